"""Benchmarks of the node daemon: memory (PSS) across ranks and workers, attach time, load throughput, cold cache.

Run: python benchmarks/bench_daemon.py [--records 1000000] [--big-gib 2] [--out benchmarks/results/daemon.md]
Every figure is quoted against a baseline measured in the same run. Cleans up its daemon, files and segments.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench_core import portable
from contenders import daemon

import smstore
from smstore.wire.client import daemon_request, open_store

SHM = Path("/dev/shm")


def pss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return 0


def descendants(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                out.append(int(child))
                out.extend(descendants(int(child)))
    return out


def make_blob(path: Path, records: int, seed: int = 0) -> None:
    import random

    rng = random.Random(seed)
    words = [bytes(rng.choices(b"abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(5000)]

    def gen() -> Iterator[bytes]:
        for _ in range(records):
            yield b" ".join(rng.choices(words, k=rng.randint(10, 60)))

    with smstore.Writer(path, encoding="lines") as w:
        w.extend(gen())


def make_big_blob(path: Path, size: int) -> None:
    rec = os.urandom(1 << 20)
    with smstore.Writer(path) as w:
        for i in range(size >> 20):
            w.append(rec[i % 97 :] + rec[: i % 97])


# ---- (a) memory: R ranks x K workers --------------------------------------------------------


def _touch(batch: list[Any]) -> int:
    # Reads every byte of every record, so every page of the data is really mapped.
    return sum(zlib.crc32(r) for r in batch)


class ListDataset:
    """The usual approach: each rank holds its records in a Python list."""

    def __init__(self, path: str) -> None:
        with smstore.open(path) as s:
            self.records = [bytes(r) for r in s]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> bytes:
        return self.records[i]


def rank_main(path: str, mode: str, rank: int, world: int, workers: int) -> None:
    """One simulated rank: a full DistributedSampler epoch, then wait to be measured."""
    from torch.utils.data import DataLoader, DistributedSampler

    ds: Any = ListDataset(path) if mode == "list" else smstore.SharedStoreDataset(path, mode=mode)  # type: ignore[arg-type]
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(
        ds, batch_size=256, sampler=sampler, num_workers=workers, collate_fn=_touch, persistent_workers=True
    )
    total = sum(loader)
    print(f"done {total}", flush=True)
    sys.stdin.read()  # the parent measures PSS now, then closes stdin
    del loader


def memory_run(path: Path, mode: str, ranks: int, workers: int, daemon_pid: int | None) -> int:
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--rank-main",
                os.fspath(path),
                mode,
                str(r),
                str(ranks),
                str(workers),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(ranks)
    ]
    for p in procs:
        line = p.stdout.readline()  # type: ignore[union-attr]
        if not line.startswith("done"):
            raise RuntimeError(f"rank failed: {line!r}")
    pids = [p.pid for p in procs]
    for p in procs:
        pids.extend(descendants(p.pid))
    if daemon_pid is not None:
        pids.append(daemon_pid)
    total = sum(pss_kib(pid) for pid in pids) * 1024
    for p in procs:
        p.communicate("")
    return total


# ---- (c) load throughput ---------------------------------------------------------------------


def best_of(n: int, fn: Any) -> float:
    return min(fn() for _ in range(n))


def timed(cmd: str) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, shell=True, check=True)
    return time.perf_counter() - t


# ---- (d) cold page cache ------------------------------------------------------------------------


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def random_epoch(store: smstore.Store) -> float:
    import numpy as np

    order = np.random.default_rng(0).permutation(len(store)).tolist()
    t = time.perf_counter()
    acc = 0
    for i in order:
        acc += store[i][0] if len(store[i]) else 0  # touch the record's first byte
    return (time.perf_counter() - t) / len(order) * 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--big-gib", type=float, default=2.0, help="size of the large blob for attach times")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--out", default="benchmarks/results/daemon.md")
    ap.add_argument("--rank-main", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_main:
        p, mode, r, w, k = args.rank_main
        rank_main(p, mode, int(r), int(w), int(k))
        return

    rows: list[tuple[str, str, str]] = []
    work = Path(tempfile.mkdtemp(prefix="bench-daemon-", dir="/tmp"))
    work.chmod(0o700)
    sock = work / "smstore.sock"
    os.environ["SMSTORE_SOCKET"] = os.fspath(sock)
    try:
        data, empty = work / "data.smst", work / "empty.smst"
        make_blob(data, args.records)
        # The baseline has as many (empty) records: the sampler's index lists and the workers'
        # per-batch costs grow with the record count and are no part of the data's memory.
        with smstore.Writer(empty) as w:
            w.extend(b"" for _ in range(args.records))
        size = data.stat().st_size
        # Divide by what the data adds over the baseline blob (its data section; the offsets
        # index is in both): the conservative reading of "divided by the blob size".
        extra = size - empty.stat().st_size
        print(f"blob: {args.records} records, {size / 2**20:.1f} MiB", file=sys.stderr)

        # (a) PSS of R ranks x K workers, minus the same harness on an empty dataset.
        with daemon(sock, data, empty) as d:
            base_d = memory_run(empty, "daemon", args.ranks, args.workers, d.pid)
            pss_d = memory_run(data, "daemon", args.ranks, args.workers, d.pid)
        base = memory_run(empty, "list", args.ranks, args.workers, None)
        pss_l = memory_run(data, "list", args.ranks, args.workers, None)
        pss_m = memory_run(data, "mmap", args.ranks, args.workers, None)
        base_m = memory_run(empty, "mmap", args.ranks, args.workers, None)
        rk = f"R={args.ranks} x K={args.workers}"
        rows.append(
            (
                f"(a) (PSS - same-count empty blob) / data: daemon ({rk}, daemon included)",
                f"{(pss_d - base_d) / extra:.3f}",
                "goal <= 1.05",
            )
        )
        rows.append(
            (
                f"(a) (PSS - same-count empty blob) / data: mmap of the file ({rk})",
                f"{(pss_m - base_m) / extra:.3f}",
                "page cache",
            )
        )
        rows.append(
            (
                f"(a) (PSS - same-count empty blob) / data: Python list per rank ({rk})",
                f"{(pss_l - base) / extra:.3f}",
                "usual approach",
            )
        )

        # (b) attach time: 10 MiB vs a large blob.
        small, big = work / "small.smst", work / "big.smst"
        make_big_blob(small, 10 << 20)
        make_big_blob(big, int(args.big_gib * 2**30))
        with daemon(sock, small, big):
            for blob in (small, big):
                times = []
                for _ in range(200):
                    t = time.perf_counter()
                    s = open_store(blob, mode="daemon")
                    times.append(time.perf_counter() - t)
                    s.close()
                label = f"{blob.stat().st_size / 2**20:.0f} MiB"
                rows.append(
                    (f"(b) attach (median of 200), {label}", f"{statistics.median(times) * 1e6:.0f} us", "")
                )
        big.unlink()

        # (c) load throughput from page cache vs `cat > /dev/null` and `cp` into /dev/shm.
        subprocess.run(f"cat {data} > /dev/null", shell=True, check=True)
        t_cat = best_of(3, lambda: timed(f"cat {data} > /dev/null"))
        cp_to = SHM / f"bench-daemon-{os.getpid()}"

        def cp_once() -> float:
            t = timed(f"cp {data} {cp_to}")
            cp_to.unlink()
            return t

        t_cp = best_of(3, cp_once)
        with daemon(sock) as d:
            loads = []
            for _ in range(3):
                r = daemon_request({"op": "load", "path": os.fspath(data)}, sock, timeout=None)
                loads.append(r["load_seconds"])
                daemon_request({"op": "unload", "checksum": r["checksum"]}, sock)
        t_load = min(loads)
        mib = size / 2**20
        rows.append(("(c) cat file > /dev/null (page cache)", f"{mib / t_cat:.0f} MiB/s", "baseline"))
        rows.append(
            ("(c) cp file /dev/shm/ (no checksum)", f"{mib / t_cp:.0f} MiB/s", f"{t_cat / t_cp:.2f}x cat")
        )
        rows.append(
            (
                "(c) daemon load with checksum",
                f"{mib / t_load:.0f} MiB/s",
                f"{t_cat / t_load:.2f}x cat (goal >= 0.8)",
            )
        )

        # (d) random-order epoch with a cold page cache: daemon segment vs file mapping.
        with daemon(sock, data):
            if drop_caches():
                seg = open_store(data, mode="daemon")
                ns_seg = random_epoch(seg)
                drop_caches()
                ns_file = random_epoch(smstore.open(data))
                rows.append(
                    ("(d) cold cache random epoch, daemon segment", f"{ns_seg:.0f} ns/record", "baseline")
                )
                rows.append(
                    (
                        "(d) cold cache random epoch, file mapping",
                        f"{ns_file:.0f} ns/record",
                        f"{ns_file / ns_seg:.1f}x",
                    )
                )
                seg.close()
            else:
                rows.append(("(d) cold cache random epoch", "not permitted", "cannot drop caches"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for p in SHM.glob(f"bench-daemon-{os.getpid()}*"):
            p.unlink()

    table = ["| measurement | value | note |", "|---|---|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in rows]
    text = "\n".join(table) + "\n"
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        portable(f"# bench_daemon.py ({args.records} records, {size / 2**20:.0f} MiB blob)\n\n{text}")
    )


if __name__ == "__main__":
    main()
