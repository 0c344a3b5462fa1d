"""Orders as data: every shuffle smstore draws is a pure function of its spec, a seed and an epoch.

A spec (:class:`OrderSpec`) names a kind of order, its parameters and the data it orders (how
many records, a digest of the shard sizes); ``spec.order(seed, epoch)`` is the epoch's order,
the same for every world size. The one sampler (:mod:`smstore.sampling.sampler`) splits it
across ranks, resumes it and saves the spec in its state; an order that holds data while it is
read says what with ``holds(lane, position, behind)``.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, Protocol

import numpy as np

from smstore import _core
from smstore.wire.blocks import Piece

__all__ = [
    "BlockSpec",
    "BlockWindowOrder",
    "FeistelPermutation",
    "GlobalSpec",
    "Order",
    "OrderSpec",
    "ShardedSpec",
    "WindowedOrder",
    "WindowedSpec",
    "block_bounds",
    "round_keys",
]


class FeistelPermutation:
    """A keyed bijection of ``range(n)`` that needs O(1) memory.

    An alternating (unbalanced) Feistel network permutes the ``b``-bit integers, ``2**b`` being
    the smallest power of two ``>= n`` (so at most ``2n``); values that land outside ``[0, n)``
    are sent through the network again (cycle-walking) until they land inside, which keeps the map
    a bijection of ``[0, n)``. The expected number of passes is ``2**b / n < 2``. Each round splits
    the value into a high part ``A`` and a low part ``B`` and maps ``(A, B)`` to
    ``(B, A xor F_k(B))``; the parts trade widths every round, which is why any bit width works.
    ``F_k`` is splitmix64's finalizer applied to ``B + k``, with one 64-bit key per round.

    The permutation is a pure function of ``key`` and ``n``; it holds ``rounds`` 64-bit keys and
    nothing else. It is a shuffle, not cryptography.

    Args:
        n: The size of the domain.
        key: Any bytes; the round keys are derived from it with BLAKE2b.
        rounds: Feistel rounds (6 by default: well past the 4 that make a good pseudorandom
            permutation from good round functions).
    """

    def __init__(self, n: int, key: bytes, *, rounds: int = 6) -> None:
        if n < 0:
            msg = f"n must be >= 0, not {n}"
            raise ValueError(msg)
        if n > 2**63:
            msg = f"n must be <= 2**63, not {n}"
            raise ValueError(msg)
        self.n = n
        self._keys = round_keys(key, rounds)

    def __call__(self, positions: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The images of an array of positions in ``[0, n)``, as int64 (computed in C++, a few ns each).

        Raises:
            IndexError: A position is outside ``[0, n)``.
        """
        return map_positions(
            positions,
            lambda flat: _core.feistel_permute(flat, self.n, self._keys),
            f"a permutation of {self.n}",
        )

    def strided(self, first: int, step: int, count: int, wrap: int) -> list[int]:
        """The images of positions ``(first + i * step) % wrap`` for ``i < count`` (a rank's share
        of a pass, its padding wrapped), as a list: one call into C++, whatever ``count`` is."""
        return _core.feistel_strided(self.n, self._keys, first, step, count, wrap)

    def strided_array(
        self, first: int, step: int, count: int, wrap: int
    ) -> np.ndarray[Any, np.dtype[np.int64]]:
        """:meth:`strided`'s images as an int64 array (no Python int per index)."""
        return _core.feistel_strided_array(self.n, self._keys, first, step, count, wrap)

    def __getitem__(self, position: int) -> int:
        if not 0 <= position < self.n:
            msg = f"position {position} out of range for a permutation of {self.n}"
            raise IndexError(msg)
        return int(self(np.array([position], dtype=np.uint64))[0])

    def __len__(self) -> int:
        return self.n


class Order(Protocol):
    """The order of an epoch: ``order(positions)`` are the records at those positions."""

    def __call__(self, positions: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.int64]]: ...

    def strided(self, first: int, step: int, count: int, wrap: int) -> list[int]:
        """The records at positions ``(first + i * step) % wrap`` for ``i < count``."""
        ...

    def strided_array(
        self, first: int, step: int, count: int, wrap: int
    ) -> np.ndarray[Any, np.dtype[np.int64]]:
        """:meth:`strided`'s records as an int64 array."""
        ...


def map_positions(
    positions: np.ndarray[Any, Any],
    images: Callable[[np.ndarray[Any, Any]], np.ndarray[Any, np.dtype[np.int64]]],
    what: str,
) -> np.ndarray[Any, np.dtype[np.int64]]:
    """``images`` (a C++ call over flat uint64 positions) of an array of any shape; a negative
    position is an IndexError (as uint64 it would wrap to a huge one, which C++ refuses by value)."""
    x = np.asarray(positions)
    if x.size and x.dtype.kind == "i" and int(x.min()) < 0:
        msg = f"position {int(x.min())} out of range for {what}"
        raise IndexError(msg)
    return images(x.astype(np.uint64, copy=False).ravel()).reshape(x.shape)


def round_keys(key: bytes, rounds: int = 6) -> list[int]:
    """A Feistel permutation's round keys: 64 bits each, from BLAKE2b of ``key`` (the core's rule,
    which smstore.Loader's threads apply to shuffled token windows too)."""
    return _core.feistel_round_keys(key, rounds)


class WindowedOrder:
    """The order of one epoch of :class:`WindowedShuffleSampler`: shards shuffled, then records within windows.

    The shards are put in a keyed random order; windows are runs of ``window`` consecutive shards
    of it; the records of window ``j`` come at positions ``[G_j, G_{j+1})``, permuted by a keyed
    bijection of that range (:class:`FeistelPermutation`). ``order(p)`` for any positions costs a
    binary search over the windows and one Feistel evaluation each: no epoch-sized table exists.

    Args:
        shard_sizes: Records in each shard, in manifest order.
        window: Shards per window.
        key: Derives every permutation of the epoch (the seed and epoch are in it).
    """

    def __init__(self, shard_sizes: Sequence[int] | np.ndarray[Any, Any], window: int, key: str) -> None:
        sizes = np.asarray(shard_sizes, dtype=np.int64)
        self.window = window
        self.n = int(sizes.sum())
        # Shard order, and where each shard starts in the dataset and in the shard-ordered sequence.
        self.shard_order = FeistelPermutation(len(sizes), f"{key}:shards".encode())(
            np.arange(len(sizes), dtype=np.uint64)
        )
        self._starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._seq_starts = np.concatenate([[0], np.cumsum(sizes[self.shard_order])]).astype(np.int64)
        # G_j: the first position of window j (len: windows + 1).
        self.window_starts = self._seq_starts[::window].copy()
        if self.window_starts[-1] != self.n:
            self.window_starts = np.append(self.window_starts, self.n)
        # The same tables in C++, which evaluates the order (each window's round keys derived the
        # first time it is read: the callable holds the key, not this object, so no cycle forms).
        prefix = f"{key}:window:"
        self._core = _core.WindowedOrder(
            self.window_starts.tolist(),
            self._seq_starts.tolist(),
            self._starts[self.shard_order].tolist(),
            window,
            lambda j: round_keys(f"{prefix}{j}".encode()),
        )
        self._window_starts: list[int] = self.window_starts.tolist()  # read at every window (plain ints)
        self._shard_list: list[int] = self.shard_order.tolist()

    @property
    def kernel(self) -> _core.WindowedOrder:
        """The order's tables in C++ (what a windowed mixture's order evaluates each source with)."""
        return self._core

    @property
    def window_count(self) -> int:
        return len(self.window_starts) - 1

    def window_of(self, position: int) -> int:
        """The window holding global position ``position`` (0 <= position < n)."""
        return bisect.bisect_right(self._window_starts, position) - 1

    def window_start(self, j: int) -> int:
        """The first position of window ``j`` (``n`` for ``j == window_count``)."""
        return self._window_starts[j]

    def window_shards(self, j: int) -> list[int]:
        """Shard indices (of the manifest) of window ``j``, in shard order."""
        return self._shard_list[j * self.window : (j + 1) * self.window]

    def holds(self, lane: int, at: int, behind: int) -> tuple[tuple[int, ...], int]:  # noqa: ARG002 - one lane
        """What to hold at position ``at`` (``0 <= at < n``), and the next position where that changes.

        Held: the window of ``at``, the one before it while ``at`` is among the first ``behind``
        positions of its window (loader workers may still read it), and the next one (loading
        while this one is read), in that order.
        """
        j = self.window_of(at)
        begin = self._window_starts[j]
        draining = j > 0 and at - begin < behind
        shards = self.window_shards(j)
        if draining:
            shards += self.window_shards(j - 1)
        if j + 1 < self.window_count:
            shards += self.window_shards(j + 1)
        change = self._window_starts[j + 1]
        if draining:
            change = min(change, begin + behind)
        return tuple(shards), change

    def __call__(self, positions: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The records at an array of positions: the window's permutation of the position, then
        back from shard order to the record's index (computed in C++).

        Raises:
            IndexError: A position is outside ``[0, n)``.
        """
        return map_positions(positions, self._core, f"an order of {self.n}")

    def strided(self, first: int, step: int, count: int, wrap: int) -> list[int]:
        """The records at positions ``(first + i * step) % wrap`` for ``i < count``, as a list."""
        return self._core.strided(first, step, count, wrap)

    def strided_array(
        self, first: int, step: int, count: int, wrap: int
    ) -> np.ndarray[Any, np.dtype[np.int64]]:
        """:meth:`strided`'s records as an int64 array."""
        return self._core.strided_array(first, step, count, wrap)

    def __len__(self) -> int:
        return self.n


class BlockWindowOrder:
    """An epoch's order drawn from blocks: record ranges read in one go, from many shards at once.

    The design of docs/training.md, "Block windows", as a pure order (BlockWindowSampler yields it
    with groups of one block). Each shard is cut into **blocks** of at least ``block``
    consecutive records, as many as fit and as even as whole records allow (a shard of fewer is
    one block): a block never crosses a shard's end, so each is one sequential read of at least
    ``block`` records (:func:`block_bounds`). A keyed permutation puts the blocks in one random
    order, the **sequence**; **groups** are runs of ``G = group * block`` consecutive records of
    it (the last shorter), so a block's records fall in one group or two. The records of group
    ``j`` are dealt to ``spread`` parts: record ``r`` of it (in sequence order) to part
    ``r * stride % spread``, a step near ``0.38 spread`` (``deal_stride``), so the parts are as
    even as whole records allow and source neighbours fall far apart. Part ``t`` goes to
    **window** ``j + t``; the records of each window (parts of groups ``j - spread + 1 .. j``) are
    permuted by a keyed bijection of the window's positions, and the windows follow each other.

    So every record comes exactly once; the order is a pure function of ``key`` (the seed and
    epoch go in it), the same for any world size; ``order(p)`` for any positions costs a few
    binary searches and one Feistel evaluation each (O(1) resume), with tables of one entry a
    block, a window and a part (never groups x parts). While window ``w`` is read, groups
    ``w - spread + 1 .. w`` are needed and group ``w + 1`` is loading: a sliding run of
    ``(spread + 1) * G`` records of the sequence, in the blocks that cover it (at most one more
    block at each end), each block read once, sequentially. ``spread=1`` is plain windows of
    blocks (the one read and the next); a larger ``spread`` spreads each block's records over
    ``spread`` windows, so source neighbours share a batch less often (docs/training.md states
    the bound).

    Args:
        shard_sizes: Records in each shard, in manifest order.
        block: Records per block, at least (at least 1).
        group: Blocks per group (at least 1): a group is ``group * block`` records.
        spread: Windows over which a group's records are spread (at least 1).
        key: Derives every permutation of the epoch.

    Raises:
        ValueError: A shard size is negative, or ``block``, ``group`` or ``spread`` is below 1.
    """

    def __init__(
        self,
        shard_sizes: Sequence[int] | np.ndarray[Any, Any],
        *,
        block: int,
        group: int,
        spread: int,
        key: str,
    ) -> None:
        sizes = np.asarray(shard_sizes, dtype=np.int64)
        if sizes.size and int(sizes.min()) < 0:
            msg = "shard sizes must be >= 0"
            raise ValueError(msg)
        for name, value in (("block", block), ("group", group), ("spread", spread)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                msg = f"{name} must be a positive integer, not {value!r}"
                raise ValueError(msg)
        self.block, self.group, self.spread, self._key = block, group, spread, key
        self._permutations: dict[tuple[str, int], FeistelPermutation] = {}
        self.n = n = int(sizes.sum())
        # Blocks: records [block_first, block_first + block_length) of shard block_shard.
        self.block_first, self.block_length, self.block_shard = block_bounds(sizes, block)
        self._block_first: list[int] = self.block_first.tolist()
        self._block_length: list[int] = self.block_length.tolist()
        self._block_shard: list[int] = self.block_shard.tolist()
        self._shard_starts: list[int] = [0, *np.cumsum(sizes, dtype=np.int64).tolist()]
        nb = len(self.block_first)
        # The sequence: the blocks in a keyed order, and where each starts in it.
        self.block_order = FeistelPermutation(nb, f"{key}:blocks".encode())(
            np.arange(nb, dtype=np.uint64)
        ).astype(np.int64)
        self._seq_starts = np.concatenate([[0], np.cumsum(self.block_length[self.block_order])]).astype(
            np.int64
        )
        # Groups: sequence positions [j G, (j + 1) G); all of G records but the last.
        size = self.group_records = group * block
        groups = -(-n // size)
        self.group_starts = np.minimum(np.arange(groups + 1, dtype=np.int64) * size, n)
        self._last = n - (groups - 1) * size if groups else 0
        # Records are dealt to parts: record r of a group (in sequence order) goes to part
        # r * stride % spread, so part t holds records deal[t], deal[t] + spread, ... and source
        # neighbours (r, r + 1) land `stride` windows apart (about 0.38 spread: golden-ratio steps).
        self.stride = deal_stride(spread, size)
        inverse = pow(self.stride, -1, spread) if spread > 1 else 0
        self._deal = np.arange(spread, dtype=np.int64) * inverse % spread  # part t's first record
        # cut[t]: a full group's records in its parts before part t (cut[spread] = G); the last group's.
        self._cut = _cuts(size, self._deal)
        self._last_cut = _cuts(self._last, self._deal)
        self._cut_sums = np.concatenate([[0], np.cumsum(self._cut)]).astype(np.int64)  # sum of cut[:d]
        windows = groups + spread - 1 if groups else 0
        self.window_starts = np.append(self._before(np.arange(windows, dtype=np.int64)), n).astype(np.int64)

    def _cut_of(
        self, j: np.ndarray[Any, Any], t: np.ndarray[Any, Any]
    ) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Records of group ``j`` in its parts before part ``t`` (0 <= t <= spread)."""
        groups = len(self.group_starts) - 1
        out: np.ndarray[Any, np.dtype[np.int64]] = np.where(j == groups - 1, self._last_cut[t], self._cut[t])
        return out

    def _before(self, w: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Positions before window ``w``: whole groups ``<= w - spread``, and the parts before
        ``w`` of groups ``w - spread + 1 .. w``."""
        groups, s = len(self.group_starts) - 1, self.spread
        whole = np.clip(w - s + 1, 0, groups)
        lo = whole  # the first group with parts in or after window w
        hi = np.minimum(w, groups - 1)  # the last group with parts in or before it
        full_hi = np.minimum(hi, groups - 2)  # the groups of G records among them
        # Sum over j in [lo, full_hi] of cut[w - j] = sum of cut[d] for d in [w - full_hi, w - lo].
        some = full_hi >= lo
        d_lo, d_hi = np.where(some, w - full_hi, 0), np.where(some, w - lo + 1, 0)
        partial = self._cut_sums[np.clip(d_hi, 0, s + 1)] - self._cut_sums[np.clip(d_lo, 0, s + 1)]
        last_in = (lo <= groups - 1) & (groups - 1 <= hi)
        partial = partial + np.where(last_in, self._last_cut[np.clip(w - groups + 1, 0, s)], 0)
        total: np.ndarray[Any, np.dtype[np.int64]] = self.group_starts[whole] + partial
        return total

    @property
    def window_count(self) -> int:
        return len(self.window_starts) - 1

    def window_groups(self, w: int) -> range:
        """The groups window ``w`` draws from (those resident while it is read)."""
        groups = len(self.group_starts) - 1
        return range(max(0, w - self.spread + 1), min(w, groups - 1) + 1)

    def group_blocks(self, j: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Block indices (see ``block_first``) holding records of group ``j``, in sequence order."""
        lo, hi = int(self.group_starts[j]), int(self.group_starts[j + 1])
        first = int(np.searchsorted(self._seq_starts, lo, side="right")) - 1
        last = int(np.searchsorted(self._seq_starts, hi - 1, side="right")) - 1
        return self.block_order[first : last + 1]

    def held_blocks(self, position: int) -> list[int]:
        """The blocks held while ``position`` is read (lag not counted), in load order.

        Window ``w``'s groups and the next; while the memory fills (the first ``spread`` windows,
        which draw from fewer groups) the groups up to ``spread + 1`` too, so the daemon loads
        ahead as far as the budget allows from the first batch on instead of one block a window.
        """
        w = self.window_of(position)
        groups = len(self.group_starts) - 1
        first = self.window_groups(w).start
        last = min(max(w + 1, self.spread + 1), groups - 1)
        blocks: list[int] = []
        for j in range(first, last + 1):
            blocks += [int(b) for b in self.group_blocks(j) if not blocks or b != blocks[-1]]
        return blocks

    def piece(self, b: int) -> Piece:
        """Block ``b`` as the daemon holds it: a piece of its shard."""
        shard = self._block_shard[b]
        lo = self._block_first[b] - self._shard_starts[shard]
        return Piece(shard, lo, lo + self._block_length[b])

    def holds(self, lane: int, at: int, behind: int) -> tuple[tuple[Piece, ...], int]:  # noqa: ARG002 - one lane
        """The pieces to hold at position ``at`` (``0 <= at < n``), and the next position where that changes.

        :meth:`held_blocks`, and the blocks of every window among the last ``behind`` positions,
        which loader workers may still read: every one of them, not only the previous (a window
        shorter than the lag, as at the epoch's end, would let a worker behind read a released
        block, which the daemon then fetched again).
        """
        w = self.window_of(at)
        lagged = self.window_of(max(0, at - behind))
        blocks = self.held_blocks(at)
        for v in range(lagged, w):
            for j in self.window_groups(v):
                blocks += [int(b) for b in self.group_blocks(j) if b not in blocks]
        change = self.window_start(w + 1)
        if lagged < w:
            change = min(change, self.window_start(lagged + 1) + behind)
        return tuple(self.piece(b) for b in blocks), change

    def __call__(self, positions: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The records at an array of positions in ``[0, n)``.

        Raises:
            IndexError: A position is outside ``[0, n)``.
        """
        shape: tuple[int, ...] = np.shape(positions)
        p = np.asarray(positions).astype(np.int64).ravel()
        if p.size and (int(p.min()) < 0 or int(p.max()) >= self.n):
            bad = int(p.min()) if int(p.min()) < 0 else int(p.max())
            msg = f"position {bad} out of range for an order of {self.n}"
            raise IndexError(msg)
        groups, s = len(self.group_starts) - 1, self.spread
        # The window's permutation of the position: its place q among the window's parts.
        w = np.searchsorted(self.window_starts, p, side="right") - 1
        q = np.empty_like(p)
        for win, at in _runs(w):
            begin, end = int(self.window_starts[win]), int(self.window_starts[win + 1])
            q[at] = self._permutation("window", win, end - begin)(p[at] - begin)
        # The window holds part w - j of groups j = lo .. hi, in that order; every part but the
        # last group's has cut[w - j + 1] - cut[w - j] records, so part j starts at
        # cut[w - lo + 1] - cut[w - j + 1]: the last part starting at or before q is the one.
        lo = np.maximum(0, w - s + 1)
        hi = np.minimum(w, groups - 1)
        top = self._cut[w - lo + 1]
        u = np.maximum(np.searchsorted(self._cut, top - q, side="left"), w - hi + 1)
        j = w - u + 1
        t = w - j
        offset = top - self._cut[u]
        # The record dealt to that place of part t of group j, then the record in its block.
        seq = self.group_starts[j] + self._deal[t] + (q - offset) * s
        k = np.searchsorted(self._seq_starts, seq, side="right") - 1
        out: np.ndarray[Any, np.dtype[np.int64]] = (
            self.block_first[self.block_order[k]] + seq - self._seq_starts[k]
        )
        return out.reshape(shape)

    def strided(self, first: int, step: int, count: int, wrap: int) -> list[int]:
        """The records at positions ``(first + i * step) % wrap`` for ``i < count``."""
        return self.strided_array(first, step, count, wrap).tolist()  # type: ignore[no-any-return]

    def strided_array(
        self, first: int, step: int, count: int, wrap: int
    ) -> np.ndarray[Any, np.dtype[np.int64]]:
        """:meth:`strided`'s records as an int64 array."""
        positions = (first + np.arange(count, dtype=np.int64) * step) % max(1, wrap)
        return self(positions)

    def window_of(self, position: int) -> int:
        """The window holding ``position``."""
        return int(np.searchsorted(self.window_starts, position, side="right")) - 1

    def window_start(self, w: int) -> int:
        """The first position of window ``w`` (``n`` past the last)."""
        return int(self.window_starts[min(w, len(self.window_starts) - 1)])

    def _permutation(self, kind: str, index: int, size: int) -> FeistelPermutation:
        """The keyed permutation of window or group ``index``, kept: a sampler draws a few hundred
        positions at a time from the same few dozen groups, and making one costs its round keys."""
        cached = self._permutations.get((kind, index))
        if cached is None:
            if len(self._permutations) >= 4096:
                self._permutations.clear()
            cached = FeistelPermutation(size, f"{self._key}:{kind}:{index}".encode())
            self._permutations[(kind, index)] = cached
        return cached

    def __len__(self) -> int:
        return self.n


def deal_stride(spread: int, records: int) -> int:
    """The step between the parts of consecutive records of a group of ``records``: coprime with ``spread``.

    Records ``k`` apart land ``k * stride % spread`` parts (windows) apart. Source neighbours come
    first: in a group they land ``stride`` or ``spread - stride`` windows apart, and a group's last
    record and the next group's first (a block runs on across groups) ``|(records - 1) * stride %
    spread - 1|``; the step keeps all three at least ``spread // 5`` apart wherever a step can
    (:func:`_neighbour_gap`; the planner picks only spreads where one can). Among those, the one
    whose distance from 0 (circularly), times ``k``, is largest at its smallest over ``k = 1 ..
    K`` (``K = min(records, spread, 64) - 1``): the golden ratio's property (``k ||k phi||`` stays
    above ``1 / sqrt(5)``) on the integers, so records a few apart land not much closer than
    neighbours; the closest to ``0.382 spread`` among equals.
    """
    if spread <= 2:
        return 1
    k = np.arange(1, max(2, min(records, spread, 64)), dtype=np.int64)
    golden = spread * (3 - 5**0.5) / 2
    # Steps a and spread - a deal records k apart as far (both ways round), but not a group's end.
    a = np.arange(1, spread, dtype=np.int64)
    if len(a) > 16384:  # very wide spreads: the steps near the golden one, both ways round
        near = np.arange(max(1, int(golden) - 4096), int(golden) + 4096, dtype=np.int64)
        a = np.concatenate([near, spread - near[::-1]])
    a = a[np.gcd(a, spread) == 1]
    steps = k[None, :] * a[:, None] % spread
    nearest = (np.minimum(steps, spread - steps) * k[None, :]).min(axis=1)
    edge = edge_gap(spread, records, a)
    # The neighbour bound is a floor, not a preference: a step that crossed it for records k
    # apart would break the promise of docs/training.md for a pair in every group.
    gap = np.minimum(np.minimum(a, spread - a), edge)
    allowed = gap >= min(max(1, spread // 5), int(gap.max()))
    # (Past a fifth of the spread the edge is far enough: one pair a group.)
    nearest = np.where(allowed, np.minimum(nearest, np.maximum(edge, spread // 5)), -1)
    best = a[nearest == nearest.max()]
    # The closest to the golden step, the one below half the spread first.
    return int(best[np.lexsort((best > spread // 2, np.abs(np.minimum(best, spread - best) - golden)))[0]])


def edge_gap(spread: int, records: int, stride: Any) -> Any:
    """Windows between a group's last record (part ``(records - 1) * stride % spread`` of window
    ``j``) and the next group's first (part 0 of window ``j + 1``); ``spread`` for groups of one
    record, whose blocks (of one record too) hold no neighbours."""
    if records < 2:
        return np.full(np.shape(stride), spread, dtype=np.int64)
    return np.abs((records - 1) % spread * np.asarray(stride, dtype=np.int64) % spread - 1)


def block_bounds(
    shard_sizes: Sequence[int] | np.ndarray[Any, Any], block: int
) -> tuple[
    np.ndarray[Any, np.dtype[np.int64]],
    np.ndarray[Any, np.dtype[np.int64]],
    np.ndarray[Any, np.dtype[np.int64]],
]:
    """The blocks of a dataset: ``(first, length, shard)`` arrays, blocks in manifest order.

    Shard ``k`` of ``n`` records is cut into ``m = max(1, n // block)`` blocks (none if empty),
    block ``t`` of it holding its records ``[t n // m, (t + 1) n // m)``: every block lies in one
    shard and holds at least ``block`` records (fewer only where the whole shard does), at most
    ``2 block - 1``. ``smstore.wire.blocks.shard_block`` finds a record's block the same way.
    """
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    m = np.where(sizes > 0, np.maximum(1, sizes // block), 0)
    shard = np.repeat(np.arange(len(sizes), dtype=np.int64), m)
    t = np.arange(int(m.sum()), dtype=np.int64) - np.repeat(np.cumsum(m) - m, m)
    n, mk = sizes[shard], m[shard]
    lo, hi = t * n // mk, (t + 1) * n // mk
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return (starts[shard] + lo).astype(np.int64), (hi - lo).astype(np.int64), shard


def _cuts(size: int, deal: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Records of a group of ``size`` in its parts before each part: part t holds the records
    ``r < size`` with ``r % spread == deal[t]``."""
    spread = len(deal)
    counts = np.maximum(0, size - deal + spread - 1) // spread
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def _runs(
    values: np.ndarray[Any, np.dtype[np.int64]],
) -> Iterator[tuple[int, np.ndarray[Any, np.dtype[np.intp]]]]:
    """Each distinct value and the indices holding it (one sort, not a scan per value)."""
    by_value = np.argsort(values, kind="stable")
    sorted_values = values[by_value]
    cuts = np.flatnonzero(np.diff(sorted_values)) + 1
    for chunk in np.split(by_value, cuts):
        if chunk.size:
            yield int(values[chunk[0]]), chunk


def sizes_digest(sizes: Sequence[int]) -> str:
    """The short key of a list of shard sizes that states and block keys have always used."""
    return hashlib.blake2b(str(list(sizes)).encode(), digest_size=8).hexdigest()


class OrderSpec:
    """A kind of order, its parameters and the identity of the data it orders: an order as data.

    ``order(seed, epoch)`` builds the epoch's order; ``describe()`` is what a sampler's state
    stores (``{"kind", "params", "data"}``, plain JSON), and a state is resumed only by a sampler
    whose spec describes itself the same. ``legacy()`` is what the states of format 1 saved
    beside the kind's name, to translate them. An order that holds data while it is read has
    ``holds(lane, position, behind)``, one lane per residency it drives (a source of a mixture).
    """

    kind: ClassVar[str]
    error: ClassVar[type[ValueError]] = ValueError  # what refuses a state of another order
    num_records: int

    def order(self, seed: int, epoch: int) -> Order:
        raise NotImplementedError

    def params(self) -> dict[str, Any]:
        """What tells apart the orders of this kind over the same data."""
        return {}

    def data(self) -> dict[str, Any]:
        """The identity of the data the order is over."""
        return {"records": self.num_records}

    def legacy(self) -> dict[str, Any]:
        """The entries a state of format 1 saved for this order beside its kind."""
        return {}

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "params": self.params(), "data": self.data()}

    def fields(self) -> str:
        """The parameters, as a repr shows them."""
        return ", ".join(f"{k}={v!r}" for k, v in self.params().items())

    def lane_windows(self) -> list[int] | None:
        """Shards per window of each lane, for an order that keeps two windows of shards of each
        resident (the one read and the next); None for any other order."""
        return None


class GlobalSpec(OrderSpec):
    """An exact global shuffle of ``num_records`` records (:class:`FeistelPermutation`)."""

    kind: ClassVar[str] = "global"

    def __init__(self, num_records: int) -> None:
        self.num_records = num_records

    def order(self, seed: int, epoch: int) -> Order:
        key = f"smstore-global-shuffle-v1:{seed}:{epoch}:{self.num_records}".encode()
        return FeistelPermutation(self.num_records, key)


class ShardedSpec(OrderSpec):
    """An order over the records of shards of the given sizes: they are its data's identity."""

    def __init__(self, shard_sizes: Sequence[int]) -> None:
        self.shard_sizes = tuple(shard_sizes)
        self.num_records = sum(self.shard_sizes)
        self.digest = sizes_digest(self.shard_sizes)

    def data(self) -> dict[str, Any]:
        return {"records": self.num_records, "shards": self.digest}


class WindowedSpec(ShardedSpec):
    """Shards shuffled, then records within windows of ``window`` shards (:class:`WindowedOrder`)."""

    kind: ClassVar[str] = "windowed"

    def __init__(self, shard_sizes: Sequence[int], window: int) -> None:
        super().__init__(shard_sizes)
        self.window = window

    def order(self, seed: int, epoch: int) -> WindowedOrder:
        sizes = list(self.shard_sizes)
        return WindowedOrder(
            sizes, self.window, f"smstore-windowed-shuffle-v1:{seed}:{epoch}:{self.window}:{sizes}"
        )

    def params(self) -> dict[str, Any]:
        return {"window": self.window}

    def legacy(self) -> dict[str, Any]:
        return {"window": self.window, "shard_sizes_digest": self.digest}

    def fields(self) -> str:
        return f"shards={len(self.shard_sizes)}, window={self.window}"

    def lane_windows(self) -> list[int]:
        return [self.window]


# Bumped when BlockWindowOrder yields another order for the same key: a saved state says which.
BLOCK_ORDER_VERSION = 3


class BlockSpec(ShardedSpec):
    """Blocks of at least ``block`` records, each group dealt over ``spread`` windows (:class:`BlockWindowOrder`)."""

    kind: ClassVar[str] = "blocks"

    def __init__(self, shard_sizes: Sequence[int], block: int, spread: int) -> None:
        super().__init__(shard_sizes)
        self.block, self.spread = block, spread

    def order(self, seed: int, epoch: int) -> BlockWindowOrder:
        key = f"smstore-block-shuffle-v2:{seed}:{epoch}:{self.block}:{self.spread}:{self.digest}"
        return BlockWindowOrder(self.shard_sizes, block=self.block, group=1, spread=self.spread, key=key)

    def params(self) -> dict[str, Any]:
        return {"block": self.block, "spread": self.spread, "version": BLOCK_ORDER_VERSION}

    def legacy(self) -> dict[str, Any]:
        return {"blocks": [self.block, self.spread, self.digest, BLOCK_ORDER_VERSION]}

    def fields(self) -> str:
        return f"shards={len(self.shard_sizes)}, block={self.block}, spread={self.spread}"
