"""The contenders of ``python -m benchmarks``: smstore and what people use instead, on the same records.

Each contender builds its own store from the same records (a text file of one record per line,
as packed by every tool), and gives a reader with ``get(i)`` and ``get_batch(indices)``. Every
reader is built the way its own documentation recommends for random access, on its fast path:

- smstore: the node daemon's shared-memory copy, and a mapping of the file (``smstore.open``).
- a Python list of ``bytes`` per rank (the usual approach: PyTorch issue 13246).
- mmengine ``BaseDataset(serialize_data=True)`` (the real package): one pickled numpy array per rank.
- detectron2's serialized list, written out here (``detectron2/data/common.py``,
  ``_TorchSerializedList``: pickle each item, one uint8 tensor plus cumulative addresses).
- Hugging Face ``datasets``: ``save_to_disk`` then ``load_from_disk`` (memory-mapped Arrow).
- LMDB (py-lmdb): one key per record, opened read-only in each process after fork, batches
  through ``Cursor.getmulti``.
- litdata: ``optimize`` into a local directory, read with ``StreamingDataset[i]``.
- Mosaic ``streaming``: ``MDSWriter`` into a local directory, read with ``StreamingDataset[i]``.
- megatron-core: ``IndexedDatasetBuilder`` (uint8 documents) and ``IndexedDataset[i]``.
- SQLite: a table by rowid, opened read-only in each process after fork; batches as one
  ``WHERE rowid IN (...)`` query.
- a text file read by ``os.pread`` at offsets from an index (the ``seek()`` + offsets technique).

Records as objects (lists of dicts) have their own contenders: ``smstore.SharedList``, mmengine,
detectron2's list and a plain list; each builds from dicts made in every rank, as a training
script does.

A contender whose package is not installed is reported as skipped with the reason; none is
dropped silently. ``verify`` checks that every contender returns the same bytes for the same
indices (tests/test_contenders.py runs it on those installed), so none is timed doing less work.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pickle
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import smstore

Record = Any  # bytes, memoryview or a uint8 numpy array: whatever the library hands out


# --------------------------------------------------------------------------------------------------
# Data


def read_lines(path: Path) -> list[bytes]:
    """The records of a text file of one record per line (what every contender builds from)."""
    data = path.read_bytes()
    return data.split(b"\n")[:-1] if data.endswith(b"\n") else data.split(b"\n")


def make_dicts(n: int, seed: int = 0, empty: bool = False) -> list[dict[str, Any]]:
    """COCO-like annotations (as mmengine/detectron2 datasets hold them): a path, size, boxes, caption.

    ``empty``: n empty dicts (the memory baseline: the same length, no data).
    """
    if empty:
        return [{} for _ in range(n)]
    rng = random.Random(seed)
    words = ("a", "cat", "on", "the", "red", "bus", "two", "dogs")
    out = []
    for i in range(n):
        k = rng.choice((0, 1, 1, 2, 3, 4, 6, 9, 15))
        out.append(
            {
                "img_id": i,
                "img_path": f"data/coco/train2017/{i:012d}.jpg",
                "height": rng.randrange(200, 640),
                "width": rng.randrange(200, 640),
                "instances": [
                    {
                        "bbox": [
                            rng.uniform(0, 500),
                            rng.uniform(0, 400),
                            rng.uniform(1, 300),
                            rng.uniform(1, 300),
                        ],
                        "bbox_label": rng.randrange(80),
                        "ignore_flag": 0,
                        "area": rng.uniform(1, 90000),
                    }
                    for _ in range(k)
                ],
                "caption": " ".join(rng.choice(words) for _ in range(rng.randrange(3, 14))),
            }
        )
    return out


def as_bytes(record: Record) -> Any:
    """A record as bytes, whatever the library returned (a dict stays a dict), for the equality check."""
    if isinstance(record, np.ndarray):
        return record.tobytes()
    if isinstance(record, dict):
        return record
    return bytes(record)


# --------------------------------------------------------------------------------------------------
# Readers


class Reader:
    """Random access to one contender's records, as a training process holds it."""

    def __len__(self) -> int:
        raise NotImplementedError

    def get(self, i: int) -> Record:
        raise NotImplementedError

    def get_batch(self, indices: Sequence[int]) -> list[Record]:
        """The contender's batched access where it has one; a loop of ``get`` where it has none."""
        get = self.get
        return [get(i) for i in indices]

    def close(self) -> None:
        """Release what the reader holds (mappings, handles, shared memory)."""


class AfterFork(Reader):
    """A reader whose handle must be opened in the process that uses it (SQLite, LMDB: their docs say so).

    ``open`` runs on first use in each process, so a DataLoader worker forked from a rank opens
    its own handle instead of inheriting the rank's.
    """

    def __init__(self, n: int) -> None:
        self._n = n
        self._pid = -1
        self._handle: Any = None

    def __len__(self) -> int:
        return self._n

    def open(self) -> Any:
        raise NotImplementedError

    @property
    def handle(self) -> Any:
        if self._pid != os.getpid():
            self._handle = self.open()
            self._pid = os.getpid()
        return self._handle


class SmstoreReader(Reader):
    def __init__(self, path: Path, mode: str, socket: Path | None) -> None:
        from smstore.wire.client import open_store

        self.store = open_store(path, mode, socket)  # type: ignore[arg-type]
        self.get = self.store.__getitem__  # type: ignore[method-assign]
        self.get_batch = self.store.get_batch  # type: ignore[method-assign]

    def __len__(self) -> int:
        return len(self.store)

    def close(self) -> None:
        self.store.close()


class ListReader(Reader):
    def __init__(self, items: list[Any]) -> None:
        self.items = items
        self.get = items.__getitem__  # type: ignore[method-assign]

    def __len__(self) -> int:
        return len(self.items)

    def get_batch(self, indices: Sequence[int]) -> list[Record]:
        items = self.items
        return [items[i] for i in indices]


class MMEngineReader(Reader):
    """mmengine's BaseDataset with ``serialize_data=True`` (its default), an empty pipeline."""

    def __init__(self, items: list[Any], field: str | None) -> None:
        from mmengine.dataset import BaseDataset

        data_list = [{"record": x} for x in items] if field else items

        class Records(BaseDataset):  # type: ignore[misc]
            def load_data_list(self) -> list[Any]:
                return data_list

        self.ds = Records(serialize_data=True)
        self.field = field
        del data_list[:]  # the per-rank objects are freed, as a real dataset's annotations are

    def __len__(self) -> int:
        return len(self.ds)

    def get(self, i: int) -> Record:
        info = self.ds.get_data_info(i)  # unpickles the record's bytes from the serialized array
        if self.field:
            return info[self.field]
        del info["sample_idx"]  # added by get_data_info: not part of the record
        return info


class SerializedList(Reader):
    """detectron2's ``_TorchSerializedList`` (detectron2/data/common.py), the smallest faithful version.

    Each item is pickled; the pickles are concatenated into one uint8 array with the cumulative
    end addresses beside it, so a forked worker reads them without touching a refcount per item.
    detectron2 holds the arrays as torch tensors so that spawn workers get them through torch's
    shared memory; with fork (used here) a numpy array behaves the same.
    """

    def __init__(self, items: list[Any]) -> None:
        pickles = [np.frombuffer(pickle.dumps(x, protocol=-1), dtype=np.uint8) for x in items]
        self._addr = np.cumsum(np.asarray([len(p) for p in pickles], dtype=np.int64))
        self._lst = np.concatenate(pickles) if pickles else np.zeros(0, np.uint8)
        del items[:]

    def __len__(self) -> int:
        return len(self._addr)

    def get(self, i: int) -> Record:
        start = 0 if i == 0 else int(self._addr[i - 1])
        end = int(self._addr[i])
        return pickle.loads(memoryview(self._lst[start:end]))


class HFReader(Reader):
    def __init__(self, path: Path) -> None:
        import datasets

        datasets.disable_progress_bars()
        self.ds = datasets.load_from_disk(str(path))  # memory-maps the Arrow files

    def __len__(self) -> int:
        return len(self.ds)

    def get(self, i: int) -> Record:
        return self.ds[i]["record"]

    def get_batch(self, indices: Sequence[int]) -> list[Record]:
        return self.ds[list(indices)]["record"]  # type: ignore[no-any-return]


class LMDBReader(AfterFork):
    def __init__(self, path: Path, n: int) -> None:
        super().__init__(n)
        self.path = path

    def open(self) -> Any:
        import lmdb

        # The py-lmdb docs: open read-only after fork; lock=False for a read-only file no one writes.
        env = lmdb.open(str(self.path), readonly=True, lock=False, readahead=False, meminit=False)
        return env, env.begin(buffers=False)

    def get(self, i: int) -> Record:
        return self.handle[1].get(i.to_bytes(8, "big"))

    def get_batch(self, indices: Sequence[int]) -> list[Record]:
        cursor = self.handle[1].cursor()
        return [v for _, v in cursor.getmulti([i.to_bytes(8, "big") for i in indices])]

    def close(self) -> None:
        if self._pid == os.getpid():
            self._handle[0].close()
        self._pid = -1


class SQLiteReader(AfterFork):
    def __init__(self, path: Path, n: int) -> None:
        super().__init__(n)
        self.path = path

    def open(self) -> Any:
        # Opened after fork: a connection inherited across fork corrupts reads ("database disk image
        # is malformed"). Read-only URI, so nothing takes write locks.
        return sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=False)

    def get(self, i: int) -> Record:
        return self.handle.execute("SELECT data FROM records WHERE id = ?", (i,)).fetchone()[0]

    def get_batch(self, indices: Sequence[int]) -> list[Record]:
        query = f"SELECT id, data FROM records WHERE id IN ({','.join('?' * len(indices))})"
        found = dict(self.handle.execute(query, list(indices)).fetchall())
        return [found[i] for i in indices]

    def close(self) -> None:
        if self._pid == os.getpid():
            self._handle.close()
        self._pid = -1


class PreadReader(AfterFork):
    """A text file and an int64 offsets index; each record is one ``os.pread`` at its offset."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offsets = np.load(path.with_suffix(".offsets.npy"))
        super().__init__(len(self.offsets) - 1)

    def open(self) -> Any:
        return os.open(self.path, os.O_RDONLY)

    def get(self, i: int) -> Record:
        start, end = int(self.offsets[i]), int(self.offsets[i + 1]) - 1  # minus the "\n"
        return os.pread(self.handle, end - start, start)

    def close(self) -> None:
        if self._pid == os.getpid():
            os.close(self._handle)
        self._pid = -1


class LitdataReader(Reader):
    def __init__(self, path: Path) -> None:
        from litdata import StreamingDataset

        self.ds = StreamingDataset(input_dir=str(path))
        index = json.loads((path / "index.json").read_text())
        self._n = sum(chunk["chunk_size"] for chunk in index["chunks"])  # len() depends on the world size

    def __len__(self) -> int:
        return self._n

    def get(self, i: int) -> Record:
        return self.ds[i]


class MosaicReader(Reader):
    def __init__(self, path: Path) -> None:
        from streaming import StreamingDataset

        self.ds = StreamingDataset(local=str(path), shuffle=False, batch_size=1)

    def __len__(self) -> int:
        return int(self.ds.num_samples)  # len() is this rank's share of an epoch

    def get(self, i: int) -> Record:
        return self.ds.get_item(i)["record"]


class MegatronReader(Reader):
    def __init__(self, prefix: Path) -> None:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        self.ds = IndexedDataset(str(prefix), mmap=True)

    def __len__(self) -> int:
        return len(self.ds)

    def get(self, i: int) -> Record:
        return self.ds[i]


class NullReader(Reader):
    """The baseline: the same length, sampler and loader, empty records."""

    def __init__(self, n: int) -> None:
        self._n = n

    def __len__(self) -> int:
        return self._n

    def get(self, i: int) -> Record:
        return b""

    def get_batch(self, indices: Sequence[int]) -> list[Record]:
        return [b""] * len(indices)


# --------------------------------------------------------------------------------------------------
# Builders: each writes its store under `out` from the text file `src` (records one per line).


def build_smstore(src: Path, out: Path) -> None:
    smstore.pack_files([src], out / "data.smst", durable=False, progress=False)  # no fsync, as the others


def build_hf(src: Path, out: Path) -> None:
    import datasets

    datasets.disable_progress_bars()

    def gen() -> Iterator[dict[str, bytes]]:
        with open(src, "rb") as f:
            for line in f:
                yield {"record": line[:-1]}

    features = datasets.Features({"record": datasets.Value("binary")})
    ds = datasets.Dataset.from_generator(gen, features=features, cache_dir=str(out / "cache"))
    ds.save_to_disk(str(out / "hf"))
    del ds
    shutil.rmtree(out / "cache", ignore_errors=True)


def build_lmdb(src: Path, out: Path) -> None:
    import lmdb

    size = src.stat().st_size
    env = lmdb.open(str(out / "lmdb"), map_size=max(1 << 30, size * 4), subdir=True, lock=True)
    with env.begin(write=True) as txn, open(src, "rb") as f:
        for i, line in enumerate(f):
            txn.put(i.to_bytes(8, "big"), line[:-1], append=True)  # keys in order: append is the fast path
    env.sync()
    env.close()


def build_sqlite(src: Path, out: Path) -> None:
    db = sqlite3.connect(out / "records.sqlite")
    db.execute("PRAGMA journal_mode = OFF")
    db.execute("PRAGMA synchronous = OFF")
    db.execute("CREATE TABLE records (id INTEGER PRIMARY KEY, data BLOB NOT NULL)")
    with open(src, "rb") as f:
        db.executemany("INSERT INTO records VALUES (?, ?)", ((i, line[:-1]) for i, line in enumerate(f)))
    db.commit()
    db.close()


def build_pread(src: Path, out: Path) -> None:
    dst = out / "records.txt"
    shutil.copyfile(src, dst)
    with open(src, "rb") as f:
        lengths = [len(line) for line in f]
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    np.save(dst.with_suffix(".offsets.npy"), offsets)


def _litdata_item(line: bytes) -> bytes:
    return line


def build_litdata(src: Path, out: Path) -> None:
    from litdata import optimize

    optimize(
        fn=_litdata_item,
        inputs=read_lines(src),
        output_dir=str(out / "litdata"),
        chunk_bytes="64MB",
        num_workers=1,  # the records must keep their order (the inputs are split among workers)
        mode="overwrite",
        verbose=False,
    )


def build_mosaic(src: Path, out: Path) -> None:
    from streaming import MDSWriter

    with (
        MDSWriter(out=str(out / "mds"), columns={"record": "bytes"}, size_limit="64mb") as w,
        open(src, "rb") as f,
    ):
        for line in f:
            w.write({"record": line[:-1]})


def build_megatron(src: Path, out: Path) -> None:
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = out / "megatron"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint8)
    with open(src, "rb") as f:
        for line in f:
            builder.add_item(torch.from_numpy(np.frombuffer(line, dtype=np.uint8)[:-1].copy()))
            builder.end_document()
    builder.finalize(f"{prefix}.idx")


# --------------------------------------------------------------------------------------------------
# The contenders


@dataclass(frozen=True)
class Contender:
    key: str
    label: str
    kind: str  # "bytes" (records of a text file) or "objects" (dicts made in every rank)
    needs: tuple[str, ...]  # importable modules it needs
    follows: str  # the upstream code or docs it is built from
    build: Callable[[Path, Path], None] | None  # (source text file, out dir); None: built in each rank
    open: Callable[[Path, Any], Reader]  # (out dir, context) -> reader, in the process that reads
    batched: bool = False  # has a batched access of its own
    shared: bool = True  # one copy per node by design (else one per rank)
    access: str = "mmap"  # how a reader reaches the bytes: what PSS can see of them

    def missing(self) -> str | None:
        """Why it cannot run here (a module not installed or not importable), or None."""
        for mod in self.needs:
            if importlib.util.find_spec(mod.split(".")[0]) is None:
                return f"`{mod}` is not installed (pip install '.[bench]', see benchmarks/README.md)"
        for mod in self.needs:
            try:
                with warnings.catch_warnings():  # megatron-core warns that it runs without Apex
                    warnings.simplefilter("ignore")
                    __import__(mod)
            except Exception as exc:  # noqa: BLE001 - a broken install is reported, never hidden
                return f"`import {mod}` fails: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        return None


@dataclass
class Context:
    """What a rank needs to open a contender: the source file, record count, the daemon's socket."""

    src: Path
    n: int
    socket: Path | None = None
    objects: int = 0  # objects contenders: how many dicts each rank makes
    empty: bool = False  # objects contenders: make empty dicts (the memory baseline)


def _lines(ctx: Context) -> list[bytes]:
    return read_lines(ctx.src)


CONTENDERS: list[Contender] = [
    Contender(
        "smstore-daemon",
        "smstore (daemon)",
        "bytes",
        (),
        "smstore serve + smstore.open(mode='daemon')",
        build_smstore,
        lambda out, ctx: SmstoreReader(out / "data.smst", "daemon", ctx.socket),
        batched=True,
        access="shared memory (daemon)",
    ),
    Contender(
        "smstore-mmap",
        "smstore (mmap)",
        "bytes",
        (),
        "smstore.open(mode='mmap')",
        build_smstore,
        lambda out, ctx: SmstoreReader(out / "data.smst", "mmap", None),
        batched=True,
    ),
    Contender(
        "list",
        "Python list",
        "bytes",
        (),
        "a list of bytes per rank (PyTorch issue 13246)",
        None,
        lambda out, ctx: ListReader(_lines(ctx)),
        shared=False,
        access="process memory",
    ),
    Contender(
        "mmengine",
        "mmengine BaseDataset",
        "bytes",
        ("mmengine.dataset",),
        "mmengine BaseDataset(serialize_data=True), one serialized array per rank",
        None,
        lambda out, ctx: MMEngineReader(_lines(ctx), "record"),
        shared=False,
        access="process memory",
    ),
    Contender(
        "detectron2",
        "detectron2 serialized list",
        "bytes",
        (),
        "detectron2/data/common.py _TorchSerializedList (written out here), one per rank",
        None,
        lambda out, ctx: SerializedList(_lines(ctx)),
        shared=False,
        access="process memory",
    ),
    Contender(
        "hf",
        "HF datasets (Arrow)",
        "bytes",
        ("datasets",),
        "datasets save_to_disk + load_from_disk, ds[i] / ds[indices]",
        build_hf,
        lambda out, ctx: HFReader(out / "hf"),
        batched=True,
    ),
    Contender(
        "lmdb",
        "LMDB",
        "bytes",
        ("lmdb",),
        "py-lmdb, read-only env opened after fork, Cursor.getmulti for batches",
        build_lmdb,
        lambda out, ctx: LMDBReader(out / "lmdb", ctx.n),
        batched=True,
    ),
    Contender(
        "litdata",
        "litdata",
        "bytes",
        ("litdata",),
        "litdata optimize + StreamingDataset[i] on a local dir",
        build_litdata,
        lambda out, ctx: LitdataReader(out / "litdata"),
        access="its chunk reader",
    ),
    Contender(
        "mosaic",
        "Mosaic streaming (MDS)",
        "bytes",
        ("streaming",),
        "streaming MDSWriter + StreamingDataset(local=...)[i]",
        build_mosaic,
        lambda out, ctx: MosaicReader(out / "mds"),
        access="read() (page cache, not in PSS)",
    ),
    Contender(
        "megatron",
        "megatron-core IndexedDataset",
        "bytes",
        ("megatron.core.datasets.indexed_dataset",),
        "megatron-core IndexedDatasetBuilder (uint8) + IndexedDataset[i] (mmap)",
        build_megatron,
        lambda out, ctx: MegatronReader(out / "megatron"),
    ),
    Contender(
        "sqlite",
        "SQLite by rowid",
        "bytes",
        (),
        "sqlite3, INTEGER PRIMARY KEY, read-only connection opened after fork; batches: WHERE id IN (...)",
        build_sqlite,
        lambda out, ctx: SQLiteReader(out / "records.sqlite", ctx.n),
        batched=True,
        access="read() (page cache, not in PSS)",
    ),
    Contender(
        "pread",
        "text file + offsets",
        "bytes",
        (),
        "seek()/os.pread into a text file by an int64 offsets index",
        build_pread,
        lambda out, ctx: PreadReader(out / "records.txt"),
        access="pread() (page cache, not in PSS)",
    ),
    # Records as objects: each rank makes the dicts, as a training script does.
    Contender(
        "obj-sharedlist",
        "smstore SharedList",
        "objects",
        (),
        "smstore.SharedList(dicts): one copy per node",
        None,
        lambda out, ctx: ListReader(smstore.SharedList(make_dicts(ctx.objects, empty=ctx.empty))),  # type: ignore[arg-type],
        access="shared memory",
    ),
    Contender(
        "obj-mmengine",
        "mmengine BaseDataset",
        "objects",
        ("mmengine.dataset",),
        "mmengine BaseDataset(serialize_data=True)",
        None,
        lambda out, ctx: MMEngineReader(make_dicts(ctx.objects, empty=ctx.empty), None),
        shared=False,
        access="process memory",
    ),
    Contender(
        "obj-detectron2",
        "detectron2 serialized list",
        "objects",
        (),
        "detectron2/data/common.py _TorchSerializedList (written out here)",
        None,
        lambda out, ctx: SerializedList(make_dicts(ctx.objects, empty=ctx.empty)),
        shared=False,
        access="process memory",
    ),
    Contender(
        "obj-list",
        "Python list",
        "objects",
        (),
        "a list of dicts per rank",
        None,
        lambda out, ctx: ListReader(make_dicts(ctx.objects, empty=ctx.empty)),
        shared=False,
        access="process memory",
    ),
]

BY_KEY = {c.key: c for c in CONTENDERS}
NULL = Contender("null", "empty records", "bytes", (), "baseline", None, lambda out, ctx: NullReader(ctx.n))


def store_dir(root: Path, contender: Contender) -> Path:
    """Where a contender's store lives (smstore's two modes share one blob)."""
    return root / ("smstore" if contender.key.startswith("smstore") else contender.key)


def dir_bytes(path: Path) -> int:
    """Bytes on disk under a directory (allocated blocks, as ``du`` counts)."""
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


# --------------------------------------------------------------------------------------------------
# The daemon


@contextlib.contextmanager
def daemon(sock: Path, *blobs: Path, options: Sequence[str] = ()) -> Iterator[subprocess.Popen[bytes]]:
    """``smstore serve`` on its own socket, serving ``blobs``, until the block ends (stopped by its pid);
    ``options`` go on its command line (``("--shm-limit", "64M")``)."""
    from smstore.wire.client import daemon_request

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "smstore",
            "serve",
            "--socket",
            os.fspath(sock),
            *options,
            *map(os.fspath, blobs),
        ],
        stderr=subprocess.DEVNULL,
        cwd=sock.parent,  # not a checkout, whose smstore/ may hold only sources
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            with contextlib.suppress(smstore.DaemonError):
                st = daemon_request({"op": "status"}, sock)
                if len(st["segments"]) == len(blobs) and not st["loading"]:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("smstore serve did not start")
            time.sleep(0.05)
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


# --------------------------------------------------------------------------------------------------
# Equality


def verify(readers: dict[str, Reader], expected: Sequence[Any], indices: Sequence[int]) -> None:
    """Every reader returns ``expected[i]`` for every i, through ``get`` and ``get_batch``; raises if not.

    Records compare as bytes (a dict, by ``==``), so no contender is measured doing less work.
    """
    want = [expected[i] for i in indices]
    for key, reader in readers.items():
        if len(reader) != len(expected):
            raise AssertionError(f"{key}: {len(reader)} records, expected {len(expected)}")
        got = [as_bytes(reader.get(i)) for i in indices]
        batch = [as_bytes(r) for r in reader.get_batch(list(indices))]
        for name, values in (("get", got), ("get_batch", batch)):
            bad = next((k for k, (g, w) in enumerate(zip(values, want, strict=True)) if g != w), None)
            if bad is not None:
                i = indices[bad]
                raise AssertionError(f"{key}.{name}({i}) = {values[bad][:60]!r}, expected {want[bad][:60]!r}")
