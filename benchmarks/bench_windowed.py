"""Larger than RAM: a window of shards resident per node, the next one loaded while the current one trains.

    python benchmarks/bench_windowed.py             # writes benchmarks/results/windowed.md (~5 min on 2 cores)
    python benchmarks/bench_windowed.py --quick --out /tmp/w.md

Every figure is measured in this one run:

1. **Shuffle quality** of `WindowedShuffleSampler` and of the block schedule
   (`BlockWindowOrder`, docs/training.md "Block windows", with its model's prediction)
   against an exact global shuffle, and of WebDataset's recipe (shuffled shard list, then its own
   `_shuffle` buffer) and Mosaic streaming's `py1br` / `py1e` (their own `get_shuffle`; a row says
   "skipped" when `mosaicml-streaming` is not installed) at the same memory: a buffer, block or
   set of resident blocks of two windows' records, since smstore keeps two windows resident (the
   one read and the next, loading). Two statistics over batches
   of `--batch-size` consecutive samples of one epoch, each divided by its value for the exact
   global shuffle (so 1.0 is as good as a global shuffle):
   - *shard spread*: the mean number of distinct shards a batch draws from;
   - *neighbour rate*: how often two records adjacent in the source (same shard, i and i+1)
     land in the same batch (a global shuffle: (B-1)/(N-1)); higher means source order leaks
     into batches. Reported as global / ours, so 1.0 is best and 0.01 means 100x more often.
2. **Loading a shard** into /dev/shm with its checksum (`smstore load`'s code) against `cp` of
   the same file into /dev/shm, page cache warm, while a child process (`while True: pass`)
   keeps one core busy: the median over `--load-repeats` interleaved rounds of cp's time over
   the load's, and the same for the load hashing on its copying thread alone. Both are bound by
   tmpfs allocating the pages; on a VM a run takes either about 0.4 s or 2-3x that a GiB,
   whichever program it is, so the median needs many runs to mean anything.
3. **One epoch at R=2 ranks x K=2 workers** over a dataset 3x the memory budget: a daemon
   (`smstore serve --shm-limit BUDGET --max-read-rate RATE`: the rate-limited reader stands in for
   a slow shared file system), `SharedStoreDataset(mode="daemon")` and `WindowedShuffleSampler`
   with the window `window_for(budget)` gives. Each rank times every `next(loader)` (the batch
   wait) and then "trains" for `--train-ms`. Batches in the first `--switch-batches` of a window
   (where a late load would show) are the switch batches; the rest (after the first window) are
   steady. Data memory is sampled every 100 ms (by a thread under SCHED_IDLE): the system's
   shared memory (/proc/meminfo Shmem) over its value before the daemon started, which counts the
   daemon's segments, loads under way, and segments it released that a process still maps, each
   page once (an unlinked segment keeps all its pages while mapped); the daemon's segments in
   /dev/shm are shown beside it. Every record's CRC32 is checked against the source: each read
   exactly once. The sampler's `lag` is its default (`--lag`); an info row runs the same epoch
   again at the least safe lag (`2 x prefetch_factor x workers x batch`), where the previous
   window's release lands in the switch batches (`--no-least-lag` skips it).
4. **The same epoch through blocks**: `BlockWindowSampler` with `plan(budget, --block-mib)`, the
   daemon holding pieces of shards (smstore/daemon/blocks.py) and the workers reading records
   through `BlockReader`, over the same bytes in a sixth as many shards (blocks are meant to be
   smaller than shards). The same criteria (the first `spread` windows, while the memory fills,
   are the start of the epoch, as the window sampler's first window is), and the reads: one
   sequential read a block (each within one shard), how many are at least `--block-mib`, and each
   block read once (the daemon's log). Section 1's `BlockWindowSampler` rows and the acceptance
   row per memory size (spread and neighbour ratio at least WebDataset's and `py1e`'s) are this
   sampler's order, with blocks of `--block-mib` at records of `--record-kib` (that section's
   memory sizes are in records).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from bench_core import MiB, Report, command_line, log, machine_info, temp_dir, write_results, yes_no

import smstore
from smstore import _core
from smstore.format.manifest import read_manifest
from smstore.sampling import (
    BlockWindowOrder,
    BlockWindowSampler,
    GlobalShuffleSampler,
    WindowedShuffleSampler,
    block_bounds,
)
from smstore.sampling.plan import neighbour_spread
from smstore.wire.blocks import BlockReader
from smstore.wire.residency import Residency

RESULTS = Path(__file__).parent / "results"


# ---- 1. shuffle quality ---------------------------------------------------------------------


def quality_stats(order: np.ndarray, shard_of: np.ndarray, batch: int) -> tuple[float, float]:
    """(mean distinct shards per batch, rate at which source neighbours share a batch)."""
    n = len(order) // batch * batch
    batches = shard_of[order[:n]].reshape(-1, batch)
    spread = float(np.mean([len(np.unique(b)) for b in batches]))
    batch_of = np.empty(len(order), dtype=np.int64)
    batch_of[order] = np.arange(len(order)) // batch
    same_shard = shard_of[:-1] == shard_of[1:]
    together = (batch_of[:-1] == batch_of[1:]) & same_shard
    return spread, float(together.sum() / max(1, same_shard.sum()))


def webdataset_order(sizes: list[int], buffer: int, seed: int) -> np.ndarray | str:
    try:
        from webdataset.filters import _shuffle
    except ImportError as e:
        return f"skipped: {e}"
    starts = np.concatenate([[0], np.cumsum(sizes)])
    shards = list(range(len(sizes)))
    random.Random(seed).shuffle(shards)  # wds.shuffle on the shard list
    stream = (i for k in shards for i in range(starts[k], starts[k + 1]))
    return np.fromiter(_shuffle(stream, bufsize=buffer, initial=buffer, seed=seed), dtype=np.int64)


def mosaic_order(sizes: list[int], algo: str, block: int, seed: int) -> np.ndarray | str:
    try:
        from streaming.base.shuffle import get_shuffle
    except ImportError as e:
        return f"skipped: {e} (pip install mosaicml-streaming)"
    return np.asarray(get_shuffle(algo, np.asarray(sizes, np.int64), 1, seed, 0, block), dtype=np.int64)


def block_order(
    sizes: list[int], memory: int, block: int, spread: int, seed: int
) -> tuple[str, np.ndarray | str]:
    """The block schedule (``BlockWindowOrder``) within ``memory`` records: ``spread + 1`` groups
    resident (the ``spread`` a window draws from, and the next, loading), as many blocks a group as fit."""
    group = memory // ((spread + 1) * block)
    name = f"block schedule: blocks of {block}, spread {spread}, groups of {group * block} records"
    if group < 1:
        return name, f"skipped: {memory} records cannot hold {spread + 1} groups of one block of {block}"
    order = BlockWindowOrder(sizes, block=block, group=group, spread=spread, key=f"bench-blocks:{seed}")
    return f"{name} ({(spread + 1) * group * block} records resident)", order(np.arange(order.n))


def block_model(n: int, shards: int, batch: int, block: int, group: int, spread: int) -> tuple[float, float]:
    """What docs/training.md's model of the block schedule predicts: (shards a batch, neighbour ratio),
    shards of equal size, every group of ``group * block`` records.

    Group ``j``'s ``G`` records are dealt to ``spread`` parts, part ``t`` placed at random in window
    ``j + t`` of ``G`` positions: records ``r, r + 1`` of a group land ``stride`` windows apart, or
    ``spread - stride`` the other way, and then share a batch with probability
    ``E[max(0, 1 - |distance| / batch)]``. The model leaves out
    the epoch's first and last ``spread`` windows, which draw from fewer groups (memory filling and
    draining). A batch draws from the ``group * (spread + batch / G)`` blocks whose parts fill the
    windows it covers, at random (fewer distinct ones than balanced parts give: the spread is a
    lower estimate), and those blocks come from random shards.
    """
    window = group * block
    # Records r and r + 1 of a group are dealt `stride` parts apart (forward, for a share
    # (spread - stride) / spread of them) or spread - stride back: windows that far apart.
    stride = BlockWindowOrder([window], block=block, group=group, spread=spread, key="model").stride
    apart = (
        {0: 1.0} if spread == 1 else {stride: (spread - stride) / spread, spread - stride: stride / spread}
    )
    v = np.linspace(-1, 1, 401)  # U1 - U2 of two uniform places in their windows: triangular
    w = 1 - np.abs(v)
    w /= w.sum()
    together = sum(
        p * float((np.clip(1 - np.abs(d + v) * window / batch, 0, None) * w).sum()) for d, p in apart.items()
    )
    # Pairs across a block edge (about 1 in ``block``) fall in unrelated groups: a global shuffle's rate.
    global_rate = (batch - 1) / (n - 1)
    rate = (1 - 1 / block) * together + global_rate / block
    blocks = group * (spread + batch / window)  # a batch covers 1 + batch / window windows on average
    distinct_blocks = blocks * (1 - (1 - 1 / blocks) ** batch)
    spread_shards = shards * (1 - (1 - 1 / shards) ** distinct_blocks)
    return spread_shards, global_rate / rate


def bench_quality(
    report: Report,
    shards: int,
    per_shard: int,
    batch: int,
    windows: Sequence[int],
    block: int,
    block_bytes: int,
    record_bytes: int,
) -> None:
    rng = np.random.default_rng(0)
    sizes = [int(s) for s in rng.integers(per_shard // 2, per_shard * 3 // 2, size=shards)]
    n = sum(sizes)
    shard_of = np.repeat(np.arange(shards), sizes)
    g = GlobalShuffleSampler(n, seed=1, rank=0, world_size=1)
    g_spread, g_near = quality_stats(np.asarray(list(g)), shard_of, batch)
    report.add(
        f"exact global shuffle ({n} records, {shards} shards, batch {batch})",
        f"{g_spread:.1f} shards/batch, neighbours together {g_near:.2e}",
    )

    pairs = int((shard_of[:-1] == shard_of[1:]).sum())  # source neighbours: adjacent records of a shard

    def row(name: str, order: np.ndarray | str, bound: str = "") -> tuple[float, float, str] | None:
        """Report an order's spread and neighbour ratio (both / the global shuffle's); return them and
        the neighbour ratio as shown (a lower bound where no pair shared a batch)."""
        if isinstance(order, str):
            report.add(name, order)
            return None
        assert sorted(order.tolist()) == list(range(n)), name
        spread, near = quality_stats(order, shard_of, batch)
        # No pair together: the rate is below one pair in `pairs`, so the ratio is at least this.
        ratios = (spread / g_spread, g_near / near if near else g_near * pairs)
        shown = f"{ratios[1]:.3f}" if near else f"> {ratios[1]:.1f}"
        report.add(
            name,
            f"{spread:.1f} shards/batch, neighbours together {near:.2e}{bound}",
            ratio=f"spread {ratios[0]:.2f}, neighbours {shown}"
            + ("" if near else f" (none of the {pairs} pairs shared a batch)"),
        )
        return (*ratios, shown)

    for w in windows:
        # Two windows are resident (the one read, the next): every row gets that memory.
        memory = 2 * w * per_shard
        s = WindowedShuffleSampler(sizes, window=w, seed=1, rank=0, world_size=1, residency=False)
        row(f"memory {memory}: smstore window of {w} shards", np.asarray(list(s)))
        # Blocks of a fixed size, plain windows of them (spread 1) and spread as far as memory allows;
        # then blocks of memory / (2 x batch) records, the design's rule (docs/training.md).
        for b, most in ((block, False), (block, True), (max(1, memory // (2 * batch)), True)):
            spread = max(1, memory // b - 1) if most else 1
            name, order = block_order(sizes, memory, b, spread, 1)
            group = memory // ((spread + 1) * b)
            model = ""
            if group >= 1:
                m_spread, m_ratio = block_model(n, shards, batch, b, group, spread)
                model = f" (model: >= {m_spread:.1f} shards/batch, neighbour ratio {m_ratio:.3f})"
            row(f"memory {memory}: {name}", order, model)

        def sampler_row(b: int, what: str, memory: int) -> tuple[float, float, str] | None:
            """The block sampler itself (what a job runs) with blocks of at least `b` records and the
            widest spread the memory holds: spread + 2 groups (the window's, the next, one in the
            lag) and the rest of a block at each end, narrowed where the deal could not keep source
            neighbours apart (plan()'s rule, in records)."""
            longest = max(-(-x // max(1, x // b)) for x in sizes)
            spread = neighbour_spread((memory - 2 * longest) // b - 2, b)
            if spread < 1:
                report.add(
                    f"memory {memory}: smstore BlockWindowSampler, {what}", "skipped: fewer than 3 blocks fit"
                )
                return None
            sampler = BlockWindowSampler(
                sizes, block=b, spread=spread, seed=1, rank=0, world_size=1, residency=False
            )
            return row(
                f"memory {memory}: smstore BlockWindowSampler, {what}: blocks of {b}+ records, spread {spread} "
                f"(at most {(spread + 2) * b + 2 * longest} records held)",
                np.asarray(list(sampler)),
            )

        # Blocks of `block_bytes` at records of `record_bytes` (the acceptance row), of the same
        # bytes at records a quarter that size, and of memory / (2 x batch) records (the design's rule).
        per_block = -(-block_bytes // record_bytes)
        ours = sampler_row(
            per_block, f"{block_bytes // MiB} MiB blocks of {record_bytes // 1024} KiB records", memory
        )
        sampler_row(
            4 * per_block, f"{block_bytes // MiB} MiB blocks of {record_bytes // 4096} KiB records", memory
        )
        sampler_row(max(1, memory // (2 * batch)), "blocks of memory / (2 x batch) records", memory)
        wds = row(
            f"memory {memory}: WebDataset shard shuffle + _shuffle({memory})",
            webdataset_order(sizes, memory, 1),
        )
        mosaic = {
            algo: row(
                f"memory {memory}: Mosaic streaming {algo}, block {memory}",
                mosaic_order(sizes, algo, memory, 1),
            )
            for algo in ("py1br", "py1e")
        }
        py1e = mosaic["py1e"]
        if ours is not None and wds is not None and py1e is not None:
            met = ours[0] >= max(wds[0], py1e[0]) and ours[1] >= max(wds[1], py1e[1])
            report.add(
                f"memory {memory}: block sampler ({block_bytes // MiB} MiB blocks of {record_bytes // 1024} KiB "
                "records) against WebDataset and py1e (spread; neighbour ratio)",
                f"{ours[0]:.2f}; {ours[2]}",
                baseline=f"WebDataset {wds[0]:.2f}; {wds[1]:.3f}, py1e {py1e[0]:.2f}; {py1e[1]:.3f}",
                goal=">= both, each",
                met=yes_no(met),
            )
        else:
            report.add(
                f"memory {memory}: block sampler against WebDataset and py1e",
                "skipped: an anchor was not measured",
                goal=">= both, each",
                met="no",
            )
    report.notes.append(
        "ratios: spread = ours / global (1.0 = as many shards per batch as a global shuffle); "
        "neighbours = global rate / ours (1.0 = source neighbours no more often together than in a global shuffle)"
    )
    report.notes.append(
        "block schedule: smstore.sampling.orders.BlockWindowOrder (docs/training.md, 'Block windows'); "
        f"blocks of {block} records, and of memory / (2 x batch) records (the design's rule); spread 1 is plain "
        "windows of blocks, the larger spreads are the most that fit; the model (shards of equal size, the "
        "epoch's first and last windows left out) is printed beside what was measured"
    )


# ---- 2. loading a shard vs cp -----------------------------------------------------------------


def bench_load(report: Report, tmp: Path, mib: int, repeats: int) -> None:
    src = tmp / "load.txt"
    rng = np.random.default_rng(1)
    with open(src, "wb") as f:
        for _ in range(mib // 16):
            chunk = rng.integers(97, 123, size=16 * MiB, dtype=np.uint8)
            chunk[::200] = 10
            f.write(chunk.tobytes())
    blob = tmp / "load.smst"
    smstore.pack_files([src], blob, progress=False, durable=False)
    src.unlink()
    subprocess.run(["cat", os.fspath(blob)], stdout=subprocess.DEVNULL, check=True)
    target = Path("/dev/shm") / f"smstore-bench-cp-{os.getpid()}"
    name = f"/smstore-bench-load-{os.getpid()}"

    # CPU seconds of each run beside its wall time: what a run takes from the other processes of a
    # busy node, steadier than wall time where those processes decide who runs when.
    cpu: dict[str, list[float]] = {}

    def cpu_of(who: int) -> float:
        r = resource.getrusage(who)
        return r.ru_utime + r.ru_stime

    def cp() -> float:
        c, t = cpu_of(resource.RUSAGE_CHILDREN), time.perf_counter()
        subprocess.run(["cp", os.fspath(blob), os.fspath(target)], check=True)
        d = time.perf_counter() - t
        cpu.setdefault("cp", []).append(cpu_of(resource.RUSAGE_CHILDREN) - c)
        target.unlink()
        return d

    def load(hash_thread: bool = True) -> float:
        # RUSAGE_SELF: every thread of this process (the helper thread included); nothing else runs here.
        c, t = cpu_of(resource.RUSAGE_SELF), time.perf_counter()
        fd, *_ = _core.shm_load(os.fspath(blob), name, 0o400, -1, 0, hash_thread=hash_thread)
        d = time.perf_counter() - t
        cpu.setdefault("load" if hash_thread else "one thread", []).append(cpu_of(resource.RUSAGE_SELF) - c)
        os.close(fd)
        _core.shm_unlink(name)
        return d

    runs = {"cp": cp, "load": load, "one thread": lambda: load(hash_thread=False)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    # One core kept busy all along, as a training process would: a load must not need a spare core.
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for r in range(repeats):
            for k in list(runs)[r % 3 :] + list(runs)[: r % 3]:  # each goes first in turn
                times[k].append(runs[k]())
    finally:
        busy.kill()
        busy.wait()
        target.unlink(missing_ok=True)
        _core.shm_unlink(name)
    size = blob.stat().st_size / MiB
    med = {k: statistics.median(v) for k, v in times.items()}
    spread = {k: f"{min(v):.2f}-{max(v):.2f} s" for k, v in times.items()}

    def ratios(k: str) -> tuple[float, str]:
        """cp's time over k's in each round: their median, and their range."""
        r = [c / x for c, x in zip(times["cp"], times[k], strict=True)]
        return statistics.median(r), f"{min(r):.2f}-{max(r):.2f}x"

    ratio, ratio_spread = ratios("load")
    report.compare(
        f"load {size:.0f} MiB into /dev/shm with checksum, one core busy (median of {repeats} interleaved rounds "
        f"of cp's time / the load's; rounds {ratio_spread})",
        f"{size / med['load']:.0f} MiB/s ({spread['load']})",
        f"cp: {size / med['cp']:.0f} MiB/s ({spread['cp']})",
        ratio,
        ">= 1.0x",
        ratio >= 1.0,
    )
    one, one_spread = ratios("one thread")
    report.add(
        "info: the same load hashing on its copying thread alone (no helper thread: read, hash, write)",
        f"{size / med['one thread']:.0f} MiB/s ({spread['one thread']}; rounds {one_spread})",
        baseline=f"cp: {size / med['cp']:.0f} MiB/s",
        ratio=f"{one:.2f}x",
    )
    cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
    report.add(
        "info: CPU time of a run (user + system, every thread; median): the load's over cp's, "
        "and the same on one thread",
        f"load {cpu_med['load'] * 1000:.0f} ms, one thread {cpu_med['one thread'] * 1000:.0f} ms",
        baseline=f"cp: {cpu_med['cp'] * 1000:.0f} ms",
        ratio=f"{cpu_med['load'] / cpu_med['cp']:.2f}x, one thread {cpu_med['one thread'] / cpu_med['cp']:.2f}x",
    )


# ---- 3. one epoch, larger than the budget ------------------------------------------------------


def make_dataset(tmp: Path, total_mib: int, shards: int, seed: int) -> tuple[Path, list[int]]:
    """Lines of 512-2047 random printable bytes, packed into `shards` shards; their CRC32s."""
    rng = np.random.default_rng(seed)
    src = tmp / "epoch.txt"
    crcs: list[int] = []
    written = 0
    with open(src, "wb") as f:
        while written < total_mib * MiB:
            lengths = rng.integers(512, 2048, size=4096)
            data = rng.integers(32, 127, size=int(lengths.sum()), dtype=np.uint8).tobytes()
            pos = 0
            for length in lengths.tolist():
                rec = data[pos : pos + length]
                pos += length
                crcs.append(zlib.crc32(rec))
                f.write(rec + b"\n")
            written += pos + len(lengths)
    out = tmp / "epoch"
    smstore.pack_files([src], out, shard_size=-(-written // shards), progress=False, durable=False)
    src.unlink()
    # Written back now, not by the kernel's flusher threads during the epoch (a GiB written just
    # before: seconds of a core and of the disk, inside the measurement).
    os.sync()
    return out, crcs


def crc_collate(batch: list[Any]) -> list[int]:
    return [zlib.crc32(r) for r in batch]


class CountingReader:
    """A BlockReader whose items say where each record came from: the daemon's block, or the shard file."""

    def __init__(self, reader: BlockReader) -> None:
        self.reader = reader

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, i: int) -> tuple[bytes, bool]:
        before = self.reader.block_reads
        data = self.reader[i]
        return data, self.reader.block_reads > before


def crc_collate_counted(batch: list[tuple[bytes, bool]]) -> tuple[list[int], int]:
    """The records' CRC32s, and how many came from the daemon's blocks."""
    return [zlib.crc32(r) for r, _b in batch], sum(b for _r, b in batch)


def rank_child(args: argparse.Namespace) -> None:
    """One rank: a DataLoader over the dataset through the daemon; times every batch wait."""
    import torch

    ds: Any
    if args.block:  # the block sampler: pieces of shards held, records read through BlockReader
        sizes = [s.records for s in read_manifest(args.dataset).shards]
        block, spread = args.block
        sampler: Any = BlockWindowSampler(
            sizes, block=block, spread=spread, seed=args.seed, rank=args.rank_child, world_size=args.ranks,
            lag=args.lag, residency=Residency(args.dataset, mode="daemon"),
        )  # fmt: skip
        plain: Any = BlockWindowSampler(
            sizes, block=block, spread=spread, seed=args.seed, rank=args.rank_child, world_size=args.ranks,
            residency=False,
        )  # fmt: skip
        ds = CountingReader(BlockReader(args.dataset, block=block, keep=sampler.keep))
    else:
        ds = smstore.SharedStoreDataset(args.dataset, mode="daemon", decode=None)
        sampler = WindowedShuffleSampler(
            ds, window=args.window, seed=args.seed, rank=args.rank_child, world_size=args.ranks, lag=args.lag
        )
        plain = WindowedShuffleSampler(
            ds.shard_sizes, window=args.window, seed=args.seed, rank=args.rank_child, world_size=args.ranks
        )
    indices = list(plain)
    order = plain.permutation()
    loader = torch.utils.data.DataLoader(
        ds,
        sampler=sampler,
        batch_size=args.batch_size,
        num_workers=args.workers,
        collate_fn=crc_collate_counted if args.block else crc_collate,
        multiprocessing_context="fork",
        prefetch_factor=2,
        persistent_workers=False,
    )
    # The batch in which each window starts for this rank, and every batch's first window.
    waits: list[float] = []
    crcs: list[int] = []
    from_blocks = 0
    file_batches: list[int] = []  # batches with a record read from a shard file (the first 20)
    it = iter(loader)
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        waits.append(time.perf_counter() - t0)
        if args.block:
            batch, counted = batch
            from_blocks += counted
            if counted < len(batch) and len(file_batches) < 20:
                file_batches.append(len(waits) - 1)
        crcs += batch
        time.sleep(args.train_ms / 1000)
    n = len(ds)
    windows = [order.window_of((args.rank_child + i * args.ranks) % n) for i in range(len(indices))]
    firsts = [windows[b * args.batch_size] for b in range(len(waits))]
    sampler.close()
    Path(args.result).write_text(
        json.dumps(
            {
                "waits": waits,
                "crcs": crcs,
                "indices": indices,
                "windows": firsts,
                "from_blocks": from_blocks,
                "file_batches": file_batches,
            }
        )
    )


def shmem_bytes() -> int:
    """Every shared-memory page of the system (/proc/meminfo ``Shmem``), in bytes.

    It counts a segment as long as its pages exist: in /dev/shm, and after it is unlinked while
    any process still maps it (all its pages, not only those a process touched, which its PSS
    would count). Read against its value before the daemon starts, it is the memory the job's data
    takes. Reading it takes no lock of the job's processes, unlike /proc/PID/maps or smaps, which
    hold a process's mmap lock while they list it: a worker mapping its next shard meanwhile
    waits, and so does the training loop behind it.
    """
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no Shmem line")


def process_cpu_seconds(pid: int) -> float:
    """The CPU time (user and system, all threads) a live process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def daemon_segments(daemon_pid: int) -> int:
    """Bytes of the daemon's segments in /dev/shm (loads under way included)."""
    total = 0
    prefix = f"smstore-{os.getuid()}-{daemon_pid}-"
    for entry in os.scandir("/dev/shm"):
        if entry.name.startswith(prefix) and not entry.name.endswith("-lock"):
            with contextlib.suppress(OSError):
                total += entry.stat(follow_symlinks=False).st_blocks * 512
    return total


def run_epoch(
    tmp: Path,
    dataset: Path,
    budget: int,
    window: int,
    lag: int,
    args: argparse.Namespace,
    daemon_args: Sequence[str] = (),
    block: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """One epoch of R ranks through a fresh daemon (given `daemon_args` too): each rank's waits,
    records and memory samples."""
    run = Path(tempfile.mkdtemp(prefix="epoch-", dir=tmp))
    sock = run / "run" / "smstore.sock"
    sock.parent.mkdir(mode=0o700)
    env = {**os.environ, "SMSTORE_SOCKET": os.fspath(sock)}
    daemon_log = run / "daemon.log"
    shmem_before = shmem_bytes()
    with open(daemon_log, "wb") as err:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "smstore", "serve", "--shm-limit", str(budget),
             "--max-read-rate", str(args.read_rate_mib * MiB), *daemon_args],
            stderr=err, env=env,
        )  # fmt: skip
    ranks: list[subprocess.Popen[bytes]] = []
    samples: list[tuple[int, int]] = []  # (daemon's segments in /dev/shm, Shmem over its baseline)
    stop = threading.Event()
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            if time.monotonic() > deadline or daemon.poll() is not None:
                raise RuntimeError(daemon_log.read_text())
            time.sleep(0.05)
        results = [run / f"rank{r}.json" for r in range(args.ranks)]
        started = time.perf_counter()
        for r in range(args.ranks):
            cmd = [
                sys.executable, __file__, "--rank-child", str(r), "--dataset", os.fspath(dataset),
                "--result", os.fspath(results[r]), "--window", str(window), "--ranks", str(args.ranks),
                "--workers", str(args.workers), "--batch-size", str(args.batch_size),
                "--train-ms", str(args.train_ms), "--seed", str(args.seed), "--lag", str(lag),
                *(["--block", str(block[0]), str(block[1])] if block else []),
            ]  # fmt: skip
            ranks.append(subprocess.Popen(cmd, env=env))

        def watch() -> None:
            # The instrument must not compete with what it measures: it runs only where a core
            # would idle (a thread at nice 19 still takes whole slices from a rank on 2 cores).
            try:
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            except (AttributeError, OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            while not stop.is_set():
                samples.append((daemon_segments(daemon.pid), shmem_bytes() - shmem_before))
                time.sleep(0.1)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        for r in ranks:
            if r.wait(timeout=3600) != 0:
                raise RuntimeError(f"rank exited with {r.returncode}")
        elapsed = time.perf_counter() - started
        daemon_cpu = process_cpu_seconds(daemon.pid)
    finally:
        stop.set()
        for r in ranks:
            if r.poll() is None:
                r.kill()
                r.wait()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)
    return {
        "outs": [json.loads(p.read_text()) for p in results],
        "samples": samples,
        "elapsed": elapsed,
        "daemon_cpu": daemon_cpu,
        "daemon_log": daemon_log.read_text(errors="replace"),
    }


def switch_and_steady(
    outs: list[dict[str, Any]], switch_batches: int, startup: int = 1
) -> tuple[list[float], list[float]]:
    """Batch waits in the first `switch_batches` batches of each window after the first `startup`, and the others.

    The first `startup` windows are the start of the epoch, not switches: the window sampler's
    first window (nothing was loaded before it), the block sampler's first `spread` (the memory
    fills: they draw from fewer blocks than a full memory holds, and go by faster than blocks load).
    """
    switch, steady = [], []
    for o in outs:
        last = None
        since = 0
        for wait, win in zip(o["waits"], o["windows"], strict=True):
            since = 0 if win != last else since + 1
            last = win
            if win < o["windows"][0] + startup:
                continue  # startup, not a switch
            (switch if since < switch_batches else steady).append(wait)
    return switch, steady


def startup_waits(outs: list[dict[str, Any]], startup: int) -> tuple[int, float, float]:
    """Over the ranks: batches in the first `startup` windows, their total wait and their p99 (seconds)."""
    waits = [
        w
        for o in outs
        for w, win in zip(o["waits"], o["windows"], strict=True)
        if win < o["windows"][0] + startup
    ]
    return (
        len(waits),
        float(sum(waits)) / max(1, len(outs)),
        float(np.percentile(waits, 99)) if waits else 0.0,
    )


def epoch_criteria(
    report: Report,
    prefix: str,
    epoch: dict[str, Any],
    crcs: list[int],
    args: argparse.Namespace,
    startup: int = 1,
) -> None:
    """The epoch criteria of a run_epoch result: switch-batch wait, memory within the budget, every record once.

    `startup`: the windows at the start of the epoch that are not switches (see switch_and_steady).
    """
    outs, samples = epoch["outs"], epoch["samples"]
    budget = args.budget_mib * MiB
    # Every record once per epoch, byte-exact (CRC32 of every record read against the source's).
    seen = np.zeros(len(crcs), dtype=np.int64)
    bad = 0
    for o in outs:
        for i, c in zip(o["indices"], o["crcs"], strict=True):
            seen[i] += 1
            bad += c != crcs[i]
    exact = bad == 0 and bool((seen >= 1).all()) and int(seen.sum()) - len(crcs) < args.ranks
    switch, steady = switch_and_steady(outs, args.switch_batches, startup)
    p99 = {k: float(np.percentile(v, 99)) * 1000 for k, v in (("switch", switch), ("steady", steady))}
    ratio = p99["switch"] / p99["steady"]
    report.compare(
        f"{prefix}batch wait p99 in the first {args.switch_batches} batches of a window ({len(switch)} batches)",
        f"{p99['switch']:.2f} ms",
        f"steady p99 {p99['steady']:.2f} ms ({len(steady)} batches)",
        ratio,
        "<= 1.5x",
        ratio <= 1.5,
    )
    # A p99 over a few dozen batches is nearly their maximum: how far it strays with no switch at
    # all, over random samples of the steady batches of the same size.
    rng = np.random.default_rng(0)
    subsets = [
        float(np.percentile(rng.choice(steady, min(len(switch), len(steady)), replace=False), 99)) * 1000
        for _ in range(400)
    ]
    lo, mid, hi = np.percentile(subsets, [5, 50, 95])
    report.add(
        f"{prefix}info: p99 of {len(switch)} steady batches drawn at random (400 draws)",
        f"median {mid:.2f} ms (5-95 %: {lo:.2f}-{hi:.2f} ms)",
        baseline=f"steady p99 {p99['steady']:.2f} ms",
        ratio=f"{mid / p99['steady']:.2f}x ({lo / p99['steady']:.2f}-{hi / p99['steady']:.2f}x)",
    )
    peak_shm = max(s for s, _ in samples)
    peak_data = max(d for _, d in samples)
    report.compare(
        f"{prefix}data memory, peak of {len(samples)} samples (the system's shared memory over its value before the "
        "daemon started: loads under way and segments unlinked but still mapped included)",
        f"{peak_data / MiB:.1f} MiB (/dev/shm alone {peak_shm / MiB:.1f} MiB)",
        f"budget {args.budget_mib} MiB",
        peak_data / budget,
        "<= 1.05x",
        peak_data <= 1.05 * budget,
    )
    report.add(
        f"{prefix}every record read exactly once, byte-exact (CRC32)",
        f"{len(crcs)} records, {bad} mismatches, {int((seen == 0).sum())} missed",
        goal="all",
        met=yes_no(exact),
    )


def bench_epoch(report: Report, tmp: Path, args: argparse.Namespace) -> None:
    budget = args.budget_mib * MiB
    dataset, crcs = make_dataset(tmp, args.data_mib or 3 * args.budget_mib, args.shards, args.seed)
    manifest = read_manifest(dataset)
    data_bytes = sum(s.file_size for s in manifest.shards)
    window = WindowedShuffleSampler.window_for(dataset, budget)
    log(
        f"dataset {data_bytes / MiB:.0f} MiB in {len(manifest.shards)} shards; budget {args.budget_mib} MiB; window {window}"
    )
    epoch = run_epoch(tmp, dataset, budget, window, args.lag, args)
    outs, elapsed = epoch["outs"], epoch["elapsed"]
    epoch_criteria(report, "", epoch, crcs, args)
    first_wait = outs[0]["waits"][0]
    report.add(
        "epoch",
        f"{elapsed:.1f} s, {data_bytes / MiB / elapsed:.0f} MiB/s; first batch after {first_wait * 1000:.0f} ms",
    )
    least = 2 * 2 * args.workers * args.batch_size  # prefetch_factor (2) x workers x batch, twice over
    if args.least_lag and least != args.lag:
        # The same epoch with the previous window released as early as is safe: its release (the
        # daemon freeing a window's pages, the next loads starting) lands in the switch batches.
        log(f"epoch again with lag {least}")
        again = run_epoch(tmp, dataset, budget, window, least, args)
        sw, st = switch_and_steady(again["outs"], args.switch_batches)
        a, b = float(np.percentile(sw, 99)) * 1000, float(np.percentile(st, 99)) * 1000
        report.add(
            f"info: the same, with the sampler's lag at its least ({least} samples: the previous window "
            f"released within the first {args.switch_batches} batches)",
            f"switch p99 {a:.2f} ms",
            baseline=f"steady p99 {b:.2f} ms",
            ratio=f"{a / b:.2f}x",
        )
    report.notes.append(
        f"epoch: {data_bytes / MiB:.0f} MiB in {len(manifest.shards)} shards, budget {args.budget_mib} MiB "
        f"(window of {window} shards), daemon reads at most {args.read_rate_mib} MiB/s; R={args.ranks} x "
        f"K={args.workers}, batch {args.batch_size}, {args.train_ms} ms of 'training' a batch; the sampler's "
        f"lag {args.lag} samples (the previous window is released that far into the next)"
    )


def bench_epoch_blocks(report: Report, tmp: Path, args: argparse.Namespace) -> None:
    """The epoch of bench_epoch with BlockWindowSampler: the daemon holds pieces of shards, not shards."""
    budget = args.budget_mib * MiB
    # Shards larger than blocks, as in practice (256 MiB - 1 GiB shards, 4-64 MiB blocks): a block
    # split at a shard's end is read as two pieces, and the window sampler's small shards would
    # split most blocks. The same bytes as the window epoch, in a sixth as many shards.
    shards = max(1, args.shards // 6)
    dataset, crcs = make_dataset(tmp, args.data_mib or 3 * args.budget_mib, shards, args.seed + 1)
    manifest = read_manifest(dataset)
    data_bytes = sum(s.file_size for s in manifest.shards)
    block, spread = BlockWindowSampler.plan(dataset, budget, block_bytes=args.block_mib * MiB)
    lag = 2 * 2 * args.workers * args.batch_size  # prefetch_factor (2) x workers x batch, twice over
    log(f"blocks of {block} records, spread {spread}, lag {lag}")
    epoch = run_epoch(tmp, dataset, budget, 0, lag, args, block=(block, spread))
    outs, elapsed = epoch["outs"], epoch["elapsed"]
    # The first `spread` windows are the fill (each draws from fewer blocks than the memory holds,
    # and goes by faster than a block loads): the start of the epoch, as the window sampler's first.
    epoch_criteria(report, "blocks: ", epoch, crcs, args, startup=spread)
    batches, total, p99 = startup_waits(outs, spread)
    report.add(
        f"blocks: info: the fill (the first {spread} windows, {batches} batches of {len(outs)} ranks)",
        f"waited {total * 1000:.0f} ms a rank in all, p99 {p99 * 1000:.1f} ms; first batch after "
        f"{outs[0]['waits'][0] * 1000:.0f} ms",
    )
    # The reads: one per block (a piece of one shard), each sequential, each once.
    first, length, shard = block_bounds([s.records for s in manifest.shards], block)
    starts = [0, *np.cumsum([s.records for s in manifest.shards]).tolist()]
    offsets = []
    for k in range(len(manifest.shards)):
        with smstore._core.Store(manifest.shard_path(k)) as st:
            offsets.append(st.offsets)
    piece_bytes = [
        int(offsets[k][f - starts[k] + n] - offsets[k][f - starts[k]])
        for f, n, k in zip(first.tolist(), length.tolist(), shard.tolist(), strict=True)
    ]
    big = [x for x in piece_bytes if x >= args.block_mib * MiB]
    report.add(
        f"blocks: reads (one sequential read a block, each within one shard), >= {args.block_mib} MiB",
        f"{len(piece_bytes)} blocks: {len(big)} reads >= {args.block_mib} MiB carrying "
        f"{sum(big) / sum(piece_bytes):.0%} of the bytes; blocks {min(piece_bytes) / MiB:.2f}-"
        f"{max(piece_bytes) / MiB:.2f} MiB (median {np.median(piece_bytes) / MiB:.2f})",
        goal=f"every read >= {args.block_mib} MiB",
        met=yes_no(len(big) == len(piece_bytes)),
    )
    # Where the ranks' records came from: the daemon's blocks, or (a record at a time, at random
    # places) the shard files, when a block was not there.
    read = sum(len(o["crcs"]) for o in outs)
    blocks_read = sum(o["from_blocks"] for o in outs)
    report.add(
        "blocks: records the workers read from the daemon's blocks (the rest: single records read from the shard files)",
        f"{blocks_read} of {read} ({blocks_read / max(1, read):.2%}); from the files: {read - blocks_read}"
        + (
            f" (in batches {sorted({b for o in outs for b in o['file_batches']})[:10]})"
            if read > blocks_read
            else ""
        ),
        goal="all from blocks: the source is read only in sequential block reads",
        met=yes_no(blocks_read == read),
    )
    # Each byte read once: the daemon's log has one "loaded PATH#records=A-B" line a piece it read.
    loaded = [line for line in epoch["daemon_log"].splitlines() if " loaded " in line and "#records=" in line]
    read_once = len(loaded) == len(piece_bytes) and len(
        {line.split(" loaded ")[1].split(":")[0] for line in loaded}
    ) == len(loaded)
    report.add(
        "blocks: pieces read by the daemon (each byte read once an epoch: read amplification 1.0)",
        f"{len(loaded)} reads of {len(piece_bytes)} pieces, {sum(piece_bytes) / MiB:.0f} MiB",
        goal="each piece once",
        met=yes_no(read_once),
    )
    report.add(
        "blocks: epoch",
        f"{elapsed:.1f} s, {data_bytes / MiB / elapsed:.0f} MiB/s; first batch after {outs[0]['waits'][0] * 1000:.0f} ms",
    )
    report.notes.append(
        f"blocks: the same epoch with BlockWindowSampler.plan(budget, {args.block_mib} MiB): blocks of {block} "
        f"records at least, spread {spread} (spread + 2 groups of {block} records held: the window's, the next, one "
        f"in the lag; and the rest of a block at each end), lag {lag} samples, over {data_bytes / MiB:.0f} MiB in "
        f"{len(manifest.shards)} shards; the daemon loads each block as its own segment (smstore/daemon/blocks.py), "
        "readers read through smstore.wire.blocks.BlockReader; a window is about one block of positions, so the 'first "
        f"{args.switch_batches} batches of a window' are a third of all; the first {spread} windows are the fill "
        "(the memory filling: each draws from fewer blocks than it holds, and goes by faster than a block loads), "
        "counted as the start of the epoch, as the window sampler's first window is"
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smaller run (about a minute)")
    p.add_argument("--only", action="append", choices=["quality", "load", "epoch", "blocks"])
    p.add_argument("--out", type=Path, default=RESULTS / "windowed.md")
    p.add_argument("--tmpdir", type=Path)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--budget-mib", type=int, default=160)
    p.add_argument("--shards", type=int, default=48)
    p.add_argument("--data-mib", type=int, default=0, help="dataset size (default: 3x the budget)")
    p.add_argument("--read-rate-mib", type=int, default=100, help="the daemon's --max-read-rate (MiB/s)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--train-ms", type=float, default=4.0)
    p.add_argument("--switch-batches", type=int, default=8)
    p.add_argument(
        "--lag",
        type=int,
        default=inspect.signature(WindowedShuffleSampler).parameters["lag"].default,
        help="the sampler's lag (default: its default)",
    )
    p.add_argument(
        "--no-least-lag",
        dest="least_lag",
        action="store_false",
        help="skip the second epoch, with the least safe lag",
    )
    p.add_argument(
        "--block-records",
        type=int,
        default=64,
        help="records a block in the block schedule's fixed-size rows",
    )
    p.add_argument("--load-mib", type=int, default=1024)
    p.add_argument("--load-repeats", type=int, default=15)
    # One rank of the epoch section (run by the benchmark itself).
    p.add_argument("--rank-child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--dataset", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--window", type=int, help=argparse.SUPPRESS)
    p.add_argument("--block", type=int, nargs=2, help=argparse.SUPPRESS)  # block records, spread
    p.add_argument("--block-mib", type=int, default=4, help="the block sampler's blocks, at least (MiB)")
    p.add_argument(
        "--record-kib",
        type=int,
        default=64,
        help="the shuffle-quality section's record size (KiB): its memory sizes are in records, so a "
        "block of --block-mib is this many records",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.budget_mib, args.shards, args.load_mib, args.load_repeats = 48, 24, 256, 9
        args.lag = min(args.lag, 2048)  # windows of ~20000 samples: the lag stays under a quarter
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank_child is not None:
        rank_child(args)
        return 0
    sections = set(args.only or ["quality", "load", "epoch", "blocks"])
    report = Report()
    started = time.perf_counter()
    with temp_dir(args.tmpdir) as tmp:
        header = machine_info(tmp)
        if "quality" in sections:
            log("shuffle quality")
            bench_quality(
                report,
                shards=200,
                per_shard=1000,
                batch=args.batch_size * 4,
                windows=[1, 4, 16],
                block=args.block_records,
                block_bytes=args.block_mib * MiB,
                record_bytes=args.record_kib * 1024,
            )
        if "load" in sections:
            log("load vs cp")
            bench_load(report, tmp, args.load_mib, args.load_repeats)
        if "epoch" in sections:
            log("epoch")
            bench_epoch(report, tmp, args)
        if "blocks" in sections:
            log("epoch through blocks")
            bench_epoch_blocks(report, tmp, args)
    cmd = command_line("python benchmarks/bench_windowed.py", argv)
    write_results(
        args.out,
        "Larger than RAM: windows of shards",
        [
            f"`{cmd}` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {time.perf_counter() - started:.0f} s."
        ],
        header,
        report,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
