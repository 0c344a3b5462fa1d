"""The daemon's connection layer: accepting within limits, framed requests with backpressure, timeouts.

Every byte that arrives here may come from a hostile process. The rules (docs/daemon.md, "Limits"):
a connection holds at most one request and one reply at a time (it is not read while a reply is
pending), a request is at most ``max_request`` bytes and must arrive within ``io_timeout`` of its
first byte, a reply must be read within ``io_timeout``, a new connection must complete a request
within ``io_timeout``, each uid other than the owner's has at most ``max_per_uid`` connections,
and ``owner_reserve`` of ``max_connections`` are kept for the owner. A request may be parked (answered
later, on a change: a reader's ``held`` waiting for what the ranks hold to change): at most
``max_parked`` at a time (0: none, readers poll), ``parked_reserve`` of them for the owner, each until a deadline of at most
``MAX_WAIT`` seconds, and answered at once if its client sends more or closes. A file descriptor sent in a
reply is a duplicate made when the reply was queued, so it is the one requested however long the
reply waits, and whatever happens to the original meanwhile.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import math
import os
import selectors
import socket
import struct
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from smstore.errors import DaemonError, StoreError
from smstore.wire.protocol import (
    BUSY,
    PERMISSION_DENIED,
    TOO_LARGE,
    Location,
    ProtocolError,
    encode,
    frame_length,
    parse_request,
    refusal,
)

__all__ = ["Conn", "Limits", "Server"]

log = logging.getLogger("smstore.daemon")

_UCRED = struct.Struct("3i")


@dataclass(frozen=True)
class Limits:
    """What one daemon grants its clients (see the module docstring)."""

    max_connections: int = 4096
    max_per_uid: int = 256
    owner_reserve: int = 64
    max_request: int = 64 << 10
    io_timeout: float = 5.0
    max_parked: int = 1024
    parked_reserve: int = 64  # of max_parked, for the owner (apart from owner_reserve)

    def __post_init__(self) -> None:
        if not 0 < self.owner_reserve < self.max_connections or self.max_per_uid < 1:
            msg = f"invalid connection limits {self}: need 0 < owner_reserve < max_connections and max_per_uid >= 1"
            raise ValueError(msg)
        if self.max_parked < 0 or not (
            0 <= self.parked_reserve < self.max_parked or self.parked_reserve == self.max_parked == 0
        ):
            msg = (
                f"invalid limits on parked requests {self}: need max_parked >= 0 (0: none parked) and "
                "0 <= parked_reserve < max_parked"
            )
            raise ValueError(msg)
        if not 16 <= self.max_request <= 1 << 20:
            msg = f"max_request must be between 16 bytes and 1 MiB, not {self.max_request}"
            raise ValueError(msg)
        if not (math.isfinite(self.io_timeout) and 0 < self.io_timeout <= 3600):
            msg = f"the I/O timeout must be a number of seconds in (0, 3600], not {self.io_timeout}"
            raise ValueError(msg)


@dataclass
class Conn:
    """One client connection: who it is, what it sent, what it is owed."""

    sock: socket.socket
    pid: int
    uid: int
    gid: int
    owner: bool  # the daemon's own uid, or root
    accepted_at: float
    inbuf: bytearray = field(default_factory=bytearray)
    in_since: float = 0.0  # when the request now in inbuf began
    # Replies not yet sent: the bytes left and the fds (duplicates owned by this queue) to send with them.
    # A partly sent reply is a view of its frame: one frame shared by many connections is never copied.
    out: deque[tuple[bytes | memoryview, list[int]]] = field(default_factory=deque)
    out_since: float = 0.0  # when the oldest unsent reply was queued
    served: bool = False  # completed at least one request
    close_after_send: bool = False
    busy: bool = False  # waiting for a load to finish: not read meanwhile, no timeout
    # When its parked request is answered at the latest (`Server.park`; None: none parked): a
    # change answers it sooner.
    parked_until: float | None = None
    following: Location | None = None  # the manifest its parked 'held' follows (None: every held shard)
    # What its busy request waits for: the manifest being fetched at a URL (the request is served
    # again once it is in), or a held piece on its way (its label, the checksum a reader's attach
    # asked for, since when: answered when its load ends or it is no longer coming).
    waits_manifest: tuple[str, dict[str, Any]] | None = None
    waits_load: tuple[str, str, float] | None = None
    attached: set[str] = field(default_factory=set)
    events: int = 0  # what the selector watches now
    # A descriptor the client sent (at most one, for its next request; closed if that request does
    # not take it). The kernel closes any further ones sent with the same bytes.
    received_fd: int | None = None

    def take_fd(self) -> int | None:
        """The descriptor sent with the current request, now the caller's."""
        fd, self.received_fd = self.received_fd, None
        return fd

    def drop_fd(self) -> None:
        if self.received_fd is not None:
            os.close(self.received_fd)
            self.received_fd = None

    def deadline(self, timeout: float) -> float | None:
        """When this connection is dropped unless it makes progress (None: it may idle)."""
        if self.busy or self.parked_until is not None:
            return None
        if self.out:
            return self.out_since + timeout
        if self.inbuf:
            return self.in_since + timeout
        if not self.served:
            return self.accepted_at + timeout
        return None


class Server:
    """Accepts, reads and writes connections; subclasses answer requests in `handle`.

    Args:
        uid: The owner's uid (root is an owner too).
        limits: The limits it holds clients to.
    """

    def __init__(self, uid: int, limits: Limits) -> None:
        self.uid = uid
        self.limits = limits
        # Every connection's state is on its `Conn` (its parked request, what it waits for): one table.
        self.conns: dict[int, Conn] = {}
        self.parked = 0  # connections with a parked request
        self.ids = itertools.count(1)  # connection ids are never reused, unlike fd numbers
        self.sel = selectors.DefaultSelector()
        self.listener: socket.socket | None = None
        # One spare descriptor: when the process runs out, it is released to accept and close the
        # newcomer, so the listener does not stay readable (a busy loop) while nothing can be done.
        self._spare_fd: int | None = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    # ---- what subclasses provide ----------------------------------------------------------------

    def allowed(self, conn: Conn) -> str | None:
        """None if `conn` may use the daemon, else why not."""
        return None if conn.owner else f"uid {conn.uid} may not use this smstore daemon"

    def handle(self, cid: int, conn: Conn, req: dict[str, Any]) -> None:
        """Answer one request (with `reply`, now or later)."""
        raise NotImplementedError

    def on_close(self, cid: int, conn: Conn) -> None:
        """Forget what `conn` held."""

    def refused(self, code: str) -> None:
        """A refusing reply with error `code` was queued (the metrics count them)."""

    def wake(self, cid: int) -> None:
        """Answer a parked request now: its deadline passed, or its client sent more."""
        raise NotImplementedError

    # ---- parking ---------------------------------------------------------------------------------

    def park(self, cid: int, seconds: float) -> bool:
        """Answer `cid`'s request later: by `wake` after `seconds`, or sooner (see `unpark`).

        False if the limit on parked requests is reached (the owner's reserve counted): the caller
        answers at once. A parked connection is still read: what its client sends (or its close)
        wakes the request first.
        """
        conn = self.conns[cid]
        lim = self.limits
        if conn.parked_until is not None:  # one parked request per connection, never replaced
            return False
        if self.parked >= lim.max_parked - (0 if conn.owner else lim.parked_reserve):
            return False
        conn.parked_until = time.monotonic() + seconds
        self.parked += 1
        return True

    def unpark(self, cid: int) -> bool:
        """Take `cid` off the parked requests; True if it was parked (its reply is the caller's to send)."""
        conn = self.conns.get(cid)
        if conn is None or conn.parked_until is None:
            return False
        conn.parked_until = None
        self.parked -= 1
        return True

    def parked_ids(self) -> list[int]:
        """The connections with a parked request."""
        return (
            [cid for cid, conn in self.conns.items() if conn.parked_until is not None] if self.parked else []
        )

    def per_uid(self) -> Counter[int]:
        """Open connections by the peer's uid."""
        return Counter(conn.uid for conn in self.conns.values())

    # ---- accepting ------------------------------------------------------------------------------

    def accept_all(self) -> None:
        """Accept every pending connection, refusing those over the limits."""
        assert self.listener is not None
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE):
                    self._shed_one()
                    return
                if e.errno in (errno.ECONNABORTED, errno.EPROTO, errno.ENOBUFS, errno.ENOMEM):
                    continue
                raise
            self.add_connection(sock)

    def _shed_one(self) -> None:
        log.warning("out of file descriptors: refusing a connection")
        assert self.listener is not None
        if self._spare_fd is not None:
            os.close(self._spare_fd)
            self._spare_fd = None
        with contextlib.suppress(OSError):
            sock, _ = self.listener.accept()
            sock.close()
        with contextlib.suppress(OSError):
            self._spare_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    def add_connection(self, sock: socket.socket) -> int:
        """Take a connected socket; returns its connection id (it may be refused at once)."""
        sock.setblocking(False)
        pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        cid = next(self.ids)
        conn = Conn(sock, pid, uid, gid, uid in (self.uid, 0), time.monotonic())
        self.conns[cid] = conn
        self._watch(cid, conn)
        why = self._over_limits(conn)
        if why is not None:
            log.warning("refused connection from pid %d uid %d: %s", pid, uid, why)
            refused = refusal(BUSY, why)
            if conn.owner:
                # Even the owner's reserve is in use: connections that stall are dropped within
                # the I/O timeout, so the owner's client tries again for that long (_ipc.request).
                refused["retry_within"] = self.limits.io_timeout
            self.reply(cid, refused, close=True)
            return cid
        why = self.allowed(conn)
        if why is not None:
            log.warning("refused connection from pid %d uid %d", pid, uid)
            self.reply(cid, refusal(PERMISSION_DENIED, why), close=True)
        return cid

    def _over_limits(self, conn: Conn) -> str | None:
        lim = self.limits
        total = len(self.conns)
        if total > lim.max_connections:
            return f"too many connections ({lim.max_connections})"
        if conn.owner:
            return None
        if total > lim.max_connections - lim.owner_reserve:
            return f"too many connections ({lim.max_connections - lim.owner_reserve} for other users)"
        if sum(other.uid == conn.uid for other in self.conns.values()) > lim.max_per_uid:
            return f"too many connections from uid {conn.uid} ({lim.max_per_uid})"
        return None

    # ---- reading --------------------------------------------------------------------------------

    def readable(self, cid: int) -> None:
        conn = self.conns[cid]
        room = 4 + self.limits.max_request - len(conn.inbuf)
        try:
            data, fds, _flags, _addr = socket.recv_fds(conn.sock, max(room, 1), 1, socket.MSG_CMSG_CLOEXEC)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close(cid)
            return
        for fd in fds:
            conn.drop_fd()
            conn.received_fd = fd
        if not data:
            self.close(cid)
            return
        if not conn.inbuf:
            conn.in_since = time.monotonic()
        conn.inbuf += data
        self.parse(cid)

    def parse(self, cid: int) -> None:
        """Serve the complete requests in the input buffer, one at a time: never while a reply is pending."""
        conn = self.conns.get(cid)
        while conn is not None and not (conn.busy or conn.out or conn.close_after_send):
            if conn.parked_until is not None:
                # One request at a time: a parked request ends the loop until it is answered, and
                # more input from its client answers it now, before the next request is read.
                if not conn.inbuf or not self.unpark(cid):
                    break
                self.wake(cid)
                conn = self.conns.get(cid)
                continue
            if len(conn.inbuf) < 4:
                break
            n = frame_length(conn.inbuf)
            if n > self.limits.max_request:
                msg = f"message of {n} bytes exceeds the {self.limits.max_request}-byte limit"
                self.reply(cid, refusal(TOO_LARGE, msg), close=True)
                return
            if len(conn.inbuf) < 4 + n:
                break
            body = bytes(conn.inbuf[4 : 4 + n])
            del conn.inbuf[: 4 + n]
            conn.in_since = time.monotonic()
            conn.served = True
            try:
                self.serve_request(cid, conn, body)
            finally:
                conn.drop_fd()  # a descriptor the request did not take is not kept
            conn = self.conns.get(cid)
        if conn is not None:
            self._watch(cid, conn)

    def serve_request(self, cid: int, conn: Conn, request: bytes | dict[str, Any]) -> None:
        """Handle one request (its frame's body, or the request parsed: one served again); a refusal
        is the reply to anything wrong with it."""
        try:
            self.handle(cid, conn, parse_request(request) if isinstance(request, bytes) else request)
        except ProtocolError as e:
            self.reply(cid, refusal(e.error, str(e)))
        except (StoreError, OSError) as e:  # what the client sent or named is bad: no traceback
            log.warning("request from pid %d refused: %s", conn.pid, e)
            self.reply(cid, refusal(type(e).__name__, str(e)[:1000]))
        except Exception as e:  # one request, however malformed, never ends the loop
            log.exception("request from pid %d failed", conn.pid)
            self.reply(cid, refusal(type(e).__name__, str(e)[:1000]))

    # ---- writing --------------------------------------------------------------------------------

    def reply(
        self, cid: int, msg: dict[str, Any] | bytes, *, fd: int | None = None, close: bool = False
    ) -> None:
        """Queue a reply (with a duplicate of `fd`, sent along) and send what the socket takes now.

        `msg` may be a frame already encoded (one reply sent to many connections is encoded once).
        """
        conn = self.conns.get(cid)
        if conn is None:
            return
        if isinstance(msg, dict) and msg.get("ok") is False:
            self.refused(str(msg.get("error"))[:100])
        try:
            data = msg if isinstance(msg, bytes) else encode(msg)
        except (DaemonError, TypeError, ValueError) as e:
            data = encode({"ok": False, "error": "reply_failed", "message": str(e)[:1000]})
            fd = None
        fds = [os.dup(fd)] if fd is not None else []
        if not conn.out:
            conn.out_since = time.monotonic()
        conn.out.append((data, fds))
        conn.close_after_send = conn.close_after_send or close
        if self._send(cid, conn):
            if not conn.out and conn.close_after_send:
                self.close(cid)
            else:
                self._watch(cid, conn)

    def flush(self, cid: int) -> None:
        """The socket takes more: send, then serve the requests that waited for the reply."""
        conn = self.conns.get(cid)
        if conn is None or not self._send(cid, conn):
            return
        if not conn.out and conn.close_after_send:
            self.close(cid)
        elif not conn.out:
            self.parse(cid)
        else:
            self._watch(cid, conn)

    def _send(self, cid: int, conn: Conn) -> bool:
        """Send what the socket takes; False if that closed the connection."""
        while conn.out:
            data, fds = conn.out[0]
            try:
                sent = socket.send_fds(conn.sock, [data], fds) if fds else conn.sock.send(data)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.close(cid)
                return False
            for fd in fds:  # on their way: the kernel holds them now
                os.close(fd)
            if sent < len(data):
                conn.out[0] = (memoryview(data)[sent:], [])  # a reply must be read whole within the timeout
                break
            conn.out.popleft()
            conn.out_since = time.monotonic()
        return True

    # ---- bookkeeping ----------------------------------------------------------------------------

    def _watch(self, cid: int, conn: Conn) -> None:
        """Select what to wait for: replies to send, and more input only when it may be served."""
        events = selectors.EVENT_WRITE if conn.out else 0
        wants_input = not (conn.busy or conn.out or conn.close_after_send)
        if wants_input and len(conn.inbuf) < 4 + self.limits.max_request:
            events |= selectors.EVENT_READ
        if events == conn.events:
            return
        if conn.events == 0:
            self.sel.register(conn.sock, events, cid)
        elif events == 0:
            self.sel.unregister(conn.sock)
        else:
            self.sel.modify(conn.sock, events, cid)
        conn.events = events

    def set_busy(self, cid: int, busy: bool) -> None:
        conn = self.conns.get(cid)
        if conn is not None:
            conn.busy = busy
            self._watch(cid, conn)

    def close(self, cid: int) -> None:
        conn = self.conns.pop(cid, None)
        if conn is None:
            return
        if conn.parked_until is not None:
            self.parked -= 1
        for _data, fds in conn.out:
            for fd in fds:
                os.close(fd)
        conn.out.clear()
        conn.drop_fd()
        self.on_close(cid, conn)
        if conn.events:
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(conn.sock)
        conn.sock.close()

    def expire(self) -> None:
        """Answer the parked requests whose deadline passed; drop connections that stalled past the I/O timeout."""
        now = time.monotonic()
        due = [
            c for c, conn in self.conns.items() if conn.parked_until is not None and conn.parked_until <= now
        ]
        for cid in due:
            if self.unpark(cid):
                self.wake(cid)
        timeout = self.limits.io_timeout
        for cid, conn in list(self.conns.items()):
            deadline = conn.deadline(timeout)
            if deadline is not None and now > deadline:
                log.warning("closing connection from pid %d: no progress in %.1f s", conn.pid, timeout)
                self.close(cid)

    def dispatch(self, key: selectors.SelectorKey, events: int) -> None:
        """Serve one ready connection; an error closes that connection, never the loop."""
        cid = int(key.data)
        try:
            if events & selectors.EVENT_WRITE:
                self.flush(cid)
            if events & selectors.EVENT_READ and cid in self.conns:
                self.readable(cid)
        except Exception:
            log.exception("connection %d failed; closing it", cid)
            self.close(cid)

    def close_all(self) -> None:
        for cid in list(self.conns):
            self.close(cid)
        if self._spare_fd is not None:
            os.close(self._spare_fd)
            self._spare_fd = None
