"""Reading blobs: smstore.open() and the Store class (implemented in C++)."""

from __future__ import annotations

import os

from smstore import _core
from smstore._core import Store
from smstore._objects import OBJECT_ENCODINGS, ObjectStore
from smstore._shards import ShardedStore, is_manifest, open_sharded
from smstore.errors import StoreFormatError

__all__ = ["ShardedStore", "Store", "open", "read_checksum"]


def open(path: str | os.PathLike[str], *, verify: bool = False, raw: bool = False) -> Store | ShardedStore:
    """Map a blob read-only and validate its structure (header and offsets index).

    A blob of objects (see :func:`smstore.pack_objects`) opens as an :class:`ObjectStore`, whose
    items are decoded objects (unpickling a pickle record runs code from the file); with ``raw``,
    or through ``smstore.Store(path)``, its records are raw bytes. A sharded dataset (a manifest,
    or a directory holding ``manifest.json``) opens as a :class:`ShardedStore` (a
    ``ShardedObjectStore`` for objects, unless ``raw``), one global index over its shards.
    Opening, ``len``, ``metadata``, ``verify`` and ``repr`` never decode a record.

    Args:
        path: The ``.smst`` file, or a sharded dataset.
        verify: Also check the checksum over the whole file (reads every byte; every shard).
        raw: Give every record as a read-only memoryview of its bytes, never decoded: what a
            program that only inspects a file it does not trust should use.

    Raises:
        StoreNotFoundError: The file does not exist.
        StoreFormatError: The file is foreign, malformed, truncated, or fails ``verify``.
    """
    if is_manifest(path):
        sharded = open_sharded(path, raw=raw)
        if verify:
            sharded.verify()
        return sharded
    store = Store(path)
    try:
        objects = store.encoding in OBJECT_ENCODINGS and not raw
    except StoreFormatError:
        objects = False  # a corrupt metadata block is reported where the metadata is read
    if objects:
        store.close()
        store = ObjectStore(path)  # validated again: cheap next to decoding, and no race with a swap
    if verify:
        store.verify()
    return store


def read_checksum(path: str | os.PathLike[str]) -> str | None:
    """The checksum recorded in a blob's header (one small read, nothing validated), or None if it is no blob.

    Raises:
        OSError: The file cannot be read.
    """
    return _core.peek_checksum(os.fspath(path))
