"""The manifest of a sharded dataset: its format, reading and validating it, writing and publishing it.

A manifest is a small JSON file (``manifest.json`` in a dataset directory, or anywhere for a
:func:`smstore.join`) that records, for each shard, its path, record count, sizes and checksum;
docs/format.md has the format. This module knows no store: the daemon, the client and the
samplers read manifests through it without importing the readers and writers of ``_shards``.
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
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import cached_property
from typing import Any, ClassVar

from smstore import _core
from smstore.errors import StoreError, StoreFormatError, StoreIOError, StoreNotFoundError, StoreVersionError
from smstore.remote.urls import is_remote_url, needs_daemon
from smstore.wire.protocol import CHECKSUM_WORDING, is_checksum, is_utf8
from smstore.write.pack import publish_file, source_names

__all__ = [
    "MANIFEST_FORMAT",
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "MAX_MANIFEST_BYTES",
    "LocalFile",
    "Manifest",
    "RemoteObject",
    "ShardInfo",
    "ShardNames",
    "Source",
    "absolute",
    "describe_shard",
    "is_manifest",
    "manifest_file",
    "publish_manifest",
    "read_manifest",
    "source_of",
    "stored_path",
    "write_manifest",
]

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "smstore-manifest"
MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 256 << 20  # ~1.5M shards: a larger file is not a manifest we wrote


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
class Source:
    """Where a blob's bytes are, decided once (by :func:`source_of`, or when a manifest is read):
    a local file or an object in object storage. Code past that point asks the source
    (``remote``, ``header``, ``read_range``, ``require_daemon``), never the string.

    Attributes:
        location: The absolute path of the file, or the object's URL.
        size: The blob's size, where a manifest records it (else None: its header says).
        checksum: Its checksum, where a manifest records it (else None: its header says).
    """

    location: str
    size: int | None = None
    checksum: str | None = None
    remote: ClassVar[bool] = False

    def __str__(self) -> str:
        return self.location

    def header(self, *, deadline: float | None = None) -> _core.BlobHeader:
        """The blob's header, checked by the core's one header check."""
        raise NotImplementedError

    def read_range(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the blob."""
        raise NotImplementedError

    def require_daemon(self, what: str, why: str = "") -> None:
        """Raise the one "an object needs the daemon" error if this blob can only be read through it.

        Raises:
            RemoteNeedsDaemonError: An object in object storage (`what` says which: a shard, a dataset).
        """


@dataclass(frozen=True)
class LocalFile(Source):
    """A blob in a local file, read by this process."""

    def header(self, *, deadline: float | None = None) -> _core.BlobHeader:  # noqa: ARG002 (a file read waits on no store)
        fd = _open_blob(self.location, "blob")
        try:
            return _core.read_header_fd(fd, self.location)
        finally:
            os.close(fd)

    def read_range(self, start: int, end: int) -> bytes:
        fd = _open_blob(self.location, "blob")
        try:
            return os.pread(fd, end - start, start)
        except OSError as e:
            raise StoreIOError(e.errno, f"{self.location}: {e.strerror}") from None
        finally:
            os.close(fd)


@dataclass(frozen=True)
class RemoteObject(Source):
    """A blob in object storage: the daemon fetches it for readers; a command reads its header or a
    range of it with a ranged GET (the ``remote`` extra)."""

    remote: ClassVar[bool] = True

    def header(self, *, deadline: float | None = None) -> _core.BlobHeader:
        from smstore.remote.fetch import Retry, read_header

        return read_header(self.location, retry=Retry(deadline=deadline))

    def read_range(self, start: int, end: int) -> bytes:
        from smstore.remote.fetch import read_range

        data, _etag = read_range(self.location, start, end)
        return bytes(data)

    def require_daemon(self, what: str, why: str = "") -> None:
        raise needs_daemon(self.location, what, why=why)


def source_of(path: str | os.PathLike[str]) -> Source:
    """What a user's `path` names: an object (a URL, as it is) or a local file (made absolute).

    The one place a string given to smstore becomes a decision about storage.
    """
    p = os.fspath(path)
    return RemoteObject(p) if is_remote_url(p) else LocalFile(os.path.abspath(p))


def _open_blob(path: str, what: str) -> int:
    """A read-only descriptor of the file at `path` (never blocking on a FIFO)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise StoreNotFoundError(2, f"{path}: no such {what}") from None
    except OSError as e:
        raise StoreIOError(e.errno, f"{path}: {e.strerror}") from None


@dataclass(frozen=True)
class Manifest:
    """A parsed, validated manifest (see :func:`read_manifest`)."""

    path: str  # the manifest file
    encoding: str
    shards: tuple[ShardInfo, ...]
    meta: dict[str, Any]  # created, source, smstore_version, user
    remote: bool = False  # the manifest is in object storage (its relative shard paths are keys there)

    @property
    def directory(self) -> str:
        """The manifest's directory; for a manifest in object storage, its prefix (ending in ``/``)."""
        if self.remote:
            return self.path[: self.path.rindex("/") + 1]
        return os.path.dirname(os.path.abspath(self.path))

    @cached_property
    def sources(self) -> tuple[Source, ...]:
        """Each shard's source, decided once from the manifest: an object where the manifest names
        the shard by URL (``s3://...``) or is itself in object storage (a relative path is then a
        key under its prefix, checked when the manifest was read), else a local file."""
        # source_of's rule, with the directory made absolute once: an abspath per shard is a
        # getcwd() system call per shard.
        directory = self.directory
        out: list[Source] = []
        for s in self.shards:
            if is_remote_url(s.path):
                out.append(RemoteObject(s.path, s.file_size, s.checksum))
            elif self.remote:
                out.append(RemoteObject(directory + s.path, s.file_size, s.checksum))
            else:
                out.append(LocalFile(os.path.join(directory, s.path), s.file_size, s.checksum))
        return tuple(out)

    def shard_path(self, k: int) -> str:
        """The absolute path of shard ``k``, or its URL (see :attr:`sources`)."""
        return self.sources[k].location

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


def absolute(path: str) -> str:
    """`path` as every process names it: a URL as it is, a local path made absolute."""
    return source_of(path).location


def _manifest_source(path: str | os.PathLike[str]) -> Source:
    """The source of `path`'s manifest: the file itself, or ``manifest.json`` inside a directory
    (or under a URL prefix ending in ``/``)."""
    p = os.fspath(path)
    if source_of(p).remote:
        return RemoteObject(p + MANIFEST_NAME if p.endswith("/") else p)
    return LocalFile(os.path.join(p, MANIFEST_NAME) if os.path.isdir(p) else p)


def manifest_file(path: str | os.PathLike[str]) -> str:
    """The manifest of `path`: the file itself, or ``manifest.json`` inside a directory (or under a
    URL prefix ending in ``/``)."""
    return _manifest_source(path).location


def is_manifest(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a sharded dataset (a manifest, or a directory holding one); no validation.

    A URL is one by its name alone (nothing is fetched): a prefix ending in ``/`` or a ``.json`` object.
    """
    source = _manifest_source(path)
    p = source.location
    if source.remote:
        return p.endswith(".json")
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
    return (
        not head.startswith(_core.BLOB_MAGIC)
        and head.lstrip()[:1] == b"{"
        and MANIFEST_FORMAT.encode() in head
    )


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


def read_manifest(path: str | os.PathLike[str], *, deadline: float | None = None) -> Manifest:
    """Read and validate a manifest (or the ``manifest.json`` of a dataset directory).

    `path` may be a URL (``s3://bucket/ds/``, meaning ``s3://bucket/ds/manifest.json``, or the URL
    of the ``.json`` manifest): it is fetched with one GET (refused if larger than
    ``MAX_MANIFEST_BYTES``, before its body is read) and validated as a local one. Its relative
    shard paths are keys under its prefix; one with ``..``, or an absolute local path, is refused,
    and every shard URL goes through the scheme allow-list. The GET and its retries end by
    `deadline` (a ``time.monotonic()`` instant), if given.

    Raises:
        StoreNotFoundError: It does not exist (``RemoteNotFoundError`` for a URL).
        StoreFormatError: It is not a well-formed manifest; the message names the field.
        StoreVersionError: It was written by a newer smstore.
        RemoteURLError, RemoteError: A URL smstore will not fetch, or the fetch failed (or
            `deadline` passed).
    """
    source = _manifest_source(path)
    p = source.location
    if source.remote:
        return _read_remote(p, deadline)
    try:
        # O_NONBLOCK: a FIFO named as a manifest must not wait for a writer (the daemon reads
        # manifests on its event loop); anything but a regular file is refused below.
        with open(os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise _bad(p, "not a regular file")
            # Sized by the file: read(MAX + 1) would allocate the whole limit for every manifest.
            raw = f.read(min(st.st_size, MAX_MANIFEST_BYTES) + 1)
    except FileNotFoundError:
        raise StoreNotFoundError(2, f"{p}: no such manifest") from None
    except OSError as e:
        raise StoreIOError(e.errno or 5, f"{p}: cannot read the manifest: {e.strerror}") from None
    if len(raw) > MAX_MANIFEST_BYTES:
        raise _bad(p, f"larger than {MAX_MANIFEST_BYTES} bytes")
    return _parse(p, raw)


def hold_fields(manifest: Manifest) -> dict[str, str]:
    """How a hold (``hold``) names `manifest`'s dataset: its absolute path or URL,
    and for a dataset in object storage the checksum of the manifest this reader read (the daemon's
    copy of the manifest must be that one)."""
    fields = {"manifest": absolute(manifest.path)}
    if manifest.remote:
        fields["dataset"] = manifest.checksum
    return fields


def _read_remote(url: str, deadline: float | None) -> Manifest:
    """The manifest at `url`, fetched (one GET) and validated, its shards checked as keys or URLs."""
    from smstore.remote.fetch import Retry, read_object
    from smstore.remote.urls import parse_url

    u = parse_url(url)  # the allow-list, before anything is fetched
    raw = read_object(u, max_bytes=MAX_MANIFEST_BYTES, what="the manifest", retry=Retry(deadline=deadline))
    manifest = _parse(str(u), raw, remote=True)
    for k, shard in enumerate(manifest.shards):
        where = f"shards[{k}].path {shard.path!r}"  # not a URL: no credentials to hide in it
        if manifest.sources[k].location != shard.path:  # not named by URL: a key under the prefix
            if shard.path.startswith("/"):
                raise _bad(
                    str(u),
                    f"{where} is a local path: a manifest in object storage names its shards by "
                    "keys relative to its prefix, or by URL",
                )
            if ".." in shard.path.split("/"):
                raise _bad(str(u), f"{where} leaves the manifest's prefix ('..')")
        try:
            parse_url(manifest.shard_path(k))
        except StoreError as e:  # names the URL as parse_url shows it (redacted), never as written
            raise _bad(str(u), f"shards[{k}].path: {e}") from None
    return manifest


def _parse(p: str, raw: bytes, *, remote: bool = False) -> Manifest:
    """The manifest in `raw` (read from `p`, which every error names), validated."""
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
    shards = [_shard_info(p, k, entry) for k, entry in enumerate(entries)]
    manifest = Manifest(p, encoding, tuple(shards), {k: v for k, v in doc.items() if k != "shards"}, remote)
    totals = {
        "records": sum(s.records for s in shards),
        "data_bytes": sum(s.data_bytes for s in shards),
        "file_size": sum(s.file_size for s in shards),
    }
    for key, total in totals.items():
        if total >= _INT_LIMIT:
            raise _bad(p, f"the shards' {key} add up to {total}, more than 2**63 - 1")
        if key != "file_size" and _int_field(p, "", doc, key) != total:
            raise _bad(p, f"{key} is {doc.get(key)!r}, but its shards add up to {total}")
    return manifest


def _shard_info(p: str, k: int, entry: object) -> ShardInfo:
    """Shard `k` of the manifest at `p`, its `entry` validated (every fault raised names the field)."""
    if type(entry) is dict:
        # The usual entry, checked in one expression (a dataset lists thousands); any fault is
        # found again below, one field at a time, for its message.
        spath, checksum = entry.get("path"), entry.get("checksum")
        records, data_bytes, size = entry.get("records"), entry.get("data_bytes"), entry.get("file_size")
        if (
            type(spath) is str
            and spath
            and "\0" not in spath
            and is_utf8(spath)
            and is_checksum(checksum)
            and type(records) is int
            and type(data_bytes) is int
            and type(size) is int
            and 0 <= records < _INT_LIMIT
            and 0 <= data_bytes < _INT_LIMIT
            and 4096 <= size < _INT_LIMIT
        ):
            return ShardInfo(spath, records, data_bytes, size, checksum)
    where = f"shards[{k}]"
    if not isinstance(entry, dict):
        raise _bad(p, f"{where} must be an object")
    spath = entry.get("path")
    if not isinstance(spath, str) or not spath or "\0" in spath:
        raise _bad(p, f"{where}.path must be a non-empty path, not {spath!r}")
    if not is_utf8(spath):  # a "\udcff" escape: a file name the daemon and its readers cannot pass on
        raise _bad(
            p, f"{where}.path {spath!r} is not valid UTF-8; rename the shard and write the manifest again"
        )
    checksum = entry.get("checksum")
    if not is_checksum(checksum):
        raise _bad(p, f"{where}.checksum must be {CHECKSUM_WORDING}, not {checksum!r}")
    return ShardInfo(
        spath,
        _int_field(p, where, entry, "records"),
        _int_field(p, where, entry, "data_bytes"),
        _int_field(p, where, entry, "file_size", 4096),
        checksum,
    )


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
        "source": source_names(source),
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

    The header is read and validated by the core (``_core.read_header_fd``), in the words of every
    open; the offsets index and the records are checked when the shard is opened.

    Raises:
        StoreNotFoundError, StoreFormatError: Not a readable blob.
    """
    p = os.fspath(path)
    fd = _open_blob(p, "shard")
    try:
        header = _core.read_header_fd(fd, p)
        meta_raw = os.pread(fd, header.meta_size, header.meta_offset) if header.meta_size <= 1 << 30 else b""
    except OSError as e:
        raise StoreIOError(e.errno, f"{p}: {e.strerror}") from None
    finally:
        os.close(fd)
    try:
        meta = json.loads(meta_raw)
        encoding = str(meta.get("encoding", "bytes")) if isinstance(meta, dict) else None
    except ValueError:
        encoding = None
    if encoding is None:
        raise StoreFormatError(f"{p}: corrupt metadata block (not a JSON object); run 'smstore verify' on it")
    info = ShardInfo(
        stored_path or p, header.record_count, header.data_size, header.file_size, header.checksum
    )
    return info, encoding


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


def stored_path(shard: str, manifest_dir: str) -> str:
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
        header = _core.read_header_fd(fd, shard.path)
    except StoreError:
        return False
    finally:
        os.close(fd)
    return header.file_size == shard.file_size and header.checksum == shard.checksum
