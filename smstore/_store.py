"""Reading blobs: smstore.open() and the Store class (implemented in C++)."""

from __future__ import annotations

import os

from smstore import _core
from smstore._core import Store

__all__ = ["Store", "open", "read_checksum"]


def open(path: str | os.PathLike[str], *, verify: bool = False) -> Store:
    """Map a blob read-only and validate its structure (header and offsets index).

    Args:
        path: The ``.smst`` file.
        verify: Also check the checksum over the whole file (reads every byte).

    Raises:
        StoreNotFoundError: The file does not exist.
        StoreFormatError: The file is foreign, malformed, truncated, or fails ``verify``.
    """
    store = Store(path)
    if verify:
        store.verify()
    return store


def read_checksum(path: str | os.PathLike[str]) -> str | None:
    """The checksum recorded in a blob's header (one small read, nothing validated), or None if it is no blob.

    Raises:
        OSError: The file cannot be read.
    """
    return _core.peek_checksum(os.fspath(path))
