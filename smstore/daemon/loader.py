"""The daemon's loader thread: copies files into shared-memory segments and frees released ones, off the event loop.

The manifests of datasets in object storage are read off the loop too, each on a thread of its own
(a GET never waits behind the loads, nor they behind it); their results come out with the loads'.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from smstore import _core
from smstore.daemon.planner import Planner
from smstore.daemon.segments import SHM_DIR, Segment, SegmentTable, pages, unlink_quietly
from smstore.daemon.sources import Index, Source
from smstore.errors import DaemonError, SharedMemoryError, StoreChangedError, StoreError, StoreFormatError
from smstore.format.manifest import Manifest, read_manifest
from smstore.read.store import explain_not_a_blob, read_checksum
from smstore.remote.cache import NodeCache
from smstore.remote.fetch import fetch, read_header
from smstore.remote.urls import RemoteURL, parse_url
from smstore.wire.protocol import Piece
from smstore.write.pack import human_bytes

__all__ = ["AlreadyLoaded", "Failed", "Indexed", "LoadResult", "Loaded", "Loader", "ManifestRead"]

log = logging.getLogger("smstore.daemon")

# The loader thread's nice value (relative to 0): below the training processes.
LOADER_NICENESS = 10

# Seconds the loader thread rests after freeing a released segment.
FREE_PAUSE = 0.005
# How long stop() waits for a load under way to end (it then unlinks what it made).
STOP_WAIT = 5.0


@dataclass(frozen=True)
class Loaded:
    """A new segment: its name in /dev/shm (no leading slash), read-only descriptor, checksum, seconds taken."""

    name: str
    fd: int
    checksum: str
    seconds: float


@dataclass(frozen=True)
class AlreadyLoaded:
    """The file's contents are in a segment already (under this or another path)."""

    checksum: str


@dataclass(frozen=True)
class Failed:
    """The load failed: why."""

    error: Exception


@dataclass(frozen=True)
class Indexed:
    """The index of an object was read (its pieces' sizes are known now)."""

    index: Index


LoadResult = Loaded | AlreadyLoaded | Failed | Indexed


@dataclass(frozen=True)
class ManifestRead:
    """The read of the manifest at `url` ended: the manifest, or why not (`read_manifest`'s error)."""

    url: str
    result: Manifest | Exception


def _sized(size: int) -> str:
    """A byte count for a message: ``64.0 KiB (65536 bytes)``."""
    return f"{size} bytes" if size < 1024 else f"{human_bytes(size)} ({size} bytes)"


class Loader:
    """The loader thread and its two queues: work in (`source.load(piece)`s, an object's index to
    read, segments to free), results out.

    A slow file system never blocks the event loop: every file a load reads is opened here. Each
    finished load wakes the loop through `wake` (a socket the loop watches).

    Args:
        segments: The daemon's segment table (read here: a load of contents already loaded is skipped).
        planner: The one budget (`Planner.room`) a load must fit.
        segment_name: A fresh segment name for a checksum.
        gid: The group that may read the segments, or None for the owner only.
        read_rate: Read files at most this many bytes a second (0: no limit).
        cache_dir: Where shards named by URL are kept once fetched (a NodeCache), or None: fetched
            straight into their segments.
        cache_limit: The most bytes the cache's entries may hold together.
    """

    def __init__(
        self,
        segments: SegmentTable,
        planner: Planner,
        segment_name: Callable[[str], str],
        *,
        gid: int | None,
        read_rate: int,
        cache_dir: str | None = None,
        cache_limit: int = 0,
    ) -> None:
        self.segments = segments
        self.planner = planner
        self.segment_name = segment_name
        self.gid = gid
        self.read_rate = read_rate
        self.cache = NodeCache(cache_dir, cache_limit) if cache_dir is not None else None
        self.fetched_bytes = 0  # bytes fetched from object storage straight into segments (pieces too)
        # The cache's size, measured in this thread after each use (status never lists the directory).
        self.cache_bytes = self.cache.total_bytes() if self.cache is not None else 0
        self.stopping = False
        # Set by stop(): a fetch under way ends at once (its requests in flight are not waited for).
        self.halt = threading.Event()
        # Work, in order: a piece of a source to load (None: the object's index to read), a
        # released segment to free, or None (stop).
        self.jobs: queue.Queue[tuple[Source, Piece | None] | Segment | None] = queue.Queue()
        # Results, in order: a finished job, the name of a released segment removed (unlinked and
        # unmapped here: its pages are room only from then on, `Planner.freed`, not from its
        # release), or a manifest read (`fetch_manifest`).
        self.done: queue.Queue[tuple[Source, Piece | None, LoadResult] | str | ManifestRead] = queue.Queue()
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.wake_w.setblocking(False)
        self.thread = threading.Thread(target=self._run, name="smstore-loader", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _access(self) -> tuple[int, int]:
        """(mode, gid) of a loaded segment: read-only, and readable by the daemon's group if it has one."""
        return (0o400, -1) if self.gid is None else (0o440, self.gid)

    def seal(self, fd: int, name: str) -> int:
        """Give segment `name`, written in full through `fd`, its final mode and group; returns a read-only fd of it."""
        return _core.shm_seal(fd, "/" + name, *self._access())

    def load(self, source: Source, piece: Piece) -> None:
        """Queue a load of `piece` of `source` (a whole shard's holds the checksum `source` records, if any)."""
        self.jobs.put((source, piece))

    def read_index(self, source: Source) -> None:
        """Queue the read of an object's index (its pieces' sizes are not known before)."""
        self.jobs.put((source, None))

    def free(self, seg: Segment) -> None:
        """Queue a released segment to be unlinked and freed, before any load queued after it."""
        self.jobs.put(seg)

    def fetch_manifest(self, url: str) -> None:
        """Read the manifest at `url` (``read_manifest``: the scheme allow-list, one GET, the full
        validation) on a thread of its own; its `ManifestRead` comes out of `results`."""
        threading.Thread(
            target=self._read_manifest, args=(url,), name="smstore-manifest", daemon=True
        ).start()

    def _read_manifest(self, url: str) -> None:
        result: Manifest | Exception
        try:
            result = read_manifest(url)
        except Exception as e:  # noqa: BLE001 - every read gets an answer: the waiting requests hear it
            result = e
        self._put(ManifestRead(url, result))

    def _put(self, result: tuple[Source, Piece | None, LoadResult] | str | ManifestRead) -> None:
        self.done.put(result)
        with contextlib.suppress(OSError):
            self.wake_w.send(b"x")

    def results(self) -> tuple[list[str], list[tuple[Source, Piece | None, LoadResult]], list[ManifestRead]]:
        """What ended since the last call (the loop calls it when woken): the names of the released
        segments removed, the jobs finished, and the manifests read."""
        with contextlib.suppress(BlockingIOError):
            self.wake_r.recv(4096)
        removed: list[str] = []
        finished: list[tuple[Source, Piece | None, LoadResult]] = []
        manifests: list[ManifestRead] = []
        with contextlib.suppress(queue.Empty):
            while True:
                item = self.done.get_nowait()
                if isinstance(item, str):
                    removed.append(item)
                elif isinstance(item, ManifestRead):
                    manifests.append(item)
                else:
                    finished.append(item)
        return removed, finished, manifests

    def stop(self) -> None:
        """Stop the thread; free the released segments it had not freed yet."""
        self.stopping = True
        self.halt.set()
        self.jobs.put(None)
        if self.thread.is_alive():
            # A load still running writes on into its segment; the thread unlinks it when it ends
            # (it checks `stopping` before every job and after every load), so the shutdown's scan
            # of /dev/shm that follows finds every segment it made. Bounded: a load of a file on a
            # stuck mount must not hold the daemon's exit forever.
            self.thread.join(timeout=STOP_WAIT)
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if isinstance(job, Segment):
                with contextlib.suppress(OSError, StoreError):
                    job.close()

    def _run(self) -> None:
        # Loads are background work: at a lower CPU priority (this thread, and the copying thread
        # each load starts, which inherits it), they never slow the training processes on a busy
        # node; idle cores still run them at full speed.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOADER_NICENESS)
        while True:
            job = self.jobs.get()
            if job is None or (self.stopping and not isinstance(job, Segment)):
                return  # no load starts once the daemon stops: stop() frees the queued segments
            if isinstance(job, Segment):
                # Freeing a released segment's pages takes milliseconds a 10 MiB: here, at the
                # loader's priority, before any load queued after it counts on the room.
                with contextlib.suppress(OSError, StoreError):
                    job.close()
                    _core.wait_for_unmaps()  # the daemon's own mapping too: its pages are gone now
                self._put(job.name)
                time.sleep(FREE_PAUSE)  # one segment's pages at a time: spread over a busy node's CPUs
                continue
            source, piece = job
            result: LoadResult
            try:
                result = (
                    Indexed(source.read_index(self.halt)) if piece is None else self._load_one(source, piece)
                )
            except Exception as e:  # noqa: BLE001 - every load gets an answer (the error); none ends the thread
                if piece is None:
                    log.warning("%s", e)
                result = Failed(e)
            if self.stopping and isinstance(result, Loaded):
                unlink_quietly(result.name)
                os.close(result.fd)
                return
            self._put((source, piece, result))

    def remote_values(self) -> dict[str, int]:
        """What object storage cost, for status's metrics: bytes fetched, cache hits and misses, cache bytes."""
        stats = self.cache.stats if self.cache is not None else None
        return {
            "fetched_bytes": self.fetched_bytes + (stats.bytes_fetched if stats is not None else 0),
            "cache_hits": stats.hits if stats is not None else 0,
            "cache_misses": stats.fetches if stats is not None else 0,
            "cache_bytes": self.cache_bytes,
        }

    def _load_one(self, source: Source, piece: Piece) -> Loaded | AlreadyLoaded:
        if not piece.whole:
            return self._load_piece(source, piece)
        if source.remote:
            return self._fetch_one(source)
        return self._load_file(source.location, source.checksum)

    def _load_piece(self, source: Source, piece: Piece) -> Loaded:
        """`source.load` of a record range into a new segment of its own, served read-only."""
        t0 = time.monotonic()
        key = source.key(piece)
        name = self.segment_name(key)
        wfd = _core.shm_create("/" + name)
        try:
            wfd, read = source.load(piece, wfd, self.halt)
            if source.remote:
                self.fetched_bytes += read
            if (
                self.read_rate
            ):  # --max-read-rate holds for pieces too (a slow file system, a node's network share)
                self.halt.wait(max(0.0, read / self.read_rate - (time.monotonic() - t0)))
            rfd = self.seal(wfd, name)
        except BaseException:
            os.close(wfd)
            unlink_quietly(name)
            raise
        os.close(wfd)
        return Loaded(name, rfd, key, time.monotonic() - t0)

    def _fetch_one(self, source: Source) -> Loaded | AlreadyLoaded:
        """Load a shard named by URL: through the node cache, or fetched straight into its segment.

        The bytes are verified against the manifest's checksum before the segment is served;
        on a mismatch nothing is served and nothing cached (the error names the object).
        """
        u = parse_url(source.location)  # the scheme allow-list: the error names the URL, never a credential
        expected, size = source.checksum, source.size
        if expected is not None and expected in self.segments:
            return AlreadyLoaded(expected)
        if size is None or expected is None:
            # Named alone ('smstore load URL', or 'smstore serve URL'): no manifest the daemon read
            # gives its size, so its header does (one ranged GET); the checksum the loader names, if
            # any, must be the header's.
            expected, size = self._describe(u, expected)
            source.size = size
            if expected in self.segments:
                return AlreadyLoaded(expected)
        if self.cache is not None:
            return self._load_cached(self.cache, u, expected, size)
        room = self.planner.room()
        if room is not None and pages(size) > room:
            limit, limit_from = self.planner.shm_limit, self.planner.shm_limit_from
            msg = (
                f"{u}: not enough shared memory under the daemon's limit: loading it needs {_sized(pages(size))}, "
                f"but {limit_from} is {_sized(limit)} and the daemon's segments use {_sized(self.planner.used())} of it"
            )
            raise SharedMemoryError(msg)
        name = self.segment_name(expected)
        t0 = time.monotonic()
        fd = _core.shm_create("/" + name)
        try:
            os.ftruncate(fd, size)
            # --max-read-rate paces the fetched bytes as it paces a file's.
            result = fetch(u, fd, size=size, checksum=expected, rate=self.read_rate, stop=self.halt)
            ro = self.seal(fd, name)
        except BaseException:
            unlink_quietly(name)
            raise
        finally:
            os.close(fd)
        self.fetched_bytes += result.bytes
        return Loaded(name, ro, expected, time.monotonic() - t0)

    def _load_cached(
        self, cache: NodeCache, u: RemoteURL, checksum: str, size: int
    ) -> Loaded | AlreadyLoaded:
        """Load the shard at `u` from its node cache entry (fetched first if not cached).

        The cache checks an entry's header before handing it over; the load checks every record.
        An entry whose records rotted on disk is dropped and fetched once more, so that one bad
        sector does not fail every later load of the shard.

        Raises:
            StoreFormatError: The entry fetched anew is corrupt too (naming the URL and the entry).
        """
        result = self._load_entry(cache, u, checksum, size)
        if isinstance(result, StoreFormatError):
            log.warning("%s: dropped, fetching it again", result)
            result = self._load_entry(cache, u, checksum, size)
            if isinstance(result, StoreFormatError):
                msg = (
                    f"{result}, fetched anew too: check the disk under {cache.directory}, "
                    "or publish the object again"
                )
                raise type(result)(msg)
        return result

    def _load_entry(
        self, cache: NodeCache, u: RemoteURL, checksum: str, size: int
    ) -> Loaded | AlreadyLoaded | StoreFormatError:
        """One load from the cache entry of `u`; a corrupt entry is dropped and its fault returned.

        Raises:
            StoreFormatError: The entry is corrupt and this process cannot drop it.
        """
        try:
            # The entry open, so that another process evicting it meanwhile cannot fail the load.
            fd = cache.get_fd(u, checksum=checksum, size=size, stop=self.halt)
        finally:
            self.cache_bytes = cache.total_bytes()
        label = f"/proc/self/fd/{fd}"
        try:
            return self._load_file(label, checksum)
        except StoreFormatError as e:
            # The core's message names the descriptor and advises a re-pack: only its fault holds
            # for an entry (the cure is a fresh copy).
            fault = str(e).removeprefix(f"{label}: ").split("; ", 1)[0]
            bad = type(e)(f"{u}: its node cache entry {cache.path_of(u, checksum)} is corrupt ({fault})")
            try:
                cache.drop(u, checksum, fd)
            except StoreError as dropping:
                raise type(e)(f"{bad}, and cannot be dropped: {dropping}") from None
            return bad
        finally:
            os.close(fd)

    def _describe(self, u: RemoteURL, expected: str | None) -> tuple[str, int]:
        """The checksum and size of the blob at `u`, from its header (one ranged GET of 4 KiB).

        Raises:
            StoreFormatError: Not an smstore blob.
            StoreChangedError: It holds another checksum than `expected`.
            RemoteError: The read failed (after retries).
        """
        header = read_header(u, stop=self.halt)
        if expected is not None and header.checksum != expected:
            msg = (
                f"{u}: holds checksum {header.checksum}, but its manifest records {expected}: it was re-packed "
                "or replaced since its manifest was written; publish the dataset again"
            )
            raise StoreChangedError(msg)
        return header.checksum, header.file_size

    def _load_file(self, path: str, expected: str | None) -> Loaded | AlreadyLoaded:
        checksum = read_checksum(path)
        if expected is not None and checksum != expected:
            # Loading it would serve no rank (they read the manifest's contents): refused before
            # a byte is copied, and not tried again until the file changes.
            what = f"checksum {checksum}" if checksum is not None else "no smstore blob"
            msg = (
                f"{path}: holds {what}, but the manifest it was held by records {expected}: the shard was "
                "re-packed or overwritten since its manifest was written. Pack the dataset again "
                "(or restore the shard), then start the job again"
            )
            raise StoreChangedError(msg)
        if checksum is not None and checksum in self.segments:
            return AlreadyLoaded(checksum)
        room = self.planner.room()
        if room is not None:
            self._check_room(path, room)
        name = self.segment_name(checksum or "0" * 16)
        t0 = time.monotonic()
        limit_room = 0 if room is None else max(1, room)  # 0: no limit
        try:
            fd, _size, ck, _n = _core.shm_load(path, "/" + name, *self._access(), limit_room, self.read_rate)
        except StoreFormatError as e:
            raise explain_not_a_blob(path, e) from None
        if ck != checksum:  # the file was replaced between the two reads
            os.close(fd)
            _core.shm_unlink("/" + name)
            msg = f"{path}: the file changed while it was being loaded; try again"
            raise DaemonError(msg)
        return Loaded(name, fd, ck, time.monotonic() - t0)

    def _check_room(self, path: str, room: int) -> None:
        """Refuse a load that --shm-limit leaves no room for, blaming the limit (not /dev/shm).

        Raises:
            SharedMemoryError: The blob does not fit under the limit, and /dev/shm has more room
                than the limit leaves (else the loader's own message, about /dev/shm, is right).
        """
        try:
            needed = pages(os.stat(path).st_size)
        except OSError:
            return  # the load says what is wrong with the file
        if needed <= room or _core.shm_space(os.fspath(SHM_DIR))[0] < room:
            return
        limit, limit_from = self.planner.shm_limit, self.planner.shm_limit_from
        msg = (
            f"{path}: not enough shared memory under the daemon's limit: loading it needs "
            f"{_sized(needed)}, but {limit_from} is {_sized(limit)} and the daemon's "
            f"segments use {_sized(self.planner.used())} of it. Raise {limit_from}, unload blobs the daemon "
            'serves (smstore unload FILE), or read the file directly: mode="mmap".'
        )
        raise SharedMemoryError(msg)
