"""Reading blobs: smstore.open() and the Store class."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from functools import cached_property
from typing import Any

from smstore import _core
from smstore.errors import StoreFormatError

__all__ = ["Store", "open"]


class Store(_core.Store):
    """A read-only, memory-mapped smstore blob.

    ``store[i]`` is a zero-copy, read-only ``memoryview`` of record ``i`` (negative indices count
    from the end). Every view keeps the mapping alive, so views stay valid after ``close()``.

    Args:
        path: The ``.smst`` file to map. Its header and offsets index are validated on open.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(os.fspath(path))

    @cached_property
    def metadata(self) -> dict[str, Any]:
        """The blob's metadata block: encoding, source, created, and user metadata."""
        try:
            meta = json.loads(self.metadata_bytes)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            msg = f"{self.path}: corrupt metadata block ({e}); run 'smstore verify {self.path}'"
            raise StoreFormatError(msg) from None
        if not isinstance(meta, dict):
            msg = f"{self.path}: corrupt metadata block (not a JSON object)"
            raise StoreFormatError(msg)
        return meta

    @property
    def encoding(self) -> str:
        """How records are encoded: ``lines``, ``jsonl``, ``bytes`` or ``npy:<dtype>``."""
        return str(self.metadata.get("encoding", "bytes"))

    def __iter__(self) -> Iterator[memoryview]:
        for i in range(len(self)):
            yield self[i]

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "<smstore.Store (closed)>"
        return f"<smstore.Store {self.path!r}: {len(self)} records, {self.nbytes} bytes>"


def open(path: str | os.PathLike[str], *, verify: bool = False) -> Store:  # noqa: A001
    """Map a blob read-only and validate its structure.

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
