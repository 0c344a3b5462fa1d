"""BlockWindowSampler and block residency: pieces of shards held, loaded and dropped by the daemon, read byte-exact."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from smstore_testlib import block_rank, outcome_past_a_fifo, random_sharded, run_ranks, whole_order

import smstore
from smstore import _core
from smstore.errors import DaemonError, StoreChangedError
from smstore.format.manifest import ShardInfo, read_manifest, write_manifest
from smstore.read import modes as _modes
from smstore.sampling import BlockWindowSampler, GlobalShuffleSampler, block_bounds
from smstore.wire.blocks import BlockReader, Piece, piece_id, shard_block
from smstore.wire.residency import Residency

from .daemon_testlib import Daemon

SIZES = [50, 0, 70, 30, 100, 10, 80, 40, 40, 90]


sharded = partial(random_sharded, shards=8, per_shard=300, size=400, seed=11)
order_of = partial(whole_order, BlockWindowSampler, seed=3, residency=False)


@pytest.mark.parametrize(("block", "spread"), [(1, 1), (7, 1), (7, 5), (16, 3), (600, 2)])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_record_once_and_the_same_order_at_any_world_size(block: int, spread: int, world: int) -> None:
    n = sum(SIZES)
    ref = order_of(SIZES, block=block, spread=spread)
    assert sorted(ref) == list(range(n))
    outs = [
        list(
            BlockWindowSampler(
                SIZES, block=block, spread=spread, seed=3, rank=r, world_size=world, residency=False
            )
        )
        for r in range(world)
    ]
    per_rank = -(-n // world)
    merged = [outs[i % world][i // world] for i in range(per_rank * world)]
    assert merged == [ref[p % n] for p in range(per_rank * world)]
    assert order_of(SIZES, block=block, spread=spread, epoch=1) != ref  # a new order each epoch


@pytest.mark.parametrize(("before", "after"), [(2, 3), (3, 1), (1, 4)])
def test_resume_at_another_world_size_yields_the_rest_of_the_order(before: int, after: int) -> None:
    n = sum(SIZES)
    ref = order_of(SIZES, block=9, spread=4, seed=5)
    samplers = [
        BlockWindowSampler(SIZES, block=9, spread=4, seed=5, rank=r, world_size=before, residency=False)
        for r in range(before)
    ]
    its = [iter(s) for s in samplers]
    taken = 37  # samples per rank before the checkpoint
    for it in its:
        for _ in range(taken):
            next(it)
    state = samplers[0].state_dict()
    resumed = []
    for r in range(after):
        s = BlockWindowSampler(SIZES, block=9, spread=4, seed=5, rank=r, world_size=after, residency=False)
        s.load_state_dict(state)
        resumed.append(list(s))
    k = taken * before
    merged = [resumed[i % after][i // after] for i in range(-(-(n - k) // after) * after)]
    assert merged[: n - k] == ref[k:]
    other = BlockWindowSampler(SIZES, block=10, spread=4, seed=5, residency=False)
    with pytest.raises(ValueError, match="another order cannot be resumed"):
        other.load_state_dict(state)
    # A state without the blocks' (a plain global shuffle's, same seed and records) is another order.
    foreign = GlobalShuffleSampler(sum(SIZES), seed=5).state_dict()
    with pytest.raises(ValueError, match="another order cannot be resumed"):
        samplers[0].load_state_dict(foreign)


class HoldRecorder:
    def __init__(self) -> None:
        self.holds: list[tuple[int, frozenset[Piece]]] = []
        self.yielded = 0

    def hold(self, pieces: tuple[Piece, ...], *, wait: bool = False) -> None:
        self.holds.append((self.yielded, frozenset(pieces)))

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("world", "rank"), [(1, 0), (2, 1), (3, 2)])
def test_holds_cover_every_record_read(world: int, rank: int) -> None:
    rec = HoldRecorder()
    s = BlockWindowSampler(
        SIZES, block=8, spread=3, seed=2, rank=rank, world_size=world, residency=rec, lag=4
    )
    starts = [0, *np.cumsum(SIZES).tolist()]
    held: frozenset[Piece] = frozenset()
    for i in s:
        while rec.holds and rec.holds[0][0] <= rec.yielded:
            held = rec.holds.pop(0)[1]
        k = int(np.searchsorted(starts, i, side="right")) - 1
        assert any(p.shard == k and p.first <= i - starts[k] < p.end for p in held), i
        rec.yielded += 1
    # What is held at once: the window's blocks, the next and the lag's, each at most two pieces here.
    assert max(len(h) for _y, h in rec.holds or [(0, held)]) <= 2 * (3 + 2)


def test_the_first_hold_fills_the_memory_ahead_and_holds_never_exceed_it() -> None:
    """While the memory fills (the first `spread` windows draw from fewer groups and go by faster
    than blocks load), the sampler holds every group up to spread + 1 from the first batch, not one
    more a window (the daemon then sat idle while the early windows waited on their blocks)."""
    sizes = [400] * 6
    rec = HoldRecorder()
    s = BlockWindowSampler(sizes, block=8, spread=5, seed=2, rank=0, world_size=1, residency=rec, lag=4)
    order = s.permutation()
    expected = {s.piece(int(b)) for j in range(5 + 2) for b in order.group_blocks(j)}
    held_records = []
    for _ in s:
        rec.yielded += 1
    assert rec.holds[0] == (0, frozenset(expected))
    for _y, held in rec.holds:
        held_records.append(sum(p.end - p.first for p in held))
    # spread + 2 groups of 8 records, and the rest of a block at each end (blocks of 8 here).
    assert max(held_records) <= (5 + 2) * 8 + 2 * 8


def test_plan_fits_what_is_held_and_room_for_one_released_block_in_the_budget(tmp_path: Path) -> None:
    out, recs = sharded(tmp_path)
    m = read_manifest(out)
    per_record = sum(s.data_bytes for s in m.shards) / len(recs)
    budget = 400_000
    block, spread = BlockWindowSampler.plan(out, budget, block_bytes=16 << 10)
    assert block * per_record >= 16 << 10  # blocks of at least the bytes asked for
    _first, length, _shard = block_bounds([s.records for s in m.shards], block)
    # The most held at once: spread + 2 groups and a block at each end; and room for one more group.
    held = (spread + 3) * block + 2 * int(length.max())
    assert held * per_record + (spread + 5) * (4096 + 8 * int(length.max())) <= budget
    # More memory: a wider spread.
    assert BlockWindowSampler.plan(out, 2 * budget, block_bytes=16 << 10)[1] > spread
    with pytest.raises(ValueError, match="raise the budget"):
        BlockWindowSampler.plan(out, 5 * (16 << 10), block_bytes=16 << 10)


def test_plan_counts_each_piece_with_its_shards_metadata_as_the_daemon_does(tmp_path: Path) -> None:
    """The daemon writes a piece as a blob of its records with its shard's metadata
    (daemon.sources.Source.piece_size) and admits its load by those pages; the planner counted
    the records alone, so shards with much metadata got a spread whose pieces overfilled the budget."""
    meta, record_bytes, sizes = 64 << 10, 1000, [1000] * 8
    path = tmp_path / "ds.json"
    shards = [
        ShardInfo(f"s{k}.smst", x, x * record_bytes, _core.blob_size(x, x * record_bytes, meta), "0" * 16)
        for k, x in enumerate(sizes)
    ]
    write_manifest(path, "raw", shards, durable=False)
    budget = 2 << 20
    block, spread = BlockWindowSampler.plan(path, budget, block_bytes=16 << 10)
    _first, length, _shard = block_bounds(sizes, block)

    def pages(records: int) -> int:  # what the daemon's budget counts for a piece of `records`
        return _core.shm_footprint(_core.blob_size(records, records * record_bytes, meta))

    # The most held at once (spread + 2 groups and one released, a block at each end) fits.
    assert (spread + 3) * pages(block) + 2 * pages(int(length.max())) <= budget, (block, spread)


def test_the_planner_keeps_source_neighbours_in_a_block_out_of_a_batch(tmp_path: Path) -> None:
    """For every (memory, batch, record size), the spread plan() picks deals two records adjacent
    in a block at least spread // 5 windows apart, in a group and across a group's end, so past the
    fill they are at least (spread // 5 - 1) * block + 1 positions apart and never share a batch of
    that many (docs/training.md, "The bound"). At a spread dividing the group size less one (68
    records a block, spread 67), a group's last record and the next one's first landed in adjacent
    windows and shared batches."""
    rng = np.random.default_rng(7)
    sizes = rng.integers(1_000, 3_000, size=40).tolist()
    n, shard_of = sum(sizes), np.repeat(np.arange(len(sizes)), sizes)
    checked = 0
    for record_bytes in (65536, 96 << 10, 150_000, 250_000):
        path = tmp_path / f"ds-{record_bytes}.json"
        shards = [
            ShardInfo(f"s{k}.smst", x, x * record_bytes, x * record_bytes + 4096, "0" * 16)
            for k, x in enumerate(sizes)
        ]
        write_manifest(path, "raw", shards, durable=False)
        for memory in (0.02, 0.04, 0.06, 0.08, 0.12, 0.16):  # of the data
            block, spread = BlockWindowSampler.plan(path, int(memory * n * record_bytes), block_bytes=4 << 20)
            s = BlockWindowSampler(
                sizes, block=block, spread=spread, seed=1, rank=0, world_size=1, residency=False
            )
            order = s.permutation()
            position = np.empty(n, dtype=np.int64)
            position[order(np.arange(n))] = np.arange(n)
            window = np.searchsorted(order.window_starts, position, side="right") - 1
            blocks = np.repeat(np.arange(len(order.block_first)), order.block_length)
            pair = np.flatnonzero(blocks[:-1] == blocks[1:])  # records i and i + 1 of one block
            lo, hi = np.minimum(window[pair], window[pair + 1]), np.maximum(window[pair], window[pair + 1])
            assert (hi - lo).min() >= spread // 5, (record_bytes, memory, block, spread)
            # Past the fill, before the drain, every window holds a whole group's worth: G records.
            groups = len(order.group_starts) - 1
            steady = (lo >= spread - 1) & (hi <= groups - 2)
            assert steady.sum() > n // 4
            bound = (spread // 5 - 1) * block + 1
            apart = np.abs(position[pair + 1] - position[pair])[steady]
            assert apart.min() >= bound, (record_bytes, memory, block, spread)
            for batch in {max(1, bound // 2), max(1, bound)}:
                batch_of = position // batch
                shared = (batch_of[pair] == batch_of[pair + 1]) & steady
                assert not shared.any(), (record_bytes, memory, batch, block, spread)
            checked += 1
            assert (shard_of[pair] == shard_of[pair + 1]).all()
    assert checked == 24


def test_blocks_stay_within_shards_and_a_reader_finds_the_block_the_sampler_holds() -> None:
    sizes = [5, 0, 7, 18, 1, 31, 8]
    assert [tuple(map(int, x)) for x in zip(*block_bounds(sizes, 8), strict=True)] == [
        (0, 5, 0),  # a shard shorter than a block is one block
        (5, 7, 2),
        (12, 9, 3),  # 18 records: two blocks of 9, never one of 8 and a short one of 2
        (21, 9, 3),
        (30, 1, 4),
        (31, 10, 5),  # 31 records: three blocks of 10, 10 and 11
        (41, 10, 5),
        (51, 11, 5),
        (62, 8, 6),
    ]
    s = BlockWindowSampler(sizes, block=8, spread=2, seed=1, rank=0, world_size=1, residency=False)
    starts = [0, *np.cumsum(sizes).tolist()]
    for b, (first, length, shard) in enumerate(zip(*block_bounds(sizes, 8), strict=True)):
        lo = int(first) - starts[shard]
        assert s.piece(b) == Piece(int(shard), lo, lo + int(length))
        for x in range(lo, lo + int(length)):  # BlockReader's lookup of each record of it
            assert shard_block(sizes[shard], 8, x) == (lo, lo + int(length))
    rng = np.random.default_rng(5)
    for _ in range(20):
        sizes = rng.integers(0, 200, size=12).tolist()
        block = int(rng.integers(1, 50))
        for first, length, shard in zip(*block_bounds(sizes, block), strict=True):
            lo = int(first) - int(np.sum(sizes[:shard]))
            assert shard_block(sizes[shard], block, lo) == shard_block(
                sizes[shard], block, lo + int(length) - 1
            )
            assert shard_block(sizes[shard], block, lo) == (lo, lo + int(length))


# block_rank's DataLoader: its workers read at most PREFETCH x WORKERS batches of BATCH behind its
# sampler, the samples the sampler's lag keeps held.
PREFETCH, WORKERS, BATCH = 2, 2, 16
LAG = PREFETCH * WORKERS * BATCH


class Recorded:
    """A residency that keeps what it was last told to hold."""

    held: frozenset[Piece] = frozenset()

    def hold(self, pieces: list[Piece], *, wait: bool = False) -> None:
        self.held = frozenset(pieces)


@pytest.mark.parametrize(("sizes", "block", "spread"), [([1000] * 3, 150, 3), ([300] * 8, 40, 4)])
def test_the_lag_keeps_every_block_a_worker_behind_the_sampler_reads_held(
    sizes: list[int], block: int, spread: int
) -> None:
    """Whenever the sampler yields a sample, the blocks of its last LAG samples are held, which
    the workers may still be reading: windows shorter than the lag (the epoch's last) included.
    A block released before a worker read it was fetched again for that worker (the remote block
    epoch's test saw one block's ranged GET twice under load)."""
    starts = np.cumsum([0, *sizes]).tolist()

    def piece_of(i: int) -> Piece:
        k = int(np.searchsorted(starts, i, side="right")) - 1
        return Piece(k, *shard_block(sizes[k], block, i - starts[k]))

    for rank in range(2):
        residency = Recorded()
        sampler = BlockWindowSampler(
            sizes, block=block, spread=spread, seed=9, rank=rank, world_size=2, lag=LAG, residency=residency
        )
        order: list[int] = []
        for i in sampler:
            order.append(i)
            behind = {piece_of(x) for x in order[-LAG:]}
            assert behind <= residency.held, (rank, len(order), sorted(behind - residency.held))


def test_an_epoch_through_blocks_at_2_ranks_x_2_workers_reads_every_record_once_within_the_budget(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    pytest.importorskip("torch")
    out, recs = sharded(tmp_path)
    m = read_manifest(out)
    block, spread = 40, 4  # pieces of about 12 KiB: the 6 held at once (and the next) fit the budget
    page = os.sysconf("SC_PAGESIZE")
    first, length, _shard = block_bounds([s.records for s in m.shards], block)
    largest_block = max(
        len(b"".join(recs[f : f + k])) for f, k in zip(first.tolist(), length.tolist(), strict=True)
    )
    piece_pages = -(-(largest_block + 4096 + 8 * (block + 1)) // page) * page
    budget = (spread + 3) * 2 * piece_pages
    assert budget < sum(s.file_size for s in m.shards) // 2  # far less than the dataset
    d = start_daemon(args=("--shm-limit", str(budget)), loaded=0)
    peak = [0]
    seen_segments: set[str] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            st = d.status()
            # The segments served, and (the daemon's one count) those plus the released pieces a
            # worker still maps: memory too, counted in the budget until the worker unmaps them.
            used = max(sum(-(-s["size"] // page) * page for s in st["segments"]), st["shm"]["used"])
            seen_segments.update(s["checksum"] for s in st["segments"])
            peak[0] = max(peak[0], used)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        rank = partial(block_rank, seed=9, lag=LAG, batch=BATCH)
        results = dict(run_ranks(rank, [(os.fspath(out), r, 2, block, spread) for r in range(2)]))
    finally:
        stop.set()
        watcher.join()
    n = len(recs)
    ref = order_of([s.records for s in m.shards], block=block, spread=spread, seed=9)
    merged = [results[i % 2][i // 2] for i in range(n)]
    assert [i for i, _d, _b in merged] == ref  # the sampler's order, across ranks and workers
    assert sorted(i for i, _d, _b in merged) == list(range(n))  # every record once
    assert all(data == recs[i] for i, data, _b in merged)  # byte-exact
    from_blocks = sum(b for _i, _d, b in merged)
    assert from_blocks > n // 2, from_blocks  # read from the daemon's block segments
    assert 0 < peak[0] <= budget
    sampler = BlockWindowSampler(
        [s.records for s in m.shards],
        block=block,
        spread=spread,
        seed=9,
        rank=0,
        world_size=1,
        residency=False,
    )
    pieces = {
        piece_id(m.shards[p.shard].checksum, p.first, p.end) for p in map(sampler.piece, range(len(first)))
    }
    assert seen_segments <= pieces  # only block pieces were loaded, never a whole shard
    deadline = time.monotonic() + 120  # the ranks have closed: the daemon drops them at once, unless starved
    while d.status()["segments"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert d.status()["segments"] == []  # the ranks closed: every piece dropped


def test_a_block_of_a_changed_shard_is_refused(tmp_path: Path, start_daemon: Callable[..., Daemon]) -> None:
    out, recs = sharded(tmp_path, shards=3)
    m = read_manifest(out)
    start_daemon(loaded=0)
    residency = Residency(out, mode="daemon")
    try:
        residency.hold([Piece(1, 0, 10)], wait=True)
        victim = Path(m.shard_path(1))
        w = smstore.Writer(str(victim) + ".new", durable=False)
        for r in recs[:5]:
            w.append(r)
        w.close()
        os.replace(str(victim) + ".new", victim)
        residency.hold([Piece(1, 0, 10)])  # sent without waiting: its refusal waits on the connection
        with pytest.raises(DaemonError, match=r"part-\S+\.smst.*holds checksum .* re-packed or overwritten"):
            residency.hold([Piece(1, 0, 10)], wait=True)
        with pytest.raises(DaemonError, match="re-packed or overwritten"):  # on a new connection too
            residency.hold([Piece(1, 0, 10)], wait=True)
        reader = BlockReader(out, block=10)
        try:
            with pytest.raises(StoreChangedError, match="re-packed or overwritten"):
                reader[m.shards[0].records + 3]
        finally:
            reader.close()
    finally:
        residency.close()


def test_a_piece_larger_than_the_budget_is_refused(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    out, _recs = sharded(tmp_path, shards=2)
    start_daemon(args=("--shm-limit", "64K"), loaded=0)
    residency = Residency(out, mode="daemon")
    try:
        with pytest.raises(DaemonError, match="does not fit the daemon's --shm-limit"):
            residency.hold([Piece(0, 0, 299)], wait=True)
    finally:
        residency.close()


def test_without_a_daemon_a_reader_reads_every_record_from_the_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="smstore")
    monkeypatch.setattr(_modes, "_warned_fallback", False)  # as in a fresh process: the first fallback warns
    out, recs = sharded(tmp_path, shards=3)
    monkeypatch.setenv("SMSTORE_SOCKET", os.fspath(tmp_path / "none" / "smstore.sock"))
    sizes = [s.records for s in read_manifest(out).shards]
    residency = Residency(out)  # "auto": no daemon: the page cache (a warning says so)
    sampler = BlockWindowSampler(sizes, block=50, spread=3, seed=1, rank=0, world_size=1, residency=residency)
    reader = BlockReader(out, block=50, keep=sampler.keep)
    try:
        got = [(i, reader[i]) for i in sampler]
    finally:
        reader.close()
        sampler.close()
    assert residency.kind == "page cache"  # the blocks read ahead into the page cache
    assert "instead of using the smstore daemon" in caplog.text
    assert sorted(i for i, _ in got) == list(range(len(recs)))
    assert all(data == recs[i] for i, data in got)
    assert (reader.block_reads, reader.file_reads) == (0, len(recs))


def test_without_a_daemon_the_residency_reads_a_blocks_bytes_ahead_and_drops_them_once_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One residency for shards and blocks: without a daemon, a block (a record range) is read ahead
    into the page cache as a shard is, but only its records' bytes, and dropped once no longer held
    (the block residency held nothing without a daemon)."""
    out, _recs = sharded(tmp_path, shards=3)
    advised: list[tuple[str, int, int, int]] = []

    def advise(fd: int, offset: int, length: int, advice: int) -> None:
        advised.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length, advice))

    monkeypatch.setattr(os, "posix_fadvise", advise)
    manifest = read_manifest(out)
    shard0, shard1 = (os.path.realpath(manifest.shard_path(k)) for k in (0, 1))
    with smstore.Store(shard0) as store:
        start = _core.read_header(shard0).data_offset
        first, end = int(store.offsets[10]), int(store.offsets[60])
    residency = Residency(out, mode="mmap")
    try:
        residency.hold([Piece(0, 10, 60)], wait=True)
        assert advised == [(shard0, start + first, end - first, os.POSIX_FADV_WILLNEED)]
        residency.hold([Piece(1)], wait=True)  # a whole shard: its file; the block is dropped
        assert sorted(advised[1:]) == sorted(
            [
                (shard1, 0, 0, os.POSIX_FADV_WILLNEED),
                (shard0, start + first, end - first, os.POSIX_FADV_DONTNEED),
            ]
        )
        assert residency.kind == "page cache"
    finally:
        residency.close()


def test_resume_at_another_world_size_through_the_daemon_reads_the_rest_byte_exact(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    out, recs = sharded(tmp_path, shards=4)
    sizes = [s.records for s in read_manifest(out).shards]
    start_daemon(loaded=0)
    block, spread = 30, 3

    def ranks(world: int) -> list[tuple[BlockWindowSampler, BlockReader]]:
        return [
            (
                BlockWindowSampler(
                    sizes, block=block, spread=spread, seed=4, rank=r, world_size=world, lag=8,
                    residency=Residency(out, mode="daemon"),
                ),
                BlockReader(out, block=block, keep=32),
            )
            for r in range(world)
        ]  # fmt: skip

    got: list[tuple[int, bytes]] = []
    first = ranks(2)
    its = [iter(s) for s, _r in first]
    for _ in range(250):  # samples per rank before the checkpoint, rank by rank as a step would
        for (_s, reader), it in zip(first, its, strict=True):
            i = next(it)
            got.append((i, reader[i]))
    state = first[0][0].state_dict()
    reads = sum(reader.block_reads for _s, reader in first)
    for s, reader in first:
        s.close()
        reader.close()
    second = ranks(3)
    for s, _r in second:
        s.load_state_dict(state)
    rest = [[(i, reader[i]) for i in s] for s, reader in second]
    reads += sum(reader.block_reads for _s, reader in second)
    for s, reader in second:
        s.close()
        reader.close()
    n = len(recs)
    k = n - 500
    got += [rest[j % 3][j // 3] for j in range(k)]
    assert [i for i, _d in got] == order_of(sizes, block=block, spread=spread, seed=4)
    assert all(data == recs[i] for i, data in got)
    assert reads > n // 2  # through the daemon's pieces, before and after the resume


def test_a_piece_load_refuses_a_shard_replaced_by_a_fifo_without_blocking(tmp_path: Path) -> None:
    # Between a hold (which checked the shard) and its load, the shard's file is replaced by a
    # FIFO: the load must fail at once, not block the daemon's loader thread on open() forever.
    import threading

    from smstore.daemon.sources import Source

    out, _recs = sharded(tmp_path, shards=2)
    m = read_manifest(out)
    shard = out / m.shards[1].path
    shard.unlink()
    os.mkfifo(shard)
    source = Source(os.fspath(shard), m.shards[1].checksum, m.shards[1].file_size)
    outcome = outcome_past_a_fifo(
        lambda: source.read(Piece(1, 0, 10), threading.Event()), shard, "the piece load"
    )
    assert isinstance(outcome, StoreChangedError), outcome
    assert "not a regular file" in str(outcome)


def test_a_reader_drops_released_pieces_when_the_next_one_waits_for_their_room(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    # The budget fits one piece. The reader maps A; the holds move on to B, releasing A, whose
    # pages count until the reader unmaps it; B waits for that room. A reader that unmapped stale
    # pieces only after attaching a new one read B from the file forever.
    out, recs = sharded(tmp_path, shards=2)
    start_daemon(args=("--shm-limit", "64K"), loaded=0)
    residency = Residency(out, mode="daemon")
    reader = BlockReader(out, block=100)
    records = read_manifest(out).shards[0].records
    a = Piece(0, *shard_block(records, 100, 0))
    b = Piece(0, *shard_block(records, 100, a.end))
    try:
        residency.hold([a], wait=True)
        assert reader[0] == recs[0]
        assert reader.block_reads == 1
        residency.hold([b], wait=True)
        deadline = time.monotonic() + 120  # a guard against a hang only: B comes once A is unmapped
        while reader.block_reads < 2 and time.monotonic() < deadline:
            for i in range(b.first, b.end):
                assert reader[i] == recs[i]
            time.sleep(0.02)
        assert reader.block_reads >= 2, (reader.block_reads, reader.file_reads)
    finally:
        reader.close()
        residency.close()


def test_the_daemon_keeps_no_shard_mapped_after_checking_a_hold(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    # A hold's shards are checked once and their offsets kept: as a copy, not a view of the shard's
    # mapping (which kept every checked shard mapped, and a shard truncated in place killed the
    # daemon with SIGBUS when the view was read).
    out, _recs = sharded(tmp_path, shards=2)
    m = read_manifest(out)
    d = start_daemon(loaded=0)
    residency = Residency(out, mode="daemon")
    try:
        residency.hold([Piece(0, 0, 100), Piece(1, 0, 100)], wait=True)
        # Once both pieces are loaded (a load maps its shard while it reads the index: not checked here).
        deadline = time.monotonic() + 120  # a guard against a hang only
        while len(d.status()["segments"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(d.status()["segments"]) == 2
        maps = Path(f"/proc/{d.pid}/maps").read_text()
        for s in m.shards:
            assert os.fspath(out / s.path) not in maps
    finally:
        residency.close()


def test_the_samplers_residency_is_the_datasets_socket_mode_and_manifest(tmp_path: Path) -> None:
    """BlockWindowSampler built its residency from the manifest's path alone: a dataset's custom
    socket was ignored (it asked the default daemon), its mode too, and a URL's manifest fetched again."""
    out, _recs = sharded(tmp_path, shards=3, per_shard=50)
    sock = tmp_path / "run" / "custom.sock"
    ds = smstore.SharedStoreDataset(os.fspath(out), mode="mmap", socket=os.fspath(sock))
    sampler = BlockWindowSampler(ds, block=10, spread=2, seed=0, rank=0, world_size=1)
    assert isinstance(sampler.residency, Residency)
    assert sampler.residency.socket == sock
    assert sampler.residency.mode == "mmap"


BUDGET_DAEMON = Path(__file__).parent / "budget_daemon.py"


@pytest.mark.parametrize("share", [0.02, 0.08, 0.32])
def test_a_block_epoch_keeps_the_pages_of_every_segment_mapped_or_present_within_the_budget(
    share: float, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """Issue 37: at a 2 % budget an epoch peaked at 1.33-1.57x --shm-limit. Released pieces not yet
    removed by the loader thread, or still mapped by a worker, were counted as free while new
    pieces loaded. Measured by the daemon itself at each piece it writes: the pages of its segments
    in /dev/shm or mapped by any process of this test, never its own count."""
    pytest.importorskip("torch")
    out, recs = sharded(tmp_path, shards=6, per_shard=1000, size=1400)
    data = sum(s.file_size for s in read_manifest(out).shards)
    budget = int(share * data)
    block, spread = BlockWindowSampler.plan(out, budget, block_bytes=8 << 10)
    report = tmp_path / "pages.txt"
    launcher = (os.fspath(BUDGET_DAEMON), os.fspath(report), "-", str(os.getpid()))
    start_daemon(args=("--shm-limit", str(budget)), loaded=0, launcher=launcher)
    # One rank with a short lag: its 2 workers read 2 batches of 4 behind the sampler (the
    # longer lag of the test above keeps more held, and its loads rarely wait on a released piece).
    rank = partial(block_rank, seed=5, lag=16, batch=4)
    # Thousands of piece loads: about 15 s on an idle 2-core machine, up to 150 s beside three busy
    # processes, more on a machine busier still; the guard is for a hang, not a timing.
    ((_rank, got),) = run_ranks(rank, [(os.fspath(out), None, None, block, spread)], timeout=1200)
    assert sorted(i for i, _d, _b in got) == list(range(len(recs)))  # every record once
    assert all(data == recs[i] for i, data, _b in got)  # byte-exact
    peak = max(int(line.split()[1]) for line in report.read_text().splitlines() if line.startswith("pages "))
    assert peak <= 1.05 * budget, (peak / budget, block, spread)
    assert sum(b for _i, _d, b in got) > len(recs) // 2  # mostly from the daemon's pieces


def test_a_shard_load_and_a_piece_load_in_flight_together_never_exceed_the_budget(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """Issue 37: the shard planner and the block residency each counted only their own loads in
    flight, so a held shard and a held piece loaded at once into a budget that fits either alone.
    Every load waits at a gate this test opens: what is in flight is what the daemon admitted."""

    out, _recs = sharded(tmp_path, shards=2)
    m = read_manifest(out)
    shard = os.fspath(out / m.shards[0].path)
    piece = Piece(1, 0, 100)  # about 10 pages: its records, header and index
    page = os.sysconf("SC_PAGESIZE")
    budget = -(-m.shards[0].file_size // page) * page + 8 * page  # the shard, or the piece, never both
    gate_path = tmp_path / "gate"
    os.mkfifo(gate_path)
    gate = os.open(gate_path, os.O_RDWR)  # a writer before the daemon's reader: loads wait for bytes
    report = tmp_path / "report.txt"
    launcher = (os.fspath(BUDGET_DAEMON), os.fspath(report), os.fspath(gate_path), str(os.getpid()))
    shards = Residency(out, mode="daemon")
    pieces = Residency(out, mode="daemon")
    try:
        d = start_daemon(args=("--shm-limit", str(budget)), loaded=0, launcher=launcher)
        shards.hold([0], wait=True)
        pieces.hold([piece], wait=True)
        assert d.status()["loading"] == [shard]  # the piece waits for room: it is not in flight too
        os.write(gate, b"x")  # the shard's load goes on, and lands
        deadline = time.monotonic() + 120  # a guard against a hang only
        while not d.status()["segments"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [s["paths"] for s in d.status()["segments"]] == [[shard]]
        assert d.status()["loading"] == []  # the shard's pages leave no room for the piece
        shards.hold([], wait=True)  # released: once removed, its room is the piece's
        os.write(gate, b"x")
        key = piece_id(m.shards[1].checksum, piece.first, piece.end)
        while [s["checksum"] for s in d.status()["segments"]] != [key] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [s["checksum"] for s in d.status()["segments"]] == [key]  # never a deadlock
        starts = [
            line.split(" ", 1)[1] for line in report.read_text().splitlines() if line.startswith("start ")
        ]
        pseudo = f"{os.fspath(out / m.shards[1].path)}#records={piece.first}-{piece.end}"
        assert starts == [shard, pseudo]
    finally:
        pieces.close()
        shards.close()
        os.close(gate)  # EOF: any load still at the gate goes on


def test_a_released_piece_counts_in_the_budget_until_the_daemon_has_removed_it(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """Issue 37: a released piece was counted free at its release, while the loader thread had
    not removed it yet, so the next piece loaded beside it. The budget fits one piece; the daemon
    removes released segments late (budget_daemon.py) and measures its real pages at each write."""
    out, _recs = sharded(tmp_path, shards=2)
    records = read_manifest(out).shards[0].records
    checksum = read_manifest(out).shards[0].checksum
    a = Piece(0, *shard_block(records, 100, 0))
    b = Piece(0, *shard_block(records, 100, a.end))
    report = tmp_path / "pages.txt"
    launcher = (os.fspath(BUDGET_DAEMON), os.fspath(report), "-", str(os.getpid()))
    d = start_daemon(args=("--shm-limit", "64K"), loaded=0, launcher=launcher)
    residency = Residency(out, mode="daemon")
    try:
        deadline = time.monotonic() + 120  # a guard against a hang only
        for p in (a, b):
            residency.hold([p], wait=True)
            key = piece_id(checksum, p.first, p.end)
            while [s["checksum"] for s in d.status()["segments"]] != [key] and time.monotonic() < deadline:
                time.sleep(0.02)
            assert [s["checksum"] for s in d.status()["segments"]] == [key]  # loaded: no deadlock
    finally:
        residency.close()
    pages = [int(line.split()[1]) for line in report.read_text().splitlines() if line.startswith("pages ")]
    assert len(pages) == 2
    assert max(pages) <= 64 << 10, pages
