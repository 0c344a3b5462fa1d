"""Training-path benchmarks: GlobalShuffleSampler cost and memory, and DataLoader token-batch throughput.

    python benchmarks/bench_train.py                 # ~2 minutes on 2 cores; markdown tables on stdout
    python benchmarks/bench_train.py --records 4000  # quicker

Throughput compares, in the same run and on the same token records, smstore (indices in, one
``gather`` per batch in the worker via ``TokenCollator``) with the usual approach: a Python list of
numpy arrays in the Dataset, fetched one by one and padded in a collate function.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import platform
import tempfile
import time
import tracemalloc
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import smstore
from smstore import GlobalShuffleSampler, TokenCollator
from smstore.sampling import FeistelPermutation

BATCH, SEQ = 256, 512


def bench_sampler(n: int, count: int) -> list[tuple[str, str]]:
    rows = []
    s = GlobalShuffleSampler(n, seed=0, rank=0, world_size=1)
    t = time.perf_counter()
    it = iter(s)
    next(it)
    first = time.perf_counter() - t
    t = time.perf_counter()
    for _ in itertools.islice(it, count):
        pass
    per_index = (time.perf_counter() - t) / count
    # Memory separately: tracemalloc slows every allocation down.
    tracemalloc.start()
    for _ in itertools.islice(iter(GlobalShuffleSampler(n, seed=1, rank=0, world_size=1)), 300_000):
        pass
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    perm = FeistelPermutation(n, b"bench")
    pos = np.arange(1 << 16, dtype=np.uint64)
    reps = max(1, count // len(pos))
    t = time.perf_counter()
    for k in range(reps):
        perm(pos + np.uint64(k << 16))
    vec = (time.perf_counter() - t) / (reps * len(pos))
    state = s.state_dict()
    t = time.perf_counter()
    s.load_state_dict({**state, "consumed": n - 1000})
    tail = list(s)
    resume = time.perf_counter() - t
    rows.append(("records", f"{n:.0e}"))
    rows.append(
        ("iterating the sampler (Python ints, as a DataLoader does)", f"{per_index * 1e9:.0f} ns/index")
    )
    rows.append(("permutation alone, numpy chunks of 65536", f"{vec * 1e9:.1f} ns/index"))
    rows.append(("first index of an epoch", f"{first * 1e3:.2f} ms"))
    rows.append((f"resume at consumed = N - 1000 and yield the {len(tail)} left", f"{resume * 1e3:.2f} ms"))
    rows.append(("memory allocated while iterating (tracemalloc peak)", f"{peak / 2**20:.2f} MiB"))
    rows.append(("memory held between chunks", "O(1): seed, epoch, position, 6 round keys"))
    rows.append(("a stored permutation of the same N (int64)", f"{8 * n / 2**30:.1f} GiB"))
    return rows


def bench_distributed_sampler(n: int) -> tuple[str, str]:
    """Baseline: DistributedSampler materializes randperm(N) before the first index."""
    s = DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=0)
    t = time.perf_counter()
    next(iter(s))
    return (
        f"DistributedSampler, first index of an epoch at N={n:.0e} (builds the list)",
        f"{(time.perf_counter() - t) * 1e3:.0f} ms",
    )


def make_records(n: int, seed: int = 0) -> list[np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(SEQ // 2, SEQ * 3 // 2, size=n)
    return [rng.integers(0, 50_000, size=int(k), dtype=np.uint16) for k in lengths]


class ListDataset(Dataset[np.ndarray[Any, Any]]):
    """The usual approach: the records as a Python list of arrays, fetched one at a time."""

    def __init__(self, records: list[np.ndarray[Any, Any]]) -> None:
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> np.ndarray[Any, Any]:
        return self.records[i]


def pad_list_batch(batch: list[np.ndarray[Any, Any]]) -> dict[str, torch.Tensor]:
    tokens = torch.zeros((len(batch), SEQ), dtype=torch.long)
    grid = tokens.numpy()
    lengths = []
    for i, a in enumerate(batch):
        k = min(len(a), SEQ)
        grid[i, :k] = a[:k]
        lengths.append(k)
    return {"tokens": tokens, "lengths": torch.tensor(lengths)}


def run_epoch(loader: DataLoader[Any]) -> tuple[float, float, float, int]:
    """(startup s, batches/s after the first batch, slowest wait s after the first batch, batches)."""
    t0 = time.perf_counter()
    it = iter(loader)
    next(it)
    startup = time.perf_counter() - t0
    waits = []
    t = time.perf_counter()
    start = t
    for batch in it:
        now = time.perf_counter()
        waits.append(now - t)
        assert batch["tokens"].shape[1] == SEQ
        t = time.perf_counter()
    total = time.perf_counter() - start
    del it
    return startup, len(waits) / total, max(waits), len(waits) + 1


def bench_loader(
    records: list[np.ndarray[Any, Any]], path: Path, workers: list[int], repeat: int
) -> list[list[str]]:
    results: dict[tuple[int, str], list[tuple[float, float, float, int]]] = {}
    n = len(records)
    # Interleaved repeats, best epoch kept: other load on the machine hits both sides alike.
    for _, k, name in itertools.product(range(repeat), workers, ("smstore", "python list")):
        gc.collect()
        sampler = GlobalShuffleSampler(n, seed=k, rank=0, world_size=1)
        if name == "smstore":
            collate = TokenCollator(
                path, max_length=SEQ, fixed_length=True, dtype=torch.long, return_indices=False
            )
            loader = DataLoader(
                range(n), batch_size=BATCH, sampler=sampler, collate_fn=collate, num_workers=k, drop_last=True
            )
        else:
            loader = DataLoader(
                ListDataset(records),
                batch_size=BATCH,
                sampler=sampler,
                collate_fn=pad_list_batch,
                num_workers=k,
                drop_last=True,
            )
        results.setdefault((k, name), []).append(run_epoch(loader))
    rows = []
    for (k, name), runs in results.items():
        startup, rate, slowest, batches = max(runs, key=lambda r: r[1])
        mtok = rate * BATCH * SEQ / 1e6
        rows.append(
            [
                str(k),
                name,
                f"{rate:.1f}",
                f"{mtok:.1f}",
                f"{slowest * 1e3:.1f}",
                f"{startup * 1e3:.0f}",
                str(batches),
            ]
        )
    return rows


def table(header: list[str], rows: list[list[str]] | list[tuple[str, str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sampler-n", type=float, default=1e9, help="records for the sampler benchmark")
    p.add_argument("--sampler-count", type=int, default=2_000_000, help="indices to draw")
    p.add_argument(
        "--records", type=int, default=256 * 120, help="token records for the DataLoader benchmark"
    )
    p.add_argument("--workers", default="1,2,4", help="worker counts")
    p.add_argument("--repeat", type=int, default=3, help="epochs per configuration; the best is shown")
    args = p.parse_args()
    torch.set_num_threads(1)
    # More workers than cores is the point of the K=4 row.
    warnings.filterwarnings("ignore", message="This DataLoader will create")

    print(
        f"# bench_train: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, smstore {smstore.__version__}\n"
    )
    print("## GlobalShuffleSampler\n")
    rows = bench_sampler(int(args.sampler_n), args.sampler_count)
    rows.append(bench_distributed_sampler(10**7))
    print(table(["what", "figure"], rows))

    records = make_records(args.records)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokens.smst"
        smstore.pack_arrays(records, path, dtype=np.uint16, durable=False)
        mib = path.stat().st_size / 2**20
        print(
            f"\n## DataLoader: token batches {BATCH} x {SEQ} (int64 out), {args.records} records of 256..767 uint16 tokens ({mib:.0f} MiB blob), one epoch\n"
        )
        rows = bench_loader(records, path, [int(w) for w in args.workers.split(",")], args.repeat)
    print(
        table(
            ["workers", "dataset", "batches/s", "Mtokens/s", "slowest wait ms", "first batch ms", "batches"],
            rows,
        )
    )
    print(
        f"\nBest of {args.repeat} epochs per row (by batches/s). batches/s and the slowest wait exclude the first"
        " batch (worker start-up), shown separately."
    )


if __name__ == "__main__":
    main()
