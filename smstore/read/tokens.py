"""Token windows: fixed-length samples over documents of tokens concatenated, located with no index.

Pretraining reads documents of tokens (records of an ``npy:<dtype>`` blob or sharded dataset, as
``smstore.pack_arrays`` and the Megatron converter write them) as one stream cut into samples of
``length + 1`` tokens (inputs and next-token targets) that cross document boundaries: the samples
of Megatron-LM's ``GPTDataset``. Megatron builds (and caches) index arrays of every document and
sample before the first step; here sample ``k`` is found from the blobs' own offsets indexes by a
binary search, O(log n) reads of them, with nothing built or stored, so a dataset of 10^12 tokens
is ready at once. Shuffle samples with any sampler over ``len(windows)``: the exact global shuffle
of :class:`smstore.GlobalShuffleSampler` is resumable at any world size.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from smstore import _core
from smstore.errors import StoreFormatError
from smstore.read.views import portable_source, restored_source
from smstore.write.pack import numpy_dtype

__all__ = ["TokenWindows"]


class TokenWindows:
    """Samples of ``length + 1`` tokens over the documents of a dataset concatenated in stored order.

    Sample ``k`` is tokens ``[k * length, (k + 1) * length + 1)`` of the stream of every document
    (record) in order, each followed by the token ``eod`` when one is given (documents that already
    end in one need none): consecutive samples share a token, as Megatron's ``GPTDataset``
    samples do, and there are ``(tokens - 1) // length`` of them (a tail too short for a whole
    sample is left out). A sample is a new array (``dtype``) that a collate stacks as it is.

    Args:
        source: A blob or sharded dataset of token documents (``npy:<dtype>`` records of
            integers): its path, a :class:`~smstore.SharedStoreDataset` (read through its store:
            the daemon's copy, or the files), or an open ``Store`` / ``ShardedStore``.
        length: Tokens a sample predicts (the sequence length); a sample holds ``length + 1``.
        eod: The end-of-document token after every document, or None (the default): none.
        dtype: The samples' dtype (default int64, as Megatron's).

    Raises:
        StoreFormatError: The records are not ``npy:`` arrays of integers.
        ValueError: ``length`` below 1, or an ``eod`` that ``dtype`` cannot hold.
    """

    def __init__(self, source: Any, length: int, *, eod: int | None = None, dtype: Any = np.int64) -> None:
        if isinstance(source, str) or hasattr(source, "__fspath__"):
            from smstore.read.store import open as open_path

            source = open_path(source, raw=True)
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            msg = f"length must be a positive number of tokens, not {length!r}"
            raise ValueError(msg)
        self.source = source
        self.length = length
        self.eod = None if eod is None else int(eod)
        self.dtype = np.dtype(dtype)
        store = self._store()
        self.path = str(store.path)
        self.token_dtype = numpy_dtype(str(store.encoding), self.path)
        if self.token_dtype.kind not in "iu" or self.dtype.kind not in "iu":
            msg = f"{self.path}: token windows read integer tokens ({self.token_dtype} records, {self.dtype} samples)"
            raise StoreFormatError(msg)
        if self.eod is not None and not np.can_cast(np.min_scalar_type(self.eod), self.dtype):
            msg = f"eod={self.eod} does not fit the samples' dtype {self.dtype}"
            raise ValueError(msg)
        item = self.token_dtype.itemsize
        per_doc = 0 if self.eod is None else 1
        # Tokens before each shard, from the manifest's sizes (a blob is one shard): no shard opened.
        manifest = getattr(store, "manifest", None)
        if isinstance(store, _core.ShardedStore) and manifest is not None:
            counts = [(s.data_bytes // item, s.records) for s in manifest.shards]
            self._record_starts = [int(x) for x in store.starts]
        else:
            counts = [(int(store.offsets[-1]) // item, len(store))]
            self._record_starts = [0, len(store)]
        self._token_starts = [0]
        for tokens, records in counts:
            self._token_starts.append(self._token_starts[-1] + tokens + per_doc * records)
        self.tokens = self._token_starts[-1]
        self._len = max(0, (self.tokens - 1) // length)

    def _store(self) -> Any:
        return getattr(self.source, "store", self.source)

    @property
    def store(self) -> Any:
        """The ``Store`` or ``ShardedStore`` the windows read (a dataset source's, attached in this process)."""
        return self._store()

    def __len__(self) -> int:
        return self._len

    def locate(self, token: int) -> tuple[int, int]:
        """``(document, offset)``: the document holding ``token`` of the stream and the token's
        place in it (its ``eod`` is at the document's length), by binary searches: of the shards'
        token counts, then of the shard's offsets index (O(log n) reads, nothing built)."""
        if not 0 <= token < self.tokens:
            msg = f"token {token} is outside a stream of {self.tokens}"
            raise IndexError(msg)
        k = bisect.bisect_right(self._token_starts, token) - 1
        store = self._store()
        offsets = (store.shard(k) if isinstance(store, _core.ShardedStore) else store).offsets
        item, per_doc = self.token_dtype.itemsize, 0 if self.eod is None else 1
        # The last record j whose first token is at or before t: the core's one rule, which
        # smstore.Loader's threads apply too.
        j, at = _core.locate_in_shard(offsets, item, per_doc, token - self._token_starts[k])
        return self._record_starts[k] + j, at

    def batch_spec(self) -> _core.BatchSpec | None:
        """These windows for the C++ batcher (smstore.Loader): the stream's shards and its options;
        None for tokens or samples in a byte order not this machine's."""
        if not (self.token_dtype.isnative and self.dtype.isnative):
            return None
        return _core.BatchSpec.windows(
            in_dtype=f"{self.token_dtype.kind}{self.token_dtype.itemsize}",
            out_dtype=f"{self.dtype.kind}{self.dtype.itemsize}",
            length=self.length,
            eod=self.eod,
            token_starts=self._token_starts,
            record_starts=self._record_starts,
        )

    def __getitem__(self, index: int) -> np.ndarray[Any, Any]:
        """Sample ``index``: ``length + 1`` tokens, a new array."""
        k = int(index)
        if k < 0:
            k += self._len
        if not 0 <= k < self._len:
            msg = f"sample {index} out of range for {self._len} token windows of {self.path}"
            raise IndexError(msg)
        out = np.empty(self.length + 1, dtype=self.dtype)
        doc, at = self.locate(k * self.length)
        store, filled = self._store(), 0
        while filled < out.size:
            tokens = np.frombuffer(store[doc], dtype=self.token_dtype)
            take = tokens[at : at + out.size - filled]
            out[filled : filled + take.size] = take
            filled += take.size
            if filled < out.size and self.eod is not None:
                out[filled] = self.eod
                filled += 1
            doc, at = doc + 1, 0
        return out

    def __getitems__(self, indices: Sequence[int]) -> list[np.ndarray[Any, Any]]:
        return [self[i] for i in indices]

    def __iter__(self) -> Iterator[np.ndarray[Any, Any]]:
        for k in range(self._len):
            yield self[k]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "source": portable_source(self.source)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, source=restored_source(state["source"]))

    def __repr__(self) -> str:
        eod = "" if self.eod is None else f", eod={self.eod}"
        return f"TokenWindows({self.path!r}, length={self.length}{eod}, samples={self._len})"
