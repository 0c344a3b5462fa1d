"""Drop-ins for training frameworks; each module imports its framework, and ``import smstore`` imports none of them."""
