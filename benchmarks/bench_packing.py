"""Packing: the padding of best-fit vs first-fit vs none, and the speed of PackedBins.

    python benchmarks/bench_packing.py               # writes benchmarks/results/packing.md (~2 min on 2 cores)
    python benchmarks/bench_packing.py --quick --out /tmp/p.md

Every figure is measured in this one run:

1. **Padding**: documents of log-normal lengths (median 700 tokens, `--sigma` of the log, seeded:
   the distribution shipped with this benchmark) packed into bins of `--length` 4096 tokens,
   `--group` documents at a time, by `smstore.read.packing.pack_lengths` with the same bounded
   buffer of open bins for first-fit and best-fit (`--open-bins`, each size a row); "none" is one
   document per bin, truncated (its lost tokens are shown). Padding is pad tokens / bin tokens.
   Three closing rules (`close=`): ours ("fullest"), Grain's ("all": the whole batch of open bins
   emitted when a piece fits none) and FIFO ("oldest"); rows compare best-fit and first-fit under
   ours, under Grain's (like for like, Grain's comparison), and ours against Grain's first-fit.
   Goal (issue 39): best-fit's padding at most 0.73x first-fit's.
2. **Speed**, each against the Python packer (the tests' oracle) in the same run: `pack_lengths`
   in documents/s; `PackedBins` construction over `--big-docs` documents (a manifest naming one
   blob of `--blob-docs` such documents, uint16, again and again; groups of `--speed-group`;
   every group's bins counted, no token read) and its Python memory peak (tracemalloc); then, over
   the blob, bins/s read in stored order, in
   `WindowedShuffleSampler(bins.group_sizes, window=2)` order (each group packed once) and in
   `GlobalShuffleSampler` order (a group repacked for most bins), against `TokenWindows` reads of
   the same tokens in the same loop (interleaved, best of `--repeats`).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
from bench_core import Report, command_line, log, machine_info, temp_dir, write_results

import smstore
from smstore import _core
from smstore.format.manifest import describe_shard, write_manifest
from smstore.read import packing
from smstore.read.packing import PackedBins, pack_lengths

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from smstore_testlib import reference_pack_lengths  # the tests' oracle: the speed rows' "before"

MEDIAN = 700
# (row title, best-fit's closing rule, first-fit's): like for like with our buffer, like for like
# under Grain's rule (its packers emit the whole batch of rows when an element fits none), and our
# default against Grain's first-fit.
PADDING_ROWS = (
    ("best-fit vs first-fit, both closing the fullest bin (ours)", "fullest", "fullest"),
    ("best-fit vs first-fit, both closing every bin (Grain's rule)", "all", "all"),
    ("ours (best-fit, closing the fullest) vs Grain's first-fit (closing every bin)", "fullest", "all"),
)


def lengths_of(count: int, sigma: float, seed: int) -> np.ndarray:
    """The shipped distribution: log-normal document lengths of median 700 tokens, at least 1."""
    rng = np.random.default_rng(seed)
    return np.maximum(1, rng.lognormal(np.log(MEDIAN), sigma, count)).astype(np.int64)


def padding(
    lengths: np.ndarray, length: int, group: int, open_bins: int, algorithm: str, close: str = "fullest"
) -> tuple[float, int]:
    """(padding fraction, bins) of packing `lengths` group by group."""
    rule = {"length": length, "open_bins": open_bins, "algorithm": algorithm, "close": close}
    bins = int(_core.count_bins(lengths, group, **rule).sum())
    return 1 - int(lengths.sum()) / (bins * length), bins


def rate(items: int, fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return items / (time.perf_counter() - t)


def read_all(ds: object, order: Sequence[int]) -> None:
    for k in order:
        ds[k]  # type: ignore[index]


def compare_fits(
    report: Report, lengths: np.ndarray, args: argparse.Namespace, label: str, group: int, open_bins: int
) -> None:
    """A row per PADDING_ROWS: best-fit's padding against first-fit's, each under its closing rule."""
    for title, ours, theirs in PADDING_ROWS:
        bf, bf_bins = padding(lengths, args.length, group, open_bins, "best-fit", ours)
        ff, ff_bins = padding(lengths, args.length, group, open_bins, "first-fit", theirs)
        report.compare(
            f"padding, {title}, {label}, {open_bins} open bins",
            f"{bf:.3%} ({bf_bins} bins)",
            f"{ff:.3%} ({ff_bins} bins)",
            bf / ff,
            "<= 0.73x",
            bf <= 0.73 * ff,
        )


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
            compare_fits(
                report, lengths, args, f"sigma {sigma}, groups of {args.group}", args.group, open_bins
            )
        open_bins = args.open_bins[0]
        if sigma == args.sigma[0]:  # the groups' ends: one group of every document (a stream, as Grain's)
            label = f"sigma {sigma}, one group of all {len(lengths)} documents"
            for size in (open_bins, args.grain_bins):  # and a batch of Grain's size
                compare_fits(report, lengths, args, label, len(lengths), size)
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


class PythonPacker:
    """The packer's two functions done by the tests' Python oracle (tests/smstore_testlib.py): the
    speed rows' "before", PackedBins as it was (every group packed in Python, one call a group)."""

    pack_lengths = staticmethod(reference_pack_lengths)

    @staticmethod
    def count_bins(lengths: np.ndarray, group: int, **rule: Any) -> np.ndarray:
        return np.array(
            [
                len(reference_pack_lengths(lengths[a : a + group], **rule)[1]) - 1
                for a in range(0, len(lengths), group)
            ],
            dtype=np.int64,
        )


def python_packer() -> Any:
    """PackedBins made and read with the Python packer while this is entered."""
    return mock.patch.object(packing, "_core", PythonPacker)


def repeated_dataset(shard: Path, docs: int) -> Path:
    """A sharded dataset of at least ``docs`` documents: one blob named again and again by its manifest."""
    info, encoding = describe_shard(shard, stored_path=shard.name)
    write_manifest(shard.parent / "manifest.json", encoding, [info] * -(-docs // info.records), durable=False)
    return shard.parent


def bench_speed(report: Report, args: argparse.Namespace, tmp: Path) -> None:
    sigma, open_bins = args.sigma[0], args.open_bins[0]
    lengths = lengths_of(args.docs, sigma, args.seed)
    rule = {"length": args.length, "open_bins": open_bins, "algorithm": "best-fit", "close": "fullest"}
    groups = [lengths[a : a + args.group] for a in range(0, len(lengths), args.group)]
    python = rate(len(lengths), lambda: [reference_pack_lengths(g, **rule) for g in groups])
    cpp = rate(len(lengths), lambda: [pack_lengths(g, **rule) for g in groups])
    counted = rate(len(lengths), lambda: _core.count_bins(lengths, args.group, **rule))
    report.add(
        f"pack_lengths, best-fit, {open_bins} open bins, a call a group of {args.group}: C++ vs Python",
        f"{cpp / 1e6:.1f} M documents/s",
        baseline=f"{python / 1e6:.2f} M documents/s",
        ratio=f"{cpp / python:.0f}x",
    )
    report.add(
        f"count_bins (construction's count), best-fit, {open_bins} open bins, {len(lengths)} documents in one call",
        f"{counted / 1e6:.1f} M documents/s",
    )
    rng = np.random.default_rng(args.seed + 1)
    blob = tmp / "repeated" / "docs.smst"
    blob.parent.mkdir()
    smstore.pack_arrays(
        (rng.integers(1, 50000, int(n), dtype=np.uint16) for n in lengths[: args.blob_docs]),
        blob,
        durable=False,
    )
    options: dict[str, Any] = {"eod": 0, "group": args.speed_group, "open_bins": open_bins}
    built: dict[str, float] = {}
    big = repeated_dataset(blob, args.big_docs)
    for name, packer in (("python", python_packer), ("c++", contextlib.nullcontext)):
        with packer():
            t = time.perf_counter()
            bins = PackedBins(big, args.length, **options)
            built[name] = time.perf_counter() - t
    tracemalloc.start()  # apart: it slows Python's allocations, the Python packer's most of all
    PackedBins(big, args.length, **options)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    report.add(
        f"PackedBins construction, {bins.documents:,} documents (one shard of {args.blob_docs} named "
        f"{bins.documents // args.blob_docs} times), {bins.tokens / 1e9:.0f} G tokens, {len(bins)} bins in "
        f"{len(bins.group_sizes)} groups of {args.speed_group}: C++ vs Python packer",
        f"{built['c++']:.2f} s ({bins.documents / built['c++'] / 1e6:.1f} M documents/s)",
        baseline=f"{built['python']:.1f} s; Python memory peak {peak / 2**20:.1f} MiB (C++ packer)",
        ratio=f"{built['python'] / built['c++']:.0f}x",
    )
    bins = PackedBins(blob, args.length, **options)
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
    few = shuffled[: max(1, n // 5)]  # the Python packer's global shuffle: slow, fewer bins
    best = dict.fromkeys(["windows", "python", *orders], 0.0)
    for _ in range(args.repeats):  # interleaved, best of: the first pass also faults the pages in
        best["windows"] = max(best["windows"], rate(n, lambda: read_all(windows, stored)))
        for name, order in orders.items():
            best[name] = max(best[name], rate(n, lambda order=order: read_all(bins, order)))
        with python_packer():
            before = PackedBins(blob, args.length, **options)
            best["python"] = max(best["python"], rate(len(few), lambda before=before: read_all(before, few)))
    base = best["windows"]
    for name in orders:
        got = best[name]
        report.add(
            f"PackedBins bins/s ({args.length} tokens, padded), {name} order",
            f"{got / 1e3:.1f} k bins/s",
            baseline=f"TokenWindows {base / 1e3:.1f} k samples/s in stored order",
            ratio=f"{got / base:.2f}x",
        )
    report.add(
        f"PackedBins bins/s ({args.length} tokens, padded), global shuffle order: C++ vs Python packer",
        f"{best['global shuffle'] / 1e3:.1f} k bins/s",
        baseline=f"{best['python'] / 1e3:.2f} k bins/s (the first {len(few)} bins of the order)",
        ratio=f"{best['global shuffle'] / best['python']:.1f}x",
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "packing.md")
    ap.add_argument("--quick", action="store_true", help="fewer documents and reads (seconds)")
    ap.add_argument("--sigma", type=float, action="append", help="each a row (default 1.2, 1.0, 1.5)")
    ap.add_argument("--open-bins", type=int, action="append", help="each a row (default 16, 4, 64)")
    for option, default in (
        ("--docs", 200_000),
        ("--length", 4096),
        ("--group", 4096),
        ("--seed", 0),
        ("--grain-bins", 256),
    ):
        ap.add_argument(option, type=int, default=default)
    for option, default in (
        ("--blob-docs", 20_000),
        ("--big-docs", 10_000_000),
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
        args.big_docs = 400_000
    started = time.perf_counter()
    report = Report()
    log("padding")
    bench_padding(report, args)
    log("speed")
    with temp_dir(None) as tmp:
        bench_speed(report, args, tmp)
        header = machine_info(tmp)
    report.notes += [
        (
            "The closing rules, one packer (smstore.read.packing.pack_lengths, C++): a piece goes into an "
            "open bin with room (best-fit: the fullest such bin; first-fit: the oldest); when none has room "
            "and the buffer is full, one bin is closed first: ours closes the fullest (the default), FIFO "
            "the oldest, Grain's rule every open bin (Grain's PackedBatch / BestFitPackedBatch emit their "
            "whole batch of num_packing_bins rows when an element fits no row). Every bin closes at the end "
            "of its group. Documents longer than a bin are split into bin-sized pieces (each a sequence of "
            "its own); Grain's packers truncate them instead, so its own figure is not this one."
        ),
        (
            "Which comparison meets the issue's 0.73x: best-fit vs first-fit like for like under Grain's "
            "rule does not on these log-normal lengths (0.81x to 0.95x: Grain's 27 % less padding is not "
            "reproduced here, whatever the batch's size), nor mostly under our rule (0.69x to 0.87x; 0.74x "
            "for one group of every document). What meets it, by far, is our default (best-fit, closing the "
            "fullest bin) against Grain's first-fit (0.11x to 0.37x): closing the whole batch leaves every "
            "row's room unused at once, and that costs more than the choice of fit; FIFO first-fit sits "
            "between (best-fit leaves 0.55x to 0.65x of its padding)."
        ),
        (
            "Speed rows: before = the same PackedBins with the Python packer (the tests' oracle, "
            "tests/smstore_testlib.py reference_pack_lengths) swapped in for the C++ one, measured in this "
            "run; construction counts every group's bins with count_bins over each shard's offsets "
            "(a chunk of 2^20 documents a call), no token read. A bin's tokens are still copied in Python "
            "(TokenDocuments.gather, one copy per segment); the global-shuffle row repacks a group "
            "(in C++) for most bins (the cache keeps 4 groups)."
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
