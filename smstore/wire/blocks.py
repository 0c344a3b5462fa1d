"""Blocks of a sharded dataset: record ranges the daemon holds instead of whole shards, and the reader of them.

A **block** is a run of at least ``block`` consecutive records of one shard (a shard is cut into
as many as fit, as even as whole records allow: :func:`shard_block`), read sequentially in one
go. The daemon holds it as a **piece** (a shard and a record range) and serves it as its own segment: a blob holding exactly the piece's records, named
(in the daemon's table) by :func:`piece_id` of the shard's checksum and the range, so a reader
finds it without asking which bytes it holds. Client and daemon import this module; it never
imports the daemon or torch.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import socket as socket_module
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from smstore import _core
from smstore.errors import DaemonError, RemoteNeedsDaemonError, StoreChangedError
from smstore.format.manifest import Manifest, absolute, hold_fields, read_manifest
from smstore.read.modes import Mode, check_mode, fall_back, warn_once
from smstore.remote.urls import needs_daemon
from smstore.wire.ipc import connect, exchange, socket_path, wait_until_served
from smstore.wire.protocol import (
    NOT_SERVED,
    PERMISSION_DENIED,
    Piece,
    encode,
    piece_id,
    piece_path,
    pieces_value,
)

# How long a reader's own hold may wait for its reply (the daemon fetching a dataset's manifest
# first): as long as a reader waits for a load (client.LOAD_WAIT).
HOLD_WAIT = 300.0

__all__ = ["BlockReader", "BlockResidency", "Piece", "piece_id", "piece_path", "shard_block"]


# Reads of pieces the daemon does not serve between two checks for released pieces still mapped.
_STALE_EVERY = 64


def shard_block(records: int, block: int, x: int) -> tuple[int, int]:
    """The block holding record ``x`` of a shard of ``records``: its records ``[lo, hi)`` in the shard.

    A shard is cut into ``m = max(1, records // block)`` blocks, block ``t`` holding records
    ``[t records // m, (t + 1) records // m)`` (``smstore.sampling.orders.block_bounds``, which cuts every
    shard the same way): each at least ``block`` records unless the whole shard is shorter.
    """
    m = max(1, records // block)
    t = ((x + 1) * m - 1) // records
    return t * records // m, (t + 1) * records // m


class BlockReader:
    """Records of a sharded dataset read from the daemon's block segments, else from the shard files.

    A reader (a DataLoader worker) asks the daemon for the piece holding a record; one the ranks'
    samplers hold arrives as soon as its load ends, and one that is not held (or whose load
    failed) is read from the shard's file instead, so every record reads the same bytes either
    way (``block_reads`` and ``file_reads`` count which). At most ``keep`` pieces stay mapped:
    the least recently read one is detached first, so the daemon can free the pieces the ranks
    moved past (a piece still mapped counts against ``--shm-limit`` until it is detached).

    Args:
        path: The manifest, or a directory holding ``manifest.json``.
        block: Records per block (the sampler's).
        keep: Pieces kept mapped (about the pieces the sampler holds).
        socket: The daemon's socket (default: ``$SMSTORE_SOCKET``, else the per-user default).

    Raises:
        StoreChangedError: A shard read from its file holds other contents than the manifest
            records.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, block: int, keep: int = 64, socket: str | None = None
    ) -> None:
        manifest = read_manifest(path)
        self.path = manifest.path
        self._hold_fields = hold_fields(manifest)
        self.block = int(block)
        self.keep = max(1, int(keep))
        paths = [manifest.shard_path(k) for k in range(len(manifest.shards))]
        self.shards = [(absolute(p), s.checksum) for p, s in zip(paths, manifest.shards, strict=True)]
        self.remote = [src.remote for src in manifest.sources]  # no file to read a piece from instead
        starts = [0]
        for s in manifest.shards:
            starts.append(starts[-1] + s.records)
        self.starts = starts
        self.socket = socket_path(socket)
        self.block_reads = 0
        self.file_reads = 0
        self._misses = 0  # reads of a held piece the daemon does not serve yet
        self._pieces: OrderedDict[str, tuple[Piece, _core.Store | None]] = OrderedDict()
        self._files: dict[int, _core.Store] = {}
        self._conn: socket_module.socket | None = None
        self._pid = os.getpid()

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, index: int) -> bytes:
        """The bytes of record ``index`` of the dataset."""
        if self._pid != os.getpid():  # a forked child: its own connection and mappings
            self._conn, self._pieces, self._files, self._pid = None, OrderedDict(), {}, os.getpid()
        i = int(index)
        if not 0 <= i < self.starts[-1]:
            msg = f"{self.path}: record {i} out of range for a dataset of {self.starts[-1]}"
            raise IndexError(msg)
        k = bisect.bisect_right(self.starts, i) - 1
        lo, hi = shard_block(self.starts[k + 1] - self.starts[k], self.block, i - self.starts[k])
        piece = Piece(k, lo, hi)
        store = self._piece(piece)
        if store is not None:
            self.block_reads += 1
            return bytes(store[i - self.starts[k] - lo])
        self.file_reads += 1
        return bytes(self._file(k)[i - self.starts[k]])

    def _piece(self, piece: Piece) -> _core.Store | None:
        key = piece_id(self.shards[piece.shard][1], piece.first, piece.end)
        entry = self._pieces.get(key)
        if entry is not None:
            self._pieces.move_to_end(key)
            return entry[1]
        store, why = self._attach_or_why(key, piece)
        if store is None and self.remote[piece.shard]:
            if why:  # its fetch failed (a hold after its backoff fetches it again)
                path = piece_path(self.shards[piece.shard][0], piece.first, piece.end)
                raise DaemonError(f"{path}: the smstore daemon will not serve it: {why}")
            store = self._fetch_for_reader(key, piece)  # no file to read it from instead
        if store is None:
            if self._conn is None:  # no daemon answers: this piece is read from its file from now on
                self._pieces[key] = (piece, None)
                while len(self._pieces) > self.keep:
                    self._detach(next(iter(self._pieces)))
            elif self._misses % _STALE_EVERY == 0:
                # Not served (yet): perhaps because the pieces this reader still maps, released,
                # fill the budget and the next loads wait for them. Drop them now and then.
                self._drop_stale()
            self._misses += 1
            return None  # not held now: read from the file, asked again next time
        # A new piece: the ranks moved on, so unmap the pieces no rank holds any more (a released
        # piece still mapped keeps its pages in the daemon's budget, and the next loads wait).
        self._drop_stale()
        self._pieces[key] = (piece, store)
        while len(self._pieces) > self.keep:
            self._detach(next(iter(self._pieces)))
        return store

    def _fetch_for_reader(self, key: str, piece: Piece) -> _core.Store:
        """The piece of a shard in object storage, which the daemon does not serve now.

        No sampler holds it (none is used, its ``lag`` released the piece while workers still read
        it, or its hold has not reached the daemon yet), and there is no file to read instead: this
        reader holds the piece itself (replacing the piece it held so before), so the daemon
        fetches it, and waits for it. A warning says so once per process. A reader the daemon does
        not let hold (a member of its ``--group``) waits for the owner's samplers instead.

        Raises:
            DaemonError: No daemon answers (only the daemon fetches from object storage), it
                refused the hold or the piece's shard failed (why, from the daemon), or it is not
                served within ``REMOTE_WAIT`` seconds.
        """
        path = piece_path(self.shards[piece.shard][0], piece.first, piece.end)
        warn_once(
            f"{self.path}: unheld",
            "%s: a block (%s) is read while no sampler holds it: fetched for this reader (slower "
            "than a hold ahead). Read a dataset in object storage with BlockWindowSampler, its lag at least "
            "prefetch_factor * num_workers * batch_size",
            self.path,
            path,
        )
        if self._conn is None:
            try:
                self._conn = connect(self.socket)
            except DaemonError:
                raise self._needs_daemon(piece) from None
        reply = self._hold_piece(piece)
        error = reply.get("error")
        if not reply.get("ok") and error not in (None, PERMISSION_DENIED):
            raise DaemonError(
                f"{path}: the smstore daemon on {self.socket} cannot serve it: {reply.get('message')}"
            )
        try:
            return self._wait_for_remote(key, piece)
        finally:
            if reply.get("ok"):
                # Held only until attached (the mapping keeps it; its pages count in the daemon's
                # budget until detached): a hold kept would keep it resident ahead of the samplers'.
                with contextlib.suppress(DaemonError):
                    self._hold_piece(None)

    def _needs_daemon(self, piece: Piece) -> RemoteNeedsDaemonError:
        return needs_daemon(
            self.shards[piece.shard][0],
            "a shard",
            why=f"none answers on {self.socket}",
            part=f"#records={piece.first}-{piece.end}",
        )

    def _hold_piece(self, piece: Piece | None) -> dict[str, Any]:
        """Hold `piece` for this reader (None: nothing): the daemon's reply, which waits for it to
        fetch the manifest of a dataset in object storage (up to ``HOLD_WAIT`` seconds).

        Raises:
            DaemonError: The exchange failed or timed out (the connection is dropped).
        """
        message = {
            "op": "hold",
            **self._hold_fields,
            "pieces": pieces_value(() if piece is None else (piece,)),
            "reader": True,
        }
        if self._conn is None:
            self._conn = connect(self.socket)
        conn = self._conn
        conn.settimeout(HOLD_WAIT)
        try:
            reply, fd = exchange(conn, message, self.socket)
        except DaemonError as e:
            conn.close()
            self._conn = None
            raise DaemonError(f"{self.path}: holding a block for a reader: {e}") from None
        conn.settimeout(10.0)
        if fd is not None:
            os.close(fd)
        return reply

    def _wait_for_remote(self, key: str, piece: Piece) -> _core.Store:
        """The piece of a shard in object storage, once the daemon serves it.

        Raises:
            DaemonError: No daemon answers (only the daemon fetches from object storage), the
                piece's shard failed (why, from the daemon), or it is not served within
                ``REMOTE_WAIT`` seconds.
        """
        path = piece_path(self.shards[piece.shard][0], piece.first, piece.end)

        def ask() -> _core.Store | None:
            if self._conn is None:
                raise self._needs_daemon(piece)
            store, reason = self._attach_or_why(key, piece)
            if reason:
                raise DaemonError(f"{path}: the smstore daemon will not serve it: {reason}")
            return store

        what = f"{path}: a block of a shard in object storage is read once a sampler (BlockWindowSampler) holds it"
        return wait_until_served(ask, what)

    def _drop_stale(self) -> None:
        """Unmap the pieces this reader maps that no rank holds any more."""
        if self._pieces:
            reply, _fd = self._send({"op": "stale_blocks", "checksums": ",".join(self._pieces)}, reply=True)
            for old in reply.get("stale", []):
                self._detach(old)

    def _detach(self, key: str) -> None:
        entry = self._pieces.pop(key, None)
        if entry is not None and entry[1] is not None:
            entry[1].close()
            self._send({"op": "detach", "checksum": key, "noreply": True}, reply=False)

    def _attach_or_why(self, key: str, piece: Piece) -> tuple[_core.Store | None, str | None]:
        """The piece's segment if the daemon serves it; else None and why it never will (if it said)."""
        path = piece_path(self.shards[piece.shard][0], piece.first, piece.end)
        reply, fd = self._send({"op": "attach", "checksum": key, "path": path}, reply=True)
        if fd is None:
            if reply.get("error", reply.get("code")) not in (None, NOT_SERVED):
                if not self.remote[piece.shard]:  # busy, or not ours to use: the file is read instead
                    if self._conn is not None:
                        self._conn.close()
                        self._conn = None
                    return None, None
                raise DaemonError(f"{path}: the smstore daemon refused: {reply.get('message', reply)}")
            reason = reply.get("reason")
            return None, reason if isinstance(reason, str) else None
        try:
            store = _core.Store._from_fd(fd, path, False)
        finally:
            os.close(fd)
        if len(store) != piece.stop - piece.first:
            store.close()
            msg = f"{path}: the daemon's segment holds {len(store)} records, not {piece.stop - piece.first}"
            raise StoreChangedError(msg)
        return store, None

    def _send(self, message: dict[str, Any], *, reply: bool) -> tuple[dict[str, Any], int | None]:
        if self._conn is None:
            try:
                self._conn = connect(self.socket)
            except DaemonError:
                return {"ok": False, "code": NOT_SERVED}, None
        if not reply:
            try:
                self._conn.sendall(encode(message))
            except OSError:  # the daemon is gone: so are its holds of what we unmapped
                self._conn.close()
                self._conn = None
            return {}, None
        try:
            return exchange(self._conn, message, self.socket)
        except DaemonError:
            self._conn.close()
            self._conn = None
            return {"ok": False, "code": NOT_SERVED}, None

    def _file(self, k: int) -> _core.Store:
        store = self._files.get(k)
        if store is None:
            path, checksum = self.shards[k]
            store = _core.Store(path)
            if store.checksum != checksum:
                found = store.checksum
                store.close()
                msg = (
                    f"{path}: holds checksum {found}, but {self.path} records {checksum}: the shard "
                    "was re-packed or overwritten since its manifest was written; pack the dataset again"
                )
                raise StoreChangedError(msg)
            self._files[k] = store
        return store

    def close(self) -> None:
        """Unmap every piece and file, and close the connection (the daemon forgets this reader)."""
        for _p, store in self._pieces.values():
            if store is not None:
                store.close()
        for store in self._files.values():
            store.close()
        self._pieces.clear()
        self._files.clear()
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_conn=None, _pieces=OrderedDict(), _files={}, _pid=-1)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pid = os.getpid()


class BlockResidency:
    """Which pieces of a sharded dataset this rank needs now, told to the daemon (``hold``).

    Without a daemon (``mode="auto"``) nothing is held: readers read the shard files (a warning
    once per process says so); ``mode="daemon"`` requires one.

    Args:
        path: The manifest, or a directory holding ``manifest.json``.
        mode: ``"auto"``, ``"daemon"`` or ``"mmap"`` (never a daemon), as for every reader.
        socket: The daemon's socket (default: ``$SMSTORE_SOCKET``, else the per-user default).
        manifest: The manifest at `path`, parsed already (a dataset URL's is not fetched again).
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
        self.path = absolute(manifest.path)
        # A dataset in object storage: its holds name the dataset, and without a daemon there is
        # no file to read instead.
        self._hold_fields = hold_fields(manifest)
        self.socket = socket_path(socket)
        self.kind: str | None = None
        self.held: tuple[Piece, ...] = ()
        self._conn: socket_module.socket | None = None
        self._pid = os.getpid()

    def hold(self, pieces: Sequence[Piece], *, wait: bool = False) -> None:
        """Need `pieces` (in the order to load them) and no others from now on.

        Args:
            pieces: The pieces, the window's first.
            wait: Wait for the daemon's answer (the first hold of a pass: a refusal is raised
                before any batch). Otherwise the hold is sent without a reply, inside the training
                loop's ``next()``: a refusal of it is read and raised by the next hold.

        Raises:
            DaemonError: The daemon refused (a piece larger than its ``--shm-limit``, a shard
                changed since its manifest was written), or none answers with ``mode="daemon"``.
        """
        wanted = tuple(pieces)
        remote = "dataset" in self._hold_fields
        if self.mode == "mmap":
            if remote:
                msg = (
                    f'{self.path}: a dataset in object storage is held only by the daemon; mode="mmap" cannot'
                )
                raise DaemonError(msg)
            self.kind, self.held = "file", wanted
            return
        if self._pid != os.getpid():
            self._conn, self._pid = None, os.getpid()
        message = {
            "op": "hold",
            **self._hold_fields,
            "pieces": pieces_value(wanted),
        }
        if not wait and self.kind == "daemon" and self._conn is not None and self._send_noreply(message):
            self.held = wanted
            return
        try:
            if self._conn is None:
                self._conn = connect(self.socket)
            reply, fd = exchange(self._conn, message, self.socket)
        except DaemonError as e:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            # A dataset in object storage has no file to read instead: no daemon is an error.
            fall_back("daemon" if remote else self.mode, self.path, str(e), self.socket, "file")
            self.kind, self.held = "file", wanted
            return
        if fd is not None:
            os.close(fd)
        if not reply.get("ok"):
            # The connection may hold this hold's own refusal behind an earlier one's: start afresh.
            self.close()
            msg = f"{self.path}: the smstore daemon on {self.socket} refused: {reply.get('message', reply)}"
            raise DaemonError(msg)
        self.kind, self.held = "daemon", wanted

    def _send_noreply(self, message: dict[str, Any]) -> bool:
        """Send a hold without waiting for a reply; False if the connection has something to say first.

        A refusal of an earlier hold (or the daemon's end) is waiting on the connection: the
        caller then sends this one with a reply, which raises the refusal if it still holds.
        """
        assert self._conn is not None
        timeout = self._conn.gettimeout()
        try:
            self._conn.setblocking(False)
            try:
                pending: bytes | None = self._conn.recv(65536)
            except BlockingIOError:
                pending = None
            except OSError:
                pending = b""
            if pending is None:
                self._conn.settimeout(timeout)
                self._conn.sendall(encode({**message, "noreply": True}))
                return True
        except OSError:
            pass
        self._conn.close()
        self._conn = None
        return False

    def close(self) -> None:
        """Give up every hold (the daemon drops the pieces no other rank holds)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __getstate__(self) -> dict[str, Any]:
        msg = "a BlockResidency belongs to the process that made it; it does not pickle"
        raise TypeError(msg)
