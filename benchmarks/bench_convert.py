"""Converters against their source library's own sequential read of the same data, and peak memory.

    python benchmarks/bench_convert.py                  # >= 1 GiB Parquet; writes results/convert.md
    python benchmarks/bench_convert.py --parquet-mib 64 --out /tmp/c.md    # quick

For each format, in one run on the same files (page cache warm, best of `--repeats`):

- baseline: the library's own sequential read of every record: pyarrow `iter_batches` +
  `to_pylist()` of the column, and `datasets.load_from_disk(...).iter(batch_size=1000)` (each also,
  in an info row, against the bare page decode / IPC read, which hands no record to Python: a
  floor that no reader of records reaches, not the goal); webdataset's
  `tar_file_iterator` over the members; a numpy slice of the mapped `.bin` per Megatron document
  (megatron-core's `IndexedDataset[i]`); `json.load` of the JSON list, and of a COCO-like file for
  `--key annotations` (its images list first);
- smstore: the converter writing a blob (`durable=False`, so the disk's fsync speed stays out).

Peak RSS: a child process converting the >= 1 GiB Parquet file (VmHWM), against the file size; and
children converting `--key annotations` after a large images list or one 200 MiB string, against
`--key images` (the values skipped must cost no memory).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from bench_core import MiB, Report, command_line, log, machine_info, temp_dir, write_results, yes_no

import smstore
from smstore.convert import convert_arrow, convert_json_list, convert_megatron, convert_webdataset

RESULTS = Path(__file__).parent / "results"


def best(repeats: int, fn: Callable[[], object], output: Path | None = None) -> float:
    """Min wall time of `fn`; `output` is removed before each run (a conversion writes a new file)."""
    times = []
    for _ in range(repeats):
        if output is not None and output.exists():
            shutil.rmtree(output) if output.is_dir() else output.unlink()
        os.sync()  # earlier runs' dirty pages must not be written back during this one
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def ratio_row(
    report: Report, name: str, mib: float, ours: float, theirs: float, lib: str, *, goal: bool = True
) -> None:
    """A converter against a read of the same data; `goal=False`: an info row (a floor, not the goal)."""
    r = theirs / ours
    report.add(
        name if goal else f"info: {name}",
        f"{mib / ours:.0f} MiB/s",
        baseline=f"{lib} {mib / theirs:.0f} MiB/s",
        ratio=f"{r:.2f}",
        goal=">= 0.5" if goal else "-",
        met=yes_no(r >= 0.5) if goal else "-",
    )


def make_parquet(path: Path, mib: int) -> int:
    """A Parquet file of at least `mib` MiB (uncompressed, so the file is as large as its text)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    vocab = ["the", "of", "and", "to", "in", "is", "that", "for", "it", "with", "as", "was", "on", "be"]
    pool = [" ".join(rng.choice(vocab, 80)) for _ in range(1000)]
    rows = written = 0
    with pq.ParquetWriter(
        path, pa.schema([("text", pa.string()), ("id", pa.int64())]), compression="none"
    ) as w:
        while written < mib * MiB * 1.35:  # the estimate below runs ~25 % above the file's size
            n = 50_000
            lens = rng.integers(20, 400, n)
            texts = [pool[i % 1000][: int(k)] for i, k in enumerate(lens)]
            w.write_table(pa.table({"text": texts, "id": np.arange(rows, rows + n)}), row_group_size=10_000)
            rows += n
            written += int(lens.sum()) + 8 * n
    return rows


def bench_parquet(report: Report, tmp: Path, mib: int, repeats: int) -> Path:
    import pyarrow.parquet as pq

    src = tmp / "big.parquet"
    rows = make_parquet(src, mib)
    size = src.stat().st_size / MiB
    log(f"parquet: {rows} rows, {size:.0f} MiB")

    def theirs() -> None:
        for batch in pq.ParquetFile(src).iter_batches(batch_size=4096, columns=["text"]):
            batch.column(0).buffers()  # decoded pages: every value's bytes in memory

    ours = best(
        repeats,
        lambda: convert_arrow(src, tmp / "p.smst", column="text", durable=False, progress=False),
        tmp / "p.smst",
    )

    def records() -> None:
        for batch in pq.ParquetFile(src).iter_batches(batch_size=4096, columns=["text"]):
            batch.column(0).to_pylist()  # every record as a Python object: what a reading loop sees

    name = f"parquet column -> blob ({size:.0f} MiB file)"
    ratio_row(report, name, size, ours, best(repeats, records), "pyarrow records")
    ratio_row(report, name, size, ours, best(repeats, theirs), "pyarrow page decode only", goal=False)
    with smstore.open(tmp / "p.smst") as s:
        if len(s) != rows:
            sys.exit(f"bench_convert: {len(s)} records, {rows} rows")
    return src


def bench_hf(report: Report, tmp: Path, repeats: int) -> None:
    try:
        import datasets
    except ImportError:
        report.notes.append("HF save_to_disk: skipped (datasets not installed)")
        return
    import pyarrow as pa

    n = 300_000
    texts = [f"sample {i} " + "x" * (i % 300) for i in range(n)]
    folder = tmp / "hf"
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(os.fspath(folder), max_shard_size="64MB")
    size = sum(p.stat().st_size for p in folder.glob("*.arrow")) / MiB

    def theirs() -> None:
        for f in sorted(folder.glob("*.arrow")):
            with pa.ipc.open_stream(f) as r:
                for batch in r:
                    batch.column(0).buffers()

    ours = best(
        repeats,
        lambda: convert_arrow(folder, tmp / "hf.smst", column="text", durable=False, progress=False),
        tmp / "hf.smst",
    )

    def records() -> None:
        ds = datasets.load_from_disk(os.fspath(folder))
        for batch in ds.iter(batch_size=1000):  # the documented fast way to read it all
            batch["text"]

    name = f"HF save_to_disk -> blob ({size:.0f} MiB)"
    ratio_row(report, name, size, ours, best(repeats, records), "datasets .iter()")
    ratio_row(report, name, size, ours, best(repeats, theirs), "pyarrow IPC, no decode", goal=False)


def bench_webdataset(report: Report, tmp: Path, repeats: int) -> None:
    try:
        import webdataset as wds
    except ImportError:
        report.notes.append("WebDataset: skipped (webdataset not installed)")
        return
    rng = np.random.default_rng(1)
    tars = []
    for k in range(4):
        path = tmp / f"wds-{k}.tar"
        with tarfile.open(path, "w") as tar:
            for i in range(5000):
                for ext, size in (("jpg", int(rng.integers(2000, 40000))), ("cls", 2), ("json", 60)):
                    data = rng.bytes(size)
                    info = tarfile.TarInfo(f"s{k}-{i:06d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        tars.append(path)
    size = sum(p.stat().st_size for p in tars) / MiB

    def theirs() -> None:
        for t in tars:
            with open(t, "rb") as f:
                for _ in wds.tariterators.tar_file_iterator(f):
                    pass

    ours = best(
        repeats,
        lambda: convert_webdataset(tars, tmp / "w.smst", durable=False, progress=False),
        tmp / "w.smst",
    )
    ratio_row(
        report, f"WebDataset tars -> blob ({size:.0f} MiB)", size, ours, best(repeats, theirs), "webdataset"
    )


def bench_megatron(report: Report, tmp: Path, repeats: int) -> None:
    rng = np.random.default_rng(2)
    lengths = rng.integers(50, 2000, 200_000).astype(np.int32)
    prefix = tmp / "mega"
    tokens = rng.integers(0, 50_000, int(lengths.sum()), dtype=np.uint16)
    (tmp / "mega.bin").write_bytes(tokens.tobytes())
    pointers = np.concatenate([[0], np.cumsum(lengths.astype(np.int64))[:-1]]) * 2
    docs = np.arange(len(lengths) + 1, dtype=np.int64)
    with open(tmp / "mega.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + (1).to_bytes(8, "little") + bytes([8]))
        f.write(len(lengths).to_bytes(8, "little") + len(docs).to_bytes(8, "little"))
        f.write(lengths.tobytes() + pointers.tobytes() + docs.tobytes())
    size = (tmp / "mega.bin").stat().st_size / MiB

    def theirs() -> None:
        # What megatron-core's IndexedDataset does per document: a numpy view of the mapped .bin.
        mm = np.memmap(tmp / "mega.bin", np.uint16, "r")
        for p, n in zip(pointers.tolist(), lengths.tolist(), strict=True):
            bytes(mm[p // 2 : p // 2 + n])

    ours = best(
        repeats,
        lambda: convert_megatron(prefix, tmp / "m.smst", durable=False, progress=False),
        tmp / "m.smst",
    )
    ratio_row(
        report,
        f"Megatron .bin/.idx -> blob ({size:.0f} MiB)",
        size,
        ours,
        best(repeats, theirs),
        "numpy memmap",
    )


def bench_json(report: Report, tmp: Path, repeats: int) -> None:
    objs = [
        {
            "id": i,
            "image_id": i // 7,
            "bbox": [i % 640, i % 480, 32.5, 17.25],
            "category_id": i % 80,
            "area": 561.0,
        }
        for i in range(300_000)
    ]
    src = tmp / "anns.json"
    src.write_text(json.dumps(objs))
    size = src.stat().st_size / MiB

    def theirs() -> None:
        with open(src, encoding="utf-8") as f:
            json.load(f)

    ours = best(
        repeats, lambda: convert_json_list(src, tmp / "j.smst", durable=False, progress=False), tmp / "j.smst"
    )
    ratio_row(report, f"JSON list -> blob ({size:.0f} MiB)", size, ours, best(repeats, theirs), "json.load")


def make_coco(path: Path, images: int, annotations: int) -> None:
    """A COCO-like file: info and licenses, the images list first, then annotations and categories."""
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 10**6, images).tolist()
    heights = rng.integers(200, 640, images).tolist()
    with open(path, "w", encoding="utf-8") as f:
        f.write('{"info": {"year": 2017, "description": "COCO-like"}, "licenses": [{"id": 1, "name": "x"}],')
        f.write(' "images": [')
        f.write(
            ",".join(
                f'{{"license": 3, "file_name": "{i:012d}.jpg", "coco_url": "http://images.cocodataset.org/'
                f'train2017/{i:012d}.jpg", "height": {h}, "width": 640, "date_captured": "2013-11-14 17:02:52", '
                f'"flickr_url": "http://farm7.staticflickr.com/6116/{i}_da26cf2c9e_z.jpg", "id": {i}}}'
                for i, h in zip(ids, heights, strict=True)
            )
        )
        f.write('], "annotations": [')
        polygon = ", ".join(f"{x:.2f}" for x in rng.uniform(0, 640, 24))
        f.write(
            ",".join(
                f'{{"segmentation": [[{polygon}]], "area": 702.1057, "iscrowd": 0, "image_id": {ids[a % images]}, '
                f'"bbox": [473.07, 395.93, 38.65, 28.67], "category_id": {a % 90 + 1}, "id": {a}}}'
                for a in range(annotations)
            )
        )
        f.write('], "categories": [{"supercategory": "person", "id": 1, "name": "person"}]}')


def make_big_string(path: Path, mib: int) -> None:
    """One string value of `mib` MiB (escapes and non-ASCII text in it) before a small list under "annotations"."""
    piece = 'lorem ipsum \\"dolor\\" sit amet caf\\u00e9 é\\n ' * 1000
    with open(path, "w", encoding="utf-8") as f:
        f.write('{"blob": "')
        f.writelines(piece for _ in range(mib * MiB // len(piece.encode())))
        f.write('", "annotations": [' + ",".join(json.dumps({"id": i}) for i in range(1000)) + "]}")


JSON_RSS_CHILD = """
import sys
from smstore.convert import convert_json_list
convert_json_list(sys.argv[1], sys.argv[2], key=sys.argv[3], durable=False, progress=False)
for line in open('/proc/self/status'):
    if line.startswith('VmHWM:'):
        print(int(line.split()[1]))
"""


def json_peak_mib(src: Path, out: Path, key: str) -> float:
    """Peak RSS (VmHWM) of a child converting the list under `key`."""
    run = subprocess.run(
        [sys.executable, "-c", JSON_RSS_CHILD, str(src), str(out), key],
        check=True,
        capture_output=True,
        text=True,
    )
    out.unlink()
    return int(run.stdout.split()[-1]) / 1024


def bench_json_coco(report: Report, tmp: Path, repeats: int) -> None:
    """--key annotations after a large images list: the list skipped is walked, never built."""
    src = tmp / "coco.json"
    make_coco(src, 240_000, 70_000)
    size = src.stat().st_size / MiB

    def theirs() -> None:
        with open(src, encoding="utf-8") as f:
            json.load(f)

    out = tmp / "anns.smst"
    ours = best(
        repeats,
        lambda: convert_json_list(src, out, key="annotations", durable=False, progress=False),
        out,
    )
    name = f"COCO --key annotations -> blob ({size:.0f} MiB, images list first)"
    ratio_row(report, name, size, ours, best(repeats, theirs), "json.load")
    out.unlink()
    images = json_peak_mib(src, out, "images")
    for what, path in (("a COCO file, images list skipped", src), ("after one 200 MiB string", None)):
        if path is None:
            path = tmp / "string.json"
            make_big_string(path, 200)
        peak = json_peak_mib(path, out, "annotations")
        report.add(
            f"peak RSS, --key annotations: {what} ({path.stat().st_size / MiB:.0f} MiB file)",
            f"{peak:.0f} MiB",
            baseline=f"--key images of the COCO file {images:.0f} MiB",
            ratio=f"{peak / images:.2f}",
            goal="< 1.5",
            met=yes_no(peak < 1.5 * images),
        )


RSS_CHILD = """
import sys
from smstore.convert import convert_arrow
convert_arrow(sys.argv[1], sys.argv[2], column="text", durable=False, progress=False)
for line in open('/proc/self/status'):
    if line.startswith('VmHWM:'):
        print(int(line.split()[1]))
"""


def bench_rss(report: Report, src: Path, tmp: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", RSS_CHILD, str(src), str(tmp / "rss.smst")],
        check=True,
        capture_output=True,
        text=True,
    )
    peak = int(out.stdout.split()[-1]) / 1024
    size = src.stat().st_size / MiB
    report.add(
        f"peak RSS converting a {size / 1024:.2f} GiB Parquet file",
        f"{peak:.0f} MiB",
        goal="< 300 MiB",
        met=yes_no(peak < 300),
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parquet-mib", type=int, default=1100)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS / "convert.md")
    p.add_argument("--tmpdir", type=Path)
    args = p.parse_args(argv)
    report = Report()
    started = time.perf_counter()
    with temp_dir(args.tmpdir) as tmp:
        header = machine_info(tmp)
        src = bench_parquet(report, tmp, args.parquet_mib, args.repeats)
        bench_rss(report, src, tmp)
        bench_hf(report, tmp, args.repeats)
        bench_webdataset(report, tmp, args.repeats)
        bench_megatron(report, tmp, args.repeats)
        bench_json(report, tmp, args.repeats)
        bench_json_coco(report, tmp, args.repeats)
    cmd = command_line("python benchmarks/bench_convert.py", argv)
    write_results(
        args.out,
        "Converters",
        [
            f"`{cmd}` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {time.perf_counter() - started:.0f} s.",
            "Throughput is source MiB per second; the ratio is the source library's own sequential read time",
            f"over the converter's (1.0: converting costs what reading does). Page cache warm, best of {args.repeats}.",
        ],
        header,
        report,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
