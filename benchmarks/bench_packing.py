"""Packing: the padding of best-fit vs first-fit vs none, and the speed of PackedBins.

    python benchmarks/bench_packing.py               # writes benchmarks/results/packing.md (~2 min on 2 cores)
    python benchmarks/bench_packing.py --quick --out /tmp/p.md

Every figure is measured in this one run:

1. **Padding**: documents of log-normal lengths (median 700 tokens, `--sigma` of the log, seeded:
   the distribution shipped with this benchmark) packed into bins of `--length` 4096 tokens,
   `--group` documents at a time, by `smstore.read.packing.pack_lengths` with the same bounded
   buffer of open bins for first-fit and best-fit (`--open-bins`, each size a row); "none" is one
   document per bin, truncated (its lost tokens are shown). Padding is pad tokens / bin tokens.
   One more row per sigma: first-fit whose buffer closes its oldest bin (FIFO) instead of the fullest.
   Goal (issue 39): best-fit's padding at most 0.73x first-fit's.
2. **Speed**: `pack_lengths` in documents/s; `PackedBins` over a blob of `--blob-docs` such
   documents (uint16) in groups of `--speed-group`: construction (every group packed once to count its bins, no token read)
   and its Python memory peak (tracemalloc), then bins/s read in stored order, in
   `WindowedShuffleSampler(bins.group_sizes, window=2)` order (each group packed once) and in
   `GlobalShuffleSampler` order (a group repacked for most bins), against `TokenWindows` reads of
   the same tokens in the same loop (interleaved, best of `--repeats`).
"""

from __future__ import annotations

import argparse
import itertools
import time
import tracemalloc
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from bench_core import Report, command_line, log, machine_info, temp_dir, write_results

import smstore
from smstore.read.packing import PackedBins, pack_lengths

MEDIAN = 700


def lengths_of(count: int, sigma: float, seed: int) -> np.ndarray:
    """The shipped distribution: log-normal document lengths of median 700 tokens, at least 1."""
    rng = np.random.default_rng(seed)
    return np.maximum(1, rng.lognormal(np.log(MEDIAN), sigma, count)).astype(np.int64)


def padding(
    lengths: np.ndarray, length: int, group: int, open_bins: int, algorithm: str, close: str = "fullest"
) -> tuple[float, int]:
    """(padding fraction, bins) of packing `lengths` group by group."""
    bins = 0
    for first in range(0, len(lengths), group):
        _, starts = pack_lengths(
            lengths[first : first + group], length, open_bins=open_bins, algorithm=algorithm, close=close
        )
        bins += len(starts) - 1
    return 1 - int(lengths.sum()) / (bins * length), bins


def rate(items: int, fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return items / (time.perf_counter() - t)


def read_all(ds: object, order: Sequence[int]) -> None:
    for k in order:
        ds[k]  # type: ignore[index]


def bench_padding(report: Report, args: argparse.Namespace) -> None:
    for sigma in args.sigma:
        lengths = lengths_of(args.docs, sigma, args.seed)
        clipped = np.minimum(lengths, args.length)
        none = 1 - int(clipped.sum()) / (len(lengths) * args.length)
        lost = 1 - int(clipped.sum()) / int(lengths.sum())
        report.add(
            f"padding, none (a document a bin, truncated), sigma {sigma}",
            f"{none:.1%}",
            baseline=f"{lost:.1%} of tokens truncated away",
        )
        for open_bins in args.open_bins:
            ff, ff_bins = padding(lengths, args.length, args.group, open_bins, "first-fit")
            bf, bf_bins = padding(lengths, args.length, args.group, open_bins, "best-fit")
            report.compare(
                f"padding, best-fit vs first-fit, sigma {sigma}, {open_bins} open bins, groups of {args.group}",
                f"{bf:.3%} ({bf_bins} bins)",
                f"{ff:.3%} ({ff_bins} bins)",
                bf / ff,
                "<= 0.73x",
                bf <= 0.73 * ff,
            )
        open_bins = args.open_bins[0]
        if sigma == args.sigma[0]:  # the groups' ends: one group of every document
            whole_bf, whole_bf_bins = padding(lengths, args.length, len(lengths), open_bins, "best-fit")
            whole_ff, whole_ff_bins = padding(lengths, args.length, len(lengths), open_bins, "first-fit")
            report.compare(
                f"padding, best-fit vs first-fit, sigma {sigma}, {open_bins} open bins, one group of all "
                f"{len(lengths)} documents",
                f"{whole_bf:.3%} ({whole_bf_bins} bins)",
                f"{whole_ff:.3%} ({whole_ff_bins} bins)",
                whole_bf / whole_ff,
                "<= 0.73x",
                whole_bf <= 0.73 * whole_ff,
            )
        bf, bf_bins = padding(lengths, args.length, args.group, open_bins, "best-fit")
        fifo, fifo_bins = padding(lengths, args.length, args.group, open_bins, "first-fit", "oldest")
        report.compare(
            f"padding, best-fit vs first-fit closing its oldest bin (a FIFO buffer), sigma {sigma}, "
            f"{open_bins} open bins",
            f"{bf:.3%} ({bf_bins} bins)",
            f"{fifo:.3%} ({fifo_bins} bins)",
            bf / fifo,
            "<= 0.73x",
            bf <= 0.73 * fifo,
        )


def bench_speed(report: Report, args: argparse.Namespace, tmp: Path) -> None:
    sigma = args.sigma[0]
    lengths = lengths_of(args.docs, sigma, args.seed)
    docs_per_s = rate(
        args.docs, lambda: padding(lengths, args.length, args.group, args.open_bins[0], "best-fit")
    )
    report.add(
        f"pack_lengths, best-fit, {args.open_bins[0]} open bins",
        f"{docs_per_s / 1e3:.0f} k documents/s",
    )
    rng = np.random.default_rng(args.seed + 1)
    blob = tmp / "docs.smst"
    smstore.pack_arrays(
        (rng.integers(1, 50000, int(n), dtype=np.uint16) for n in lengths[: args.blob_docs]),
        blob,
        durable=False,
    )
    tracemalloc.start()
    t = time.perf_counter()
    bins = PackedBins(blob, args.length, eod=0, group=args.speed_group, open_bins=args.open_bins[0])
    built = time.perf_counter() - t
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    report.add(
        f"PackedBins construction, {args.blob_docs} documents, {bins.tokens / 1e6:.0f} M tokens, "
        f"{len(bins)} bins in {len(bins.group_sizes)} groups of {args.speed_group}",
        f"{built * 1e3:.0f} ms",
        baseline=f"Python memory peak {peak / 2**20:.1f} MiB (tokens {bins.tokens * 2 / 2**20:.0f} MiB)",
    )
    windows = smstore.TokenWindows(blob, args.length - 1, eod=0)
    n = min(len(bins), len(windows), args.reads)
    stored = list(range(n))
    windowed = list(
        itertools.islice(
            smstore.WindowedShuffleSampler(list(bins.group_sizes), window=2, seed=1, rank=0, world_size=1), n
        )
    )
    shuffled = list(
        itertools.islice(smstore.GlobalShuffleSampler(len(bins), seed=1, rank=0, world_size=1), n)
    )
    orders = {"stored": stored, "windowed (2 groups)": windowed, "global shuffle": shuffled}
    best = dict.fromkeys(["windows", *orders], 0.0)
    for _ in range(args.repeats):  # interleaved, best of: the first pass also faults the pages in
        best["windows"] = max(best["windows"], rate(n, lambda: read_all(windows, stored)))
        for name, order in orders.items():
            best[name] = max(best[name], rate(n, lambda order=order: read_all(bins, order)))
    base = best["windows"]
    for name in orders:
        got = best[name]
        report.add(
            f"PackedBins bins/s ({args.length} tokens, padded), {name} order",
            f"{got / 1e3:.1f} k bins/s",
            baseline=f"TokenWindows {base / 1e3:.1f} k samples/s in stored order",
            ratio=f"{got / base:.2f}x",
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "packing.md")
    ap.add_argument("--quick", action="store_true", help="fewer documents and reads (seconds)")
    ap.add_argument("--sigma", type=float, action="append", help="each a row (default 1.2, 1.0, 1.5)")
    ap.add_argument("--open-bins", type=int, action="append", help="each a row (default 16, 4, 64)")
    for option, default in (("--docs", 200_000), ("--length", 4096), ("--group", 4096), ("--seed", 0)):
        ap.add_argument(option, type=int, default=default)
    for option, default in (
        ("--blob-docs", 20_000),
        ("--speed-group", 1024),
        ("--reads", 5_000),
        ("--repeats", 3),
    ):
        ap.add_argument(option, type=int, default=default, help="the speed rows")
    args = ap.parse_args(argv)
    args.open_bins = args.open_bins or [16, 4, 64]
    args.sigma = args.sigma or [1.2, 1.0, 1.5]
    if args.quick:
        args.docs, args.blob_docs, args.reads, args.speed_group = 40_000, 4_000, 1_000, 256
    started = time.perf_counter()
    report = Report()
    log("padding")
    bench_padding(report, args)
    log("speed")
    with temp_dir(None) as tmp:
        bench_speed(report, args, tmp)
        header = machine_info(tmp)
    ff_note = (
        "Both packers use the same bounded buffer: a piece goes into an open bin with room (best-fit: "
        "the fullest such bin; first-fit: the oldest); when none has room a bin opens, and past the "
        "buffer's size the fullest open bin is closed; every bin closes at the end of its group. "
        "Documents longer than a bin are split into bin-sized pieces (each a sequence of its own)."
    )
    report.notes += [
        ff_note,
        (
            "Why best-fit's gain is below 0.73x like for like: with a buffer that closes its fullest bin, "
            "first-fit already leaves under 1 % padding here, and best-fit's margin over it grows with the "
            "spread of the lengths (sigma 1.5: 0.69x at 16 open bins) and with the group (the groups' ends "
            "close partly filled bins: one group of every document comes near 0.73x), and is not monotonic "
            "in the buffer's size. Sorting a group by length first makes first-fit and best-fit place every "
            "piece alike (ratio 1.0), so neither sorts. The closing rule matters more than the fit: against "
            "a first-fit whose buffer closes its oldest bin (FIFO), best-fit leaves 0.55x to 0.65x the "
            "padding. (Grain's own 27 % was not re-measured "
            "here; its packer's buffer rule was not checked.)"
        ),
        (
            "PackedBins reads a bin's tokens in Python (TokenDocuments.gather, one copy per segment); the "
            "global-shuffle row repacks a group for most bins (the cache keeps 4 groups)."
        ),
    ]
    cmd = command_line("python benchmarks/bench_packing.py", argv)
    write_results(
        args.out,
        "Packing",
        [
            f"`{cmd}` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {time.perf_counter() - started:.0f} s.",
        ],
        header,
        report,
    )


if __name__ == "__main__":
    main()
