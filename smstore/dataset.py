"""SharedStoreDataset: a torch Dataset over a blob that pickles as its path and attaches in each process."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, cast

from torch.utils.data import Dataset

from smstore._core import RecordReader
from smstore._decode import Decoder, make_decoder
from smstore._store import ShardedStore, Store
from smstore.client import Mode, open_store

__all__ = ["SharedStoreDataset"]


class SharedStoreDataset(RecordReader, Dataset[Any]):
    """A map-style Dataset of the records of an smstore blob.

    The blob is mapped read-only; every process that reads it (DataLoader workers, local ranks)
    shares the same physical pages, so memory does not grow with the number of processes. The
    dataset pickles as its path and options only and attaches lazily in each process, so it works
    with the ``fork``, ``spawn`` and ``forkserver`` start methods. ``ds[i]`` runs in C (see
    ``smstore._core.RecordReader``).

    Args:
        path: The ``.smst`` blob, or a sharded dataset (a manifest, or a directory holding
            ``manifest.json``: see ``smstore pack --shard-size`` and ``smstore join``).
        decode: ``"auto"`` (the default): objects for blobs of objects (see
            :func:`smstore.pack_objects`), else as ``None``; ``None`` for a zero-copy read-only
            ``memoryview``; ``"bytes"``, ``"utf8"``, ``"json"``, ``"numpy"`` (dtype
            from the blob's ``npy:<dtype>`` encoding, zero-copy and read-only), or a callable
            taking the memoryview.
        transform: Called on each decoded record.
        mode: ``"auto"``: the ``smstore serve`` daemon's shared-memory copy if it serves this
            file, else a mapping of the file; ``"daemon"``: require the daemon; ``"mmap"``: never
            use it. See :func:`smstore.client.open_store`.
        socket: The daemon's socket (default: ``$SMSTORE_SOCKET``, else the per-user default).
            Every process the dataset is pickled to uses the same one.

    Note:
        memoryviews cannot be pickled, so with ``num_workers > 0`` decode them (or collate them
        into tensors) inside the worker: pass ``decode=`` or a ``collate_fn``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        decode: str | Decoder | None = "auto",
        transform: Callable[[Any], Any] | None = None,
        mode: Mode = "auto",
        socket: str | os.PathLike[str] | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.decode = decode
        self.transform = transform
        self.mode: Mode = mode
        self.socket = os.fspath(socket) if socket is not None else None
        store = open_store(self.path, mode, self.socket)
        self.checksum = store.checksum  # every process must read these very bytes
        self._len = len(store)
        self.metadata: dict[str, Any] = store.metadata
        # Record counts of the shards, in order (one for a single blob): what windowed samplers need.
        self.shard_sizes: list[int] = store.shard_sizes if isinstance(store, ShardedStore) else [len(store)]
        self._decoder = make_decoder(decode, store.encoding, self.path)
        self._bind(store, self._decoder, transform)

    def _attach(self) -> None:
        """Attach in this process (called by the C base on first access after unpickling).

        Raises:
            StoreChangedError: The file was re-packed since the dataset was created, so this
                process would read other records than the others (and than ``len`` says).
        """
        store = open_store(self.path, self.mode, self.socket, checksum=self.checksum)
        self._bind(store, self._decoder, self.transform)

    @property
    def store(self) -> Store | ShardedStore:
        """The Store this process reads from (attached on first use)."""
        store = self._bound_store
        if store is None:
            self._attach()
            store = self._bound_store
            assert store is not None  # _attach() binds one
        return cast("Store | ShardedStore", store)  # what _attach() bound: open_store()'s result

    def __len__(self) -> int:
        return self._len

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        records: list[Any] = self.store.get_batch(indices)
        if self._decoder is not None:
            decoder = self._decoder
            records = [decoder(r) for r in records]
        if self.transform is not None:
            transform = self.transform
            records = [transform(r) for r in records]
        return records

    def __getstate__(self) -> dict[str, Any]:
        # Path and options only: never the data, never a mapping or a socket.
        state = self.__dict__.copy()
        state["_decoder"] = None  # may be a closure; rebuilt from `decode` on unpickling
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._decoder = make_decoder(self.decode, self.metadata.get("encoding", "bytes"), self.path)

    def __repr__(self) -> str:
        return f"SharedStoreDataset({self.path!r}, records={self._len}, decode={self.decode!r})"
