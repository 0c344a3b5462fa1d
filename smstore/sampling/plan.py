"""The one planner: how much of an order a budget of shared memory holds, counted by the daemon's page rule.

Every sampler that holds data sizes its windows (or blocks) here, in whole pages of shared
memory as ``smstore serve --shm-limit`` counts them (``_core.shm_footprint``): a window of
shards, each source's windows of a mixture, the groups of blocks of a block order. :func:`fit`
is the rule they share: each lane first gets the fewest units it needs, then the rest of the
budget in proportion to its weight.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from smstore import _core
from smstore.sampling.orders import deal_stride, edge_gap

if TYPE_CHECKING:
    from smstore.format.manifest import Manifest

__all__ = [
    "check_room",
    "fit",
    "manifest_of",
    "plan_blocks",
    "plan_window",
    "plan_windows",
    "sharded_manifest",
]


def fit(budget: int, units: Sequence[int], weights: Sequence[Fraction | int], least: int) -> list[int] | None:
    """Units of each lane that fit ``budget`` bytes: ``least`` each, then the rest by weight.

    Lane ``l`` takes ``units[l]`` bytes a unit; it gets ``least + floor(rest * w_l / W / units[l])``
    units, ``rest`` being what the ``least`` units of every lane leave. ``None`` when the budget
    cannot hold ``least`` units of every lane.
    """
    need = sum(least * u for u in units)
    if budget < need or any(u <= 0 for u in units):
        return None
    rest = budget - need
    total = sum(weights) or 1
    return [
        least + math.floor(Fraction(rest) * Fraction(w) / Fraction(total) / u)
        for u, w in zip(units, weights, strict=True)
    ]


def manifest_of(dataset: Any) -> str | None:
    """The manifest's path of a SharedStoreDataset of a sharded dataset, else None."""
    path = getattr(dataset, "path", None)
    if not isinstance(path, str) or getattr(dataset, "shard_sizes", None) is None:
        return None
    from smstore.format.manifest import is_manifest

    return path if is_manifest(path) else None


def sharded_manifest(dataset: Any) -> Manifest:
    """The manifest of a sharded dataset: the one it keeps parsed (a dataset URL's: not fetched
    again), else read at its path; ``dataset`` may be the path itself."""
    from smstore.format.manifest import read_manifest

    kept = getattr(dataset, "manifest", None)
    return kept if kept is not None else read_manifest(getattr(dataset, "path", dataset))


def _largest_pages(manifest: Manifest) -> int:
    return max((_core.shm_footprint(s.file_size) for s in manifest.shards), default=0)


def plan_window(dataset: Any, budget: int) -> int:
    """:meth:`WindowedShuffleSampler.window_for`."""
    # Two windows, not fewer: at a switch the window just left stays held for the lag while the
    # one now read must be resident already; with less room it waits for that lag, which the
    # loop waiting on it never ends.
    largest = _largest_pages(sharded_manifest(dataset))
    counts = fit(budget, [2 * largest], [1], 1)
    if counts is None:
        msg = (
            f"a budget of {budget} bytes cannot hold two shards of up to {largest} bytes of shared memory "
            "(in whole pages, as the daemon counts them; the window being read and the next): raise it, "
            "or pack smaller shards (smstore pack --shard-size)"
        )
        raise ValueError(msg)
    return counts[0]


def plan_windows(sources: Sequence[Any], weights: Sequence[Fraction], budget: int) -> list[int]:
    """:meth:`WindowedMixtureSampler.windows_for`: a source without shards gets 1."""
    sharded = {s: sharded_manifest(x) for s, x in enumerate(sources) if manifest_of(x) is not None}
    # A manifest without shards holds nothing: its source reads one window of none.
    largest = {s: big for s, m in sharded.items() if (big := _largest_pages(m)) > 0}
    counts = fit(budget, [2 * big for big in largest.values()], [weights[s] for s in largest], 1)
    if counts is None:
        need = sum(2 * big for big in largest.values())
        msg = (
            f"a budget of {budget} bytes cannot hold two of the largest shards of every sharded source "
            f"({need} bytes of shared memory in whole pages, as the daemon counts them: each source's "
            "window being read and the next): raise it, or pack smaller shards (smstore pack --shard-size)"
        )
        raise ValueError(msg)
    windows = [1] * len(sources)
    for s, count in zip(largest, counts, strict=True):
        windows[s] = max(1, min(len(sharded[s].shards), count))
    return windows


def check_room(lanes: Sequence[tuple[Manifest, int]], limit: int, where: str) -> None:
    """Refuse windows that two at a time cannot fit a daemon's ``limit`` bytes (``--shm-limit``).

    Each lane (a sharded dataset, or a source of a mixture) keeps two windows of ``window`` shards
    resident: the one read, and the next, loading. If they cannot fit however the shards fall
    (the ``2 * window`` largest shards, in whole pages as the daemon counts them), the window read
    next can wait for room that the one read keeps until its readers move on, which they never do:
    the epoch stops. :func:`plan_window` and :func:`plan_windows` never choose such windows; a
    window picked by hand is checked here, once the daemon has said its limit.

    Raises:
        ValueError: The lanes' two windows need more than ``limit`` (``limit`` 0: no limit).
    """
    if limit <= 0:
        return
    need = 0
    for manifest, window in lanes:
        pages = sorted((_core.shm_footprint(s.file_size) for s in manifest.shards), reverse=True)
        need += sum(pages[: 2 * window])
    if need > limit:
        windows = ", ".join(str(w) for _m, w in lanes)
        msg = (
            f"{where}: two windows of {windows} shards need up to {need} bytes of shared memory (in whole "
            f"pages, as the daemon counts them), more than the daemon's --shm-limit of {limit}: the next "
            "window could not load beside the one being read, and the epoch would stop. Take the windows "
            "WindowedShuffleSampler.window_for(dataset, budget) or WindowedMixtureSampler.windows_for("
            "mixture, budget) give, or raise the daemon's --shm-limit"
        )
        raise ValueError(msg)


def _piece_pages(records: int, per_record: float, meta: int) -> int:
    """A piece of ``records`` records as the daemon holds it: a blob of them with its shard's
    ``meta`` bytes of metadata (``daemon.sources.Source.piece_size``), in whole pages."""
    return _core.shm_footprint(_core.blob_size(records, math.ceil(records * per_record), meta))


def _largest_meta(manifest: Manifest) -> int:
    """The most metadata a shard of `manifest` carries: what its file holds beyond records and index."""
    return max(
        (max(0, s.file_size - _core.blob_size(s.records, s.data_bytes)) for s in manifest.shards), default=0
    )


def plan_blocks(dataset: Any, budget: int, block_bytes: int) -> tuple[int, int]:
    """:meth:`BlockWindowSampler.plan`."""
    manifest = sharded_manifest(dataset)
    shard_records = [x.records for x in manifest.shards]
    records = sum(shard_records)
    per_record = max(1.0, sum(x.data_bytes for x in manifest.shards) / max(1, records))
    # 5 % over the average: a block of thousands of records strays far less from its mean.
    block = max(1, math.ceil(1.05 * block_bytes / per_record))
    longest = max((-(-x // max(1, x // block)) for x in shard_records), default=block)
    # Groups of one block each, and the rest of a block at each end (a group shares one with the next).
    meta = _largest_meta(manifest)
    ends = 2 * _piece_pages(longest, per_record, meta)
    counts = fit(budget - ends, [_piece_pages(block, per_record, meta)], [1], 4)
    if counts is None:
        held = max(0, (budget - ends) // _piece_pages(block, per_record, meta))
        msg = (
            f"a budget of {budget} bytes holds {held} groups of {block} records ({block_bytes} bytes) "
            f"beside two blocks of up to {longest} records; at least 4 are needed (the window's, the next, "
            "the previous and room for one released): raise the budget"
        )
        raise ValueError(msg)
    return block, neighbour_spread(counts[0] - 3, block)


def neighbour_spread(most: int, records: int) -> int:
    """The widest spread up to ``most`` whose step keeps source neighbours ``spread // 5`` windows
    apart, across a group's end too: where ``spread`` divides ``records - 1`` (or nearly), a
    group's last record and the next one's first land in adjacent windows for every step."""
    spread = most
    while spread > 1 and neighbour_gap(spread, records) < spread // 5:
        spread -= 1
    return spread


def neighbour_gap(spread: int, records: int) -> int:
    """The fewest windows between two records adjacent in a block, in groups of ``records`` dealt
    over ``spread`` windows (0: one window; docs/training.md, "The bound")."""
    stride = deal_stride(spread, records)
    return int(min(stride, spread - stride, int(edge_gap(spread, records, stride))))
