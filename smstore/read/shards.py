"""Sharded datasets: several blobs under one global index, listed in a small JSON manifest.

A sharded dataset is a directory holding ``manifest.json`` and its shards (or a manifest anywhere
that names shards anywhere, built by :func:`join`); :mod:`smstore.format.manifest` owns the manifest.
Record ``i`` of the dataset is record ``i - starts[k]`` of the shard ``k`` whose range holds it.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from smstore import _core
from smstore.errors import (
    PackInputError,
    StoreChangedError,
    StoreFormatError,
    StoreIOError,
    StoreNotFoundError,
)
from smstore.format.manifest import (
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    ShardNames,
    Source,
    describe_shard,
    is_manifest,
    publish_manifest,
    read_manifest,
    stored_path,
)
from smstore.format.objects import OBJECT_ENCODINGS, DecodedItems, object_decoder
from smstore.write.pack import Transaction, build_metadata, check_output, dataset_output, item_size

__all__ = [
    "ShardedObjectStore",
    "ShardedStore",
    "ShardedWriter",
    "dataset_dir",
    "join",
    "open_sharded",
]

# ----------------------------------------------------------------------------- reading


ShardOpener = Callable[[Source], _core.Store]


def _map_shard(source: Source) -> _core.Store:
    source.require_daemon("a shard", 'open the dataset with mode="daemon"')
    return _core.Store(source.location)


class ShardedStore(_core.ShardedStore):
    """The records of a sharded dataset under one global index (``smstore.open()`` returns one).

    ``store[i]``, ``get_batch`` and ``gather`` work as on a ``Store``; shards are opened (mapped,
    or attached through the daemon) on first use, each checked against the checksum and record
    count the manifest records, so opening a dataset of thousands of shards is fast.

    Args:
        path: The manifest, or a directory holding ``manifest.json``.
        opener: ``opener(source) -> Store`` opens one shard, given its source in the manifest
            (default: a file mapping).
        check_files: Check up front that every shard exists with the size the manifest records
            (one ``stat`` per distinct file). Off when shards are served by the daemon.
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
        """Check that every shard exists with the size the manifest records (one stat per distinct file)."""
        m = self.manifest
        sizes: dict[str, int] = {}  # a file the manifest lists again is the same file within one open
        for k, (shard, source) in enumerate(zip(m.shards, m.sources, strict=True)):
            source.require_daemon("a shard", 'open the dataset with mode="daemon"')
            spath = source.location
            size = sizes.get(spath)
            if size is None:
                try:
                    size = sizes[spath] = os.stat(spath).st_size
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
            store = self._opener(m.sources[k])
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
    manifest: Manifest | None = None,
) -> ShardedStore:
    """A ShardedStore, or (unless `raw`) a ShardedObjectStore for a dataset of object records.

    `manifest`: the dataset's manifest, already read (else it is read from `path`).
    """
    manifest = manifest if manifest is not None else read_manifest(path)
    objects = manifest.encoding in OBJECT_ENCODINGS and not raw
    cls = ShardedObjectStore if objects else ShardedStore
    return cls(path, opener=opener, check_files=check_files, manifest=manifest, keep_alive=keep_alive)


# ----------------------------------------------------------------------------- writing


def dataset_dir(output: str | os.PathLike[str]) -> str:
    """The directory of a sharded output, created if missing (:func:`smstore.write.pack.check_output`)."""
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
        for spath in shard_files(item):
            info, enc = describe_shard(spath, stored_path=stored_path(spath, out_dir))
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


def shard_files(item: str | os.PathLike[str]) -> Iterator[str]:
    p = os.fspath(item)
    if is_manifest(p):
        m = read_manifest(p)
        for k in range(len(m.shards)):
            yield m.shard_path(k)
    else:
        yield p
