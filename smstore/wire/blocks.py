"""Blocks of a sharded dataset: record ranges the daemon holds instead of whole shards, and the reader of them.

A **block** is a run of at least ``block`` consecutive records of one shard (a shard is cut into
as many as fit, as even as whole records allow: :func:`shard_block`), read sequentially in one
go. The daemon holds it as a **piece** (a shard and a record range) and serves it as its own segment: a blob holding exactly the piece's records, named
(in the daemon's table) by :func:`piece_id` of the shard's checksum and the range, so a reader
finds it without asking which bytes it holds. The client's side: it speaks to the daemon through
the process's one session (``smstore.wire.client.session_for``); it never imports the daemon or torch.
"""

from __future__ import annotations

import bisect
import contextlib
import os
from collections import OrderedDict
from typing import Any

from smstore import _core
from smstore.errors import DaemonError, RemoteNeedsDaemonError, StoreChangedError
from smstore.format.manifest import absolute, hold_fields, read_manifest
from smstore.read.modes import warn_once
from smstore.remote.urls import needs_daemon
from smstore.wire.client import DaemonSession, session_for
from smstore.wire.ipc import socket_path, wait_until_served
from smstore.wire.protocol import (
    NOT_SERVED,
    PERMISSION_DENIED,
    Piece,
    piece_id,
    piece_path,
    pieces_value,
)

# How long a reader's own hold may wait for its reply (the daemon fetching a dataset's manifest
# first): as long as a reader waits for a load (client.LOAD_WAIT).
HOLD_WAIT = 300.0

__all__ = ["BlockReader", "Piece", "piece_id", "piece_path", "shard_block"]


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
        self._connected = True  # False: the daemon did not answer last time (the files are read)
        self._holder = (-1, 0)  # (pid, id) of its holds for itself on its process's session
        self._pid = os.getpid()

    @property
    def _session(self) -> DaemonSession:
        return session_for(self.socket)

    def _holder_id(self) -> int:
        if self._holder[0] != os.getpid():  # a holder id is its process's own
            self._holder = (os.getpid(), DaemonSession.new_holder())
        return self._holder[1]

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, index: int) -> bytes:
        """The bytes of record ``index`` of the dataset."""
        if self._pid != os.getpid():  # a forked child: its own connection and mappings
            self._pieces, self._files, self._pid = OrderedDict(), {}, os.getpid()
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

    def block_starts(self) -> list[int]:
        """The dataset's global record at which each block begins (shard by shard, as
        :func:`shard_block` cuts each shard), then the record count: what smstore.Loader indexes by."""
        if not hasattr(self, "_blocks"):
            self._blocks: list[Piece] = []
            for k in range(len(self.starts) - 1):
                records = self.starts[k + 1] - self.starts[k]
                m = max(1, records // self.block)
                self._blocks += [Piece(k, t * records // m, (t + 1) * records // m) for t in range(m)]
        return [self.starts[p.shard] + p.first for p in self._blocks] + [self.starts[-1]]

    def block_store(self, b: int) -> tuple[_core.Store, int]:
        """Block ``b``'s records as ``(store, first)``: records ``first ..`` of the store, the daemon's
        piece (first 0) if it serves it, else the shard's file (as :meth:`__getitem__` reads them)."""
        if self._pid != os.getpid():  # a forked child: its own connection and mappings
            self._pieces, self._files, self._pid = OrderedDict(), {}, os.getpid()
        self.block_starts()
        piece = self._blocks[b]
        store = self._piece(piece)
        if store is not None:
            self.block_reads += 1
            return store, 0
        self.file_reads += 1
        return self._file(piece.shard), piece.first

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
            if not self._connected:  # no daemon answers: this piece is read from its file from now on
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
        try:
            self._session.open()
        except DaemonError:
            raise self._needs_daemon(piece) from None
        self._connected = True
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
            "holder": self._holder_id(),
        }
        try:
            reply, fd = self._session.ask(message, HOLD_WAIT)
        except DaemonError as e:
            self._connected = False
            raise DaemonError(f"{self.path}: holding a block for a reader: {e}") from None
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
            if not self._connected:
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
            reply, _fd = self._ask({"op": "stale_blocks", "checksums": ",".join(self._pieces)})
            for old in reply.get("stale", []):
                self._detach(old)

    def _detach(self, key: str) -> None:
        entry = self._pieces.pop(key, None)
        if entry is not None and entry[1] is not None:
            entry[1].close()
            self._session.detach(key)

    def _attach_or_why(self, key: str, piece: Piece) -> tuple[_core.Store | None, str | None]:
        """The piece's segment if the daemon serves it; else None and why it never will (if it said)."""
        path = piece_path(self.shards[piece.shard][0], piece.first, piece.end)
        try:
            reply, fd = self._session.attach(key, path)
            self._connected = True
        except DaemonError:
            self._connected = False
            reply, fd = {"ok": False, "code": NOT_SERVED}, None
        if fd is None:
            if reply.get("error", reply.get("code")) not in (None, NOT_SERVED):
                if not self.remote[piece.shard]:  # busy, or not ours to use: the file is read instead
                    self._connected = False
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

    def _ask(self, message: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
        try:
            answer = self._session.ask(message, 10.0)
        except DaemonError:
            self._connected = False
            return {"ok": False, "code": NOT_SERVED}, None
        self._connected = True
        return answer

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
        for key in list(self._pieces):
            self._detach(key)
        for store in self._files.values():
            store.close()
        self._pieces.clear()
        self._files.clear()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_pieces=OrderedDict(), _files={}, _pid=-1, _holder=(-1, 0), _connected=True)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pid = os.getpid()
