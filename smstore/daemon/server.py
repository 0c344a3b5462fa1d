"""The daemon's server: its lifecycle, its segment table, and the dispatch of requests (`smstore serve`)."""

from __future__ import annotations

import contextlib
import fcntl
import grp
import itertools
import json
import logging
import os
import resource
import selectors
import signal
import socket
import stat
import time
from pathlib import Path
from typing import Any

from smstore import _core
from smstore._ipc import ensure_private_dir, process_start_time, socket_path
from smstore.daemon.connections import Conn, Limits, ProtocolError, Server
from smstore.daemon.loader import AlreadyLoaded, Failed, Loaded, Loader
from smstore.daemon.planner import Planner
from smstore.daemon.requests import (
    STATUS_PAGE,
    checksum_arg,
    hold_arg,
    key_arg,
    not_served,
    page_arg,
    path_arg,
)
from smstore.daemon.segments import (
    SHM_DIR,
    DaemonLock,
    Segment,
    SegmentTable,
    adopt_previous,
    list_segments,
    new_segment_name,
    unlink_quietly,
)
from smstore.daemon.state import StateFile, state_path
from smstore.errors import DaemonError

__all__ = ["Daemon", "Limits", "serve", "set_background_scheduling"]

log = logging.getLogger("smstore.daemon")

_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK

# A status reply lists at most STATUS_PAGE segments, in at most STATUS_BYTES of JSON, and at most
# STATUS_LIST entries of each other list.
STATUS_BYTES = 256 << 10
STATUS_LIST = 20


def _peer_groups(pid: int) -> set[int]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Groups:"):
                return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()


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


def claim_socket(sock_path: Path) -> None:
    """Remove a dead daemon's socket at `sock_path`; refuse if a live one listens there."""
    if not os.path.lexists(sock_path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(2.0)
        probe.connect(os.fspath(sock_path))
    except (ConnectionRefusedError, FileNotFoundError):
        log.info("removing stale socket %s", sock_path)
        sock_path.unlink(missing_ok=True)
        return
    except OSError as e:
        msg = f"{sock_path}: exists and cannot be probed ({e}); remove it if no daemon uses it"
        raise DaemonError(msg) from None
    finally:
        probe.close()
    msg = f"another smstore daemon is already listening on {sock_path}; 'smstore stop' it first"
    raise DaemonError(msg)


class Daemon(Server):
    """The daemon's segments, its requests and its event loop. See docs/daemon.md.

    Residency (what the ranks hold, and the budget) is the planner's; loads run in the loader's
    thread; the state file is written by `StateFile`; connections are the `Server`'s.

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
        self.pid = os.getpid()
        start = process_start_time(self.pid)
        if start is None:
            msg = "cannot read this process's start time from /proc"
            raise DaemonError(msg)
        self.start_time = start
        self.gid: int | None = grp.getgrnam(group).gr_gid if group else None
        self.segments = SegmentTable()
        self.planner = Planner(
            self.segments,
            shm_limit=shm_limit,
            shm_limit_from=shm_limit_from,
            is_owner=lambda cid: (conn := self.conns.get(cid)) is not None and conn.owner,
            release=self._release,
        )
        self.loader = Loader(
            self.segments, self.planner, self._segment_name, gid=self.gid, read_rate=read_rate
        )
        self.state = StateFile(state_path(sock_path), self._state)
        self.loading: dict[str, list[int]] = {}  # path -> connection ids waiting for it
        # Readers waiting for a held shard still on its way (connection id, checksum), by path.
        self.attach_waiting: dict[str, list[tuple[int, str]]] = {}
        self.loads = 0  # loads finished (or failed) since the start
        self.stopping = False
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
        claim_socket(self.sock_path)
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
        self.sel.register(self.loader.wake_r, selectors.EVENT_READ, "wake")
        self._owns_state = True
        self.state.save()
        self.loader.start()
        log.info("listening on %s (pid %d)", self.sock_path, self.pid)
        for f in files:
            self._queue_load(os.fspath(Path(f).absolute()), None)

    def _adopt_previous(self) -> None:
        """Take over the segments of a dead daemon of this socket; unlink what cannot be adopted."""
        for seg, held in adopt_previous(self.state.path, self.uid, self._segment_name):
            self.segments[seg.checksum] = seg
            if held:
                self.planner.adopted(seg.checksum)

    def _segment_name(self, checksum: str) -> str:
        return new_segment_name(self.uid, self.pid, self.start_time, checksum)

    def _state(self) -> tuple[dict[str, Any], int]:
        """What the state file records: our segments (a memfd cannot be adopted), for a successor."""
        entries = [
            s.state_entry(held=self.planner.is_held(s.checksum))
            for s in self.segments.values()
            if not s.shared
        ]
        state = {
            "pid": self.pid,
            "start_time": self.start_time,
            "socket": os.fspath(self.sock_path),
            "segments": entries,
        }
        return state, len(entries)

    def shutdown(self) -> None:
        """Unlink every segment, and the socket and state file if we made them. Clients keep their mappings."""
        self.stopping = True
        try:
            for seg in list(self.segments.values()):
                self._drop(seg)
            self.close_all()
            if self.listener is not None:
                self.listener.close()
            if self._owns_socket:
                self.sock_path.unlink(missing_ok=True)
            if self._owns_state:
                self.state.path.unlink(missing_ok=True)
            self.loader.stop()
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
        """Stop serving a segment now (unloaded, replaced, stopping): clients keep their mappings."""
        seg.close()
        self.segments.pop(seg.checksum, None)
        self.planner.dropped(seg.checksum)

    def _release(self, seg: Segment) -> None:
        """The planner released a held segment: out of the table, freed by the loader thread, off this loop."""
        self.segments.pop(seg.checksum, None)
        self.loader.free(seg)

    # ---- loading (a thread, so that a slow filesystem never blocks attaching clients) -----------

    def _queue_load(
        self, path: str, cid: int | None, *, quiet: bool = False, expected: str | None = None
    ) -> None:
        first = path not in self.loading
        waiters = self.loading.setdefault(path, [])
        if cid is not None:
            waiters.append(cid)
            self.set_busy(cid, True)
        if first:
            self.loader.load(path, expected)
            if not quiet:
                log.info("loading %s", path)

    def _finish_loads(self) -> None:
        for path, result in self.loader.finished():
            waiters = self.loading.pop(path, [])
            self.loads += 1
            reply: dict[str, Any]
            failure: str | None = None
            if isinstance(result, Failed):
                log.error("failed to load %s: %s", path, result.error)
                failure = str(result.error)[:1000]
                self.planner.load_failed(path, failure)
                reply = {"ok": False, "error": type(result.error).__name__, "message": failure}
            else:
                # Marked before _register writes the state file, which records it as held.
                self.planner.load_done(path, result.checksum, asked=bool(waiters))
                seg = self._register(path, result)
                reply = {"ok": True, **describe(seg)}
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
                    self.reply(cid, not_served(checksum, failure))
                else:
                    self._attach(cid, conn, seg_now)
                self.parse(cid)
            self._reconcile()

    def _register(self, path: str, result: Loaded | AlreadyLoaded) -> Segment:
        # The generation this path held before (if other contents): no longer served by this path.
        previous = self.segments.serving(path)
        if isinstance(result, AlreadyLoaded):
            seg = self.segments[result.checksum]
            self.segments.add_path(seg, path)
        elif result.checksum in self.segments:
            # Another path with the same contents finished loading first: keep one copy.
            unlink_quietly(result.name)
            os.close(result.fd)
            seg = self.segments[result.checksum]
            self.segments.add_path(seg, path)
        else:
            name, fd, ck, seconds = result.name, result.fd, result.checksum, result.seconds
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
        self.state.changed()
        return seg

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
            self._attach_request(cid, conn, req)
        elif op == "held":
            # What the ranks hold, so that readers attach it before they read it.
            self.reply(cid, {"ok": True, "shards": [[p, c] for c, p in self.planner.wanted().items()]})
        elif op == "detach":
            self._detach(cid, conn, checksum_arg(req), reply=req.get("noreply") is not True)
        elif op == "status":
            self.reply(cid, status(self, *page_arg(req)))
        elif op in ("load", "unload", "stop", "share", "hold") and not conn.owner:
            # Loading reads files with the daemon's rights and stopping affects everyone: owner only.
            raise ProtocolError("permission_denied", f"only uid {self.uid} may {op}")
        elif op == "load":
            path = path_arg(req, required=True)
            assert path is not None
            self._queue_load(path, cid)
        elif op == "unload":
            self._unload(cid, checksum_arg(req), path_arg(req, required=False))
        elif op == "share":
            self._share(cid, conn, req)
        elif op == "hold":
            self._hold(cid, *hold_arg(req), reply=req.get("noreply") is not True)
        elif op == "stop":
            self.reply(cid, {"ok": True, "pid": self.pid})
            self.stopping = True
        else:
            raise ProtocolError("bad_request", f"unknown op {str(op)[:100]!r}")

    def _attach_request(self, cid: int, conn: Conn, req: dict[str, Any]) -> None:
        checksum, key = checksum_arg(req), key_arg(req, required=False)
        if key is not None:
            seg = next((s for s in self.segments.values() if s.key == key), None)
        else:
            seg = self.segments.get(checksum) if checksum is not None else None
        path = path_arg(req, required=False)
        if (
            seg is None
            and path is not None
            and checksum is not None
            and self.planner.on_its_way(path, checksum, self.loading)
        ):
            # A held shard on its way (loading, or waiting for room): answer when its load ends.
            # No file is read for this that a rank did not ask for.
            self.attach_waiting.setdefault(path, []).append((cid, checksum))
            self.set_busy(cid, True)
            return
        if seg is None:
            why = (
                self.planner.why_not_held(path, checksum)
                if path is not None and checksum is not None
                else None
            )
            self.reply(cid, not_served(str(key or checksum), why))
            return
        self._attach(cid, conn, seg)

    # ---- residency: the planner decides, the server replies and queues ------------------------

    def _hold(self, cid: int, manifest_path: str, indices: list[int], *, reply: bool) -> None:
        """Replace what connection `cid` holds; load what no one has loaded yet, drop what no one holds.

        The reply comes at once (none with ``"noreply": true``, unless the request is refused):
        loads run in the background, in the order given (the window being read first, then the
        next). A shard larger than the whole --shm-limit is refused here.
        """
        shards = self.planner.hold(cid, manifest_path, indices)
        if reply:
            resident = [ck for _p, ck in shards if ck in self.segments]
            self.reply(cid, {"ok": True, "resident": len(resident), "held": len(shards)})
            self.flush(cid)  # the rank goes on at once; releases and loads follow
        self._reconcile()

    def _reconcile(self) -> None:
        """Carry out the planner's plan: queue its loads, and answer readers waiting for what will not come."""
        plan = self.planner.plan(self.loading)
        for path, checksum in plan.loads:
            self._queue_load(path, None, quiet=True, expected=checksum)
        for path in list(self.attach_waiting):
            if path not in self.loading and path not in self.planner.waiting_room:
                # Not on its way (no longer held, its load failed, unloaded): the readers hear so now.
                for cid, checksum in self.attach_waiting.pop(path):
                    if cid in self.conns:
                        self.set_busy(cid, False)
                        self.reply(cid, not_served(checksum, self.planner.why_not_held(path, checksum)))
                        self.parse(cid)
        # One log line for each kind of change, however many shards: a window switch releases and
        # loads a window's worth on the daemon's loop, inside the switch (a line costs ~35 us).
        if plan.released:
            log.info("releasing %d shard(s) no rank holds: %s", len(plan.released), "; ".join(plan.released))
            self.state.changed()
        if plan.loads:
            log.info("loading %d held shard(s): %s", len(plan.loads), ", ".join(p for p, _ in plan.loads))

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
            freed = self.planner.unmapped(c, checksum) or freed
        if freed:
            self._reconcile()
        if reply:
            self.reply(cid, {"ok": True})

    def _attach(self, cid: int, conn: Conn, seg: Segment) -> None:
        seg.clients[cid] = conn.pid
        conn.attached.add(seg.checksum)
        self.reply(cid, {"ok": True, **describe(seg)}, fd=seg.fd)

    def _share(self, cid: int, conn: Conn, req: dict[str, Any]) -> None:
        """Serve a blob a client built in a sealed memfd (sent with the request) under its content key.

        The daemon holds it while any client is attached (the sharer included) and drops it after.
        """
        key = key_arg(req, required=True)
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
            if not self.planner.fits(st.st_size):
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
        info = describe(seg)
        self.planner.unload(seg.checksum)
        self._drop(seg)
        self.state.changed()
        log.info(
            "unloaded %s (%s); %d client(s) still map it",
            ", ".join(seg.paths),
            seg.checksum,
            len(info["clients"]),
        )
        self.reply(cid, {"ok": True, **info})
        self._reconcile()  # readers waiting for it hear at once

    def on_close(self, cid: int, conn: Conn) -> None:
        if self.planner.disconnect(cid):
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
                self._finish_loads()
            else:
                self.dispatch(key, events)
        self.expire()
        self.state.flush()

    def run(self) -> None:
        """Serve until `stop`, SIGTERM or SIGINT."""
        while not self.stopping:
            self.run_once(min(1.0, self.limits.io_timeout / 2))


def describe(seg: Segment) -> dict[str, Any]:
    """What a reply says of a segment."""
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


def status(daemon: Daemon, offset: int, limit: int) -> dict[str, Any]:
    """A summary, and a page of `limit` segments from `offset` (in load order) with every list capped.

    Every reply fits a message, whatever the daemon holds (100,000 segments, paths of 4 KiB):
    ``next_offset`` is where the next page starts (None after the last), and the lists other
    than ``segments`` hold their first entries (their lengths are in ``counts``).
    """
    available, total = _core.shm_space(os.fspath(SHM_DIR))
    page: list[dict[str, Any]] = []
    size = 0
    next_offset: int | None = None
    for k, seg in enumerate(itertools.islice(daemon.segments.values(), offset, None)):
        if len(page) == limit or size > STATUS_BYTES:
            next_offset = offset + k
            break
        entry = describe(seg)
        size += len(json.dumps(entry))
        page.append(entry)
    failed = [
        {"path": p, "checksum": ck, "message": why} for p, (ck, _i, why) in daemon.planner.hold_failed.items()
    ]
    return {
        "ok": True,
        "pid": daemon.pid,
        "uid": daemon.uid,
        "socket": os.fspath(daemon.sock_path),
        "version": _core.__version__,
        "shm": {
            "available": available,
            "total": total,
            "limit": daemon.planner.shm_limit,
            "limit_from": daemon.planner.shm_limit_from,
            "used": daemon.planner.used(),
        },
        "counts": {
            "segments": len(daemon.segments),
            "loading": len(daemon.loading),
            "held": len(daemon.planner.managed),
            "unclaimed": len(daemon.planner.unclaimed),
            "released": len(daemon.planner.released),
            "failed": len(failed),
        },
        "segments": page,
        "offset": offset,
        "next_offset": next_offset,
        "loading": sorted(daemon.loading)[:STATUS_LIST],
        "held": sorted(daemon.planner.managed)[:STATUS_PAGE],  # checksums loaded because a rank holds them
        "unclaimed": sorted(daemon.planner.unclaimed)[
            :STATUS_PAGE
        ],  # adopted, held by a dead predecessor, not since
        "released": sorted(daemon.planner.released)[:STATUS_PAGE],  # released held segments readers still map
        # Held shards whose load failed, not tried again until their file changes.
        "failed": failed[:STATUS_LIST],
        "loads": daemon.loads,
        "connections": len(daemon.conns),
    }


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
    signal.set_wakeup_fd(daemon.loader.wake_w.fileno(), warn_on_full_buffer=False)
    try:
        daemon.start(files)
        daemon.run()
    finally:
        daemon.shutdown()
    return 0
