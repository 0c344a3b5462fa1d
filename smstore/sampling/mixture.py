"""Mixtures of sources by weight: exact proportions computed per position, per-source epochs, O(1) resume.

A mixture epoch is a sequence of positions ``0..N-1``; position ``p`` draws from one source,
chosen by a closed form (no blend index is built), and takes the next element of that source's own
shuffled order. :class:`MixtureSampler` splits the positions across ranks exactly as
:class:`~smstore.GlobalShuffleSampler` does (it is one), yielding indices into the concatenation
of the sources, which :class:`MixtureDataset` maps back to ``(source, index)``.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections.abc import Callable, Sequence, Sized
from fractions import Fraction
from typing import Any, ClassVar

import numpy as np

from smstore import _core
from smstore.errors import MixtureError
from smstore.sampling.orders import OrderSpec, WindowedOrder, map_positions, round_keys

__all__ = [
    "Mixture",
    "MixtureDataset",
    "MixtureOrder",
    "MixtureSpec",
    "WindowedMixtureOrder",
    "WindowedMixtureSpec",
    "counts_digest",
    "from_megatron_blend",
    "parse_megatron_blend",
]

STOPPING = ("all_exhausted", "first_exhausted")
# Shares are integers with a total at most this, so that every split's arithmetic fits in int64
# (a remainder times a share is below 2**62) whatever the position.
_MAX_TOTAL = 2**31


def _as_fraction(w: object, i: int) -> Fraction:
    """A weight as an exact rational: a float by its shortest decimal form (0.7 is 7/10)."""
    if isinstance(w, bool) or not isinstance(w, (int, float, Fraction, np.integer, np.floating)):
        msg = f"weight {i} is {w!r}: weights must be numbers"
        raise MixtureError(msg)
    if isinstance(w, (float, np.floating)):
        if not math.isfinite(w):
            msg = f"weight {i} is {w}: weights must be finite"
            raise MixtureError(msg)
        f = Fraction(repr(float(w)))
    else:
        f = Fraction(w)  # type: ignore[arg-type]
    if f <= 0:
        msg = f"weight {i} is {w}: weights must be > 0 (leave a source out rather than weigh it 0)"
        raise MixtureError(msg)
    return f


def _shares(weights: Sequence[Fraction]) -> list[int]:
    """Integer shares in the exact ratio of the weights, or (when their total would pass 2**31) the
    largest-remainder rounding of the weights to a total of 2**30, every share at least 1."""
    denom = math.lcm(*(w.denominator for w in weights))
    shares = [int(w * denom) for w in weights]
    g = math.gcd(*shares)
    shares = [s // g for s in shares]
    if sum(shares) <= _MAX_TOTAL:
        return shares
    total = sum(weights)
    target = 2**30
    exact = [w / total * target for w in weights]
    floors = [max(1, math.floor(x)) for x in exact]
    left = target - sum(floors)
    by_remainder = sorted(range(len(weights)), key=lambda s: (-(exact[s] - math.floor(exact[s])), s))
    for s in by_remainder[: max(0, left)]:
        floors[s] += 1
    return floors


class Mixture:
    """Which source each position of a mixture epoch draws from, in closed form.

    **The rule.** The weights become integer shares ``q_s`` (exact for weights written as
    decimals: 0.7 and 0.3 are 7 and 3). The sources are the leaves of a binary tree built as a
    Huffman code of the shares (heavy sources near the root). A node with share ``Q`` whose left
    child has share ``a`` sends, of the first ``m`` positions that reach it, ``L(m) = floor((m a +
    h) / Q)`` to the left (``h = (Q - 1) // 2``, so ``L(m)`` is ``m a / Q`` rounded) and the rest
    to the right: position ``m`` of the node goes left exactly when ``L(m + 1) > L(m)``, and is
    then the child's position ``L(m)`` (else ``m - L(m)``). Descending from the root with ``m =
    p`` gives the source of global position ``p`` and how many positions before ``p`` drew from
    it, in O(depth) integer operations: no table, whatever ``p`` is. Every count is
    non-decreasing in ``p`` and they sum to ``p``.

    **The bound.** Each split is within 1/2 of its exact share, so the number ``c_s(n)`` of the
    first ``n`` positions that draw from source ``s`` satisfies ``|c_s(n) - n w_s| <= E_s`` with
    ``E_s = (q_s / 2) * sum(1 / q_A)`` over the tree nodes ``A`` on the path from the root's child
    to the leaf ``s`` (:meth:`deviation_bounds`). That is 1/2 for two sources, below 1 for three,
    and about 1 for balanced weights; it never grows with ``n``. (No rule that gives each
    position in O(1) can promise below 1 for any number of sources: largest-remainder rounding of
    ``n w_s`` is not monotone in ``n`` (the Alabama paradox), and sequential rules such as
    Megatron's "most behind first" need the whole prefix.)

    **Stopping.** ``stop`` is the number of positions of an epoch, or (HF ``interleave_datasets``'
    names) ``"all_exhausted"``: the fewest positions in which every source has drawn at least its
    length (smaller sources start over: upsampling), or ``"first_exhausted"``: the most positions
    in which no source draws more than its length.

    Args:
        sources: One per source: its number of records, or anything with ``len``.
        weights: One positive, finite number per source (any scale: they are normalised).
        stop: ``"all_exhausted"`` (default), ``"first_exhausted"`` or a number of samples.

    Raises:
        MixtureError: No sources, a source without records, a weight that is not a positive
            finite number, a count of weights that does not match, or an unknown ``stop``.
    """

    def __init__(
        self, sources: Sequence[Sized | int], weights: Sequence[float], *, stop: str | int = "all_exhausted"
    ) -> None:
        if len(sources) == 0:
            msg = "a mixture needs at least one source"
            raise MixtureError(msg)
        if len(weights) != len(sources):
            msg = f"{len(weights)} weights for {len(sources)} sources: give one weight per source"
            raise MixtureError(msg)
        lengths = [s if isinstance(s, (int, np.integer)) else len(s) for s in sources]
        for i, n in enumerate(lengths):
            if isinstance(n, bool) or int(n) <= 0:
                msg = f"source {i} has {n} records: a mixture cannot draw from an empty source"
                raise MixtureError(msg)
        self.lengths = [int(n) for n in lengths]
        self.shares = _shares([_as_fraction(w, i) for i, w in enumerate(weights)])
        self.total = sum(self.shares)
        self.weights = [Fraction(q, self.total) for q in self.shares]
        self.offsets = [0]
        for n in self.lengths:
            self.offsets.append(self.offsets[-1] + n)
        self._build_tree()
        if isinstance(stop, str):
            if stop not in STOPPING:
                msg = f"stop={stop!r}: use 'all_exhausted', 'first_exhausted' or a number of samples"
                raise MixtureError(msg)
        elif isinstance(stop, bool) or not isinstance(stop, (int, np.integer)) or stop < 0:
            msg = f"stop={stop!r}: a number of samples must be an integer >= 0"
            raise MixtureError(msg)
        self.stop: str | int = stop if isinstance(stop, str) else int(stop)
        self.num_samples = self._epoch_length()
        key = f"{self.lengths}:{self.shares}:{self.stop}".encode()
        self.digest = hashlib.blake2b(key, digest_size=8).hexdigest()

    # -- the tree -------------------------------------------------------------------------------

    def _build_tree(self) -> None:
        """The Huffman tree of the shares. Node ``j`` (internal) has arrays ``a`` (left share),
        ``q`` (its share), ``h``, and children coded ``>= 0`` (a node) or ``-(s + 1)`` (source s)."""
        heap: list[tuple[int, int, int]] = [(q, s, -(s + 1)) for s, q in enumerate(self.shares)]
        heapq.heapify(heap)
        left: list[int] = []
        right: list[int] = []
        a: list[int] = []
        q: list[int] = []
        tiebreak = len(self.shares)
        while len(heap) > 1:
            q1, _, c1 = heapq.heappop(heap)
            q0, _, c0 = heapq.heappop(heap)
            left.append(c0)  # the heavier child on the left
            right.append(c1)
            a.append(q0)
            q.append(q0 + q1)
            heapq.heappush(heap, (q0 + q1, tiebreak, len(q) - 1))
            tiebreak += 1
        self.root = heap[0][2]
        # A source's path: (node, goes left) from the root down.
        self._paths: list[list[tuple[int, bool]]] = [[] for _ in self.shares]

        def walk(node: int, path: list[tuple[int, bool]]) -> None:
            if node < 0:
                self._paths[-node - 1] = path
                return
            walk(left[node], [*path, (node, True)])
            walk(right[node], [*path, (node, False)])

        walk(self.root, [])
        self._left, self._right, self._a, self._q = left, right, a, q
        self._bounds = self.deviation_bounds()
        self._h = [(x - 1) // 2 for x in q]
        self._kernel: _core.MixtureTree | None = None

    @property
    def tree(self) -> _core.MixtureTree:
        """The tree in C++, which :meth:`locate` and :class:`MixtureOrder` descend (built on first
        use: a pickled mixture, a DataLoader worker's, carries only the Python lists)."""
        if self._kernel is None:
            self._kernel = _core.MixtureTree(
                self._a, self._q, self._left, self._right, self.root, len(self.shares)
            )
        return self._kernel

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_kernel": None}

    def _split(self, node: int, m: int) -> int:
        """``L(m)``: of the first ``m`` positions of ``node``, how many go to its left child."""
        a, q, h = self._a[node], self._q[node], self._h[node]
        return (m * a + h) // q

    def count(self, source: int, n: int) -> int:
        """How many of positions ``[0, n)`` draw from ``source`` (O(depth), exact for any ``n``)."""
        m = n
        for node, goes_left in self._paths[source]:
            k = self._split(node, m)
            m = k if goes_left else m - k
        return m

    def counts(self, n: int) -> list[int]:
        """:meth:`count` of every source (O(sources))."""
        out = [0] * len(self.shares)
        stack = [(self.root, n)]
        while stack:
            node, m = stack.pop()
            if node < 0:
                out[-node - 1] = m
                continue
            k = self._split(node, m)
            stack.append((self._left[node], k))
            stack.append((self._right[node], m - k))
        return out

    def deviation_bounds(self) -> list[float]:
        """``E_s`` per source: ``|count(s, n) - n * w_s| <= E_s`` for every ``n``."""
        out = []
        for s, path in enumerate(self._paths):
            shares = [self._q[node] for node, _ in path[1:]] + [self.shares[s]]
            out.append(0.0 if not path else self.shares[s] / 2 * sum(1 / x for x in shares))
        return out

    def locate(
        self, positions: np.ndarray[Any, Any]
    ) -> tuple[np.ndarray[Any, np.dtype[np.int64]], np.ndarray[Any, np.dtype[np.int64]]]:
        """For positions ``p`` (flattened, each in ``[0, 2**63)``): the source each draws from, and
        how many positions before ``p`` drew from that source (its draw number), computed in C++.

        Raises:
            IndexError: A position is negative.
        """
        p = np.asarray(positions)
        if p.size and p.dtype.kind == "i" and int(p.min()) < 0:
            msg = f"position {int(p.min())} is negative"
            raise IndexError(msg)
        return self.tree.locate(p.astype(np.uint64, copy=False).ravel())

    # -- stopping -------------------------------------------------------------------------------

    def _first_reaching(self, s: int, c: int) -> int:
        """The fewest positions in which source ``s`` draws ``c`` times (binary search in the
        window the bound leaves around ``c / w_s``)."""
        w = self.shares[s] / self.total
        e = self._bounds[s] + 1
        lo = max(0, math.floor((c - e) / w) - 1)
        hi = math.ceil((c + e) / w) + 1
        while self.count(s, hi) < c:  # never taken while the bound holds; kept for safety
            hi *= 2
        while lo < hi:
            mid = (lo + hi) // 2
            if self.count(s, mid) >= c:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def positions_for(self, source: int, draws: int) -> int:
        """The fewest positions in which ``source`` draws ``draws`` times (where its draw number
        ``draws`` is first the next one): O(depth * log(bound)), for any ``draws``."""
        return self._first_reaching(source, draws)

    def _epoch_length(self) -> int:
        if isinstance(self.stop, int):
            return self.stop
        if self.stop == "all_exhausted":
            return max(self._first_reaching(s, n) for s, n in enumerate(self.lengths))
        return min(self._first_reaching(s, n + 1) - 1 for s, n in enumerate(self.lengths))

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        w = ", ".join(f"{float(x):.4g}" for x in self.weights)
        return f"Mixture(lengths={self.lengths}, weights=[{w}], stop={self.stop!r}, num_samples={self.num_samples})"


class MixtureOrder:
    """The order of one mixture epoch: position ``p`` -> global index ``offset_s + P_{s,e}(k mod n_s)``.

    ``s`` and ``k`` (the draw number) come from :meth:`Mixture.locate`; ``P_{s,e}`` is source
    ``s``'s own Feistel permutation for its epoch ``e = k // n_s`` of this mixture epoch, keyed by
    ``(seed, mixture epoch, s, e)``: a source drawn past its length starts a fresh permutation of
    its own (upsampling), independently of the others.
    """

    def __init__(self, mixture: Mixture, seed: int, epoch: int) -> None:
        self.mixture = mixture
        self.n = mixture.num_samples
        self.prefix = f"smstore-mixture-v1:{seed}:{epoch}"
        self._kernel: _core.MixtureOrder | None = None

    @property
    def kernel(self) -> _core.MixtureOrder:
        """The order in C++ (built on first use: a pickled order carries only its key prefix)."""
        if self._kernel is None:
            prefix, lengths = self.prefix, self.mixture.lengths
            self._kernel = _core.MixtureOrder(
                self.mixture.tree,
                lengths,
                self.mixture.offsets[:-1],
                self.n,
                # Each source pass's round keys, derived when the order first reaches it (the
                # callable holds the prefix and lengths, not this object: no cycle forms).
                lambda s, e: round_keys(f"{prefix}:{s}:{e}:{lengths[s]}".encode()),
            )
        return self._kernel

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_kernel": None}

    def pairs(
        self, positions: np.ndarray[Any, Any]
    ) -> tuple[np.ndarray[Any, np.dtype[np.int64]], np.ndarray[Any, np.dtype[np.int64]]]:
        """``(source, index in source)`` for each position in ``[0, n)`` (flattened).

        Raises:
            IndexError: A position is outside ``[0, n)``.
        """
        p = np.asarray(positions)
        if p.size and p.dtype.kind == "i" and int(p.min()) < 0:
            msg = f"position {int(p.min())} out of range for a mixture epoch of {self.n}"
            raise IndexError(msg)
        return self.kernel.pairs(p.astype(np.uint64, copy=False).ravel())

    def __call__(self, positions: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Global indices (into the concatenation of the sources) at an array of positions.

        Raises:
            IndexError: A position is outside ``[0, n)``.
        """
        return map_positions(positions, self.kernel, f"a mixture epoch of {self.n}")

    def strided(self, first: int, step: int, count: int, wrap: int) -> list[int]:
        """The indices at positions ``(first + i * step) % wrap`` for ``i < count``, as a list."""
        return self.kernel.strided(first, step, count, wrap)

    def strided_array(
        self, first: int, step: int, count: int, wrap: int
    ) -> np.ndarray[Any, np.dtype[np.int64]]:
        """:meth:`strided`'s indices as an int64 array."""
        return self.kernel.strided_array(first, step, count, wrap)

    def __len__(self) -> int:
        return self.n


class MixtureDataset:
    """The concatenation of the sources, read through the mixture's global indices.

    Index ``i`` is record ``i - offset_s`` of the source ``s`` whose range holds it (the offsets
    are the sources' cumulative lengths): what :class:`MixtureSampler` yields. The sources are
    read as they are (``source[j]``); nothing is copied.

    Args:
        sources: Datasets with ``len`` and ``__getitem__`` (blobs, sharded datasets,
            SharedLists, SharedStoreDatasets, any map-style dataset).
        weights: One positive weight per source.
        stop: See :class:`Mixture`.
    """

    def __init__(
        self, sources: Sequence[Any], weights: Sequence[float], *, stop: str | int = "all_exhausted"
    ) -> None:
        self.sources = list(sources)
        self.mixture = Mixture(self.sources, weights, stop=stop)
        self.offsets = self.mixture.offsets

    def locate(self, index: int) -> tuple[int, int]:
        """``(source, index in source)`` of a global index."""
        offsets = self.offsets
        if not 0 <= index < offsets[-1]:
            msg = f"index {index} out of range for a mixture of {offsets[-1]} records"
            raise IndexError(msg)
        import bisect

        s = bisect.bisect_right(offsets, index) - 1
        return s, index - offsets[s]

    def __getitem__(self, index: int) -> Any:
        s, j = self.locate(int(index))
        return self.sources[s][j]

    def __len__(self) -> int:
        return self.offsets[-1]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.mixture!r})"


class WindowedMixtureOrder(MixtureOrder):
    """The order of one mixture epoch whose sources are read through windows of their shards.

    The mixture decides which source position ``p`` draws from and its draw number ``k`` (as in
    :class:`MixtureOrder`); source ``s``'s own windowed order for its pass ``e = k // n_s``
    (:class:`~smstore.sampling.orders.WindowedOrder` over its shards, keyed by ``(seed, mixture epoch, s,
    e)``) decides which record: ``offset_s + W_{s,e}(k mod n_s)``. A source drawn past its length
    starts its next pass, with its own shard order and windows, independently of the others.
    A source without shards is one shard: its window is the whole source.

    Args:
        mixture: The mixture.
        shard_sizes: Per source, the records of each of its shards (summing to its length).
        windows: Per source, shards per window.
        seed: The sampler's seed.
        epoch: The mixture epoch.
    """

    def __init__(
        self,
        mixture: Mixture,
        shard_sizes: Sequence[Sequence[int] | np.ndarray[Any, Any]],
        windows: Sequence[int],
        seed: int,
        epoch: int,
    ) -> None:
        super().__init__(mixture, seed, epoch)
        self.shard_sizes = [np.asarray(sizes, dtype=np.int64) for sizes in shard_sizes]
        self.windows = list(windows)
        self._keys = [
            f"smstore-mixture-windowed-v1:{seed}:{epoch}:{s}:{self.windows[s]}:{counts_digest(sizes)}"
            for s, sizes in enumerate(self.shard_sizes)
        ]
        self._passes: list[dict[int, WindowedOrder]] = [{} for _ in self.shard_sizes]
        self._totals = mixture.counts(self.n)  # each source's draws in the epoch

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_kernel": None, "_passes": [{} for _ in self.shard_sizes]}

    def source_order(self, source: int, pass_: int) -> WindowedOrder:
        """Source ``source``'s windowed order for its pass ``pass_`` of this epoch (kept while the
        residency reads its windows)."""
        cache = self._passes[source]
        order = cache.get(pass_)
        if order is None:
            if len(cache) >= 4:  # a rank's draws of a source rise: the pass read and the next suffice
                cache.clear()
            order = WindowedOrder(
                self.shard_sizes[source], self.windows[source], f"{self._keys[source]}:{pass_}"
            )
            cache[pass_] = order
        return order

    @property
    def kernel(self) -> _core.MixtureOrder:
        """The order in C++: the mixture's tree, then each source pass's windowed order, made by
        the kernel when it first reaches the pass (its own copy: the kernel runs without the GIL)."""
        if self._kernel is None:
            sizes, windows, keys = self.shard_sizes, self.windows, self._keys
            self._kernel = _core.MixtureOrder(
                self.mixture.tree,
                self.mixture.lengths,
                self.mixture.offsets[:-1],
                self.n,
                windows=lambda s, e: WindowedOrder(sizes[s], windows[s], f"{keys[s]}:{e}").kernel,
            )
        return self._kernel

    # -- windows, for residency ------------------------------------------------------------------

    def window_of_draw(self, source: int, draw: int) -> tuple[int, int]:
        """``(pass, window)`` of the source's ``draw``-th draw of the epoch."""
        e, k = divmod(draw, self.mixture.lengths[source])
        return e, self.source_order(source, e).window_of(k)

    def window_shards(self, source: int, window: tuple[int, int]) -> list[int]:
        """The source's shards (manifest indices) of ``window`` (a ``(pass, window)``)."""
        return self.source_order(source, window[0]).window_shards(window[1])

    def _next_window(self, source: int, window: tuple[int, int]) -> tuple[tuple[int, int], int]:
        """The window after ``window`` and the draw number it starts at."""
        e, j = window
        order = self.source_order(source, e)
        if j + 1 >= order.window_count:
            e, j = e + 1, 0
        else:
            j += 1
        return (e, j), e * self.mixture.lengths[source] + self.source_order(source, e).window_start(j)

    def holds(self, source: int, at: int, behind: int) -> tuple[tuple[int, ...], int]:
        """What to hold of ``source`` at position ``at`` (``0 <= at < n``), and the next position
        where that may change (``> at``; ``n`` or past it when nothing changes before the end).

        Held: the windows of the draws made at positions ``[at - behind, at)`` (loader workers may
        still read them), the window of the next draw, and the window after it, each only while
        the epoch still draws from it; in the order to load them (the next draw's window first).
        """
        mix = self.mixture
        total = self._totals[source]
        c0, c = mix.count(source, max(0, at - behind)), mix.count(source, at)
        if c0 >= total:
            return (), self.n
        top = min(c, total - 1)
        current = self.window_of_draw(source, top)
        after, after_start = self._next_window(source, current)
        # The next draw's window moves when the draws reach the next one (never, once the source
        # has drawn all it draws this epoch).
        change = self.n if c >= total else mix.positions_for(source, after_start)
        shards = list(self.window_shards(source, current))
        if c < total and after_start < total:
            shards += self.window_shards(source, after)
        window = self.window_of_draw(source, c0)
        if window != current:
            # The lagged windows: held until the draws behind pass the first of them.
            nxt, start = self._next_window(source, window)
            change = min(change, mix.positions_for(source, start) + behind)
            while window != current:
                shards += self.window_shards(source, window)
                window = nxt
                nxt, _ = self._next_window(source, window)
        return tuple(dict.fromkeys(shards)), change


def counts_digest(sizes: Sequence[int] | np.ndarray[Any, Any]) -> str:
    """A short key of a list of counts (O(1) Python work per call: millions of shards hash in ms)."""
    data = np.ascontiguousarray(sizes, dtype="<i8").tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


class MixtureSpec(OrderSpec):
    """A mixture epoch: which source each position draws from, then that source's own shuffle (:class:`MixtureOrder`)."""

    kind: ClassVar[str] = "mixture"
    error: ClassVar[type[ValueError]] = MixtureError

    def __init__(self, mixture: Mixture) -> None:
        self.mixture = mixture
        self.num_records = mixture.num_samples

    def order(self, seed: int, epoch: int) -> MixtureOrder:
        return MixtureOrder(self.mixture, seed, epoch)

    def params(self) -> dict[str, Any]:
        return {"mixture": self.mixture.digest}  # its lengths, weights and stopping rule

    def data(self) -> dict[str, Any]:
        return {"records": self.num_records, "sources": len(self.mixture.lengths)}

    def legacy(self) -> dict[str, Any]:
        return {"mixture": self.mixture.digest, "sources": len(self.mixture.lengths)}

    def fields(self) -> str:
        return f"mixture={self.mixture!r}"


class WindowedMixtureSpec(MixtureSpec):
    """A mixture epoch whose sources are read through windows of their shards (:class:`WindowedMixtureOrder`)."""

    kind: ClassVar[str] = "windowed-mixture"

    def __init__(
        self,
        mixture: Mixture,
        shard_sizes: Sequence[np.ndarray[Any, np.dtype[np.int64]]],
        windows: Sequence[int],
    ) -> None:
        super().__init__(mixture)
        self.shard_sizes = list(shard_sizes)
        self.windows = list(windows)
        self.layout = counts_digest(np.concatenate([self.windows, *self.shard_sizes]))

    def order(self, seed: int, epoch: int) -> WindowedMixtureOrder:
        return WindowedMixtureOrder(self.mixture, self.shard_sizes, self.windows, seed, epoch)

    def params(self) -> dict[str, Any]:
        return {**super().params(), "windows": self.layout}  # windows and shard sizes

    def legacy(self) -> dict[str, Any]:
        return {**super().legacy(), "windows": self.layout}

    def fields(self) -> str:
        return f"{super().fields()}, windows={self.windows}"

    def lane_windows(self) -> list[int]:
        return list(self.windows)


def parse_megatron_blend(blend: str | Sequence[str]) -> list[tuple[float, str]]:
    """Megatron-LM's ``--data-path`` blend (``"0.7 path_a 0.3 path_b"``, or its list of words)
    as ``[(weight, path), ...]``; a lone path (Megatron's unweighted form) weighs 1.

    Raises:
        MixtureError: An odd number of words, or a weight that is not a number.
    """
    words = blend.split() if isinstance(blend, str) else [str(w) for w in blend]
    if len(words) == 1:
        return [(1.0, words[0])]
    if not words or len(words) % 2:
        msg = f"a Megatron blend alternates weights and paths ('0.7 path_a 0.3 path_b'), got {words!r}"
        raise MixtureError(msg)
    out = []
    for i in range(0, len(words), 2):
        try:
            w = float(words[i])
        except ValueError:
            msg = f"word {i} of the blend, {words[i]!r}, is not a weight (blends read 'weight path ...')"
            raise MixtureError(msg) from None
        out.append((w, words[i + 1]))
    return out


def from_megatron_blend(
    blend: str | Sequence[str],
    *,
    open_source: Callable[[str], Any] | None = None,
    stop: str | int = "all_exhausted",
) -> MixtureDataset:
    """A :class:`MixtureDataset` from a Megatron blend string, each path opened by ``open_source``
    (default :class:`~smstore.SharedStoreDataset`).

    Megatron takes the weights as they are too (it normalises them), so the same blend gives the
    same proportions here, exactly, with no blend index built.
    """
    if open_source is None:
        from smstore.read.dataset import SharedStoreDataset

        open_source = SharedStoreDataset
    pairs = parse_megatron_blend(blend)
    return MixtureDataset([open_source(p) for _, p in pairs], [w for w, _ in pairs], stop=stop)
