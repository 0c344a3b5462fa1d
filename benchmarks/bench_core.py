"""Benchmarks of the smstore core (issue 2): random reads, batched reads, pack throughput, PSS memory.

Run on demand, on an otherwise idle machine:

    python benchmarks/bench_core.py [--records N] [--out benchmarks/results/core.md]

Everything is measured in one run on the same records: the first N lines of the Python standard
library's own ``.py`` files (cycled if the library has fewer lines). See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import mmap
import os
import platform
import random
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

import smstore

MiB = 1 << 20
# The header fields a hand-written reader needs (csrc/format.hpp: struct Header, little-endian).
HEADER = struct.Struct("<8sIIQQQQQQQQQIIQ")
SECTIONS = ("reads", "batch", "pack", "memory")


# --------------------------------------------------------------------------------------------------
# Corpus


def stdlib_files() -> list[Path]:
    """The standard library's own .py files (not site-packages), in a stable order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)


def stdlib_lines(n: int) -> list[bytes]:
    """The first n lines of the stdlib sources, each without its b"\\n"; cycles through the files again if needed."""
    files = stdlib_files()
    if not files:
        sys.exit("bench_core: no .py files found in the standard library")
    lines: list[bytes] = []
    while len(lines) < n:
        for path in files:
            try:
                data = path.read_bytes()
            except OSError:
                continue
            parts = data.split(b"\n")
            if data.endswith(b"\n"):
                parts.pop()  # a file's final newline ends its last line, it is not an empty line
            lines.extend(parts)
            if len(lines) >= n:
                break
    del lines[n:]
    return lines


def write_lines(path: Path, lines: Sequence[bytes]) -> None:
    with open(path, "wb") as f:
        f.write(b"\n".join(lines))
        f.write(b"\n")


def warm(path: Path) -> int:
    """Read a file once so its pages are in the page cache; returns its size."""
    size = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(8 * MiB):
            size += len(chunk)
    return size


# --------------------------------------------------------------------------------------------------
# Results


@dataclass
class Row:
    metric: str
    value: str
    baseline: str = "-"
    ratio: str = "-"
    goal: str = "-"
    met: str = "-"


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *args: str, **kw: str) -> None:
        row = Row(*args, **kw)
        self.rows.append(row)
        line = f"  {row.metric}: {row.value}"
        if row.baseline != "-":
            line += f" (baseline {row.baseline}, ratio {row.ratio})"
        if row.goal != "-":
            line += f" goal {row.goal}: {row.met}"
        log(line)

    def compare(self, metric: str, value: str, baseline: str, ratio: float, goal: str, ok: bool) -> None:
        """A row measured against a baseline of the same run, with its goal."""
        self.add(metric, value, baseline=baseline, ratio=f"{ratio:.2f}x", goal=goal, met=yes_no(ok))

    def table(self) -> str:
        out = ["| metric | value | baseline | ratio | goal | met? |", "|---|---|---|---|---|---|"]
        out += [
            f"| {r.metric} | {r.value} | {r.baseline} | {r.ratio} | {r.goal} | {r.met} |" for r in self.rows
        ]
        return "\n".join(out)


def _machine_dirs() -> list[tuple[str, str]]:
    """(directory of this machine, how a results file names it), the most specific first."""
    root = str(Path(__file__).resolve().parent.parent)
    dirs = [(root, "."), (tempfile.gettempdir().rstrip(os.sep), "$TMPDIR"), (os.path.expanduser("~"), "~")]
    both = [(d, shown) for d, shown in dirs] + [(os.path.realpath(d), shown) for d, shown in dirs]
    return sorted({(d, shown) for d, shown in both if d not in ("", os.sep)}, key=lambda x: -len(x[0]))


def portable_path(path: str) -> str:
    """``path`` as a results file names it: relative to the repository, under ``$TMPDIR`` or ``~``,
    and any other absolute path by its last part alone (``.../name``)."""
    if not os.path.isabs(path):
        return path
    norm = os.path.normpath(path)
    for base, shown in _machine_dirs():
        if norm == base:
            return shown
        if norm.startswith(base + os.sep):
            rest = norm[len(base) + 1 :]
            return rest if shown == "." else f"{shown}/{rest}"
    return f".../{os.path.basename(norm)}" if os.path.basename(norm) else norm


def command_line(program: str, argv: Sequence[str] | None = None) -> str:
    """How this run was started (``program`` and ``argv``, default ``sys.argv[1:]``), every path
    argument (``--out PATH``, ``--tmpdir=PATH``) as :func:`portable_path` names it."""
    shown = []
    for arg in sys.argv[1:] if argv is None else argv:
        option, eq, value = arg.partition("=")
        shown.append(
            f"{option}={portable_path(value)}" if eq and option.startswith("-") else portable_path(arg)
        )
    return " ".join([program, *shown])


def portable(text: str) -> str:
    """`text` without the absolute paths of this machine: the repository's root becomes relative,
    temporary directories `$TMPDIR` and the home directory `~`, so a results file says nothing of
    where it ran. (Paths elsewhere reach a results file only as arguments: see `command_line`.)"""
    for base, shown in _machine_dirs():
        if shown == ".":
            text = text.replace(base + os.sep, "").replace(base, ".")
        else:
            text = re.sub(re.escape(base) + r"(?=/|\b)", lambda _m, s=shown: s, text)
    return text


def write_results(out: Path, title: str, intro: list[str], header: list[str], report: Report) -> None:
    """Write a results page: title, how it was run, the machine, the table and its notes; print it too."""
    text = portable(
        "\n".join(
            [
                f"# {title}",
                "",
                *intro,
                "",
                *header,
                "",
                report.table(),
                "",
                *[f"- {n}" for n in report.notes],
                "",
            ]
        )
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def how_run(cmd: str, started: float, load_before: tuple[float, ...]) -> str:
    """A results page's first line: the command, when, how long since ``started`` (perf_counter)
    and the load average (1 min) before and now."""
    return (
        f"`{cmd}` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{time.perf_counter() - started:.0f} s; load average (1 min) before / after: "
        f"{load_before[0]:.2f} / {os.getloadavg()[0]:.2f}."
    )


def yes_no(ok: bool) -> str:
    return "yes" if ok else "**no**"


def ns(x: float) -> str:
    return f"{x:.1f} ns/record" if x < 100 else f"{x:.0f} ns/record"


def best_of(repeats: int, variants: dict[str, Callable[[], None]]) -> dict[str, float]:
    """Min wall time (ns) of each variant over `repeats` rounds; variants interleave so load hits all alike."""
    best = dict.fromkeys(variants, math.inf)
    gc_was_enabled = gc.isenabled()
    gc.disable()  # as timeit does: a collection landing in one variant's pass is noise, not cost
    try:
        for _ in range(repeats):
            for name, fn in variants.items():
                t0 = time.perf_counter_ns()
                fn()
                best[name] = min(best[name], time.perf_counter_ns() - t0)
    finally:
        if gc_was_enabled:
            gc.enable()
    return best


# --------------------------------------------------------------------------------------------------
# 1. Random single-record reads


class MmapBaseline:
    """The hand-written reader to beat: numpy int64 offsets + memoryview slices of an mmap of the blob."""

    def __init__(self, path: Path) -> None:
        self._file = open(path, "rb")  # noqa: SIM115 - lives as long as the mapping; close() ends both
        self.mm = mmap.mmap(self._file.fileno(), 0, prot=mmap.PROT_READ)
        fields = HEADER.unpack_from(self.mm, 0)
        count, data_offset, index_offset = fields[5], fields[6], fields[8]
        index = np.frombuffer(self.mm, dtype="<u8", count=count + 1, offset=index_offset)
        self.offs = index.astype(np.int64) + data_offset  # absolute file offsets
        del index  # a numpy view would pin the mmap open
        self.mv = memoryview(self.mm)

    def close(self) -> None:
        self.mv.release()
        self.mm.close()
        self._file.close()


def random_order(n: int, seed: int) -> list[int]:
    """A random permutation of range(n) as a list of Python ints, made as a DataLoader sampler makes it.

    Like ``torch.randperm(n).tolist()``, the int objects are created in list order, so walking the
    list walks memory forward; shuffling ``list(range(n))`` instead would add a cache miss per index
    (the int objects sit in allocation order) that no real sampler has.
    """
    return np.random.default_rng(seed).permutation(n).tolist()  # type: ignore[no-any-return]


def loop_getitem(obj: Any, idx: list[int]) -> None:
    for i in idx:
        obj[i]


def loop_baseline(mv: memoryview, offs: Any, idx: list[int]) -> None:
    for i in idx:
        mv[offs[i] : offs[i + 1]]


def loop_empty(idx: list[int]) -> None:
    for _i in idx:
        pass


def bench_reads(report: Report, blob: Path, lines: list[bytes], repeats: int, seed: int) -> None:
    from smstore import SharedStoreDataset

    n = len(lines)
    idx = random_order(n, seed)
    ds = SharedStoreDataset(blob)  # decode=None: zero-copy memoryviews
    store = smstore.open(blob)
    base = MmapBaseline(blob)
    mv, offs = base.mv, base.offs
    offs_list = offs.tolist()
    # The benchmark is only meaningful if every reader returns the same, correct bytes.
    for i in [*random.Random(seed + 1).sample(range(n), min(n, 2000)), 0, n - 1]:
        expect = lines[i]
        if not (
            ds[i] == store[i] == mv[offs[i] : offs[i + 1]] == mv[offs_list[i] : offs_list[i + 1]] == expect
        ):
            sys.exit(f"bench_core: record {i} differs between readers")

    best = best_of(
        repeats,
        {
            "ds": lambda: loop_getitem(ds, idx),
            "store": lambda: loop_getitem(store, idx),
            "base": lambda: loop_baseline(mv, offs, idx),
            "base_list": lambda: loop_baseline(mv, offs_list, idx),  # type: ignore[arg-type]
            "empty": lambda: loop_empty(idx),
        },
    )
    per = {k: v / n for k, v in best.items()}
    b = per["base"]
    base_txt = ns(b)
    report.add(
        "`ds[i]` random order, `SharedStoreDataset(path)` (decode=None)",
        ns(per["ds"]),
        base_txt,
        f"{per['ds'] / b:.2f}x",
        "<= 0.7x",
        yes_no(per["ds"] / b <= 0.7),
    )
    report.add("`store[i]` random order", ns(per["store"]), base_txt, f"{per['store'] / b:.2f}x")
    report.add("baseline: `mv[offs[i]:offs[i+1]]`, numpy int64 `offs`", base_txt)
    report.add(
        "(info) same slices with `offs` as a Python list",
        ns(per["base_list"]),
        base_txt,
        f"{per['base_list'] / b:.2f}x",
    )
    report.add("(info) empty loop `for i in idx: pass`", ns(per["empty"]))
    report.notes.append(
        f"Reads: one Python `for` loop over the same random permutation of all {n} indices for every reader "
        f"(the loop itself is the 'empty loop' row, included in every figure); best (min) of {repeats} "
        "interleaved passes, GC disabled while timing; ns/record = pass time / records. Before timing, "
        "2000 random records were checked byte-exact across all readers and against the source lines."
    )
    store.close()
    base.close()


# --------------------------------------------------------------------------------------------------
# 2. Batched reads


def bench_batches(report: Report, blob: Path, repeats: int, seed: int, batch_size: int) -> None:
    from smstore import SharedStoreDataset

    store = smstore.open(blob)
    ds = SharedStoreDataset(blob)
    n = len(store)
    idx = random_order(n, seed + 2)
    batches = [idx[k : k + batch_size] for k in range(0, n, batch_size)]
    base = MmapBaseline(blob)
    mv, offs = base.mv, base.offs
    b0 = batches[0]
    if [bytes(v) for v in store.get_batch(b0)] != [bytes(mv[offs[i] : offs[i + 1]]) for i in b0]:
        sys.exit("bench_core: get_batch returned wrong records")
    data, goffs = store.gather(b0)
    if [data[goffs[k] : goffs[k + 1]].tobytes() for k in range(len(b0))] != [bytes(store[i]) for i in b0]:
        sys.exit("bench_core: gather returned wrong records")

    def run_get_batch() -> None:
        get_batch = store.get_batch
        for b in batches:
            get_batch(b)

    def run_gather() -> None:
        gather = store.gather
        for b in batches:
            gather(b)

    def run_getitems() -> None:
        getitems = ds.__getitems__
        for b in batches:
            getitems(b)

    def run_baseline() -> None:
        for b in batches:
            [mv[offs[i] : offs[i + 1]] for i in b]

    best = best_of(
        repeats,
        {"get_batch": run_get_batch, "gather": run_gather, "getitems": run_getitems, "base": run_baseline},
    )
    per = {k: v / n for k, v in best.items()}
    b = per["base"]
    base_txt = ns(b)
    report.add(
        f"`store.get_batch({batch_size} random indices)`",
        ns(per["get_batch"]),
        base_txt,
        f"{per['get_batch'] / b:.2f}x",
        "<= 100 ns/record",
        yes_no(per["get_batch"] <= 100),
    )
    report.add(
        f"`store.gather({batch_size} random indices)` (copy into one uint8 array)",
        ns(per["gather"]),
        base_txt,
        f"{per['gather'] / b:.2f}x",
    )
    report.add(
        f"(info) `ds.__getitems__({batch_size})` (what DataLoader calls)",
        ns(per["getitems"]),
        base_txt,
        f"{per['getitems'] / b:.2f}x",
    )
    report.notes.append(
        f"Batches: {len(batches)} batches of {batch_size} indices (Python lists, as a DataLoader passes them) "
        f"covering a random permutation of all records; baseline is the list comprehension "
        f"`[mv[offs[i]:offs[i+1]] for i in batch]` over the same batches; best of {repeats}."
    )
    store.close()
    base.close()


# --------------------------------------------------------------------------------------------------
# 3. Pack throughput


def smstore_cli() -> list[str]:
    script = Path(sys.executable).parent / "smstore"
    return [str(script)] if script.exists() else [sys.executable, "-m", "smstore"]


def bench_pack(report: Report, tmp: Path, lines_file: Path, n: int, pack_mib: int, repeats: int) -> None:
    chunk = lines_file.read_bytes()
    reps = max(1, math.ceil(pack_mib * MiB / len(chunk)))
    src = tmp / "pack_input.txt"
    with open(src, "wb") as f:
        f.writelines(chunk for _ in range(reps))
    del chunk
    size = warm(src)
    out = tmp / "pack_output.smst"
    cli = smstore_cli()

    def packer(**kw: Any) -> Callable[[], None]:
        return lambda: smstore.pack_files([src], out, progress=False, **kw) and None

    def command(argv: list[str]) -> Callable[[], None]:
        return lambda: subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)

    variants = {
        "cat": command(["cat", str(src)]),
        "durable": packer(durable=True),
        "fast": packer(durable=False),
        "cli": command([*cli, "pack", str(src), "-o", str(out), "-q"]),
        "cli_nofsync": command([*cli, "pack", str(src), "-o", str(out), "-q", "--no-fsync"]),
    }
    best = dict.fromkeys(variants, math.inf)
    for _ in range(repeats):
        for name, fn in variants.items():
            with contextlib.suppress(FileNotFoundError):
                out.unlink()
            os.sync()  # start each run with no dirty pages from the last one waiting to be written
            t0 = time.perf_counter_ns()
            fn()
            best[name] = min(best[name], time.perf_counter_ns() - t0)
            if name != "cat":
                with smstore.open(out) as s:
                    if len(s) != n * reps or s.nbytes != size - n * reps:
                        sys.exit(f"bench_core: {name} pack wrote {len(s)} records, expected {n * reps}")
    out.unlink()
    src.unlink()
    os.sync()

    rate = {k: size / MiB / (v / 1e9) for k, v in best.items()}
    cat_txt = f"{rate['cat']:.0f} MiB/s"
    labels = {
        "durable": "`smstore.pack_files(durable=True)` (fsync before publish)",
        "fast": "`smstore.pack_files(durable=False)`",
        "cli": "CLI `smstore pack IN -o OUT -q`, end to end (fsync)",
        "cli_nofsync": "CLI `smstore pack IN -o OUT -q --no-fsync`, end to end",
    }
    for key, label in labels.items():
        report.add(
            label,
            f"{rate[key]:.0f} MiB/s",
            cat_txt,
            f"{rate[key] / rate['cat']:.2f}x",
            ">= 500 MiB/s",
            yes_no(rate[key] >= 500),
        )
    report.add("baseline: `cat IN > /dev/null`", cat_txt)
    report.notes.append(
        f"Pack: input is the {n}-line corpus repeated {reps}x = {size / MiB:.0f} MiB "
        f"({n * reps} lines), read once before timing so it is in the page cache; MiB/s of input; "
        f"best of {repeats} interleaved runs, each started after `sync` with the previous output deleted; "
        "the CLI rows include interpreter start-up. Output goes to the same file system as the input "
        "(see 'temp dir' above); the durable rows include fsync of the output to that disk."
    )


# --------------------------------------------------------------------------------------------------
# 4. Memory (PSS) with forked DataLoader workers


def smaps_rollup(pid: int) -> dict[str, int]:
    """The kB fields of /proc/PID/smaps_rollup (Pss, Pss_Anon, Pss_File, ...)."""
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1])
    return fields


def mapping_pss(pid: int, path: str) -> int:
    """PSS (kB) of the mappings of one file in a process, from /proc/PID/smaps."""
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(maxsplit=5)
            if head and "-" in head[0] and not head[0].endswith(":"):  # a mapping's header line
                inside = len(head) == 6 and head[5].rstrip("\n") == path
            elif inside and head and head[0] == "Pss:":
                total += int(head[1])
    return total


class ListDataset:
    """The usual approach: a Python list of bytes held by the parent and inherited by forked workers."""

    def __init__(self, lines: list[bytes]) -> None:
        self.lines = lines

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, i: int) -> bytes:
        return self.lines[i]


def collate_sizes(batch: list[Any]) -> tuple[int, int, int, int]:
    """Reduce a batch to (worker id, records, bytes, CRC sum) so transfer to the parent costs nothing.

    The CRC reads every byte of every record, as a real consumer (decoder, tokenizer) would: a
    zero-copy view that is never read never faults its page in, which would flatter the store.
    """
    import torch.utils.data

    info = torch.utils.data.get_worker_info()
    crc = sum(zlib.crc32(r) for r in batch)
    return (info.id if info is not None else -1, len(batch), sum(len(r) for r in batch), crc)


class StridedShuffle:
    """A random-looking permutation of range(n) in O(1) memory: i -> (a*i + c) mod n, gcd(a, n) = 1.

    torch's RandomSampler materialises the permutation as a list of n Python ints in the parent
    (about 40 bytes a record); that is the harness's cost, not the dataset's, and it would not cancel
    against the empty harness. Consecutive indices land far apart, so every batch spans the blob.
    """

    def __init__(self, n: int, seed: int) -> None:
        rng = random.Random(seed)
        self.n = n
        self.c = rng.randrange(n)
        a = rng.randrange(n // 3, n) | 1
        while math.gcd(a, n) != 1:
            a += 2
        self.a = a

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        a, c, n = self.a, self.c, self.n
        return ((a * i + c) % n for i in range(n))


def mem_child(mode: str, path: Path, workers: int, batch_size: int, seed: int, sampler: str) -> None:
    """One fresh process: open the data, read every record once through K forked workers, sum PSS."""
    import torch
    from torch.utils.data import DataLoader

    # K=4 workers on a 2-core machine is the point of the measurement, not a mistake.
    warnings.filterwarnings("ignore", message=".*worker processes in total.*")
    dataset: Any
    if mode == "store":
        from smstore import SharedStoreDataset

        dataset = SharedStoreDataset(path)
    else:
        data = path.read_bytes()
        lines = data.split(b"\n")
        if data.endswith(b"\n"):
            lines.pop()
        del data
        dataset = ListDataset(lines)
        del lines
    gc.collect()
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=StridedShuffle(len(dataset), seed) if sampler == "strided" else None,
        shuffle=sampler == "random",
        generator=torch.Generator().manual_seed(seed),
        num_workers=workers,
        multiprocessing_context="fork",
        persistent_workers=True,  # workers stay alive, idle, after the epoch: measured then
        collate_fn=collate_sizes,
    )
    it = iter(loader)
    per_worker = [0] * workers
    records = nbytes = crc = 0
    for wid, count, size, crcs in it:
        per_worker[wid] += count
        records += count
        nbytes += size
        crc += crcs
    procs = list(it._workers)  # type: ignore[attr-defined]
    if records != len(dataset) or min(per_worker) == 0 or not all(p.is_alive() for p in procs):
        sys.exit(f"bench_core: memory harness read {records}/{len(dataset)} records, per worker {per_worker}")
    gc.collect()
    pids = [os.getpid()] + [p.pid for p in procs]
    rollups = [smaps_rollup(pid) for pid in pids]  # all K workers alive and done with their share
    blob_kb = [mapping_pss(pid, str(path.resolve())) for pid in pids] if mode == "store" else [0] * len(pids)
    keys = ("Rss", "Pss", "Pss_Anon", "Pss_File", "Pss_Shmem")
    result = {
        "mode": mode,
        "records": records,
        "bytes": nbytes,
        "crc_sum": crc,
        "per_worker": per_worker,
        "pss_kb": [r.get("Pss", 0) for r in rollups],
        "anon_kb": [r.get("Pss_Anon", 0) for r in rollups],
        "file_kb": [r.get("Pss_File", 0) for r in rollups],
        "blob_kb": blob_kb,
        "total_kb": {k: sum(r.get(k, 0) for r in rollups) for k in keys},
    }
    it._shutdown_workers()  # type: ignore[attr-defined]
    print(json.dumps(result))


def run_mem_child(mode: str, path: Path, args: argparse.Namespace) -> dict[str, Any]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--mem-child", mode, str(path)]
    argv += ["--workers", str(args.workers), "--batch-size", str(args.batch_size), "--seed", str(args.seed)]
    argv += ["--sampler", args.sampler]
    proc = subprocess.run(argv, check=True, stdout=subprocess.PIPE, text=True)
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def bench_memory(
    report: Report, tmp: Path, blob: Path, lines_file: Path, lines: list[bytes], args: argparse.Namespace
) -> None:
    k, bs = args.workers, args.batch_size
    tiny_lines = lines[: k * bs]  # one batch per worker: every code path runs, the data is negligible
    tiny_blob, tiny_file = tmp / "tiny.smst", tmp / "tiny.txt"
    write_lines(tiny_file, tiny_lines)
    smstore.pack_files([tiny_file], tiny_blob, durable=False, progress=False)
    for p in (blob, tiny_blob, lines_file, tiny_file):
        warm(p)
    blob_size = blob.stat().st_size

    results: dict[str, list[dict[str, Any]]] = {m: [] for m in ("store", "store0", "list", "list0")}
    inputs = {"store": blob, "store0": tiny_blob, "list": lines_file, "list0": tiny_file}
    for _ in range(args.mem_repeats):
        for name, path in inputs.items():
            results[name].append(run_mem_child(name.rstrip("0"), path, args))

    if results["store"][0]["crc_sum"] != results["list"][0]["crc_sum"]:
        sys.exit("bench_core: the store and the list harness read different bytes")

    def median(name: str, measure: Callable[[dict[str, Any]], float]) -> float:
        return float(np.median([measure(r) for r in results[name]]))

    def total_pss(r: dict[str, Any]) -> float:
        return float(r["total_kb"]["Pss"])

    def own_pss(r: dict[str, Any]) -> float:
        # Anonymous memory plus the blob's own mapping: leaves out shared libraries, whose PSS share
        # moves whenever an unrelated process on the machine maps (or unmaps) the same libtorch.
        return float(sum(r["anon_kb"]) + sum(r["blob_kb"]))

    ratio, own = {}, {}
    for mode in ("store", "list"):
        ratio[mode] = (median(mode, total_pss) - median(mode + "0", total_pss)) * 1024 / blob_size
        own[mode] = (median(mode, own_pss) - median(mode + "0", own_pss)) * 1024 / blob_size
        full, empty = results[mode][0], results[mode + "0"][0]

        def mib(values: list[int]) -> str:
            return " + ".join(f"{kb / 1024:.1f}" for kb in values)

        blob_part = f"; blob mapping {mib(full['blob_kb'])}" if mode == "store" else ""
        report.notes.append(
            f"Memory, {mode} (first run), MiB per process (parent + {k} workers): Pss {mib(full['pss_kb'])}; "
            f"Pss_Anon {mib(full['anon_kb'])}; Pss_File {mib(full['file_kb'])}{blob_part}. Empty harness: "
            f"Pss {mib(empty['pss_kb'])}; Pss_Anon {mib(empty['anon_kb'])}. Records per worker "
            f"{full['per_worker']}."
        )
    report.add(
        f"memory: `SharedStoreDataset`, parent + {k} forked workers, (PSS - empty) / blob size",
        f"{ratio['store']:.2f}",
        f"{ratio['list']:.2f} (Python list of lines)",
        f"{ratio['store'] / ratio['list']:.2f}x" if ratio["list"] > 0 else "-",
        "<= 1.1",
        yes_no(ratio["store"] <= 1.1),
    )
    report.add(
        f"memory: Python `list` of the lines in the parent, {k} forked workers, (PSS - empty) / blob size",
        f"{ratio['list']:.2f}",
    )
    report.add(
        "(info) memory, shared libraries left out: (Pss_Anon + blob mapping PSS - empty) / blob size",
        f"{own['store']:.2f}",
        f"{own['list']:.2f} (Python list of lines)",
        f"{own['store'] / own['list']:.2f}x" if own["list"] > 0 else "-",
    )
    order = {
        "strided": "a shuffled order from an O(1)-memory strided permutation (i -> a*i+c mod n)",
        "random": "torch's RandomSampler (its list of n Python ints in the parent is counted)",
        "sequential": "index order",
    }[args.sampler]
    report.notes.append(
        f"Memory: each figure is a fresh `python` process that opens the data (the store; or reads the lines "
        f"file into a `list` of bytes), then iterates a `DataLoader(batch_size={bs}, num_workers={k}, "
        "multiprocessing_context='fork', persistent_workers=True)` over every record once, in "
        f"{order}; its collate_fn reads every byte of each record (CRC32) and returns (worker id, count, "
        "bytes, CRC sum), so nothing sizeable travels to the parent; the CRC sums of both harnesses must "
        "agree. With the workers still alive and idle, it sums the `Pss:` line of /proc/PID/smaps_rollup "
        f"over the parent and the {k} workers. The same harness on a {k * bs}-record dataset (one batch per "
        f"worker) is subtracted and the difference divided by the blob's file size ({blob_size / MiB:.1f} "
        f"MiB: data + index + header); median of {args.mem_repeats} run(s). The blob and the lines file were "
        "read once first, so they are in the page cache. PSS charges each mapped page 1/m to each of the m "
        "processes mapping it: the blob's page-cache pages, mapped by several workers, add up to about one "
        "copy in total, and page cache that no process maps counts for no one (this benchmark's own process "
        "holds no mapping of the blob during the measurement). The list's bytes objects live in the "
        "parent's anonymous memory; a worker that reads one writes its reference count, so the kernel "
        "copies that page into the worker (copy-on-write), and a shuffled epoch touches nearly every page "
        "from every worker. Shared libraries (libtorch) are in the total too; their PSS share changes when "
        "other processes on the machine map them, hence the 'shared libraries left out' row."
    )


# --------------------------------------------------------------------------------------------------
# Driver


def machine_info(tmp: Path) -> list[str]:
    model = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    fs = "?"
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        fs = subprocess.run(
            ["df", "--output=fstype", str(tmp)], check=True, capture_output=True, text=True
        ).stdout.split()[-1]
    commit = "?"
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        commit = subprocess.run(
            ["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    import torch

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    cpus = f"nproc {os.cpu_count()} (usable {len(os.sched_getaffinity(0))})"
    versions = f"Python {platform.python_version()}, numpy {np.__version__}, torch {torch.__version__}"
    return [
        f"- machine: {cpus}, CPU `{model}`, {ram:.0f} GiB RAM, Linux {platform.release()}",
        f"- software: {versions}, smstore {smstore.__version__} (git {commit})",
        f"- temp files: {fs} (the system temp dir unless --tmpdir names another)",
    ]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=1_000_000, help="records (lines) to pack (default 1e6)")
    p.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "core.md", help="Markdown file"
    )
    p.add_argument("--repeats", type=int, default=5, help="timing repeats for reads (best is kept)")
    p.add_argument("--pack-repeats", type=int, default=3, help="timing repeats for pack (best is kept)")
    p.add_argument("--pack-mib", type=int, default=256, help="minimum pack input size in MiB")
    p.add_argument("--workers", type=int, default=4, help="DataLoader workers for the memory measurement")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--mem-repeats", type=int, default=1, help="runs of each memory harness (median kept)")
    p.add_argument(
        "--sampler",
        choices=["strided", "random", "sequential"],
        default="strided",
        help="memory harness order: O(1)-memory strided shuffle (default), torch RandomSampler, or in order",
    )
    p.add_argument("--only", action="append", choices=SECTIONS, help="run only these sections (repeatable)")
    p.add_argument("--tmpdir", type=Path, default=None, help="where to write the corpus and blobs")
    p.add_argument("--seed", type=int, default=12345)
    p.add_argument("--mem-child", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.records < args.workers * args.batch_size * 2:
        p.error(f"--records must be at least {args.workers * args.batch_size * 2}")
    return args


@contextlib.contextmanager
def temp_dir(parent: Path | None) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="smstore-bench-", dir=parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.mem_child:
        mem_child(
            args.mem_child[0], Path(args.mem_child[1]), args.workers, args.batch_size, args.seed, args.sampler
        )
        return 0
    sections = set(args.only or SECTIONS)
    started = time.perf_counter()
    load_before = os.getloadavg()
    report = Report()
    with temp_dir(args.tmpdir) as tmp:
        log(f"building the corpus: {args.records} lines of stdlib sources")
        lines = stdlib_lines(args.records)
        lines_file, blob = tmp / "lines.txt", tmp / "core.smst"
        write_lines(lines_file, lines)
        stats = smstore.pack_files([lines_file], blob, durable=False, progress=False)
        if stats.records != len(lines):
            sys.exit(f"bench_core: packed {stats.records} records, expected {len(lines)}")
        warm(blob)
        blob_mib = blob.stat().st_size / MiB
        log(f"blob: {stats.records} records, {stats.data_bytes / MiB:.1f} MiB data, {blob_mib:.1f} MiB file")
        header = machine_info(tmp)
        # Memory first: this process must hold no mapping of the blob, or it would take a PSS share.
        if "memory" in sections:
            log("memory (PSS) ...")
            bench_memory(report, tmp, blob, lines_file, lines, args)
        if "reads" in sections:
            log("random reads ...")
            bench_reads(report, blob, lines, args.repeats, args.seed)
        if "batch" in sections:
            log("batched reads ...")
            bench_batches(report, blob, args.repeats, args.seed, args.batch_size)
        if "pack" in sections:
            log("pack throughput ...")
            del lines
            bench_pack(report, tmp, lines_file, stats.records, args.pack_mib, args.pack_repeats)
    elapsed = time.perf_counter() - started
    load_after = os.getloadavg()
    cmd = command_line("python benchmarks/bench_core.py", argv)
    corpus = (
        f"- corpus: first {stats.records} lines of the Python {platform.python_version()} standard library's "
        f".py files (sorted paths, cycled if short), {stats.data_bytes / MiB:.1f} MiB of record data, "
        f"blob {blob_mib:.1f} MiB"
    )
    doc = [
        "# smstore core benchmarks",
        "",
        f"- command: `{cmd}`",
        f"- date: {datetime.now(timezone.utc).isoformat(timespec='seconds')}",
        *header,
        corpus,
        f"- load average (1 min) before / after: {load_before[0]:.2f} / {load_after[0]:.2f}; run took {elapsed:.0f} s",
        "",
        report.table(),
        "",
        "Notes:",
        "",
        *[f"- {n}" for n in report.notes],
        "",
    ]
    text = portable("\n".join(doc))
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
