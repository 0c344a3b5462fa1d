"""Sharded datasets: several blobs under one global index, listed in a small JSON manifest.

A sharded dataset is a directory holding ``manifest.json`` and its shards (or a manifest anywhere
that names shards anywhere, built by :func:`join`). The manifest records, for each shard, its
path, record count, sizes and checksum; docs/format.md has the format. Record ``i`` of the dataset
is record ``i - starts[k]`` of the shard ``k`` whose range holds it.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import re
import secrets
import stat
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from smstore import _core
from smstore._objects import OBJECT_ENCODINGS, DecodedItems, object_decoder
from smstore._pack import Transaction, build_metadata, check_output, dataset_output, item_size, publish_file
from smstore.errors import (
    PackInputError,
    StoreChangedError,
    StoreFormatError,
    StoreIOError,
    StoreNotFoundError,
    StoreVersionError,
)

__all__ = [
    "MANIFEST_NAME",
    "Manifest",
    "ShardInfo",
    "ShardedObjectStore",
    "ShardedStore",
    "ShardedWriter",
    "dataset_dir",
    "describe_shard",
    "is_manifest",
    "join",
    "publish_manifest",
    "read_manifest",
    "write_manifest",
]

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "smstore-manifest"
MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 256 << 20  # ~1.5M shards: a larger file is not a manifest we wrote

BLOB_MAGIC = b"\x89SMST\r\n\x1a"
_HEADER = struct.Struct("<8sIIQQQQQQQQQIIQ")  # docs/format.md, "Header"
_HEX16 = re.compile(r"[0-9a-f]{16}\Z")


@dataclass(frozen=True)
class ShardInfo:
    """One shard as the manifest lists it.

    Attributes:
        path: As written in the manifest: relative to the manifest's directory, or absolute.
        records: Its record count.
        data_bytes: The bytes of its records.
        file_size: The size of the blob file.
        checksum: Its XXH64 checksum (16 hex digits), as in its header.
    """

    path: str
    records: int
    data_bytes: int
    file_size: int
    checksum: str

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "records": self.records,
            "data_bytes": self.data_bytes,
            "file_size": self.file_size,
            "checksum": self.checksum,
        }


@dataclass(frozen=True)
class Manifest:
    """A parsed, validated manifest (see :func:`read_manifest`)."""

    path: str  # the manifest file
    encoding: str
    shards: tuple[ShardInfo, ...]
    meta: dict[str, Any]  # created, source, smstore_version, user

    @property
    def directory(self) -> str:
        return os.path.dirname(os.path.abspath(self.path))

    def shard_path(self, k: int) -> str:
        """The absolute path of shard ``k``."""
        return os.path.join(self.directory, self.shards[k].path)

    @property
    def records(self) -> int:
        return sum(s.records for s in self.shards)

    @property
    def data_bytes(self) -> int:
        return sum(s.data_bytes for s in self.shards)

    @property
    def starts(self) -> list[int]:
        return [0, *itertools.accumulate(s.records for s in self.shards)]

    @property
    def checksum(self) -> str:
        """The dataset's identity: a hash of its encoding and its shards' checksums, in order.

        Paths are left out, so a dataset moved or copied elsewhere keeps its checksum.
        """
        h = hashlib.blake2b(digest_size=8)
        h.update(self.encoding.encode())
        for s in self.shards:
            h.update(f"\n{s.records} {s.checksum}".encode())
        return h.hexdigest()


def manifest_file(path: str | os.PathLike[str]) -> str:
    """The manifest of `path`: the file itself, or ``manifest.json`` inside a directory."""
    p = os.fspath(path)
    return os.path.join(p, MANIFEST_NAME) if os.path.isdir(p) else p


def is_manifest(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a sharded dataset (a manifest, or a directory holding one); no validation."""
    p = manifest_file(path)
    if p != os.fspath(path):
        return os.path.isfile(p)  # a directory with a manifest.json: read_manifest says what is wrong with it
    try:
        # O_NONBLOCK: opening a FIFO to look at it must not wait for a writer.
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        head = os.pread(fd, 4096, 0)
    except OSError:
        return False
    finally:
        os.close(fd)
    return not head.startswith(BLOB_MAGIC) and head.lstrip()[:1] == b"{" and MANIFEST_FORMAT.encode() in head


def _bad(path: str, what: str) -> StoreFormatError:
    return StoreFormatError(f"{path}: not a valid smstore manifest: {what}")


# Every count and size in smstore is a signed 64-bit integer somewhere (off_t, Py_ssize_t, int64
# offsets): a manifest's integers, and their sums, must stay below this.
_INT_LIMIT = 1 << 63


def _int_field(path: str, where: str, entry: dict[str, Any], key: str, minimum: int = 0) -> int:
    value = entry.get(key)
    name = f"{where}.{key}" if where else key
    if type(value) is not int or not minimum <= value < _INT_LIMIT:
        raise _bad(path, f"{name} must be an integer >= {minimum} and < 2**63, not {value!r}")
    return value


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Read and validate a manifest (or the ``manifest.json`` of a dataset directory).

    Raises:
        StoreNotFoundError: It does not exist.
        StoreFormatError: It is not a well-formed manifest; the message names the field.
        StoreVersionError: It was written by a newer smstore.
    """
    p = manifest_file(path)
    try:
        with open(p, "rb") as f:
            # Sized by the file: read(MAX + 1) would allocate the whole limit for every manifest.
            raw = f.read(min(os.fstat(f.fileno()).st_size, MAX_MANIFEST_BYTES) + 1)
    except FileNotFoundError:
        raise StoreNotFoundError(2, f"{p}: no such manifest") from None
    except OSError as e:
        raise StoreIOError(e.errno or 5, f"{p}: cannot read the manifest: {e.strerror}") from None
    if len(raw) > MAX_MANIFEST_BYTES:
        raise _bad(p, f"larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise _bad(p, f"invalid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        raise _bad(p, f'no "format": "{MANIFEST_FORMAT}" key')
    version = doc.get("version")
    if type(version) is not int or version < 1:
        raise _bad(p, f"version must be a positive integer, not {version!r}")
    if version > MANIFEST_VERSION:
        msg = f"{p}: manifest version {version} is newer than this smstore reads ({MANIFEST_VERSION}); upgrade smstore"
        raise StoreVersionError(msg)
    encoding = doc.get("encoding")
    if not isinstance(encoding, str) or not encoding:
        raise _bad(p, f"encoding must be a non-empty string, not {encoding!r}")
    entries = doc.get("shards")
    if not isinstance(entries, list):
        raise _bad(p, "shards must be a list")
    shards = []
    for k, entry in enumerate(entries):
        where = f"shards[{k}]"
        if not isinstance(entry, dict):
            raise _bad(p, f"{where} must be an object")
        spath = entry.get("path")
        if not isinstance(spath, str) or not spath or "\0" in spath:
            raise _bad(p, f"{where}.path must be a non-empty path, not {spath!r}")
        checksum = entry.get("checksum")
        if not isinstance(checksum, str) or not _HEX16.match(checksum):
            raise _bad(p, f"{where}.checksum must be 16 lowercase hex digits, not {checksum!r}")
        shards.append(
            ShardInfo(
                spath,
                _int_field(p, where, entry, "records"),
                _int_field(p, where, entry, "data_bytes"),
                _int_field(p, where, entry, "file_size", 4096),
                checksum,
            )
        )
    manifest = Manifest(p, encoding, tuple(shards), {k: v for k, v in doc.items() if k != "shards"})
    for key in ("records", "data_bytes", "file_size"):
        total = sum(getattr(s, key) for s in shards)
        if total >= _INT_LIMIT:
            raise _bad(p, f"the shards' {key} add up to {total}, more than 2**63 - 1")
        if key != "file_size" and _int_field(p, "", doc, key) != total:
            raise _bad(p, f"{key} is {doc.get(key)!r}, but its shards add up to {total}")
    return manifest


def write_manifest(
    path: str | os.PathLike[str],
    encoding: str,
    shards: Sequence[ShardInfo],
    *,
    source: Sequence[str] = (),
    user: dict[str, Any] | None = None,
    durable: bool = True,
) -> Manifest:
    """Write a manifest atomically (a temporary file renamed over `path`); returns it, parsed back.

    Shard paths are stored as given (callers pass them relative to the manifest's directory where
    they lie inside it, absolute otherwise).
    """
    p = os.fspath(path)
    doc: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "encoding": encoding,
        "records": sum(s.records for s in shards),
        "data_bytes": sum(s.data_bytes for s in shards),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "smstore_version": _core.__version__,
        "source": list(source),
    }
    if user:
        doc["user"] = user
    doc["shards"] = [s.to_json() for s in shards]
    try:
        text = json.dumps(doc, ensure_ascii=False, indent=1)
    except (TypeError, ValueError) as e:
        msg = f"metadata must be JSON-serializable: {e}"
        raise TypeError(msg) from None
    publish_file(p, [(text + "\n").encode()], what="the manifest", durable=durable)
    return read_manifest(p)


def describe_shard(path: str | os.PathLike[str], *, stored_path: str | None = None) -> tuple[ShardInfo, str]:
    """(ShardInfo, encoding) of a blob from its header and metadata block: two small reads, O(1).

    The structure is validated in full when the shard is opened; this checks what the manifest
    records: the magic, the sizes, and that the file is as long as its header says.

    Raises:
        StoreNotFoundError, StoreFormatError: Not a readable blob.
    """
    p = os.fspath(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not block us
        with open(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise StoreIOError(22, f"{p}: not a regular file; a shard is an .smst blob")
            head = f.read(_HEADER.size)
            size = st.st_size
            fields = _HEADER.unpack(head) if len(head) == _HEADER.size else None
            if fields is None or fields[0] != BLOB_MAGIC:
                raise StoreFormatError(f"{p}: not an smstore blob (no magic bytes)")
            (
                _,
                version,
                _,
                _,
                file_size,
                records,
                _,
                data_size,
                _,
                _,
                meta_off,
                meta_size,
                _,
                _,
                checksum,
            ) = fields
            if version != 1:
                raise StoreVersionError(f"{p}: blob format version {version}; this smstore reads version 1")
            if file_size != size:
                raise StoreFormatError(f"{p}: the header says {file_size} bytes, the file has {size}")
            if meta_size > 1 << 30 or meta_off + meta_size > size:
                raise StoreFormatError(f"{p}: the metadata block lies outside the file")
            f.seek(meta_off)
            meta_raw = f.read(meta_size)
    except FileNotFoundError:
        raise StoreNotFoundError(2, f"{p}: no such shard") from None
    except IsADirectoryError:
        raise StoreIOError(21, f"{p}: is a directory, not a shard") from None
    try:
        meta = json.loads(meta_raw)
        encoding = str(meta.get("encoding", "bytes")) if isinstance(meta, dict) else None
    except ValueError:
        encoding = None
    if encoding is None:
        raise StoreFormatError(f"{p}: corrupt metadata block (not a JSON object); run 'smstore verify' on it")
    info = ShardInfo(stored_path or p, records, data_size, size, f"{checksum:016x}")
    return info, encoding


# ----------------------------------------------------------------------------- reading


ShardOpener = Callable[[str, ShardInfo], _core.Store]


def _map_shard(path: str, _info: ShardInfo) -> _core.Store:
    return _core.Store(path)


class ShardedStore(_core.ShardedStore):
    """The records of a sharded dataset under one global index (``smstore.open()`` returns one).

    ``store[i]``, ``get_batch`` and ``gather`` work as on a ``Store``; shards are opened (mapped,
    or attached through the daemon) on first use, each checked against the checksum and record
    count the manifest records, so opening a dataset of thousands of shards is fast.

    Args:
        path: The manifest, or a directory holding ``manifest.json``.
        opener: ``opener(path, shard_info) -> Store`` opens one shard (default: a file mapping).
        check_files: Check up front that every shard exists with the size the manifest records
            (one ``stat`` each). Off when shards are served by the daemon.
        keep_alive: Objects that live as long as the store (the daemon connection its shards are
            attached through, what attaches held shards before they are read).

    Raises:
        StoreNotFoundError: The manifest, or (with ``check_files``) a shard, is missing.
        StoreChangedError: A shard's size or checksum differs from the manifest's record of it:
            it was re-packed, or belongs to another dataset.
        StoreFormatError: The manifest is malformed.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        opener: ShardOpener | None = None,
        check_files: bool = True,
        manifest: Manifest | None = None,
        keep_alive: Sequence[object] = (),
    ) -> None:
        self.manifest = manifest if manifest is not None else read_manifest(path)
        self.keep_alive = tuple(keep_alive)
        self._opener = opener or _map_shard
        if check_files:
            self.check_files()
        super().__init__(self.manifest.starts, self._open_shard, self.manifest.path)
        # Shards no read has touched for a while are unmapped (and open again when read): a
        # windowed or sequential order keeps only the shards it is reading mapped in each process.
        self.auto_release = True

    def check_files(self) -> None:
        """Check that every shard exists with the size the manifest records (one stat each)."""
        m = self.manifest
        for k, shard in enumerate(m.shards):
            spath = m.shard_path(k)
            try:
                size = os.stat(spath).st_size
            except FileNotFoundError:
                raise StoreNotFoundError(2, f"{m.path}: shard {k} ({spath}) is missing") from None
            except OSError as e:
                raise StoreIOError(e.errno or 5, f"{m.path}: shard {k} ({spath}): {e.strerror}") from None
            if size != shard.file_size:
                raise self._changed(k, f"is {size} bytes, the manifest records {shard.file_size}")

    def _changed(self, k: int, what: str) -> StoreChangedError:
        return StoreChangedError(
            f"{self.manifest.path}: shard {k} ({self.manifest.shard_path(k)}) {what}: it was re-packed or "
            "belongs to another dataset; rebuild the manifest with 'smstore join'"
        )

    def _open_shard(self, k: int) -> _core.Store:
        m = self.manifest
        shard = m.shards[k]
        spath = m.shard_path(k)
        try:
            store = self._opener(spath, shard)
        except StoreNotFoundError:
            raise StoreNotFoundError(2, f"{m.path}: shard {k} ({spath}) is missing") from None
        if store.checksum != shard.checksum:
            held = store.checksum
            store.close()
            raise self._changed(k, f"holds checksum {held}, the manifest records {shard.checksum}")
        return store

    @property
    def path(self) -> str:
        """The manifest file."""
        return self.manifest.path

    @property
    def checksum(self) -> str:
        """The dataset's identity (see :attr:`Manifest.checksum`)."""
        return self.manifest.checksum

    @property
    def encoding(self) -> str:
        return self.manifest.encoding

    @property
    def metadata(self) -> dict[str, Any]:
        """The manifest's metadata (a fresh dict): encoding, created, source, user, shard count."""
        meta = json.loads(json.dumps(self.manifest.meta))
        meta["shards"] = len(self.manifest.shards)
        return dict(meta)

    @property
    def nbytes(self) -> int:
        return self.manifest.data_bytes

    @property
    def shard_sizes(self) -> list[int]:
        """Record counts of the shards, in order."""
        return [s.records for s in self.manifest.shards]

    @property
    def shard_paths(self) -> list[str]:
        return [self.manifest.shard_path(k) for k in range(len(self.manifest.shards))]

    def verify(self) -> None:
        """Check every shard's checksum over every byte, and that each is the shard the manifest names.

        Raises:
            ChecksumMismatchError: A shard's bytes do not match its own checksum.
            StoreChangedError: A shard is not the one the manifest records.
        """
        for k in range(self.shard_count):
            self.shard(k).verify()

    def __repr__(self) -> str:
        if self.closed:
            return "<smstore.ShardedStore (closed)>"
        return (
            f"<smstore.ShardedStore {self.path!r}: {len(self)} records in {self.shard_count} shards, "
            f"{self.nbytes} bytes>"
        )


class ShardedObjectStore(DecodedItems, ShardedStore):
    """A :class:`ShardedStore` of object records (see :func:`smstore.pack_objects`): items are decoded."""

    _raw = _core.ShardedStore

    def __init__(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        ShardedStore.__init__(self, path, **kwargs)
        decoder = object_decoder(self.encoding)
        if decoder is None:
            msg = f"{self.path}: records are encoded as {self.encoding!r}, not as objects"
            raise StoreFormatError(msg)
        self._decode = decoder


def open_sharded(
    path: str | os.PathLike[str],
    *,
    opener: ShardOpener | None = None,
    check_files: bool = True,
    raw: bool = False,
    keep_alive: Sequence[object] = (),
) -> ShardedStore:
    """A ShardedStore, or (unless `raw`) a ShardedObjectStore for a dataset of object records."""
    manifest = read_manifest(path)
    objects = manifest.encoding in OBJECT_ENCODINGS and not raw
    cls = ShardedObjectStore if objects else ShardedStore
    return cls(path, opener=opener, check_files=check_files, manifest=manifest, keep_alive=keep_alive)


# ----------------------------------------------------------------------------- writing


def _stored_path(shard: str, manifest_dir: str) -> str:
    """How a manifest in `manifest_dir` names `shard`: relative when inside that directory."""
    a = os.path.abspath(shard)
    rel = os.path.relpath(a, manifest_dir)
    return a if rel == ".." or rel.startswith("../") else rel


def publish_manifest(
    manifest_path: str,
    encoding: str,
    shards: Sequence[ShardInfo],
    *,
    source: Sequence[str],
    user: dict[str, Any] | None,
    durable: bool,
    remove_replaced: bool = True,
) -> Manifest:
    """Write the manifest; then, if `remove_replaced`, remove the shards of the manifest it replaced
    that :func:`_our_old_shard` proves a dataset writer wrote for it and the new one does not list.

    Dataset writers (pack -j, ShardedWriter, the Ray sink) remove; join never does. Readers that
    mapped a removed shard keep their mappings.
    """
    old: Manifest | None = None
    if remove_replaced and os.path.isfile(manifest_path) and is_manifest(manifest_path):
        try:
            old = read_manifest(manifest_path)
        except (StoreFormatError, StoreIOError):
            old = None  # nothing it lists can be trusted to be ours: remove nothing
    manifest = write_manifest(manifest_path, encoding, shards, source=source, user=user, durable=durable)
    if old is not None:
        keep = {s.path for s in manifest.shards}
        for shard in old.shards:
            if shard.path not in keep and _our_old_shard(old.directory, shard):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(old.directory, shard.path))
    return manifest


def _our_old_shard(directory: str, shard: ShardInfo) -> bool:
    """Whether `shard`, listed by the manifest in `directory` being replaced, is provably a shard a
    dataset writer wrote for it: named as :class:`ShardNames` names shards (so it lies in the
    directory and is not the manifest), a regular file (not a symbolic link) whose header records
    the size and checksum that manifest records. A stale or hostile manifest names nothing else
    that a re-pack would remove (docs/format.md, "What publishing removes")."""
    if not ShardNames.pattern.match(shard.path):
        return False
    try:
        fd = os.open(
            os.path.join(directory, shard.path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        )
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        head = os.pread(fd, _HEADER.size, 0) if stat.S_ISREG(st.st_mode) else b""
    except OSError:
        return False
    finally:
        os.close(fd)
    if len(head) != _HEADER.size:
        return False
    fields = _HEADER.unpack(head)
    magic, file_size, checksum = fields[0], fields[4], fields[14]
    return (
        magic == BLOB_MAGIC
        and file_size == st.st_size == shard.file_size
        and f"{checksum:016x}" == shard.checksum
    )


def dataset_dir(output: str | os.PathLike[str]) -> str:
    """The directory of a sharded output, created if missing (:func:`smstore._pack.check_output`)."""
    d = os.fspath(output)
    check_output(d, directory=True)
    try:
        os.makedirs(d, exist_ok=True)
    except OSError as e:
        raise StoreIOError(e.errno or 5, f"{d}: cannot create the dataset directory: {e.strerror}") from None
    return d


class ShardedWriter(Transaction):
    """Streams records into a sharded dataset: a directory of shards and ``manifest.json``.

    A new shard starts once the current one holds ``shard_size`` bytes of records or
    ``shard_records`` records: every call is split where that happens (each record's size is known
    before it is written), so no shard holds more than ``shard_size`` plus one record. The
    manifest is written last and atomically; until then, a reader of the directory sees the
    previous dataset, whole (shard names are unique to each writer, so no shard of the previous
    dataset is overwritten). On an exception inside the ``with`` block, the shards written so far
    are removed.

    Args:
        output: The dataset directory.
        encoding, metadata, source, durable: As for :class:`smstore.Writer`.
        shard_size: Bytes of records per shard (default 1 GiB).
        shard_records: Records per shard, if given.
        check_every: The most records :meth:`extend` hands the writer in one call.
    """

    # The most bytes of records extend() holds before handing them to the writer.
    _BATCH_BYTES = 16 << 20

    def __init__(
        self,
        output: str | os.PathLike[str],
        *,
        encoding: str = "bytes",
        metadata: dict[str, Any] | None = None,
        source: Sequence[str] = (),
        shard_size: int | None = None,
        shard_records: int | None = None,
        durable: bool = True,
        check_every: int = 1024,
    ) -> None:
        if shard_size is not None and shard_size <= 0:
            msg = f"shard_size must be positive, not {shard_size}"
            raise ValueError(msg)
        if shard_records is not None and shard_records <= 0:
            msg = f"shard_records must be positive, not {shard_records}"
            raise ValueError(msg)
        self.directory = dataset_dir(output)
        self.encoding = encoding
        self._user = metadata
        self._source = list(source)
        self._meta = build_metadata(encoding, source=self._source, user=metadata)
        self._item_size = item_size(encoding, self.directory)
        self._durable = durable
        self._shard_size = (
            shard_size if shard_size is not None else (1 << 30) if shard_records is None else None
        )
        self._shard_records = shard_records
        self._check_every = max(1, min(check_every, shard_records or check_every))
        self._names = ShardNames(self.directory)
        self._done: list[ShardInfo] = []
        self._written: list[str] = []
        self._writer: _core.Writer | None = None
        self.record_count = 0
        self.manifest: Manifest | None = None

    def _current(self) -> _core.Writer:
        if self._writer is None:
            path = self._names.next()
            self._writer = _core.Writer(path, self._durable, self._item_size)
            self._written.append(path)
        return self._writer

    def _full(self, w: _core.Writer) -> bool:
        if self._shard_records is not None and w.record_count >= self._shard_records:
            return True
        return self._shard_size is not None and w.data_size >= self._shard_size

    def _close_shard(self) -> None:
        w = self._writer
        if w is None:
            return
        self._writer = None
        w.finish(self._meta)
        info, _ = describe_shard(w.path, stored_path=os.path.basename(w.path))
        self._done.append(info)

    def append(self, record: Any) -> None:
        w = self._current()
        w.append(record)
        self.record_count += 1
        if self._full(w):
            self._close_shard()

    def extend(self, records: Iterable[Any]) -> int:
        """Append every record; returns how many. A shard ends at the record that fills it."""
        it = iter(records)
        n = 0
        while True:
            w = self._current()
            most = self._check_every
            if self._shard_records is not None:
                most = min(most, self._shard_records - w.record_count)
            room = self._BATCH_BYTES
            if self._shard_size is not None:
                room = min(room, self._shard_size - w.data_size)
            batch: list[Any] = []
            size = 0
            more = False
            measure = self._record_size
            for record in it:
                batch.append(record)
                size += len(record) if type(record) is bytes else measure(record)
                if size >= room or len(batch) >= most:
                    more = True
                    break
            got = w.extend(batch)
            n += got
            self.record_count += got
            if self._full(w):
                self._close_shard()
            if not more:
                return n

    @staticmethod
    def _record_size(record: Any) -> int:
        """The bytes the writer will store for `record` (0 for what it will refuse, naming why)."""
        if isinstance(record, bytes | bytearray):
            return len(record)
        try:
            if isinstance(record, str):
                return len(record) if record.isascii() else len(record.encode())
            return memoryview(record).nbytes
        except (TypeError, UnicodeEncodeError):
            return 0

    def extend_offsets(self, data: Any, offsets: Any) -> int:
        """Append records ``data[offsets[i]:offsets[i+1]]`` (Arrow's layout), split where a shard fills.

        The split points are found on the offsets with numpy, never record by record.
        """
        import numpy as np

        o = np.asarray(offsets)
        count = len(o) - 1 if o.ndim == 1 else 0
        w = self._current()
        split = o.dtype.kind in "iu" and count > 0
        if split:
            records_left = None if self._shard_records is None else self._shard_records - w.record_count
            bytes_left = None if self._shard_size is None else self._shard_size - w.data_size
            span = int(o[-1]) - int(o[0])
            split = (records_left is not None and count > records_left) or (
                bytes_left is not None and span >= bytes_left
            )
        if not split:  # one call (it also says what is wrong with offsets that are not offsets)
            n = w.extend_offsets(data, offsets)
            self.record_count += n
            if self._full(w):
                self._close_shard()
            return n
        try:
            size = memoryview(data).nbytes
        except TypeError:
            size = None
        at = o.astype(np.int64)
        bad = (at[1:] < at[:-1]) | (at[:-1] < 0)
        if size is not None:
            bad |= at[1:] > size
        if bool(bad.any()):
            # The writer checks these too, but on each piece, and would name a place in the piece.
            i = int(np.argmax(bad))
            msg = f"{w.path}: offsets[{i}:{i + 2}] do not lie within the data buffer in order"
            raise PackInputError(msg)
        done = 0
        while done < count:
            w = self._current()
            take = count - done
            if self._shard_records is not None:
                take = min(take, self._shard_records - w.record_count)
            if self._shard_size is not None:
                # The records that start before the shard holds shard_size bytes.
                full_at = int(at[done]) + self._shard_size - w.data_size
                take = max(1, min(take, int(np.searchsorted(at[:-1], full_at, "left")) - done))
            got = w.extend_offsets(data, o[done : done + take + 1])
            done += got
            self.record_count += got
            if self._full(w):
                self._close_shard()
        return count

    def close(self) -> Manifest:
        """Finish the last shard and publish the manifest (idempotent); returns the manifest."""
        if self.manifest is None:
            if self._writer is not None and (self._writer.record_count or not self._done):
                self._close_shard()
            elif self._writer is not None:
                self._writer.abort()  # an empty trailing shard
                self._written.pop()
                self._writer = None
            path = os.path.join(self.directory, MANIFEST_NAME)
            self.manifest = publish_manifest(
                path, self.encoding, self._done, source=self._source, user=self._user, durable=self._durable
            )
        return self.manifest

    def abort(self) -> None:
        """Discard every shard written; the directory's previous dataset is left as it was."""
        if self.manifest is not None:
            return
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
        for path in self._written:
            with contextlib.suppress(OSError):
                os.unlink(path)
        self._written.clear()


class ShardNames:
    """Shard file names unique to one writer: ``part-<8 hex>-<5 digits>.smst`` in a directory."""

    pattern = re.compile(r"part-[0-9a-f]{8}-[0-9]{5,}\.smst\Z")  # every name() matches

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.run = secrets.token_hex(4)
        self._k = 0

    def name(self, k: int) -> str:
        return os.path.join(self.directory, f"part-{self.run}-{k:05d}.smst")

    def next(self) -> str:
        path = self.name(self._k)
        self._k += 1
        return path


def join(
    inputs: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    metadata: dict[str, Any] | None = None,
    verify: bool = False,
    durable: bool = True,
) -> Manifest:
    """Build a manifest over existing shards, in order, copying no record.

    Args:
        inputs: Blobs, manifests or dataset directories (whose shards are taken in their order).
        output: The manifest file to write (atomically), or a dataset directory (an existing
            directory or a path ending with ``/``: its ``manifest.json``). Shards inside its
            directory are named relative to it, others by absolute path. No file is removed,
            not even the shards of a manifest it replaces.
        metadata: Your own JSON-serializable metadata, stored under ``"user"``.
        verify: Also check each shard's checksum over every byte.

    Raises:
        PackInputError: No inputs, or shards of different encodings.
        StoreFormatError, StoreNotFoundError: An input is not a readable blob or manifest.
    """
    if not inputs:
        msg = "join needs at least one shard"
        raise PackInputError(msg)
    out = os.path.join(dataset_dir(output), MANIFEST_NAME) if dataset_output(output) else os.fspath(output)
    check_output(out)  # before reading any shard
    out_dir = os.path.dirname(os.path.abspath(out))
    shards: list[ShardInfo] = []
    encoding: str | None = None
    first: str = ""
    sources: list[str] = []
    for item in inputs:
        for spath in _shard_files(item):
            info, enc = describe_shard(spath, stored_path=_stored_path(spath, out_dir))
            if encoding is None:
                encoding, first = enc, spath
            elif enc != encoding:
                msg = f"{spath}: records are encoded as {enc!r}, but {first} holds {encoding!r}; join shards of one encoding"
                raise PackInputError(msg)
            if verify:
                with _core.Store(spath) as s:
                    s.verify()
            shards.append(info)
            sources.append(os.path.abspath(spath))
    assert encoding is not None
    return publish_manifest(
        out, encoding, shards, source=sources, user=metadata, durable=durable, remove_replaced=False
    )


def _shard_files(item: str | os.PathLike[str]) -> Iterator[str]:
    p = os.fspath(item)
    if is_manifest(p):
        m = read_manifest(p)
        for k in range(len(m.shards)):
            yield m.shard_path(k)
    else:
        yield p
