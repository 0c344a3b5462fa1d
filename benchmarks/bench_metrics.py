"""What the daemon's metrics cost: bench_windowed's epoch with `--metrics` and `--metrics-file` on vs off.

    python benchmarks/bench_metrics.py [--rounds 4] [--out benchmarks/results/metrics.md]

Each round runs the epoch twice through a fresh daemon, metrics off then on (the order alternates
from round to round), over the same dataset: R ranks x K workers of a windowed shuffle through a
daemon under a --shm-limit of a third of the data (bench_windowed's `--quick` epoch). With metrics
on, the daemon serves them on a local port, writes the textfile, and this process scrapes the
endpoint every `--scrape-s` seconds (Prometheus' default is 15 s: 1 s is harsher). Reported, on
against off: the epoch's wall time (each round's on/off ratio: the two runs of a round are
neighbours in time, so a busy spell of the machine falls on both), the daemon's CPU time over the
epoch, and the ranks' mean batch wait.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

import bench_windowed as bw
from bench_core import MiB, Report, command_line, log, machine_info, temp_dir, write_results

from smstore.sampling import WindowedShuffleSampler

RESULTS = Path(__file__).parent / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scraper(url: str, every: float, stop: threading.Event, counts: list[int]) -> None:
    while not stop.wait(every):
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as r:
            r.read()
            counts[0] += 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4, help="pairs of epochs (off, on), interleaved")
    p.add_argument("--scrape-s", type=float, default=1.0, help="seconds between two scrapes")
    p.add_argument("--out", type=Path, default=RESULTS / "metrics.md")
    p.add_argument("--tmpdir", type=Path)
    args = p.parse_args(argv)
    # bench_windowed's quick epoch: its defaults for the ranks, workers, batch, training time, lag.
    wargs = bw.parse_args(["--quick"])
    budget = wargs.budget_mib * MiB
    started = time.perf_counter()
    report = Report()
    with temp_dir(args.tmpdir) as tmp:
        header = machine_info(tmp)
        dataset, _crcs = bw.make_dataset(tmp, 3 * wargs.budget_mib, wargs.shards, wargs.seed)
        window = WindowedShuffleSampler.window_for(dataset, budget)
        elapsed: dict[str, list[float]] = {"off": [], "on": []}
        waits: dict[str, list[float]] = {"off": [], "on": []}
        cpu: dict[str, list[float]] = {"off": [], "on": []}
        scrapes = [0]
        for r in range(args.rounds):
            for variant in ("off", "on") if r % 2 == 0 else ("on", "off"):
                daemon_args: list[str] = []
                stop = threading.Event()
                if variant == "on":
                    port = free_port()
                    daemon_args = [
                        "--metrics",
                        f"127.0.0.1:{port}",
                        "--metrics-file",
                        str(tmp / "smstore.prom"),
                    ]
                    url = f"http://127.0.0.1:{port}/metrics"
                    threading.Thread(
                        target=scraper, args=(url, args.scrape_s, stop, scrapes), daemon=True
                    ).start()
                try:
                    epoch = bw.run_epoch(tmp, dataset, budget, window, wargs.lag, wargs, daemon_args)
                finally:
                    stop.set()
                elapsed[variant].append(epoch["elapsed"])
                cpu[variant].append(epoch["daemon_cpu"])
                all_waits = [w for o in epoch["outs"] for w in o["waits"]]
                waits[variant].append(statistics.fmean(all_waits))
                log(
                    f"round {r} metrics {variant}: {epoch['elapsed']:.2f} s, mean wait {waits[variant][-1] * 1e3:.2f} ms"
                )
    med = {k: statistics.median(v) for k, v in elapsed.items()}
    wmed = {k: statistics.median(v) for k, v in waits.items()}
    spread = {k: f"{min(v):.2f}-{max(v):.2f} s" for k, v in elapsed.items()}
    # Within noise: 1 lies inside the interquartile range of the rounds' paired ratios.
    paired = sorted(on / off for on, off in zip(elapsed["on"], elapsed["off"], strict=True))
    q1, q2, q3 = statistics.quantiles(paired, n=4)
    report.compare(
        f"epoch wall time, metrics on ({args.rounds} rounds, {spread['on']}; "
        f"{scrapes[0]} scrapes at 1 per {args.scrape_s:g} s, textfile written)",
        f"median {med['on']:.2f} s; each round's on/off ratio: median {q2:.3f}x, quartiles "
        f"{q1:.3f}-{q3:.3f}x, range {paired[0]:.2f}-{paired[-1]:.2f}x",
        f"metrics off: median {med['off']:.2f} s ({spread['off']})",
        q2,
        "within noise: 1 inside the quartiles of the paired ratios",
        q1 <= 1 <= q3,
    )
    cmed = {k: statistics.median(v) for k, v in cpu.items()}
    report.add(
        "the daemon's CPU time over the epoch (user + system, every thread), metrics on (median of the rounds)",
        f"{cmed['on']:.2f} s ({min(cpu['on']):.2f}-{max(cpu['on']):.2f} s)",
        baseline=f"metrics off: {cmed['off']:.2f} s ({min(cpu['off']):.2f}-{max(cpu['off']):.2f} s)",
        ratio=f"{cmed['on'] / cmed['off']:.3f}x",
    )
    report.add(
        "the ranks' mean batch wait, metrics on (median of the rounds)",
        f"{wmed['on'] * 1e3:.2f} ms",
        baseline=f"metrics off: {wmed['off'] * 1e3:.2f} ms",
        ratio=f"{wmed['on'] / wmed['off']:.3f}x",
    )
    report.notes.append(
        f"epoch: {3 * wargs.budget_mib} MiB in {wargs.shards} shards, budget {wargs.budget_mib} MiB (window "
        f"{window}), daemon reads at most {wargs.read_rate_mib} MiB/s; R={wargs.ranks} x K={wargs.workers}, "
        f"batch {wargs.batch_size}, {wargs.train_ms} ms of 'training' a batch (bench_windowed --quick's epoch)"
    )
    cmd = command_line("python benchmarks/bench_metrics.py", argv)
    write_results(
        args.out,
        "What the daemon's metrics cost",
        [
            (
                f"`{cmd}` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {time.perf_counter() - started:.0f} s; "
                "off and on interleaved, the order alternating from round to round."
            )
        ],
        header,
        report,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
