"""Writing blobs and sharded datasets."""
