"""Simulate a multi-node run on one machine: one smstore daemon and one torchrun per "node", one epoch.

    smstore pack examples/data/corpus.txt -o corpus.smst
    python examples/multinode_sim.py --data corpus.smst --batch-size 64

Each simulated node gets its own ``smstore serve`` (its own socket, and so its own shared-memory
segment, as on separate machines) serving the same blob, and its own ``torchrun --nnodes=N
--node-rank=K`` (static rendezvous on 127.0.0.1) whose ranks train ``examples/train.py`` for one
epoch with ``--mode daemon --socket <that node's socket>``. Afterwards it checks, from the ranks'
traces, that

* every rank read from its own node's daemon (the segment's name carries the daemon's pid, and
  the daemon listed the rank's pid among the segment's clients), and
* the epoch covered the global order exactly: rank ``r`` of ``W`` saw ``O[r], O[r+W], ...``, so
  every record was seen exactly once when ``W`` divides ``N``; otherwise the first
  ``ceil(N/W)*W - N`` records of the order were seen twice (DistributedSampler's padding).

The daemons are stopped by pid on any exit and ``/dev/shm`` is checked to be clean. Exit status 0
when every check passed. ``--workdir`` keeps the traces, logs and ``summary.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import smstore
from smstore import DaemonError, GlobalShuffleSampler, collect_garbage, daemon_request, list_segments

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    """A TCP port nobody listens on right now (for the rendezvous of node 0's agent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Node:
    """One simulated node: its directory, daemon and torchrun."""

    def __init__(self, rank: int, workdir: Path) -> None:
        self.rank = rank
        self.dir = workdir / f"node{rank}"
        self.sock = self.dir / "run" / "smstore.sock"  # the daemon creates run/ mode 0700
        self.daemon: subprocess.Popen[bytes] | None = None
        self.torchrun: subprocess.Popen[bytes] | None = None
        self.status: dict[str, Any] = {}

    def start_daemon(self, data: Path) -> None:
        self.dir.mkdir(mode=0o700, parents=True)
        with open(self.dir / "daemon.log", "wb") as log:
            self.daemon = subprocess.Popen(
                [sys.executable, "-m", "smstore", "serve", "--socket", str(self.sock), str(data)],
                stderr=log,
                stdin=subprocess.DEVNULL,
                cwd=self.dir,  # not the repository root, whose smstore/ has no compiled module
            )

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Poll the daemon's status (what `smstore status` prints) until the blob is loaded."""
        assert self.daemon is not None
        deadline = time.monotonic() + timeout
        while True:
            if self.daemon.poll() is not None:
                log = (self.dir / "daemon.log").read_text()
                raise SystemExit(f"node {self.rank}: the daemon exited ({self.daemon.returncode}):\n{log}")
            with contextlib.suppress(DaemonError):
                st = daemon_request({"op": "status"}, self.sock, timeout=5.0)
                if st["segments"] and not st["loading"]:
                    self.status = st
                    return
            if time.monotonic() > deadline:
                raise SystemExit(f"node {self.rank}: the daemon did not get ready in {timeout} s")
            time.sleep(0.02)

    def stop_daemon(self) -> list[str]:
        """Stop the daemon by its pid (SIGTERM, then SIGKILL); return what it left in /dev/shm."""
        proc = self.daemon
        if proc is None:
            return []
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the daemon unlinks its segments, socket and state
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        left = list_segments(proc.pid)
        if left:
            collect_garbage(self.sock)  # the daemon is dead: gc removes its segments and socket
        return left


def train_command(node: Node, args: argparse.Namespace, port: int, steps: int, extra: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={args.nodes}",
        f"--node-rank={node.rank}",
        f"--nproc-per-node={args.nproc_per_node}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        str(HERE / "train.py"),
        "--data",
        str(args.data),
        "--mode",
        "daemon",
        "--socket",
        str(node.sock),
        "--steps",
        str(steps),
        "--batch-size",
        str(args.batch_size),
        "--workers",
        str(args.workers),
        "--seed",
        str(args.seed),
        "--trace",
        str(args.workdir / "trace"),
        "--checkpoint",
        str(args.workdir / "checkpoint.pt"),
        "--sample",
        "0",
        "--log-every",
        str(max(1, steps)),
        *extra,
    ]


def read_trace(path: Path) -> tuple[dict[str, Any], list[list[int]]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    (head,) = [x for x in lines if "source" in x]
    return head["source"], [x["indices"] for x in lines if "indices" in x]


def check(args: argparse.Namespace, n: int, daemons: dict[int, dict[str, Any]]) -> list[str]:
    """Every check of the module docstring; returns the failures (empty when all passed)."""
    world = args.nodes * args.nproc_per_node
    order = GlobalShuffleSampler(n, seed=args.seed, rank=0, world_size=1).global_order().tolist()
    per_rank = math.ceil(n / world)
    faults: list[str] = []
    seen: Counter[int] = Counter()
    for rank in range(world):
        source, batches = read_trace(Path(f"{args.workdir / 'trace'}.rank{rank}"))
        node = rank // args.nproc_per_node
        d = daemons[node]
        if source["node"] != node or source["local_rank"] != rank % args.nproc_per_node:
            faults.append(f"rank {rank}: placed as node {source['node']} local rank {source['local_rank']}")
        if source["source"] != "daemon" or source["daemon_pid"] != d["pid"]:
            faults.append(
                f"rank {rank}: read from {source.get('daemon_pid')}, not node {node}'s daemon {d['pid']}"
            )
        if source.get("segment") != d["segment"] or not source.get("listed"):
            faults.append(f"rank {rank}: segment {source.get('segment')} (listed: {source.get('listed')})")
        stream = [i for b in batches for i in b]
        expected = [order[(rank + j * world) % n] for j in range(per_rank)]
        if stream != expected:
            faults.append(f"rank {rank}: saw {len(stream)} samples, not its {per_rank} of the global order")
        seen.update(stream)
    padding = per_rank * world - n
    twice = set(order[:padding])
    wrong = [i for i in range(n) if seen[i] != (2 if i in twice else 1)]
    if wrong or set(seen) - set(range(n)):
        faults.append(f"epoch coverage: {len(wrong)} records seen the wrong number of times")
    return faults


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, required=True, help="the packed blob (.smst)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64, help="records per rank per step")
    p.add_argument("--workers", type=int, default=1, help="DataLoader workers per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--workdir", type=Path, help="keep traces, logs and summary.json here (default: a temp dir)"
    )
    p.add_argument("--timeout", type=float, default=300, help="seconds for the training run")
    args, extra = p.parse_known_args()  # the rest goes to train.py
    return args, [x for x in extra if x != "--"]


def main() -> int:
    args, extra = parse_args()
    args.data = args.data.resolve()
    keep = args.workdir is not None
    args.workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="smstore-multinode-"))).resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    with smstore.open(args.data) as store:
        n = len(store)
    world = args.nodes * args.nproc_per_node
    steps = math.ceil(math.ceil(n / world) / args.batch_size)  # exactly one epoch
    nodes = [Node(k, args.workdir) for k in range(args.nodes)]
    summary: dict[str, Any] = {"records": n, "world_size": world, "steps": steps, "daemons": {}}
    faults: list[str] = []
    try:
        for node in nodes:
            node.start_daemon(args.data)
            assert node.daemon is not None
            summary["daemons"][node.rank] = {"pid": node.daemon.pid, "socket": str(node.sock)}
        # Written before anything can fail: whoever runs us can find (and kill) the daemons by pid.
        (args.workdir / "summary.json").write_text(json.dumps(summary, indent=2))
        for node in nodes:
            node.wait_ready()
            summary["daemons"][node.rank]["segment"] = node.status["segments"][0]["segment"]
            print(
                f"node {node.rank}: daemon pid {node.daemon.pid if node.daemon else '?'} on {node.sock}",
                flush=True,
            )
        port = free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        print(
            f"{world} ranks ({args.nodes} nodes x {args.nproc_per_node}), {n} records, {steps} steps",
            flush=True,
        )
        for node in nodes:
            with open(node.dir / "torchrun.log", "wb") as log:
                node.torchrun = subprocess.Popen(
                    train_command(node, args, port, steps, extra),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    cwd=node.dir,
                )
        deadline = time.monotonic() + args.timeout
        for node in nodes:
            assert node.torchrun is not None
            rc = node.torchrun.wait(timeout=max(1.0, deadline - time.monotonic()))
            if rc != 0:
                faults.append(f"node {node.rank}: torchrun exited with {rc}")
        for node in nodes:
            for line in (node.dir / "torchrun.log").read_text().splitlines():
                print(f"[node {node.rank}] {line}", flush=True)
        if not faults:
            faults = check(args, n, summary["daemons"])
    finally:
        for node in nodes:
            if node.torchrun is not None and node.torchrun.poll() is None:
                node.torchrun.terminate()  # torchrun passes SIGTERM on to its ranks
                try:
                    node.torchrun.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    node.torchrun.kill()
                    node.torchrun.wait()
        for node in nodes:
            left = node.stop_daemon()
            if left:
                faults.append(f"node {node.rank}: the daemon left {left} in /dev/shm")
        summary["faults"] = faults
        (args.workdir / "summary.json").write_text(json.dumps(summary, indent=2))
        if not keep:
            shutil.rmtree(args.workdir, ignore_errors=True)
    for fault in faults:
        print(f"FAILED: {fault}", file=sys.stderr)
    if not faults:
        print(
            f"ok: every rank read its own node's daemon; the epoch's {n} records covered as the global order says"
        )
    return 1 if faults else 0


if __name__ == "__main__":
    sys.exit(main())
