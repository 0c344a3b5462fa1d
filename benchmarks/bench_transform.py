"""Decoded records (issue 26 B): smstore.TransformLoader against torch's DataLoader at the same worker count.

    python benchmarks/bench_transform.py [--images 4096] [--workers 2] [--out benchmarks/results/transform.md]

One run, one blob of JPEGs (drawn here, deterministic), one sampler order; both loaders decode with
Pillow and resize, in the same number of worker processes, started before timing (the DataLoader
with persistent_workers). The timings are the best of ``--repeats`` epochs, the two loaders taking
turns. A transform that returns one constant array (no decode) leaves the per-batch hand-over: a new
shared-memory tensor per batch for the DataLoader, a 24-byte message and a reused slot here. Memory
is PSS summed over this process and its workers at the end of an epoch.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import procs
from bench_core import MiB, Report, command_line, how_run, log, machine_info, temp_dir, write_results
from procs import descendants, pss_bytes

import smstore

RESULTS = Path(__file__).parent / "results"
SIDE = 96  # the stored JPEGs are SIDE x SIDE RGB
OUT = 64  # decoded and resized to OUT x OUT
_BLANK = np.zeros((OUT, OUT, 3), dtype=np.uint8)


def make_jpeg(i: int) -> bytes:
    from PIL import Image

    y, x = np.mgrid[0:SIDE, 0:SIDE]
    rgb = np.stack([(x * 3 + i) % 256, (y * 5 + 7 * i) % 256, ((x ^ y) + i * 13) % 256], axis=-1)
    buf = io.BytesIO()
    Image.fromarray(rgb.astype(np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def decode(record: bytes) -> np.ndarray[Any, Any]:
    """The transform measured: Pillow decode, RGB, a bilinear resize, an HWC uint8 array."""
    from PIL import Image

    with Image.open(io.BytesIO(record)) as im:
        return np.array(im.convert("RGB").resize((OUT, OUT), Image.Resampling.BILINEAR))


def blank(_record: bytes) -> np.ndarray[Any, Any]:
    """No decode: what is left is reading the record and handing the batch over."""
    return _BLANK


def epoch(loader: Iterable[Any]) -> tuple[float, int]:
    """Seconds for one pass and the batches it gave."""
    t0 = time.perf_counter()
    n = 0
    for _ in loader:
        n += 1
    return time.perf_counter() - t0, n


def pss_mib() -> float:
    return sum(pss_bytes(p) for p in descendants([os.getpid()])) / MiB


def cpu_seconds() -> float:
    """User + system CPU time of this process and its workers so far (/proc/PID/stat)."""
    return procs.cpu_seconds(descendants([os.getpid()]))


def run_queue_seconds() -> float:
    """Time this process and its workers spent runnable but waiting for a CPU (/proc/PID/schedstat):
    what other work on the machine took from them."""
    total = 0
    for pid in descendants([os.getpid()]):
        with contextlib.suppress(OSError, IndexError, ValueError):
            total += int(Path(f"/proc/{pid}/schedstat").read_text().split()[1])
    return total / 1e9


def measure(
    loaders: dict[str, Callable[[], Any]], rounds: int, epochs: int = 2
) -> tuple[dict[str, list[float]], dict[str, int], dict[str, float], dict[str, float], dict[str, float]]:
    """Best epoch time of each round, batches, peak PSS at the end of an epoch and mean CPU seconds an epoch of
    each loader. The loaders take turns in rounds; in its turn a loader is made, warmed up (workers
    started, pages touched), timed for ``epochs`` epochs and closed, so that no other loader's
    workers are alive while it runs. On a shared machine the CPU time is the steadier figure: the
    wall time of a pass depends on what else runs."""
    best: dict[str, list[float]] = {name: [] for name in loaders}  # the best epoch of each round
    batches: dict[str, int] = {}
    pss: dict[str, float] = {}
    cpu = dict.fromkeys(loaders, 0.0)
    waited = dict.fromkeys(loaders, 0.0)
    for _ in range(rounds):
        for name, make in loaders.items():
            loader = make()
            epoch(loader)
            best[name].append(float("inf"))
            for _ in range(epochs):
                cpu0, wait0 = cpu_seconds(), run_queue_seconds()
                seconds, batches[name] = epoch(loader)
                used = cpu_seconds() - cpu0
                cpu[name] += used / (rounds * epochs)
                waited[name] += (run_queue_seconds() - wait0) / (rounds * epochs)
                best[name][-1] = min(best[name][-1], seconds)
                log(f"    {name}: {seconds:.3f} s, {used:.2f} CPU s")
                pss[name] = max(pss.get(name, 0.0), pss_mib())
            if hasattr(loader, "close"):
                loader.close()
            del loader
            gc.collect()  # a DataLoader's persistent workers stop when its iterator is collected
    return best, batches, pss, cpu, waited


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=4096)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--context", default="fork", choices=["fork", "spawn", "forkserver"])
    p.add_argument("--tmpdir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=RESULTS / "transform.md")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import PIL
    except ImportError:
        sys.exit("bench_transform: Pillow is not installed (pip install pillow, or the bench extra)")
    import torch
    from torch.utils.data import DataLoader

    report = Report()
    started, load_before = time.perf_counter(), os.getloadavg()
    with temp_dir(args.tmpdir) as tmp:
        header = machine_info(tmp)
        path = tmp / "jpegs.smst"
        log(f"packing {args.images} JPEGs of {SIDE}x{SIDE}")
        smstore.pack((make_jpeg(i) for i in range(args.images)), path, durable=False)
        size = path.stat().st_size / MiB
        sampler = smstore.GlobalShuffleSampler(args.images, seed=1)
        k, b = args.workers, args.batch_size
        rows = [("JPEG decode + resize", decode), ("no-op transform (the hand-over alone)", blank)]
        for label, fn in rows:
            log(label)

            def dataloader(fn: Any = fn) -> Any:
                ds = smstore.SharedStoreDataset(path, decode="bytes", transform=fn)
                return DataLoader(
                    ds,
                    batch_size=b,
                    sampler=sampler,
                    num_workers=k,
                    persistent_workers=True,
                    multiprocessing_context=args.context,
                )

            def transform_loader(fn: Any = fn) -> Any:
                ds = smstore.SharedStoreDataset(path, decode="bytes")
                return smstore.TransformLoader(
                    ds, fn, batch_size=b, sampler=sampler, num_workers=k, multiprocessing_context=args.context
                )

            best, batches, pss, cpu, waited = measure(
                {"DataLoader": dataloader, "TransformLoader": transform_loader}, args.repeats
            )
            n = batches["TransformLoader"]
            assert n == batches["DataLoader"], batches
            # Paired by round (the two measured minutes apart at most): the median of the rounds'
            # ratios, which one quiet or busy moment of a shared machine does not decide.
            pairs = sorted(d / t for d, t in zip(best["DataLoader"], best["TransformLoader"], strict=True))
            speedup = statistics.median(pairs)
            dl, tl = statistics.median(best["DataLoader"]), statistics.median(best["TransformLoader"])
            cpu_dl, cpu_tl = cpu["DataLoader"], cpu["TransformLoader"]
            if fn is decode:
                report.compare(
                    f"{label}: samples/s, {k} workers, batch {b} (rounds' ratios {pairs[0]:.2f}-{pairs[-1]:.2f}x)",
                    f"{args.images / tl:,.0f}",
                    f"DataLoader {args.images / dl:,.0f}",
                    speedup,
                    ">= 1.0x",
                    speedup >= 1.0,
                )
            else:
                report.compare(
                    f"{label}: ms per batch, {k} workers, batch {b} "
                    f"(rounds' ratios {1 / pairs[-1]:.2f}-{1 / pairs[0]:.2f}x)",
                    f"{1e3 * tl / n:.3f}",
                    f"DataLoader {1e3 * dl / n:.3f}",
                    1 / speedup,
                    "< 1.0x",
                    speedup > 1.0,
                )
            report.add(
                f"{label}: CPU ms per batch, the process and its {k} workers (mean of {2 * args.repeats} epochs)",
                f"{1e3 * cpu_tl / n:.2f}",
                baseline=f"DataLoader {1e3 * cpu_dl / n:.2f}",
                ratio=f"{cpu_tl / cpu_dl:.2f}x" if cpu_dl else "-",
            )
            report.add(
                f"{label}: s an epoch runnable but waiting for a CPU, the process and its {k} workers (mean)",
                f"{waited['TransformLoader']:.3f}",
                baseline=f"DataLoader {waited['DataLoader']:.3f}",
            )
            report.add(
                f"{label}: PSS summed over the process and its {k} workers",
                f"{pss['TransformLoader']:.0f} MiB",
                baseline=f"DataLoader {pss['DataLoader']:.0f} MiB",
                ratio=f"{pss['TransformLoader'] / pss['DataLoader']:.2f}x",
            )
    slot = b * OUT * OUT * 3 + 8 * b
    report.notes += [
        (
            f"{args.images} JPEGs of {SIDE}x{SIDE} RGB (quality 90, blob {size:.1f} MiB), decoded with Pillow "
            f"{PIL.__version__} and resized to {OUT}x{OUT}; the order of a GlobalShuffleSampler (seed 1); "
            f"start method {args.context}; {args.repeats} rounds in which each loader in turn is made, warmed up for an epoch, timed for 2 and closed; a round's time is its better epoch; the table gives the median over rounds and, as the ratio, the median of the rounds' paired ratios."
        ),
        (
            f"TransformLoader's ring: depth {2 * k + 1} (the default, 2 x workers + 1) slots of one batch "
            f"({slot / MiB:.2f} MiB each), allocated once; the DataLoader allocates a tensor a batch "
            f"(prefetch_factor 2). torch {torch.__version__}."
        ),
        (
            "Ratios: samples/s as TransformLoader / DataLoader (higher is better); ms per batch and PSS as "
            "TransformLoader / DataLoader (lower is better)."
        ),
    ]
    cmd = command_line("python benchmarks/bench_transform.py", argv)
    write_results(
        args.out,
        "Decoded records: TransformLoader vs DataLoader",
        [how_run(cmd, started, load_before)],
        header,
        report,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
