"""Sharded datasets: open time, ds[i] against one blob, parallel packing, pack memory at 200M records.

    python benchmarks/bench_shards.py                       # writes benchmarks/results/shards.md
    python benchmarks/bench_shards.py --records 200000 --rss-records 20000000 --out /tmp/s.md   # quick

Every ratio is measured in this one run, on the same records:

1. Opening a manifest of `--shards` shards (`smstore.open(dir)`: parse, validate, one stat per
   shard; no shard mapped) and building `SharedStoreDataset(dir)`: median of 21 opens.
2. `ds[i]` over a random permutation: the sharded dataset (every shard already opened) against
   `SharedStoreDataset` over one blob of the same records; min of `--repeats` interleaved passes.
3. `smstore pack -j 2` (two shards packed at once) against `-j 1` (one blob), same input file of at
   least `--pack-mib` MiB, best of 3 each, page cache warm.
4. Peak resident memory (VmHWM minus the RSS before packing) of a process packing
   `--rss-records` one-byte lines: the offsets index no longer lives in RAM.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from bench_core import (
    MiB,
    Report,
    best_of,
    command_line,
    log,
    loop_empty,
    loop_getitem,
    machine_info,
    ns,
    random_order,
    stdlib_lines,
    temp_dir,
    warm,
    write_lines,
    write_results,
    yes_no,
)

import smstore
from smstore import SharedStoreDataset

RESULTS = Path(__file__).parent / "results"


def bench_open(report: Report, dataset: Path, shards: int) -> None:
    times, ds_times = [], []
    for _ in range(21):
        t0 = time.perf_counter()
        s = smstore.open(dataset)
        times.append(time.perf_counter() - t0)
        s.close()
        t0 = time.perf_counter()
        SharedStoreDataset(dataset, mode="mmap")
        ds_times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    report.add(f"open a {shards}-shard manifest", f"{ms:.2f} ms", goal="< 50 ms", met=yes_no(ms < 50))
    dms = statistics.median(ds_times) * 1e3
    report.add(
        f"SharedStoreDataset over {shards} shards", f"{dms:.2f} ms", goal="< 50 ms", met=yes_no(dms < 50)
    )


def synthetic_records(n: int, size: int) -> list[bytes]:
    """`n` records of random printable bytes, `size / 2` to `3 * size / 2` long (no newline)."""
    rng = np.random.default_rng(3)
    lengths = rng.integers(size // 2, size * 3 // 2, size=n)
    data = rng.integers(32, 127, size=int(lengths.sum()), dtype=np.uint8).tobytes()
    ends = np.cumsum(lengths).tolist()
    return [data[e - length : e] for e, length in zip(ends, lengths.tolist(), strict=True)]


def bench_reads(report: Report, blob: Path, dataset: Path, n: int, repeats: int) -> None:
    one = SharedStoreDataset(blob, decode=None, mode="mmap")
    many = SharedStoreDataset(dataset, decode=None, mode="mmap")
    idx = random_order(n, 0)
    for i in random_order(n, 1)[:2000]:
        if bytes(one[i]) != bytes(many[i]):
            sys.exit(f"bench_shards: record {i} differs between the blob and the sharded dataset")
    loop_getitem(many, list(range(0, n, max(1, n // 10_000))))  # open every shard before timing
    best = best_of(
        repeats,
        {
            "one blob": lambda: loop_getitem(one, idx),
            "sharded": lambda: loop_getitem(many, idx),
            "empty": lambda: loop_empty(idx),
        },
    )
    per = {k: v / n for k, v in best.items()}
    ratio = per["sharded"] / per["one blob"]
    report.add(
        f"ds[i] random, {many.store.shard_count} shards",
        ns(per["sharded"]),
        baseline=f"one blob {ns(per['one blob'])}",
        ratio=f"{ratio:.2f}",
        goal="<= 1.2",
        met=yes_no(ratio <= 1.2),
    )
    report.notes.append(f"empty loop: {ns(per['empty'])} (inside both figures)")


def bench_pack(report: Report, tmp: Path, lines: list[bytes], pack_mib: int) -> None:
    src = tmp / "pack-input.txt"
    with open(src, "wb") as f:
        written = 0
        while written < pack_mib * MiB:
            chunk = b"\n".join(lines) + b"\n"
            f.write(chunk)
            written += len(chunk)
    warm(src)
    best: dict[int, float] = {}
    for _ in range(3):
        for jobs in (1, 2):
            out = tmp / ("p1.smst" if jobs == 1 else "p2")
            if out.exists():  # a pack writes a new output: freeing the last one is not its cost
                shutil.rmtree(out) if out.is_dir() else out.unlink()
            os.sync()  # the last round's dirty pages must not be written back during this one
            t0 = time.perf_counter()
            smstore.pack_files([src], out, jobs=jobs, progress=False, durable=False)
            best[jobs] = min(best.get(jobs, float("inf")), time.perf_counter() - t0)
    a, b = smstore.open(tmp / "p1.smst"), smstore.open(tmp / "p2")
    if len(a) != len(b) or any(bytes(a[i]) != bytes(b[i]) for i in range(0, len(a), max(1, len(a) // 5000))):
        sys.exit("bench_shards: pack -j 2 differs from pack -j 1")
    mib = written / MiB
    ratio = best[1] / best[2]
    report.compare(
        f"pack -j 2, {mib:.0f} MiB of lines",
        f"{mib / best[2]:.0f} MiB/s",
        f"-j 1 {mib / best[1]:.0f} MiB/s",
        ratio,
        ">= 1.6x",
        ratio >= 1.6,
    )


RSS_CHILD = """
import sys, smstore
def kib(key):
    for line in open('/proc/self/status'):
        if line.startswith(key):
            return int(line.split()[1])
before = kib('VmRSS:')
stats = smstore.pack_files([sys.argv[1]], sys.argv[2], progress=False, durable=False)
print(stats.records, kib('VmHWM:') - before, before)
"""


def bench_pack_rss(report: Report, tmp: Path, records: int) -> None:
    src = tmp / "one-byte-lines.txt"
    with open(src, "wb") as f:
        block = b"x\n" * (1 << 20)
        f.writelines(block for _ in range(records >> 20))
        f.write(b"x\n" * (records & ((1 << 20) - 1)))
    out = subprocess.run(
        [sys.executable, "-c", RSS_CHILD, str(src), str(tmp / "rss.smst")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    n, grown_kib, base_kib = int(out[0]), int(out[1]), int(out[2])
    if n != records:
        sys.exit(f"bench_shards: packed {n} records, expected {records}")
    peak = (grown_kib + base_kib) / 1024
    report.add(
        f"pack {records / 1e6:.0f}M records: peak RSS",
        f"{peak:.0f} MiB ({grown_kib / 1024:.0f} MiB above the interpreter's {base_kib / 1024:.0f} MiB)",
        baseline=f"index in RAM: {records * 8 / MiB:.0f} MiB",
        goal="< 300 MiB",
        met=yes_no(peak < 300),
    )
    (tmp / "rss.smst").unlink()
    src.unlink()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--shards", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--pack-mib", type=int, default=512)
    p.add_argument("--rss-records", type=int, default=200_000_000)
    p.add_argument("--out", type=Path, default=RESULTS / "shards.md")
    p.add_argument(
        "--record-bytes",
        type=int,
        default=0,
        help="random records of about this many bytes instead of stdlib lines (bigger shards)",
    )
    p.add_argument("--only", action="append", choices=["open", "reads", "pack", "rss"])
    p.add_argument("--tmpdir", type=Path)
    args = p.parse_args(argv)
    report = Report()
    started = time.perf_counter()
    with temp_dir(args.tmpdir) as tmp:
        lines = (
            synthetic_records(args.records, args.record_bytes)
            if args.record_bytes
            else stdlib_lines(args.records)
        )
        sections = set(args.only or ["open", "reads", "pack", "rss"])
        lines_file, blob, dataset = tmp / "lines.txt", tmp / "one.smst", tmp / "sharded"
        write_lines(lines_file, lines)
        smstore.pack_files([lines_file], blob, progress=False, durable=False)
        per_shard = -(-args.records // args.shards)
        with smstore.ShardedWriter(dataset, encoding="lines", shard_records=per_shard, durable=False) as w:
            w.extend(lines)
        header = machine_info(tmp)
        if "open" in sections:
            log("open")
            bench_open(report, dataset, args.shards)
        if "reads" in sections:
            log("reads")
            bench_reads(report, blob, dataset, args.records, args.repeats)
        if "pack" in sections:
            log("pack -j")
            bench_pack(report, tmp, lines, args.pack_mib)
        if "rss" in sections:
            log("pack RSS")
            bench_pack_rss(report, tmp, args.rss_records)
    kind = f"random, ~{args.record_bytes} bytes each" if args.record_bytes else "stdlib source lines"
    cmd = command_line("python benchmarks/bench_shards.py", argv)
    write_results(
        args.out,
        "Sharded datasets",
        [
            f"`{cmd}` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {time.perf_counter() - started:.0f} s;",
            f"{args.records} records ({kind}) in one blob and in {args.shards} shards.",
        ],
        header,
        report,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
