"""Decoded once per node (issue 38): TransformLoader(cache="node") against the uncached loader; the cache's memory.

    python benchmarks/bench_cache.py [--images 4096] [--workers 2] [--out benchmarks/results/cache.md]

One run over one blob of bench_transform's JPEGs, read from its file (mode="mmap"), so that the
daemon's shared memory is the cache's alone; each section has a daemon of its own (``smstore
serve`` on a socket in a temp dir), so each measures one cache from empty. ``prepare`` is
bench_transform's decode (Pillow decode, resize to 64x64), timed inside every process that runs it;
``transform`` is a random flip and crop-and-pad, run on every sample of every epoch.

1. Throughput: the uncached loader, then the cached one epoch by epoch (samples/s, decode CPU,
   the workers' CPU), and a pass of each from the same seed, byte-compared.
2. Memory: the cache's PSS over 2 ranks x 4 workers, and over 2 concurrent jobs, against one
   decoded copy.
3. A cache at 30 % of the decoded size (``--shm-limit``): hit rate, memory, every sample checked.

What each row means: the notes under the table in benchmarks/results/cache.md.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from bench_core import MiB, Report, command_line, how_run, log, machine_info, temp_dir, write_results, yes_no
from bench_transform import OUT, SIDE, decode, make_jpeg
from contenders import daemon
from procs import cpu_seconds, descendants, mapping_pss, pss_bytes

import smstore
from smstore.wire.client import daemon_request

RESULTS = Path(__file__).parent / "results"
TITLE = "Decoded samples cached once per node: TransformLoader(cache='node')"
SECTIONS = ("throughput", "memory", "budget")
SAMPLE_BYTES = OUT * OUT * 3  # one decoded sample: OUT x OUT RGB uint8
PAD = 8  # the crop-and-pad moves an image by up to PAD pixels each way
# How the daemon names a cache's memfds (smstore/daemon/caches.py: smstore-cache-ID-PART-RANDOM,
# ID the cache's first 12 hex digits): every mapping of the cache, in the daemon and in each
# client, shows it in /proc/PID/smaps as /memfd:NAME.
CACHE_MAPPING = "smstore-cache-{id12}-"
COUNTS = ("hits", "fills", "waits", "uncached")
METER_ENV = "SMSTORE_BENCH_DECODE_METER"  # the directory of the processes' decode counters

# -- the pipeline ---------------------------------------------------------------------------------------


class DecodeMeter:
    """Each process's decode CPU seconds and calls, in a file of its own that the benchmark sums.

    A class, because DecodedCache's identity digests ``prepare``'s code and the values of the globals
    it names: a module-level dict of counters, changing with every decode, would give each process
    that computes the identity (each rank, each job) a cache of its own. Of a class the digest sees
    the methods only.
    """

    files: ClassVar[dict[int, Any]] = {}  # pid -> this process's counter file (a fork child makes its own)

    @staticmethod
    def add(seconds: float) -> None:
        pid = os.getpid()
        counter = DecodeMeter.files.get(pid)
        if counter is None:
            path = Path(os.environ[METER_ENV]) / f"{pid}.f64"
            path.write_bytes(bytes(16))
            counter = DecodeMeter.files[pid] = np.memmap(path, dtype=np.float64, mode="r+", shape=(2,))
        counter[0] += seconds
        counter[1] += 1

    @staticmethod
    def totals() -> tuple[float, int]:
        """CPU seconds inside decode and its calls so far, summed over every process of this run."""
        cpu, calls = 0.0, 0.0
        for path in Path(os.environ[METER_ENV]).glob("*.f64"):
            counter = np.fromfile(path, dtype=np.float64)
            if counter.size == 2:
                cpu, calls = cpu + float(counter[0]), calls + float(counter[1])
        return cpu, int(calls)


def timed_decode(record: bytes) -> np.ndarray[Any, Any]:
    """The cached part (``prepare``): bench_transform's decode, its CPU seconds (this thread's)
    and its calls counted by DecodeMeter."""
    start = time.thread_time()
    image = decode(record)
    DecodeMeter.add(time.thread_time() - start)
    return image


def augment(image: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The random part, run on every sample every epoch: a horizontal flip half of the time, then
    the image moved by up to PAD pixels each way with zeros filled in (a random crop of the padded
    image, as torchvision's RandomCrop(padding=PAD)). Python's ``random``: the loader seeds it per worker."""
    if random.random() < 0.5:
        image = image[:, ::-1]
    dy, dx = random.randint(-PAD, PAD), random.randint(-PAD, PAD)
    h, w = image.shape[:2]
    out = np.zeros_like(image)
    out[max(dy, 0) : h + min(dy, 0), max(dx, 0) : w + min(dx, 0)] = image[
        max(-dy, 0) : h + min(-dy, 0), max(-dx, 0) : w + min(-dx, 0)
    ]
    return out


def make_loader(
    dataset: Any, args: argparse.Namespace, sock: Path, *, cache: bool, transform: Any = augment, **kw: Any
) -> Any:
    """``TransformLoader(prepare=timed_decode, transform=augment)``, through the node cache or not."""
    return smstore.TransformLoader(
        dataset,
        transform,
        prepare=timed_decode,
        cache="node" if cache else None,
        socket=sock,
        batch_size=args.batch_size,
        num_workers=args.workers,
        multiprocessing_context=args.context,
        **kw,
    )


def open_images(path: Path) -> Any:
    # From the file, never the daemon's copy: the daemon's shared memory is the cache's alone.
    return smstore.SharedStoreDataset(path, decode="bytes", mode="mmap")


# -- the daemon's side ----------------------------------------------------------------------------------


def cache_entries(sock: Path) -> list[dict[str, Any]]:
    """The daemon's ``status`` entries of its caches of decoded samples."""
    caches: list[dict[str, Any]] = daemon_request({"op": "status"}, sock)["decoded_caches"]
    return caches


def cache_counts(sock: Path) -> dict[str, int]:
    """Hits, fills, waits and uncached so far, summed over the daemon's caches."""
    caches = cache_entries(sock)
    return {k: sum(int(c.get(k, 0)) for c in caches) for k in COUNTS}


def the_cache(sock: Path) -> dict[str, Any]:
    """The daemon's ``status`` entry of its one cache (each section's daemon has one)."""
    caches = cache_entries(sock)
    if len(caches) != 1:
        raise RuntimeError(f"the daemon has {len(caches)} caches, not 1: {[c['id'][:12] for c in caches]}")
    return caches[0]


def cache_pss(pids: Sequence[int], entry: dict[str, Any]) -> int:
    """PSS of the mappings of the cache of ``entry`` (meta page and chunks) summed over ``pids`` (bytes)."""
    name = CACHE_MAPPING.format(id12=entry["id"][:12])
    return sum(mapping_pss(pid, name) for pid in pids)


# -- one pass -------------------------------------------------------------------------------------------


@dataclass
class Pass:
    """What one pass of a loader cost: wall time, samples, decode CPU and calls (every process),
    the workers' CPU (/proc/PID/stat) and the daemon's counts in this pass."""

    seconds: float
    samples: int
    decode_cpu: float
    decodes: int
    worker_cpu: float
    counts: dict[str, int] = field(default_factory=dict)
    digest: str = ""

    @property
    def rate(self) -> float:
        return self.samples / self.seconds

    def cell(self) -> str:
        counts = (
            ", ".join(f"{k} {self.counts.get(k, 0)}" for k in COUNTS) if any(self.counts.values()) else ""
        )
        return (
            f"{self.rate:,.0f} samples/s; decode CPU {self.decode_cpu:.3f} s ({self.decodes} decodes); "
            f"workers' CPU {self.worker_cpu:.2f} s" + (f"; {counts}" if counts else "")
        )


def run_pass(loader: Any, sock: Path, daemon_pid: int, *, hashed: bool = False) -> Pass:
    """One pass over ``loader``, its workers started before the clock (a first pass starts them in ``iter``)."""
    it = iter(loader)
    not_workers = {os.getpid(), *descendants([daemon_pid])}
    workers = [p for p in descendants([os.getpid()]) if p not in not_workers]
    counts0, (cpu0, calls0), workers0 = cache_counts(sock), DecodeMeter.totals(), cpu_seconds(workers)
    digest = hashlib.blake2b(digest_size=16)
    samples = 0
    start = time.perf_counter()
    for batch in it:
        samples += len(batch)
        if hashed:
            digest.update(batch.numpy())
    seconds = time.perf_counter() - start
    counts1, (cpu1, calls1) = cache_counts(sock), DecodeMeter.totals()
    return Pass(
        seconds,
        samples,
        cpu1 - cpu0,
        calls1 - calls0,
        cpu_seconds(workers) - workers0,
        {k: counts1[k] - counts0[k] for k in COUNTS},
        digest.hexdigest() if hashed else "",
    )


def mismatches(dataset: Any, args: argparse.Namespace, sock: Path) -> tuple[int, int]:
    """(samples that differ, samples): every record through the cache (a loader with ``prepare``
    alone, in index order) against a direct ``decode`` of its JPEG here."""
    bad = i = 0
    with make_loader(dataset, args, sock, cache=True, transform=None) as loader:
        for batch in loader:
            for row in batch.numpy():
                bad += not np.array_equal(row, decode(dataset[i]))
                i += 1
    return bad, i


# -- 1. throughput and decode CPU ------------------------------------------------------------------------


def throughput(report: Report, path: Path, args: argparse.Namespace, tmp: Path) -> None:
    import torch

    images = open_images(path)
    n = len(images)
    sock = tmp / "throughput.sock"
    # Each loader's last pass is hashed, the same pass number from the same seed: a cached pass
    # must give the bytes an uncached one gives.
    before_hash = max(1 + args.repeats, args.epochs)
    with daemon(sock) as d:
        torch.manual_seed(0)
        with make_loader(images, args, sock, cache=False) as loader:
            log("uncached: a first pass (as fresh as the cached epoch 1), then the timed ones")
            first = run_pass(loader, sock, d.pid)
            plain = [run_pass(loader, sock, d.pid) for _ in range(args.repeats)]
            for _ in range(before_hash - 1 - args.repeats):
                run_pass(loader, sock, d.pid)
            plain_hash = run_pass(loader, sock, d.pid, hashed=True).digest
        torch.manual_seed(0)
        with make_loader(images, args, sock, cache=True) as loader:
            log("cached: epoch by epoch")
            cached = [run_pass(loader, sock, d.pid) for _ in range(args.epochs)]
            for _ in range(before_hash - args.epochs):
                run_pass(loader, sock, d.pid)
            cached_hash = run_pass(loader, sock, d.pid, hashed=True).digest
            pids = descendants([os.getpid()])
            entry = the_cache(sock)
            pss = cache_pss(pids, entry)
        bad, checked = mismatches(images, args, sock)
    plain.sort(key=lambda p: p.seconds)
    base = plain[len(plain) // 2]
    k, b = args.workers, args.batch_size
    report.add(
        f"1. uncached TransformLoader(prepare=decode, transform=augment), {k} workers, batch {b} "
        f"(the median of {args.repeats} passes)",
        base.cell(),
    )
    report.add("1. uncached, its first pass (new workers, as the cached epoch 1)", first.cell())
    for e, p in enumerate(cached, 1):
        report.add(f'1. cache="node", epoch {e}', p.cell())
    e1, e2 = cached[0], cached[1]
    report.compare(
        "1. decode CPU, cached epoch 2 / epoch 1",
        f"{e2.decode_cpu:.3f} s",
        f"epoch 1 {e1.decode_cpu:.3f} s",
        e2.decode_cpu / max(e1.decode_cpu, 1e-9),
        "<= 0.1x",
        e2.decode_cpu <= 0.1 * e1.decode_cpu,
    )
    ratio = e2.rate / base.rate
    report.compare(
        "1. samples/s, cached epoch 2 / uncached",
        f"{e2.rate:,.0f}",
        f"uncached {base.rate:,.0f}",
        ratio,
        ">= 5x",
        ratio >= 5,
    )
    if len(cached) > 2:
        report.add(
            "1. samples/s, cached epochs 2.. (median) / uncached",
            f"{statistics.median(p.rate for p in cached[1:]):,.0f}",
            baseline=f"uncached {base.rate:,.0f}",
            ratio=f"{statistics.median(p.rate for p in cached[1:]) / base.rate:.2f}x",
        )
    report.add(
        f"1. pass {before_hash + 1} from torch.manual_seed(0), cached vs uncached: batches byte-identical",
        yes_no(plain_hash == cached_hash),
        goal="yes",
        met=yes_no(plain_hash == cached_hash),
    )
    report.add(
        "1. samples read through the cache that differ from a direct decode",
        f"{bad} of {checked}",
        goal="0",
        met=yes_no(bad == 0 and checked == n),
    )
    copy = n * SAMPLE_BYTES
    report.add(
        f"1. the cache's PSS (this process, its {k} workers, the daemon) / one decoded copy; daemon's bytes",
        f"{pss / MiB:.1f} MiB; status bytes {entry['bytes'] / MiB:.1f} MiB",
        baseline=f"one copy {copy / MiB:.1f} MiB",
        ratio=f"{pss / copy:.3f}x",
    )


# -- 2. memory over ranks and jobs ------------------------------------------------------------------------


def rank_main(spec: dict[str, Any]) -> None:
    """A rank or a job: one cached epoch of its share, then wait to be measured (stdin closed)."""
    import torch

    args = argparse.Namespace(**spec["args"])
    images = open_images(Path(spec["path"]))
    sampler = smstore.GlobalShuffleSampler(len(images), seed=1, rank=spec["rank"], world_size=spec["world"])
    torch.manual_seed(spec["rank"])
    with make_loader(images, args, Path(spec["socket"]), cache=True, sampler=sampler) as loader:
        it = iter(loader)  # the workers start
        print("ready", flush=True)
        if sys.stdin.readline() != "go\n":  # every rank starts together: they race for the same records
            return  # the benchmark gave up (another rank failed)
        start, samples = time.perf_counter(), 0
        for batch in it:
            samples += len(batch)
        print(json.dumps({"seconds": time.perf_counter() - start, "samples": samples}), flush=True)
        sys.stdin.read()


def concurrent(
    args: argparse.Namespace, path: Path, sock: Path, world: int, daemon_pid: int
) -> dict[str, Any]:
    """2 processes (ranks of a world of ``world``, or whole jobs with ``world=1``), each with
    ``--rank-workers`` workers, through one epoch; their memory measured while all are alive."""
    spec_args = {**vars(args), "workers": args.rank_workers, "out": None, "tmpdir": None, "only": None}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--rank-main", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for spec in (
            {
                "path": os.fspath(path),
                "socket": os.fspath(sock),
                "rank": r % world,
                "world": world,
                "args": spec_args,
            }
            for r in range(2)
        )
    ]
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
                raise RuntimeError("a rank failed to start (its traceback is above)")
        for p in procs:
            p.stdin.write("go\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        done = [json.loads(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]
        pids = [daemon_pid, *descendants([p.pid for p in procs])]
        figures = {
            "cache_pss": cache_pss(pids, the_cache(sock)),
            "pss": sum(pss_bytes(pid) for pid in pids),
            "processes": len(pids),
            "rates": [d["samples"] / d["seconds"] for d in done],
            "samples": sum(d["samples"] for d in done),
        }
    finally:
        for p in procs:
            with contextlib.suppress(OSError, ValueError):
                p.communicate("", timeout=60)
    return figures


def memory(report: Report, path: Path, args: argparse.Namespace, tmp: Path) -> None:
    n = len(open_images(path))
    copy = n * SAMPLE_BYTES
    kr = args.rank_workers
    cases = [
        ("2a", 2, f"2 ranks x {kr} workers, an epoch each (half the records each)"),
        ("2b", 1, f"2 concurrent jobs of {kr} workers, an epoch each (every record each)"),
    ]
    for tag, world, what in cases:
        log(f"{tag}: {what}")
        sock = tmp / f"{tag}.sock"
        with daemon(sock) as d:
            decodes0 = DecodeMeter.totals()[1]
            fig = concurrent(args, path, sock, world, d.pid)
            decodes = DecodeMeter.totals()[1] - decodes0
            entry = the_cache(sock)
        ratio = fig["cache_pss"] / copy
        report.compare(
            f"{tag}. {what}: the cache's PSS over every process ({fig['processes']}, the daemon included) "
            "/ one decoded copy",
            f"{fig['cache_pss'] / MiB:.1f} MiB (status bytes {entry['bytes'] / MiB:.1f} MiB)",
            f"one copy {copy / MiB:.1f} MiB",
            ratio,
            "<= 1.05x",
            ratio <= 1.05,
        )
        report.add(
            f"{tag}. decodes over the node (every process) and the daemon's fills, against the records",
            f"{decodes} decodes; fills {entry['fills']}, hits {entry['hits']}, waits {entry['waits']}, "
            f"uncached {entry['uncached']}; {fig['samples']} samples read",
            baseline=f"{n} records",
            goal=f"fills = {n}",
            met=yes_no(entry["fills"] == n),
        )
        report.add(
            f"{tag}. for context: the whole PSS of those processes; each one's samples/s",
            f"{fig['pss'] / MiB:.0f} MiB; " + ", ".join(f"{r:,.0f}" for r in fig["rates"]),
        )


# -- 3. a cache at 30 % of the decoded size ----------------------------------------------------------------


def budget(report: Report, path: Path, args: argparse.Namespace, tmp: Path) -> None:
    images = open_images(path)
    n = len(images)
    limit = int(args.fraction * n * SAMPLE_BYTES)
    sock = tmp / "budget.sock"
    with daemon(sock, options=("--shm-limit", str(limit))) as d:
        sampler = smstore.GlobalShuffleSampler(n, seed=1, rank=0, world_size=1)
        with make_loader(images, args, sock, cache=True, sampler=sampler) as loader:
            e1, e2 = run_pass(loader, sock, d.pid), run_pass(loader, sock, d.pid)
            entry = the_cache(sock)
            pss = cache_pss(descendants([os.getpid()]), entry)
        bad, checked = mismatches(images, args, sock)
    pct = f"{args.fraction:.0%}"
    report.add(f"3. {pct} cache, epoch 1", e1.cell())
    report.add(f"3. {pct} cache, epoch 2", e2.cell())
    c = e2.counts
    hit_rate = c["hits"] / max(1, c["hits"] + c["fills"] + c["uncached"])
    held = (
        entry["ready"] / n
    )  # the records of the chunks held (the last chunk holds fewer), all filled by epoch 1
    report.compare(
        f"3. {pct} cache: epoch 2's hit rate (hits / (hits + fills + uncached)) / the records held",
        f"{hit_rate:.3f}",
        f"held {held:.3f} ({entry['ready']} records ready in {entry['held']} of {entry['chunks']} chunks of "
        f"{entry['rows']} rows)",
        hit_rate / held if held else float("nan"),
        "0.95-1.05x",
        held > 0 and abs(hit_rate / held - 1) <= 0.05,
    )
    for label, value in (
        ("PSS of its mappings, every process", pss),
        ("the daemon's status bytes", entry["bytes"]),
    ):
        report.compare(
            f"3. {pct} cache's memory: {label} / --shm-limit",
            f"{value / MiB:.1f} MiB",
            f"limit {limit / MiB:.1f} MiB",
            value / limit,
            "<= 1.05x",
            value <= 1.05 * limit,
        )
    report.add(
        f"3. {pct} cache: samples read through it that differ from a direct decode",
        f"{bad} of {checked}; evictions {entry['evictions']}",
        goal="0",
        met=yes_no(bad == 0 and checked == n),
    )


# -- the run -------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=4096)
    p.add_argument("--workers", type=int, default=2, help="the loader's workers in sections 1 and 3")
    p.add_argument("--rank-workers", type=int, default=4, help="each rank's or job's workers in section 2")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed passes of the uncached loader")
    p.add_argument("--epochs", type=int, default=3, help="timed epochs of the cached loader (at least 2)")
    p.add_argument("--fraction", type=float, default=0.3, help="section 3's --shm-limit / the decoded size")
    p.add_argument("--context", default="fork", choices=["fork", "spawn", "forkserver"])
    p.add_argument("--only", action="append", choices=SECTIONS, help="run these sections only")
    p.add_argument("--tmpdir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=RESULTS / "cache.md")
    p.add_argument("--rank-main", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.epochs < 2:
        p.error("--epochs must be at least 2 (epoch 2 is the one measured)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank_main:
        rank_main(json.loads(args.rank_main))
        return 0
    try:
        import PIL
    except ImportError:
        sys.exit("bench_cache: Pillow is not installed (pip install pillow, or the bench extra)")
    import torch

    report = Report()
    started, load_before = time.perf_counter(), os.getloadavg()
    sections = args.only or SECTIONS
    with temp_dir(args.tmpdir) as tmp:
        header = machine_info(tmp)
        os.environ[METER_ENV] = os.fspath(tmp / "meter")
        (tmp / "meter").mkdir()
        path = tmp / "jpegs.smst"
        log(f"packing {args.images} JPEGs of {SIDE}x{SIDE}")
        smstore.pack((make_jpeg(i) for i in range(args.images)), path, durable=False)
        size = path.stat().st_size / MiB
        for name, section in (("throughput", throughput), ("memory", memory), ("budget", budget)):
            if name in sections:
                log(f"section: {name}")
                section(report, path, args, tmp)
    copy = args.images * SAMPLE_BYTES / MiB
    report.notes += [
        (
            f"{args.images} JPEGs of {SIDE}x{SIDE} RGB (blob {size:.1f} MiB, read from its file); `prepare` decodes "
            f"with Pillow {PIL.__version__} and resizes to {OUT}x{OUT} (one decoded copy: {args.images} x "
            f"{SAMPLE_BYTES} bytes = {copy:.1f} MiB); `transform` flips half the images and moves them by up to "
            f"{PAD} pixels each way (crop-and-pad), with Python's random; batch {args.batch_size}, start method "
            f"{args.context}, the order of a GlobalShuffleSampler (seed 1). torch {torch.__version__}."
        ),
        (
            "Rows per pass: samples/s (wall time of the pass, workers started before it); decode CPU: the "
            "seconds of thread CPU inside decode summed over every process (each adds its own to a counter "
            "file), and how many decodes ran; the workers' CPU: utime + stime of the worker processes "
            "(/proc/PID/stat, 10 ms ticks); hits, fills, waits and uncached: the daemon's status for the "
            "cache over the pass."
        ),
        (
            "1: one daemon. The uncached loader runs a first pass, then the timed ones (the row is the "
            "median); the cached loader, new workers and an empty cache, runs epoch 1 (each record decoded "
            "once and written into the cache; record 0 was decoded when the loader was made, to learn the "
            "layout, and is the cache's first fill), then epochs 2 and on, which read the decoded records from "
            "the shared memory and run only the random part. Goals (issue 38): epoch 2's decode CPU at most "
            "0.1x epoch 1's, its samples/s at least 5x the uncached loader's. Each loader is made after "
            "torch.manual_seed(0) and its last pass hashed: the same pass of both gives the same bytes. "
            "Then every record is read through the cache (a loader with prepare only) and compared with "
            "a direct decode."
        ),
        (
            "2: a new daemon for each case. 2a: 2 rank processes (rank 0 and 1 of a world of 2, each its "
            "half of the order) with their own workers; 2b: 2 jobs, each a process with its own loader over "
            "every record. Both start their epoch together (they race for the same records), then wait "
            "while the PSS of the cache's mappings (its memfds, /memfd:smstore-cache-ID-...) in "
            "/proc/PID/smaps is summed over the processes, their workers and the daemon: PSS charges a "
            "shared page 1/m to each of its m mappers, so one copy on the node sums to 1.00x. Goal: at most "
            "1.05x. The decodes and the daemon's fills show each record decoded once on the node (a "
            "process that makes a loader while the cache exists learns the layout from it; two that make "
            "theirs at the same moment may each decode record 0 once for it). The daemon's status bytes "
            "count whole pages of every chunk (a chunk of 4 MiB holds 341 rows; the last one is made for "
            "the rows it holds), where PSS counts the pages written."
        ),
        (
            f"3: a daemon with --shm-limit {args.fraction:.0%} of one decoded copy, the blob read from its "
            "file (it takes none of the budget). Epoch 1 fills the chunks that fit (whole chunks: as many "
            "as the limit holds), the rest is decoded and left uncached; epoch 2's hit rate should be the "
            "fraction of records in the chunks held; the "
            "cache's PSS (as in 2) and the bytes the daemon reports must stay within 1.05x the limit; every "
            "sample read through the partial cache is compared with a direct decode."
        ),
        "Ratios are within this one run; the machine may be shared (its load average is above).",
    ]
    cmd = command_line("python benchmarks/bench_cache.py", argv)
    write_results(args.out, TITLE, [how_run(cmd, started, load_before)], header, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
