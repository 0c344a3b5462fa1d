"""The processes of one job on one node: who they are, and how one hands a file descriptor to the others.

The local rank 0 listens on a Linux abstract-namespace Unix socket named from the job; the other
local ranks connect to it, learn its pid at once, and receive the descriptor (SCM_RIGHTS) when it
is ready. An abstract socket has no file: it vanishes with the last process holding it, so
nothing is left behind when a job is killed, and EOF on it tells a waiter that the builder died.

Abstract names have no permissions, and this one is predictable (torchrun's defaults give every
job the key ``none``/``127.0.0.1``/``29500``), so another user can bind it first. Nobody but this
user can make a job fail or wait through it: both ends check the peer's uid (``SO_PEERCRED``)
before they exchange a byte, and a builder that finds the name held by another user listens on
the name followed by ``-<128 random bits>`` instead, which waiters find in ``/proc/net/unix``
(connecting to each candidate and keeping the one that belongs to this user).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import select
import socket
import struct
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

from smstore.errors import SharedListError
from smstore.wire import fork as _fork

__all__ = ["Peer", "Server", "Topology", "address_for", "bind_listener", "connect", "job_key", "topology"]

log = logging.getLogger("smstore")

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
# /proc/net/unix flags of a listening socket (__SO_ACCEPTCON).
_ACCEPTING = 0x10000
# How long a builder that finds its name bound by nobody listening gives a racing process of this
# user (between its bind() and listen(), microseconds) before it calls the name taken.
_RACE_GRACE = 0.2


@dataclass(frozen=True)
class Topology:
    """Where this process stands among the local processes of its job.

    ``role`` is ``"single"`` (nobody to share with: build and keep it), ``"builder"`` (local
    rank 0), ``"waiter"`` (another local rank) or ``"elect"`` (ranks of torch.distributed
    without LOCAL_RANK: the first process to bind the socket builds).
    """

    role: str
    local_rank: int | None
    local_world_size: int | None


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        msg = f"${name} must be an integer, not {value!r}"
        raise SharedListError(msg) from None


def topology() -> Topology:
    """This process's local rank: ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` (torchrun), else torch.distributed."""
    rank, size = _env_int("LOCAL_RANK"), _env_int("LOCAL_WORLD_SIZE")
    if rank is not None:
        if size == 1:
            return Topology("single", rank, size)
        return Topology("builder" if rank == 0 else "waiter", rank, size)
    torch = sys.modules.get("torch")  # never import torch for this: only look if the job did
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return Topology("elect", None, None)
    return Topology("single", 0, 1)


def job_key() -> str:
    """A string that all local processes of one job share and other jobs do not.

    ``$SMSTORE_JOB_ID`` if set; else torchrun's run id and rendezvous address; else the parent's
    pid (the launcher of every local rank, for torchrun, srun or mp.spawn).
    """
    env = os.environ
    if env.get("SMSTORE_JOB_ID"):
        return "id=" + env["SMSTORE_JOB_ID"]
    parts = [f"{k}={env[k]}" for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT") if env.get(k)]
    return ",".join(parts) if parts else f"ppid={os.getppid()}"


def address_for(name: str) -> bytes:
    """The abstract socket address of list ``name`` of this user's job (the leading NUL makes it abstract)."""
    digest = hashlib.sha256(f"{os.getuid()}\0{job_key()}\0{name}".encode()).hexdigest()[:32]
    return f"\0smstore-list-{os.getuid()}-{digest}".encode()


def _peer_cred(sock: socket.socket) -> tuple[int, int]:
    pid, uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return pid, uid


def _connect_ours(address: bytes) -> tuple[socket.socket | None, int | None]:
    """A connection to ``address`` if a process of this user listens there.

    Returns ``(sock, uid)``: the connected socket (blocking) when the listener is ours; ``None``
    and the listener's uid when it is another user's (closed at once: no byte is exchanged);
    ``(None, None)`` when nobody listens there or its backlog is full. Never blocks: the listener's
    uid is known at connect() (the kernel records it at listen()), before anyone accepts.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
    try:
        sock.connect(address)
        _pid, uid = _peer_cred(sock)
    except OSError:  # refused (nobody listens), EAGAIN (backlog full): not usable now
        sock.close()
        return None, None
    except BaseException:
        sock.close()
        raise
    if uid != os.getuid():
        sock.close()
        return None, uid
    sock.setblocking(True)
    return sock, uid


def _private_names(address: bytes) -> list[bytes]:
    """The listening abstract sockets named ``address-<32 hex digits>`` (anyone's), from /proc/net/unix."""
    prefix = "@" + address[1:].decode() + "-"
    try:
        with open("/proc/net/unix", encoding="ascii", errors="replace") as f:
            lines = f.readlines()[1:]
    except OSError:
        return []
    names = []
    for line in lines:
        # Num RefCount Protocol Flags Type St Inode Path; a name is another user's text: check all of it.
        fields = line.split()
        if len(fields) != 8 or not fields[7].startswith(prefix):
            continue
        if not re.fullmatch(r"[0-9a-f]{32}", fields[7][len(prefix) :]):
            continue
        try:
            accepting = int(fields[3], 16) & _ACCEPTING
        except ValueError:
            continue
        if accepting:
            names.append(b"\0" + fields[7][1:].encode())
    return names


def _find_ours(address: bytes) -> socket.socket | None:
    """A connection to this user's process listening on ``address`` or on one of its private names."""
    sock, _uid = _connect_ours(address)
    if sock is not None:
        return sock
    for name in _private_names(address):
        sock, _uid = _connect_ours(name)
        if sock is not None:
            return sock
    return None


def _listen(address: bytes) -> socket.socket | None:
    """A socket listening on ``address``; None if the name is taken."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            return None
        raise
    except BaseException:
        sock.close()
        raise
    return sock


def _taken(name: str) -> OSError:
    return OSError(errno.EADDRINUSE, f"SharedList {name!r}: a process of this user already serves it")


def bind_listener(address: bytes, name: str) -> socket.socket:
    """Listen for the waiters of list ``name``: on ``address``, or on a private name if another user holds it.

    Raises:
        OSError: ``EADDRINUSE`` if a process of this user already serves the list (on either name).
    """
    sock = _listen(address)
    if sock is not None:
        return sock
    give_up = time.monotonic() + _RACE_GRACE
    while True:
        ours, uid = _connect_ours(address)
        if ours is not None:
            ours.close()
            raise _taken(name)
        if uid is not None or time.monotonic() >= give_up:
            break  # another user's, or bound by a process that never listens
        time.sleep(0.005)  # bound, not listening yet: maybe one of ours between bind() and listen()
        sock = _listen(address)
        if sock is not None:
            return sock  # it went away
    for other in _private_names(address):
        ours, _uid = _connect_ours(other)
        if ours is not None:
            ours.close()
            raise _taken(name)
    holder = f"uid {uid}" if uid is not None else "a process that does not listen"
    log.warning(
        "SharedList %r: its rendezvous name on this node is held by %s, not by this user; "
        "serving it on a private name instead",
        name,
        holder,
    )
    while True:  # 128 random bits: nobody can take this one before us
        sock = _listen(address + b"-" + secrets.token_hex(16).encode())
        if sock is not None:
            return sock


def _encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message).encode() + b"\n"


class Server:
    """Local rank 0's end: accepts waiters from the start of its build, hands them the result.

    Waiters get ``{"pid": ..., "key": ...}`` on connecting (the key names what is being built, so a
    waiter that wants something else can say so before the build ends), then one final message: the result with the
    descriptor attached, or ``{"ok": false, "message": ...}`` if the build failed. The listener
    closes once ``expected`` waiters have been served (never, if that number is unknown).
    """

    def __init__(self, address: bytes, name: str, expected: int | None, key: str | None = None) -> None:
        self._sock = bind_listener(address, name)
        self._name = name
        self._key = key
        self._expected = expected
        self._served = 0
        self._lock = threading.Lock()
        self._pending: list[socket.socket] = []
        self._result: tuple[dict[str, Any], int | None] | None = None
        self._closed = False
        _servers.add(self)
        self._thread = threading.Thread(target=self._accept_loop, name=f"smstore-list-{name}", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # the listener was shut down
            try:
                _pid, uid = _peer_cred(conn)
                if uid != os.getuid():  # abstract sockets have no permissions: check who it is
                    conn.close()
                    continue
                conn.sendall(_encode({"pid": os.getpid(), "name": self._name, "key": self._key}))
            except OSError:
                conn.close()
                continue
            with self._lock:
                if self._result is None:
                    self._pending.append(conn)
                    continue
            self._deliver(conn)

    def publish(self, info: dict[str, Any], fd: int) -> None:
        """Hand a copy of ``fd`` and ``info`` to every waiter, now and later (the caller keeps ``fd``)."""
        self._finish(({"ok": True, **info}, os.dup(fd)))

    def fail(self, message: str) -> None:
        """Tell every waiter that the build failed, with the builder's error."""
        self._finish(({"ok": False, "message": message}, None))

    def _finish(self, result: tuple[dict[str, Any], int | None]) -> None:
        with self._lock:
            self._result = result
            pending, self._pending = self._pending, []
        for conn in pending:
            self._deliver(conn)
        if result[1] is None:
            self.close()  # a failed build serves nobody later

    def _deliver(self, conn: socket.socket) -> None:
        with self._lock:  # close() must not close the descriptor while it is being sent
            assert self._result is not None
            message, fd = self._result
            try:
                if fd is not None:
                    socket.send_fds(conn, [_encode(message)], [fd])
                elif not message["ok"]:
                    conn.sendall(_encode(message))
                # else: closed meanwhile; the waiter sees EOF, as if this process had exited
            except OSError:
                pass  # that waiter is gone; it counts as served (it will not come back)
            finally:
                conn.close()
            self._served += 1
            done = self._expected is not None and self._served >= self._expected
        if done:
            self.close()

    def close(self) -> None:
        """Stop listening (wakes the accept thread)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending, self._pending = self._pending, []
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        for conn in pending:
            conn.close()
        with self._lock:
            self._close_fd()

    def _close_in_forked_child(self) -> None:
        # The child shares the listening socket and the waiters' connections with its parent:
        # close its copies without shutdown(), which would end the parent's too. Without this a
        # forked DataLoader worker would keep them open after the builder died, and a waiter
        # would wait for a message that never comes instead of seeing EOF.
        if self._closed:
            return  # its descriptors were closed before the fork; their numbers may be reused
        self._closed = True
        self._sock.close()
        for conn in self._pending:
            conn.close()
        self._pending = []
        self._close_fd()

    def _close_fd(self) -> None:
        if self._result is not None and self._result[1] is not None:
            os.close(self._result[1])
            self._result = (self._result[0], None)


_servers: weakref.WeakSet[Server] = weakref.WeakSet()
# A waiter may have connected just before local rank 0 exits (its connection still in the
# listen backlog): give such waiters a moment to be served rather than an EOF.
_DRAIN_AT_EXIT = 5.0


def _drain_at_exit() -> None:
    deadline = time.monotonic() + _DRAIN_AT_EXIT
    for server in list(_servers):
        while not server._closed and server._result is not None and time.monotonic() < deadline:
            time.sleep(0.01)


atexit.register(_drain_at_exit)


def _after_fork_in_child() -> None:
    for server in list(_servers):
        server._close_in_forked_child()


_fork.in_child(_after_fork_in_child)


class Peer:
    """A waiter's connection to the builder: its pid at once, the result when ready, EOF if it dies."""

    def __init__(self, sock: socket.socket, name: str) -> None:
        self._sock = sock
        self._name = name
        self._buf = b""
        self._fds: list[int] = []
        self._eof = False
        self.pid, uid = _peer_cred(sock)
        if uid != os.getuid():
            self.close()
            msg = f"SharedList {name!r}: the process serving it (pid {self.pid}) belongs to uid {uid}, not to you"
            raise SharedListError(msg)

    def _fill(self, timeout: float | None) -> bool:
        """Read what is there (waiting up to ``timeout``); False if nothing came in time."""
        ready, _, _ = select.select([self._sock], [], [], timeout)
        if not ready:
            return False
        # recv_fds for every read: a plain recv would drop descriptors riding on the bytes it reads.
        data, fds, _flags, _addr = socket.recv_fds(self._sock, 65536, 4)
        self._fds.extend(fds)
        if not data:
            self._eof = True
        self._buf += data
        return True

    def _message(self) -> dict[str, Any] | None:
        line, sep, rest = self._buf.partition(b"\n")
        if not sep:
            return None
        self._buf = rest
        message: dict[str, Any] = json.loads(line)
        return message

    def receive(self, deadline: float, what: str) -> tuple[dict[str, Any], int | None]:
        """The next message and the descriptor that came with it, by ``deadline`` (time.monotonic())."""
        while True:
            message = self._message()
            if message is not None:
                # Only the final message ({"ok": ...}) carries a descriptor; the hello may have
                # been read together with it.
                fd = self._fds.pop(0) if "ok" in message and self._fds else None
                return message, fd
            if self._eof:
                msg = (
                    f"SharedList {self._name!r}: the local rank 0 building it (pid {self.pid}) exited "
                    f"before {what}; see that process's error"
                )
                raise SharedListError(msg)
            left = deadline - time.monotonic()
            if left <= 0 or not self._fill(left):
                msg = (
                    f"SharedList {self._name!r}: timed out waiting for {what} from the local rank 0 "
                    f"building it (pid {self.pid}); raise timeout= if building takes longer"
                )
                raise SharedListError(msg)

    def check_alive(self) -> None:
        """Raise at once if the builder has died (a non-blocking look at the socket)."""
        while not self._eof and self._fill(0):
            pass
        if self._eof and b"\n" not in self._buf:
            msg = (
                f"SharedList {self._name!r}: the local rank 0 building it (pid {self.pid}) exited "
                f"before it finished; see that process's error"
            )
            raise SharedListError(msg)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        self._sock.close()


def connect(address: bytes, name: str, deadline: float) -> Peer:
    """Connect to the builder of list ``name``, retrying while nobody listens yet, until ``deadline``.

    Only a process of this user counts: another user's socket on the name is never spoken to, and
    the builder is looked for on its private names too (see :func:`bind_listener`).
    """
    delay = 0.005
    while True:
        sock = _find_ours(address)
        if sock is None:
            left = deadline - time.monotonic()
            if left <= 0:
                msg = (
                    f"SharedList {name!r}: no local rank 0 of this job (key {job_key()!r}) served it in "
                    "time; every local rank must create the same SharedLists in the same order (or pass "
                    "the same name=), and local rank 0 must be running"
                )
                raise SharedListError(msg)
            time.sleep(min(delay, left))
            delay = min(delay * 2, 0.25)
            continue
        return Peer(sock, name)
