"""smstore against what people use instead, on the same records, in one run: ``python -m benchmarks``.

    python -m benchmarks --quick      # under 5 minutes on 2 cores
    python -m benchmarks --full       # a big machine: more records, ranks and workers
    python -m benchmarks --only reads --contender smstore-mmap --contender lmdb

Writes ``benchmarks/results/contenders-<date>.json`` (raw figures), ``contenders.md`` (tables) and
``contenders-*.png`` (plots). What each figure means: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import pickle
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from .bench_core import command_line
from .contenders import (
    BY_KEY,
    CONTENDERS,
    NULL,
    Contender,
    Context,
    Reader,
    daemon,
    dir_bytes,
    make_dicts,
    store_dir,
    verify,
)
from .procs import descendants, pss_bytes

MiB = 1 << 20
SECTIONS = ("build", "reads", "first", "memory", "objects")
RESULTS = Path(__file__).parent / "results"
DOCS = Path(__file__).parent.parent / "docs" / "benchmarks.md"
PACKAGES = (
    "smstore",
    "numpy",
    "torch",
    "mmengine-lite",
    "datasets",
    "pyarrow",
    "lmdb",
    "litdata",
    "mosaicml-streaming",
    "megatron-core",
)


START = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - START:6.1f} s] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# Records


def corpus(n: int, lines_per_record: int = 1) -> list[bytes]:
    """n records of the Python standard library's own sources (real text, on every machine).

    Each record is ``lines_per_record`` consecutive non-empty lines joined by a space (no record
    holds a newline: the text-file contenders keep one record per line).
    """
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)
    lines: list[bytes] = []
    want = n * lines_per_record
    while len(lines) < want:
        for path in files:
            with contextlib.suppress(OSError):
                lines.extend(line for line in path.read_bytes().split(b"\n") if line.strip())
            if len(lines) >= want:
                break
    if lines_per_record == 1:
        return lines[:n]
    k = lines_per_record
    return [b" ".join(lines[i : i + k]) for i in range(0, want, k)]


# --------------------------------------------------------------------------------------------------
# A rank of a memory/throughput job (a child process)


class Strided:
    """An O(1)-memory shuffle of this rank's share: i -> (a*i + c) mod n, positions rank, rank+R, ...

    torch's RandomSampler keeps n Python ints in every rank; that list would be measured as the
    contender's memory. Every contender gets the same order.
    """

    def __init__(self, n: int, rank: int, ranks: int, seed: int) -> None:
        self.n, self.rank, self.ranks = n, rank, ranks
        rng = np.random.default_rng(seed)
        a = int(rng.integers(1, n))
        while np.gcd(a, n) != 1:
            a += 1
        self.a, self.c = a, int(rng.integers(0, n))

    def __len__(self) -> int:
        return len(range(self.rank, self.n, self.ranks))

    def __iter__(self) -> Any:
        a, c, n = self.a, self.c, self.n
        return ((a * i + c) % n for i in range(self.rank, n, self.ranks))


def _digest(records: list[Any]) -> tuple[int, int, int]:
    """(count, bytes, CRC sum) of a batch; reads every byte (or every field of a dict)."""
    if records and isinstance(records[0], dict):
        blobs = [json.dumps(r, sort_keys=True).encode() for r in records]
        return len(records), sum(map(len, blobs)), sum(map(zlib.crc32, blobs))
    return len(records), sum(map(len, records)), sum(map(zlib.crc32, records))


def rank_main(args: argparse.Namespace) -> None:
    import torch
    from torch.utils.data import DataLoader, Dataset

    contender = {**BY_KEY, "null": NULL}[args.rank]
    ctx = Context(Path(args.src), args.n, Path(args.socket) if args.socket else None, args.n, args.empty)
    start = time.perf_counter()
    reader = contender.open(Path(args.store), ctx)
    build_s = time.perf_counter() - start

    class Records(Dataset[Any]):
        def __init__(self, reader: Reader) -> None:
            self.reader = reader

        def __len__(self) -> int:
            return len(self.reader)

        def __getitem__(self, i: int) -> Any:
            return _digest([self.reader.get(i)])

        def __getitems__(self, indices: list[int]) -> Any:
            return _digest(self.reader.get_batch(indices))

    def loader_for(workers: int) -> Any:
        return DataLoader(
            Records(reader),
            batch_size=args.batch_size,
            sampler=Strided(len(reader), args.rank_id, args.ranks, args.seed),
            num_workers=workers,
            multiprocessing_context="fork" if workers else None,
            persistent_workers=workers > 0,
            collate_fn=lambda x: x,
        )

    def steady_rate(loader: Any, seconds: float) -> float:
        """Records/s after the first batch (worker start-up left out), for at most ``seconds``."""
        it = iter(loader)
        next(it)
        start, count = time.perf_counter(), 0
        for c, _, _ in it:
            count += c
            if time.perf_counter() - start > seconds:
                break
        return count / max(time.perf_counter() - start, 1e-9)

    # The scaling curve: a few seconds of the same epoch with fewer workers, each loader gone
    # (its workers exited) before the measured one starts.
    scaling = {}
    for k in args.scaling:
        loader = loader_for(k)
        scaling[k] = steady_rate(loader, args.scaling_seconds)
        del loader
    gc.collect()
    torch.manual_seed(0)
    loader = loader_for(args.workers)
    start = time.perf_counter()
    count = size = crc = 0
    first = None
    for c, b, s in loader:
        count, size, crc = count + c, size + b, crc + s
        if first is None:
            first = (time.perf_counter(), count)
    end = time.perf_counter()
    epoch_s = end - start
    assert first is not None
    scaling[args.workers] = (count - first[1]) / max(end - first[0], 1e-9)
    out = {
        "build_s": build_s,
        "epoch_s": epoch_s,
        "count": count,
        "bytes": size,
        "crc": crc,
        "scaling": scaling,
    }
    print(json.dumps(out), flush=True)
    sys.stdin.readline()  # the harness sums PSS now, with every worker alive
    del loader
    reader.close()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(
    args: argparse.Namespace, contender: Contender, data: Data, ranks: int, workers: int
) -> dict[str, Any]:
    """R rank processes (LOCAL_RANK set, as torchrun does) each reading its share with K workers.

    Returns the summed PSS of every process of the job (ranks and workers, all alive, after the
    epoch; and the daemon's), the epoch time of the slowest rank and the (count, bytes, CRC sum)
    over all ranks.
    """
    env = {
        **os.environ,
        "LOCAL_WORLD_SIZE": str(ranks),
        "WORLD_SIZE": str(ranks),  # as torchrun sets them (Mosaic streaming reads all four)
        "SMSTORE_SOCKET": str(args.socket),  # SharedList shares through this run's daemon, counted here
        "MASTER_ADDR": "127.0.0.1",  # Mosaic streaming starts torch.distributed when WORLD_SIZE > 1
        "MASTER_PORT": str(free_port()),
        "SMSTORE_JOB_ID": f"bench-{os.getpid()}-{time.monotonic_ns()}",
        "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
    }
    cmd = [
        sys.executable,
        "-m",
        "benchmarks",
        "--rank",
        contender.key,
        "--store",
        str(store_dir(data.root, contender)),
    ]
    cmd += ["--src", str(data.src), "--n", str(data.n), "--ranks", str(ranks), "--workers", str(workers)]
    cmd += ["--batch-size", str(args.batch_size), "--seed", str(args.seed), "--socket", str(args.socket)]
    cmd += ["--empty"] if data.empty else []
    if ranks == 1 and not data.empty and args.scaling:
        cmd += ["--scaling", ",".join(map(str, args.scaling)), "--scaling-seconds", str(args.scaling_seconds)]
    procs = [
        subprocess.Popen(
            [*cmd, "--rank-id", str(r)],
            env={**env, "LOCAL_RANK": str(r), "RANK": str(r)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(ranks)
    ]
    try:
        outs = []
        for p in procs:
            line = p.stdout.readline()  # type: ignore[union-attr]
            if not line:
                raise RuntimeError(f"{contender.key}: a rank exited with {p.wait()} before its epoch ended")
            outs.append(json.loads(line))
        time.sleep(0.2)  # let freed memory go back
        pids = descendants([p.pid for p in procs]) + args.extra_pids
        pss = sum(pss_bytes(pid) for pid in pids)
        for p in procs:
            p.stdin.write("\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        for p in procs:
            p.wait(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return {
        "pss": pss,
        "processes": len(pids),
        "epoch_s": max(o["epoch_s"] for o in outs),
        "build_s": [o["build_s"] for o in outs],
        "count": sum(o["count"] for o in outs),
        "bytes": sum(o["bytes"] for o in outs),
        "crc": sum(o["crc"] for o in outs),
        "scaling": {int(k): v for k, v in outs[0]["scaling"].items()} if ranks == 1 else {},
    }


# --------------------------------------------------------------------------------------------------
# Sections


@dataclass
class Data:
    """One set of records and the stores built from it: the full records, or as many empty ones."""

    root: Path  # stores under root/<contender>
    src: Path  # the text file (bytes contenders) they are built from
    n: int
    empty: bool = False


def timed(fn: Any) -> float:
    t0 = time.perf_counter_ns()
    fn()
    return float(time.perf_counter_ns() - t0)


def section_build(contenders: list[Contender], data: Data, results: dict[str, Any] | None) -> None:
    """Build every store from the text file; with ``results``, time it and size it on disk."""
    size = data.src.stat().st_size
    done: dict[Path, str] = {}
    for c in contenders:
        out = store_dir(data.root, c)
        if c.build is None:
            continue
        if out in done:  # smstore's two modes read one blob
            if results is not None:
                results["build"][c.key] = results["build"][done[out]]
            continue
        done[out] = c.key
        out.mkdir(parents=True, exist_ok=True)
        log(f"build {c.key}{' (baseline records)' if data.empty else ''}")
        t0 = time.perf_counter()
        c.build(data.src, out)
        seconds = time.perf_counter() - t0
        if results is not None:
            results["build"][c.key] = {
                "seconds": seconds,
                "mib_s": size / MiB / seconds,
                "disk": dir_bytes(out),
            }


def section_reads(
    args: argparse.Namespace, readers: dict[str, Reader], n: int, results: dict[str, Any]
) -> None:
    """ns/record of ``get(i)`` over random indices and of ``get_batch`` over random batches.

    A warm-up round of 2,000 reads sizes each contender's rounds to about ``--read-seconds``
    (at least 2,000 and at most ``--read-records`` indices), so the slowest stores do not take
    minutes; the same index list is used by every contender of that size.
    """
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(n)[: max(args.read_records, 2000)].tolist()
    times: dict[str, dict[str, list[float]]] = {}
    counts: dict[str, int] = {}
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for key, reader in readers.items():
            warm = order[:2000]
            per = max(timed(lambda r=reader, w=warm: [r.get(i) for i in w]) / len(warm), 1.0)  # type: ignore[misc]
            counts[key] = int(min(max(args.read_seconds * 1e9 / per, 2000), len(order)))
        for rep in range(args.repeats + 1):  # round 0 is a warm-up, not kept
            for key, reader in readers.items():
                get, get_batch, idx = reader.get, reader.get_batch, order[: counts[key]]
                batches = [idx[i : i + args.batch_size] for i in range(0, len(idx), args.batch_size)]

                def single(get: Any = get, idx: list[int] = idx) -> None:
                    for i in idx:
                        get(i)

                def batched(get_batch: Any = get_batch, batches: list[list[int]] = batches) -> None:
                    for b in batches:
                        get_batch(b)

                s, b = timed(single) / len(idx), timed(batched) / len(idx)
                if rep:
                    times.setdefault(key, {"single": [], "batch": []})
                    times[key]["single"].append(s)
                    times[key]["batch"].append(b)
    finally:
        if gc_was:
            gc.enable()
    for key, t in times.items():
        results["reads"][key] = {
            "indices": counts[key],
            **{m: {"median": statistics.median(v), "min": min(v), "max": max(v)} for m, v in t.items()},
        }


FIRST = """
import sys, time, random
from pathlib import Path
from benchmarks.contenders import BY_KEY, NULL, Context
c = BY_KEY.get(sys.argv[1], NULL)
r = c.open(Path(sys.argv[2]), Context(Path(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])))
x = r.get(random.randrange(int(sys.argv[4])))
"""


def section_first(
    args: argparse.Namespace, contenders: list[Contender], data: Data, results: dict[str, Any]
) -> None:
    """Wall time of a fresh process that imports the contender, opens its store and reads one record."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    for c in [NULL, *contenders]:
        runs = []
        for _ in range(args.first_repeats):
            cmd = [
                sys.executable,
                "-c",
                FIRST,
                c.key,
                str(store_dir(data.root, c)),
                str(data.src),
                str(data.n),
            ]
            t0 = time.perf_counter()
            out = subprocess.run(
                [*cmd, str(args.socket)], env=env, capture_output=True, text=True, check=False
            )
            runs.append(time.perf_counter() - t0)
            if out.returncode:
                raise RuntimeError(f"first record of {c.key} failed: {out.stderr[-2000:]}")
        results["first"][c.key] = {
            "median_s": statistics.median(runs),
            "min_s": min(runs),
            "max_s": max(runs),
        }


def section_memory(
    args: argparse.Namespace,
    contenders: list[Contender],
    full: Data,
    empty: Data,
    raw: int,
    grid: list[tuple[int, int]],
    results: dict[str, Any],
    key: str,
) -> None:
    """Summed PSS of R ranks x K workers, minus the same job over one-byte records (dicts: empty ones), over the raw size."""
    for ranks, workers in grid:
        want: tuple[int, int] | None = None
        for c in contenders:
            log(f"{key} R={ranks} K={workers}: {c.key}")
            job = run_job(args, c, full, ranks, workers)
            base = run_job(args, c, empty, ranks, workers)
            got = (job["count"], job["crc"])
            if want is None:
                want = got
            elif got != want:  # every contender must have read the same records, every byte
                raise RuntimeError(f"{c.key} read other records than {contenders[0].key}: {got} != {want}")
            results[key].append(
                {
                    "contender": c.key,
                    "ranks": ranks,
                    "workers": workers,
                    "pss": job["pss"],
                    "baseline_pss": base["pss"],
                    "x_raw": (job["pss"] - base["pss"]) / (raw - (empty.n if key == "memory" else 0)),
                    "processes": job["processes"],
                    "epoch_s": job["epoch_s"],
                    "records_s": job["count"] / job["epoch_s"],
                    "rank_open_s": job["build_s"],
                    "steady_records_s": job["scaling"],  # R=1: records/s by workers, start-up left out
                }
            )


# --------------------------------------------------------------------------------------------------
# Output


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[pkg] = metadata.version(pkg)
    return out


def machine() -> dict[str, Any]:
    model = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    commit = subprocess.run(
        ["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return {
        "cpus": len(os.sched_getaffinity(0)),
        "cpu": model,
        "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "kernel": platform.release(),
        "load_before": round(os.getloadavg()[0], 2),
        "git": commit or "?",
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank:
        rank_main(args)
        return 0
    from .report import write_report

    sections = args.only or list(SECTIONS)
    chosen = [c for c in CONTENDERS if not args.contender or c.key in args.contender]
    results: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command_line("python -m benchmarks", argv),
        "preset": "full" if args.full else "quick" if args.quick else "custom",
        "machine": machine(),
        "versions": versions(),
        "params": {k: v for k, v in vars(args).items() if k in PARAMS},
        "contenders": {},
        "skipped": {},
        "seconds": {},
        "build": {},
        "reads": {},
        "first": {},
        "memory": [],
        "objects": [],
    }
    active: list[Contender] = []
    for c in chosen:
        results["contenders"][c.key] = {
            "label": c.label,
            "kind": c.kind,
            "follows": c.follows,
            "batched": c.batched,
            "access": c.access,
        }
        why = c.missing()
        if why:
            results["skipped"][c.key] = why
            log(f"skipped {c.key}: {why}")
        else:
            active.append(c)
    byte_cs = [c for c in active if c.kind == "bytes"]
    obj_cs = [c for c in active if c.kind == "objects"]
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        results["seconds"][name] = round(time.perf_counter() - clock, 1)
        clock = time.perf_counter()

    tmp = Path(tempfile.mkdtemp(prefix="smstore-bench-", dir=args.tmpdir))
    try:
        records = corpus(args.records, args.lines_per_record)
        full = Data(tmp / "full", tmp / "records.txt", len(records))
        empty = Data(tmp / "empty", tmp / "empty.txt", len(records), empty=True)
        full.src.write_bytes(b"\n".join(records) + b"\n")
        empty.src.write_bytes(b"-\n" * len(records))  # one byte each: some stores refuse empty files
        raw = sum(map(len, records))
        results["data"] = {"records": len(records), "raw_bytes": raw, "text_bytes": full.src.stat().st_size}
        section_build(byte_cs, full, results if "build" in sections else None)
        lap("build")
        blobs = [store_dir(d.root, BY_KEY["smstore-mmap"]) / "data.smst" for d in (full, empty)]
        if "memory" in sections:
            section_build(byte_cs, empty, None)
        blobs = [b for b in blobs if b.exists()]
        args.socket = tmp / "daemon.sock"
        with daemon(args.socket, *blobs) if blobs else contextlib.nullcontext() as served:
            # The daemon's own PSS (its share of the segments it maps) is counted with every job.
            args.extra_pids = [served.pid] if served is not None else []
            ctx = Context(full.src, full.n, args.socket)
            readers = {c.key: c.open(store_dir(full.root, c), ctx) for c in byte_cs}
            check = np.random.default_rng(args.seed + 1).permutation(full.n)[:2000].tolist()
            verify(readers, records, check)
            if readers:
                log(
                    f"verified: {len(readers)} contenders return the same bytes for {len(check)} random indices"
                )
            if "reads" in sections:
                section_reads(args, readers, full.n, results)
                lap("reads")
            for r in readers.values():
                r.close()
            del readers
            gc.collect()
            if "first" in sections:
                section_first(args, byte_cs, full, results)
                lap("first")
            if "memory" in sections:
                section_memory(args, byte_cs, full, empty, raw, args.grid, results, "memory")
                lap("memory")
            if "objects" in sections and obj_cs:
                dicts = make_dicts(args.objects)
                raw_objects = sum(len(pickle.dumps(d, protocol=5)) for d in dicts)
                results["data"]["objects"] = args.objects
                results["data"]["objects_pickled_bytes"] = raw_objects
                del dicts
                small = Context(full.src, 0, args.socket, objects=500)
                readers = {c.key: c.open(tmp, small) for c in obj_cs}
                verify(readers, make_dicts(500), list(range(500)))
                log(f"verified: {len(readers)} object contenders return equal dicts")
                for r in readers.values():
                    r.close()
                del readers
                full_o = Data(tmp / "full", full.src, args.objects)
                empty_o = Data(tmp / "empty", empty.src, args.objects, empty=True)
                section_memory(
                    args, obj_cs, full_o, empty_o, raw_objects, args.object_grid, results, "objects"
                )
                lap("objects")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results["seconds"]["total"] = round(time.monotonic() - START, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    raw_json = args.out / f"contenders-{results['date'][:10]}.json"
    raw_json.write_text(json.dumps(results, indent=1, default=str) + "\n")
    log(f"wrote {raw_json}")
    write_report(results, args.out, None if args.no_docs or args.out != RESULTS else DOCS)
    return 0


PARAMS = ("records", "lines_per_record", "objects", "grid", "object_grid", "repeats", "first_repeats")
PARAMS += ("read_records", "read_seconds", "batch_size", "seed", "scaling", "scaling_seconds")


def grid(text: str) -> list[tuple[int, int]]:
    """'1x1,1x4,2x4' -> [(1, 1), (1, 4), (2, 4)] (ranks x workers)."""
    out = []
    for part in text.split(","):
        r, _, k = part.strip().partition("x")
        out.append((int(r), int(k)))
    return out


PRESETS = {
    "quick": {
        "records": 25_000,
        "lines_per_record": 32,
        "objects": 100_000,
        "grid": "1x4,2x4",
        "object_grid": "2x4",
        "scaling": "1,2",
        "first_repeats": 1,
    },
    "full": {
        "records": 2_000_000,
        "lines_per_record": 8,
        "objects": 500_000,
        "grid": "1x1,1x2,1x4,1x8,2x4,4x4,8x4,8x8",
        "object_grid": "1x4,2x4,4x4,8x8",
        "scaling": "",
        "first_repeats": 5,
    },
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    preset = p.add_mutually_exclusive_group()
    preset.add_argument("--quick", action="store_true", help="the small preset: under 5 minutes on 2 cores")
    preset.add_argument("--full", action="store_true", help="the big preset: many ranks, workers and records")
    p.add_argument("--records", type=int, help="records (quick 25,000; full 2,000,000)")
    p.add_argument(
        "--lines-per-record", type=int, help="stdlib lines joined into a record (quick 32, full 8)"
    )
    p.add_argument(
        "--objects", type=int, help="dicts per rank for the objects grid (quick 100,000; full 500,000)"
    )
    p.add_argument("--grid", help="memory grid, RxK,... (ranks x workers)")
    p.add_argument("--object-grid", help="objects memory grid, RxK,...")
    p.add_argument("--only", action="append", choices=SECTIONS, help="run only these sections (repeatable)")
    p.add_argument("--contender", action="append", choices=[c.key for c in CONTENDERS], help="only these")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds of the read loops (after a warm-up)")
    p.add_argument("--first-repeats", type=int, help="fresh processes per contender (quick 1, full 5)")
    p.add_argument("--read-records", type=int, default=200_000, help="most random reads per timed round")
    p.add_argument("--read-seconds", type=float, default=0.3, help="aim of each timed round per contender")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tmpdir", type=Path, default=None, help="where the stores are built (default: $TMPDIR)")
    p.add_argument("--out", type=Path, default=RESULTS, help="results directory (default benchmarks/results)")
    p.add_argument("--no-docs", action="store_true", help="do not put the tables into docs/benchmarks.md")
    # A rank of a memory job (internal).
    p.add_argument("--rank", help=argparse.SUPPRESS)
    p.add_argument("--rank-id", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--workers", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--src", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--socket", help=argparse.SUPPRESS)
    p.add_argument("--empty", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--scaling",
        help="worker counts also timed in every R=1 job: the scaling curve (quick 1,2; '' for none)",
    )
    p.add_argument("--scaling-seconds", type=float, default=1.5, help="each point of the scaling curve (s)")
    args = p.parse_args(argv)
    if args.rank:
        args.scaling = [int(k) for k in args.scaling.split(",")] if args.scaling else []
        return args
    base = PRESETS["full" if args.full else "quick"]
    args.records = args.records or int(base["records"])
    args.objects = args.objects or int(base["objects"])
    args.grid = grid(args.grid or str(base["grid"]))
    args.object_grid = grid(args.object_grid or str(base["object_grid"]))
    args.first_repeats = args.first_repeats or int(base["first_repeats"])
    scaling = str(base["scaling"]) if args.scaling is None else args.scaling
    args.scaling = [int(k) for k in scaling.split(",") if k.strip()]
    args.lines_per_record = args.lines_per_record or int(base["lines_per_record"])
    return args
