"""Mixtures: start-up with 100 sources of 10^9 records, and the cost of an index against GlobalShuffleSampler's.

    python benchmarks/bench_mixture.py               # writes benchmarks/results/mixture.md (~1 min on 2 cores)
    python benchmarks/bench_mixture.py --quick --out /tmp/m.md

Every figure is measured in this one run:

1. **Start-up**: building `Mixture` + `MixtureSampler` for 100 sources of 10^9 records each with
   random weights (median of `--repeats`), and the Python memory it allocates (tracemalloc peak),
   for 100 and for 1000 sources (O(sources)). Beside it, Megatron-LM's blend index
   (`build_blending_indices` in `megatron/core/datasets/helpers.cpp`, as documented there: for
   each sample, the dataset whose `weight * i - count` is largest, stored as a uint8 dataset
   index and an int64 sample index) computed by the same algorithm in Python at `--megatron-size`
   samples and extrapolated linearly to the 10^11 samples of one pass over the sources (its
   memory is 9 bytes a sample whatever the language; its time in C++ is lower than Python's, so
   the Python extrapolation is an upper bound on time, the memory an exact figure).
2. **Cost per index**: one rank's indices drawn through the sampler's own path (`iter(sampler)`,
   chunks of up to 65536) for a 100-source mixture and for a GlobalShuffleSampler over the same
   10^11 records, interleaved, best of `--repeats`. The same for `WindowedMixtureSampler` (each
   source 10^4 shards of 1000 records, windows of 4 shards), without residency and with its
   bookkeeping (holds sent to a no-op residency), against GlobalShuffleSampler again in the same
   loop; and the time from constructing it to its first index.
3. **Proportions over every prefix**, for the blend 0.5/0.3/0.2 and for 5 random weights, over
   `--prefix` positions: the largest `|count_s(n) - n w_s|` over every prefix `n` and source `s`,
   for smstore's order, Megatron's greedy index (its algorithm, above), Hugging Face
   `interleave_datasets(probabilities=...)` (the installed `datasets`, map-style, measured with
   its build time; skipped when not installed) and litdata's `CombinedStreamingDataset` draws
   (`random.Random(seed).choices(..., weights)` per sample, its `_CombinedDatasetIterator`,
   replayed in Python: litdata is a benchmark contender, not installed with the tests).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import random
import statistics
import time
import tracemalloc
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from bench_core import Report, command_line, log, machine_info, temp_dir, write_results, yes_no

from smstore.sampling import (
    GlobalShuffleSampler,
    Mixture,
    MixtureOrder,
    MixtureSampler,
    WindowedMixtureSampler,
)

SOURCES = 100
RECORDS = 10**9
# The windowed rows: sources of 10^7 records in 10^4 shards of 1000, windows of 4 shards.
WINDOWED_RECORDS, SHARD_RECORDS, WINDOW = 10**7, 1000, 4


def megatron_blend(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's build_blending_indices (helpers.cpp), line by line: greedy "most behind first"."""
    n = len(weights)
    dataset_index = np.zeros(size, dtype=np.uint8)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    current = [0] * n
    for i in range(size):
        denom = max(i, 1)
        best, best_error = 0, weights[0] * denom - current[0]
        for d in range(1, n):
            error = weights[d] * denom - current[d]
            if error > best_error:
                best, best_error = d, error
        dataset_index[i] = best
        dataset_sample_index[i] = current[best]
        current[best] += 1
    return dataset_index, dataset_sample_index


def startup(sources: int, weights: list[float], repeats: int) -> tuple[float, int]:
    """Median seconds to build the mixture and its sampler; tracemalloc peak bytes of one build."""
    times = []
    for _ in range(repeats):
        # The collector off while timed: a collection falling inside one build doubles its time.
        gc.collect()
        gc.disable()
        try:
            t = time.perf_counter()
            mix = Mixture([RECORDS] * sources, weights, stop=RECORDS * sources)
            MixtureSampler(mix, seed=1, rank=0, world_size=8)
            times.append(time.perf_counter() - t)
        finally:
            gc.enable()
    tracemalloc.start()
    mix = Mixture([RECORDS] * sources, weights, stop=RECORDS * sources)
    MixtureSampler(mix, seed=1, rank=0, world_size=8)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return statistics.median(times), peak


def worst_prefix(sources: np.ndarray, weights: list[float]) -> float:
    """max over prefixes n and sources s of |count_s(n) - n w_s|, for a sequence of source ids."""
    n = np.arange(1, len(sources) + 1, dtype=np.float64)
    worst = 0.0
    for s, w in enumerate(weights):
        counts = np.cumsum(sources == s, dtype=np.float64)
        worst = max(worst, float(np.abs(counts - n * w).max()))
    return worst


def hf_interleave(weights: list[float], size: int) -> tuple[np.ndarray, float] | str:
    """Source ids of HF interleave_datasets over `size` positions, and its build seconds."""
    try:
        import datasets
    except ImportError as e:
        return f"skipped: {e}"
    datasets.disable_progress_bars()
    parts = [datasets.Dataset.from_dict({"s": [s] * size}) for s in range(len(weights))]
    t = time.perf_counter()
    mixed = datasets.interleave_datasets(
        parts, probabilities=weights, seed=0, stopping_strategy="first_exhausted"
    )
    built = time.perf_counter() - t
    return np.asarray(mixed["s"][:size], dtype=np.int64), built


def litdata_draws(weights: list[float], size: int) -> np.ndarray:
    """litdata's CombinedStreamingDataset: one random.Random(seed).choices draw by weight per sample."""
    rng = random.Random(42)
    ids = list(range(len(weights)))
    return np.fromiter((rng.choices(ids, weights=weights, k=1)[0] for _ in range(size)), np.int64, size)


class NoResidency:
    """A residency that takes the holds and does nothing: the sampler's bookkeeping alone."""

    def __init__(self) -> None:
        self.holds = 0

    def hold(self, shards: tuple[int, ...], *, wait: bool = False) -> None:
        self.holds += 1

    def close(self) -> None:
        pass


def windowed_mixture(
    weights: list[float], residency: bool
) -> tuple[WindowedMixtureSampler, list[NoResidency]]:
    sources = len(weights)
    mix = Mixture([WINDOWED_RECORDS] * sources, weights, stop=WINDOWED_RECORDS * sources)
    shards = [[SHARD_RECORDS] * (WINDOWED_RECORDS // SHARD_RECORDS)] * sources
    holders = [NoResidency() for _ in range(sources)] if residency else []
    sampler = WindowedMixtureSampler(
        mix,
        window=WINDOW,
        shard_sizes=shards,
        seed=1,
        rank=0,
        world_size=1,
        residency=holders or False,
        lag=256,
    )
    return sampler, holders


def draw(sampler: GlobalShuffleSampler, count: int) -> float:
    """Seconds to draw `count` indices through the sampler's iterator."""
    t = time.perf_counter()
    for _ in itertools.islice(iter(sampler), count):
        pass
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "mixture.md")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--indices", type=int, default=2_000_000)
    ap.add_argument("--megatron-size", type=int, default=200_000)
    ap.add_argument("--prefix", type=int, default=1_000_000, help="positions for the proportion rows")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.indices, args.megatron_size, args.prefix = 3, 300_000, 20_000, 100_000
    started = time.perf_counter()
    rng = np.random.default_rng(0)
    weights = [float(x) for x in rng.random(SOURCES) + 0.01]
    report = Report()

    log("start-up")
    seconds, peak = startup(SOURCES, weights, args.repeats)
    report.add(
        f"start-up, {SOURCES} sources x 10^9 records (Mixture + MixtureSampler)",
        f"{seconds * 1e3:.1f} ms",
        goal="< 50 ms",
        met=yes_no(seconds < 0.05),
    )
    seconds_1k, peak_1k = startup(
        10 * SOURCES, [float(x) for x in rng.random(10 * SOURCES) + 0.01], args.repeats
    )
    report.add(f"start-up, {10 * SOURCES} sources x 10^9 records", f"{seconds_1k * 1e3:.1f} ms")
    report.add(
        "Python memory allocated at start-up (tracemalloc peak), 100 / 1000 sources",
        f"{peak / 1024:.0f} KiB / {peak_1k / 1024:.0f} KiB",
        goal="O(sources)",
        met=yes_no(peak_1k < 20 * peak),
    )
    mix = Mixture([RECORDS] * SOURCES, weights, stop=RECORDS * SOURCES)
    report.add(
        "proportion bound max_s E_s (abs(count_s(n) - n w_s) <= E_s for every n)",
        f"{max(mix.deviation_bounds()):.3f}",
    )

    log("megatron blend index")
    total = float(sum(weights))
    t = time.perf_counter()
    megatron_blend([w / total for w in weights], args.megatron_size)
    mt = time.perf_counter() - t
    full = RECORDS * SOURCES
    report.add(
        f"Megatron blend index, {args.megatron_size} samples (its algorithm, in Python)",
        f"{mt * 1e3:.0f} ms",
    )
    report.add(
        "Megatron blend index extrapolated to 10^11 samples",
        f"{mt / args.megatron_size * full / 3600:.0f} h in Python; {9 * full / 2**30:.0f} GiB (9 bytes a sample)",
        baseline=f"{seconds * 1e3:.1f} ms, {peak / 1024:.0f} KiB (smstore)",
    )

    log("cost per index")
    gss = GlobalShuffleSampler(full, seed=1, rank=0, world_size=1)
    mixs = MixtureSampler(mix, seed=1, rank=0, world_size=1)
    best = {"gss": float("inf"), "mix": float("inf")}
    for _ in range(args.repeats):
        best["gss"] = min(best["gss"], draw(gss, args.indices))
        best["mix"] = min(best["mix"], draw(mixs, args.indices))
    g, m = best["gss"] / args.indices * 1e9, best["mix"] / args.indices * 1e9
    report.compare(
        f"cost per index, {SOURCES}-source mixture vs GlobalShuffleSampler (iter, {args.indices} indices)",
        f"{m:.0f} ns",
        f"{g:.0f} ns",
        m / g,
        "<= 2x",
        m / g <= 2,
    )
    two = MixtureSampler(Mixture([RECORDS] * 2, [0.7, 0.3], stop=2 * RECORDS), seed=1, rank=0, world_size=1)
    best2 = min(draw(two, args.indices) for _ in range(args.repeats)) / args.indices * 1e9
    report.compare(
        "cost per index, 2-source mixture (0.7/0.3)",
        f"{best2:.0f} ns",
        f"{g:.0f} ns",
        best2 / g,
        "<= 2x",
        best2 / g <= 2,
    )
    log("cost per index, windowed mixtures")
    t = time.perf_counter()
    wide, _ = windowed_mixture(weights, residency=False)
    next(iter(wide))
    first = time.perf_counter() - t
    narrow, _ = windowed_mixture([0.7, 0.3], residency=False)
    held, holders = windowed_mixture(weights, residency=True)
    # GlobalShuffleSampler again, interleaved with these rows: the ratio is of one stretch of time.
    wbest = {"gss": float("inf"), "wide": float("inf"), "narrow": float("inf"), "held": float("inf")}
    for _ in range(args.repeats):
        wbest["gss"] = min(wbest["gss"], draw(gss, args.indices))
        wbest["wide"] = min(wbest["wide"], draw(wide, args.indices))
        wbest["narrow"] = min(wbest["narrow"], draw(narrow, args.indices))
        wbest["held"] = min(wbest["held"], draw(held, args.indices))
    per = {k: v / args.indices * 1e9 for k, v in wbest.items()}
    shape = f"10^4 shards of {SHARD_RECORDS} records a source, window {WINDOW}"
    for key, name in [
        ("wide", f"cost per index, {SOURCES}-source windowed mixture ({shape}) vs GlobalShuffleSampler"),
        ("narrow", "cost per index, 2-source windowed mixture (0.7/0.3)"),
        ("held", f"cost per index, {SOURCES}-source windowed mixture with residency (holds to a no-op)"),
    ]:
        ratio = per[key] / per["gss"]
        report.compare(name, f"{per[key]:.0f} ns", f"{per['gss']:.0f} ns", ratio, "<= 2x", ratio <= 2)
    report.add(
        f"windowed mixture, {SOURCES} sources x 10^4 shards: construction to the first index",
        f"{first * 1e3:.0f} ms",
    )
    log("proportions over every prefix")
    blends = {"0.5/0.3/0.2": [0.5, 0.3, 0.2], "5 random weights": [float(x) for x in rng.random(5) + 0.05]}
    for name, blend in blends.items():
        w = [x / sum(blend) for x in blend]
        k = args.prefix
        mine = Mixture([k] * len(w), w, stop=k)
        src, _ = MixtureOrder(mine, seed=1, epoch=0).pairs(np.arange(k, dtype=np.int64))
        ours = worst_prefix(src, w)
        m_size = min(k, args.megatron_size)
        meg = worst_prefix(megatron_blend(w, m_size)[0].astype(np.int64), w)
        lit = worst_prefix(litdata_draws(w, k), w)
        hf = hf_interleave(w, k)
        hf_cell = hf if isinstance(hf, str) else f"{worst_prefix(hf[0], w):.1f} (built in {hf[1]:.2f} s)"
        report.add(
            f"worst abs(count_s(n) - n w_s) over every prefix, {name}, {k} positions: smstore / bound",
            f"{ours:.2f} / {max(mine.deviation_bounds()):.2f}",
            baseline=f"Megatron {meg:.2f} ({m_size} positions); HF interleave {hf_cell}; litdata draws {lit:.1f}",
        )
    report.notes += [
        (
            "The mixture's order is one C++ call per chunk, like GlobalShuffleSampler's: the tree descent "
            "(16 positions at a time, without branches, one multiply per division) then the source's "
            "Feistel permutation for the draw's pass (kept per source while its pass lasts)."
        ),
        (
            "The windowed mixture is the same C++ call per chunk, with each source pass's windowed order "
            "(window, Feistel permutation within it, shard) in place of its permutation. With residency, "
            f"chunks are at most 4096 indices and each source's windows move every {SHARD_RECORDS * WINDOW} "
            f"of its draws ({sum(h.holds for h in holders) // args.repeats} holds sent in each run of "
            f"{args.indices} indices of the row with residency); the "
            "first index builds no table of the epoch: each source's shard order is computed when its pass "
            "is first reached."
        ),
        (
            "Megatron's index is built once per (blend, size) and cached on disk; its time in C++ is "
            "roughly 100x below the Python figure, its memory is what is shown."
        ),
        (
            "The prefix rows: smstore's and Megatron's orders stay within a constant of every weight on every "
            "prefix; random draws by weight (HF interleave_datasets with probabilities, litdata) drift like a "
            "random walk, about sqrt(n w (1 - w)) after n positions, so their worst prefix grows with the run."
        ),
    ]
    with temp_dir(None) as tmp:
        header = machine_info(tmp)
    cmd = command_line("python benchmarks/bench_mixture.py", argv)
    write_results(
        args.out,
        "Mixtures",
        [
            f"`{cmd}` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {time.perf_counter() - started:.0f} s."
        ],
        header,
        report,
    )


if __name__ == "__main__":
    main()
