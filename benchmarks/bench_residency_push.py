"""Readers following the daemon's holds: what it costs the daemon and the readers, and how late they attach.

    python benchmarks/bench_residency_push.py                      # the installed smstore
    python benchmarks/bench_residency_push.py --variant before=DIR --variant after=DIR2 \
        --out benchmarks/results/residency_push.md

Each reading process of a windowed sampler runs a thread (``_Preattacher`` in smstore/wire/client.py)
that follows what the ranks hold in the daemon: it attaches a held shard of its dataset once the
daemon has loaded it and unmaps the shards no longer held. Every variant (a directory put first on
``PYTHONPATH`` of the daemon and of every rank, reader and worker: an older checkout's ``smstore/``
with its compiled module copied in) runs the same two sections, one variant after the other, in
this one run:

1. **Idle readers.** A daemon, one rank holding every shard of the dataset (all loaded), and then
   R x K reader processes that each opened the dataset and read one record (so their thread
   runs), and do nothing else for `--idle-s` seconds. Measured: the CPU time of the daemon's
   event-loop thread (``/proc/PID/task/PID/schedstat``, in ns: ``stat``'s clock ticks are too
   coarse for this) and its voluntary context switches (its wake-ups), per second, over the
   same span with no reader (first) and with the readers (after); and the readers' CPU time and
   wake-ups, all their threads summed.
2. **One epoch** of R ranks x K DataLoader workers (the setup of bench_windowed.py's epoch: a
   dataset over a `--budget-mib` daemon budget, reads limited to `--read-rate-mib`; the ranks meet
   at a gloo barrier after every batch, as a training step's all-reduce makes them). Every attach
   in a worker is recorded: by the pre-attaching thread (its delay: when it attached a shard
   minus when the daemon finished loading it, the ``loaded_at`` of the attach reply; only shards
   loaded after the worker's first attach count), or by a read that found its shard not ready
   (an attach on the read's critical path, timed). Batch waits as in bench_windowed.py: the
   first `--switch-batches` of each window after the first are the switch batches.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from bench_core import MiB, Report, command_line, log, machine_info, temp_dir, write_results
from bench_windowed import crc_collate, make_dataset, switch_and_steady

import smstore
from smstore.format.manifest import read_manifest
from smstore.sampling import WindowedShuffleSampler
from smstore.wire.client import daemon_request

RESULTS = Path(__file__).parent / "results"


# ---- measuring threads -------------------------------------------------------------------------


def thread_cpu_and_wakeups(pid: int, tid: int) -> tuple[int, int]:
    """(ns on a CPU, voluntary context switches) of one thread."""
    ns = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
    for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return ns, int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/task/{tid}/status has no voluntary_ctxt_switches")


def process_cpu_and_wakeups(pid: int) -> tuple[int, int]:
    """The same, summed over every thread of a process (threads that exited are not counted)."""
    ns = wakeups = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError):
            a, b = thread_cpu_and_wakeups(pid, int(tid))
            ns, wakeups = ns + a, wakeups + b
    return ns, wakeups


def rate(before: tuple[int, int], after: tuple[int, int], seconds: float) -> tuple[float, float]:
    """(ms of CPU a second, wake-ups a second) between two readings."""
    return (after[0] - before[0]) / 1e6 / seconds, (after[1] - before[1]) / seconds


# ---- the processes of a run --------------------------------------------------------------------


class Run:
    """A daemon on a private socket, and the processes started against it, all with one PYTHONPATH."""

    def __init__(self, tmp: Path, pythonpath: str | None, *args: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="run-", dir=tmp))
        self.sock = self.dir / "run" / "smstore.sock"
        self.sock.parent.mkdir(mode=0o700)
        self.env = {**os.environ, "SMSTORE_SOCKET": os.fspath(self.sock)}
        if pythonpath:
            self.env["PYTHONPATH"] = os.pathsep.join([pythonpath, os.environ.get("PYTHONPATH", "")])
        self.log = self.dir / "daemon.log"
        self.procs: list[subprocess.Popen[bytes]] = []
        with open(self.log, "wb") as err:
            self.daemon = subprocess.Popen(
                [sys.executable, "-m", "smstore", "serve", *args], stderr=err, env=self.env, cwd=self.dir
            )
        deadline = time.monotonic() + 30
        while not self.sock.exists():
            if time.monotonic() > deadline or self.daemon.poll() is not None:
                raise RuntimeError(self.log.read_text())
            time.sleep(0.05)

    def child(self, *args: str, stdin: bool = False) -> subprocess.Popen[bytes]:
        with open(self.dir / f"child{len(self.procs)}.err", "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, __file__, *args],
                env=self.env,
                stdin=subprocess.PIPE if stdin else None,
                stdout=subprocess.PIPE if stdin else None,
                stderr=err,
                cwd=self.dir,
            )
        self.procs.append(proc)
        return proc

    def status(self) -> dict[str, Any]:
        return daemon_request({"op": "status"}, self.sock)

    def close(self) -> None:
        for p in self.procs:
            if p.stdin is not None:
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.daemon.send_signal(signal.SIGTERM)
        self.daemon.wait(timeout=30)


def wait_line(proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != b"ready":
        raise RuntimeError(f"child {proc.pid} failed ({proc.wait()})")


# ---- 1. idle readers -----------------------------------------------------------------------------


def holder_child(args: argparse.Namespace) -> None:
    """A rank holding every shard of the dataset until its stdin closes."""
    from smstore.wire.residency import Residency

    residency = Residency(args.dataset, mode="daemon")
    residency.hold(range(len(read_manifest(args.dataset).shards)), wait=True)
    print("ready", flush=True)
    sys.stdin.read()
    residency.close()


def reader_child(args: argparse.Namespace) -> None:
    """A reading process that opened the dataset and read one record, until its stdin closes."""
    from smstore.wire.client import open_store

    store = open_store(args.dataset, mode="daemon")
    bytes(store[0])  # the first read starts the pre-attaching thread
    print("ready", flush=True)
    sys.stdin.read()
    store.close()


def bench_idle(
    report: Report, tmp: Path, dataset: Path, name: str, path: str | None, args: argparse.Namespace
) -> None:
    shards = len(read_manifest(dataset).shards)
    for workers in args.workers:
        readers = args.ranks * workers
        run = Run(tmp, path)
        try:
            holder = run.child("--child", "holder", "--dataset", os.fspath(dataset), stdin=True)
            wait_line(holder)
            deadline = time.monotonic() + 60
            while (st := run.status())["counts"]["segments"] < shards or st["loading"]:
                if time.monotonic() > deadline:
                    raise RuntimeError(run.log.read_text())
                time.sleep(0.1)
            time.sleep(1.0)
            pid = run.daemon.pid
            t0, d0 = time.perf_counter(), thread_cpu_and_wakeups(pid, pid)
            time.sleep(args.idle_s)
            t1, d1 = time.perf_counter(), thread_cpu_and_wakeups(pid, pid)
            alone = rate(d0, d1, t1 - t0)
            procs = [
                run.child("--child", "reader", "--dataset", os.fspath(dataset), stdin=True)
                for _ in range(readers)
            ]
            for p in procs:
                wait_line(p)
            time.sleep(2.0)  # every reader has attached what is held
            t0, d0 = time.perf_counter(), thread_cpu_and_wakeups(pid, pid)
            r0 = [process_cpu_and_wakeups(p.pid) for p in procs]
            time.sleep(args.idle_s)
            t1, d1 = time.perf_counter(), thread_cpu_and_wakeups(pid, pid)
            r1 = [process_cpu_and_wakeups(p.pid) for p in procs]
            with_readers = rate(d0, d1, t1 - t0)
            reader_rate = rate(
                (sum(a for a, _ in r0), sum(b for _, b in r0)),
                (sum(a for a, _ in r1), sum(b for _, b in r1)),
                t1 - t0,
            )
        finally:
            run.close()
        extra_cpu = with_readers[0] - alone[0]
        report.add(
            f"{name}: idle, R={args.ranks} x K={workers}: daemon loop CPU and wake-ups a second with {readers} readers",
            f"{with_readers[0]:.3f} ms/s, {with_readers[1]:.1f} wake-ups/s",
            baseline=f"no reader: {alone[0]:.3f} ms/s, {alone[1]:.1f} wake-ups/s",
            ratio=f"+{extra_cpu:.3f} ms/s, +{with_readers[1] - alone[1]:.1f} wake-ups/s",
        )
        report.add(
            f"{name}: idle, R={args.ranks} x K={workers}: the {readers} readers' CPU and wake-ups a second (all threads)",
            f"{reader_rate[0]:.3f} ms/s, {reader_rate[1]:.1f} wake-ups/s",
        )
        RESULTS_RAW.setdefault(name, {})[f"idle{workers}"] = {
            "daemon_ms": extra_cpu,
            "daemon_wakeups": with_readers[1] - alone[1],
            "readers_ms": reader_rate[0],
            "readers_wakeups": reader_rate[1],
        }


# ---- 2. one epoch --------------------------------------------------------------------------------


def rank_child(args: argparse.Namespace) -> None:
    """One rank of the epoch; its workers record every attach they make to a file of their own."""
    import warnings

    import torch

    warnings.filterwarnings("ignore", message="This DataLoader will create")

    from smstore.wire import client

    events_dir = Path(args.result).parent

    def record(event: dict[str, Any]) -> None:
        event["pid"] = os.getpid()
        with open(events_dir / f"events-{os.getpid()}.jsonl", "a") as f:
            f.write(json.dumps(event) + "\n")

    base = client.DaemonStore

    class Recorded(base):  # type: ignore[misc, valid-type]
        def __init__(self, fd: int, path: str, info: dict[str, Any], *rest: Any) -> None:
            super().__init__(fd, path, info, *rest)
            self.loaded_at = info.get("loaded_at")
            record(
                {
                    "kind": "attach",
                    "t": time.time(),
                    "loaded_at": info.get("loaded_at"),
                    "checksum": self.checksum,
                    "ahead": threading.current_thread().name == "smstore-preattach",
                }
            )

    attach = client._attach

    def timed(*a: Any) -> Any:
        t, asked = time.perf_counter(), time.time()
        store = attach(*a)
        # Already loaded when the read asked: the read did the pre-attaching thread's work.
        resident = (getattr(store, "loaded_at", None) or asked) < asked
        record({"kind": "read_attach", "seconds": time.perf_counter() - t, "resident": resident})
        return store

    client.DaemonStore = Recorded  # type: ignore[misc]
    client._attach = timed

    # The ranks step together, as a training step's all-reduce makes them: ranks left to drift apart
    # by windows hold more than the budget takes, and a rank's window can then wait for room that
    # only the other rank's progress frees, while that rank waits the same way.
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{events_dir / 'pg'}", rank=args.rank_child, world_size=args.ranks
    )
    ds = smstore.SharedStoreDataset(args.dataset, mode="daemon", decode=None)
    sampler = WindowedShuffleSampler(
        ds, window=args.window, seed=args.seed, rank=args.rank_child, world_size=args.ranks, lag=args.lag
    )
    plain = WindowedShuffleSampler(
        ds.shard_sizes, window=args.window, seed=args.seed, rank=args.rank_child, world_size=args.ranks
    )
    order = plain.permutation()
    loader = torch.utils.data.DataLoader(
        ds,
        sampler=sampler,
        batch_size=args.batch_size,
        num_workers=args.workers[0],
        collate_fn=crc_collate,
        multiprocessing_context="fork",
        prefetch_factor=2,
    )
    waits: list[float] = []
    it = iter(loader)
    while True:
        t0 = time.perf_counter()
        try:
            next(it)
        except StopIteration:
            break
        waits.append(time.perf_counter() - t0)
        time.sleep(args.train_ms / 1000)
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    n = len(ds)
    firsts = [
        order.window_of((args.rank_child + b * args.batch_size * args.ranks) % n) for b in range(len(waits))
    ]
    sampler.close()
    Path(args.result).write_text(json.dumps({"waits": waits, "windows": firsts}))


def bench_epoch(
    report: Report, tmp: Path, dataset: Path, name: str, path: str | None, args: argparse.Namespace
) -> None:
    budget = args.budget_mib * MiB
    window = WindowedShuffleSampler.window_for(dataset, budget)
    for workers in args.workers:
        run = Run(tmp, path, "--shm-limit", str(budget), "--max-read-rate", str(args.read_rate_mib * MiB))
        try:
            pid = run.daemon.pid
            d0, t0 = thread_cpu_and_wakeups(pid, pid), time.perf_counter()
            results = [run.dir / f"rank{r}.json" for r in range(args.ranks)]
            ranks = [
                run.child(
                    "--rank-child",
                    str(r),
                    "--dataset",
                    os.fspath(dataset),
                    "--result",
                    os.fspath(results[r]),
                    "--window",
                    str(window),
                    "--ranks",
                    str(args.ranks),
                    "--workers",
                    str(workers),
                    "--batch-size",
                    str(args.batch_size),
                    "--train-ms",
                    str(args.train_ms),
                    "--seed",
                    str(args.seed),
                    "--lag",
                    str(args.lag),
                )
                for r in range(args.ranks)
            ]
            for r in ranks:
                if r.wait(timeout=1800) != 0:
                    errors = "".join(f.read_text()[-3000:] for f in sorted(run.dir.glob("child*.err")))
                    raise RuntimeError(f"rank exited with {r.returncode}: {errors}")
            d1, t1 = thread_cpu_and_wakeups(pid, pid), time.perf_counter()
        finally:
            run.close()
        outs = [json.loads(p.read_text()) for p in results]
        events = [
            json.loads(line) for f in run.dir.glob("events-*.jsonl") for line in f.read_text().splitlines()
        ]
        # The first attach of each shard in each worker (a later one re-attaches a shard the worker
        # released while it was still held), by the thread, of a shard loaded after the worker began.
        first: dict[int, float] = {}
        firsts: dict[tuple[int, str], dict[str, Any]] = {}
        for e in sorted((e for e in events if e["kind"] == "attach"), key=lambda e: e["t"]):
            first.setdefault(e["pid"], e["t"])
            firsts.setdefault((e["pid"], e["checksum"]), e)
        delays = [
            (e["t"] - e["loaded_at"]) * 1000
            for e in firsts.values()
            if e["ahead"] and e["loaded_at"] > first[e["pid"]]
        ]
        on_read = [e["seconds"] * 1000 for e in events if e["kind"] == "read_attach"]
        late = [e["seconds"] * 1000 for e in events if e["kind"] == "read_attach" and e["resident"]]
        ahead = sum(1 for e in events if e["kind"] == "attach" and e["ahead"])
        switch, steady = switch_and_steady(outs, args.switch_batches)
        p99 = {k: float(np.percentile(v, 99)) * 1000 for k, v in (("switch", switch), ("steady", steady))}
        cpu = rate(d0, d1, t1 - t0)
        tag = f"{name}: epoch, R={args.ranks} x K={workers}"
        d = np.asarray(delays) if delays else np.zeros(1)
        report.add(
            f"{tag}: pre-attach delay after a shard's load ({len(delays)} first attaches)",
            f"median {np.median(d):.1f} ms, p90 {np.percentile(d, 90):.1f} ms, max {d.max():.1f} ms",
        )
        report.add(
            f"{tag}: attaches on a read's path (the shard not ready) / by the thread",
            f"{len(on_read)} / {ahead}; on a read: {sum(on_read):.1f} ms in all, max {max(on_read, default=0):.1f} ms",
        )
        report.add(
            f"{tag}: of those, shards the daemon had loaded before the read asked (the thread not there yet)",
            f"{len(late)}; {sum(late):.1f} ms in all, max {max(late, default=0):.1f} ms",
        )
        report.add(
            f"{tag}: batch wait p99 in the first {args.switch_batches} batches of a window",
            f"{p99['switch']:.2f} ms",
            baseline=f"steady p99 {p99['steady']:.2f} ms",
            ratio=f"{p99['switch'] / p99['steady']:.2f}x",
        )
        report.add(
            f"{tag}: daemon loop CPU and wake-ups over the epoch",
            f"{cpu[0] * (t1 - t0):.0f} ms, {cpu[1] * (t1 - t0):.0f} wake-ups in {t1 - t0:.1f} s",
        )
        RESULTS_RAW.setdefault(name, {})[f"epoch{workers}"] = {
            "delay_median_ms": float(np.median(d)),
            "delay_max_ms": float(d.max()),
            "on_read": len(on_read),
            "on_read_resident": len(late),
            "switch_over_steady_p99": p99["switch"] / p99["steady"],
            "daemon_ms": cpu[0] * (t1 - t0),
            "daemon_wakeups": cpu[1] * (t1 - t0),
        }


RESULTS_RAW: dict[str, dict[str, dict[str, float]]] = {}


def compare_variants(report: Report, names: list[str]) -> None:
    """Rows of the last variant against the first, same run."""
    if len(names) < 2:
        return
    a, b = RESULTS_RAW[names[0]], RESULTS_RAW[names[-1]]
    for section in a:
        for key in a[section]:
            x, y = a[section][key], b[section][key]
            report.add(
                f"{names[-1]} vs {names[0]}: {section} {key}",
                f"{y:.3f}",
                baseline=f"{x:.3f}",
                ratio=f"{y / x:.2f}x" if x else "-",
            )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME=DIR: run with DIR first on PYTHONPATH (repeat; default: the installed smstore)",
    )
    p.add_argument("--only", action="append", choices=["idle", "epoch"])
    p.add_argument("--out", type=Path, default=RESULTS / "residency_push.md")
    p.add_argument("--tmpdir", type=Path)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--idle-s", type=float, default=5.0)
    p.add_argument("--budget-mib", type=int, default=32)
    p.add_argument("--shards", type=int, default=24)
    p.add_argument("--read-rate-mib", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--train-ms", type=float, default=4.0)
    p.add_argument("--switch-batches", type=int, default=8)
    p.add_argument("--lag", type=int, default=2048)
    p.add_argument("--child", choices=["holder", "reader"], help=argparse.SUPPRESS)
    p.add_argument("--rank-child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--dataset", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--window", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child == "holder":
        holder_child(args)
        return 0
    if args.child == "reader":
        reader_child(args)
        return 0
    if args.rank_child is not None:
        rank_child(args)
        return 0
    variants = [v.split("=", 1) for v in args.variant] or [["installed", ""]]
    sections = set(args.only or ["idle", "epoch"])
    report = Report()
    started = time.perf_counter()
    with temp_dir(args.tmpdir) as tmp:
        header = machine_info(tmp)
        dataset, _crcs = make_dataset(tmp, 3 * args.budget_mib, args.shards, args.seed)
        for name, path in variants:
            if "idle" in sections:
                log(f"{name}: idle readers")
                bench_idle(report, tmp, dataset, name, path or None, args)
        for name, path in variants:
            if "epoch" in sections:
                log(f"{name}: epoch")
                bench_epoch(report, tmp, dataset, name, path or None, args)
        compare_variants(report, [n for n, _ in variants])
    cmd = command_line("python benchmarks/bench_residency_push.py", argv)
    report.notes.append(
        f"dataset {3 * args.budget_mib} MiB in {args.shards} shards, budget {args.budget_mib} MiB, daemon reads at "
        f"most {args.read_rate_mib} MiB/s; batch {args.batch_size}, {args.train_ms} ms of 'training' a batch, "
        f"lag {args.lag}; idle spans of {args.idle_s} s"
    )
    write_results(
        args.out,
        "Residency: readers following the daemon's holds",
        [
            f"`{cmd}` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {time.perf_counter() - started:.0f} s."
        ],
        header,
        report,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
