"""Reading blobs: smstore.open() and the Store class (implemented in C++)."""

from __future__ import annotations

import codecs
import os
import stat

from smstore import _core
from smstore._core import Store
from smstore.errors import StoreFormatError
from smstore.format.manifest import MANIFEST_NAME, is_manifest
from smstore.format.objects import OBJECT_ENCODINGS, ObjectStore
from smstore.read.shards import ShardedStore, open_sharded

__all__ = ["ShardedStore", "Store", "explain_not_a_blob", "open", "open_blob", "read_checksum"]


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
    store = open_blob(path)
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


def open_blob(path: str | os.PathLike[str]) -> Store:
    """``Store(path)``; a directory or a file that is no blob raises saying what to give instead.

    Raises:
        StoreNotFoundError: The file does not exist.
        StoreFormatError: The file is no valid blob (see :func:`explain_not_a_blob`).
    """
    try:
        return Store(path)
    except StoreFormatError as e:
        raise explain_not_a_blob(path, e) from None


# What `smstore pack` needs to turn a file of this kind into a blob (the lines format needs nothing).
_PACK_FORMATS = {
    ".jsonl": "--format jsonl ",
    ".ndjson": "--format jsonl ",
    ".json": "--format json-list ",
    ".parquet": "--format parquet ",
    ".arrow": "--format arrow ",
    ".tar": "--format webdataset ",
}
_TEXT_SUFFIXES = {".txt", ".text", ".csv", ".tsv", ".md", ".log"}


def explain_not_a_blob(path: str | os.PathLike[str], error: StoreFormatError) -> StoreFormatError:
    """The error to raise when ``path`` failed to open as a blob with ``error``.

    A directory that holds no manifest gets what a dataset directory needs; a file that looks
    like text (or has the extension of a format ``smstore pack`` converts) gets the command that
    packs it. Any other fault is ``error`` itself.
    """
    p = os.fspath(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # never wait on a FIFO
    except OSError:
        return error
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            msg = (
                f"{p}: a directory, but not a sharded dataset: it holds no {MANIFEST_NAME}. A dataset "
                f"directory holds {MANIFEST_NAME} next to its shards, as 'smstore pack INPUTS -o {p}/ "
                f"--shard-size 1G' or 'smstore join SHARDS -o {p}/' write them; to read a single "
                "blob, give its .smst file"
            )
            return StoreFormatError(msg)
        head = os.pread(fd, 4096, 0) if stat.S_ISREG(st.st_mode) else b""
    except OSError:
        return error
    finally:
        os.close(fd)
    if not head or head.startswith(_core.BLOB_MAGIC):
        return error  # empty, or a blob with another fault: the reader said which
    name, suffix = os.path.splitext(p)
    fmt = _PACK_FORMATS.get(suffix.lower())
    if fmt is None and (suffix.lower() in _TEXT_SUFFIXES or _looks_like_text(head)):
        fmt = ""
    if fmt is None:
        return error
    what = "text" if not fmt else f"a {suffix} file"
    output = f"{name if suffix else p}.smst"
    if output == p:  # a text file named .smst: packing it over itself would destroy the input
        output = f"{name}.packed.smst"
    per_line = " (one record per line)" if not fmt else ""
    msg = f"{error}; it looks like {what}: pack it into a blob first, 'smstore pack {fmt}{p} -o {output}'{per_line}, then open {output}"
    return type(error)(msg)


def _looks_like_text(head: bytes) -> bool:
    """Whether the first bytes of a file are UTF-8 text (a multi-byte character may be cut at the end)."""
    if b"\0" in head:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return True
