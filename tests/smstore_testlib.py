"""Helpers shared by the tests, importable by name so spawn/forkserver DataLoader workers can unpickle them."""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import pickle
import random
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import xxhash

HEADER_SIZE = 4096
MAGIC = b"\x89SMST\r\n\x1a"
# The on-disk header (csrc/format.hpp): little-endian, 104 bytes, zero padded to 4096.
HEADER_STRUCT = struct.Struct("<8sIIQQQQQQQQQIIQ")
HEADER_FIELDS = (
    "magic",
    "version",
    "header_size",
    "flags",
    "file_size",
    "record_count",
    "data_offset",
    "data_size",
    "index_offset",
    "index_size",
    "meta_offset",
    "meta_size",
    "checksum_algo",
    "reserved0",
    "checksum",
)
CHECKSUM_OFFSET = 96
# Where test subprocesses run: `python -c` and `python -m` put their cwd first on sys.path, and from
# the repository root that would shadow the installed smstore with the unbuilt source tree.
SAFE_CWD = Path(__file__).resolve().parent


# name -> (byte offset, struct format), as laid out in csrc/format.hpp.
FIELDS: dict[str, tuple[int, str]] = {
    "magic": (0, "<8s"),
    "version": (8, "<I"),
    "header_size": (12, "<I"),
    "flags": (16, "<Q"),
    "file_size": (24, "<Q"),
    "record_count": (32, "<Q"),
    "data_offset": (40, "<Q"),
    "data_size": (48, "<Q"),
    "index_offset": (56, "<Q"),
    "index_size": (64, "<Q"),
    "meta_offset": (72, "<Q"),
    "meta_size": (80, "<Q"),
    "checksum_algo": (88, "<I"),
    "reserved0": (92, "<I"),
    "checksum": (96, "<Q"),
}


def parse_header(blob: bytes) -> dict[str, Any]:
    return dict(zip(HEADER_FIELDS, HEADER_STRUCT.unpack_from(blob, 0), strict=True))


def set_field(blob: bytes | bytearray, name: str, value: Any) -> bytearray:
    """A copy of `blob` with one header field replaced (the checksum is left stale)."""
    out = bytearray(blob)
    offset, fmt = FIELDS[name]
    struct.pack_into(fmt, out, offset, value)
    return out


def expected_checksum(blob: bytes) -> int:
    """The documented rule: XXH64 of bytes[4096:] followed by the header with the checksum zeroed."""
    header = bytearray(blob[:HEADER_SIZE])
    header[CHECKSUM_OFFSET : CHECKSUM_OFFSET + 8] = bytes(8)
    return xxhash.xxh64(bytes(blob[HEADER_SIZE:]) + bytes(header)).intdigest()


def reseal(blob: bytes | bytearray) -> bytearray:
    """Recompute the checksum after a deliberate edit, so that only the structural fault remains."""
    out = bytearray(blob)
    struct.pack_into("<Q", out, CHECKSUM_OFFSET, expected_checksum(bytes(out)))
    return out


# No record contains '\n', so the same list packs identically through the lines packer.
AWKWARD = [
    b"",
    b"hello",
    b"\r",
    b"carriage\r",
    b"\rlead and\rmiddle\r",
    b"\x00",
    b"nul\x00in\x00the\x00middle",
    b"\xff\xfe\xfd invalid utf-8 \xc3\x28 \xed\xa0\x80",
    "h\u00e9llo w\u00f6rld \u6f22\u5b57 \U0001f600".encode(),
    b"",
    b" ",
    b"\t\x0b\x0c",
    b"\x1a\x89SMST",
    bytes(range(256)).replace(b"\n", b""),
    b"x" * 5000,
    b"",
]


def random_records(n: int, seed: int = 0, max_len: int = 200, newline: bool = False) -> list[bytes]:
    """`n` random records of random bytes (no '\\n' unless asked), some empty."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = 0 if i % 17 == 0 else rng.randrange(max_len)
        rec = rng.randbytes(length)
        if not newline:
            rec = rec.replace(b"\n", b"\r")
        out.append(rec)
    return out


def lines_oracle(data: bytes) -> list[bytes]:
    """Records `smstore pack` must produce for one text input: every line without its '\\n'."""
    if not data:
        return []
    parts = data.split(b"\n")
    if parts[-1] == b"":
        parts.pop()
    return parts


def lines_oracle_files(datas: Iterable[bytes]) -> list[bytes]:
    out: list[bytes] = []
    for d in datas:
        out.extend(lines_oracle(d))
    return out


def printable_records(n: int, size: int, seed: int, *, vary: bool = True) -> list[bytes]:
    """`n` records of random printable ASCII, of size//2 to size bytes (with `vary`) or of `size` each."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [
        bytes(
            rng.integers(32, 127, size=int(rng.integers(size // 2, size)) if vary else size, dtype=np.uint8)
        )
        for _ in range(n)
    ]


def sharded(
    where: Path,
    records: Sequence[bytes],
    *,
    shard_size: int | None = None,
    shard_records: int | None = None,
    name: str = "ds",
) -> Path:
    """`records` as the dataset where/NAME: lines in shards of `shard_size` bytes, or of `shard_records`."""
    import smstore

    out = where / name
    if shard_records is not None:
        with smstore.ShardedWriter(f"{out}/", shard_records=shard_records, durable=False) as w:
            w.extend(records)
        return out
    src = where / f"{name}.txt"
    src.write_bytes(b"".join(r + b"\n" for r in records))
    smstore.pack_files([src], out, shard_size=shard_size, progress=False, durable=False)
    return out


def random_sharded(
    where: Path, *, shards: int, per_shard: int, size: int, seed: int
) -> tuple[Path, list[bytes]]:
    """A dataset of `shards` shards of ~`per_shard` printable records (size//2..size bytes), and them."""
    recs = printable_records(shards * per_shard, size, seed)
    return sharded(where, recs, shard_size=per_shard * (size * 3 // 4 + 1)), recs


def read_records(store: str | os.PathLike[str] | Any, *, verify: bool = False) -> list[bytes]:
    """Every record's raw bytes: of an open store, or of the blob or dataset at a path (opened raw)."""
    import smstore

    if not isinstance(store, (str, os.PathLike)):
        return [bytes(store[i]) for i in range(len(store))]
    with smstore.open(store, verify=verify, raw=True) as s:
        return read_records(s)


def stray_temps(directory: str | os.PathLike[str]) -> list[str]:
    """Temporary files the writer may leave behind (named `.NAME.smstore-tmp-*`)."""
    return sorted(p.name for p in Path(directory).iterdir() if ".smstore-tmp-" in p.name)


# ---- picklable callables for DataLoader workers (spawn/forkserver import them by name) ----


def tag_with_pid(record: Any) -> tuple[int, Any]:
    return (os.getpid(), record)


def identity_collate(batch: Sequence[Any]) -> list[Any]:
    return list(batch)


def to_bytes(view: memoryview) -> bytes:
    return bytes(view)


def upper(record: bytes) -> bytes:
    return record.upper()


# ---- object records and SharedList ----


def annotation(i: int) -> dict[str, Any]:
    """A COCO-like record of varied size: file name, a few boxes, labels, a caption."""
    rng = random.Random(i)
    boxes = [
        [rng.uniform(0, 600), rng.uniform(0, 400), rng.uniform(1, 200), rng.uniform(1, 200)]
        for _ in range(i % 7)
    ]
    return {
        "img_id": i,
        "file_name": f"{i:012d}.jpg",
        "boxes": boxes,
        "labels": [rng.randrange(80) for _ in boxes],
        "caption": "a photo of " + " and ".join(["a cat", "two dogs", "a red bus"][: 1 + i % 3]),
        "crowd": i % 11 == 0,
        "extra": None if i % 2 else (i, f"t{i}"),
    }


class ItemsDataset:
    """A map-style dataset over any sequence; each item comes back with the reading process's view of it."""

    def __init__(self, items: Sequence[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[int, int, str, Any]:
        role = getattr(self.items, "role", "")
        return (i, os.getpid(), role, self.items[i])


def report_shared_list(lst: Any, q: Any) -> None:
    """A multiprocessing child: what it sees of a SharedList it was handed."""
    q.put((lst.role, lst[7], len(lst), os.fstat(lst._fd).st_ino))


@contextlib.contextmanager
def child_process(
    args: Sequence[str], *, group: bool = False, **popen: Any
) -> Iterator[subprocess.Popen[Any]]:
    """``subprocess.Popen(args, **popen)`` for the block: on every way out, the child is killed (by its
    pid; with `group`, it leads a session of its own and its process group is killed) if it still
    runs, reaped, and its pipes are closed.

    A pipe left open when a test fails is freed only when pytest drops that failure's traceback (at
    the next failure) and the collector runs: its ResourceWarning then fails whichever test is
    running, far from the cause (issue 36).
    """
    # Popen's own exit closes the pipes and then waits; the kill before it makes that wait short.
    with subprocess.Popen(args, start_new_session=group, **popen) as p:
        try:
            yield p
        finally:
            if p.poll() is None:
                if group:
                    os.killpg(p.pid, signal.SIGKILL)
                else:
                    p.kill()


def run_cli(*args: str | os.PathLike[str], stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    """`smstore ARGS...` in a child process (run from SAFE_CWD), output captured, never raising."""
    return subprocess.run(
        [sys.executable, "-m", "smstore", *map(os.fspath, args)],
        input=stdin,
        capture_output=True,
        timeout=120,
        check=False,
        cwd=SAFE_CWD,
    )


def interleave(streams: list[list[int]]) -> list[int]:
    """Rank r's i-th sample sits at global position r + i*W."""
    return [x for row in itertools.zip_longest(*streams) for x in row if x is not None]


def whole_order(sampler: Callable[..., Any], *args: Any, epoch: int = 0, **kw: Any) -> list[int]:
    """The whole order of `epoch`: what sampler(*args, rank=0, world_size=1, **kw) yields in it."""
    s = sampler(*args, rank=0, world_size=1, **kw)
    s.set_epoch(epoch)
    return list(s)


def loader_batches(loader: object, k: int | None = None) -> list[int]:
    """The indices of the first `k` batches (all with None) of a loader of index tensors."""
    # islice takes exactly k batches from the loader (a loop that breaks would receive one more).
    return [x for batch in itertools.islice(loader, k) for x in batch.tolist()]  # type: ignore[call-overload]


# World sizes of a resume test, and the batches each rank reads at each (None: the rest).
RESUME_PLAN: list[tuple[int, int | None]] = [(1, 5), (3, 2), (8, 1), (2, None)]


def stateful_resume(
    sdl: Any, make_sampler: Callable[[int, int], Any], items: int, batch: int, num_workers: int
) -> tuple[list[int], list[int]]:
    """Reads through torchdata's StatefulDataLoader (module `sdl`) at the world sizes of RESUME_PLAN:
    at each, every rank's loader (sampler `make_sampler(rank, world)`) resumes from rank 0's state of
    the step before and reads its first k batches. Returns what was read, put back at its global
    positions, and the global position where each step began."""
    state = None
    got: list[int] = []
    starts: list[int] = []
    for world, k in RESUME_PLAN:
        streams, saved = [], None
        for r in range(world):
            loader = sdl.StatefulDataLoader(
                range(items), batch_size=batch, sampler=make_sampler(r, world), num_workers=num_workers
            )
            if state is not None:
                loader.load_state_dict(state)
            it = iter(loader)
            streams.append(loader_batches(it, k))
            if r == 0:
                saved = loader.state_dict()
            del it
        starts.append(len(got))
        got += interleave(streams)
        state = saved
    return got, starts


# ---- one mode rule, one handle (tests/test_modes.py) -------------------------------------------

MODE_USERS = ("dataset", "collator", "residency", "shared_list")


def use_in_mode(user: str, mode: str, blob: str, manifest: str, sock: str | None) -> Any:
    """Read through one of the four users of ``mode=`` and return what it read (bytes, or the held shards)."""
    import smstore
    from smstore.wire.residency import Residency

    if user == "dataset":
        ds = smstore.SharedStoreDataset(blob, decode="bytes", mode=mode, socket=sock)  # type: ignore[arg-type]
        return [ds[i] for i in range(len(ds))]
    if user == "collator":
        collate = smstore.TokenCollator(blob, layout="pack", mode=mode, socket=sock)  # type: ignore[arg-type]
        out = collate(list(range(len(collate))))
        cu = out["cu_seqlens"].tolist()
        data = out["tokens"].numpy().tobytes()
        return [data[a:b] for a, b in itertools.pairwise(cu)]
    if user == "residency":
        residency = Residency(manifest, mode=mode, socket=sock)  # type: ignore[arg-type]
        try:
            residency.hold([1, 0], wait=True)
            return (residency.kind, residency.held)
        finally:
            residency.close()
    if user == "shared_list":
        lst = smstore.SharedList(
            [f"object {i}" for i in range(50)], name=f"modes-{os.getpid()}", mode=mode, socket=sock
        )  # type: ignore[arg-type]
        try:
            return list(lst)
        finally:
            lst.close()
    raise AssertionError(user)


def fallbacks_in_a_fresh_process(order: Sequence[str], blob: str, manifest: str, sock: str, q: Any) -> None:
    """A spawned child: the users of mode="auto" in ``order`` with no daemon on ``sock``; puts what
    each read and every record the ``smstore`` logger emitted, as (level, message)."""
    import logging

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("smstore")
    logger.addHandler(Keep(logging.INFO))
    logger.setLevel(logging.INFO)
    try:
        read = {user: use_in_mode(user, "auto", blob, manifest, sock) for user in order}
        q.put((read, [(r.levelno, r.getMessage()) for r in records]))
    except BaseException as e:  # noqa: BLE001 - the parent raises it
        q.put(e)


def read_through_handles(ds: Any, collate: Any, q: Any) -> None:
    """A multiprocessing child: what a SharedStoreDataset and a TokenCollator it was handed read, and from where."""
    try:
        records = [ds[i] for i in range(len(ds))]
        out = collate(list(range(len(collate))))
        cu = out["cu_seqlens"].tolist()
        data = out["tokens"].numpy().tobytes()
        gathered = [data[a:b] for a, b in itertools.pairwise(cu)]
        where = [(type(s).__name__, getattr(s, "segment", None)) for s in (ds.store, collate.store)]
        q.put((records, gathered, where))
    except BaseException as e:  # noqa: BLE001 - the parent raises it
        q.put(e)


def run_ranks(
    target: Callable[..., None],
    args: Sequence[tuple[Any, ...]],
    *,
    timeout: float = 300.0,
    method: str = "fork",
) -> list[Any]:
    """Run one process per rank (started by `method`), `target(*args[r], queue)`; what each puts on the
    queue, in arrival order.

    Every process must exit 0; one still alive when the test fails is killed (by its pid) and joined.
    """
    import multiprocessing

    ctx = multiprocessing.get_context(method)
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, q)) for a in args]
    try:
        for p in procs:
            p.start()
        results = [q.get(timeout=timeout) for _ in procs]
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0, f"rank process {p.pid} exited with {p.exitcode}"
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


def read_epoch(ds: Any, sampler: Any, batch_size: int) -> list[Any]:
    """Every item a rank reads in an epoch of `sampler` over `ds`, through 2 forked DataLoader workers."""
    import torch

    loader = torch.utils.data.DataLoader(
        ds,
        sampler=sampler,
        batch_size=batch_size,
        num_workers=2,
        prefetch_factor=2,
        collate_fn=list,
        multiprocessing_context="fork",
    )
    return [item for batch in loader for item in batch]


class BlockDataset:
    """Records through a BlockReader, each with where it was read from (for the test)."""

    def __init__(self, path: Path, block: int, keep: int) -> None:
        from smstore.wire.blocks import BlockReader

        self.reader = BlockReader(path, block=block, keep=keep)

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, i: int) -> tuple[int, bytes, int]:
        before = self.reader.block_reads
        data = self.reader[i]
        return i, data, self.reader.block_reads - before


def block_rank(
    out: str,
    rank: int | None,
    world: int | None,
    block: int,
    spread: int,
    q: Any,
    *,
    seed: int,
    lag: int,
    batch: int,
) -> None:
    """A rank's block epoch of `out` through the daemon; puts (rank, [(index, bytes, block reads)])."""
    from smstore.format.manifest import read_manifest
    from smstore.sampling import BlockWindowSampler
    from smstore.wire.residency import Residency

    sizes = [s.records for s in read_manifest(out).shards]

    class Sized:
        shard_sizes = sizes
        path = out

    sampler = BlockWindowSampler(
        Sized(),
        block=block,
        spread=spread,
        seed=seed,
        rank=rank,
        world_size=world,
        lag=lag,
        residency=Residency(out, mode="daemon"),
    )
    ds = BlockDataset(Path(out), block, sampler.keep)
    got = read_epoch(ds, sampler, batch)
    sampler.close()
    ds.reader.close()
    q.put((rank, got))


def windowed_rank(source: Any, rank: int, window: int, q: Any) -> None:
    """A rank's windowed epoch over `source` (a manifest's path, or a dataset its parent opened); puts
    (rank, its residency's kind, the records)."""
    import smstore

    ds = (
        source
        if isinstance(source, smstore.SharedStoreDataset)
        else smstore.SharedStoreDataset(source, mode="daemon", decode="bytes")
    )
    # The lag covers what the workers still read behind the sampler: prefetch_factor (2) x 2
    # workers x 16 (with 32, a shard could be released under a worker still reading it, which
    # then fetched it again for itself).
    sampler = smstore.WindowedShuffleSampler(ds, window=window, seed=7, rank=rank, world_size=2, lag=64)
    got = read_epoch(ds, sampler, 16)
    kind = sampler.residency.kind if sampler.residency is not None else None
    sampler.close()
    q.put((rank, kind, got))


# ---- views ----


def token_documents(count: int, seed: int) -> list[Any]:
    """Documents of uint16 tokens of skewed lengths, some empty, none containing the eod token 0."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(3.0, 1.2, size=count).astype(np.int64)
    lengths[rng.integers(0, count, size=count // 10)] = 0
    return [rng.integers(1, 60000, size=int(n), dtype=np.uint16) for n in lengths]


def token_datasets(root: Path, docs: Sequence[Any]) -> dict[str, Path]:
    """`docs` (uint16 arrays) packed as a blob and as a sharded dataset of shards of 457 records."""
    import smstore

    smstore.pack_arrays(docs, root / "docs.smst", durable=False)
    with smstore.ShardedWriter(
        f"{root / 'sharded'}/", encoding="npy:<u2", shard_records=457, durable=False
    ) as w:
        w.extend(d.tobytes() for d in docs)
    return {"blob": root / "docs.smst", "sharded": root / "sharded"}


def run_child(target: Callable[..., None], *args: Any, method: str = "spawn") -> Any:
    """What `target(*args, queue)` puts, run in a child started by `method`; raised if an exception."""
    ctx = multiprocessing.get_context(method)
    q = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, q))
    proc.start()
    try:
        got = q.get(timeout=120)  # a guard against a child that hangs: it answers in seconds
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert proc.exitcode == 0
    if isinstance(got, BaseException):
        raise got
    return got


def unpickle_and_read(state: bytes, q: Any) -> None:
    """A spawned or forkserver child: unpickle a view as a DataLoader worker does and read every
    record; puts the records, or the StoreError unpickling or reading raised."""
    from smstore.errors import StoreError

    try:
        view = pickle.loads(state)
        q.put([bytes(view[i]) for i in range(len(view))])
    except StoreError as e:
        q.put(e)


def outcome_past_a_fifo(fn: Callable[[], Any], fifo: str | os.PathLike[str], what: str) -> Any:
    """What fn() returns or raises (the exception, returned), run in a thread.

    Should it block opening `fifo` (waiting for a writer), a writer lets it go and the test fails
    saying `what` blocked. The join's bound is for that defect only: code that never opens the FIFO
    is done long before it.
    """
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(fn())
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            outcome.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=60)
    if t.is_alive():  # blocked in open(): let it go before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join()
        raise AssertionError(f"{what} blocked on a FIFO")
    return outcome[0]


def reference_pack_lengths(
    lengths: Sequence[int] | Any, length: int, *, open_bins: int, algorithm: str, close: str
) -> tuple[Any, Any]:
    """The packer written in Python (the C++ one's oracle, and bench_packing's "before"): the rule of
    smstore.read.packing.pack_lengths, the same (segments, starts), an open bin found by bisection."""
    import bisect
    from operator import itemgetter

    import numpy as np

    best, oldest = algorithm == "best-fit", itemgetter(1)
    bins: list[list[tuple[int, int, int]]] = []
    open_: list[tuple[int, int]] = []  # (room, bin) sorted: the fullest first, the oldest among equals
    for doc, n in enumerate(np.asarray(lengths, dtype=np.int64).tolist()):
        first = 0
        while n - first >= length:
            bins.append([(doc, first, length)])
            first += length
        piece = n - first
        if not piece:
            continue
        i = bisect.bisect_left(open_, (piece, -1))
        if i < len(open_):
            room, b = open_.pop(i) if best else open_.pop(open_.index(min(open_[i:], key=oldest), i))
        else:
            if len(open_) == open_bins:
                if close == "all":
                    open_.clear()
                else:
                    del open_[0 if close == "fullest" else open_.index(min(open_, key=oldest))]
            room, b = length, len(bins)
            bins.append([])
        bins[b].append((doc, first, piece))
        bisect.insort(open_, (room - piece, b))
    starts = np.zeros(len(bins) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in bins], out=starts[1:])
    segments = np.array([s for b in bins for s in b], dtype=np.int64).reshape(-1, 3)
    return segments, starts


def packed_bins_digest(path: str, options: dict[str, Any], q: Any) -> None:
    """A spawned child: the hash of every bin's segments and tokens of PackedBins(path, **options)."""
    import hashlib

    from smstore.read.packing import PackedBins

    bins = PackedBins(path, **options)
    h = hashlib.sha256()
    for k in range(len(bins)):
        h.update(bins.segments(k).tobytes())
        h.update(bins[k]["tokens"].tobytes())
    q.put(h.hexdigest())
