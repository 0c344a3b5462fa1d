"""Residency: keep the pieces of a sharded dataset that an order reads next resident on the node, off the critical path.

A rank's sampler says which pieces it needs (a window's shards, or a block window's record ranges
of them: :class:`smstore.wire.protocol.Piece`; a shard is the piece of all its records) as its
order reaches them. With a daemon (``smstore serve``), the daemon loads them into shared memory in
the background, within its ``--shm-limit``, and drops a piece once no rank holds it any more.
Without one, their bytes are read ahead into the page cache (``posix_fadvise``) and the released
ones are dropped from it. Either way the sampler never waits, except once at the start of a pass,
where a budget too small for a piece is reported before any batch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from smstore import _core
from smstore.errors import DaemonError, StoreChangedError, StoreError
from smstore.format.manifest import Manifest, absolute, hold_fields, read_manifest
from smstore.read.modes import Mode, check_mode, fall_back
from smstore.wire.client import DaemonSession, session_for
from smstore.wire.ipc import socket_path
from smstore.wire.protocol import Piece, encode, pieces_value
from smstore.wire.protocol import frame as framed

__all__ = ["Residency", "ShardResidency"]

log = logging.getLogger("smstore")


class _Unreachable(Exception):
    """The daemon did not answer (as opposed to refusing)."""


class Residency:
    """Which pieces of a sharded dataset this rank needs now, told to the daemon or the page cache.

    Args:
        path: The manifest, or a directory holding ``manifest.json``.
        mode: ``"auto"``: the daemon if one answers on ``socket``, else the page cache (and,
            also when the daemon dies later, says so as every reader does: a warning once per
            process, see :func:`smstore.read.modes.fall_back`); ``"daemon"``: require it (a
            :class:`DaemonError` naming the socket); ``"mmap"``: the page cache only, never a
            daemon.
        socket: The daemon's socket (default: ``$SMSTORE_SOCKET``, else the per-user default).
        manifest: The dataset's manifest, already read (a dataset URL's: not fetched again).

    Raises:
        ValueError: ``mode`` is none of those.

    Attributes:
        kind: ``"daemon"`` or ``"page cache"``, once the first :meth:`hold` has decided.
        limit: The daemon's ``--shm-limit`` in bytes (0: none) once a hold's reply said it, else None.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        mode: Mode = "auto",
        socket: str | os.PathLike[str] | None = None,
        manifest: Manifest | None = None,
    ) -> None:
        self.mode: Mode = check_mode(mode)
        if manifest is None:
            manifest = read_manifest(path)
        self.manifest = manifest
        self.path = absolute(manifest.path)
        self.shards = [(absolute(manifest.shard_path(k)), s.checksum) for k, s in enumerate(manifest.shards)]
        # A dataset in object storage: only the daemon can fetch its shards (no page cache to fall
        # back to), and its holds name the dataset's checksum.
        self.remote = manifest.remote
        self._hold_fields = hold_fields(manifest)
        self.sizes = [s.file_size for s in manifest.shards]
        self.socket = socket_path(socket)
        self.kind: str | None = None
        self.limit: int | None = None  # the daemon's --shm-limit (0: none), as its last hold's reply said
        # Its holds on the process's session are its own: the daemon replaces only this holder's.
        self._holder = DaemonSession.new_holder()
        self._refused: bool | None = None  # a hold sent without waiting was refused (or unanswered)
        self._held: tuple[Piece | int, ...] = ()
        self._advised: set[Piece] = set()
        self._error: BaseException | None = None
        self._pending: queue.Queue[tuple[Piece | int, ...] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        # A residency never closed ends its thread when it is collected (the thread holds it weakly).
        weakref.finalize(self, self._pending.put, None)
        self._lock = threading.Lock()  # one hold applied at a time (the thread's, or a waited one)
        # The hold's frame around its piece list, encoded once: a hold is sent inside the
        # training loop's next(), where even json.dumps of a small dict costs tens of microseconds.
        head = encode({"op": "hold", **self._hold_fields, "holder": self._holder, "pieces": ""})
        self._frame_head, self._frame_tail = head[4:-2], b'"}'

    def hold(self, pieces: Sequence[Piece | int], *, wait: bool = False) -> None:
        """Need `pieces` (in the order to load them) and no others from now on.

        Args:
            pieces: The pieces, the window's first: :class:`~smstore.wire.protocol.Piece` s, or
                shard indices of the manifest (each the piece of all its records).
            wait: Apply it before returning, and raise what it raises (a budget too small, no
                daemon with ``mode="daemon"``): the first hold of a pass, so a refusal is raised
                before any batch. Otherwise it is sent without waiting for the daemon's reply
                (inside the training loop's ``next()``), or applied by a background thread, and
                an error it met is raised by the next call.

        Raises:
            DaemonError: The daemon refused (a piece larger than its ``--shm-limit``, a shard
                changed since its manifest was written), or none answers with ``mode="daemon"``.
        """
        wanted = tuple(p if isinstance(p, Piece) else int(p) for p in pieces)
        if wait:  # a new start: an error of the holds before it is stale
            self._error = None
            self._apply(wanted)
            return
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if self.kind == "daemon":
            self._session.pump()  # a refusal of the last hold, arrived since, is heard now
        if self.kind == "daemon" and self._session.conn is not None and not self._refused:
            # One send from this thread: no reply to wait for, no thread to wake (a woken thread
            # would take the GIL from the training loop for milliseconds at every window).
            self._send_hold(wanted)
            return
        if self._refused:  # an earlier hold refused: this one is applied with a reply, here
            self._apply(wanted)
            return
        if self._thread is None:
            self._thread = threading.Thread(
                target=Residency._run,
                args=(weakref.ref(self), self._pending),
                name="smstore-residency",
                daemon=True,
            )
            self._thread.start()
        self._pending.put(wanted)

    @staticmethod
    def _run(ref: weakref.ref[Residency], pending: queue.Queue[tuple[Piece | int, ...] | None]) -> None:
        while True:
            wanted = pending.get()
            with contextlib.suppress(queue.Empty):
                while True:  # only the latest set matters
                    wanted = pending.get_nowait()
            residency = ref()
            if wanted is None or residency is None:
                return
            try:
                residency._apply(wanted)
            except Exception as e:  # noqa: BLE001 - reported to the sampler by its next hold()
                residency._error = e
            del residency  # between holds the thread keeps no reference: the residency can be collected

    def _apply(self, wanted: tuple[Piece | int, ...]) -> None:
        with self._lock:
            if self.kind is None:
                self.kind = self._choose()
            if self.kind == "daemon":
                try:
                    self._hold_in_daemon(wanted)
                except _Unreachable as e:
                    # The daemon died: read ahead into the page cache until one answers again.
                    fall_back(self._fallback_mode, self.path, str(e), self.socket, "shards")
                    self.kind = None
                    self._hold_in_page_cache(wanted)
            else:
                self._hold_in_page_cache(wanted)
            self._held = wanted

    @property
    def _fallback_mode(self) -> Mode:
        """A dataset in object storage has no page cache to fall back to: no daemon is an error."""
        return "daemon" if self.remote else self.mode

    def _choose(self) -> str:
        if self.mode == "mmap":
            if self.remote:
                msg = (
                    f'{self.path}: a dataset in object storage is held only by the daemon; mode="mmap" cannot'
                )
                raise DaemonError(msg)
            return "page cache"
        try:
            self._session.open()
        except DaemonError as e:
            fall_back(self._fallback_mode, self.path, str(e), self.socket, "shards")
            return "page cache"
        return "daemon"

    def _hold_in_daemon(self, wanted: tuple[Piece | int, ...]) -> None:
        self._refused = None  # this hold's reply says afresh
        try:
            reply, fd = self._session.ask(self._message(wanted), 10.0)
        except DaemonError as e:
            raise _Unreachable(str(e)) from None
        if fd is not None:
            os.close(fd)
        self._note_limit(reply)
        if not reply.get("ok"):
            # Nothing is held for this rank any more (what it held before may be the very pieces
            # refused now): its readers read the files, which say what changed.
            self._release()
            msg = f"{self.path}: the smstore daemon on {self.socket} refused: {reply.get('message', reply)}"
            raise DaemonError(msg)

    def _message(self, wanted: tuple[Piece | int, ...]) -> dict[str, Any]:
        return {"op": "hold", **self._hold_fields, "holder": self._holder, "pieces": pieces_value(wanted)}

    def _heard(self, reply: dict[str, Any] | None, error: BaseException | None) -> None:
        """The reply to a hold sent without waiting: a refusal (or no reply) has the next hold
        sent again with a reply, which raises the refusal if it still holds (or falls back)."""
        if error is not None or reply is None or not reply.get("ok"):
            self._refused = True
        else:
            self._note_limit(reply)

    def _note_limit(self, reply: dict[str, Any]) -> None:
        limit = reply.get("limit")
        if type(limit) is int and limit >= 0:  # a daemon before 0.1 says nothing
            self.limit = limit

    def _send_hold(self, wanted: tuple[Piece | int, ...]) -> None:
        """Tell the daemon without waiting for its reply (read later, by whichever request of the
        process's session comes next): the frame's head and tail encoded once, the pieces between."""
        body = b"%s%s%s" % (self._frame_head, pieces_value(wanted).encode(), self._frame_tail)
        try:
            self._session.send({}, self._heard, frame=framed(body))
        except DaemonError:
            self._apply(wanted)  # reconnects, or falls back (mode "auto") or raises
            return
        self._held = wanted

    def _hold_in_page_cache(self, wanted: tuple[Piece | int, ...]) -> None:
        pieces = [p if isinstance(p, Piece) else Piece(p) for p in wanted]
        for piece in pieces:
            if piece not in self._advised:
                self._advise(piece, os.POSIX_FADV_WILLNEED)
                self._advised.add(piece)
        for piece in self._advised - set(pieces):
            self._advise(piece, os.POSIX_FADV_DONTNEED)  # pages still mapped by a reader stay
            self._advised.discard(piece)

    def _advise(self, piece: Piece, advice: int) -> None:
        """Advise the kernel of the bytes of `piece`: the whole file of a shard, or its records' range."""
        path = self.shards[piece.shard][0]
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as e:
            log.warning("%s: shard %d: %s", self.path, piece.shard, e)
            return
        try:
            start, length = 0, 0  # the whole file
            if not piece.whole:
                start, length = _record_range(fd, path, piece)
            os.posix_fadvise(fd, start, length, advice)
        except (OSError, StoreError) as e:  # a file that is no blob (now): its reader says so
            log.warning("%s: shard %d: %s", self.path, piece.shard, e)
        finally:
            os.close(fd)

    @property
    def held(self) -> tuple[Piece | int, ...]:
        """The pieces of the latest hold applied, as given."""
        return self._held

    def close(self) -> None:
        """Stop the thread and give up every hold (the daemon drops what no other rank holds)."""
        if self._thread is not None:
            self._pending.put(None)
            self._thread.join(timeout=30)
            self._thread = None
        with self._lock:
            if self.kind == "daemon":
                self._release()

    def _release(self) -> None:
        if self._session.conn is not None:
            with contextlib.suppress(DaemonError):
                self._session.ask(self._message(()), 10.0)

    @property
    def _session(self) -> DaemonSession:
        """This process's session with the daemon (a forked child's own)."""
        return session_for(self.socket)

    def __getstate__(self) -> dict[str, Any]:
        msg = f"a {type(self).__name__} belongs to the process that made it; it does not pickle"
        raise TypeError(msg)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({Path(self.path).name!r}, kind={self.kind!r}, held={len(self._held)} pieces)"


def _record_range(fd: int, path: str, piece: Piece) -> tuple[int, int]:
    """The file offset and length of the records of `piece` (a record range) in the blob open at `fd`."""
    with _core.Store._from_fd(fd, path, False) as store:  # only two offsets read: O(1)
        offsets = store.offsets
        end = min(piece.stop, len(store))
        if not 0 <= piece.first < end:
            msg = f"{path}: records {piece.first}-{piece.stop} are outside a shard of {len(store)}"
            raise StoreChangedError(msg)
        start = _core.read_header_fd(fd, path).data_offset
        return start + int(offsets[piece.first]), int(offsets[end]) - int(offsets[piece.first])


# The name the residency of windows of shards had before pieces (a shard is the piece of all its records).
ShardResidency = Residency
