"""Object records: the pickle and JSON encodings, pack_objects() and ObjectStore (no numpy, no torch)."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from smstore import _core
from smstore.errors import PackInputError, StoreFormatError
from smstore.format.samples import decode_sample, encode_sample
from smstore.write.pack import Writer

__all__ = [
    "OBJECT_ENCODINGS",
    "PICKLE_PROTOCOL",
    "ContentHash",
    "ObjectStore",
    "encode_objects",
    "object_decoder",
    "pack_objects",
]

# Protocol 5 (Python 3.8+) frames large bytes and buffers without extra copies on load.
PICKLE_PROTOCOL = 5


def _dump_pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=PICKLE_PROTOCOL)


def _dump_json(obj: Any) -> bytes:
    # Standard JSON only (no NaN/Infinity), so any JSON reader can read the records.
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _load_json(view: memoryview) -> Any:
    return json.loads(view.tobytes())


# encoding -> (encode one object, decode one record). "pickle" rebuilds any picklable object but
# runs code while loading; "json" only builds dicts, lists, str, numbers, bools and None.
# "wds" holds one WebDataset sample, {extension: bytes} (smstore/format/samples.py).
_CODECS: dict[str, tuple[Callable[[Any], bytes], Callable[[memoryview], Any]]] = {
    "pickle": (_dump_pickle, pickle.loads),
    "json": (_dump_json, _load_json),
    "wds": (encode_sample, decode_sample),
}
OBJECT_ENCODINGS = tuple(_CODECS)


def object_decoder(encoding: str) -> Callable[[memoryview], Any] | None:
    """The function that turns a record of ``encoding`` into a fresh object; None if not an object encoding."""
    codec = _CODECS.get(encoding)
    return codec[1] if codec else None


def _type_name(obj: Any) -> str:
    t = type(obj)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def encode_objects(objects: Iterable[Any], encoding: str) -> Iterator[bytes]:
    """Encode objects one at a time (only one object's bytes exist at once).

    Raises:
        ValueError: ``encoding`` is not an object encoding (at the call, before any object is read).
        PackInputError: An object cannot be encoded (while iterating); the message names its index
            and type.
    """
    codec = _CODECS.get(encoding)
    if codec is None:
        msg = f"encoding must be one of {', '.join(map(repr, OBJECT_ENCODINGS))}, not {encoding!r}"
        raise ValueError(msg)
    return _encoded(objects, encoding, codec[0])


def _encoded(objects: Iterable[Any], encoding: str, dump: Callable[[Any], bytes]) -> Iterator[bytes]:
    for i, obj in enumerate(objects):
        try:
            data = dump(obj)
        except Exception as e:  # pickling runs the object's own __reduce__: it may raise anything
            msg = f"object {i} ({_type_name(obj)}) cannot be encoded as {encoding}: {type(e).__name__}: {e}"
            if encoding == "json":
                msg += " (use encoding='pickle' for objects other than dict, list, str, numbers, bool, None)"
            raise PackInputError(msg) from e
        yield data


class ContentHash:
    """A hash of a sequence of records (each one's length and bytes): equal lists give equal hashes.

    The blob checksum cannot serve here: it also covers the metadata (creation time), so two ranks
    that encode the same list would never agree on it.
    """

    def __init__(self) -> None:
        self._h = hashlib.blake2b(digest_size=16)
        self.count = 0

    def update(self, record: bytes) -> None:
        self._h.update(len(record).to_bytes(8, "little"))
        self._h.update(record)
        self.count += 1

    def hexdigest(self) -> str:
        return f"blake2b-128:{self._h.hexdigest()}"


def pack_objects(
    objects: Iterable[Any],
    path: str | os.PathLike[str],
    *,
    encoding: str = "pickle",
    metadata: dict[str, Any] | None = None,
    durable: bool = True,
) -> int:
    """Pack Python objects into a blob, one record per object, streaming.

    Each object is encoded and handed to the writer before the next one is taken from
    ``objects``, so an iterator of millions of dicts never sits in memory twice. Readers
    (``smstore.open``, ``SharedStoreDataset``) decode the records back to objects by default.

    Args:
        objects: Any iterable of objects.
        path: The ``.smst`` file to write (atomically, as :class:`smstore.Writer`).
        encoding: ``"pickle"`` (protocol 5; any picklable object; loading it runs code, so only
            open pickle blobs you trust) or ``"json"`` (dicts, lists, str, numbers, bools and
            None; safe to load from anyone; tuples come back as lists).
        metadata: Your own JSON-serializable metadata, stored under ``"user"``.
        durable: fsync the file before publishing it.

    Returns:
        The number of objects written.

    Raises:
        PackInputError: An object cannot be encoded (its index and type are named); nothing is
            written at ``path``.
    """
    encoded = encode_objects(objects, encoding)  # checks `encoding` before a file is created
    with Writer(path, encoding=encoding, metadata=metadata, durable=durable) as w:
        w.extend(encoded)
        return w.record_count


class DecodedItems:
    """Items decoded on access: a mixin before a store class, which names its raw base in ``_raw``."""

    _raw: Any
    _decode: Callable[[memoryview], Any]

    def __getitem__(self, index: Any) -> Any:
        return self._decode(self._raw.__getitem__(self, index))

    def raw(self, index: int) -> memoryview:
        """Record ``index`` undecoded: a zero-copy, read-only memoryview."""
        view: memoryview = self._raw.__getitem__(self, index)
        return view

    def get_batch(self, indices: Any) -> list[Any]:
        decode = self._decode
        return [decode(r) for r in self._raw.get_batch(self, indices)]

    def __iter__(self) -> Iterator[Any]:
        n = len(self)  # type: ignore[arg-type]
        step = 1024  # a batch of views at a time: fewer calls, bounded memory
        for start in range(0, n, step):
            yield from self.get_batch(list(range(start, min(start + step, n))))


class ObjectStore(DecodedItems, _core.Store):
    """A Store of object records whose items are decoded objects, a fresh one per access.

    ``smstore.open()`` returns one for blobs written by :func:`pack_objects`. ``store[i]``,
    ``get_batch`` and iteration decode; ``raw(i)`` is the record's zero-copy memoryview, as
    ``smstore.Store(path)[i]`` is.

    Args:
        path: The ``.smst`` file (or ``fd, label, full_index`` as for ``Store``).
    """

    _raw = _core.Store

    def __init__(self, *args: Any) -> None:
        _core.Store.__init__(self, *args)
        decoder = object_decoder(self.encoding)
        if decoder is None:
            label = self.path
            encoding = self.encoding
            self.close()
            msg = (
                f"{label}: records are encoded as {encoding!r}, not as objects "
                f"({', '.join(OBJECT_ENCODINGS)}); open it with smstore.Store"
            )
            raise StoreFormatError(msg)
        self._decode = decoder

    def __repr__(self) -> str:
        if self.closed:
            return "<smstore.ObjectStore (closed)>"
        return (
            f"<smstore.ObjectStore {self.path!r}: {len(self)} {self.encoding} objects, {self.nbytes} bytes>"
        )
