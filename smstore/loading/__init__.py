"""Batches for a training loop: collators and loaders."""
