"""The client's daemon connections: a store attached from the daemon, the session of a dataset's
shards, one request, sharing a file's copy, and what a fork of the process drops."""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import socket
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from smstore import _core
from smstore.errors import DaemonError, StoreFormatError
from smstore.format.manifest import (
    Manifest,
    absolute,
    hold_fields,
)
from smstore.format.objects import DecodedItems, object_decoder
from smstore.read.store import Store
from smstore.wire import fork as _fork
from smstore.wire.ipc import connect, receive, request, socket_path
from smstore.wire.protocol import NOT_SERVED, encode

__all__ = [
    "LOAD_WAIT",
    "DaemonObjectStore",
    "DaemonSession",
    "DaemonStore",
    "attach_shared",
    "daemon_request",
    "keep_attached",
    "refused",
    "session_for",
    "share_with_daemon",
]


class DaemonStore(Store):
    """A Store over the daemon's read-only shared-memory segment (see :func:`open_store`).

    The daemon validated the blob (checksum and index) when it loaded it, and no other user can
    write the segment, so attaching checks only the header and the index's ends: O(1), whatever
    the blob's size. Every record access still checks its offsets against the data section.
    """

    def __init__(
        self,
        fd: int,
        path: str,
        info: dict[str, Any],
        conn: socket.socket | None,
        session: DaemonSession | None = None,
    ) -> None:
        _core.Store.__init__(self, fd, path, False)
        self.segment: str = str(info.get("segment", ""))
        self._conn = conn
        self._session = session
        keep_attached(self)

    def detach_through(self, session: DaemonSession | None) -> None:
        """Leave the daemon's client list through `session` when closed (None: not at all)."""
        self._session = session

    def close(self) -> None:
        """Unmap (once no record view is alive) and leave the daemon's client list."""
        if not self.closed and self._session is not None:
            self._session.detach(self.checksum)
        super().close()
        self._drop_connection()

    def __del__(self) -> None:
        # Dropping a Store without close() is normal use: leave quietly, no ResourceWarning. Its
        # segment stays mapped until the Store's own teardown, so the daemon hears it went only
        # from close(); a process's session outlives its stores.
        self._drop_connection()

    def _drop_connection(self) -> None:
        conn = getattr(self, "_conn", None)
        if conn is not None:
            conn.close()
            self._conn = None

    def __repr__(self) -> str:
        if self.closed:
            return "<smstore.DaemonStore (closed)>"
        return (
            f"<smstore.DaemonStore {self.path!r} in {self.segment}: {len(self)} records, {self.nbytes} bytes>"
        )


# Holders of connections that keep this process listed as a client of a segment (anything with a
# _drop_connection method); a forked child must not keep its parent's (the daemon would otherwise
# see the parent as attached after it exited).
_attachments: weakref.WeakSet[Any] = weakref.WeakSet()


def keep_attached(holder: Any) -> None:
    """Have `holder._drop_connection()` called in every forked child of this process."""
    _attachments.add(holder)


# How long a reader waits for the daemon to finish loading a shard it asked for.
LOAD_WAIT = 300.0


class DaemonObjectStore(DecodedItems, DaemonStore):
    """The daemon's copy of a blob of objects (:func:`smstore.open` of a blob URL): items decoded
    as :class:`smstore.ObjectStore`'s, ``raw(i)`` the record's bytes."""

    _raw = _core.Store

    def __init__(self, *args: Any) -> None:  # DaemonStore's
        DaemonStore.__init__(self, *args)
        decoder = object_decoder(self.encoding)
        if decoder is None:  # only made for a blob of objects
            label, encoding = self.path, self.encoding
            self.close()
            raise StoreFormatError(f"{label}: records are encoded as {encoding!r}, not as objects")
        self._decode = decoder


# Told the reply to a request sent without waiting, or why none will come.
_OnReply = Callable[[dict[str, Any] | None, BaseException | None], None]


class _Ticket:
    """A request on a session's connection whose reply has not been read yet."""

    __slots__ = ("done", "error", "fd", "on_reply", "reply", "timeout")

    def __init__(self, timeout: float, on_reply: _OnReply | None) -> None:
        self.timeout = timeout
        self.on_reply = on_reply  # a request sent without waiting: told its reply (or failure)
        self.done = False
        self.reply: dict[str, Any] = {}
        self.fd: int | None = None
        self.error: BaseException | None = None

    def settle(self, reply: dict[str, Any] | None, fd: int | None, error: BaseException | None) -> None:
        self.done, self.error = True, error
        if reply is not None:
            self.reply, self.fd = reply, fd
        if self.on_reply is not None:
            if fd is not None:
                os.close(fd)
                self.fd = None
            self.on_reply(reply, error)


class DaemonSession:
    """This process's one connection to the daemon on one socket (see :func:`session_for`).

    Shared by everything of the process that speaks to that daemon: the stores and the sharded
    datasets attached from it, the pre-attacher's questions, the samplers' residencies and the
    block readers. The daemon serves a connection's requests one at a time, in order (a parked
    ``held`` question is answered as soon as another request follows it), so replies come back in
    the order of the requests: each request takes a place in a queue, and whichever waiting thread
    reads the next reply hands it to the request at the queue's head. Requests a caller does not
    wait for (a residency's holds, detaches) still get their reply, read by the next reader, so no
    stray refusal is ever taken for another request's answer. What waits daemon-side (an attach of
    a shard still loading) waits on a connection of its own (see :meth:`attach`), so a detach that
    would free the room that load needs is never queued behind it.

    The daemon keeps a connection's holds apart by holder (:meth:`new_holder`), and lists the
    process as a client of what it attached through it while it stays open. A forked child has
    its own session (the fork handler empties the registry).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.conn: socket.socket | None = None
        self._pid = os.getpid()
        # Sends and the queue of replies to come, in one order (`_owner`: the sending thread).
        self.lock = threading.Lock()
        self._owner: int | None = None
        # Sent by a finalizer while its thread was sending: sent right after.
        self._deferred: list[tuple[dict[str, Any], _OnReply]] = []
        # Reentrant: a finalizer may send (and read what came) in a thread waiting for a reply.
        self._replies = threading.Condition(threading.RLock())
        self._queue: collections.deque[_Ticket] = collections.deque()
        self._reading = False  # a thread reads the next reply (the others wait for theirs)
        keep_attached(self)

    def _live(self) -> DaemonSession:
        """This session, or (in a forked child that kept its parent's) the child's own."""
        return self if self._pid == os.getpid() else session_for(self.path)

    @staticmethod
    def new_holder() -> int:
        """A holder id of this process: the daemon replaces only that holder's holds on a hold."""
        return next(_holders)

    def attach(self, checksum: str, path: str | None = None) -> tuple[dict[str, Any], int | None]:
        """The daemon's reply to attaching the segment holding `checksum`, and its fd if it sent one.

        With `path`, a shard (or piece) the daemon is loading at the moment, or that waits for
        room, is waited for, up to `LOAD_WAIT` seconds, on a connection opened for that wait: the
        daemon reads nothing more on a connection while it waits, and this process may have to
        detach what it still maps before that load finds room. Once loaded it is attached on the
        session's connection (where its client listing belongs) and the waiting one is closed.

        Raises:
            DaemonError: No daemon answers, or the exchange failed.
        """
        session = self._live()
        message: dict[str, Any] = {"op": "attach", "checksum": checksum}
        reply, fd = session.ask(message, 10.0)
        if path is None or fd is not None or reply.get("error") != NOT_SERVED or reply.get("reason"):
            return reply, fd
        reply, fd, waited = request({**message, "path": absolute(path)}, session.path, timeout=LOAD_WAIT)
        try:
            if fd is None:
                return reply, None  # why it is not served (a failed load), or not held at all
            os.close(fd)
            return session.ask(message, 10.0)
        finally:
            waited.close()

    def hold_shard(self, manifest: Manifest, index: int, holder: int) -> dict[str, Any]:
        """Hold shard `index` of `manifest` for `holder`, a reader of this process (replacing what it
        held before): the daemon's reply, once it has the manifest (fetched first, for a dataset in
        object storage).

        Raises:
            DaemonError: No daemon answers, or the exchange failed.
        """
        # "reader": apart from the samplers' holds (loaded after them, never listed to the readers
        # that follow the holds: those unmap the shards no sampler holds).
        message = {
            "op": "hold",
            **hold_fields(manifest),
            "pieces": str(int(index)),
            "reader": True,
            "holder": holder,
        }
        reply, fd = self.ask(message, LOAD_WAIT)
        if fd is not None:
            os.close(fd)
        return reply

    def ask(self, message: dict[str, Any], timeout: float) -> tuple[dict[str, Any], int | None]:
        """The daemon's reply to `message` on the session's connection, and the fd it sent, if any.

        A connection found gone (the daemon restarted) is replaced once: a new one says whether a
        daemon serves again (refused as busy, it tries again a while).

        Raises:
            DaemonError: No daemon answers, or the exchange failed (the connection is dropped).
        """
        session = self._live()
        for attempt in (1, 2):
            ticket, fresh = session._send(message, timeout, None)
            if fresh is not None:
                return fresh
            assert ticket is not None
            session._await(ticket)
            if ticket.error is None:
                return ticket.reply, ticket.fd
            if attempt == 2 or not isinstance(ticket.error, DaemonError):
                raise ticket.error
        raise AssertionError  # unreachable: the second attempt returns or raises

    def open(self) -> None:
        """Connect now if not connected (a residency choosing between the daemon and the files).

        Raises:
            DaemonError: No daemon answers.
        """
        session = self._live()
        with session.lock:
            if session.conn is None:
                session.conn = connect(session.path)

    def send(
        self,
        message: dict[str, Any],
        on_reply: _OnReply,
        timeout: float = 10.0,
        *,
        frame: bytes | None = None,
    ) -> None:
        """Send `message` without waiting: `on_reply` is told its reply (or the connection's failure)
        by whichever thread reads it next (at the latest this session's next request). `frame`:
        `message` encoded already (then `message` is not read), sent only on a connection open now.

        Raises:
            DaemonError: No daemon answers (no connection could be made).
        """
        session = self._live()
        if session._owner == threading.get_ident():
            # A finalizer run in the middle of this thread's own send: sent after it.
            session._deferred.append((message, on_reply))
            return
        if frame is not None and session.conn is None:
            raise DaemonError(f"no connection to the smstore daemon on {session.path}")
        session._pump()
        _ticket, fresh = session._send(message, timeout, on_reply, frame)
        if fresh is not None:
            on_reply(fresh[0], None)
            if fresh[1] is not None:
                os.close(fresh[1])

    def detach(self, checksum: str) -> None:
        """Tell the daemon this process unmapped the segment holding `checksum` (best effort)."""
        session = self._live()
        message = {"op": "detach", "checksum": checksum}
        if session.conn is None:
            return  # no connection: the daemon forgot what this process attached through it
        with contextlib.suppress(DaemonError):
            session.send(message, _ignore)

    def _send(
        self,
        message: dict[str, Any],
        timeout: float,
        on_reply: _OnReply | None,
        frame: bytes | None = None,
    ) -> tuple[_Ticket | None, tuple[dict[str, Any], int | None] | None]:
        """Queue `message`'s reply and send it; or, with no connection, open one and exchange it
        there (the only request in flight on it): (its ticket, None) or (None, (reply, fd))."""
        with self.lock:
            self._owner = threading.get_ident()
            try:
                if self.conn is None:
                    if frame is not None:
                        raise DaemonError(f"no connection to the smstore daemon on {self.path}")
                    reply, fd, conn = request(message, self.path, timeout=timeout)
                    self.conn = conn
                    self._flush_deferred()
                    return None, (reply, fd)
                ticket = _Ticket(timeout, on_reply)
                with self._replies:
                    self._queue.append(ticket)
                try:
                    self.conn.settimeout(max(timeout, 10.0))
                    self.conn.sendall(encode(message) if frame is None else frame)
                    self._flush_deferred()
                except OSError as e:
                    with self._replies:
                        self._fail(
                            DaemonError(f"the smstore daemon on {self.path} is gone: {e.strerror or e}")
                        )
                return ticket, None
            finally:
                self._owner = None

    def _flush_deferred(self) -> None:
        while self._deferred and self.conn is not None:
            message, on_reply = self._deferred.pop(0)
            with self._replies:
                self._queue.append(_Ticket(10.0, on_reply))
            self.conn.sendall(encode(message))

    def _await(self, ticket: _Ticket) -> None:
        """Read replies (or wait for the thread reading them) until `ticket`'s has come."""
        with self._replies:
            while not ticket.done:
                if self._reading:
                    self._replies.wait()
                else:
                    self._read_one()

    def pump(self) -> None:
        """Read the replies already arrived for requests no one waits for (never blocks): their
        senders hear them (a residency, a refusal of its last hold) before they send again."""
        self._live()._pump()

    def _pump(self) -> None:
        with self._replies:
            while self._queue and not self._reading and self.conn is not None:
                try:
                    ready = bool(self.conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
                except BlockingIOError:
                    return
                except OSError:
                    ready = True  # the read says what went wrong
                if not ready:  # the daemon closed the connection
                    self._fail(DaemonError(f"the smstore daemon on {self.path} closed the connection"))
                    return
                self._read_one()

    def _read_one(self) -> None:
        """Read the next reply, the lock on the queue released meanwhile (called holding it)."""
        conn, head = self.conn, self._queue[0] if self._queue else None
        if conn is None or head is None:
            if head is not None:
                self._fail(DaemonError(f"the smstore daemon connection on {self.path} was closed"))
            return
        self._reading = True
        self._replies.release()
        error: BaseException | None = None
        try:
            with contextlib.suppress(OSError):
                conn.settimeout(max((t.timeout for t in list(self._queue)), default=10.0))
            reply, fd = receive(conn, self.path)
        except BaseException as e:  # noqa: BLE001 - every request waiting hears it (`_fail`)
            error = e
        finally:
            self._replies.acquire()
            self._reading = False
        if error is not None:
            self._fail(error)
            return
        ticket = self._queue.popleft()
        self._replies.notify_all()
        self._replies.release()
        try:
            ticket.settle(reply, fd, None)
        finally:
            self._replies.acquire()

    def _fail(self, error: BaseException) -> None:
        """The connection is of no further use: every reply still to come fails with `error`
        (called holding the queue's lock)."""
        self._replies.notify_all()
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.close()
        pending = list(self._queue)
        self._queue.clear()
        for ticket in pending:
            ticket.settle(None, None, error)

    def close(self) -> None:
        """Close the connection: what this process holds and attached through it is released."""
        self._drop_connection()

    def _drop_connection(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.close()

    def _after_fork_in_child(self) -> None:
        # Another thread (the pre-attacher) may have held a lock at the fork: that thread does not
        # exist here to release it. The parent's connection and queue are the parent's.
        self.lock = threading.Lock()
        self._owner = None
        self._replies = threading.Condition(threading.RLock())
        self._queue = collections.deque()
        self._deferred = []
        self._reading = False
        self._drop_connection()

    def __del__(self) -> None:
        self._drop_connection()


def _ignore(_reply: dict[str, Any] | None, _error: BaseException | None) -> None:
    pass


# This process's sessions, one per daemon socket; a forked child starts with none.
_sessions: dict[Path, DaemonSession] = {}
_sessions_lock = threading.Lock()
_holders = itertools.count(1)  # 0: a hold without a holder (a client of an earlier release)


def session_for(sock: str | os.PathLike[str] | None = None) -> DaemonSession:
    """This process's one session with the daemon on `sock` (default: see `socket_path`)."""
    path = socket_path(sock)
    with _sessions_lock:
        session = _sessions.get(path)
        if session is None:
            session = _sessions[path] = DaemonSession(path)
        return session


def _after_fork_in_child() -> None:
    global _sessions_lock
    _sessions_lock = threading.Lock()
    _sessions.clear()
    for holder in list(_attachments):
        after_fork = getattr(holder, "_after_fork_in_child", None)
        if after_fork is not None:
            after_fork()
        else:
            holder._drop_connection()


_fork.in_child(_after_fork_in_child)


def refused(reply: dict[str, Any], what: str) -> DaemonError:
    """The error for a reply that says no, in the daemon's words."""
    return DaemonError(f"smstore daemon: {reply.get('message', reply.get('error', what))}")


def daemon_request(
    message: dict[str, Any], sock: str | os.PathLike[str] | None = None, *, timeout: float | None = 10.0
) -> dict[str, Any]:
    """Send one request to the daemon and return its reply; DaemonError if it refused or failed."""
    reply, fd, conn = request(message, socket_path(sock), timeout=timeout)
    conn.close()
    if fd is not None:
        os.close(fd)
    if not reply.get("ok"):
        raise refused(reply, "request failed")
    return reply


def share_with_daemon(
    fd: int, key: str, sock: str | os.PathLike[str] | None = None
) -> tuple[dict[str, Any], socket.socket]:
    """Hand a sealed memfd blob to the daemon, which serves it under `key` to later `attach_shared` calls.

    Returns the reply and the connection: keep it open for as long as the daemon should hold the blob
    (it drops a shared blob when no client is attached any more).

    Raises:
        DaemonError: No daemon answers, or it refused.
    """
    reply, got, conn = request({"op": "share", "key": key}, socket_path(sock), timeout=60.0, fd=fd)
    if got is not None:
        os.close(got)  # our own blob (or an identical one already served) handed back: we hold ours
    if not reply.get("ok"):
        conn.close()
        raise refused(reply, "share refused")
    conn.settimeout(None)
    return reply, conn


def attach_shared(
    key: str, sock: str | os.PathLike[str] | None = None
) -> tuple[int, dict[str, Any], socket.socket] | None:
    """The descriptor of a blob the daemon serves under content `key`, or None if it serves none.

    Raises:
        DaemonError: No daemon answers, or the exchange failed.
    """
    reply, fd, conn = request({"op": "attach", "key": key}, socket_path(sock), timeout=10.0)
    if not reply.get("ok") or fd is None:
        conn.close()
        if fd is not None:
            os.close(fd)
        if reply.get("error") == NOT_SERVED:
            return None
        raise refused(reply, "attach refused")
    conn.settimeout(None)
    return fd, reply, conn
