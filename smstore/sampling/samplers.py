"""The public samplers beside GlobalShuffleSampler: constructors of the one sampler for another order.

Each builds its order's spec and the residency its order drives (from the dataset: its socket,
mode and parsed manifest) and hands them to :class:`~smstore.GlobalShuffleSampler`, which does
everything else; beside that, each has only its planner (a budget's windows or blocks).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from smstore.errors import MixtureError
from smstore.sampling.mixture import Mixture, MixtureDataset, MixtureSpec, WindowedMixtureSpec
from smstore.sampling.orders import BlockSpec, BlockWindowOrder, WindowedSpec
from smstore.sampling.plan import plan_blocks, plan_window, plan_windows
from smstore.sampling.sampler import GlobalShuffleSampler, residency_of
from smstore.sampling.schedule import MixtureSchedule, ScheduledMixtureDataset, ScheduleSpec
from smstore.wire.blocks import Piece

__all__ = ["BlockWindowSampler", "MixtureSampler", "WindowedMixtureSampler", "WindowedShuffleSampler"]


class WindowedShuffleSampler(GlobalShuffleSampler):
    """A shuffle over a sharded dataset that reads only a window of shards at a time.

    **The order.** For epoch ``e``, the shards are put in a random order keyed by ``(seed, e)``;
    windows are runs of ``window`` consecutive shards of that order; the records of each window
    are shuffled among themselves, and the windows follow each other (:class:`WindowedOrder`).
    As with :class:`GlobalShuffleSampler`, the global order does not depend on the world size,
    rank ``r`` of ``W`` yields positions ``r, r + W, ...`` of it (so every rank reads the same
    window at the same time), padding and ``drop_last`` work the same, and ``state_dict`` /
    ``load_state_dict`` resume in O(1) with any world size. ``window`` equal to the number of
    shards is an exact global shuffle of the records (by another permutation than
    GlobalShuffleSampler's). docs/training.md measures how close other windows come.

    **Residency.** Over a :class:`~smstore.SharedStoreDataset` of a sharded dataset, the sampler
    tells the node which shards it needs as its order reaches them (:class:`Residency`):
    the window it reads, the next one (loaded in the background while this one is read) and, for
    the first ``lag`` samples of a window, the previous one (DataLoader workers are still reading
    it: they run up to ``prefetch_factor * num_workers`` batches behind the sampler). With a
    daemon, it loads held shards into shared memory within ``--shm-limit`` and drops them when no
    rank holds them; without one, the files are read ahead into the page cache. Readers release
    a shard they stopped reading on their own (``ShardedStore.auto_release``), so memory stays
    near two windows.

    Args:
        dataset: A dataset with ``shard_sizes`` (``SharedStoreDataset``), or the shard sizes.
        window: Shards per window (see :meth:`window_for` to fit a memory budget).
        seed: Any integer; the same on every rank.
        rank: This rank (default: from torch.distributed or ``RANK``).
        world_size: The number of ranks (default: found like ``rank``).
        drop_last: Drop the tail that does not divide evenly instead of padding.
        residency: ``None`` (default): manage residency when ``dataset`` is a sharded
            SharedStoreDataset; ``False``: never; or a :class:`Residency` to use.
        lag: Samples of this rank during which the previous window stays held; at least
            ``prefetch_factor * num_workers * batch_size`` (a shard released too early is read
            from its file, correctly but more slowly).
    """

    def __init__(
        self,
        dataset: Any,
        *,
        window: int,
        seed: int,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        residency: Any = None,
        lag: int = 8192,
    ) -> None:
        sizes = _shard_sizes(dataset)
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            msg = f"window must be a positive number of shards, not {window!r}"
            raise ValueError(msg)
        spec = WindowedSpec(sizes, min(window, max(1, len(sizes))))
        if residency is None:
            residency = residency_of(dataset)
        self._configure(
            spec,
            seed=seed,
            rank=rank,
            world_size=world_size,
            drop_last=drop_last,
            residencies=[residency],
            lag=lag,
        )
        self.shard_sizes = list(sizes)
        self.window = spec.window
        windows = -(-len(sizes) // self.window)
        average = self.num_records // max(1, windows)
        if self.residency is not None and windows > 1 and 2 * self.lag * self.world_size > average:
            warnings.warn(
                f"WindowedShuffleSampler: lag={self.lag} samples a rank ({self.lag * self.world_size} in all) "
                f"is more than half of an average window ({average} samples): the previous window stays "
                "held through most of the next, and the window after it starts loading late (under a "
                "budget of two windows, at its own start). Pass a lag of at least prefetch_factor * "
                f"num_workers * batch_size and below {average // (2 * self.world_size)}, or larger windows.",
                stacklevel=2,
            )

    @staticmethod
    def window_for(dataset: Any, budget: int) -> int:
        """The most shards a window can have so that two windows (the one read and the next)
        fit in `budget` bytes of shared memory, however the shards fall: the budget of
        ``smstore serve --shm-limit``, counted as the daemon counts it (each shard in whole pages).

        Raises:
            ValueError: The budget cannot hold two of the largest shards.
        """
        return plan_window(dataset, budget)


class BlockWindowSampler(GlobalShuffleSampler):
    """A shuffle over a sharded dataset larger than memory that holds **blocks** (record ranges), not shards.

    **The order** is :class:`BlockWindowOrder` keyed by ``(seed, epoch)`` with groups of
    ``block`` records: each shard is cut into blocks of at least ``block`` records (never across a
    shard's end), the blocks put in a keyed order, each group's records dealt evenly over the
    ``spread`` windows from its own (source neighbours far apart), and each window shuffled
    exactly (docs/training.md, "Block windows"). As with
    :class:`GlobalShuffleSampler`, the order does not depend on the world size, rank ``r`` of
    ``W`` yields positions ``r, r + W, ...``, and ``state_dict`` / ``load_state_dict`` resume in
    O(1) at any world size.

    **Residency.** While window ``w`` is read, the blocks of groups ``w - spread + 1 .. w`` are
    needed and group ``w + 1``'s are loading (while the memory fills, the first ``spread``
    windows, the groups up to ``spread + 1`` are held from the start); the blocks of every window
    among this rank's last ``lag`` samples stay held too (the previous window's, for the first
    ``lag`` samples of a window; more where windows are shorter, as at the epoch's end).
    The sampler holds those blocks (each a :class:`smstore.wire.protocol.Piece` of one shard, with
    the one :class:`~smstore.Residency`, as windows of shards are held), so a daemon loads each one
    once an epoch, in one sequential read, within its ``--shm-limit``, and drops it when no rank
    holds it; without a daemon their bytes are read ahead into the page cache. Readers read
    records through :class:`smstore.wire.blocks.BlockReader` (``keep=sampler.keep``).

    Args:
        dataset: A SharedStoreDataset of a sharded dataset (or anything with ``shard_sizes`` and
            the manifest's ``path``), or the shard sizes (no residency then).
        block: Records per block, at least, and per group (see :meth:`plan` for blocks of at
            least 4 MiB within a budget).
        spread: Windows each block's records are spread over (at least 1).
        seed: Any integer; the same on every rank.
        rank: This rank (default: from torch.distributed or ``RANK``).
        world_size: The number of ranks (default: found like ``rank``).
        drop_last: Drop the tail that does not divide evenly instead of padding.
        residency: ``None`` (default): a :class:`~smstore.Residency` when ``dataset`` names a
            manifest; ``False``: none; or one to use.
        lag: Samples of this rank whose blocks stay held after the sampler moved past them: at
            least ``prefetch_factor * num_workers * batch_size``, the most a DataLoader's workers
            read behind it (a block released under a worker still to read it is fetched again).
    """

    def __init__(
        self,
        dataset: Any,
        *,
        block: int,
        spread: int,
        seed: int,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        residency: Any = None,
        lag: int = 1024,
    ) -> None:
        sizes = _shard_sizes(dataset)
        for name, value in (("block", block), ("spread", spread)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                msg = f"{name} must be a positive integer, not {value!r}"
                raise ValueError(msg)
        if residency is None:
            residency = residency_of(dataset)
        self._configure(
            BlockSpec(sizes, block, spread),
            seed=seed,
            rank=rank,
            world_size=world_size,
            drop_last=drop_last,
            residencies=[residency],
            lag=lag,
        )
        self.shard_sizes = list(sizes)
        self.block, self.spread = block, spread
        # Pieces a reader keeps mapped: the blocks held (spread + 2 groups, and a block at each
        # end that a group shares with the next), one piece each, twice over for the windows in flight.
        self.keep = 2 * (spread + 4)

    @staticmethod
    def plan(dataset: Any, budget: int, *, block_bytes: int = 4 << 20) -> tuple[int, int]:
        """``(block, spread)`` for blocks of at least `block_bytes` (5 % over, on average) within `budget` bytes.

        What is held at once (``spread + 2`` groups of ``block`` records: the window's, the next
        and one in the lag; and the rest of a block at each end, which a group shares with the
        next, at most the longest block) and one group's room more fill the budget, with each
        piece's header, index, its shard's metadata and page rounding, as the daemon counts a
        piece. The room is for the block the lag released: its pages count until every reader has
        unmapped it (at its next new block), and the next block's load should not wait for that. The spread, and with it the shards a batch draws
        from, grows with the budget over the block size (docs/training.md, "Block windows"); it is
        the widest that fits whose deal keeps source neighbours ``spread // 5`` windows apart
        (1 to 3 narrower in about 1 % of cases), so they never share a batch of
        ``(spread // 5 - 1) * block + 1`` positions past the fill.

        Raises:
            ValueError: The budget holds fewer than four groups and the blocks at the ends.
        """
        return plan_blocks(dataset, budget, block_bytes)

    def held_blocks(self, position: int) -> list[int]:
        """The blocks held while ``position`` of the epoch's order is read (lag not counted), in
        load order (:meth:`BlockWindowOrder.held_blocks`)."""
        order: BlockWindowOrder = self.permutation()
        return order.held_blocks(position)

    def piece(self, b: int) -> Piece:
        """Block ``b`` as the daemon holds it: a :class:`smstore.wire.blocks.Piece` of its shard."""
        order: BlockWindowOrder = self.permutation()
        return order.piece(b)


class MixtureSampler(GlobalShuffleSampler):
    """A mixture epoch split across ranks, resumable in O(1) with any world size.

    Everything :class:`~smstore.GlobalShuffleSampler` promises holds, with the mixture's order
    (:class:`MixtureOrder`) in place of the permutation: rank ``r`` of ``W`` yields positions
    ``r, r + W, ...`` of the epoch's ``len(mixture)`` positions, as global indices into the
    concatenation of the sources (:class:`MixtureDataset` reads them; :meth:`locate` splits one);
    padding, ``drop_last``, ``set_epoch``, ``state_dict`` / ``load_state_dict`` (O(1), any world
    size), :class:`~smstore.ResumableLoader`, ``StatefulDataLoader`` and the frameworks (it is a
    ``DistributedSampler``) behave the same. The state adds the mixture's digest, so a state saved
    for other sources, weights or stopping rule is refused.

    **Schedules.** Given a :class:`MixtureSchedule` (or a :class:`ScheduledMixtureDataset`), the
    weights change at the schedule's phase starts; every source keeps one stream of draws across
    the switches, each phase keeps its mixture's exact-prefix bound, and all of the above holds
    unchanged (the state names the schedule, so a state saved under another one is refused).

    Args:
        mixture: A :class:`MixtureDataset`, a :class:`Mixture`, a :class:`ScheduledMixtureDataset`
            or a :class:`MixtureSchedule`.
        seed: Any integer; the same on every rank.
        rank: This rank (default: from torch.distributed or ``RANK``).
        world_size: The number of ranks (default: found like ``rank``).
        drop_last: Drop the tail that does not divide evenly instead of padding.
    """

    def __init__(
        self,
        mixture: Mixture | MixtureDataset | MixtureSchedule,
        *,
        seed: int,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
    ) -> None:
        self.mixture: Mixture | MixtureSchedule = _mixture_of(mixture, type(self).__name__, schedules=True)
        mix = self.mixture
        spec = MixtureSpec(mix) if isinstance(mix, Mixture) else ScheduleSpec(mix)
        self._configure(spec, seed=seed, rank=rank, world_size=world_size, drop_last=drop_last)

    def locate(self, index: int) -> tuple[int, int]:
        """``(source, index in source)`` of a global index this sampler yielded."""
        offsets = self.mixture.offsets
        import bisect

        s = bisect.bisect_right(offsets, index) - 1
        if not 0 <= s < len(self.mixture.lengths):
            msg = f"index {index} out of range for a mixture of {offsets[-1]} records"
            raise IndexError(msg)
        return s, index - offsets[s]


class WindowedMixtureSampler(MixtureSampler):
    """A mixture of sharded datasets larger than memory: each source read through windows of its shards.

    **The order.** Which source each position draws from is the mixture's rule, unchanged (the
    same exact proportions and bound); the record is the next of that source's own windowed
    order (:class:`WindowedMixtureOrder`): its shards in a keyed random order, cut into windows
    of ``window`` shards, records shuffled within each window. A source drawn past its length
    (upsampling) starts its next pass with a new shard order, independently of the others. The
    order is a pure function of ``(seed, epoch, weights, lengths, shard sizes, windows)``: the
    same for every world size, split across ranks, padded and resumed in O(1) at any world size
    exactly as :class:`MixtureSampler` does.

    **Residency.** For each source with a :class:`~smstore.Residency` (by default every
    :class:`~smstore.SharedStoreDataset` of a sharded dataset among a :class:`MixtureDataset`'s
    sources), the sampler holds the window it reads, the next one and, for ``lag`` samples of
    this rank after a window ends, the previous one: the daemon keeps one window per source
    resident and loads the next ones in the background, all within its ``--shm-limit``; without a
    daemon the files are read ahead into the page cache. Memory: with ``L_s`` the largest shard
    of source ``s`` (in whole pages, as ``--shm-limit`` counts it), the windows held take at most
    ``sum_s 2 * window_s * L_s`` bytes (three windows of a source during its lag);
    :meth:`windows_for` picks windows that fit a budget.

    Args:
        mixture: A :class:`MixtureDataset` (shard sizes and residency found from its sources) or
            a :class:`Mixture` (give ``shard_sizes``).
        window: Shards per window: one number for every source, or one per source.
        seed: Any integer; the same on every rank.
        rank: This rank (default: from torch.distributed or ``RANK``).
        world_size: The number of ranks (default: found like ``rank``).
        drop_last: Drop the tail that does not divide evenly instead of padding.
        shard_sizes: Per source, its shards' record counts, or ``None`` for a source without
            shards (default: each source's ``shard_sizes``).
        residency: ``None`` (default): a :class:`~smstore.Residency` for each sharded
            SharedStoreDataset source; ``False``: none; or one per source (``None`` for none).
        lag: Samples of this rank during which the windows just left stay held; at least
            ``prefetch_factor * num_workers * batch_size``.

    Raises:
        MixtureError: Shard sizes that do not add up to a source's length, or a window or
            list of them that does not fit the sources.
    """

    def __init__(
        self,
        mixture: Mixture | MixtureDataset,
        *,
        window: int | Sequence[int],
        seed: int,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        shard_sizes: Sequence[Sequence[int] | None] | None = None,
        residency: Any = None,
        lag: int = 8192,
    ) -> None:
        self.mixture = mix = _mixture_of(mixture, type(self).__name__, schedules=False)
        lengths = mix.lengths
        sources = mixture.sources if isinstance(mixture, MixtureDataset) else None
        if shard_sizes is None:
            shard_sizes = (
                [getattr(x, "shard_sizes", None) for x in sources] if sources else [None] * len(lengths)
            )
        if len(shard_sizes) != len(lengths):
            msg = f"{len(shard_sizes)} lists of shard sizes for {len(lengths)} sources: give one per source"
            raise MixtureError(msg)
        self.shard_sizes: list[np.ndarray[Any, np.dtype[np.int64]]] = []
        for s, (given, n) in enumerate(zip(shard_sizes, lengths, strict=True)):
            sizes = np.asarray([n] if given is None else given, dtype=np.int64).ravel()
            if (sizes < 0).any() or int(sizes.sum()) != n:
                msg = f"source {s}: its shard sizes add up to {int(sizes.sum())} records, but it has {n}"
                raise MixtureError(msg)
            self.shard_sizes.append(sizes)
        wanted = [window] * len(lengths) if not isinstance(window, Sequence) else list(window)
        if len(wanted) != len(lengths) or any(
            isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 1 for w in wanted
        ):
            msg = f"window={window!r}: give a positive number of shards, or one per source ({len(lengths)})"
            raise MixtureError(msg)
        self.windows = [min(int(w), len(sizes)) for w, sizes in zip(wanted, self.shard_sizes, strict=True)]
        self._configure(
            WindowedMixtureSpec(mix, self.shard_sizes, self.windows),
            seed=seed,
            rank=rank,
            world_size=world_size,
            drop_last=drop_last,
            residencies=_residencies(residency, sources, len(lengths)),
            lag=lag,
        )
        shortest = _shortest_held_window(mix, self.shard_sizes, self.windows, self.residencies)
        if shortest is not None and 2 * self.lag * self.world_size > shortest:
            warnings.warn(
                f"WindowedMixtureSampler: lag={self.lag} samples a rank ({self.lag * self.world_size} in all) "
                f"is more than half of a source's average window ({shortest:.0f} positions of the mixture): "
                "the previous window stays held through most of the next. Pass a lag of at least "
                "prefetch_factor * num_workers * batch_size and below that, or larger windows.",
                stacklevel=2,
            )

    @staticmethod
    def windows_for(dataset: MixtureDataset, budget: int) -> list[int]:
        """Shards per window for each source so that every sharded source's window and next one fit
        in ``budget`` bytes together: ``sum_s 2 * window_s * L_s <= budget`` (``L_s`` its largest
        shard in whole pages of shared memory, as the daemon's ``--shm-limit`` counts it). Each
        sharded source gets one shard a window, then the rest of the budget in proportion to the
        weights (a source read faster gets longer windows); a source without shards gets 1.

        Raises:
            ValueError: The budget cannot hold two of the largest shards of every sharded source.
        """
        mixture = _mixture_of(dataset, "WindowedMixtureSampler.windows_for", schedules=False)
        return plan_windows(dataset.sources, mixture.weights, budget)


def _mixture_of(mixture: Any, name: str, *, schedules: bool) -> Any:
    """The Mixture (or, where ``schedules``, the MixtureSchedule) a sampler draws."""
    mix: Any = mixture
    if isinstance(mixture, ScheduledMixtureDataset):
        mix = mixture.schedule
    elif isinstance(mixture, MixtureDataset):
        mix = mixture.mixture
    if isinstance(mix, MixtureSchedule) and not schedules:
        msg = (
            f"{name} draws one mixture's weights, not a schedule's: use MixtureSampler for a schedule "
            "(its sources read whole), or one windowed sampler per phase"
        )
        raise MixtureError(msg)
    if not isinstance(mix, (Mixture, MixtureSchedule)):
        kinds = "a Mixture, a MixtureDataset or a schedule" if schedules else "a Mixture or a MixtureDataset"
        msg = f"{name} needs {kinds}, not {type(mixture).__name__}"
        raise TypeError(msg)
    return mix


def _residencies(residency: Any, sources: list[Any] | None, count: int) -> list[Any]:
    """One residency per source: each sharded SharedStoreDataset's own (``None``), none (``False``) or those given."""
    if residency is False:
        return [None] * count
    if residency is None:
        return [residency_of(x) for x in sources] if sources else [None] * count
    given = list(residency)
    if len(given) != count:
        msg = f"{len(given)} residencies for {count} sources: give one per source (None for none)"
        raise MixtureError(msg)
    return [r or None for r in given]


def _shortest_held_window(
    mixture: Mixture, shard_sizes: Sequence[Any], windows: Sequence[int], residencies: Sequence[Any]
) -> float | None:
    """The shortest average window (in positions of the mixture) of a held source with more than one window."""
    return min(
        (
            mixture.lengths[s] * w / len(sizes) / float(mixture.weights[s])
            for s, (sizes, w, r) in enumerate(zip(shard_sizes, windows, residencies, strict=True))
            if r is not None and len(sizes) > w
        ),
        default=None,
    )


def _shard_sizes(dataset: Any) -> tuple[int, ...]:
    """The shard sizes of a sharded dataset (its ``shard_sizes``), or the sizes themselves."""
    sizes = tuple(int(x) for x in (dataset if isinstance(dataset, (list, tuple)) else dataset.shard_sizes))
    if any(x < 0 for x in sizes):
        msg = "shard sizes must be >= 0"
        raise ValueError(msg)
    return sizes
