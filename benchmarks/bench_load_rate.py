"""Loads per second: the daemon's fixed cost per load, on many one-record shards (issue 36).

    python benchmarks/bench_load_rate.py --variant before=DIR --variant after= --shards 5000

Two ways a node meets it: `smstore serve` given N small blobs at start (every load queued at once:
the time until status shows all N loaded), and N/4 `load` requests sent one after another, each
waiting for its reply (as `smstore load` does). A one-record blob copies nothing worth timing, so
what is left is the cost of a load itself: queueing, planning, registering, replying. Each
variant's daemon runs from its own tree (`DIR` with its compiled module copied in, first on the
path; empty = the installed smstore); rounds interleave the variants; medians are given with the
first variant as the baseline.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench_core import Report, command_line, log, machine_info, temp_dir, write_results

import smstore
from smstore.wire.client import daemon_request

RESULTS = Path(__file__).resolve().parent / "results"

# `smstore` from a given tree: the installed package's import hook (an editable install) set aside.
LAUNCH = r"""
import sys
tree = sys.argv.pop(1)
if tree:
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
    sys.path.insert(0, tree)
from smstore.cli import main
sys.argv[0] = "smstore"
sys.exit(main())
"""


def commit(tree: str) -> str:
    out = subprocess.run(
        ["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    )
    return out.stdout.strip() or "an unknown commit"


def start(tree: str, sock: Path, blobs: Sequence[str], cwd: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", LAUNCH, tree, "serve", "--socket", os.fspath(sock), *blobs],
        cwd=cwd,
        stderr=subprocess.DEVNULL,
    )


def wait_loaded(proc: subprocess.Popen[bytes], sock: Path, count: int) -> None:
    deadline = time.monotonic() + 1800
    while True:
        with contextlib.suppress(smstore.DaemonError):
            st = daemon_request({"op": "status", "limit": 1}, sock)
            if not st["loading"] and st["counts"]["segments"] >= count:
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            msg = f"the daemon on {sock} did not load {count} blobs"
            raise RuntimeError(msg)
        time.sleep(0.02)


def stop(proc: subprocess.Popen[bytes], sock: Path) -> None:
    with contextlib.suppress(smstore.DaemonError):
        daemon_request({"op": "stop"}, sock)
    try:
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def at_start(tree: str, blobs: Sequence[str], tmp: Path) -> float:
    sock = tmp / "at-start.sock"
    t = time.perf_counter()
    proc = start(tree, sock, blobs, tmp)
    try:
        wait_loaded(proc, sock, len(blobs))
        return time.perf_counter() - t
    finally:
        stop(proc, sock)


def one_by_one(tree: str, blobs: Sequence[str], tmp: Path) -> float:
    sock = tmp / "one-by-one.sock"
    proc = start(tree, sock, [], tmp)
    try:
        wait_loaded(proc, sock, 0)
        t = time.perf_counter()
        for blob in blobs:
            daemon_request({"op": "load", "path": blob}, sock, timeout=120)
        return time.perf_counter() - t
    finally:
        stop(proc, sock)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", action="append", default=[], help="NAME=DIR (repeat; DIR empty: installed)")
    p.add_argument("--shards", type=int, default=5000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS / "load_rate.md")
    p.add_argument("--tmpdir", type=Path)
    args = p.parse_args(argv)
    variants = [v.split("=", 1) for v in args.variant] or [["installed", ""]]
    report = Report()
    began = time.perf_counter()
    with temp_dir(args.tmpdir) as tmp:
        header = machine_info(tmp)
        blobs = []
        for i in range(args.shards):
            blob = tmp / f"shard-{i:05d}.smst"
            smstore.pack([b"record %d" % i], blob)
            blobs.append(os.fspath(blob))
        some = blobs[: args.shards // 4]
        times: dict[tuple[str, str], list[float]] = {}
        for r in range(args.rounds):
            log(f"round {r + 1} of {args.rounds}")
            for name, tree in variants:
                times.setdefault((name, "start"), []).append(at_start(tree, blobs, tmp))
                times.setdefault((name, "one"), []).append(one_by_one(tree, some, tmp))
        base = variants[0][0]
        kinds = (
            ("start", f"serve {len(blobs)} blobs given at start", len(blobs)),
            ("one", f"{len(some)} load requests one after another", len(some)),
        )
        for kind, what, n in kinds:
            ref = statistics.median(times[(base, kind)])
            for name, _tree in variants:
                t = statistics.median(times[(name, kind)])
                report.add(
                    f"{name}: {what} (median of {args.rounds})",
                    f"{t:.2f} s = {n / t:.0f} loads/s",
                    baseline=f"{base} {ref:.2f} s",
                    ratio=f"{ref / t:.2f}x",
                    goal=">= 1000 loads/s" if kind == "start" else "-",
                    met="yes" if kind != "start" or n / t >= 1000 else "no",
                )
    report.notes += [
        "ratio: the baseline's median time over the variant's (above 1.0: faster); rounds interleave the variants",
        "one-record blobs: the copy is nothing; what is timed is queueing, planning, registering, replying",
    ]
    # A variant's tree by its commit, never its path on this machine.
    trees = {tree: f"<a tree at {commit(tree)}>" for _name, tree in variants if tree}
    shown = []
    for arg in sys.argv[1:] if argv is None else argv:
        for tree, label in trees.items():
            arg = arg.replace(tree, label)
        shown.append(arg)
    cmd = command_line("python benchmarks/bench_load_rate.py", shown)
    intro = [f"`{cmd}`, {time.perf_counter() - began:.0f} s."]
    write_results(args.out, "Loads per second: the daemon's fixed cost per load", intro, header, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
