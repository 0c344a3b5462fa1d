"""SharedStoreDataset: a torch Dataset over a blob that pickles as its path and attaches in each process."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import Dataset
from torch.utils.data._utils import collate as torch_collate

from smstore._core import RecordReader, _DataExport
from smstore.errors import CollateError
from smstore.format.decode import Decoder, make_decoder
from smstore.format.manifest import Manifest
from smstore.read.store import ShardedStore, Store
from smstore.wire.client import Mode, StoreHandle

__all__ = ["SharedStoreDataset"]

_CHOOSE = (
    "pass decode= ('utf8', 'bytes' or 'json' give lists of those; 'numpy' or 'torch' give arrays, "
    "which the default collate_fn stacks when every record has the same length), or "
    "collate_fn=smstore.TokenCollator(dataset) to pad or pack token records into one tensor, or a "
    "collate_fn of your own"
)


class _Batch(list[Any]):
    """The records of one ``__getitems__`` call (what a DataLoader collates): tells ours from anyone's."""

    __slots__ = ("indices", "path")
    path: str
    indices: Sequence[int]


def _refuse_views(batch: Sequence[Any], *, collate_fn_map: dict[Any, Any] | None = None) -> Any:
    """torch's default collate_fn on memoryviews: ours raise; anyone else's are sequences, as before."""
    if isinstance(batch[0].obj, _DataExport):
        where = f"{batch.path}: " if isinstance(batch, _Batch) else ""
        msg = (
            f"{where}the records are read-only memoryviews (decode=None, or 'auto' on a blob of bytes), "
            "and torch's default collate_fn would turn a batch of them into one tensor per byte "
            f"position, not one per record: {_CHOOSE}"
        )
        raise CollateError(msg)
    others = {k: v for k, v in (collate_fn_map or {}).items() if k is not memoryview}
    return torch_collate.collate(batch, collate_fn_map=others)


def _explain_ragged(collate_fn: Any) -> Any:
    """Wrap torch's collate_fn of arrays so that our records of different shapes name the way out."""

    def collate_records(batch: Sequence[Any], *, collate_fn_map: dict[Any, Any] | None = None) -> Any:
        try:
            return collate_fn(batch, collate_fn_map=collate_fn_map)
        except RuntimeError:  # "stack expects each tensor to be equal size", "...storage not resizable"
            if not isinstance(batch, _Batch):
                raise
            first = tuple(batch[0].shape)
            for k, record in enumerate(batch):
                if tuple(record.shape) != first:
                    msg = (
                        f"{batch.path}: records {batch.indices[0]} and {batch.indices[k]} have shapes "
                        f"{first} and {tuple(record.shape)}, and torch's default collate_fn stacks only "
                        f"records of one shape: {_CHOOSE}"
                    )
                    raise CollateError(msg) from None
            raise

    collate_records.smstore_guard = True  # type: ignore[attr-defined]
    return collate_records


def _guard_default_collate() -> None:
    """Make torch's default collate_fn refuse the batches it would get wrong, with what to do instead.

    A memoryview is a ``Sequence`` to torch: records "A0".."A3" became ``[tensor([65, 65, 65, 65]),
    tensor([48, 49, 50, 51])]`` without a word. Arrays of different lengths failed with torch's
    "stack expects each tensor to be equal size" (in a worker: "Trying to resize storage that is
    not resizable"), with no word of a collate_fn. This registers handlers in the map that
    ``default_collate`` dispatches on (in each process that imports this module: every DataLoader
    worker does, to unpickle the dataset): memoryviews over smstore's mappings raise, and arrays
    keep torch's own collate_fn, whose failure on one of our batches is explained.
    """
    table: dict[Any, Any] = torch_collate.default_collate_fn_map
    table[memoryview] = _refuse_views
    for kind in (torch.Tensor, np.ndarray):
        handler = table.get(kind)
        if handler is not None and not getattr(handler, "smstore_guard", False):
            table[kind] = _explain_ragged(handler)


_guard_default_collate()


class SharedStoreDataset(RecordReader, Dataset[Any]):
    """A map-style Dataset of the records of an smstore blob.

    The blob is mapped read-only; every process that reads it (DataLoader workers, local ranks)
    shares the same physical pages, so memory does not grow with the number of processes. The
    dataset pickles as its path and options only and attaches lazily in each process (through a
    :class:`smstore.wire.client.StoreHandle`, as ``TokenCollator`` does), so it works with the
    ``fork``, ``spawn`` and ``forkserver`` start methods. ``ds[i]`` runs in C (see
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
            file, else a mapping of the file (saying so as every reader does: docs/daemon.md,
            "Modes"); ``"daemon"``: require the daemon; ``"mmap"``: never use it. See
            :func:`smstore.wire.client.open_store`.
        socket: The daemon's socket (default: ``$SMSTORE_SOCKET``, else the per-user default).
            Every process the dataset is pickled to uses the same one.

    Raises:
        ValueError: ``mode`` is none of those.
        DaemonError: ``mode="daemon"`` and no daemon serves the file.
        StoreError: The file is missing or not a valid blob. In a process the dataset was
            pickled to, :class:`smstore.StoreChangedError` on first access if the file was
            re-packed since (see :class:`smstore.wire.client.StoreHandle`).

    Note:
        memoryviews cannot be pickled, so with ``num_workers > 0`` decode them (or collate them
        into tensors) inside the worker: pass ``decode=`` or a ``collate_fn``. torch's default
        ``collate_fn`` raises :class:`smstore.CollateError` on a batch of these memoryviews (it
        would make one tensor per byte position) and on arrays of different lengths (pass
        ``collate_fn=smstore.TokenCollator(dataset)`` to pad or pack them).
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
        self._handle = StoreHandle(path, mode, socket)  # what pickles: path, options, checksum
        self.decode = decode
        self.transform = transform
        store = self._handle.store
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
        self._bind(self._handle.store, self._decoder, self.transform)

    @property
    def path(self) -> str:
        """The blob or sharded dataset, as given."""
        return self._handle.path

    @property
    def manifest(self) -> Manifest | None:
        """The parsed manifest of a dataset given as a URL (pickled with it: no process fetches it
        again), else None."""
        return self._handle.manifest

    @property
    def mode(self) -> Mode:
        """``"auto"``, ``"daemon"`` or ``"mmap"`` (see :func:`smstore.wire.client.open_store`)."""
        return self._handle.mode

    @property
    def socket(self) -> str | None:
        """The daemon's socket, if one was named."""
        return self._handle.socket

    @property
    def checksum(self) -> str:
        """The contents every process reads (pinned when the dataset was created)."""
        return self._handle.checksum

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
        records: Iterable[Any] = self.store.get_batch(indices)
        if self._decoder is not None:
            records = map(self._decoder, records)
        if self.transform is not None:
            records = map(self.transform, records)
        batch = _Batch(records)  # one list, which torch's default collate_fn can tell (see above)
        batch.path = self.path
        batch.indices = indices
        return batch

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
