"""Where a held shard's bytes come from: a local file or an object, decided once when its manifest (or a load) enters the daemon.

A `Source` knows its shard's location, the checksum and size its manifest records, its identity
(what a failed load waits to change) and, once read, its index: where its data starts, each
record's offset and its metadata. The loader thread loads a piece of it with `Source.load`: the
bytes of exactly the piece's records, read in one go (one sequential read of the file, or one
ranged GET of the object), written into the piece's segment as a blob of its own.

Integrity: the whole file's XXH64 cannot be checked from a piece. A piece is loaded only from a
shard whose header records the manifest's checksum and whose size is the manifest's (a shard
re-packed or replaced is refused, at the hold and at the load); the shard's index is validated
(every record within the data section) before the piece's bytes are located by it; and the
piece's segment is a blob with its own checksum, written as its bytes are copied. Bytes changed
in place without a new header are not detected (``smstore verify`` checks whole files).

An object's header, index and metadata are read once (two ranged GETs, off the event loop), and
every piece's GET carries the ETag the header's read saw, so every part comes from one version.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from smstore import _core
from smstore.errors import StoreChangedError
from smstore.remote.urls import is_remote_url
from smstore.wire.protocol import Piece, piece_id, piece_path

if TYPE_CHECKING:
    import numpy as np

__all__ = ["NO_IDENTITY", "FileIdentity", "Index", "Source"]

# A file's identity as stat sees it: a failed held load is retried only once this changes.
FileIdentity = tuple[int, int, int, int]
# An object's: it has none to watch (a failed fetch is tried again after its backoff).
NO_IDENTITY: FileIdentity = (0, 0, 0, 0)


class Index(NamedTuple):
    """What a shard holds, read once: where its data starts, its records' offsets, its metadata,
    its version (an object's ETag), and the identity of the file it was read from."""

    data_offset: int
    offsets: np.ndarray
    meta: bytes
    etag: str | None
    identity: FileIdentity


class Source:
    """One shard's bytes: a local file or an object (see the module docstring).

    Args:
        location: The shard's absolute path, or its URL.
        checksum: The checksum its manifest records (None: a file loaded on its own, whatever it holds).
        size: Its size as its manifest says (None: unknown; an object's header says it when loaded).
        remote: Whether `location` is an object's URL, when its giver decided it already (a
            request's name, parsed by the protocol); None: decided here.
    """

    __slots__ = ("checksum", "index", "indexing", "location", "remote", "size")

    def __init__(
        self,
        location: str,
        checksum: str | None = None,
        size: int | None = None,
        *,
        remote: bool | None = None,
    ) -> None:
        self.location = location
        # The one decision for names no request gave (manifests' shards, `smstore serve`'s files):
        # carried as data from here on.
        self.remote = is_remote_url(location) if remote is None else remote
        self.checksum = checksum
        self.size = size
        self.index: Index | None = None
        self.indexing = False  # an object's index read is queued or under way

    @classmethod
    def named(cls, name: str, checksums: dict[str, str] | None = None) -> Source:
        """A blob the owner names (``smstore serve FILE...``): an object's URL as it is, a file's
        path made absolute; with the checksum `checksums` gives for that location, if any."""
        source = cls(name)
        if not source.remote:
            source.location = os.fspath(Path(name).absolute())
        source.checksum = (checksums or {}).get(source.location)
        return source

    def __repr__(self) -> str:
        return f"Source({self.location!r})"

    def label(self, piece: Piece) -> str:
        """What the daemon's loads and logs call `piece` of this shard."""
        return piece_path(self.location, piece.first, piece.end)

    def key(self, piece: Piece) -> str:
        """The name of `piece`'s segment in the daemon's table: the shard's checksum, or a range's id."""
        assert self.checksum is not None  # a held shard's, from its manifest
        return piece_id(self.checksum, piece.first, piece.end)

    def identity(self) -> FileIdentity | None:
        """The file's identity now (None: it cannot be stat'ed); an object's is `NO_IDENTITY`."""
        if self.remote:
            return NO_IDENTITY
        try:
            st = os.stat(self.location)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def current_size(self) -> int:
        """The whole shard's size: its manifest's word for an object, else the file's (OSError if it has none)."""
        if self.remote:
            if self.size is None:
                raise FileNotFoundError(self.location)
            return self.size
        return os.stat(self.location).st_size

    def piece_size(self, piece: Piece) -> int | None:
        """The segment of `piece`: the whole shard, or the blob of a range's records with the
        shard's metadata (exactly what `load` writes: the budget admits its load by this size);
        None while the index of an object is not read."""
        if piece.whole:
            try:
                return self.current_size()
            except OSError:
                return None
        if self.index is None:
            return None
        offsets = self.index.offsets
        return _core.blob_size(
            piece.stop - piece.first, int(offsets[piece.stop] - offsets[piece.first]), len(self.index.meta)
        )

    # ---- checks and index (a file's on the event loop, an object's on the loader thread) -----------

    def check(self) -> Index:
        """The index of the local shard, once its header says it is the manifest's shard (kept until the file changes).

        Raises:
            OSError: It cannot be stat'ed.
            StoreChangedError: Its header is not the manifest's shard.
            StoreError: Its header or index is not a valid blob's.
        """
        st = os.stat(self.location)
        identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if self.index is not None and self.index.identity == identity:
            return self.index
        store = _core.Store(self.location)  # validates the header and every index entry
        try:
            self._same_shard(store.checksum, store.file_size)
            # A copy: a view would keep the whole shard mapped after close(), and the daemon would die
            # of SIGBUS reading it once the file is truncated in place.
            import numpy as np  # here, not at import: its thread pool would start before SCHED_BATCH is set

            self.index = Index(
                0, np.array(store.offsets, dtype=np.int64), store.metadata_bytes, None, identity
            )
        finally:
            store.close()
        return self.index

    def read_index(self, stop: threading.Event) -> Index:
        """The header, index and metadata of the object, checked against its manifest (two ranged GETs).

        Raises:
            StoreChangedError: Its header is not the manifest's shard.
            StoreFormatError: Its header or index is not a valid blob's.
            RemoteError: A read failed (after retries).
        """
        from smstore.remote.fetch import read_range

        head, etag = read_range(self.location, 0, _core.BLOB_HEADER_SIZE, stop=stop)
        header = _core.parse_header(head, self.location)  # the one header check (csrc/format.cpp)
        self._same_shard(header.checksum, header.file_size)
        tail, _etag = read_range(self.location, *header.tail_range, if_match=etag, stop=stop)
        offsets, meta = _core.read_tail(header, tail, self.location)  # the index validated by the core
        return Index(header.data_offset, offsets, meta, etag, NO_IDENTITY)

    def _same_shard(self, checksum: str, file_size: int) -> None:
        if checksum == self.checksum and (self.size is None or file_size == self.size):
            return
        changed, cure = (
            ("replaced", "publish the dataset again")
            if self.remote
            else ("overwritten", "pack the dataset again (or restore the shard)")
        )
        msg = (
            f"{self.location}: holds checksum {checksum} ({file_size} bytes), but its manifest records "
            f"{self.checksum} ({self.size} bytes): the shard was re-packed or {changed} since its "
            f"manifest was written; {cure}, then start the job again"
        )
        raise StoreChangedError(msg)

    # ---- a piece's bytes (the loader thread) --------------------------------------------------------

    def read(self, piece: Piece, stop: threading.Event) -> tuple[bytearray, np.ndarray, bytes]:
        """The bytes of `piece`'s records, their offsets (from the first record's) and the shard's metadata.

        Raises:
            StoreChangedError: The shard is not the one its manifest records any more.
            RemoteError: The object's read failed (after retries), or changed since its index was read.
        """
        if self.remote:
            from smstore.remote.fetch import read_range

            index = self.index
            assert index is not None  # its pieces are queued once its index is read
            offsets = index.offsets[piece.first : piece.stop + 1]
            start = index.data_offset + int(offsets[0])
            # One ranged GET of the piece's bytes, of the version whose index located them.
            data, _etag = read_range(
                self.location, start, start + int(offsets[-1] - offsets[0]), if_match=index.etag, stop=stop
            )
            return data, offsets, index.meta
        label = self.label(piece)
        # O_NONBLOCK: a FIFO put in the shard's place must not block this thread (it is refused
        # below as not a regular file). The index, the header and the bytes all come from this one
        # descriptor, so a file swapped in meanwhile cannot lend one its offsets and another its bytes.
        fd = os.open(self.location, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                msg = f"{label}: the shard is not a regular file any more"
                raise StoreChangedError(msg)
            store = _core.Store._from_fd(fd, self.location)
            try:
                if store.checksum != self.checksum:
                    msg = (
                        f"{label}: the shard holds checksum {store.checksum}, but its manifest records "
                        f"{self.checksum}: it was re-packed or overwritten; pack the dataset again"
                    )
                    raise StoreChangedError(msg)
                offsets = store.offsets[piece.first : piece.stop + 1].astype("int64")
                meta = store.metadata_bytes
                header = _core.read_header_fd(fd, self.location)
            finally:
                store.close()
            start = header.data_offset + int(offsets[0])
            length = int(offsets[-1] - offsets[0])
            data = bytearray(length)
            view = memoryview(data)
            got = 0
            while got < length:  # one sequential read of the piece's bytes
                n = os.preadv(fd, [view[got:]], start + got)
                if n <= 0:
                    msg = f"{label}: the shard ended early (file truncated?)"
                    raise StoreChangedError(msg)
                got += n
        finally:
            os.close(fd)
        return data, offsets, meta

    @staticmethod
    def write(fd: int, label: str, data: bytearray, offsets: np.ndarray, meta: bytes) -> int:
        """Write the blob of a piece's records (`data`, located by `offsets`) into the segment `fd`; its descriptor after."""
        import numpy as np

        writer = _core.Writer.to_fd(fd, label)
        writer.extend_offsets(np.frombuffer(data, dtype=np.uint8), offsets - offsets[0])
        return int(writer.finish_fd(meta.decode("utf-8", "replace")))

    def load(self, piece: Piece, fd: int, stop: threading.Event) -> tuple[int, int]:
        """Write `piece` (a record range) into the new segment `fd`: its descriptor after, and the bytes read."""
        data, offsets, meta = self.read(piece, stop)
        return self.write(fd, self.label(piece), data, offsets, meta), len(data)
