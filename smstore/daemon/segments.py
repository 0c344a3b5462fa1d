"""The daemon's shared-memory segments on disk: names, listing, lock, the segment table, adoption, `gc`."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import socket
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from smstore import _core
from smstore.daemon.state import read_state, set_aside, state_path
from smstore.errors import DaemonError, StoreError
from smstore.wire.ipc import process_alive, socket_path
from smstore.wire.protocol import CHECKSUM, CacheRequest

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("smstore.daemon")

__all__ = [
    "SEGMENT_RE",
    "SHM_DIR",
    "DaemonLock",
    "Segment",
    "SegmentTable",
    "adopt_previous",
    "collect_garbage",
    "daemon_alive",
    "list_segments",
    "new_segment_name",
    "pages",
    "segment_prefix",
]

SHM_DIR = Path(_core.SHM_DIR)

# /dev/shm/smstore-<uid>-<daemon pid>-<daemon start time>-<checksum>-<random>: enough for `smstore gc`
# to tell whose segment it is and whether the daemon that made it is still alive.
SEGMENT_RE = re.compile(rf"^smstore-(\d+)-(\d+)-(\d+)-({CHECKSUM})-([0-9a-f]{{8}})$")
# /dev/shm/smstore-<uid>-<daemon pid>-<daemon start time>-lock: see DaemonLock.
LOCK_RE = re.compile(r"^smstore-(\d+)-(\d+)-(\d+)-lock$")


def segment_prefix(uid: int, pid: int, start_time: int | None = None) -> str:
    """How the names of one daemon's segments begin (all of pid's daemons when start_time is None)."""
    head = f"smstore-{uid}-{pid}-"
    return head if start_time is None else f"{head}{start_time}-"


def new_segment_name(uid: int, pid: int, start_time: int, checksum: str) -> str:
    """A fresh name for a segment holding `checksum` (a random suffix: loads never collide)."""
    return f"{segment_prefix(uid, pid, start_time)}{checksum}-{secrets.token_hex(4)}"


def list_segments(pid: int | None = None, start_time: int | None = None, *, locks: bool = False) -> list[str]:
    """Names (in /dev/shm) of this user's smstore segments; only those of daemon `pid` if given.

    With ``locks=True`` the daemons' lock files (see `DaemonLock`) are listed too.
    """
    uid = os.getuid()
    prefix = f"smstore-{uid}-" if pid is None else segment_prefix(uid, pid, start_time)
    return sorted(
        p.name
        for p in SHM_DIR.iterdir()
        if p.name.startswith(prefix) and (SEGMENT_RE.match(p.name) or (locks and LOCK_RE.match(p.name)))
    )


# ---- liveness: a pid means nothing in another PID namespace, a lock on a file in /dev/shm does ----


class DaemonLock:
    """An exclusive flock on ``/dev/shm/smstore-<uid>-<pid>-<start time>-lock``, held for a daemon's life.

    ``smstore gc`` in another PID namespace (containers sharing /dev/shm with ``--ipc=host``) cannot
    judge a daemon by its pid, which names another process there or none; the lock is on a file in
    the shared /dev/shm, so it is seen from everywhere, and the kernel drops it when the daemon dies
    however it dies.
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd

    @staticmethod
    def path_for(uid: int, pid: int, start_time: int) -> Path:
        return SHM_DIR / f"{segment_prefix(uid, pid, start_time)}lock"

    @classmethod
    def acquire(cls, uid: int, pid: int, start_time: int) -> DaemonLock:
        """Create and lock this daemon's lock file.

        Raises:
            DaemonError: It exists and belongs to someone else, or another process holds it.
        """
        path = cls.path_for(uid, pid, start_time)
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            fd = os.open(path, flags)
        try:
            st = os.fstat(fd)
            if st.st_uid != uid or not stat.S_ISREG(st.st_mode):
                msg = f"{path}: belongs to uid {st.st_uid}, not to us; remove it"
                raise DaemonError(msg)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            msg = f"{path}: locked by another process"
            raise DaemonError(msg) from None
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd)

    def release(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self.fd)

    @classmethod
    def held(cls, uid: int, pid: int, start_time: int) -> bool:
        """Whether a live daemon holds that lock (a file of another owner counts for nothing)."""
        try:
            fd = os.open(
                cls.path_for(uid, pid, start_time), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
            )
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            if st.st_uid != uid or not stat.S_ISREG(st.st_mode):
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError as e:
                return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
            return False
        finally:
            os.close(fd)  # also drops the shared lock we may have taken

    @classmethod
    def remove_stale(cls, uid: int, pid: int, start_time: int) -> bool:
        """Unlink a dead daemon's lock file; True if there was one."""
        path = cls.path_for(uid, pid, start_time)
        try:
            if os.lstat(path).st_uid != uid:
                return False
            path.unlink()
        except OSError:
            return False
        return True


def daemon_alive(uid: int, pid: int, start_time: int) -> bool:
    """Whether daemon (pid, start_time) of `uid` still runs, in this PID namespace or another."""
    return process_alive(pid, start_time) or DaemonLock.held(uid, pid, start_time)


# The counters of a decoded cache's meta page (uint64 words, `CachePart.counters`): the workers
# add hits, fills, waits and uncached reads; the daemon adds evictions and the claims of dead
# workers it reset. The metrics count the first three over the caches, evicted ones included.
HITS, FILLS, WAITS, UNCACHED, EVICTIONS, RESETS = range(6)
COUNTER_NAMES = ("hits", "fills", "waits", "uncached", "evictions", "resets")
METRIC_COUNTERS = ("hits", "fills", "uncached")
META = -1  # the chunk number of a cache's meta page
META_BYTES = 4096
LAYOUT_WORD = 64  # the meta page's claim word of the layout the processes tell each other
# The meta page's last bytes: a bit a chunk (of the first TOLD_CHUNKS), set while the daemon serves
# it, so that a process the daemon told "no room" still maps the chunks others made.
CHUNK_BITS = 3584
TOLD_CHUNKS = 8 * (META_BYTES - CHUNK_BITS)


@dataclass
class CachePart:
    """A segment of a node cache of decoded samples (smstore/daemon/caches.py): its meta page
    (`chunk` META: the counters, then the layout the processes learn) or chunk `chunk`, a slot of
    records' rows whose first 8 bytes a record are its claim word (csrc/claims.hpp). The daemon maps it writable
    to reset the claims of a connection that closed."""

    request: CacheRequest  # the cache's identity and geometry, as its meta page was asked for
    chunk: int
    mem: mmap.mmap
    # Its int64 claim words: a chunk's records', or the meta page's one of the layout.
    claims: np.ndarray[Any, Any]
    counters: np.ndarray[Any, Any] | None = None  # the meta page's (uint64, COUNTER_NAMES)

    @property
    def cache(self) -> str:
        """The cache's identity (64 hex digits)."""
        return self.request.cache

    @property
    def meta_key(self) -> str:
        return cache_key(self.cache, META)

    def counts(self) -> dict[str, int]:
        """A meta page's counters by name (a chunk has none)."""
        if self.counters is None:
            return {}
        return {name: int(value) for name, value in zip(COUNTER_NAMES, self.counters, strict=True)}

    def close(self) -> None:
        del self.claims, self.counters
        self.mem.close()


def cache_key(cache: str, chunk: int) -> str:
    """The segment table's key of chunk `chunk` (or META) of cache `cache`."""
    return f"{cache}:{'meta' if chunk == META else chunk}"


@dataclass
class Segment:
    """One generation of one blob in shared memory, as the daemon holds it."""

    name: str  # without the leading "/"
    checksum: str
    fd: int  # read-only (a cache part's: writable, sent to the owner's processes only)
    # The daemon's own read-only mapping: keeps the pages counted in its PSS (None: a cache part).
    store: _core.Store | None
    size: int
    records: int
    paths: list[str]
    loaded_at: float
    load_seconds: float
    adopted: bool = False
    # Why the planner keeps it: loaded for holds ("managed": released when no connection holds it),
    # or adopted from a dead predecessor that had ("unclaimed"); None: loaded or shared by a client.
    mark: str | None = None
    clients: dict[int, int] = field(default_factory=dict)  # connection id -> peer pid
    # A blob a client shared (a sealed memfd, no name in /dev/shm): found by its content key, and
    # dropped when no client is attached any more.
    key: str | None = None
    cache: CachePart | None = None  # a part of a node cache of decoded samples

    @property
    def shared(self) -> bool:
        return self.key is not None

    def state_entry(self, *, held: bool) -> dict[str, Any]:
        """What the state file keeps of it, for a successor daemon to adopt.

        `held`: loaded because a rank held it (a successor releases it once the ranks move on).
        """
        return {
            "name": self.name,
            "checksum": self.checksum,
            "size": self.size,
            "paths": self.paths,
            "loaded_at": self.loaded_at,
            "held": held,
        }

    def close(self) -> None:
        """Unlink the name and drop the daemon's mapping and fd; clients keep theirs."""
        if not self.shared and self.cache is None:
            _core.shm_unlink("/" + self.name)
        if self.store is not None:
            self.store.close()
        if self.cache is not None:
            self.cache.close()
        os.close(self.fd)


# Bytes of /dev/shm a segment of `size` bytes takes (whole pages): the core's one rule, which the
# samplers' window planners count by too.
pages = _core.shm_footprint


class SegmentTable(dict[str, Segment]):
    """The daemon's segments by checksum, with their totals and a path index kept as they change.

    A load, a hold and `status` need the bytes in use and the segment serving a path: summing or
    scanning the whole table each time made loading N blobs O(N**2). Segments enter with
    ``table[checksum] = seg`` and leave with ``pop``; a segment's paths change through
    :meth:`add_path` and :meth:`remove_path` only.
    """

    def __init__(self) -> None:
        super().__init__()
        self.size = 0  # bytes of the segments
        self.pages = 0  # ... in whole pages, as /dev/shm counts them
        self.cache_parts = 0  # of them, parts of decoded caches
        self.cache_pages = 0  # ... and their pages
        self._by_path: dict[str, str] = {}

    def __setitem__(self, checksum: str, seg: Segment) -> None:
        self.pop(checksum)
        super().__setitem__(checksum, seg)
        self.size += seg.size
        self.pages += pages(seg.size)
        if seg.cache is not None:
            self.cache_parts += 1
            self.cache_pages += pages(seg.size)
        for path in seg.paths:
            self._by_path[path] = checksum

    def pop(self, checksum: str, default: Segment | None = None) -> Segment | None:  # type: ignore[override]
        seg = super().pop(checksum, None)
        if seg is None:
            return default
        self.size -= seg.size
        self.pages -= pages(seg.size)
        if seg.cache is not None:
            self.cache_parts -= 1
            self.cache_pages -= pages(seg.size)
        for path in seg.paths:
            if self._by_path.get(path) == checksum:
                del self._by_path[path]
        return seg

    def serving(self, path: str) -> Segment | None:
        """The segment a load of `path` registered last, if it is still here."""
        checksum = self._by_path.get(path)
        return None if checksum is None else self.get(checksum)

    def add_path(self, seg: Segment, path: str) -> None:
        if path not in seg.paths:
            seg.paths.append(path)
        self._by_path[path] = seg.checksum

    def remove_path(self, seg: Segment, path: str) -> None:
        seg.paths.remove(path)
        if self._by_path.get(path) == seg.checksum:
            del self._by_path[path]


def adopt_segment(entry: dict[str, Any], uid: int, new_name: str) -> Segment:
    """Take over a dead daemon's segment under `new_name`, after checking every byte of it.

    Raises:
        ValueError, OSError, StoreError: It is not ours, not intact, or not what the state file says;
            the segment is then removed.
    """
    old = str(entry["name"])
    checksum = str(entry["checksum"])
    if not SEGMENT_RE.match(old):
        msg = "not one of ours"
        raise ValueError(msg)
    # Renaming to our pid first: if we die now, gc knows whom the segment belongs to.
    (SHM_DIR / old).rename(SHM_DIR / new_name)
    fd = os.open(SHM_DIR / new_name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if st.st_uid != uid or not stat.S_ISREG(st.st_mode) or st.st_mode & 0o222:
            msg = "wrong owner, type or mode"
            raise ValueError(msg)
        paths = [str(p) for p in entry["paths"]]
        # A previous daemon's segment: its owner could have changed it since, so check it all.
        store = _core.Store._from_fd(fd, paths[0] if paths else new_name, True)
        store.verify()
        if store.checksum != checksum or store.file_size != int(entry["size"]):
            msg = "contents do not match the state file"
            raise ValueError(msg)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            (SHM_DIR / new_name).unlink()
        raise
    return Segment(
        new_name,
        checksum,
        fd,
        store,
        st.st_size,
        len(store),
        paths,
        float(entry["loaded_at"]),
        0.0,
        adopted=True,
    )


def adopt_previous(
    state_file: Path, uid: int, segment_name: Callable[[str], str]
) -> list[tuple[Segment, bool]]:
    """Take over the segments a dead daemon's state file lists; unlink what cannot be adopted, and its leftovers.

    A bad state file is set aside with a warning. Returns each adopted segment, and whether it was
    loaded because a rank held it.

    Raises:
        DaemonError: The daemon that wrote the state file is alive.
    """
    try:
        state = read_state(state_file)
    except ValueError as e:
        set_aside(state_file, e)  # a successor of ours must not trip over it either
        return []
    if state is None:
        return []
    old_pid, old_start = int(state["pid"]), int(state["start_time"])
    if daemon_alive(uid, old_pid, old_start):
        msg = f"the smstore daemon pid {old_pid} still owns {state_file}; stop it first"
        raise DaemonError(msg)
    adopted: dict[str, tuple[Segment, bool]] = {}
    for entry in state["segments"]:
        try:
            checksum = str(entry["checksum"])
            if checksum in adopted:
                msg = "a duplicate"
                raise ValueError(msg)
            seg = adopt_segment(entry, uid, segment_name(checksum))
        except (OSError, StoreError, ValueError, KeyError, TypeError, OverflowError) as e:
            name = entry.get("name") if isinstance(entry, dict) else entry
            log.warning("could not adopt segment %s: %s; removing it", name, e)
            if isinstance(name, str):
                unlink_quietly(name)
            continue
        adopted[seg.checksum] = (seg, entry.get("held") is True)
        log.info(
            "adopted %s (%s, %d bytes) from dead daemon",
            ", ".join(seg.paths) or seg.name,
            seg.checksum,
            seg.size,
        )
    # Whatever else the dead daemon left (a load it did not finish, its lock) goes.
    for name in list_segments(old_pid, old_start):
        log.info("removing leftover segment %s of dead daemon %d", name, old_pid)
        unlink_quietly(name)
    DaemonLock.remove_stale(uid, old_pid, old_start)
    return list(adopted.values())


def unlink_quietly(name: str) -> None:
    """Remove a segment by name if it is still there."""
    with contextlib.suppress(OSError, StoreError):
        _core.shm_unlink("/" + name)


# ---- garbage collection --------------------------------------------------------------------------


def _answers(sock: Path) -> bool:
    """Whether something listens on the socket `sock`."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(2.0)
        probe.connect(os.fspath(sock))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def collect_garbage(sock: str | os.PathLike[str] | None = None) -> list[str]:
    """Unlink the segments (and stale socket and state files) of this user's daemons that died.

    Segments whose daemon is alive are never touched: the pid and start time in a segment's name
    must both match a running process for it to count as alive.

    Args:
        sock: The daemon socket whose stale socket and state file to remove (default: as
            ``smstore serve`` picks it).

    Returns:
        The removed paths.
    """
    removed: list[str] = []
    uid = os.getuid()
    for name in list_segments():
        m = SEGMENT_RE.match(name)
        assert m is not None  # list_segments() matched it
        try:
            st = os.lstat(SHM_DIR / name)
        except FileNotFoundError:
            continue
        if st.st_uid != uid or daemon_alive(uid, int(m.group(2)), int(m.group(3))):
            continue
        if _core.shm_unlink("/" + name):
            removed.append(os.fspath(SHM_DIR / name))
    prefix = f"smstore-{uid}-"
    for name in sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(prefix)):
        m = LOCK_RE.match(name)
        if (
            m
            and not daemon_alive(uid, int(m.group(2)), int(m.group(3)))
            and DaemonLock.remove_stale(uid, int(m.group(2)), int(m.group(3)))
        ):
            removed.append(os.fspath(SHM_DIR / name))
    path = socket_path(sock)
    state_file = state_path(path)
    try:
        info = read_state(state_file)
        dead = info is not None and not daemon_alive(uid, int(info["pid"]), int(info["start_time"]))
    except ValueError as e:
        # Not a state file: it says nothing of a daemon, so the socket goes only if none answers.
        bad = set_aside(state_file, e)
        if bad is not None:
            removed.append(os.fspath(state_file))
        dead = not _answers(path)
    if dead:
        for p in (path, state_file):
            if p.exists() or p.is_socket():
                p.unlink(missing_ok=True)
                removed.append(os.fspath(p))
    return removed
