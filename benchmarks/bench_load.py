"""Loading a blob into /dev/shm with its checksum against `cp` of the same file, one core kept busy.

    python benchmarks/bench_load.py                                  # writes benchmarks/results/load.md
    python benchmarks/bench_load.py --variant before=DIR --variant after= --mib 512 --rounds 15

What `smstore serve` does for every shard it loads (`_core.shm_load`: copy into a new segment,
XXH64 of every byte and the offsets index checked on the way) against `cp FILE /dev/shm/`, which
copies and checks nothing. The blob (`--mib` MiB of text lines) sits in the page cache, so both
measure the copy, not the disk. Rounds interleave cp and every variant; each load runs in its own
child (`DIR` first on PYTHONPATH, with its compiled module copied in; empty = the installed
smstore), timed inside the child around the call, with its CPU time (every thread). Unless
`--quiet`, a child `while True: pass` keeps one core busy throughout (a training node's load is
never alone). Each variant also runs with `hash_thread=False` (the copying thread hashes every
chunk itself) when its smstore has that option.

Ratios are cp's time over the load's, per round, and their median: above 1.0 the load is faster.
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from bench_core import MiB, Report, command_line, log, machine_info, temp_dir, write_results

import smstore

RESULTS = Path(__file__).resolve().parent / "results"

CHILD = r"""
import os, sys, time
from smstore import _core
path, name, one = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
if one and "hash_thread" not in (_core.shm_load.__doc__ or ""):
    print("unsupported")
    sys.exit(0)
kw = {"hash_thread": False} if one else {}
t, c = time.perf_counter(), time.process_time()
fd, *_ = _core.shm_load(path, name, 0o400, -1, 0, **kw)
dt, dc = time.perf_counter() - t, time.process_time() - c
os.close(fd)
_core.shm_unlink(name)
print(dt, dc)
"""


def make_blob(tmp: Path, mib: int) -> Path:
    src = tmp / "lines.txt"
    rng = np.random.default_rng(1)
    with open(src, "wb") as f:
        f.writelines(bytes(rng.integers(32, 127, size=MiB - 1, dtype=np.uint8)) + b"\n" for _ in range(mib))
    blob = tmp / "load.smst"
    smstore.pack_files([src], blob, progress=False, durable=False)
    src.unlink()
    with open(blob, "rb", buffering=0) as f:  # into the page cache
        while f.read(8 * MiB):
            pass
    return blob


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", action="append", default=[], help="NAME=DIR (repeat; DIR empty: installed)")
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--quiet", action="store_true", help="no busy core")
    p.add_argument("--out", type=Path, default=RESULTS / "load.md")
    p.add_argument("--tmpdir", type=Path)
    args = p.parse_args(argv)
    variants = [v.split("=", 1) for v in args.variant] or [["installed", ""]]
    report = Report()
    started = time.perf_counter()
    with temp_dir(args.tmpdir) as tmp:
        header = machine_info(tmp)
        blob = make_blob(tmp, args.mib)
        size = blob.stat().st_size / MiB
        target = Path("/dev/shm") / f"smstore-bench-cp-{os.getpid()}"
        name = f"/smstore-bench-load-{os.getpid()}"
        times: dict[str, list[float]] = {"cp": []}
        cpu: dict[str, list[float]] = {"cp": []}

        def cp() -> None:
            r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            t = time.perf_counter()
            subprocess.run(["cp", os.fspath(blob), os.fspath(target)], check=True)
            times["cp"].append(time.perf_counter() - t)
            r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu["cp"].append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
            target.unlink()

        def load(label: str, tree: str, one: bool) -> None:
            env = dict(os.environ)
            env.pop("PYTHONPATH", None)
            if tree:
                env["PYTHONPATH"] = os.path.abspath(tree)
            out = subprocess.run(
                [sys.executable, "-c", CHILD, os.fspath(blob), name, "1" if one else "0"],
                env=env,
                capture_output=True,
                text=True,
                check=True,
                cwd=tmp,
            ).stdout.split()
            if out == ["unsupported"]:
                return
            times.setdefault(label, []).append(float(out[0]))
            cpu.setdefault(label, []).append(float(out[1]))

        runs: list[Callable[[], None]] = [cp]
        for label, tree in variants:
            runs.append(functools.partial(load, label, tree, False))
            runs.append(functools.partial(load, f"{label}, one thread", tree, True))
        busy = None
        if not args.quiet:
            busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            for r in range(args.rounds):
                log(f"round {r + 1} of {args.rounds}")
                for run in runs:
                    run()
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
        med_cp, cpu_cp = statistics.median(times["cp"]), statistics.median(cpu["cp"])
        report.add("cp", f"{size / med_cp:.0f} MiB/s", baseline="-", ratio="1.00x")
        for label, ts in times.items():
            if label == "cp":
                continue
            ratios = [c / t for c, t in zip(times["cp"], ts, strict=True)]
            report.add(
                f"{label}: speed over cp's (median of per-round ratios; range)",
                f"{size / statistics.median(ts):.0f} MiB/s",
                baseline=f"cp {size / med_cp:.0f} MiB/s",
                ratio=f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x)",
                goal=">= 1.0x",
                met="yes" if statistics.median(ratios) >= 1.0 else "no",
            )
            report.add(
                f"info: {label}: CPU time (every thread; median) over cp's",
                f"{statistics.median(cpu[label]) * 1000:.0f} ms",
                baseline=f"cp {cpu_cp * 1000:.0f} ms",
                ratio=f"{statistics.median(cpu[label]) / cpu_cp:.2f}x",
            )
    cmd = command_line("python benchmarks/bench_load.py", argv)
    report.notes.append(
        f"a {size:.0f} MiB blob in the page cache, {args.rounds} interleaved rounds, "
        + ("nothing else running" if args.quiet else "one core kept busy by a `while True: pass` child")
    )
    write_results(
        args.out,
        "Loading a blob into /dev/shm against cp",
        [
            f"`{cmd}` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {time.perf_counter() - started:.0f} s."
        ],
        header,
        report,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
