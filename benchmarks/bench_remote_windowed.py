"""A windowed epoch from a rate-limited S3 server through the daemon, then a second one from its node cache.

    python benchmarks/bench_remote_windowed.py            # writes benchmarks/results/remote_windowed.md
    python benchmarks/bench_remote_windowed.py --quick --out /tmp/rw.md

Needs the daemon's object-storage wiring (`smstore serve --cache-dir DIR --cache-limit BYTES`, a
dataset URL accepted by `SharedStoreDataset` and the daemon): with an smstore that lacks it, the
benchmark stops at once and says so.

The epoch is bench_windowed.py's (its functions, unchanged: R=2 ranks x K=2 workers,
`WindowedShuffleSampler` with the window `window_for(budget)` gives, every batch wait timed, data
memory sampled as the system's shared memory over its value before the daemon started), over a
dataset 6x the budget (14 windows: 208 switch batches, so that their p99 is no single batch's
wait) that lives in a bucket of benchmarks/_s3limit.py, run in its own process:
an S3 GET/HEAD server that reads only the ranges asked for, with a token bucket per connection
(`--conn-rate`, default 150 MB/s, as real S3 gives one connection) and one for all of them
(`--total-rate`, default 100 MB/s: the node's share of the network, and the rate the local
benchmark's `--max-read-rate` gives its file system), and `--latency` (default 20 ms) before each
response's first byte. The first epoch starts with an empty node cache; the second starts a fresh
daemon on the same cache (a restart) and must fetch zero shard bytes (the server's own count; the
manifest is read again by each rank and the daemon, and reported apart).

Goals (as the local windowed benchmark): switch-batch wait p99 <= 1.5x steady, data memory <= budget
+ 5 %, every record read exactly once, byte-exact; and the second epoch: 0 bytes fetched.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from _s3limit import server_stats
from bench_core import Report, command_line, log, machine_info, temp_dir, write_results, yes_no
from bench_windowed import RESULTS, make_dataset, rank_child, run_epoch, switch_and_steady

from smstore import WindowedShuffleSampler
from smstore.format.manifest import read_manifest

MiB = 1 << 20
BUCKET = "smstore-bench"
HERE = Path(__file__).resolve().parent


def require_remote_daemon() -> None:
    """Stop with a clear message when the installed smstore's daemon cannot serve a dataset URL."""
    help_text = subprocess.run(
        [sys.executable, "-m", "smstore", "serve", "--help"], capture_output=True, text=True, check=False
    ).stdout
    missing = [opt for opt in ("--cache-dir", "--cache-limit") if opt not in help_text]
    if missing:
        raise SystemExit(
            f"bench_remote_windowed: this smstore's `smstore serve` has no {' or '.join(missing)}: the daemon's "
            "object-storage wiring (issue 25) is not installed, so there is nothing to measure. Install an "
            "smstore with it (pip install -e '.[remote]' from a checkout that has it) and run again."
        )


def start_server(root: Path, args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    server = subprocess.Popen(
        [sys.executable, str(HERE / "_s3limit.py"), str(root), "--conn-rate", str(args.conn_rate),
         "--total-rate", str(args.total_rate), "--latency", str(args.latency)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    assert server.stdout is not None
    endpoint = server.stdout.readline().decode().strip()
    if not endpoint:
        server.kill()
        server.wait()
        raise SystemExit("bench_remote_windowed: benchmarks/_s3limit.py did not start")
    return server, endpoint


def check_epoch(outs: list[dict[str, Any]], crcs: list[int], ranks: int) -> tuple[bool, str]:
    """Every record read once, byte-exact (CRC32 against the source's)."""
    seen = np.zeros(len(crcs), dtype=np.int64)
    bad = 0
    for o in outs:
        for i, c in zip(o["indices"], o["crcs"], strict=True):
            seen[i] += 1
            bad += c != crcs[i]
    exact = bad == 0 and bool((seen >= 1).all()) and int(seen.sum()) - len(crcs) < ranks
    return exact, f"{len(crcs)} records, {bad} mismatches, {int((seen == 0).sum())} missed"


def epoch_rows(
    report: Report, name: str, epoch: dict[str, Any], crcs: list[int], args: argparse.Namespace
) -> None:
    budget = args.budget_mib * MiB
    switch, steady = switch_and_steady(epoch["outs"], args.switch_batches)
    p99 = {k: float(np.percentile(v, 99)) * 1000 for k, v in (("switch", switch), ("steady", steady))}
    ratio = p99["switch"] / p99["steady"]
    report.compare(
        f"{name}: batch wait p99 in the first {args.switch_batches} batches of a window ({len(switch)} batches)",
        f"{p99['switch']:.2f} ms",
        f"steady p99 {p99['steady']:.2f} ms ({len(steady)} batches)",
        ratio,
        "<= 1.5x",
        ratio <= 1.5,
    )
    peak_data = max(d for _, d in epoch["samples"])
    report.compare(
        f"{name}: data memory, peak of {len(epoch['samples'])} samples (shared memory over its value before "
        "the daemon started)",
        f"{peak_data / MiB:.1f} MiB",
        f"budget {args.budget_mib} MiB",
        peak_data / budget,
        "<= 1.05x",
        peak_data <= 1.05 * budget,
    )
    exact, what = check_epoch(epoch["outs"], crcs, args.ranks)
    report.add(
        f"{name}: every record read exactly once, byte-exact (CRC32)", what, goal="all", met=yes_no(exact)
    )


def bench(report: Report, tmp: Path, args: argparse.Namespace) -> None:
    budget = args.budget_mib * MiB
    local, crcs = make_dataset(tmp, args.data_mib or 6 * args.budget_mib, args.shards, args.seed)
    manifest = read_manifest(local)
    data_bytes = sum(s.file_size for s in manifest.shards)
    window = WindowedShuffleSampler.window_for(local, budget)
    root = tmp / "bucket-root"
    (root / BUCKET / "ds").mkdir(parents=True)
    for entry in os.scandir(local):  # the dataset, as it would be after `smstore pack -o s3://...`
        os.link(entry.path, root / BUCKET / "ds" / entry.name)
    url = f"s3://{BUCKET}/ds/"
    server, endpoint = start_server(root, args)
    saved = dict(os.environ)
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_REGION="us-east-1",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint,
        AWS_ALLOW_HTTP="true",
    )
    cache = Path(tempfile.mkdtemp(prefix="node-cache-", dir=tmp))
    daemon_args = ["--cache-dir", os.fspath(cache), "--cache-limit", str(2 * data_bytes)]
    try:
        log(f"dataset {data_bytes / MiB:.0f} MiB in {len(manifest.shards)} shards at {url}; window {window}")
        stats0 = server_stats(endpoint)
        first = run_epoch(tmp, url, budget, window, args.lag, args, daemon_args)  # type: ignore[arg-type]
        stats1 = server_stats(endpoint)
        log("second epoch, a fresh daemon on the same node cache")
        second = run_epoch(tmp, url, budget, window, args.lag, args, daemon_args)  # type: ignore[arg-type]
        stats2 = server_stats(endpoint)
        # Shard bytes, and the rest: the manifest, read by each rank and by the daemon at each epoch.
        fetched1, fetched2 = (
            b["blob_bytes_sent"] - a["blob_bytes_sent"] for a, b in ((stats0, stats1), (stats1, stats2))
        )
        other1, other2 = (
            (b["bytes_sent"] - b["blob_bytes_sent"]) - (a["bytes_sent"] - a["blob_bytes_sent"])
            for a, b in ((stats0, stats1), (stats1, stats2))
        )
    finally:
        os.environ.clear()
        os.environ.update(saved)
        assert server.stdin is not None
        server.stdin.close()
        server.terminate()
        server.wait()
    epoch_rows(report, "epoch 1 (from the bucket)", first, crcs, args)
    report.add(
        "epoch 1: shard bytes fetched from the bucket (the server's count)",
        f"{fetched1 / MiB:.1f} MiB of {data_bytes / MiB:.1f} MiB (and {other1} bytes of manifest); "
        f"{first['elapsed']:.1f} s",
    )
    epoch_rows(report, "epoch 2 (from the node cache, daemon restarted)", second, crcs, args)
    report.add(
        "epoch 2: shard bytes fetched from the bucket (the server's count)",
        f"{fetched2} bytes (and {other2} bytes of manifest: each rank and the daemon read it); "
        f"{second['elapsed']:.1f} s",
        goal="0",
        met=yes_no(fetched2 == 0),
    )
    rate = f"{args.conn_rate:.0f} MB/s a connection, {args.total_rate:.0f} MB/s in all"
    report.notes.append(
        f"epoch: {data_bytes / MiB:.0f} MiB in {len(manifest.shards)} shards, budget {args.budget_mib} MiB (window "
        f"of {window} shards); the bucket on benchmarks/_s3limit.py ({rate}, {args.latency * 1000:.0f} ms to "
        f"first byte); R={args.ranks} x K={args.workers}, batch {args.batch_size}, {args.train_ms} ms of "
        f"'training' a batch; the node cache limited to twice the dataset"
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smaller run")
    p.add_argument("--out", type=Path, default=RESULTS / "remote_windowed.md")
    p.add_argument("--tmpdir", type=Path)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--budget-mib", type=int, default=160)
    p.add_argument("--shards", type=int, default=96)
    p.add_argument("--data-mib", type=int, default=0, help="dataset size (default: 6x the budget)")
    p.add_argument("--conn-rate", type=float, default=150.0, help="MB/s per connection")
    p.add_argument("--total-rate", type=float, default=100.0, help="MB/s for all connections")
    p.add_argument("--latency", type=float, default=0.020, help="seconds to each response's first byte")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--train-ms", type=float, default=4.0)
    p.add_argument("--switch-batches", type=int, default=8)
    p.add_argument("--lag", type=int, default=None, help="the sampler's lag (default: its default)")
    # One rank of an epoch (run by bench_windowed.run_epoch, which starts bench_windowed.py itself).
    p.add_argument("--rank-child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--dataset", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--window", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.lag is None:
        import inspect

        args.lag = inspect.signature(WindowedShuffleSampler).parameters["lag"].default
    if args.quick:
        args.budget_mib, args.shards = 48, 24
        args.lag = min(args.lag, 2048)
    args.read_rate_mib = 0  # run_epoch passes --max-read-rate: the bucket's limits stand in for it
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank_child is not None:
        rank_child(args)
        return 0
    require_remote_daemon()
    report = Report()
    started = time.perf_counter()
    with temp_dir(args.tmpdir) as tmp:
        header = machine_info(tmp)
        bench(report, tmp, args)
    cmd = command_line("python benchmarks/bench_remote_windowed.py", argv)
    write_results(
        args.out,
        "A windowed epoch from object storage, then from the node cache",
        [
            f"`{cmd}` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {time.perf_counter() - started:.0f} s."
        ],
        header,
        report,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
