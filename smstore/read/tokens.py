"""Token windows: fixed-length samples over documents of tokens concatenated, located with no index.

Pretraining reads documents of tokens (records of an ``npy:<dtype>`` blob or sharded dataset, as
``smstore.pack_arrays`` and the Megatron converter write them) as one stream cut into samples of
``length + 1`` tokens (inputs and next-token targets) that cross document boundaries: the samples
of Megatron-LM's ``GPTDataset``. Megatron builds (and caches) index arrays of every document and
sample before the first step; here sample ``k`` is found from the blobs' own offsets indexes by a
binary search, O(log n) reads of them, with nothing built or stored, so a dataset of 10^12 tokens
is ready at once. Shuffle samples with any sampler over ``len(windows)``: the exact global shuffle
of :class:`smstore.GlobalShuffleSampler` is resumable at any world size. The documents themselves
may be put in a new order every epoch (``seed=``), still with no index: see :class:`TokenWindows`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from smstore import _core
from smstore.errors import StoreFormatError
from smstore.read.views import portable_source, restored_source
from smstore.write.pack import numpy_dtype

__all__ = ["TokenDocuments", "TokenWindows", "positive_length"]


def _int64(value: object, what: str, low: int) -> int:
    """``value`` as an int in ``[low, 2**63)``: what the core's shuffle keys take."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= value < 2**63:
        msg = f"{what} must be an integer in [{low}, 2**63), not {value!r}"
        raise ValueError(msg)
    return int(value)


class _Group(NamedTuple):
    """One group's parts in an epoch: their bounds (stored order), the part at each shuffled
    position, and the tokens through each shuffled position."""

    bounds: np.ndarray[Any, np.dtype[np.int64]]
    order: np.ndarray[Any, np.dtype[np.int64]]
    ends: np.ndarray[Any, np.dtype[np.int64]]

    def find(self, token: int) -> tuple[int, int]:
        """The part holding ``token`` of the group's shuffled stream, and the token's place in it."""
        j = int(np.searchsorted(self.ends, token, side="right"))
        return int(self.order[j]), token - (int(self.ends[j - 1]) if j else 0)


def positive_length(length: object, path: str) -> int:
    """``length`` checked: a positive number of tokens (a sample's, a bin's)."""
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        msg = f"{path}: length must be a positive number of tokens, not {length!r}"
        raise ValueError(msg)
    return length


class TokenDocuments:
    """The documents of tokens of a dataset, each followed by ``eod`` when one is given, read by
    segments: what :class:`TokenWindows` and :class:`~smstore.PackedBins` sample from.

    A segment ``(document, first, count)`` is ``count`` tokens of a document from token ``first``,
    where the document's ``eod`` (when there is one) is its token at its length. :meth:`gather`
    copies segments into a sample: the one place tokens are read.

    Args:
        source: A blob or sharded dataset of token documents (``npy:<dtype>`` records of
            integers): its path, a :class:`~smstore.SharedStoreDataset` (read through its store:
            the daemon's copy, or the files), or an open ``Store`` / ``ShardedStore``.
        eod: The end-of-document token after every document, or None (the default): none.
        dtype: The samples' dtype (default int64, as Megatron's).

    Raises:
        StoreFormatError: The records are not ``npy:`` arrays of integers.
        ValueError: An ``eod`` that ``dtype`` cannot hold.
    """

    def __init__(self, source: Any, *, eod: int | None = None, dtype: Any = np.int64) -> None:
        if isinstance(source, str) or hasattr(source, "__fspath__"):
            from smstore.read.store import open as open_path

            source = open_path(source, raw=True)
        self.source = source
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
        # Tokens and records before each shard, from the manifest's sizes (a blob is one shard): no
        # shard opened, 16 bytes a shard.
        manifest = getattr(store, "manifest", None)
        if isinstance(store, _core.ShardedStore) and manifest is not None:
            n = len(manifest.shards)
            data = np.fromiter((s.data_bytes for s in manifest.shards), np.int64, n)
            records = np.fromiter((s.records for s in manifest.shards), np.int64, n)
        else:
            data = np.array([int(store.offsets[-1])], dtype=np.int64)
            records = np.array([len(store)], dtype=np.int64)
        self._record_starts = np.concatenate(([0], np.cumsum(records)))
        self._token_starts = np.concatenate(([0], np.cumsum(data // item + per_doc * records)))
        self.tokens = int(self._token_starts[-1])
        self.documents = int(self._record_starts[-1])

    def _store(self) -> Any:
        return getattr(self.source, "store", self.source)

    @property
    def store(self) -> Any:
        """The ``Store`` or ``ShardedStore`` the documents are read from (a dataset source's,
        attached in this process)."""
        return self._store()

    def _offsets(self, shard: int) -> np.ndarray[Any, Any]:
        store = self._store()
        return (store.shard(shard) if isinstance(store, _core.ShardedStore) else store).offsets

    def lengths(self, first: int, stop: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The tokens of documents ``[first, stop)``, ``eod`` included: from the offsets indexes of
        the shards that hold them, no record read."""
        parts = []
        k = int(np.searchsorted(self._record_starts, first, side="right")) - 1
        while first < stop:
            base, end = int(self._record_starts[k]), min(stop, int(self._record_starts[k + 1]))
            offsets = self._offsets(k)[first - base : end - base + 1].astype(np.int64)
            parts.append(np.diff(offsets) // self.token_dtype.itemsize)
            first, k = end, k + 1
        tokens = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return tokens + (0 if self.eod is None else 1)

    def locate(self, token: int) -> tuple[int, int]:
        """``(document, offset)``: the document holding ``token`` of the stream and the token's
        place in it (its ``eod`` is at the document's length), by binary searches: of the shards'
        token counts, then of the shard's offsets index (O(log n) reads, nothing built)."""
        shard, j, at, _ = self._place(token)
        return int(self._record_starts[shard]) + j, at

    def _place(self, token: int) -> tuple[int, int, int, memoryview]:
        """``locate``'s answer as (shard, record in the shard, offset, the shard's offsets as a
        memoryview: its items read as ints, no numpy scalars)."""
        if not 0 <= token < self.tokens:
            msg = f"token {token} is outside a stream of {self.tokens}"
            raise IndexError(msg)
        k = int(np.searchsorted(self._token_starts, token, side="right")) - 1
        offsets = self._offsets(k).data
        item, per_doc = self.token_dtype.itemsize, 0 if self.eod is None else 1
        # The last record j whose first token is at or before t: the core's one rule, which
        # smstore.Loader's threads apply too.
        j, at = _core.locate_in_shard(self._offsets(k), item, per_doc, token - int(self._token_starts[k]))
        return k, j, at, offsets

    def gather(
        self, segments: np.ndarray[Any, Any] | list[tuple[int, int, int]], out: np.ndarray[Any, Any]
    ) -> int:
        """Copy ``segments`` (rows ``(document, first, count)``) one after another into ``out``;
        returns the tokens written. The one reader of token segments (a C++ gather can replace it)."""
        store, at = self._store(), 0
        rows = segments.tolist() if isinstance(segments, np.ndarray) else segments
        for doc, first, count in rows:
            tokens = np.frombuffer(store[doc], dtype=self.token_dtype)
            take = tokens[first : first + count]
            out[at : at + take.size] = take
            if take.size < count:  # the segment ends with the document's eod
                out[at + take.size] = self.eod
            at += count
        return at

    def _batch_dtypes(self) -> dict[str, str] | None:
        """The stored tokens' and the samples' dtypes as the C++ batcher names them; None when
        either is not in this machine's byte order (the batcher reads native tokens only)."""
        if not (self.token_dtype.isnative and self.dtype.isnative):
            return None
        return {
            "in_dtype": f"{self.token_dtype.kind}{self.token_dtype.itemsize}",
            "out_dtype": f"{self.dtype.kind}{self.dtype.itemsize}",
        }

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "source": portable_source(self.source)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, source=restored_source(state["source"]))


class TokenWindows(TokenDocuments):
    """Samples of ``length + 1`` tokens over the documents of a dataset concatenated.

    Sample ``k`` is tokens ``[k * length, (k + 1) * length + 1)`` of the stream of every document
    (record), each followed by the token ``eod`` when one is given (documents that already
    end in one need none): consecutive samples share a token, as Megatron's ``GPTDataset``
    samples do, and there are ``(tokens - 1) // length`` of them (a tail too short for a whole
    sample is left out). A sample is a new array (``dtype``) that a collate stacks as it is.

    The documents come in stored order, or, given a ``seed``, in a new order each epoch with no
    index built. The order is a tree of groups of consecutive documents: the shards are visited in
    a keyed Feistel order (:class:`~smstore.sampling.orders.FeistelPermutation`, keyed by seed and
    epoch); a shard's documents are cut into at most ``group`` runs of nearly equal counts, visited
    in another keyed Feistel order, each cut again the same way until a run holds at most
    ``group`` documents, which are visited in a Feistel order of their own. A run's token span is
    two reads of the offsets index (its documents are consecutive), so the prefix sums of one
    group's parts in their shuffled order cost ``O(group)`` to compute, and locating token ``t``
    descends ``log_group(documents)`` levels: ``O(group * depth)`` work, with the last group of
    each level kept (consecutive tokens hit it), memory ``O(group * depth + shards)``, nothing of
    the documents' size. The shuffled stream is the same documents, so an epoch has the same
    tokens and samples as stored order. Documents of one run of ``group`` stay near each other
    (a shuffle of runs and within runs, not a uniform one); shuffle the windows themselves with
    a sampler (:class:`~smstore.GlobalShuffleSampler`) as before.

    Args:
        source: A blob or sharded dataset of token documents (``npy:<dtype>`` records of
            integers): its path, a :class:`~smstore.SharedStoreDataset` (read through its store:
            the daemon's copy, or the files), or an open ``Store`` / ``ShardedStore``.
        length: Tokens a sample predicts (the sequence length); a sample holds ``length + 1``.
        eod: The end-of-document token after every document, or None (the default): none.
        dtype: The samples' dtype (default int64, as Megatron's).
        seed: None (the default): documents in stored order; an int: documents shuffled per
            epoch, keyed by it.
        epoch: The epoch whose document order is read (see :meth:`set_epoch`).
        group: The most parts a group of the shuffle holds (default 1024).

    Raises:
        StoreFormatError: The records are not ``npy:`` arrays of integers.
        ValueError: ``length`` below 1, ``group`` below 2, a ``seed`` or ``epoch`` outside 64 bits
            (an epoch below 0), or an ``eod`` that ``dtype`` cannot hold.
    """

    def __init__(
        self,
        source: Any,
        length: int,
        *,
        eod: int | None = None,
        dtype: Any = np.int64,
        seed: int | None = None,
        epoch: int = 0,
        group: int = 1024,
    ) -> None:
        super().__init__(source, eod=eod, dtype=dtype)
        self.length = positive_length(length, self.path)
        if not isinstance(group, int) or isinstance(group, bool) or group < 2:
            msg = f"group must be a number of parts of at least 2, not {group!r}"
            raise ValueError(msg)
        self.seed = None if seed is None else _int64(seed, "seed", -(2**63))
        self.group = group
        self.epoch = _int64(epoch, "epoch", 0)
        self._groups: dict[int, tuple[tuple[int, int, int], _Group]] = {}
        self._len = max(0, (self.tokens - 1) // length)

    def __len__(self) -> int:
        return self._len

    def set_epoch(self, epoch: int) -> None:
        """Read the document order of ``epoch`` from now on (the same order again for the same
        seed and epoch, in any process); stored order is every epoch's without a ``seed``."""
        self.epoch = _int64(epoch, "epoch", 0)
        self._groups.clear()

    def locate(self, token: int) -> tuple[int, int]:
        """``(document, offset)``: the document (its stored index) holding ``token`` of this
        epoch's stream and the token's place in it (its ``eod`` is at the document's length).

        In stored order: binary searches of the shards' token counts, then of the shard's offsets
        index (O(log n) reads, nothing built). Shuffled: the descent of the class's docstring."""
        if self.seed is None:
            return super().locate(token)
        if not 0 <= token < self.tokens:
            msg = f"token {token} is outside a stream of {self.tokens}"
            raise IndexError(msg)
        return self._locate_shuffled(token)

    def _locate_shuffled(self, token: int) -> tuple[int, int]:
        shard, t = self._group_of(0, -1, 0, len(self._token_starts) - 1).find(token)
        first = int(self._record_starts[shard])
        lo, hi, level = 0, int(self._record_starts[shard + 1]) - first, 1
        while True:
            group = self._group_of(level, shard, lo, hi)
            part, t = group.find(t)
            if hi - lo <= self.group:  # the parts are documents
                return first + lo + part, t
            lo, hi, level = int(group.bounds[part]), int(group.bounds[part + 1]), level + 1

    def _group_of(self, level: int, shard: int, lo: int, hi: int) -> _Group:
        """The parts of documents ``[lo, hi)`` of ``shard`` (of the shards, for shard -1) in this
        epoch's order, kept until another group of the same level is asked for."""
        hit = self._groups.get(level)
        if hit is not None and hit[0] == (shard, lo, hi):
            return hit[1]
        assert self.seed is not None
        # The core's rule (bounds, keys, order and spans), which smstore.Loader's threads apply.
        if shard < 0:
            offsets, item, per_doc = self._token_starts.view(np.uint64), 1, 0
        else:
            offsets, item = self._offsets(shard), self.token_dtype.itemsize
            per_doc = 0 if self.eod is None else 1
        group = _Group(
            *_core.shuffle_group(offsets, item, per_doc, self.seed, self.epoch, shard, lo, hi, self.group)
        )
        self._groups[level] = ((shard, lo, hi), group)
        return group

    def batch_spec(self) -> _core.BatchSpec | None:
        """These windows for the C++ batcher (smstore.Loader): the stream's shards and its options,
        with the document order of the current epoch (the threads descend the same groups, keyed the
        same way); None for tokens or samples in a byte order not this machine's."""
        dtypes = self._batch_dtypes()
        if dtypes is None:
            return None
        return _core.BatchSpec.windows(
            **dtypes,
            length=self.length,
            eod=self.eod,
            token_starts=self._token_starts.tolist(),
            record_starts=self._record_starts.tolist(),
            seed=self.seed,
            epoch=self.epoch,
            group=self.group,
        )

    def segments(self, index: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Sample ``index``'s segments ``(document, first, count)``, int64 rows, in order."""
        return np.array(self._rows(index), dtype=np.int64).reshape(-1, 3)

    def _rows(self, index: int) -> list[tuple[int, int, int]]:
        k = int(index)
        if k < 0:
            k += self._len
        if not 0 <= k < self._len:
            msg = f"sample {index} out of range for {self._len} token windows of {self.path}"
            raise IndexError(msg)
        if self.seed is not None:
            return self._shuffled_rows(k)
        shard, j, at, offsets = self._place(k * self.length)
        doc, rows, left = int(self._record_starts[shard]) + j, [], self.length + 1
        end = int(self._record_starts[shard + 1])
        item, per_doc = self.token_dtype.itemsize, 0 if self.eod is None else 1
        while left:
            while doc == end:
                shard += 1
                offsets, end = self._offsets(shard).data, int(self._record_starts[shard + 1])
            j = doc - int(self._record_starts[shard])
            count = min(left, (offsets[j + 1] - offsets[j]) // item + per_doc - at)
            if count:
                rows.append((doc, at, count))
            left, doc, at = left - count, doc + 1, 0
        return rows

    def _shuffled_rows(self, k: int) -> list[tuple[int, int, int]]:
        """Window ``k``'s segments in a shuffled epoch: each next document is the shuffled
        stream's at the next token (``locate``), its length from the offsets."""
        rows, filled, size = [], 0, self.length + 1
        while filled < size:
            doc, at = self._locate_shuffled(k * self.length + filled)
            count = min(size - filled, int(self.lengths(doc, doc + 1)[0]) - at)
            rows.append((doc, at, count))
            filled += count
        return rows

    def __getitem__(self, index: int) -> np.ndarray[Any, Any]:
        """Sample ``index``: ``length + 1`` tokens, a new array."""
        out = np.empty(self.length + 1, dtype=self.dtype)
        self.gather(self._rows(index), out)
        return out

    def __getitems__(self, indices: Sequence[int]) -> list[np.ndarray[Any, Any]]:
        return [self[i] for i in indices]

    def __iter__(self) -> Iterator[np.ndarray[Any, Any]]:
        for k in range(self._len):
            yield self[k]

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_groups": {}}

    def __repr__(self) -> str:
        eod = "" if self.eod is None else f", eod={self.eod}"
        order = "" if self.seed is None else f", seed={self.seed}, epoch={self.epoch}"
        return f"TokenWindows({self.path!r}, length={self.length}{eod}{order}, samples={self._len})"
