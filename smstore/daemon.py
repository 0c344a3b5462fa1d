"""`smstore serve`: the node daemon that holds one shared-memory copy of each blob and hands it to clients."""

from __future__ import annotations

import contextlib
import errno
import grp
import itertools
import json
import logging
import os
import queue
import resource
import secrets
import selectors
import signal
import socket
import stat
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from smstore import _core
from smstore._ipc import (
    MAX_MESSAGE,
    SEGMENT_RE,
    decode_body,
    encode,
    ensure_private_dir,
    frame_length,
    process_alive,
    process_start_time,
    socket_path,
)
from smstore.errors import DaemonError, StoreError

__all__ = ["Daemon", "collect_garbage", "read_checksum", "serve"]

log = logging.getLogger("smstore.daemon")

SHM_DIR = Path(_core.SHM_DIR)
# A client has this long to finish a request it started sending, or to read our reply.
IO_TIMEOUT = float(os.environ.get("SMSTORE_IO_TIMEOUT", "5"))
MAX_CONNECTIONS = 4096
_UCRED = struct.Struct("3i")


def read_checksum(path: str | os.PathLike[str]) -> str | None:
    """The checksum recorded in a blob's header (one small read), or None if it is no blob."""
    return _core.peek_checksum(os.fspath(path))


def _segment_prefix(uid: int, pid: int, start_time: int) -> str:
    """How the names of one daemon's segments begin (SEGMENT_RE in _ipc.py parses them)."""
    return f"smstore-{uid}-{pid}-{start_time}-"


def _segments_of(uid: int, pid: int, start_time: int) -> list[str]:
    """Names of the segments in /dev/shm that daemon (pid, start_time) of `uid` created."""
    prefix = _segment_prefix(uid, pid, start_time)
    return [p.name for p in SHM_DIR.iterdir() if p.name.startswith(prefix)]


@dataclass
class Segment:
    """One generation of one blob in shared memory."""

    name: str  # without the leading "/"
    checksum: str
    fd: int  # read-only
    store: _core.Store  # the daemon's own read-only mapping: keeps the pages counted in its PSS
    size: int
    records: int
    paths: list[str]
    loaded_at: float
    load_seconds: float
    adopted: bool = False
    clients: dict[int, int] = field(default_factory=dict)  # connection id -> peer pid


@dataclass
class Conn:
    """One client connection and its buffers."""

    sock: socket.socket
    pid: int
    uid: int
    gid: int
    inbuf: bytearray = field(default_factory=bytearray)
    out: list[tuple[bytes, list[int]]] = field(default_factory=list)
    pending_since: float | None = None  # a request partly received, or a reply not yet fully sent
    close_after_send: bool = False
    busy: bool = False  # waiting for a load to finish: no further request is read meanwhile
    attached: set[str] = field(default_factory=set)


def _peer_groups(pid: int) -> set[int]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Groups:"):
                return {int(g) for g in line.split()[1:]}
    except OSError:
        pass
    return set()


class Daemon:
    """The daemon's state and event loop. See docs/daemon.md.

    Args:
        sock_path: Where to listen.
        group: Share segments and the socket with this group (read-only), or None for this user only.
        shm_limit: Pretend /dev/shm holds at most this many bytes for our segments (0: no limit).
    """

    def __init__(self, sock_path: Path, *, group: str | None = None, shm_limit: int = 0) -> None:
        self.sock_path = sock_path
        self.state_path = sock_path.with_name(sock_path.name + ".state")
        self.uid = os.getuid()
        self.pid = os.getpid()
        start = process_start_time(self.pid)
        assert start is not None
        self.start_time = start
        self.gid: int | None = grp.getgrnam(group).gr_gid if group else None
        self.shm_limit = shm_limit
        self.segments: dict[str, Segment] = {}
        self.conns: dict[int, Conn] = {}
        self.ids = itertools.count(1)
        self.loading: dict[str, list[tuple[int, str]]] = {}  # path -> waiting (conn id, op)
        self.sel = selectors.DefaultSelector()
        self.listener: socket.socket | None = None
        self.stopping = False
        self.done: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.jobs: queue.Queue[str | None] = queue.Queue()
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.wake_w.setblocking(False)
        self.loader = threading.Thread(target=self._loader, name="smstore-loader", daemon=True)

    # ---- setup and teardown -------------------------------------------------------------------

    def start(self, files: list[str]) -> None:
        """Claim the socket, adopt a dead predecessor's segments, listen, and queue `files`."""
        with contextlib.suppress(ValueError, OSError):
            _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        parent = self.sock_path.parent
        ensure_private_dir(parent, create=not parent.exists(), group_gid=self.gid)
        self._claim_socket()
        self._adopt_previous()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177 if self.gid is None else 0o117)
        try:
            listener.bind(os.fspath(self.sock_path))
        finally:
            os.umask(old_umask)
        if self.gid is not None:
            os.chown(self.sock_path, -1, self.gid)
        listener.listen(128)
        listener.setblocking(False)
        self.listener = listener
        self.sel.register(listener, selectors.EVENT_READ, "listen")
        self.sel.register(self.wake_r, selectors.EVENT_READ, "wake")
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
            state = json.loads(self.state_path.read_text())
            old_pid, old_start = int(state["pid"]), int(state["start_time"])
            entries = list(state["segments"])
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("ignoring unreadable state file %s: %s", self.state_path, e)
            return
        if process_alive(old_pid, old_start):
            msg = f"the smstore daemon pid {old_pid} still owns {self.state_path}; stop it first"
            raise DaemonError(msg)
        for entry in entries:
            try:
                self._adopt(entry)
            except (OSError, StoreError, ValueError, KeyError, TypeError) as e:
                log.warning("could not adopt segment %s: %s; removing it", entry.get("name"), e)
                with contextlib.suppress(Exception):
                    _core.shm_unlink("/" + str(entry["name"]))
        # Whatever else the dead daemon left (a load it did not finish) goes.
        for name in _segments_of(self.uid, old_pid, old_start):
            log.info("removing leftover segment %s of dead daemon %d", name, old_pid)
            _core.shm_unlink("/" + name)

    def _adopt(self, entry: dict[str, Any]) -> None:
        old = str(entry["name"])
        checksum = str(entry["checksum"])
        if not SEGMENT_RE.match(old) or checksum in self.segments:
            msg = "not one of ours, or a duplicate"
            raise ValueError(msg)
        new = self._segment_name(checksum)
        # Renaming to our pid first: if we die now, gc knows whom the segment belongs to.
        (SHM_DIR / old).rename(SHM_DIR / new)
        fd = os.open(SHM_DIR / new, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if st.st_uid != self.uid or not stat.S_ISREG(st.st_mode) or st.st_mode & 0o222:
                msg = "wrong owner, type or mode"
                raise ValueError(msg)
            paths = [str(p) for p in entry["paths"]]
            # A previous daemon's segment: its owner could have changed it since, so check it all.
            store = _core.Store._from_fd(fd, paths[0] if paths else new, True)
            store.verify()
            if store.checksum != checksum or store.file_size != int(entry["size"]):
                msg = "contents do not match the state file"
                raise ValueError(msg)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                (SHM_DIR / new).unlink()
            raise
        self.segments[checksum] = Segment(
            new,
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
        log.info("adopted %s (%s, %d bytes) from dead daemon", ", ".join(paths) or new, checksum, st.st_size)

    def _segment_name(self, checksum: str) -> str:
        return f"{_segment_prefix(self.uid, self.pid, self.start_time)}{checksum}-{secrets.token_hex(4)}"

    def _save_state(self) -> None:
        state = {
            "pid": self.pid,
            "start_time": self.start_time,
            "socket": os.fspath(self.sock_path),
            "segments": [
                {
                    "name": s.name,
                    "checksum": s.checksum,
                    "size": s.size,
                    "paths": s.paths,
                    "loaded_at": s.loaded_at,
                }
                for s in self.segments.values()
            ],
        }
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(state, f)
        tmp.replace(self.state_path)

    def shutdown(self) -> None:
        """Unlink every segment, the socket and the state file. Clients keep their mappings."""
        self.jobs.put(None)
        for seg in list(self.segments.values()):
            self._drop(seg)
        for cid in list(self.conns):
            self._close(cid)
        if self.listener is not None:
            self.listener.close()
            self.sock_path.unlink(missing_ok=True)
        self.state_path.unlink(missing_ok=True)
        # A load still running writes on into a segment that is unlinked here and freed at exit.
        self.loader.join(timeout=0.1)
        for name in _segments_of(self.uid, self.pid, self.start_time):
            with contextlib.suppress(OSError):
                _core.shm_unlink("/" + name)
        log.info("stopped")

    def _drop(self, seg: Segment) -> None:
        _core.shm_unlink("/" + seg.name)
        seg.store.close()
        os.close(seg.fd)
        self.segments.pop(seg.checksum, None)

    # ---- loading (a thread, so that a slow filesystem never blocks attaching clients) -----------

    def _loader(self) -> None:
        while True:
            path = self.jobs.get()
            if path is None:
                return
            try:
                result: Any = self._load_one(path)
            except (StoreError, OSError) as e:
                result = e
            if self.stopping and isinstance(result, tuple):
                _core.shm_unlink("/" + result[0])
                os.close(result[1])
                return
            self.done.put((path, result))
            with contextlib.suppress(OSError):
                self.wake_w.send(b"x")

    def _load_one(self, path: str) -> tuple[str, int, str, float] | str:
        checksum = read_checksum(path)
        if checksum is not None and checksum in self.segments:
            return checksum  # same contents already loaded (under this or another path)
        used = sum(s.size for s in list(self.segments.values()))
        room = 0
        if self.shm_limit:
            room = max(1, self.shm_limit - used)
        name = self._segment_name(checksum or "0" * 16)
        mode = 0o400 if self.gid is None else 0o440
        t0 = time.monotonic()
        fd, _size, ck, _n = _core.shm_load(path, "/" + name, mode, -1 if self.gid is None else self.gid, room)
        if ck != checksum:  # the file was replaced between the two reads
            os.close(fd)
            _core.shm_unlink("/" + name)
            msg = f"{path}: the file changed while it was being loaded; try again"
            raise DaemonError(msg)
        return name, fd, ck, time.monotonic() - t0

    def _queue_load(self, path: str, cid: int | None) -> None:
        first = path not in self.loading
        waiters = self.loading.setdefault(path, [])
        if cid is not None:
            waiters.append((cid, "load"))
        if first:
            self.jobs.put(path)
            log.info("loading %s", path)

    def _finish_loads(self) -> None:
        while True:
            try:
                path, result = self.done.get_nowait()
            except queue.Empty:
                return
            waiters = self.loading.pop(path, [])
            reply: dict[str, Any]
            if isinstance(result, Exception):
                log.error("failed to load %s: %s", path, result)
                reply = {"ok": False, "error": type(result).__name__, "message": str(result)}
            else:
                seg = self._register(path, result)
                reply = {"ok": True, **self._describe(seg)}
            for cid, _op in waiters:
                conn = self.conns.get(cid)
                if conn is not None:
                    conn.busy = False
                    self._reply(cid, reply)
                    self._parse(cid)

    def _register(self, path: str, result: tuple[str, int, str, float] | str) -> Segment:
        if isinstance(result, str):
            seg = self.segments[result]
            if path not in seg.paths:
                seg.paths.append(path)
        elif result[2] in self.segments:
            # Another path with the same contents finished loading first: keep one copy.
            name, fd, ck, _seconds = result
            _core.shm_unlink("/" + name)
            os.close(fd)
            seg = self.segments[ck]
            if path not in seg.paths:
                seg.paths.append(path)
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
        # A path now holds new contents: its previous generation is no longer served by this path.
        for other in list(self.segments.values()):
            if other is not seg and path in other.paths:
                other.paths.remove(path)
                if not other.paths:
                    log.info("%s was rewritten: unloading the old generation %s", path, other.checksum)
                    self._drop(other)
        self._save_state()
        return seg

    # ---- connections ------------------------------------------------------------------------

    def _accept(self) -> None:
        assert self.listener is not None
        while True:
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE):
                    log.warning("out of file descriptors; refusing connections for now")
                    return
                raise
            sock.setblocking(False)
            pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
            cid = next(self.ids)  # never reused, unlike fd numbers
            conn = Conn(sock, pid, uid, gid)
            self.conns[cid] = conn
            self.sel.register(sock, selectors.EVENT_READ, cid)
            if len(self.conns) > MAX_CONNECTIONS:
                self._reply(
                    cid, {"ok": False, "error": "busy", "message": "too many connections"}, close=True
                )
            elif not self._allowed(conn):
                log.warning("refused connection from pid %d uid %d", pid, uid)
                msg = f"uid {uid} may not use this smstore daemon (it serves uid {self.uid} only)"
                if self.gid is not None:
                    msg = f"uid {uid} may not use this smstore daemon (it serves uid {self.uid} and group {self.gid})"
                self._reply(cid, {"ok": False, "error": "permission_denied", "message": msg}, close=True)

    def _allowed(self, conn: Conn) -> bool:
        if conn.uid in (self.uid, 0):
            return True
        if self.gid is None:
            return False
        return conn.gid == self.gid or self.gid in _peer_groups(conn.pid)

    def _privileged(self, conn: Conn) -> bool:
        # Loading reads files with the daemon's rights and stopping affects everyone: owner only.
        return conn.uid in (self.uid, 0)

    def _readable(self, cid: int) -> None:
        conn = self.conns[cid]
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(cid)
            return
        if not data:
            self._close(cid)
            return
        if conn.close_after_send:
            return  # a refused peer: discard whatever it sends
        conn.inbuf += data
        if conn.pending_since is None:
            conn.pending_since = time.monotonic()
        self._parse(cid)

    def _parse(self, cid: int) -> None:
        conn = self.conns.get(cid)
        while conn is not None and not conn.busy and not conn.close_after_send and len(conn.inbuf) >= 4:
            n = frame_length(conn.inbuf)
            if n > MAX_MESSAGE:
                msg = f"message of {n} bytes exceeds the {MAX_MESSAGE}-byte limit"
                self._reply(cid, {"ok": False, "error": "too_large", "message": msg}, close=True)
                return
            if len(conn.inbuf) < 4 + n:
                return
            body = bytes(conn.inbuf[4 : 4 + n])
            del conn.inbuf[: 4 + n]
            conn.pending_since = time.monotonic() if conn.inbuf else None
            try:
                req = decode_body(body)
            except (UnicodeDecodeError, ValueError) as e:
                self._reply(cid, {"ok": False, "error": "bad_request", "message": f"malformed message: {e}"})
                continue
            try:
                self._handle(cid, conn, req)
            except (StoreError, OSError, ValueError, TypeError, KeyError) as e:
                self._reply(cid, {"ok": False, "error": type(e).__name__, "message": str(e)})
            conn = self.conns.get(cid)

    def _handle(self, cid: int, conn: Conn, req: dict[str, Any]) -> None:
        op = req.get("op")
        if op == "attach":
            checksum = req.get("checksum")
            seg = self.segments.get(checksum) if isinstance(checksum, str) else None
            if seg is None:
                self._reply(
                    cid, {"ok": False, "error": "not_served", "message": f"no segment holds {checksum}"}
                )
                return
            seg.clients[cid] = conn.pid
            conn.attached.add(seg.checksum)
            self._reply(cid, {"ok": True, **self._describe(seg)}, fd=seg.fd)
        elif op == "status":
            self._reply(cid, self._status())
        elif op in ("load", "unload", "stop") and not self._privileged(conn):
            self._reply(
                cid, {"ok": False, "error": "permission_denied", "message": f"only uid {self.uid} may {op}"}
            )
        elif op == "load":
            path = req.get("path")
            if not isinstance(path, str) or not Path(path).is_absolute():
                self._reply(
                    cid, {"ok": False, "error": "bad_request", "message": "load needs an absolute 'path'"}
                )
                return
            conn.busy = True
            self._queue_load(path, cid)
        elif op == "unload":
            self._unload(cid, req)
        elif op == "stop":
            self._reply(cid, {"ok": True, "pid": self.pid})
            self.stopping = True
        else:
            self._reply(cid, {"ok": False, "error": "bad_request", "message": f"unknown op {op!r}"})

    def _unload(self, cid: int, req: dict[str, Any]) -> None:
        checksum, path = req.get("checksum"), req.get("path")
        seg = self.segments.get(checksum) if isinstance(checksum, str) else None
        if seg is None and isinstance(path, str):
            seg = next((s for s in self.segments.values() if path in s.paths), None)
        if seg is None:
            what = path or checksum
            self._reply(cid, {"ok": False, "error": "not_served", "message": f"{what} is not loaded"})
            return
        info = self._describe(seg)
        self._drop(seg)
        self._save_state()
        log.info(
            "unloaded %s (%s); %d client(s) still map it",
            ", ".join(seg.paths),
            seg.checksum,
            len(info["clients"]),
        )
        self._reply(cid, {"ok": True, **info})

    def _describe(self, seg: Segment) -> dict[str, Any]:
        pids = sorted({p for p in seg.clients.values() if Path(f"/proc/{p}").exists()})
        return {
            "checksum": seg.checksum,
            "segment": "/" + seg.name,
            "paths": seg.paths,
            "size": seg.size,
            "records": seg.records,
            "loaded_at": seg.loaded_at,
            "load_seconds": seg.load_seconds,
            "adopted": seg.adopted,
            "clients": pids,
        }

    def _status(self) -> dict[str, Any]:
        available, total = _core.shm_space(os.fspath(SHM_DIR))
        return {
            "ok": True,
            "pid": self.pid,
            "uid": self.uid,
            "socket": os.fspath(self.sock_path),
            "version": _core.__version__,
            "shm": {"available": available, "total": total, "limit": self.shm_limit},
            "segments": [self._describe(s) for s in self.segments.values()],
            "loading": sorted(self.loading),
        }

    def _reply(self, cid: int, msg: dict[str, Any], *, fd: int | None = None, close: bool = False) -> None:
        conn = self.conns.get(cid)
        if conn is None:
            return
        conn.out.append((encode(msg), [fd] if fd is not None else []))
        conn.close_after_send = conn.close_after_send or close
        self._flush(cid)

    def _flush(self, cid: int) -> None:
        conn = self.conns.get(cid)
        if conn is None:
            return
        while conn.out:
            data, fds = conn.out[0]
            try:
                sent = socket.send_fds(conn.sock, [data], fds) if fds else conn.sock.send(data)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._close(cid)
                return
            if sent < len(data):
                conn.out[0] = (data[sent:], [])
                break
            conn.out.pop(0)
        if conn.out:
            if conn.pending_since is None:
                conn.pending_since = time.monotonic()
            self.sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, cid)
        else:
            if not conn.inbuf:
                conn.pending_since = None
            if conn.close_after_send:
                self._close(cid)
                return
            self.sel.modify(conn.sock, selectors.EVENT_READ, cid)

    def _close(self, cid: int) -> None:
        conn = self.conns.pop(cid, None)
        if conn is None:
            return
        for checksum in conn.attached:
            seg = self.segments.get(checksum)
            if seg is not None:
                seg.clients.pop(cid, None)
        for waiters in self.loading.values():
            waiters[:] = [w for w in waiters if w[0] != cid]
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(conn.sock)
        conn.sock.close()

    def _expire(self) -> None:
        now = time.monotonic()
        for cid, conn in list(self.conns.items()):
            if conn.pending_since is not None and not conn.busy and now - conn.pending_since > IO_TIMEOUT:
                log.warning("closing connection from pid %d: stalled mid-message", conn.pid)
                self._close(cid)

    # ---- the loop ---------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until `stop`, SIGTERM or SIGINT."""
        while not self.stopping:
            for key, events in self.sel.select(timeout=1.0):
                if key.data == "listen":
                    self._accept()
                elif key.data == "wake":
                    with contextlib.suppress(BlockingIOError):
                        self.wake_r.recv(4096)
                    self._finish_loads()
                else:
                    cid = int(key.data)
                    if events & selectors.EVENT_WRITE:
                        self._flush(cid)
                    if events & selectors.EVENT_READ and cid in self.conns:
                        self._readable(cid)
            self._expire()


def serve(
    files: list[str],
    *,
    sock: str | os.PathLike[str] | None = None,
    group: str | None = None,
    shm_limit: int = 0,
) -> int:
    """Run the daemon in the foreground until stopped. Returns the exit status."""
    daemon = Daemon(socket_path(sock), group=group, shm_limit=shm_limit)

    def on_signal(signum: int, _frame: object) -> None:
        log.info("%s received: stopping", signal.Signals(signum).name)
        daemon.stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # Wakes select() when a signal arrives, so stopping never waits for the 1 s timeout.
    signal.set_wakeup_fd(daemon.wake_w.fileno(), warn_on_full_buffer=False)
    try:
        daemon.start(files)
        daemon.run()
    finally:
        daemon.stopping = True
        daemon.shutdown()
    return 0


def collect_garbage(sock: str | os.PathLike[str] | None = None) -> list[str]:
    """Unlink the segments (and stale socket and state files) of our daemons that died.

    Segments whose daemon is alive are never touched: the pid and start time in a segment's name
    must both match a running process for it to count as alive.

    Returns:
        The removed paths.
    """
    removed: list[str] = []
    uid = os.getuid()
    for name in sorted(p.name for p in SHM_DIR.iterdir()):
        m = SEGMENT_RE.match(name)
        if not m or int(m.group(1)) != uid:
            continue
        try:
            st = os.lstat(SHM_DIR / name)
        except FileNotFoundError:
            continue
        if st.st_uid != uid or process_alive(int(m.group(2)), int(m.group(3))):
            continue
        if _core.shm_unlink("/" + name):
            removed.append(os.fspath(SHM_DIR / name))
    path = socket_path(sock)
    state = path.with_name(path.name + ".state")
    try:
        info = json.loads(state.read_text())
        dead = not process_alive(int(info["pid"]), int(info["start_time"]))
    except FileNotFoundError:
        dead = False
    except (OSError, ValueError, KeyError, TypeError):
        dead = True
    if dead:
        for p in (path, state):
            if p.exists() or p.is_socket():
                p.unlink(missing_ok=True)
                removed.append(os.fspath(p))
    return removed
