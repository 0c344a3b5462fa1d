"""Token windows: start-up for 10^12 tokens at L = 8192, and the windows against Megatron-core's GPTDataset.

    python benchmarks/bench_tokens.py              # writes benchmarks/results/tokens.md (~5 min on 2 cores)
    python benchmarks/bench_tokens.py --quick --out /tmp/tokens.md

Every figure is measured in this one run, on documents of log-normal lengths (median 700 tokens,
sigma 1, at least 1 token) of uint16 tokens, the end-of-document token ``EOD`` after each:

1. **Byte compare** (needs megatron-core, the ``bench`` extra; skipped with the reason without
   it): the documents (each ending in ``EOD``, as Megatron's preprocessing appends it) written
   with megatron-core's ``IndexedDatasetBuilder``, Megatron's ``GPTDataset`` (its own code,
   ``add_extra_token_to_sequence``: samples of ``L + 1`` tokens) built over them, and its every
   sample compared byte for byte with :class:`smstore.TokenWindows` (``eod=EOD``, the documents
   without it) over a blob and a sharded dataset of the same documents in the order of
   Megatron's document index (``GPTDataset`` always shuffles documents with its seed; that order
   is the one compared against). Megatron sample ``i`` is window ``shuffle_index[i]``.
2. **Start-up at 10^12 tokens, L = 8192**: one shard of ``--shard-mib`` of documents, a manifest
   that names it as many times as 10^12 tokens need (the same file, many shards: no disk beyond
   one shard). In a fresh process (imports done, another dataset opened and read first, so no
   lazy import is timed): the time to open the dataset, then from there to the first batch of
   ``--batch`` windows in a :class:`GlobalShuffleSampler` order (TokenWindows + sampler + batch;
   median of ``--repeats`` processes), with the Python memory each part allocates (tracemalloc
   peak) and the process's PSS delta; for stored order and for documents shuffled (``seed=``);
   and from the open for the same dataset with a file per shard (hard links of the one shard, so
   the open stats each). A fresh process owes the collector a full pass over what its imports
   allocated (torch's modules: ~170 k objects), which runs inside whatever allocates enough next
   (the open of 1865 shards, or not, by a few hundred objects either way): the child runs it
   before the clock (``gc.collect()``), its time reported apart, so the rows measure the open.
3. **Megatron's index build** for the same configuration: ``GPTDataset``'s document, sample and
   shuffle indexes built (and cached, as it does) at sizes it can build here, ``--megatron-tokens``,
   over an ``.idx`` written by megatron-core's own ``_IndexWriter`` with the lengths of the same
   distribution and a sparse ``.bin`` (the build reads only the lengths), timed in a fresh process
   with its arrays' bytes and PSS delta; extrapolated linearly to 10^12 tokens (a lower bound on
   time: its build grew faster than its size here, shuffles of larger arrays missing caches more).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
import types
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from bench_core import Report, command_line, log, machine_info, temp_dir, write_results, yes_no
from procs import pss_bytes

import smstore
from smstore.format.manifest import describe_shard, write_manifest

EOD = 50256
LENGTH = 8192
TOKENS = 10**12
MEDIAN, SIGMA = 700, 1.0


def lengths(count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.maximum(1, rng.lognormal(math.log(MEDIAN), SIGMA, size=count)).astype(np.int64)


def documents(tokens: int, seed: int) -> list[np.ndarray]:
    """Documents of about ``tokens`` uint16 tokens in all, none holding ``EOD``: views of one array."""
    sizes = lengths(int(tokens / (MEDIAN * math.exp(SIGMA**2 / 2))) + 1, seed)
    flat = np.random.default_rng(seed + 1).integers(1, EOD, size=int(sizes.sum()), dtype=np.uint16)
    return np.split(flat, np.cumsum(sizes)[:-1])


# --------------------------------------------------------------------------------------------------
# Megatron-core


def megatron_config(cache: Path, length: int) -> Any:
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    ident = {"class": "bench_tokens", "eod": EOD, "vocab_size": 65536}  # its cache key names the tokenizer
    tokenizer = types.SimpleNamespace(eod=EOD, vocab_size=65536, pad=EOD + 1, unique_identifiers=ident)
    return GPTDatasetConfig(
        random_seed=1234,
        sequence_length=length,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=str(cache),
    )


def megatron_dataset(prefix: Path, cache: Path, length: int) -> Any:
    """Megatron's GPTDataset over the IndexedDataset at ``prefix``: one epoch of its documents."""
    with warnings.catch_warnings():  # megatron-core warns that it runs without Apex / TE
        warnings.simplefilter("ignore")
        from megatron.core.datasets.gpt_dataset import GPTDataset
        from megatron.core.datasets.indexed_dataset import IndexedDataset
        from megatron.core.datasets.utils import Split

        indexed = IndexedDataset(str(prefix))
        docs = np.arange(len(indexed.sequence_lengths), dtype=np.int32)
        return GPTDataset(indexed, str(prefix), docs, None, Split.train, megatron_config(cache, length))


def megatron_missing() -> str | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import megatron.core.datasets.gpt_dataset  # noqa: F401
    except Exception as e:  # noqa: BLE001 (any failure to import it is the reason reported)
        return f"megatron-core does not import: {type(e).__name__}: {e}"
    return None


def byte_compare(report: Report, tmp: Path, tokens: int, length: int) -> None:
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    docs = documents(tokens, 3)
    prefix = tmp / "megatron"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for d in docs:
        builder.add_item(torch.from_numpy(np.append(d, np.uint16(EOD))))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    ds = megatron_dataset(prefix, tmp / "megatron-cache", length)
    order = [docs[int(d)] for d in ds.document_index]
    smstore.pack_arrays(order, tmp / "ordered.smst", durable=False)
    with smstore.ShardedWriter(
        f"{tmp / 'ordered'}/", encoding="npy:<u2", shard_records=len(order) // 7 + 1, durable=False
    ) as w:
        w.extend(d.tobytes() for d in order)
    for kind, path in (("blob", tmp / "ordered.smst"), ("sharded dataset, 7 shards", tmp / "ordered")):
        windows = smstore.TokenWindows(path, length, eod=EOD)
        same = 0
        for i in range(len(ds)):
            sample = ds[i]
            text = np.append(sample["tokens"].numpy(), sample["labels"].numpy()[-1:]).astype(np.int64)
            same += text.tobytes() == windows[int(ds.shuffle_index[i])].tobytes()
        ok = len(windows) == len(ds) and same == len(ds)
        report.add(
            f"windows equal to Megatron GPTDataset's, byte for byte (L = {length}, EOD included; {kind})",
            f"{same} of {len(ds)} (smstore: {len(windows)} windows)",
            goal="all",
            met=yes_no(ok),
        )
    report.notes.append(
        f"Byte compare: {len(docs)} documents, {sum(map(len, docs)) + len(docs)} tokens with their EOD "
        f"(megatron-core {megatron_version()}, GPTDataset seed 1234, its document order)."
    )


def megatron_version() -> str:
    from importlib import metadata

    return metadata.version("megatron-core")


def megatron_build_child(tmp: Path, tokens: int) -> dict[str, Any]:
    """Megatron's index build for ``tokens`` tokens of the distribution, in this (fresh) process."""
    from megatron.core.datasets.indexed_dataset import _IndexWriter

    def write(prefix: Path, sizes: np.ndarray) -> None:
        with _IndexWriter(f"{prefix}.idx", np.uint16) as writer:
            writer.write(sizes.astype(np.int32), None, np.arange(len(sizes) + 1, dtype=np.int64))
        with open(f"{prefix}.bin", "wb") as f:  # sparse: the index build reads only the lengths
            f.truncate(int(sizes.sum()) * 2)

    sizes = lengths(int(tokens / (MEDIAN * math.exp(SIGMA**2 / 2))) + 1, 7)
    prefix = tmp / f"megatron-{tokens}"
    write(prefix, sizes)
    write(tmp / f"megatron-warm-{tokens}", sizes[:1000])
    megatron_dataset(
        tmp / f"megatron-warm-{tokens}", tmp / f"warm-{tokens}", LENGTH // 64
    )  # imports, first calls
    before = pss_bytes(os.getpid())
    started = time.perf_counter()
    ds = megatron_dataset(prefix, tmp / f"cache-{tokens}", LENGTH)
    seconds = time.perf_counter() - started
    arrays = ds.document_index.nbytes + ds.sample_index.nbytes + ds.shuffle_index.nbytes
    return {
        "tokens": int(sizes.sum()),
        "windows": len(ds),
        "seconds": seconds,
        "index_bytes": int(arrays),
        "pss_delta": pss_bytes(os.getpid()) - before,
    }


# --------------------------------------------------------------------------------------------------
# smstore start-up


def repeated_dataset(tmp: Path, shard_mib: int) -> tuple[Path, Path, int]:
    """A dataset of >= 10^12 tokens: one shard of ``shard_mib`` named again and again by its manifest;
    and the same dataset with a file for each shard (hard links of the one shard)."""
    shard = tmp / "repeated" / "shard.smst"
    shard.parent.mkdir()
    smstore.pack_arrays(documents(shard_mib * 2**19, 11), shard, durable=False)
    info, encoding = describe_shard(shard, stored_path="shard.smst")
    repeats = -(-TOKENS // (info.data_bytes // 2 + info.records))
    write_manifest(shard.parent / "manifest.json", encoding, [info] * repeats, durable=False)
    linked = tmp / "linked"  # as many files as shards, as a real dataset has: a stat each at open
    linked.mkdir()
    for k in range(repeats):
        os.link(shard, linked / f"shard-{k:05d}.smst")
    infos = [dataclasses.replace(info, path=f"shard-{k:05d}.smst") for k in range(repeats)]
    write_manifest(linked / "manifest.json", encoding, infos, durable=False)
    warm = tmp / "warm"  # another dataset that a child opens first: lazy imports are not start-up
    warm.mkdir()
    write_manifest(
        warm / "manifest.json", encoding, [dataclasses.replace(info, path=str(shard))], durable=False
    )
    return shard.parent, linked, repeats


def startup_child(path: str, seed: int | None, batch: int) -> dict[str, Any]:
    """Open the dataset, then TokenWindows + sampler + the first batch, in this (fresh) process,
    imports done first: the times, Python allocations and PSS of each part."""
    import tracemalloc

    from smstore.sampling import GlobalShuffleSampler

    def first_batch(store: Any, *, keep: bool = True) -> tuple[int, np.ndarray]:
        windows = smstore.TokenWindows(store, LENGTH, eod=EOD, seed=seed)
        sampler = GlobalShuffleSampler(len(windows), seed=0, rank=0, world_size=1)
        it = iter(sampler)
        if keep:
            return len(windows), np.stack(windows.__getitems__([next(it) for _ in range(batch)]))
        for _ in range(batch):  # the index work alone: one window's tokens alive at a time
            out = windows[next(it)]
        return len(windows), out

    first_batch(smstore.open(str(Path(path).parent / "warm"), raw=True))
    full: list[tuple[float, float]] = []  # the collector's full passes in the timed part: (start, seconds)

    def count_full(phase: str, info: dict[str, int]) -> None:
        if info["generation"] == 2 and phase == "start":
            full.append((time.perf_counter(), 0.0))
        elif info["generation"] == 2:
            full[-1] = (full[-1][0], time.perf_counter() - full[-1][0])

    # The first full pass after the imports (owed by them, not by what runs next), before the clock:
    # a measure of the open that does not depend on whether its allocations set that pass off.
    collect = time.perf_counter()
    gc.collect()
    collect = time.perf_counter() - collect
    gc.callbacks.append(count_full)
    pss = [pss_bytes(os.getpid())]
    started = time.perf_counter()
    store = smstore.open(path, raw=True)
    opened = time.perf_counter()
    pss.append(pss_bytes(os.getpid()))
    count, out = first_batch(store)
    done = time.perf_counter()
    gc.callbacks.remove(count_full)
    pss.append(pss_bytes(os.getpid()))
    tracemalloc.start()
    store = smstore.open(path, raw=True)
    open_peak, (held, _) = tracemalloc.get_traced_memory()[1], tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    first_batch(store, keep=False)
    windows_peak = tracemalloc.get_traced_memory()[1] - held
    tracemalloc.stop()
    return {
        "open": opened - started,
        "windows": done - opened,
        "count": count,
        "shape": list(out.shape),
        "open_peak": open_peak,
        "windows_peak": windows_peak,
        "open_pss": pss[1] - pss[0],
        "windows_pss": pss[2] - pss[1],
        "full_collections": len(full),
        "full_seconds": sum(seconds for _, seconds in full),
        "collect": collect,
    }


def child(args: list[str]) -> dict[str, Any]:
    run = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(args)], capture_output=True, text=True, check=False
    )
    if run.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{run.stderr[-3000:]}")
    return dict(json.loads(run.stdout.strip().splitlines()[-1]))


def from_open(report: Report, what: str, runs: list[dict[str, Any]]) -> None:
    """The row of the time from opening the dataset to the first batch (median of `runs`)."""
    total = statistics.median(r["open"] + r["windows"] for r in runs)
    opened = statistics.median(r["open"] for r in runs)
    report.add(
        what, f"{total * 1e3:.1f} ms (open {opened * 1e3:.1f} ms)", goal="< 50 ms", met=yes_no(total < 0.05)
    )


def startup(report: Report, tmp: Path, shard_mib: int, repeats: int, batch: int) -> dict[str, Any]:
    path, linked, copies = repeated_dataset(tmp, shard_mib)
    log(f"dataset: {copies} copies of a {shard_mib} MiB shard")
    rows = {}
    every: list[dict[str, Any]] = []
    for name, seed in (("stored order", None), ("documents shuffled (seed=)", 1)):
        runs = [child(["startup", str(path), json.dumps(seed), str(batch)]) for _ in range(repeats)]
        every += runs

        def median(key: str, runs: list[dict[str, Any]] = runs) -> float:
            return statistics.median(r[key] for r in runs)

        count = runs[0]["count"]
        report.add(
            f"TokenWindows + GlobalShuffleSampler + first batch of {batch} x {LENGTH + 1} tokens, "
            f"{count:.3g} windows, {name}, after the dataset is open (median of {repeats} processes)",
            f"{median('windows') * 1e3:.1f} ms",
            goal="< 50 ms",
            met=yes_no(median("windows") < 0.05),
        )
        from_open(
            report, f"the same from opening the dataset ({copies} shards in its manifest), {name}", runs
        )
        report.add(
            f"index memory of TokenWindows + sampler + batch, {name}: Python allocations "
            f"(tracemalloc peak, one window's {(LENGTH + 1) * 8 // 1024} KiB included) / process PSS delta",
            f"{median('windows_peak') / 1024:.0f} KiB / {median('windows_pss') / 1024:.0f} KiB",
            goal="< 1 MiB",
            met=yes_no(median("windows_peak") < 2**20),
        )
        rows[name] = {"seconds": median("windows"), "peak": median("windows_peak"), "count": count}
    linked_runs = [child(["startup", str(linked), "null", str(batch)]) for _ in range(repeats)]
    every += linked_runs
    from_open(
        report,
        f"the same from opening the dataset, stored order, its {copies} shards {copies} files "
        "(hard links of the one shard: a stat each at open)",
        linked_runs,
    )
    hit = [r for r in every if r["full_collections"]]
    report.add(
        f"a fresh process's first full pass of the collector (its imports' debt), in the {len(every)} "
        "processes above: paid before the clock (gc.collect()); full passes inside the timed part",
        f"{statistics.median(r['collect'] for r in every) * 1e3:.0f} ms; in {len(hit)} of {len(every)} processes"
        + (f" ({statistics.median(r['full_seconds'] for r in hit) * 1e3:.0f} ms each)" if hit else ""),
    )
    report.add(
        f"opening the dataset: its manifest of {copies} shards parsed (tracemalloc peak / PSS delta)",
        f"{median('open_peak') / 1024:.0f} KiB / {median('open_pss') / 1024:.0f} KiB",
    )
    report.notes.append(
        f"Start-up dataset: one shard of {shard_mib} MiB named {copies} times by its manifest "
        f"({rows['stored order']['count'] * LENGTH:.3g} tokens). Opening it parses the manifest, "
        "O(shards), as any reader of the dataset does; TokenWindows then builds nothing per document or "
        "window. Its PSS delta counts every page the process touched: the offsets index pages its binary "
        "searches read (with documents shuffled, also those of each level's group bounds, up to 1025 "
        "scattered pages a level) and the windows' data pages: file pages, shared with every process "
        "reading them. The collector's full pass: a fresh process's first one after its imports "
        "(CPython 3.11 runs one once a tenth generation-1 pass finds the long-lived objects grown by a "
        "quarter), set off by the open's allocations (a dict and two objects a shard) or by whatever "
        "a training script allocates first: it costs the same wherever it falls, once a process, and "
        "the time from the open to the first batch does not include it."
    )
    return rows["stored order"]


def megatron_build(report: Report, tmp: Path, sizes: list[int], ours: dict[str, Any]) -> None:
    builds = [child(["megatron", str(tmp), str(tokens)]) for tokens in sizes]
    for b in builds:
        report.add(
            f"Megatron GPTDataset index build, {b['tokens']:.3g} tokens ({b['windows']} windows of {LENGTH})",
            f"{b['seconds'] * 1e3:.0f} ms; arrays {b['index_bytes'] / 2**20:.1f} MiB, PSS delta "
            f"{b['pss_delta'] / 2**20:.1f} MiB",
        )
    big = builds[-1]
    scale = TOKENS / big["tokens"]
    report.add(
        "Megatron GPTDataset index build extrapolated to 10^12 tokens (linear in tokens)",
        f"{big['seconds'] * scale:.0f} s; {big['index_bytes'] * scale / 2**30:.1f} GiB of index arrays",
        baseline=f"{ours['seconds'] * 1e3:.1f} ms, {ours['peak'] / 1024:.0f} KiB (smstore)",
        ratio=f"{big['seconds'] * scale / ours['seconds']:.0f}x",
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "tokens.md")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=5, help="start-up processes per row")
    ap.add_argument("--batch", type=int, default=8, help="windows in the first batch")
    ap.add_argument("--shard-mib", type=int, default=1024, help="the repeated shard's size")
    ap.add_argument("--compare-tokens", type=int, default=10_000_000, help="tokens of the byte compare")
    ap.add_argument("--compare-length", type=int, default=2048, help="L of the byte compare")
    ap.add_argument("--megatron-tokens", type=int, nargs="+", default=[10**8, 10**9, 10**10])
    ap.add_argument("--tmpdir", type=Path)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        what, *rest = json.loads(args.child)
        if what == "startup":
            result = startup_child(rest[0], json.loads(rest[1]), int(rest[2]))
        else:
            result = megatron_build_child(Path(rest[0]), int(rest[1]))
        print(json.dumps(result))
        return
    if args.quick:
        args.repeats, args.shard_mib, args.compare_tokens = 3, 256, 2_000_000
        args.megatron_tokens = [10**7, 10**8]
    started = time.perf_counter()
    report = Report()
    missing = megatron_missing()
    with temp_dir(args.tmpdir) as tmp:
        header = machine_info(tmp)
        if missing is None:
            log("byte compare")
            byte_compare(report, tmp, args.compare_tokens, args.compare_length)
        log("start-up")
        ours = startup(report, tmp, args.shard_mib, args.repeats, args.batch)
        if missing is None:
            log("megatron index build")
            megatron_build(report, tmp, args.megatron_tokens, ours)
    if missing is not None:
        report.notes.append(f"Megatron rows skipped: {missing}")
    report.notes.append(f"Run took {time.perf_counter() - started:.0f} s.")
    write_results(
        args.out,
        "Token windows: start-up at 10^12 tokens and Megatron's GPTDataset",
        [
            f"`{command_line('bench_tokens.py', argv)}`, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC.",
            "What each row measures: the docstring of benchmarks/bench_tokens.py.",
        ],
        header,
        report,
    )


if __name__ == "__main__":
    main()
