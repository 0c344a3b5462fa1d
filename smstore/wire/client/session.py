"""The client's daemon connections: a store attached from the daemon, the session of a dataset's
shards, one request, sharing a file's copy, and what a fork of the process drops."""

from __future__ import annotations

import os
import socket
import threading
import weakref
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
from smstore.wire.ipc import connect, exchange, request, socket_path
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

    def detach_through(self, session: DaemonSession) -> None:
        """Leave the daemon's client list through `session` when closed (not the attaching one)."""
        self._session = session

    def close(self) -> None:
        """Unmap (once no record view is alive) and leave the daemon's client list."""
        if not self.closed and self._session is not None:
            self._session.detach(self.checksum)
        super().close()
        self._drop_connection()

    def __del__(self) -> None:
        # Dropping a Store without close() is normal use: leave quietly, no ResourceWarning.
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


class DaemonSession:
    """One connection to the daemon for many attaches: the shards of one dataset in one process.

    The daemon lists this process as a client of every segment attached through the connection
    while it stays open. A forked child drops its parent's connection and opens its own on its
    first attach.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.conn: socket.socket | None = None
        # One exchange (or detach) at a time on the connection. Reentrant: a finalizer that closes
        # the session may run in the thread in the middle of an exchange.
        self.lock = threading.RLock()
        self.finished = False  # closed for good (`finish`): never connects again
        keep_attached(self)

    def attach(self, checksum: str, path: str | None = None) -> tuple[dict[str, Any], int | None]:
        """The daemon's reply to attaching the segment holding `checksum`, and its fd if it sent one.

        With `path`, a shard the daemon is loading at the moment (one a rank holds: see
        :class:`smstore.wire.residency.ShardResidency`) is waited for, up to `LOAD_WAIT` seconds.

        Raises:
            DaemonError: No daemon answers, or the exchange failed (the connection is dropped).
        """
        message: dict[str, Any] = {"op": "attach", "checksum": checksum}
        if path is not None:
            message["path"] = absolute(path)
        return self.ask(message, LOAD_WAIT if path is not None else 10.0)

    def hold_shard(self, manifest: Manifest, index: int) -> dict[str, Any]:
        """Hold shard `index` of `manifest` for this process (replacing what it held before): the
        daemon's reply, once it has the manifest (fetched first, for a dataset in object storage).

        Raises:
            DaemonError: No daemon answers, or the exchange failed.
        """
        # "reader": apart from the samplers' holds (loaded after them, never listed to the readers
        # that follow the holds: those unmap the shards no sampler holds).
        message = {"op": "hold", **hold_fields(manifest), "pieces": str(int(index)), "reader": True}
        reply, fd = self.ask(message, LOAD_WAIT)
        if fd is not None:
            os.close(fd)
        return reply

    def ask(self, message: dict[str, Any], timeout: float) -> tuple[dict[str, Any], int | None]:
        """The daemon's reply to `message` on the session's connection, and the fd it sent, if any.

        Raises:
            DaemonError: No daemon answers, or the exchange failed (the connection is dropped).
        """
        with self.lock:
            if self.finished:
                raise DaemonError(f"smstore: the daemon session on {self.path} is closed")
            return self._ask(message, timeout)

    def _ask(self, message: dict[str, Any], timeout: float) -> tuple[dict[str, Any], int | None]:
        for attempt in (1, 2):
            reused = self.conn is not None
            if self.conn is None:  # a new connection: refused as busy, it tries again a while
                reply, fd, self.conn = request(message, self.path, timeout=timeout)
                return reply, fd
            try:
                self.conn.settimeout(timeout)
                return exchange(self.conn, message, self.path)
            except DaemonError:
                self._drop_connection()
                if not reused or attempt == 2:
                    raise
                # The daemon we attached earlier is gone; one that replaced it may serve us.
            except BaseException:
                self._drop_connection()
                raise
        raise AssertionError  # unreachable: the second attempt returns or raises

    def detach(self, checksum: str) -> None:
        """Tell the daemon this process unmapped the segment holding `checksum` (best effort)."""
        with self.lock:
            if self.finished:
                return  # its connection closed: the daemon forgot what it attached
            try:  # no reply to wait for: releasing a shard costs one send
                if self.conn is None:  # the daemon takes any connection of this process
                    self.conn = connect(self.path)
                self.conn.sendall(encode({"op": "detach", "checksum": checksum, "noreply": True}))
            except (OSError, DaemonError):
                self._drop_connection()  # no daemon: it holds nothing for us any more

    def close(self) -> None:
        """Close the connection (the next attach opens another)."""
        self._drop_connection()

    def finish(self) -> None:
        """Close the connection for good: later attaches fail and detaches do nothing."""
        with self.lock:
            self.finished = True
            self._drop_connection()

    def _drop_connection(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.close()

    def _after_fork_in_child(self) -> None:
        # Another thread (the pre-attacher) may have held the lock at the fork: that thread does
        # not exist here to release it, so the child's first attach would block forever.
        self.lock = threading.RLock()
        self._drop_connection()

    def __del__(self) -> None:
        self._drop_connection()


def _after_fork_in_child() -> None:
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
