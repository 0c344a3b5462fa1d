"""`smstore serve`: the node daemon that holds one shared-memory copy of each blob and hands it to clients."""

from __future__ import annotations

import contextlib
import fcntl
import grp
import itertools
import json
import logging
import os
import queue
import re
import resource
import selectors
import signal
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Any

from smstore import _core
from smstore._connections import Conn, Limits, ProtocolError, Server
from smstore._ipc import ensure_private_dir, process_start_time, socket_path
from smstore._manifest import Manifest, manifest_file, read_manifest
from smstore._pack import human_bytes
from smstore._segments import (
    SHM_DIR,
    DaemonLock,
    Segment,
    SegmentTable,
    adopt_segment,
    daemon_alive,
    list_segments,
    new_segment_name,
    pages,
    read_state,
    set_aside,
    state_path,
    unlink_quietly,
    write_state,
)
from smstore._store import explain_not_a_blob, read_checksum
from smstore.errors import DaemonError, SharedMemoryError, StoreChangedError, StoreError, StoreFormatError

__all__ = ["Daemon", "Limits", "serve"]

log = logging.getLogger("smstore.daemon")

# What the loader thread hands back: a new segment (name, fd, checksum, seconds), the checksum of
# one already loaded, or the error.
LoadResult = tuple[str, int, str, float] | str | Exception

# A file's identity as stat sees it: a failed held load is retried only once this changes.
FileIdentity = tuple[int, int, int, int]


def _identity(path: str) -> FileIdentity | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _peer_groups(pid: int) -> set[int]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Groups:"):
                return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()


def _checksum_arg(req: dict[str, Any]) -> str | None:
    value = req.get("checksum")
    if value is None:
        return None
    if not (isinstance(value, str) and len(value) == 16 and all(c in "0123456789abcdef" for c in value)):
        raise ProtocolError("bad_request", "'checksum' must be 16 lowercase hex digits")
    return value


# A content key of a shared blob, e.g. "blake2b-128:<32 hex>" (SharedList's hash of its records).
_KEY_RE = re.compile(r"^[a-z0-9-]{1,32}:[0-9a-f]{16,128}$")
_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK


def _key_arg(req: dict[str, Any], *, required: bool) -> str | None:
    value = req.get("key")
    if value is None and not required:
        return None
    if not (isinstance(value, str) and _KEY_RE.match(value)):
        raise ProtocolError("bad_request", "'key' must be '<algorithm>:<16 to 128 hex digits>'")
    return value


def _path_arg(req: dict[str, Any], *, required: bool) -> str | None:
    value = req.get("path")
    if value is None and not required:
        return None
    return _path_value(value)


def _path_value(value: object) -> str:
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value or len(value) > 4096:
        raise ProtocolError(
            "bad_request", "'path' must be an absolute path (at most 4096 characters, no NUL)"
        )
    try:
        value.encode()
    except UnicodeEncodeError:
        # A file name that is not UTF-8 reaches us as lone surrogates: refuse it here, in the request,
        # rather than in the loader thread.
        raise ProtocolError("bad_request", f"'path' is not valid UTF-8: {value!r}") from None
    return value


def _not_served(what: str, why: str | None = None) -> dict[str, Any]:
    """The one refusal of an attach the daemon cannot serve (now, and not later either)."""
    message = f"no segment holds {what}" + (f": {why}" if why else "")
    return {"ok": False, "error": "not_served", "message": message}


def _page_arg(req: dict[str, Any]) -> tuple[int, int]:
    """A 'status' request's page of segments: (offset, limit)."""
    offset, limit = req.get("offset", 0), req.get("limit", STATUS_PAGE)
    if type(offset) is not int or type(limit) is not int or offset < 0 or not 0 <= limit <= STATUS_PAGE:
        msg = f"'offset' must be an integer >= 0 and 'limit' one from 0 to {STATUS_PAGE}"
        raise ProtocolError("bad_request", msg)
    return offset, limit


def _sized(size: int) -> str:
    """A byte count for a message: ``64.0 KiB (65536 bytes)``."""
    return f"{size} bytes" if size < 1024 else f"{human_bytes(size)} ({size} bytes)"


_pages = pages

# The loader thread's nice value (relative to 0): below the training processes.
LOADER_NICENESS = 10

# Seconds the loader thread rests after freeing a released segment.
FREE_PAUSE = 0.005

# The state file is written once the changes reach 1/STATE_FRACTION of its segments, or after
# STATE_DELAY seconds without a change.
STATE_FRACTION = 8
STATE_DELAY = 1.0

# A status reply lists at most this many segments, in at most STATUS_BYTES of JSON (a page: the
# request's "offset" asks for the next), and at most STATUS_LIST entries of each other list.
STATUS_PAGE = 1000
STATUS_BYTES = 256 << 10
STATUS_LIST = 20

# Manifests kept parsed (one per dataset a job holds shards of; more only from a hostile client).
MAX_MANIFESTS = 64

# At most this many shards in one 'hold' (a window and the next of a large dataset fit many times).
MAX_HOLD = 65536


def set_background_scheduling() -> bool:
    """Put the calling thread (and the threads it starts from now on) under ``SCHED_BATCH``.

    A batch thread gets its fair share of the CPU but never preempts the thread running when it
    wakes up. On a node whose cores all train, a daemon woken by a rank's request would otherwise
    take that rank's core at once, and the rank's batch would wait for the daemon's bookkeeping.
    Returns False where the system does not offer it.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError) as e:
        log.info("SCHED_BATCH is not available (%s): the daemon runs under the default policy", e)
        return False
    return True


def _hold_arg(req: dict[str, Any]) -> tuple[str, list[int]]:
    """A 'hold' request: the manifest, and the indices of its shards in the order to load them."""
    manifest = _path_value(req.get("manifest"))
    value = req.get("shards")
    if not isinstance(value, str) or len(value) > 16 * MAX_HOLD:
        raise ProtocolError("bad_request", "'shards' must be a string of comma-separated shard indices")
    try:
        shards = [int(k) for k in value.split(",")] if value else []
    except ValueError:
        raise ProtocolError(
            "bad_request", "'shards' must be a string of comma-separated shard indices"
        ) from None
    if len(shards) > MAX_HOLD or any(k < 0 for k in shards):
        raise ProtocolError("bad_request", f"'shards' must hold at most {MAX_HOLD} indices, each >= 0")
    return manifest, shards


class Daemon(Server):
    """The daemon's state, its requests and its event loop. See docs/daemon.md.

    Args:
        sock_path: Where to listen.
        group: Share segments and the socket with this group (read-only), or None for this user only.
        shm_limit: Pretend /dev/shm holds at most this many bytes for our segments (0: no limit).
        shm_limit_from: Where ``shm_limit`` came from, for the messages that it refuses a load.
        read_rate: Read files at most this many bytes a second (0: no limit), to spare a shared
            file system.
        limits: What clients are allowed (connections, request size, timeouts).
    """

    def __init__(
        self,
        sock_path: Path,
        *,
        group: str | None = None,
        shm_limit: int = 0,
        shm_limit_from: str = "--shm-limit",
        read_rate: int = 0,
        limits: Limits | None = None,
    ) -> None:
        super().__init__(os.getuid(), limits or Limits())
        self.sock_path = sock_path
        self.state_path = state_path(sock_path)
        self.pid = os.getpid()
        start = process_start_time(self.pid)
        if start is None:
            msg = "cannot read this process's start time from /proc"
            raise DaemonError(msg)
        self.start_time = start
        self.gid: int | None = grp.getgrnam(group).gr_gid if group else None
        self.shm_limit = shm_limit
        self.shm_limit_from = shm_limit_from
        self.read_rate = read_rate
        self.segments = SegmentTable()
        self.loading: dict[str, list[int]] = {}  # path -> connection ids waiting for it
        # Residency: what each connection (a rank's sampler) holds, in the order to load it; the
        # segments loaded for holds (dropped when no connection holds them); the readers waiting
        # for a held shard still on its way (connection id, checksum), by path.
        self.holds: dict[int, list[tuple[str, str]]] = {}
        self.managed: set[str] = set()
        # Adopted segments a dead predecessor had loaded for holds, not held again since: kept for
        # the ranks to claim when they hold again, released when the holds need their room or
        # release a window (the job has moved past them).
        self.unclaimed: set[str] = set()
        self.hold_loads: dict[str, str] = {}  # paths being loaded because a rank held them -> checksum
        self.attach_waiting: dict[str, list[tuple[int, str]]] = {}
        # Held segments released while readers still map them (they count against --shm-limit
        # until every reader detaches or disconnects): checksum -> (pages, connection ids).
        self.released: dict[str, tuple[int, set[int]]] = {}
        # Parsed manifests by the path a hold names, with the file's identity when it was read.
        self.manifests: dict[str, tuple[tuple[int, int, int, int], Manifest, list[str]]] = {}
        # Held paths whose load failed: path -> (the checksum held, the file's identity then, why).
        # Not loaded again (and a hold naming them is refused) until the file changes.
        self.hold_failed: dict[str, tuple[str, FileIdentity | None, str]] = {}
        # Held checksums the owner unloaded: not loaded again while a hold still names them.
        self.unloaded: set[str] = set()
        # Held paths that wait for room under --shm-limit (a reader asking for one waits too).
        self.waiting_room: set[str] = set()
        self.loads = 0  # loads finished (or failed) since the start
        # The state file: segments it lists, changes since it was written, and when the last came.
        self._state_rows = 0
        self._state_changes = 0
        self._state_changed_at = 0.0
        self.stopping = False
        self.done: queue.Queue[tuple[str, LoadResult]] = queue.Queue()
        # The loader thread's work, in order: a path to load (with the checksum a hold expects of
        # it, if any), a released segment to free, or None (stop).
        self.jobs: queue.Queue[tuple[str, str | None] | Segment | None] = queue.Queue()
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.wake_w.setblocking(False)
        self.loader = threading.Thread(target=self._loader, name="smstore-loader", daemon=True)
        self.lock: DaemonLock | None = None
        # shutdown() removes only what start() made: a second daemon refused on a live socket
        # must leave the socket and state file of the first alone.
        self._owns_socket = False
        self._owns_state = False

    # ---- setup and teardown -------------------------------------------------------------------

    def start(self, files: list[str]) -> None:
        """Claim the socket, adopt a dead predecessor's segments, listen, and queue `files`."""
        with contextlib.suppress(ValueError, OSError):
            _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        parent = self.sock_path.parent
        ensure_private_dir(parent, create=not parent.exists(), group_gid=self.gid)
        self._claim_socket()
        # Held for our whole life: `smstore gc` in another PID namespace, where our pid means
        # nothing, sees that our segments are alive.
        self.lock = DaemonLock.acquire(self.uid, self.pid, self.start_time)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177 if self.gid is None else 0o117)
        try:
            listener.bind(os.fspath(self.sock_path))
        except OSError as e:
            listener.close()
            msg = f"{self.sock_path}: cannot listen there ({e.strerror}); is another daemon starting?"
            raise DaemonError(msg) from None
        finally:
            os.umask(old_umask)
        self._owns_socket = True
        self.listener = listener
        if self.gid is not None:
            os.chown(self.sock_path, -1, self.gid)
        self._adopt_previous()
        listener.listen(128)
        listener.setblocking(False)
        self.sel.register(listener, selectors.EVENT_READ, "listen")
        self.sel.register(self.wake_r, selectors.EVENT_READ, "wake")
        self._owns_state = True
        self._save_state()
        self.loader.start()
        log.info("listening on %s (pid %d)", self.sock_path, self.pid)
        for f in files:
            self._queue_load(os.fspath(Path(f).absolute()), None)

    def _claim_socket(self) -> None:
        if not os.path.lexists(self.sock_path):
            return
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(2.0)
            probe.connect(os.fspath(self.sock_path))
        except (ConnectionRefusedError, FileNotFoundError):
            log.info("removing stale socket %s", self.sock_path)
            self.sock_path.unlink(missing_ok=True)
            return
        except OSError as e:
            msg = f"{self.sock_path}: exists and cannot be probed ({e}); remove it if no daemon uses it"
            raise DaemonError(msg) from None
        finally:
            probe.close()
        msg = f"another smstore daemon is already listening on {self.sock_path}; 'smstore stop' it first"
        raise DaemonError(msg)

    def _adopt_previous(self) -> None:
        """Take over the segments of a dead daemon of this socket; unlink what cannot be adopted."""
        try:
            state = read_state(self.state_path)
        except ValueError as e:
            set_aside(self.state_path, e)  # a successor of ours must not trip over it either
            return
        if state is None:
            return
        old_pid, old_start = int(state["pid"]), int(state["start_time"])
        if daemon_alive(self.uid, old_pid, old_start):
            msg = f"the smstore daemon pid {old_pid} still owns {self.state_path}; stop it first"
            raise DaemonError(msg)
        for entry in state["segments"]:
            try:
                checksum = str(entry["checksum"])
                if checksum in self.segments:
                    msg = "a duplicate"
                    raise ValueError(msg)
                seg = adopt_segment(entry, self.uid, self._segment_name(checksum))
            except (OSError, StoreError, ValueError, KeyError, TypeError, OverflowError) as e:
                name = entry.get("name") if isinstance(entry, dict) else entry
                log.warning("could not adopt segment %s: %s; removing it", name, e)
                if isinstance(name, str):
                    unlink_quietly(name)
                continue
            self.segments[seg.checksum] = seg
            if entry.get("held") is True:
                self.unclaimed.add(seg.checksum)
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
        DaemonLock.remove_stale(self.uid, old_pid, old_start)

    def _segment_name(self, checksum: str) -> str:
        return new_segment_name(self.uid, self.pid, self.start_time, checksum)

    def _state_changed(self) -> None:
        """Note a change of the segments for the state file, and write it if enough changed.

        Writing the whole file at every load made loading N blobs O(N**2) (5,000 took 126 s). It
        is written when the changes since the last write reach an eighth of what it lists (at
        once while it lists under 8 segments), else once no change came for `STATE_DELAY`
        seconds (`flush_state`): N loads write O(N) bytes in all. A daemon killed meanwhile
        leaves those latest segments out; its successor removes them as leftovers.
        """
        self._state_changes += 1
        self._state_changed_at = time.monotonic()
        if self._state_changes >= max(1, self._state_rows // STATE_FRACTION):
            self._save_state()

    def flush_state(self) -> None:
        """Write the changes the state file is missing once the segments stopped changing."""
        if self._state_changes and time.monotonic() - self._state_changed_at >= STATE_DELAY:
            self._save_state()

    def _save_state(self) -> None:
        """Record our segments for a successor; a failure (a full disk) costs only that, never the daemon."""
        entries = [  # a memfd cannot be adopted
            s.state_entry(held=s.checksum in self.managed or s.checksum in self.unclaimed)
            for s in self.segments.values()
            if not s.shared
        ]
        state = {
            "pid": self.pid,
            "start_time": self.start_time,
            "socket": os.fspath(self.sock_path),
            "segments": entries,
        }
        self._state_changes = 0
        self._state_rows = len(entries)
        try:
            write_state(self.state_path, state)
            log.debug("state file written: %d segment(s)", self._state_rows)
        except OSError as e:
            log.error(
                "cannot write the state file %s (%s): a restarted daemon will not adopt the segments",
                self.state_path,
                e,
            )

    def shutdown(self) -> None:
        """Unlink every segment, and the socket and state file if we made them. Clients keep their mappings."""
        self.stopping = True
        self.jobs.put(None)
        try:
            for seg in list(self.segments.values()):
                self._drop(seg)
            self.close_all()
            if self.listener is not None:
                self.listener.close()
            if self._owns_socket:
                self.sock_path.unlink(missing_ok=True)
            if self._owns_state:
                self.state_path.unlink(missing_ok=True)
            if self.loader.is_alive():
                # A load still running writes on into a segment that is unlinked here and freed at exit.
                self.loader.join(timeout=0.1)
            while True:  # released segments the loader thread had not freed yet
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if isinstance(job, Segment):
                    with contextlib.suppress(OSError, StoreError):
                        job.close()
        finally:
            # Whatever failed above (a descriptor short for listing /dev/shm), the segments and the
            # lock still go: a successor or `smstore gc` would otherwise find them.
            if self.lock is not None:
                try:
                    for name in list_segments(self.pid, self.start_time):
                        unlink_quietly(name)
                except OSError as e:
                    log.error("cannot list /dev/shm to remove our segments: %s", e)
                self.lock.release()
                self.lock = None
        log.info("stopped")

    def _drop(self, seg: Segment) -> None:
        seg.close()
        self.segments.pop(seg.checksum, None)
        self.managed.discard(seg.checksum)
        self.unclaimed.discard(seg.checksum)

    # ---- loading (a thread, so that a slow filesystem never blocks attaching clients) -----------

    def _loader(self) -> None:
        # Loads are background work: at a lower CPU priority (this thread, and the copying thread
        # each load starts, which inherits it), they never slow the training processes on a busy
        # node; idle cores still run them at full speed.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOADER_NICENESS)
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if isinstance(job, Segment):
                # Freeing a released segment's pages takes milliseconds a 10 MiB: here, at the
                # loader's priority, before any load queued after it counts on the room.
                with contextlib.suppress(OSError, StoreError):
                    job.close()
                time.sleep(FREE_PAUSE)  # one segment's pages at a time: spread over a busy node's CPUs
                continue
            path, expected = job
            try:
                result: LoadResult = self._load_one(path, expected)
            except Exception as e:  # noqa: BLE001 - every load gets an answer (the error); none ends the thread
                result = e
            if self.stopping and isinstance(result, tuple):
                unlink_quietly(result[0])
                os.close(result[1])
                return
            self.done.put((path, result))
            with contextlib.suppress(OSError):
                self.wake_w.send(b"x")

    def _load_one(self, path: str, expected: str | None) -> tuple[str, int, str, float] | str:
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
            return checksum  # same contents already loaded (under this or another path)
        used = self._shm_used()
        room = 0
        if self.shm_limit:
            room = max(1, self.shm_limit - used)
            self._check_limit(path, used)
        name = self._segment_name(checksum or "0" * 16)
        mode = 0o400 if self.gid is None else 0o440
        t0 = time.monotonic()
        gid = -1 if self.gid is None else self.gid
        try:
            fd, _size, ck, _n = _core.shm_load(path, "/" + name, mode, gid, room, self.read_rate)
        except StoreFormatError as e:
            raise explain_not_a_blob(path, e) from None
        if ck != checksum:  # the file was replaced between the two reads
            os.close(fd)
            _core.shm_unlink("/" + name)
            msg = f"{path}: the file changed while it was being loaded; try again"
            raise DaemonError(msg)
        return name, fd, ck, time.monotonic() - t0

    def _check_limit(self, path: str, used: int) -> None:
        """Refuse a load that --shm-limit leaves no room for, blaming the limit (not /dev/shm).

        Raises:
            SharedMemoryError: The blob does not fit under the limit, and /dev/shm has more room
                than the limit leaves (else the loader's own message, about /dev/shm, is right).
        """
        try:
            needed = _pages(os.stat(path).st_size)
        except OSError:
            return  # the load says what is wrong with the file
        room = max(0, self.shm_limit - used)
        if needed <= room or _core.shm_space(os.fspath(SHM_DIR))[0] < room:
            return
        msg = (
            f"{path}: not enough shared memory under the daemon's limit: loading it needs "
            f"{_sized(needed)}, but {self.shm_limit_from} is {_sized(self.shm_limit)} and the daemon's "
            f"segments use {_sized(used)} of it. Raise {self.shm_limit_from}, unload blobs the daemon "
            'serves (smstore unload FILE), or read the file directly: mode="mmap".'
        )
        raise SharedMemoryError(msg)

    def _shm_used(self) -> int:
        """Bytes of our segments, for --shm-limit (the loader thread calls it too)."""
        return self.segments.size

    def _queue_load(
        self, path: str, cid: int | None, *, quiet: bool = False, expected: str | None = None
    ) -> None:
        first = path not in self.loading
        waiters = self.loading.setdefault(path, [])
        if cid is not None:
            waiters.append(cid)
            self.set_busy(cid, True)
        if first:
            self.jobs.put((path, expected))
            if not quiet:
                log.info("loading %s", path)

    def _finish_loads(self) -> None:
        while True:
            try:
                path, result = self.done.get_nowait()
            except queue.Empty:
                return
            waiters = self.loading.pop(path, [])
            self.loads += 1
            for_hold = path in self.hold_loads
            expected = self.hold_loads.pop(path, None)
            reply: dict[str, Any]
            failure: str | None = None
            if isinstance(result, Exception):
                log.error("failed to load %s: %s", path, result)
                failure = str(result)[:1000]
                held = expected or next((ck for ck, p in self._wanted().items() if p == path), None)
                if held is not None:
                    self.hold_failed[path] = (held, _identity(path), failure)
                reply = {"ok": False, "error": type(result).__name__, "message": failure}
            else:
                checksum = result if isinstance(result, str) else result[2]
                fresh = checksum not in self.segments
                # Held now, or loaded for a hold that moved on while it loaded (and asked for by no
                # one else): the holds manage it, and _reconcile below drops it if none holds it.
                # Marked before _register writes the state file, which records it as held.
                if any(path in (p for p, _ in held) for held in self.holds.values()) or (
                    for_hold and fresh and not waiters
                ):
                    self.managed.add(checksum)
                seg = self._register(path, result)
                reply = {"ok": True, **self._describe(seg)}
            for cid in waiters:
                self.set_busy(cid, False)
                self.reply(cid, reply)
                self.parse(cid)
            for cid, checksum in self.attach_waiting.pop(path, []):
                conn = self.conns.get(cid)
                if conn is None:
                    continue
                self.set_busy(cid, False)
                seg_now = self.segments.get(checksum)
                if seg_now is None:
                    self.reply(cid, _not_served(checksum, failure))
                else:
                    self._attach(cid, conn, seg_now)
                self.parse(cid)
            self._reconcile()

    def _register(self, path: str, result: tuple[str, int, str, float] | str) -> Segment:
        # The generation this path held before (if other contents): no longer served by this path.
        previous = self.segments.serving(path)
        if isinstance(result, str):
            seg = self.segments[result]
            self.segments.add_path(seg, path)
        elif result[2] in self.segments:
            # Another path with the same contents finished loading first: keep one copy.
            name, fd, ck, _seconds = result
            unlink_quietly(name)
            os.close(fd)
            seg = self.segments[ck]
            self.segments.add_path(seg, path)
        else:
            name, fd, ck, seconds = result
            store = _core.Store._from_fd(fd, path, False)
            seg = Segment(name, ck, fd, store, store.file_size, len(store), [path], time.time(), seconds)
            self.segments[seg.checksum] = seg
            log.info(
                "loaded %s: %d records, %d bytes in %.2f s (%.0f MiB/s) as /dev/shm/%s",
                path,
                seg.records,
                seg.size,
                seconds,
                seg.size / max(seconds, 1e-9) / 2**20,
                name,
            )
        if previous is not None and previous is not seg and path in previous.paths:
            self.segments.remove_path(previous, path)
            if not previous.paths:
                log.info("%s was rewritten: unloading the old generation %s", path, previous.checksum)
                self._drop(previous)
        self._state_changed()
        return seg

    # ---- requests -----------------------------------------------------------------------------

    def allowed(self, conn: Conn) -> str | None:
        if conn.owner:
            return None
        if self.gid is not None and (conn.gid == self.gid or self.gid in _peer_groups(conn.pid)):
            return None
        served = f"uid {self.uid}" if self.gid is None else f"uid {self.uid} and group {self.gid}"
        return f"uid {conn.uid} may not use this smstore daemon (it serves {served} only)"

    def handle(self, cid: int, conn: Conn, req: dict[str, Any]) -> None:
        op = req.get("op")
        if op == "attach":
            checksum, key = _checksum_arg(req), _key_arg(req, required=False)
            if key is not None:
                seg = next((s for s in self.segments.values() if s.key == key), None)
            else:
                seg = self.segments.get(checksum) if checksum is not None else None
            path = _path_arg(req, required=False)
            if seg is None and checksum is not None and path is not None and self._on_its_way(path, checksum):
                # A held shard on its way (loading, or waiting for room): answer when its load ends.
                # No file is read for this that a rank did not ask for.
                self.attach_waiting.setdefault(path, []).append((cid, checksum))
                self.set_busy(cid, True)
                return
            if seg is None:
                why = (
                    self._why_not_held(path, checksum) if path is not None and checksum is not None else None
                )
                self.reply(cid, _not_served(str(key or checksum), why))
                return
            self._attach(cid, conn, seg)
        elif op == "held":
            # What the ranks hold, so that readers attach it before they read it.
            self.reply(cid, {"ok": True, "shards": [[p, c] for c, p in self._wanted().items()]})
        elif op == "detach":
            self._detach(cid, conn, _checksum_arg(req), reply=req.get("noreply") is not True)
        elif op == "status":
            self.reply(cid, self._status(*_page_arg(req)))
        elif op in ("load", "unload", "stop", "share", "hold") and not conn.owner:
            # Loading reads files with the daemon's rights and stopping affects everyone: owner only.
            raise ProtocolError("permission_denied", f"only uid {self.uid} may {op}")
        elif op == "load":
            path = _path_arg(req, required=True)
            assert path is not None
            self._queue_load(path, cid)
        elif op == "unload":
            self._unload(cid, _checksum_arg(req), _path_arg(req, required=False))
        elif op == "share":
            self._share(cid, conn, req)
        elif op == "hold":
            self._hold(cid, *_hold_arg(req), reply=req.get("noreply") is not True)
        elif op == "stop":
            self.reply(cid, {"ok": True, "pid": self.pid})
            self.stopping = True
        else:
            raise ProtocolError("bad_request", f"unknown op {str(op)[:100]!r}")

    # ---- residency: shards held by the ranks of a job, loaded ahead within the budget ----------

    def _hold(self, cid: int, manifest_path: str, indices: list[int], *, reply: bool) -> None:
        """Replace what connection `cid` holds; load what no one has loaded yet, drop what no one holds.

        The reply comes at once (none with ``"noreply": true``, unless the request is refused):
        loads run in the background, in the order given (the window being read first, then the
        next). A shard larger than the whole --shm-limit is refused here.
        """
        try:
            manifest, paths = self._manifest(manifest_path)
        except StoreError as e:
            raise ProtocolError("bad_request", str(e)[:1000]) from None
        if any(k >= len(manifest.shards) for k in indices):
            raise ProtocolError("bad_request", f"{manifest_path} has {len(manifest.shards)} shards")
        shards = [(paths[k], manifest.shards[k].checksum) for k in indices]
        if self.shm_limit:
            for path, _checksum in shards:
                try:
                    size = os.stat(path).st_size
                except OSError as e:
                    raise ProtocolError("not_found", f"{path}: {e.strerror}") from None
                if _pages(size) > self.shm_limit:
                    msg = (
                        f"{path}: a shard of {size} bytes does not fit the daemon's --shm-limit of "
                        f"{self.shm_limit} bytes; raise the limit or pack smaller shards"
                    )
                    raise ProtocolError("no_room", msg)
        for path, checksum in shards:
            why = self._failed(path, checksum)
            if why is not None:
                # Every rank holding it hears so at its next hold: no load, release, reload loop.
                raise ProtocolError("load_failed", f"a held shard cannot be loaded: {why}")
        if shards:
            self.holds[cid] = shards
        else:
            self.holds.pop(cid, None)
        if reply:
            resident = [ck for _p, ck in shards if ck in self.segments]
            self.reply(cid, {"ok": True, "resident": len(resident), "held": len(shards)})
            self.flush(cid)  # the rank goes on at once; releases and loads follow
        self._reconcile()

    def _on_its_way(self, path: str, checksum: str) -> bool:
        """Whether the shard at `path` holding `checksum` is loading, or held and waiting for room."""
        if path in self.loading:
            return True
        return path in self.waiting_room and self._wanted().get(checksum) == path

    def _why_not_held(self, path: str, checksum: str) -> str | None:
        """Why a held shard is not served (its load failed, or the owner unloaded it), if it is one."""
        if checksum in self.unloaded:
            return f"{path} was unloaded ('smstore unload') while held"
        return self._failed(path, checksum)

    def _failed(self, path: str, checksum: str) -> str | None:
        """Why the held load of `path` (holding `checksum`) failed, while the file is still the one that failed."""
        entry = self.hold_failed.get(path)
        if entry is None:
            return None
        held, identity, why = entry
        if held == checksum and identity is not None and identity == _identity(path):
            return why
        del self.hold_failed[path]  # the file changed (or another checksum is held): try again
        return None

    def _manifest(self, path: str) -> tuple[Manifest, list[str]]:
        """The manifest at `path` and its shards' absolute paths, parsed again only if the file changed.

        Every rank holds at every window: parsing a manifest of thousands of shards each time
        would be milliseconds of the daemon's core at each window switch.
        """
        try:
            st = os.stat(manifest_file(path))
            key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            key = None  # read_manifest says what is wrong
        cached = self.manifests.get(path)
        if key is not None and cached is not None and cached[0] == key:
            return cached[1], cached[2]
        manifest = read_manifest(path)
        paths = [os.path.abspath(manifest.shard_path(k)) for k in range(len(manifest.shards))]
        if key is not None:
            if len(self.manifests) >= MAX_MANIFESTS:
                self.manifests.clear()
            self.manifests[path] = (key, manifest, paths)
        return manifest, paths

    def _detach(self, cid: int, conn: Conn, checksum: str | None, *, reply: bool) -> None:
        """A reader unmapped a segment (it stays attached through its connection otherwise).

        With ``"noreply": true`` nothing is sent back: a reader releasing shards never waits.
        """
        if checksum is None:
            raise ProtocolError("bad_request", "'detach' needs a checksum")
        # Any connection of the process speaks for all of them: a reader blocked waiting on one
        # connection detaches through another.
        cids = [c for c, other in self.conns.items() if other.pid == conn.pid and other.uid == conn.uid]
        seg = self.segments.get(checksum)
        freed = False
        for c in cids:
            self.conns[c].attached.discard(checksum)
            if seg is not None:
                seg.clients.pop(c, None)
            freed = self._forget_released(c, checksum) or freed
        if freed:
            self._reconcile()
        if reply:
            self.reply(cid, {"ok": True})

    def _forget_released(self, cid: int, checksum: str) -> bool:
        """Connection `cid` no longer maps released segment `checksum`; True if its memory is free now."""
        entry = self.released.get(checksum)
        if entry is None:
            return False
        entry[1].discard(cid)
        if entry[1]:
            return False
        del self.released[checksum]
        return True

    def _wanted(self) -> dict[str, str]:
        """Checksum -> path of every held shard, in priority order (each holder's order, merged)."""
        wanted: dict[str, str] = {}
        lists = list(self.holds.values())
        for depth in range(max((len(h) for h in lists), default=0)):
            for held in lists:
                if depth < len(held):
                    path, checksum = held[depth]
                    wanted.setdefault(checksum, path)
        return wanted

    def _reconcile(self) -> None:
        """Drop the held segments no connection holds any more; queue loads of held shards that fit."""
        # One log line for each kind of change, however many shards: a window switch releases and
        # loads a window's worth on the daemon's loop, inside the switch (a line costs ~35 us).
        wanted = self._wanted()
        # (_drop and _release, the only ways out of self.segments, keep both sets to segments we have.)
        claimed = self.unclaimed & wanted.keys()  # held again: the holds manage them from now on
        self.unloaded &= wanted.keys()  # unloaded shards are loaded again once a hold names them anew
        self.unclaimed -= claimed
        self.managed |= claimed
        dropped = [self._release(self.segments[ck]) for ck in self.managed - wanted.keys()]
        if dropped:
            # The holds moved past a window: what a dead predecessor held that no rank claimed
            # since belongs to a window behind it.
            dropped += [self._release(self.segments[ck]) for ck in list(self.unclaimed)]
        used = self.segments.pages + sum(n for n, _ in self.released.values())
        queued: list[str] = []
        self.waiting_room = set()
        full = False
        for checksum, path in wanted.items():
            if checksum in self.segments or checksum in self.unloaded or self._failed(path, checksum):
                continue
            try:
                size = _pages(os.stat(path).st_size)
            except OSError:
                continue  # the load would fail: the reader falls back to (and reports) the file
            while not full and self.shm_limit and used + size > self.shm_limit and self.unclaimed:
                # Room for a held shard comes first: the oldest unclaimed adopted segment goes.
                seg = min((self.segments[ck] for ck in self.unclaimed), key=lambda s: s.loaded_at)
                dropped.append(self._release(seg))
                used -= _pages(seg.size)
            if full or (self.shm_limit and used + size > self.shm_limit):
                full = True  # later shards wait until earlier ones are released
                if path not in self.loading:
                    self.waiting_room.add(path)
                continue
            used += size
            if path not in self.loading:
                self._queue_load(path, None, quiet=True, expected=checksum)
                self.hold_loads[path] = checksum
                queued.append(path)
        for path in list(self.attach_waiting):
            if path not in self.loading and path not in self.waiting_room:
                # Not on its way (no longer held, its load failed, unloaded): the readers hear so now.
                for cid, checksum in self.attach_waiting.pop(path):
                    if cid in self.conns:
                        self.set_busy(cid, False)
                        self.reply(cid, _not_served(checksum, self._why_not_held(path, checksum)))
                        self.parse(cid)
        if dropped:
            log.info("releasing %d shard(s) no rank holds: %s", len(dropped), "; ".join(dropped))
            self._state_changed()
        if queued:
            log.info("loading %d held shard(s): %s", len(queued), ", ".join(queued))

    def _release(self, seg: Segment) -> str:
        """Stop serving a held segment no rank holds; its pages count until every reader unmaps it."""
        self.managed.discard(seg.checksum)
        self.unclaimed.discard(seg.checksum)
        # Only the owner's processes pin a released segment's pages in the budget: a group member
        # who keeps a segment mapped must never stall the owner's loads (docs/daemon.md, "Groups").
        pinning = {c for c in seg.clients if (conn := self.conns.get(c)) is not None and conn.owner}
        if pinning:
            self.released[seg.checksum] = (_pages(seg.size), pinning)
        self.segments.pop(seg.checksum, None)
        self.jobs.put(seg)  # unlinked and freed by the loader thread, off this loop
        return f"{', '.join(seg.paths)} ({seg.checksum})"

    def _attach(self, cid: int, conn: Conn, seg: Segment) -> None:
        seg.clients[cid] = conn.pid
        conn.attached.add(seg.checksum)
        self.reply(cid, {"ok": True, **self._describe(seg)}, fd=seg.fd)

    def _share(self, cid: int, conn: Conn, req: dict[str, Any]) -> None:
        """Serve a blob a client built in a sealed memfd (sent with the request) under its content key.

        The daemon holds it while any client is attached (the sharer included) and drops it after.
        """
        key = _key_arg(req, required=True)
        fd = conn.take_fd()
        if fd is None:
            raise ProtocolError("bad_request", "'share' needs the blob's descriptor sent with the request")
        try:
            st = os.fstat(fd)
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:  # EINVAL: a file that cannot be sealed at all
                seals = 0
            if not stat.S_ISREG(st.st_mode) or seals & _SEALS != _SEALS:
                raise ProtocolError(
                    "bad_request", "'share' takes a sealed memfd (write, grow and shrink seals)"
                )
            if self.shm_limit and st.st_size + self._shm_used() > self.shm_limit:
                msg = f"a shared blob of {st.st_size} bytes does not fit the daemon's --shm-limit"
                raise ProtocolError("no_room", msg)
            # Sealed: its bytes can no longer change, so validating the index once makes every read safe.
            store = _core.Store._from_fd(fd, f"shared {key}", True)
        except BaseException:
            os.close(fd)
            raise
        seg = self.segments.get(store.checksum)
        if seg is None:
            seg = Segment(
                "", store.checksum, fd, store, store.file_size, len(store), [], time.time(), 0.0, key=key
            )
            self.segments[seg.checksum] = seg
            log.info(
                "serving shared blob %s (%s, %d bytes) from pid %d", key, seg.checksum, seg.size, conn.pid
            )
        else:
            store.close()
            os.close(fd)
        self._attach(cid, conn, seg)

    def _unload(self, cid: int, checksum: str | None, path: str | None) -> None:
        seg = self.segments.get(checksum) if checksum is not None else None
        if seg is None and path is not None:
            seg = self.segments.serving(path)
        if seg is None:
            raise ProtocolError("not_served", f"{path or checksum} is not loaded")
        info = self._describe(seg)
        if seg.checksum in self._wanted():
            self.unloaded.add(seg.checksum)  # not loaded again for the holds naming it now
        self._drop(seg)
        self._state_changed()
        log.info(
            "unloaded %s (%s); %d client(s) still map it",
            ", ".join(seg.paths),
            seg.checksum,
            len(info["clients"]),
        )
        self.reply(cid, {"ok": True, **info})
        self._reconcile()  # readers waiting for it hear at once

    def _describe(self, seg: Segment) -> dict[str, Any]:
        pids = sorted({p for p in seg.clients.values() if Path(f"/proc/{p}").exists()})
        return {
            "checksum": seg.checksum,
            "segment": f"memfd:{seg.key}" if seg.shared else "/" + seg.name,
            "key": seg.key,
            "paths": seg.paths,
            "size": seg.size,
            "records": seg.records,
            "loaded_at": seg.loaded_at,
            "load_seconds": seg.load_seconds,
            "adopted": seg.adopted,
            "clients": pids,
        }

    def _status(self, offset: int, limit: int) -> dict[str, Any]:
        """A summary, and a page of `limit` segments from `offset` (in load order) with every list capped.

        Every reply fits a message, whatever the daemon holds (100,000 segments, paths of 4 KiB):
        ``next_offset`` is where the next page starts (None after the last), and the lists other
        than ``segments`` hold their first entries (their lengths are in ``counts``).
        """
        available, total = _core.shm_space(os.fspath(SHM_DIR))
        page: list[dict[str, Any]] = []
        size = 0
        next_offset: int | None = None
        for k, seg in enumerate(itertools.islice(self.segments.values(), offset, None)):
            if len(page) == limit or size > STATUS_BYTES:
                next_offset = offset + k
                break
            entry = self._describe(seg)
            size += len(json.dumps(entry))
            page.append(entry)
        failed = [
            {"path": p, "checksum": ck, "message": why} for p, (ck, _i, why) in self.hold_failed.items()
        ]
        return {
            "ok": True,
            "pid": self.pid,
            "uid": self.uid,
            "socket": os.fspath(self.sock_path),
            "version": _core.__version__,
            "shm": {
                "available": available,
                "total": total,
                "limit": self.shm_limit,
                "limit_from": self.shm_limit_from,
                "used": self._shm_used(),
            },
            "counts": {
                "segments": len(self.segments),
                "loading": len(self.loading),
                "held": len(self.managed),
                "unclaimed": len(self.unclaimed),
                "released": len(self.released),
                "failed": len(failed),
            },
            "segments": page,
            "offset": offset,
            "next_offset": next_offset,
            "loading": sorted(self.loading)[:STATUS_LIST],
            "held": sorted(self.managed)[:STATUS_PAGE],  # checksums loaded because a rank holds them
            "unclaimed": sorted(self.unclaimed)[
                :STATUS_PAGE
            ],  # adopted, held by a dead predecessor, not since
            "released": sorted(self.released)[:STATUS_PAGE],  # released held segments readers still map
            # Held shards whose load failed, not tried again until their file changes.
            "failed": failed[:STATUS_LIST],
            "loads": self.loads,
            "connections": len(self.conns),
        }

    def on_close(self, cid: int, conn: Conn) -> None:
        freed = [self._forget_released(cid, checksum) for checksum in list(self.released)]
        if self.holds.pop(cid, None) is not None or any(freed):
            self._reconcile()
        for checksum in conn.attached:
            seg = self.segments.get(checksum)
            if seg is not None:
                seg.clients.pop(cid, None)
                if seg.shared and not seg.clients:
                    log.info("dropping shared blob %s: no client left", seg.key)
                    self._drop(seg)
        for waiters in self.loading.values():
            if cid in waiters:
                waiters.remove(cid)

    # ---- the loop ---------------------------------------------------------------------------

    def run_once(self, timeout: float) -> None:
        """Wait up to `timeout` seconds and serve what is ready."""
        for key, events in self.sel.select(timeout=timeout):
            if key.data == "listen":
                try:
                    self.accept_all()
                except OSError as e:
                    log.error("accept failed: %s", e)
            elif key.data == "wake":
                with contextlib.suppress(BlockingIOError):
                    self.wake_r.recv(4096)
                self._finish_loads()
            else:
                self.dispatch(key, events)
        self.expire()
        self.flush_state()

    def run(self) -> None:
        """Serve until `stop`, SIGTERM or SIGINT."""
        while not self.stopping:
            self.run_once(min(1.0, self.limits.io_timeout / 2))


def serve(
    files: list[str],
    *,
    sock: str | os.PathLike[str] | None = None,
    group: str | None = None,
    shm_limit: int = 0,
    shm_limit_from: str = "--shm-limit",
    read_rate: int = 0,
    limits: Limits | None = None,
    background: bool = True,
) -> int:
    """Run the daemon in the foreground until stopped. Returns the exit status.

    With `background` (the default), the daemon's threads run under ``SCHED_BATCH``: a request
    that wakes the daemon (a rank's fire-and-forget ``hold`` at a window switch) never preempts
    the process that sent it, whose training loop goes on while the daemon waits for a free core.
    """
    if background:
        # Before any thread starts: each thread of the daemon inherits it.
        set_background_scheduling()
    daemon = Daemon(
        socket_path(sock),
        group=group,
        shm_limit=shm_limit,
        shm_limit_from=shm_limit_from,
        read_rate=read_rate,
        limits=limits,
    )

    def on_signal(signum: int, _frame: object) -> None:
        log.info("%s received: stopping", signal.Signals(signum).name)
        daemon.stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # Wakes select() when a signal arrives, so stopping never waits for the timeout.
    signal.set_wakeup_fd(daemon.wake_w.fileno(), warn_on_full_buffer=False)
    try:
        daemon.start(files)
        daemon.run()
    finally:
        daemon.shutdown()
    return 0
