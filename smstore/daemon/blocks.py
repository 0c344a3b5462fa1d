"""Block residency: the daemon holds, loads and drops pieces of shards (record ranges) for the ranks' block samplers.

A rank's :class:`smstore.sampler.BlockWindowSampler` holds the pieces (:mod:`smstore._blocks`)
its order reads now and next (``hold_blocks``). Each piece is loaded as its own segment: a blob of
exactly its records, its bytes read from the shard in one sequential read, registered in the
daemon's one segment table under :func:`~smstore._blocks.piece_id`, so readers attach it like
any segment and it counts in the planner's one budget (``Planner.committed``/``fits``: its load in
flight, then its segment). A piece no rank holds any more is released through the planner (its
pages count until the loader thread removed it and the owner's readers unmapped it). Loads run on this module's own thread and finish through the loader's queue, so the event
loop registers them and answers the readers waiting for them exactly as for a shard.

Integrity: the whole file's XXH64 cannot be checked from a piece. A piece is loaded only from a
shard whose header records the manifest's checksum and whose size is the manifest's (a shard
re-packed or replaced is refused, at the hold and at the load); the shard's index is validated
(every record within the data section) before the piece's bytes are located by it; and the
piece's segment is a blob with its own checksum, written as its bytes are copied. Bytes changed
in place without a new header are not detected (``smstore verify`` checks whole files).

Shards named by URL (object storage): the same checks from ranged reads, on this module's thread
(never the event loop). The first hold of such a shard queues the read of its header, index and
metadata (two ranged GETs; the header must be the manifest's, the index is validated); its
pieces wait for it (their size is not known before), then each piece is one ranged GET of
exactly its records' bytes, carrying the ETag the header's read saw, so every part comes from one
version of the object. A failed read of the index fails the shard's pieces: the readers waiting
for them hear why.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import stat
import threading
import time
from typing import TYPE_CHECKING, NamedTuple

from smstore import _core
from smstore._manifest import is_url
from smstore._protocol import BAD_REQUEST, LOAD_FAILED, NO_ROOM, Piece, ProtocolError, piece_id, piece_path
from smstore.daemon.loader import LOADER_NICENESS, Failed, Loaded
from smstore.daemon.segments import pages, unlink_quietly
from smstore.errors import StoreChangedError, StoreError

if TYPE_CHECKING:
    import numpy as np

    from smstore.daemon.serving import Serving

__all__ = ["Blocks"]

log = logging.getLogger("smstore.daemon")

# Index entries of checked shards kept (8 bytes each): beyond, the cache starts again.
_CACHED_OFFSETS = 1 << 22


class _Job:
    """One piece to load: the shard, the range, its id and the checksum the manifest records.

    ``size`` (the piece's segment) is None for a shard named by URL until its index is read.
    """

    __slots__ = ("checksum", "end", "first", "key", "path", "pseudo", "size")

    def __init__(self, path: str, checksum: str, piece: Piece, key: str, size: int | None) -> None:
        self.path, self.checksum, self.first, self.end = path, checksum, piece.first, piece.stop
        self.key, self.size = key, size
        self.pseudo = piece_path(path, piece.first, piece.end)


class _IndexJob:
    """Read the header, index and metadata of a shard named by URL (see the module docstring)."""

    __slots__ = ("checksum", "file_size", "url")

    def __init__(self, url: str, checksum: str, file_size: int) -> None:
        self.url, self.checksum, self.file_size = url, checksum, file_size


class _Remote(NamedTuple):
    """What a shard named by URL holds, read once: where its data starts, its index and metadata, its version."""

    data_offset: int
    offsets: np.ndarray
    meta: str
    etag: str | None


def _piece_size(offsets: np.ndarray, p: Piece, meta: int) -> int:
    """A piece's segment: the blob the writer makes of its records, with the shard's `meta` bytes.

    Exactly what `_write` makes: the budget admits its load by this size (a page short, an epoch
    at a small budget went over it).
    """
    return _core.blob_size(p.stop - p.first, int(offsets[p.stop] - offsets[p.first]), meta)


class Blocks:
    """The pieces each connection holds, their loads and releases (see the module docstring).

    Args:
        serving: The daemon's serving side: its segment table, planner (the budget), loader
            (whose queue and wake-up finish a load) and in-flight loads (readers wait on them).
    """

    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.segments = serving.segments
        self.planner = serving.planner
        self.holds: dict[int, list[_Job]] = {}
        self.mine: set[str] = set()  # ids of the segments loaded for holds
        self.loading: dict[str, _Job] = {}  # id -> job queued or under way
        self.failed: dict[str, str] = {}  # shard path -> why its pieces cannot be loaded
        # Per shard path: (identity, index offsets) of a shard checked against its manifest.
        self._shards: dict[str, tuple[tuple[int, int, int], np.ndarray, int]] = {}  # ..., metadata bytes
        # Shards named by URL: what their index read found (written by this module's thread), the
        # reads queued (event loop), and why one failed (this module's thread; the loop takes it).
        self._remote: dict[str, _Remote] = {}
        self._indexing: set[str] = set()
        self._index_failed: dict[str, str] = {}
        self._lock = threading.Lock()
        self.fetched_bytes = 0  # bytes of pieces read from object storage (this module's thread)
        self.jobs: queue.Queue[_Job | _IndexJob | None] = queue.Queue()
        self.halt = threading.Event()  # set by stop(): a read under way ends at once
        serving.piece_failure = self.failure_of
        self.thread = threading.Thread(target=self._run, name="smstore-blocks", daemon=True)
        self.thread.start()

    # ---- holds (event loop) ---------------------------------------------------------------------

    def hold(self, cid: int, manifest_path: str, pieces: list[Piece]) -> int:
        """Replace what connection `cid` holds with `pieces` of a manifest, in the order to load them; how many.

        Raises:
            ProtocolError: A bad manifest or shard index, a piece past its shard's end or larger
                than the whole budget, or a shard that changed since its manifest was written.
        """
        try:
            manifest, paths = self.planner.manifest(manifest_path)
        except StoreError as e:
            raise ProtocolError(BAD_REQUEST, str(e)[:1000]) from None
        jobs = []
        for p in pieces:
            if p.shard >= len(manifest.shards) or p.stop > manifest.shards[p.shard].records:
                raise ProtocolError(
                    BAD_REQUEST, f"{manifest_path}: no records {p.first}-{p.end} in shard {p.shard}"
                )
            path, info = paths[p.shard], manifest.shards[p.shard]
            if path in self.failed and is_url(path) and self.planner.backoff.due(path):
                self._retry(path)
            size: int | None
            if is_url(path):
                remote = self._remote_of(path, info.checksum, info.file_size)
                size = None if remote is None else _piece_size(remote.offsets, p, len(remote.meta.encode()))
            else:
                offsets, meta = self._checked(path, info.checksum, info.file_size)
                size = _piece_size(offsets, p, meta)
            if path in self.failed:
                raise ProtocolError(LOAD_FAILED, f"a held block cannot be loaded: {self.failed[path]}"[:1000])
            if size is not None and not self.planner.fits(size, used=0):
                raise ProtocolError(NO_ROOM, self._too_large(path, p, size))
            jobs.append(_Job(path, info.checksum, p, piece_id(info.checksum, p.first, p.end), size))
        if jobs:
            self.holds[cid] = jobs
        else:
            self.holds.pop(cid, None)
        self.reconcile()
        return sum(j.key in self.segments for j in jobs)

    def _checked(self, path: str, checksum: str, file_size: int) -> tuple[np.ndarray, int]:
        """The index offsets and metadata size of the shard at `path`, once its header says it is the manifest's shard.

        Raises:
            ProtocolError: It is not (LOAD_FAILED, naming the file and what differs).
        """
        try:
            st = os.stat(path)
            identity = (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError as e:
            raise ProtocolError(LOAD_FAILED, f"{path}: {e.strerror}") from None
        cached = self._shards.get(path)
        if cached is not None and cached[0] == identity:
            return cached[1], cached[2]
        try:
            store = _core.Store(path)  # validates the header and every index entry
        except StoreError as e:
            raise ProtocolError(LOAD_FAILED, f"a held block cannot be loaded: {e}"[:1000]) from None
        try:
            if store.checksum != checksum or store.file_size != file_size:
                why = (
                    f"{path}: holds checksum {store.checksum} ({store.file_size} bytes), but its manifest records "
                    f"{checksum} ({file_size} bytes): the shard was re-packed or overwritten since its manifest "
                    "was written. Pack the dataset again (or restore the shard), then start the job again"
                )
                self.failed[path] = why
                raise ProtocolError(LOAD_FAILED, f"a held block cannot be loaded: {why}")
            # A copy: a view would keep the whole shard mapped after close(), and the daemon would die
            # of SIGBUS reading it once the file is truncated in place.
            import numpy as np  # here, not at import: its thread pool would start before SCHED_BATCH is set

            offsets = np.array(store.offsets, dtype=np.int64)
            meta = len(store.metadata_bytes)
        finally:
            store.close()
        self.failed.pop(path, None)
        if sum(len(o) for _i, o, _m in self._shards.values()) + len(offsets) > _CACHED_OFFSETS:
            self._shards.clear()
        self._shards[path] = (identity, offsets, meta)
        return offsets, meta

    def _fail(self, path: str, why: str) -> None:
        """The pieces of the shard at `path` cannot be loaded: not tried again until its file changes,
        or for a shard in object storage, until a hold after its backoff (`Planner.backoff`)."""
        self.failed[path] = why
        if is_url(path):
            self.planner.backoff.failed(path)

    def _retry(self, path: str) -> None:
        """Try the shard in object storage at `path` again: its header and index are read afresh
        (it may have been uploaded again)."""
        del self.failed[path]
        with self._lock:
            self._remote.pop(path, None)

    def _too_large(self, path: str, p: Piece, size: int) -> str:
        return (
            f"{piece_path(path, p.first, p.end)}: a block piece of {size} bytes does not fit the "
            f"daemon's --shm-limit of {self.planner.shm_limit} bytes; use smaller blocks"
        )

    def _remote_of(self, url: str, checksum: str, file_size: int) -> _Remote | None:
        """What the shard at `url` holds, once its index is read; else None, and its read queued (once).

        Raises:
            ProtocolError: The URL is one the daemon does not fetch (the scheme allow-list).
        """
        from smstore.remote.urls import parse_url  # the allow-list; never a credential in the message

        with self._lock:
            remote = self._remote.get(url)
        if remote is not None:
            return remote
        if url not in self._indexing and url not in self.failed:
            try:
                parse_url(url)
            except StoreError as e:
                raise ProtocolError(BAD_REQUEST, str(e)[:1000]) from None
            self._indexing.add(url)
            self.jobs.put(_IndexJob(url, checksum, file_size))
        return None

    def failure_of(self, pseudo: str) -> str | None:
        """Why the piece a reader asks for (``PATH#records=A-B``) will not be served, if its shard failed."""
        path = pseudo.rpartition("#records=")[0]
        return self.failed.get(path) if path else None

    def stale(self, value: object) -> list[str]:
        """Of the pieces a reader maps (``"id,id,..."``), those no rank holds any more (it should unmap them).

        Raises:
            ProtocolError: Not that form.
        """
        if not isinstance(value, str) or len(value) > 17 * 65536:
            raise ProtocolError(BAD_REQUEST, "'checksums' must be a string of comma-separated checksums")
        held = {job.key for jobs in self.holds.values() for job in jobs}
        return [key for key in value.split(",") if key and key not in held]

    def closed(self, cid: int) -> None:
        if self.holds.pop(cid, None) is not None:
            self.reconcile()

    def reconcile(self) -> None:
        """Release the pieces no connection holds; queue the loads of held pieces that fit the budget."""
        wanted: dict[str, _Job] = {}
        lists = list(self.holds.values())
        for depth in range(max((len(h) for h in lists), default=0)):
            for held in lists:
                if depth < len(held):
                    wanted.setdefault(held[depth].key, held[depth])
        for key, job in list(self.loading.items()):
            if job.pseudo not in self.serving.loading:  # landed (registered) or failed
                del self.loading[key]
                why = self.serving.failures.get(job.pseudo)
                if key not in self.segments and why is not None:
                    self._fail(job.path, why)
                elif key in self.segments and is_url(job.path):
                    self.planner.backoff.succeeded(job.path)
        released = []
        for key in list(self.mine):
            if key not in wanted and key in self.segments:
                released.append(self.planner.release(self.segments[key]))
            if key not in self.loading and (key not in wanted or key not in self.segments):
                self.mine.discard(key)  # released, or its load failed (tried again at the next hold)
        # Shards named by URL whose index read ended: their pieces' sizes, or their failure.
        with self._lock:
            failed, self._index_failed = self._index_failed, {}
            remote = dict(self._remote)
        for url, why in failed.items():
            self._fail(url, why)
            self._indexing.discard(url)
        for job in wanted.values():
            if job.size is None and job.path in remote:
                self._indexing.discard(job.path)
                piece = Piece(0, job.first, job.end)
                job.size = _piece_size(remote[job.path].offsets, piece, len(remote[job.path].meta.encode()))
                if not self.planner.fits(job.size, used=0):
                    self.failed[job.path] = self._too_large(job.path, piece, job.size)
        used = self.planner.committed()  # the one count: shards' loads in flight too
        queued = []
        for key, job in wanted.items():
            if key in self.segments or key in self.loading or job.path in self.failed:
                continue
            if job.size is None or not self.planner.fits(job.size, used):
                break  # later pieces wait until earlier ones are released
            used += pages(job.size)
            self.loading[key] = job
            self.mine.add(key)
            self.serving.loading.setdefault(job.pseudo, [])  # readers asking for it wait for it
            self.planner.load_started(job.pseudo, job.size)  # counted until it lands (finish_loads)
            self.jobs.put(job)
            queued.append(job.pseudo)
        if released:
            log.info("releasing %d block piece(s) no rank holds", len(released))
            self.serving.state.changed()
        if queued:
            log.debug("loading %d held block piece(s)", len(queued))

    def stop(self) -> None:
        self.halt.set()
        self.jobs.put(None)
        self.thread.join(timeout=5.0)

    # ---- loads (this module's thread) -----------------------------------------------------------

    def _run(self) -> None:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOADER_NICENESS)
        while True:
            job = self.jobs.get()
            if job is None:
                return
            loader = self.serving.loader
            if isinstance(job, _IndexJob):
                try:
                    remote = self._read_index(job)
                except Exception as e:  # noqa: BLE001 - every read gets an answer
                    log.warning("%s", e)
                    with self._lock:
                        self._index_failed[job.url] = f"{e}"[:1000]
                else:
                    with self._lock:
                        self._remote[job.url] = remote
            else:
                result: Loaded | Failed
                try:
                    result = self._load(job)
                except Exception as e:  # noqa: BLE001 - every load gets an answer
                    result = Failed(e)
                loader.done.put((job.pseudo, result))
            with contextlib.suppress(OSError):
                loader.wake_w.send(b"x")

    def _read_index(self, job: _IndexJob) -> _Remote:
        """The header, index and metadata of the shard at ``job.url``, checked against its manifest.

        Raises:
            StoreChangedError: Its header is not the manifest's shard.
            StoreFormatError: Its header or index is not a valid blob's.
            RemoteError: A read failed (after retries).
        """
        from smstore.remote.fetch import read_range

        head, etag = read_range(job.url, 0, _core.BLOB_HEADER_SIZE, stop=self.halt)
        header = _core.parse_header(head, job.url)  # the one header check (csrc/format.cpp)
        if header.file_size != job.file_size:
            msg = (
                f"{job.url}: its header says {header.file_size} bytes, but its manifest records {job.file_size}: the "
                "shard was re-packed or replaced since its manifest was written; publish the dataset again"
            )
            raise StoreChangedError(msg)
        if header.checksum != job.checksum:
            msg = (
                f"{job.url}: holds checksum {header.checksum}, but its manifest records {job.checksum}: it was "
                "re-packed or replaced since its manifest was written; publish the dataset again"
            )
            raise StoreChangedError(msg)
        tail, _etag = read_range(job.url, *header.tail_range, if_match=etag, stop=self.halt)
        offsets, meta = _core.read_tail(header, tail, job.url)  # the index validated by the core
        return _Remote(header.data_offset, offsets, meta.decode("utf-8", "replace"), etag)

    def _load(self, job: _Job) -> Loaded:
        t0 = time.monotonic()
        if is_url(job.path):
            from smstore.remote.fetch import read_range

            with self._lock:
                remote = self._remote[job.path]
            offsets = remote.offsets[job.first : job.end + 1]
            # One ranged GET of the piece's bytes, of the version whose index located them.
            start = remote.data_offset + int(offsets[0])
            data, _etag = read_range(
                job.path, start, start + int(offsets[-1] - offsets[0]), if_match=remote.etag, stop=self.halt
            )
            self.fetched_bytes += len(data)
            self._pace(len(data), t0)
            return self._write(job, data, offsets, remote.meta, t0)
        # O_NONBLOCK: a FIFO put in the shard's place must not block this thread (it is refused
        # below as not a regular file). The index, the header and the bytes all come from this one
        # descriptor, so a file swapped in meanwhile cannot lend one its offsets and another its bytes.
        fd = os.open(job.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                msg = f"{job.pseudo}: the shard is not a regular file any more"
                raise StoreChangedError(msg)
            store = _core.Store._from_fd(fd, job.path)
            try:
                if store.checksum != job.checksum:
                    msg = (
                        f"{job.pseudo}: the shard holds checksum {store.checksum}, but its manifest records "
                        f"{job.checksum}: it was re-packed or overwritten; pack the dataset again"
                    )
                    raise StoreChangedError(msg)
                offsets = store.offsets[job.first : job.end + 1].astype("int64")
                meta = store.metadata_bytes.decode()
                header = _core.read_header_fd(fd, job.path)
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
                    msg = f"{job.pseudo}: the shard ended early (file truncated?)"
                    raise StoreChangedError(msg)
                got += n
        finally:
            os.close(fd)
        self._pace(length, t0)
        return self._write(job, data, offsets, meta, t0)

    def _pace(self, length: int, t0: float) -> None:
        """--max-read-rate holds for pieces too (a slow shared file system, a node's share of the network)."""
        rate = self.serving.loader.read_rate
        if rate:
            self.halt.wait(max(0.0, length / rate - (time.monotonic() - t0)))

    def _write(self, job: _Job, data: bytearray, offsets: np.ndarray, meta: str, t0: float) -> Loaded:
        """The piece's segment: a blob of exactly its records (`data`, located by `offsets`), served read-only."""
        name = self.serving.loader.segment_name(job.key)
        wfd = _core.shm_create("/" + name)
        try:
            writer = _core.Writer.to_fd(wfd, job.pseudo)
            import numpy as np

            writer.extend_offsets(np.frombuffer(data, dtype=np.uint8), offsets - offsets[0])
            wfd = writer.finish_fd(meta)
            rfd = self.serving.loader.seal(wfd, name)
        except BaseException:
            os.close(wfd)
            unlink_quietly(name)
            raise
        os.close(wfd)
        return Loaded(name, rfd, job.key, time.monotonic() - t0)
