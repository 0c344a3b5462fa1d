"""Collating variable-length token records into one padded or packed tensor batch with a single gather."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from smstore import _core
from smstore.format.decode import partial_items_error, torch_dtype
from smstore.read.modes import check_mode
from smstore.read.store import ShardedStore, Store
from smstore.wire.client import Mode, StoreHandle
from smstore.write.pack import numpy_dtype

__all__ = ["TokenCollator", "batch_tensors", "pinned_memory_available"]

Layout = Literal["pad", "pack"]
Side = Literal["left", "right"]


def pinned_memory_available() -> bool:
    """Whether torch can allocate page-locked memory here (it needs CUDA or another accelerator)."""
    import torch

    if torch.cuda.is_available():
        return True
    accelerator = getattr(torch, "accelerator", None)
    return bool(accelerator is not None and accelerator.is_available())


class TokenCollator:
    """A ``collate_fn`` that turns a batch of token records into one tensor batch.

    Given record *indices* (the fast path) it fetches the whole batch with one ``Store.gather``:
    one C++ call that copies every record with the GIL released, so a DataLoader worker spends
    its time in memcpy, not in Python. Given records (memoryviews, arrays or tensors, e.g. what a
    ``SharedStoreDataset`` returns) it concatenates them instead.

    Use it with a dataset of indices so that each worker receives the indices of a whole batch::

        collate = TokenCollator("tokens.smst", layout="pad", max_length=512, dtype=torch.long)
        sampler = GlobalShuffleSampler(len(collate), seed=0)
        loader = DataLoader(range(len(collate)), batch_size=256, sampler=sampler,
                            num_workers=4, collate_fn=collate, pin_memory=True)

    ``range(n)`` maps each index to itself, so the worker hands the list of indices to the
    collator, which gathers. Given a path, the collator pickles as its path and options and
    attaches in each worker on first use through the same :class:`smstore.wire.client.StoreHandle` as
    ``SharedStoreDataset`` (same ``mode`` and ``socket``, and the same ``StoreChangedError`` if
    the file was re-packed since the collator was created); given a ``SharedStoreDataset``, it
    goes through whatever that dataset attaches to.

    Output (a dict of tensors, which ``DataLoader(pin_memory=True)`` pins as a whole):

    * ``layout="pad"``: ``tokens`` ``[B, L]`` padded with ``pad_value``, ``lengths`` ``[B]`` (int64,
      after truncation). ``L`` is the longest record, capped at ``max_length``, rounded up to
      ``pad_to_multiple_of``; ``fixed_length=True`` makes it ``max_length`` always. The mask of
      real tokens is ``arange(L) < lengths[:, None]`` (right padding).
    * ``layout="pack"``: ``tokens`` ``[T]``, all records concatenated, and ``cu_seqlens`` ``[B + 1]``
      (int32, the FlashAttention varlen convention; int64 past 2**31 tokens): record ``i`` is
      ``tokens[cu_seqlens[i]:cu_seqlens[i + 1]]``.
    * ``indices`` ``[B]`` (int64) when the batch was given as indices and ``return_indices``:
      which records these are (for logging, exact-resume checks, per-sample weights).

    Args:
        source: The ``.smst`` path, a ``SharedStoreDataset`` (anything with a ``.store``), or an
            open ``Store`` (not picklable: main-process use only). Array records (``npy:<dtype>``
            encoding; see ``smstore.pack_arrays``) are tokens of their dtype; any other record
            (text lines, bytes) is a sequence of byte tokens (``uint8``, a vocabulary of 256), which
            is what a byte-level language model reads.
        layout: ``"pad"`` or ``"pack"``.
        mode: With a path: ``"auto"`` (the daemon's shared-memory copy when it serves this
            file, else a mapping of the file), ``"daemon"`` or ``"mmap"``, as in
            ``SharedStoreDataset``.
        socket: With a path: the daemon's socket (default: ``$SMSTORE_SOCKET``, else the
            per-user default). Every process the collator is pickled to uses the same one.
        pad_value: The padding token.
        max_length: Truncate records longer than this (in both layouts).
        truncation: Keep the first (``"right"``: cut the end) or last (``"left"``) tokens.
        padding_side: Where ``layout="pad"`` puts the padding.
        pad_to_multiple_of: Round the padded length up to a multiple of this.
        fixed_length: Always pad to ``max_length``.
        dtype: The output tensor dtype (a torch dtype); by default the records' own. Embedding
            layers want ``torch.long`` (or ``torch.int32``); ``torch.uint16`` tensors support few
            operations. Converting costs nothing extra in ``pad`` mode (one copy either way).
        pin_memory: Allocate the output in page-locked memory, for fast asynchronous copies to a
            GPU. Only meaningful in the process that feeds the GPU: with DataLoader workers pass
            ``pin_memory=True`` to the DataLoader instead (pinned pages cannot travel between
            processes). Where torch has no accelerator (CPU-only builds) pinning is impossible and
            this option is ignored: the batch comes in ordinary memory (``pinned_memory_available()``
            tells which).
        return_indices: Add the ``indices`` tensor to batches given as indices. Each tensor a
            worker returns costs one shared-memory hand-over, so turn it off when unused.
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | Any,
        *,
        layout: Layout = "pad",
        pad_value: int = 0,
        max_length: int | None = None,
        truncation: Side = "right",
        padding_side: Side = "right",
        pad_to_multiple_of: int | None = None,
        fixed_length: bool = False,
        dtype: Any = None,
        pin_memory: bool = False,
        return_indices: bool = True,
        mode: Mode = "auto",
        socket: str | os.PathLike[str] | None = None,
    ) -> None:
        if layout not in ("pad", "pack"):
            msg = f"layout must be 'pad' or 'pack', not {layout!r}"
            raise ValueError(msg)
        if truncation not in ("left", "right") or padding_side not in ("left", "right"):
            msg = (
                f"truncation and padding_side must be 'left' or 'right', not {truncation!r}, {padding_side!r}"
            )
            raise ValueError(msg)
        if max_length is not None and max_length < 0:
            msg = f"max_length must be >= 0, not {max_length}"
            raise ValueError(msg)
        if fixed_length and max_length is None:
            msg = "fixed_length=True needs max_length"
            raise ValueError(msg)
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            msg = f"pad_to_multiple_of must be >= 1, not {pad_to_multiple_of}"
            raise ValueError(msg)
        check_mode(mode)  # also when the source is a dataset, which ignores it: a typo is an error
        # A path is opened through a handle (what pickles: path, options, checksum); any other
        # source is read through as given.
        self._handle = StoreHandle(source, mode, socket) if isinstance(source, (str, os.PathLike)) else None
        self._source: Any = None if self._handle is not None else source
        self.layout: Layout = layout
        self.pad_value = int(pad_value)
        self.max_length = max_length
        self.truncation = truncation
        self.padding_side = padding_side
        self.pad_to_multiple_of = pad_to_multiple_of
        self.fixed_length = fixed_length
        self.dtype = dtype
        self.pin_memory = pin_memory
        self.return_indices = return_indices
        self._spec: _core.BatchSpec | Literal[False] | None = None  # made on first use, per process
        store = self.store
        # Array records carry their dtype; any other record is a byte string: uint8 tokens.
        enc = store.encoding
        self.record_dtype = numpy_dtype(enc, store.path) if enc.startswith("npy:") else np.dtype(np.uint8)
        self._len = len(store)
        if self.dtype is not None:
            self._check_pad_value()

    # -- the store, attached lazily in each process -----------------------------------------

    @property
    def store(self) -> Store | ShardedStore:
        """The Store records come from (with a path: opened in this process on first use).

        Raises:
            StoreChangedError: The file was re-packed since the collator was created (the
                same error as ``SharedStoreDataset``'s).
        """
        if self._handle is not None:
            return self._handle.store
        return self._source.store if hasattr(self._source, "store") else self._source  # type: ignore[no-any-return]

    @property
    def mode(self) -> Mode | None:
        """With a path: ``"auto"``, ``"daemon"`` or ``"mmap"`` (see ``SharedStoreDataset``); else None."""
        return self._handle.mode if self._handle is not None else None

    @property
    def socket(self) -> str | None:
        """With a path: the daemon's socket, if one was named."""
        return self._handle.socket if self._handle is not None else None

    @property
    def checksum(self) -> str | None:
        """With a path: the contents every process reads (pinned when the collator was created)."""
        return self._handle.checksum if self._handle is not None else None

    def __len__(self) -> int:
        """The number of records in the store."""
        return self._len

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_spec"] = None  # made again in each process (the handle pickles as path and options)
        return state

    def _check_pad_value(self) -> None:
        import torch

        dtype = self._torch_dtype()
        info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
        if not info.min <= self.pad_value <= info.max:
            msg = f"pad_value={self.pad_value} does not fit in {dtype}"
            raise ValueError(msg)

    def _torch_dtype(self) -> Any:
        if self.dtype is not None:
            return self.dtype
        return torch_dtype(self.record_dtype, self.store.path)

    # -- collation --------------------------------------------------------------------------

    def __call__(self, batch: Any) -> dict[str, Any]:
        """Collate a batch: record indices (one gather) or records (concatenated)."""
        import torch

        indices = _as_indices(batch, torch)
        if indices is not None:
            spec, store = self.batch_spec(), self.store
            if spec is not None:
                pinned = self._pin()
                if not pinned or _core.pinned_blocks_available():
                    arrays = _core.collate_batch(spec, store, indices, pinned)
                    return batch_tensors(arrays, self.layout, torch)
        return self._collate_numpy(batch, indices, torch)

    def batch_spec(self) -> _core.BatchSpec | None:
        """These options for the C++ batcher, or None where it cannot produce the batch (float
        records to integer tokens, a dtype it does not write: then numpy does)."""
        if self._spec is None:
            self._spec = self._make_spec()
        return self._spec or None

    def _make_spec(self) -> _core.BatchSpec | Literal[False]:
        if not isinstance(self.store, (_core.Store, _core.ShardedStore)):
            return False
        out = np.dtype(self.record_dtype) if self.dtype is None else _numpy_of(self.dtype)
        codes = [_batch_code(d) for d in (self.record_dtype, out)]
        if codes[0] is None or codes[1] is None or (codes[0][0] == "f" and codes[1][0] != "f"):
            return False
        if out is not None and out.kind in "iu":
            info = np.iinfo(out)
            if not info.min <= self.pad_value <= info.max:
                return False  # torch.full refuses it: the numpy path raises its error
        return _core.BatchSpec(
            pack=self.layout == "pack",
            in_dtype=codes[0],
            out_dtype=codes[1],
            pad_value=self.pad_value,
            max_length=self.max_length,
            truncate_left=self.truncation == "left",
            pad_left=self.padding_side == "left",
            fixed_length=self.fixed_length,
            multiple=self.pad_to_multiple_of or 1,
            with_indices=self.return_indices,
        )

    def _collate_numpy(self, batch: Any, indices: Any, torch: Any) -> dict[str, Any]:
        """The path of numpy operations: records given as such, and what the batcher cannot do."""
        if indices is not None:
            data, offsets = self.store.gather(indices)
            lengths, partial = np.divmod(np.diff(offsets), self.record_dtype.itemsize)
            if partial.any():
                k = int(np.flatnonzero(partial)[0])
                raise partial_items_error(
                    self.store.path, self.record_dtype, int(offsets[k + 1] - offsets[k]), int(indices[k])
                )
            flat = data.view(self.record_dtype)
        else:
            arrays = [_as_array(r, self.record_dtype, torch, self.store.path) for r in batch]
            lengths = np.array([a.size for a in arrays], dtype=np.int64)
            flat = np.concatenate(arrays) if arrays else np.empty(0, dtype=self.record_dtype)
        out = self._pad(flat, lengths, torch) if self.layout == "pad" else self._pack(flat, lengths, torch)
        if indices is not None and self.return_indices:
            out["indices"] = torch.from_numpy(np.asarray(indices, dtype=np.int64).copy())
        return out

    def _pin(self) -> bool:
        return self.pin_memory and pinned_memory_available()

    def _pad(self, flat: np.ndarray[Any, Any], lengths: np.ndarray[Any, Any], torch: Any) -> dict[str, Any]:
        b = len(lengths)
        kept = lengths if self.max_length is None else np.minimum(lengths, self.max_length)
        width = (
            int(self.max_length)
            if self.fixed_length and self.max_length is not None
            else int(kept.max(initial=0))
        )
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        tokens = torch.full((b, width), self.pad_value, dtype=self._torch_dtype(), pin_memory=self._pin())
        grid = tokens.numpy()
        starts = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        left_cut = self.truncation == "left"
        left_pad = self.padding_side == "left"
        # One slice copy per row: for 256 rows of hundreds of tokens this beats fancy indexing.
        for i, (s, n, k) in enumerate(
            zip(starts[:-1].tolist(), lengths.tolist(), kept.tolist(), strict=True)
        ):
            src = flat[s + n - k : s + n] if left_cut else flat[s : s + k]
            if left_pad:
                grid[i, width - k :] = src
            else:
                grid[i, :k] = src
        return {"tokens": tokens, "lengths": torch.from_numpy(kept.astype(np.int64))}

    def _pack(self, flat: np.ndarray[Any, Any], lengths: np.ndarray[Any, Any], torch: Any) -> dict[str, Any]:
        if self.max_length is not None and lengths.size and int(lengths.max()) > self.max_length:
            kept = np.minimum(lengths, self.max_length)
            starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
            pos = np.arange(flat.size, dtype=np.int64) - starts  # each token's position in its record
            if self.truncation == "left":
                pos -= np.repeat(lengths - kept, lengths)
                keep = pos >= 0
            else:
                keep = pos < np.repeat(kept, lengths)
            flat, lengths = flat[keep], kept
        cu = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=cu[1:])
        if cu[-1] < 2**31:
            cu = cu.astype(np.int32)
        dtype = self._torch_dtype()
        if self._pin():
            tokens = torch.empty(flat.size, dtype=dtype, pin_memory=True)
            tokens.numpy()[:] = flat
        else:
            tokens = torch.from_numpy(flat)  # the gathered buffer itself: no second copy
            if tokens.dtype != dtype:
                tokens = tokens.to(dtype)
        return {
            "tokens": tokens,
            "cu_seqlens": torch.from_numpy(cu),
            "lengths": torch.from_numpy(lengths.astype(np.int64)),
        }

    def __repr__(self) -> str:
        where = self._handle.path if self._handle is not None else repr(self._source)
        return f"TokenCollator({where!r}, layout={self.layout!r}, max_length={self.max_length})"


def _as_indices(batch: Any, torch: Any) -> np.ndarray[Any, Any] | Sequence[int] | None:
    """The batch as record indices, or None when it holds records."""
    if isinstance(batch, torch.Tensor):
        if batch.dtype.is_floating_point or batch.dim() != 1:
            msg = "a tensor batch must be a 1-D tensor of record indices"
            raise TypeError(msg)
        indices: np.ndarray[Any, Any] = batch.numpy()
        return indices
    if isinstance(batch, np.ndarray) and batch.dtype.kind in "iu":
        return batch
    if isinstance(batch, (list, tuple)) and (not batch or isinstance(batch[0], (int, np.integer))):
        return batch
    return None


def _as_array(record: Any, dtype: np.dtype[Any], torch: Any, path: str) -> np.ndarray[Any, Any]:
    if isinstance(record, torch.Tensor):
        record = record.numpy()
    if isinstance(record, np.ndarray):
        if record.dtype != dtype:
            msg = f"record of dtype {record.dtype}, expected {dtype}"
            raise TypeError(msg)
        return record.reshape(-1)
    nbytes = memoryview(record).nbytes
    if nbytes % dtype.itemsize:
        raise partial_items_error(path, dtype, nbytes)
    return np.frombuffer(record, dtype=dtype)


def batch_tensors(arrays: tuple[Any, ...], layout: Layout, torch: Any) -> dict[str, Any]:
    """The dict of tensors a TokenCollator returns, over the arrays of ``_core.collate_batch``."""
    tokens, lengths, cu_seqlens, indices = arrays
    out = {"tokens": torch.from_numpy(tokens)}
    if layout == "pack":
        out["cu_seqlens"] = torch.from_numpy(cu_seqlens)
    out["lengths"] = torch.from_numpy(lengths)
    if indices is not None:
        out["indices"] = torch.from_numpy(indices)
    return out


def _numpy_of(dtype: Any) -> np.dtype[Any] | None:
    """The numpy dtype of a torch dtype (None when numpy has none, e.g. bfloat16)."""
    import torch

    try:
        dtype_: np.dtype[Any] = torch.empty(0, dtype=dtype).numpy().dtype
        return dtype_
    except (TypeError, RuntimeError):
        return None


def _batch_code(dtype: np.dtype[Any] | None) -> str | None:
    """The C++ batcher's code for a dtype (``"u2"``, ``"i8"``, ...), or None if it does not handle it."""
    if dtype is None or not dtype.isnative or dtype.kind not in "iuf":
        return None
    code = f"{dtype.kind}{dtype.itemsize}"
    return code if code in _BATCH_CODES else None


_BATCH_CODES = {"u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8", "f4", "f8"}
