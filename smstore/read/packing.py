"""Packed bins: documents of tokens packed best-fit into samples of ``length`` tokens, in bounded memory.

Pretraining on documents without crossing their boundaries packs them into bins of ``length``
tokens, attention kept within each document by ``cu_seqlens`` / ``position_ids``. Here the
documents are cut into consecutive groups of ``group`` documents, and each group is packed on its
own (best-fit over a buffer of at most ``open_bins`` open bins), so bin ``k``'s contents are found
by packing its group only: never a pass with the whole dataset in memory, and the same bins in
every process (a function of the data, ``length``, the options and ``seed``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from smstore import _core
from smstore.read.tokens import TokenDocuments, positive_length

__all__ = ["ALGORITHMS", "CLOSES", "PackedBins", "pack_lengths"]

ALGORITHMS = ("best-fit", "first-fit")
CLOSES = ("fullest", "oldest", "all")

Int64s = np.ndarray[Any, np.dtype[np.int64]]


def pack_lengths(
    lengths: Sequence[int] | Int64s,
    length: int,
    *,
    open_bins: int = 16,
    algorithm: str = "best-fit",
    close: str = "fullest",
) -> tuple[Int64s, Int64s]:
    """Pack documents of ``lengths`` tokens, in the order given, into bins of ``length`` tokens.

    A document longer than a bin is split: its first ``length``-token pieces are whole bins of
    their own, its rest is packed as a document. Each piece goes into an open bin with room for it,
    the fullest that has (``"best-fit"``; the oldest of equals) or the oldest (``"first-fit"``);
    when none has, a new bin opens, and when ``open_bins`` are open already one is closed first:
    the fullest (``close="fullest"``, the default), the oldest (``"oldest"``: a FIFO buffer), or
    all of them (``"all"``: Grain's packers, which emit their whole batch of ``open_bins`` rows
    when an element fits none). The C++ core runs it without the GIL: O(``open_bins``) a
    document, memory O(pieces + ``open_bins``).

    Returns:
        ``(segments, starts)``: int64 rows ``(position, first, count)`` (``position`` in
        ``lengths``), bin ``b``'s rows being ``segments[starts[b]:starts[b + 1]]``, bins in the
        order they were opened.

    Raises:
        ValueError: A bad ``algorithm`` or ``close``, ``length`` or ``open_bins`` below 1, or a
            negative length.
    """
    return _core.pack_lengths(
        np.asarray(lengths, dtype=np.int64), length, open_bins=open_bins, algorithm=algorithm, close=close
    )


class PackedBins(TokenDocuments):
    """Samples of at most ``length`` tokens, each whole documents (or pieces of long ones) packed together.

    The documents (records, each followed by ``eod`` when one is given) are taken in groups of
    ``group`` consecutive documents (shuffled within the group by ``seed`` when one is given), and
    each group is packed by :func:`pack_lengths` (best-fit, at most ``open_bins`` bins open, the
    fullest closed first; ``close=`` picks another rule): a
    document longer than ``length`` is split into ``length``-token pieces, as Megatron's and
    Grain's packing split them, each piece its own sequence. Bin ``k`` belongs to one group, so it
    is found by packing that group alone; the last ``cache_groups`` groups' packings are kept.

    **Memory.** Packing a group holds O(``group`` + ``open_bins``) rows; the object keeps one
    int64 per group (the bins before it) and the cached groups' segments: never the dataset.
    Construction counts every group's bins (the documents' lengths from the offsets indexes, no
    token read; the C++ packer over a chunk of groups a call), O(documents) time in bounded memory.

    **Order.** A map-style dataset: ``len(bins)`` bins, so any sampler shuffles them, with
    :class:`~smstore.GlobalShuffleSampler`'s exact resumable order at any world size. Bins in
    random order each repack their group (unless ``cache_groups`` holds them all);
    ``WindowedShuffleSampler(bins.group_sizes, window=w)`` with ``cache_groups > w`` shuffles
    bins within windows of ``w`` random groups and packs each group once per epoch.

    A bin (``bins[k]``) is a dict: ``tokens`` (``length`` of ``dtype``, the tail filled with
    ``pad``; or just the bin's tokens when ``pad`` is None), ``cu_seqlens`` (int32, FlashAttention
    varlen's ``[0, end of sequence 1, ...]`` over the bin's real tokens), ``position_ids`` (int64,
    from 0 at each sequence, 0 on padding) and ``segments`` (:meth:`segments`).

    Args:
        source: A blob or sharded dataset of token documents (as :class:`~smstore.TokenWindows`).
        length: Tokens a bin holds at most.
        eod: The end-of-document token after every document, or None (the default): none.
        pad: The token filling a bin to ``length`` (default 0), or None: bins not padded.
        dtype: The tokens' dtype (default int64).
        group: Documents packed together (default 4096).
        open_bins: Bins open at once while packing a group (default 16).
        algorithm: ``"best-fit"`` (the default) or ``"first-fit"``.
        close: The open bin closed when a piece fits none and ``open_bins`` are open:
            ``"fullest"`` (the default), ``"oldest"``, or ``"all"`` (Grain's rule); see
            :func:`pack_lengths`.
        seed: Shuffles the documents within each group (None, the default: stored order).
        cache_groups: Packed groups kept (default 4).

    Raises:
        StoreFormatError: The records are not ``npy:`` arrays of integers.
        ValueError: ``length`` below 1, a bad option, or ``eod`` / ``pad`` that ``dtype`` cannot hold.
    """

    def __init__(
        self,
        source: Any,
        length: int,
        *,
        eod: int | None = None,
        pad: int | None = 0,
        dtype: Any = np.int64,
        group: int = 4096,
        open_bins: int = 16,
        algorithm: str = "best-fit",
        seed: int | None = None,
        close: str = "fullest",
        cache_groups: int = 4,
    ) -> None:
        super().__init__(source, eod=eod, dtype=dtype)
        self.length = positive_length(length, self.path)
        for name, value in (("group", group), ("open_bins", open_bins), ("cache_groups", cache_groups)):
            if not isinstance(value, int) or value < 1:
                msg = f"{self.path}: {name} must be a positive integer, not {value!r}"
                raise ValueError(msg)
        if pad is not None and not np.can_cast(np.min_scalar_type(int(pad)), self.dtype):
            msg = f"pad={pad} does not fit the bins' dtype {self.dtype}"
            raise ValueError(msg)
        self.pad = None if pad is None else int(pad)
        if algorithm not in ALGORITHMS or close not in CLOSES:
            msg = f"{self.path}: algorithm must be one of {ALGORITHMS} and close one of {CLOSES}, not {algorithm!r}, {close!r}"
            raise ValueError(msg)
        self.group, self.open_bins, self.algorithm, self.close = group, open_bins, algorithm, close
        self.seed, self.cache_groups = seed, cache_groups
        self._cache: OrderedDict[int, tuple[Int64s, Int64s]] = OrderedDict()
        self.group_sizes = tuple(self._count_bins().tolist())
        self._bin_starts = np.zeros(len(self.group_sizes) + 1, dtype=np.int64)
        np.cumsum(self.group_sizes, out=self._bin_starts[1:])

    def _rule(self) -> dict[str, Any]:
        return {
            "length": self.length,
            "open_bins": self.open_bins,
            "algorithm": self.algorithm,
            "close": self.close,
        }

    def _order(self, g: int) -> Int64s | None:
        """Group ``g``'s documents (offsets in the group) in packing order: None for stored order."""
        if self.seed is None:
            return None
        size = min(self.group, self.documents - g * self.group)
        order: Int64s = np.random.default_rng([self.seed, g]).permutation(size)
        return order

    def _count_bins(self, chunk: int = 1 << 20) -> Int64s:
        """Every group's bins, counted in C++ a chunk of whole groups at a time (the lengths from the
        offsets indexes, no token read): bounded memory, no per-group call in stored order."""
        per_chunk = self.group * max(1, chunk // self.group)
        counts = []
        for first in range(0, self.documents, per_chunk):
            lengths = self.lengths(first, min(first + per_chunk, self.documents))
            if self.seed is not None:
                for at in range(0, len(lengths), self.group):
                    order = self._order((first + at) // self.group)
                    lengths[at : at + len(order)] = lengths[at : at + len(order)][order]  # type: ignore[arg-type]
            counts.append(_core.count_bins(lengths, self.group, **self._rule()))
        return np.concatenate(counts) if counts else np.zeros(0, np.int64)

    def _packed(self, g: int) -> tuple[Int64s, Int64s]:
        """Group ``g`` packed: its bins' segments (documents numbered in the dataset) and starts."""
        if g in self._cache:
            self._cache.move_to_end(g)
            return self._cache[g]
        first = g * self.group
        lengths = self.lengths(first, min(first + self.group, self.documents))
        order = self._order(g)
        if order is not None:
            lengths = lengths[order]
        segments, starts = _core.pack_lengths(lengths, **self._rule())
        segments[:, 0] = first + (segments[:, 0] if order is None else order[segments[:, 0]])
        self._cache[g] = (segments, starts)
        while len(self._cache) > self.cache_groups:
            self._cache.popitem(last=False)
        return segments, starts

    def __len__(self) -> int:
        return int(self._bin_starts[-1])

    def segments(self, index: int) -> Int64s:
        """Bin ``index``'s segments: int64 rows ``(document, first, count)``, in the bin's order
        (a document's ``eod`` is its token at its length): what a gather of tokens reads."""
        k = int(index)
        if k < 0:
            k += len(self)
        if not 0 <= k < len(self):
            msg = f"bin {index} out of range for {len(self)} packed bins of {self.path}"
            raise IndexError(msg)
        g = int(np.searchsorted(self._bin_starts, k, side="right")) - 1
        segments, starts = self._packed(g)
        b = k - int(self._bin_starts[g])
        rows: Int64s = segments[int(starts[b]) : int(starts[b + 1])].copy()
        return rows

    def batch_segments(self, indices: Sequence[int] | Int64s) -> Int64s:
        """The segments of bins ``indices`` as :meth:`collate` lists them: int64 rows ``(row,
        document, first, count)``, ``row`` the bin's place in ``indices`` (what smstore.Loader
        hands its threads: a few numpy operations per group the bins lie in, none per bin)."""
        ks = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(self)
        bad = ks[(ks < -n) | (ks >= n)]
        if bad.size:
            msg = f"bin {int(bad[0])} out of range for {n} packed bins of {self.path}"
            raise IndexError(msg)
        ks = np.where(ks < 0, ks + n, ks)
        bin_starts = np.asarray(self._bin_starts, dtype=np.int64)
        groups = np.searchsorted(bin_starts, ks, side="right") - 1
        # Each group packed once for the batch: a batch over more groups than the cache holds
        # would otherwise pack the evicted ones again for the copy below.
        packed = {g: self._packed(g) for g in np.unique(groups).tolist()}
        lo, hi = np.empty_like(ks), np.empty_like(ks)
        for g, (_, starts) in packed.items():
            mask = groups == g
            b = ks[mask] - bin_starts[g]
            lo[mask], hi[mask] = starts[b], starts[b + 1]
        counts = hi - lo
        at = np.cumsum(counts) - counts  # each bin's first row in the output
        within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(at, counts)
        out = np.empty((len(within), 4), dtype=np.int64)
        out[:, 0] = np.repeat(np.arange(len(ks), dtype=np.int64), counts)
        for g, (segments, _) in packed.items():
            mask = groups == g
            c = counts[mask]
            offset = within[np.repeat(mask, counts)]
            out[np.repeat(at[mask], c) + offset, 1:] = segments[np.repeat(lo[mask], c) + offset]
        return out

    def __getitem__(self, index: int) -> dict[str, np.ndarray[Any, Any]]:
        """Bin ``index``: ``tokens``, ``cu_seqlens``, ``position_ids`` and ``segments``, new arrays."""
        segments = self.segments(index)
        counts = segments[:, 2]
        used = int(counts.sum())
        size = used if self.pad is None else self.length
        tokens = np.full(size, 0 if self.pad is None else self.pad, dtype=self.dtype)
        self.gather(segments, tokens)
        cu_seqlens = np.zeros(len(counts) + 1, dtype=np.int32)
        np.cumsum(counts, out=cu_seqlens[1:])
        position_ids = np.zeros(size, dtype=np.int64)
        position_ids[:used] = np.arange(used) - np.repeat(cu_seqlens[:-1], counts)
        return {
            "tokens": tokens,
            "cu_seqlens": cu_seqlens,
            "position_ids": position_ids,
            "segments": segments,
        }

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, np.ndarray[Any, Any]]]:
        return [self[i] for i in indices]

    @staticmethod
    def collate(batch: Sequence[dict[str, np.ndarray[Any, Any]]]) -> dict[str, np.ndarray[Any, Any]]:
        """Padded bins as one batch (a DataLoader's ``collate_fn``; wrap in ``torch.from_numpy``):
        ``tokens`` and ``position_ids`` stacked ``[B, length]``, ``cu_seqlens`` (int32) over the
        ``B * length`` tokens flattened, each bin's padding a sequence of its own so that the
        sequences cover the batch (FlashAttention varlen), and ``segments`` with the bin's row in
        the batch first: ``(row, document, first, count)``."""
        sizes = {len(b["tokens"]) for b in batch}
        if len(sizes) != 1:
            msg = f"bins of {sorted(sizes)} tokens do not stack: make PackedBins with a pad token"
            raise ValueError(msg)
        length, cu = sizes.pop(), [np.zeros(1, dtype=np.int64)]
        for row, b in enumerate(batch):
            ends = b["cu_seqlens"][1:].astype(np.int64)
            cu.append(row * length + (ends if ends[-1] == length else np.append(ends, length)))
        return {
            "tokens": np.stack([b["tokens"] for b in batch]),
            "position_ids": np.stack([b["position_ids"] for b in batch]),
            "cu_seqlens": np.concatenate(cu).astype(np.int32),
            "segments": np.concatenate(
                [
                    np.column_stack([np.full(len(b["segments"]), row), b["segments"]])
                    for row, b in enumerate(batch)
                ]
            ),
        }

    def batch_spec(self) -> _core.BatchSpec | None:
        """These bins for the C++ batcher (smstore.Loader: :meth:`collate`'s batches, the tokens
        gathered from :meth:`segments` by C++ threads); None for bins not padded (``pad=None``: they
        do not stack) or tokens not in this machine's byte order."""
        dtypes = self._batch_dtypes()
        if self.pad is None or dtypes is None:
            return None
        return _core.BatchSpec.bins(**dtypes, length=self.length, eod=self.eod, pad=self.pad)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_cache": OrderedDict()}

    def __repr__(self) -> str:
        eod = "" if self.eod is None else f", eod={self.eod}"
        return f"PackedBins({self.path!r}, length={self.length}{eod}, bins={len(self)}, {self.algorithm})"
