"""WindowedShuffleSampler, shard residency in the daemon and the page cache, and shard release in readers."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import smstore
from smstore import _core
from smstore.errors import DaemonError
from smstore.format.manifest import read_manifest
from smstore.sampling import FeistelPermutation, WindowedOrder, WindowedShuffleSampler
from smstore.wire.residency import Residency

from . import daemon_testlib as tl
from .daemon_testlib import Daemon
from .smstore_testlib import random_sharded, whole_order

SIZES = [5, 0, 7, 3, 10, 1, 8, 4, 4, 9]


order_of = partial(whole_order, WindowedShuffleSampler, seed=3, residency=False)
sharded = partial(random_sharded, shards=12, per_shard=200, size=300, seed=7)


@pytest.mark.parametrize("window", [1, 2, 3, 4, 10, 50])
@pytest.mark.parametrize("world", [1, 2, 3, 7])
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_record_once_and_ranks_interleave_to_one_order(
    window: int, world: int, drop_last: bool
) -> None:
    n = sum(SIZES)
    ref = order_of(SIZES, window=window)
    assert sorted(ref) == list(range(n))
    outs = [
        list(
            WindowedShuffleSampler(
                SIZES, window=window, seed=3, rank=r, world_size=world, drop_last=drop_last, residency=False
            )
        )
        for r in range(world)
    ]
    per_rank = n // world if drop_last else -(-n // world)
    assert all(len(o) == per_rank for o in outs)
    merged = [outs[i % world][i // world] for i in range(per_rank * world)]
    assert merged == [ref[p % n] for p in range(per_rank * world)]  # padding wraps to the start


def test_an_old_pass_goes_on_in_its_own_order_after_a_new_one_starts() -> None:
    sizes = [300] * 20
    s = WindowedShuffleSampler(sizes, window=3, seed=4, rank=0, world_size=1, residency=False)
    old = iter(s)
    first = [next(old) for _ in range(700)]  # into the third window
    assert list(s) == order_of(sizes, window=3, seed=4)  # a new pass, the same epoch
    assert first + list(old) == order_of(sizes, window=3, seed=4)


def test_windows_are_runs_of_shards_in_a_keyed_order() -> None:
    s = WindowedShuffleSampler(SIZES, window=3, seed=5, rank=0, world_size=1, residency=False)
    order = s.permutation()
    starts = np.concatenate([[0], np.cumsum(SIZES)])
    shard_of = np.searchsorted(starts, np.arange(sum(SIZES)), side="right") - 1
    seq = list(s)
    assert sorted(order.shard_order.tolist()) == list(range(len(SIZES)))
    for j in range(order.window_count):
        block = seq[order.window_starts[j] : order.window_starts[j + 1]]
        assert {int(shard_of[i]) for i in block} <= set(order.window_shards(j))
        assert sorted(block) == sorted(
            i for k in order.window_shards(j) for i in range(starts[k], starts[k + 1])
        )
    # The shard order and the order within windows change with the epoch and the seed.
    assert order_of(SIZES, window=3, seed=5, epoch=1) != seq
    assert order_of(SIZES, window=3, seed=6) != seq
    assert order_of(SIZES, window=3, seed=5) == seq


def numpy_windowed_order(sizes: list[int], window: int, key: str, positions: np.ndarray) -> np.ndarray:
    """The windowed order as the sampler computed it in numpy before the C++ one: a reference."""
    sz = np.asarray(sizes, dtype=np.int64)
    shard_order = FeistelPermutation(len(sz), f"{key}:shards".encode())(np.arange(len(sz), dtype=np.uint64))
    starts = np.concatenate([[0], np.cumsum(sz)]).astype(np.int64)
    seq_starts = np.concatenate([[0], np.cumsum(sz[shard_order])]).astype(np.int64)
    window_starts = seq_starts[::window].copy()
    if window_starts[-1] != sz.sum():
        window_starts = np.append(window_starts, sz.sum())
    p = positions.astype(np.int64)
    windows = np.searchsorted(window_starts, p, side="right") - 1
    seq = np.empty_like(p)
    for j in np.unique(windows):
        mask = windows == j
        base = window_starts[j]
        perm = FeistelPermutation(int(window_starts[j + 1] - base), f"{key}:window:{j}".encode())
        seq[mask] = perm(p[mask] - base) + base
    q = np.searchsorted(seq_starts, seq, side="right") - 1
    return starts[shard_order[q]] + (seq - seq_starts[q])


@pytest.mark.parametrize(
    "sizes",
    [SIZES, [0, 0, 4], [3, 0, 0], [1], [7] * 13, [1000, 0, 2**20 + 3, 77, 5000, 1] * 5, [0, 9, 0, 0, 2, 0]],
)
@pytest.mark.parametrize("window", [1, 2, 3, 5, 64])
def test_windowed_order_matches_the_numpy_reference(sizes: list[int], window: int) -> None:
    n = sum(sizes)
    order = WindowedOrder(sizes, window, "k")
    rng = np.random.default_rng(n + window)
    pos = np.unique(np.concatenate([np.arange(min(n, 3000)), rng.integers(0, n, 3000, dtype=np.uint64)]))
    expected = numpy_windowed_order(sizes, window, "k", pos)
    assert (order(pos) == expected).all()
    # The strided form a rank draws with, padding wrapped: rank r of w from `first`.
    for first, step, count in [(0, 1, n), (1, 3, n // 3 + 2), (n - 1, 2, 5), (n // 2, 7, n // 7 + 3)]:
        strided = (first + np.arange(count, dtype=np.uint64) * np.uint64(step)) % np.uint64(n)
        assert (
            order.strided(first, step, count, n) == numpy_windowed_order(sizes, window, "k", strided).tolist()
        )


def test_windowed_order_is_the_one_earlier_versions_saved() -> None:
    # Values computed by the numpy implementation: a sampler state saved by an earlier version
    # must resume in the same order.
    big = [1000, 0, 2**20 + 3, 77, 5000, 1] * 5
    pos = [0, 1, 999, 1000, 2**20, 3 * 2**20 + 17, sum(big) - 1]
    assert WindowedOrder(big, 4, "golden")(np.array(pos)).tolist() == [
        1052752, 4215042, 1049927, 4215377, 2913132, 5196281, 1543524,
    ]  # fmt: skip
    assert order_of(SIZES, window=3, seed=3) == [
        7, 8, 44, 42, 9, 10, 6, 45, 46, 11, 48, 47, 49, 50, 5, 43, 20, 33, 27, 30, 31, 19, 29, 15, 28,
        4, 16, 1, 24, 22, 32, 17, 21, 18, 23, 2, 0, 26, 3, 39, 35, 41, 38, 40, 34, 12, 14, 13, 37, 36, 25,
    ]  # fmt: skip
    s = WindowedShuffleSampler(SIZES, window=3, seed=9, rank=1, world_size=4, residency=False)
    s.set_epoch(2)
    assert list(s) == [46, 48, 12, 39, 30, 35, 25, 22, 2, 18, 17, 10, 5]


def test_windowed_order_refuses_positions_outside_it() -> None:
    order = WindowedOrder(SIZES, 3, "k")
    n = sum(SIZES)
    for bad in ([n], [0, n + 5], [-1]):
        with pytest.raises(IndexError, match="out of range"):
            order(np.array(bad))
    with pytest.raises(IndexError, match="wrap"):
        order.strided(0, 1, 3, n + 1)
    with pytest.raises(IndexError, match="wrap"):
        order.strided(0, 1, 3, 0)
    with pytest.raises(OverflowError):
        order.strided(2**63, 2**62, 3, n)
    assert order.strided(5, 1, 0, 0) == []
    assert order(np.array([], dtype=np.int64)).tolist() == []
    assert WindowedOrder([], 2, "k")(np.array([], dtype=np.uint64)).tolist() == []


def test_an_epoch_order_is_freed_when_dropped() -> None:
    # The C++ order calls back for each window's keys: the callback must not hold the order
    # (a cycle through a C++ object is one the garbage collector cannot see).
    gc.disable()
    try:
        order = WindowedOrder(SIZES, 3, "k")
        order(np.arange(sum(SIZES)))
        ref = weakref.ref(order)
        del order
        assert ref() is None
    finally:
        gc.enable()


@pytest.mark.parametrize(("world", "new_world"), [(2, 3), (3, 1), (1, 4)])
def test_resume_with_another_world_size(world: int, new_world: int) -> None:
    sizes = [50, 70, 30, 100, 20, 60]
    n = sum(sizes)
    ref = order_of(sizes, window=2)
    samplers = [
        WindowedShuffleSampler(sizes, window=2, seed=3, rank=r, world_size=world) for r in range(world)
    ]
    its = [iter(s) for s in samplers]
    taken = 37
    for it in its:
        for _ in range(taken):
            next(it)
    state = samplers[0].state_dict()
    assert state["consumed"] == taken * world
    resumed = []
    for r in range(new_world):
        s = WindowedShuffleSampler(sizes, window=2, seed=0, rank=r, world_size=new_world)
        s.load_state_dict(state)
        resumed.append(list(s))
    merged = [resumed[i % new_world][i // new_world] for i in range(len(resumed[0]) * new_world)]
    k = taken * world
    assert merged[: n - k] == ref[k:]
    other = WindowedShuffleSampler(sizes, window=3, seed=3)
    with pytest.raises(ValueError, match="window=2"):
        other.load_state_dict(state)


class HoldRecorder:
    """A residency that records every hold with the number of samples yielded before it."""

    def __init__(self) -> None:
        self.yielded = 0
        self.holds: list[tuple[int, frozenset[int], bool]] = []

    def hold(self, shards: tuple[int, ...], *, wait: bool = False) -> None:
        self.holds.append((self.yielded, frozenset(shards), wait))

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("world", "rank"), [(1, 0), (2, 1), (3, 2)])
def test_holds_always_cover_what_is_read(world: int, rank: int) -> None:
    sizes = [40, 35, 50, 40, 45, 38, 42, 40, 44, 41, 39, 43, 40, 39]  # 576: no padding for 1, 2, 3 ranks
    lag = 15  # 45 samples in all at 3 ranks: over a third of a window (and under half: no warning)
    rec = HoldRecorder()
    s = WindowedShuffleSampler(sizes, window=3, seed=5, rank=rank, world_size=world, lag=lag, residency=rec)
    order = s.permutation()
    n = sum(sizes)
    for _ in s:
        # The window read, the next one, and the previous one during the lag.
        at = (rank + rec.yielded * world) % n
        j = order.window_of(at)
        needed = set(order.window_shards(j))
        if j + 1 < order.window_count:
            needed |= set(order.window_shards(j + 1))
        if j > 0 and at - int(order.window_starts[j]) < lag * world:
            needed |= set(order.window_shards(j - 1))
        assert needed <= rec.holds[-1][1], (rec.yielded, j)
        rec.yielded += 1
    assert rec.holds[0][0] == 0
    assert [wait for _, _, wait in rec.holds] == [True] + [False] * (len(rec.holds) - 1)  # errors up front


def test_a_lag_over_half_a_window_is_warned_of() -> None:
    sizes = [100] * 10  # windows of 2 shards: 200 samples

    def sampler(lag: int, residency: Any) -> WindowedShuffleSampler:
        return WindowedShuffleSampler(
            sizes, window=2, seed=1, rank=0, world_size=2, lag=lag, residency=residency
        )

    with pytest.warns(
        UserWarning,
        match=r"lag=51 samples a rank \(102 in all\) is more than half of an average window \(200",
    ):
        sampler(51, HoldRecorder())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sampler(50, HoldRecorder())  # half a window
        sampler(8192, False)  # no residency: the lag holds nothing


def test_window_for_a_budget(tmp_path: Path) -> None:
    out, _ = sharded(tmp_path)
    page = os.sysconf("SC_PAGESIZE")
    raw = max(s.file_size for s in read_manifest(out).shards)
    largest = -(-raw // page) * page  # the daemon counts a segment in whole pages
    assert raw % page  # so the file's size alone undercounts it
    assert WindowedShuffleSampler.window_for(out, 2 * largest) == 1
    assert WindowedShuffleSampler.window_for(out, 9 * largest) == 4
    with pytest.raises(ValueError, match="cannot hold two shards"):
        WindowedShuffleSampler.window_for(out, 2 * largest - 1)
    with pytest.raises(ValueError, match="whole pages"):
        WindowedShuffleSampler.window_for(out, 2 * raw)


def equal_shards(tmp_path: Path, shards: int = 8, per_shard: int = 100) -> tuple[Path, list[bytes]]:
    """A dataset of shards of one size that is not a whole number of pages."""
    recs = [b"%05d" % i + bytes([97 + i % 26]) * 55 for i in range(shards * per_shard)]
    out = tmp_path / "ds"
    with smstore.ShardedWriter(f"{out}/", shard_records=per_shard, durable=False) as w:
        w.extend(recs)
    sizes = {s.file_size for s in read_manifest(out).shards}
    assert len(sizes) == 1, sizes
    assert sizes.pop() % os.sysconf("SC_PAGESIZE")
    return out, recs


def test_the_readme_recipe_runs_an_epoch_across_window_switches(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """window_for(ds, B) with `smstore serve --shm-limit B` (README). It sized windows by the files'
    sizes, the daemon counts whole pages: two windows did not fit, so at the first switch the window
    now read waited for room that the previous one (held for the lag) kept, and the lag never ended
    because the loop waited for that window: the epoch hung."""
    torch = pytest.importorskip("torch")
    out, recs = equal_shards(tmp_path)
    budget = 4 * read_manifest(out).shards[0].file_size  # two windows of two shards, by file size
    start_daemon(args=("--shm-limit", str(budget)), loaded=0)
    ds = smstore.SharedStoreDataset(out, mode="daemon", decode="bytes")
    window = WindowedShuffleSampler.window_for(ds, budget)
    sampler = WindowedShuffleSampler(ds, window=window, seed=1, rank=0, world_size=1, lag=40)
    assert sampler.permutation().window_count >= 3  # the epoch switches windows
    try:
        loader = torch.utils.data.DataLoader(
            ds,
            sampler=sampler,
            batch_size=4,
            num_workers=2,
            prefetch_factor=2,  # 16 samples ahead of the loop: within the lag
            collate_fn=list,
            multiprocessing_context="fork",
            # The old code's hang ends here (a worker waits for a shard no room will ever hold);
            # a batch of the fixed code takes milliseconds.
            timeout=120,
        )
        got = collect(loader)
    finally:
        sampler.close()
    assert sampler.residency.kind == "daemon"
    assert got == [recs[i] for i in order_of(ds.shard_sizes, window=window, seed=1)]


def test_a_window_picked_by_hand_that_cannot_fit_two_at_a_time_is_refused_before_the_first_sample(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """window_for never chooses windows two of which cannot fit --shm-limit; a window picked by
    hand could, and the epoch then stopped at its first window switch (the window read next waited
    for room the one read kept). The daemon's hold reply says its limit, and the sampler refuses
    such windows before its first sample, naming window_for; a window that fits runs."""
    out, _recs = equal_shards(tmp_path)
    budget = 6 * _core.shm_footprint(read_manifest(out).shards[0].file_size)  # two windows of 3 shards
    start_daemon(args=("--shm-limit", str(budget)), loaded=0)
    ds = smstore.SharedStoreDataset(out, mode="daemon", decode="bytes")
    assert WindowedShuffleSampler.window_for(ds, budget) == 3
    big = WindowedShuffleSampler(ds, window=4, seed=1, rank=0, world_size=1, lag=40)
    try:
        with pytest.raises(ValueError, match=r"two windows of 4 shards need .*window_for"):
            next(iter(big))
        assert big.residency.limit == budget
    finally:
        big.close()
    fits = WindowedShuffleSampler(ds, window=3, seed=1, rank=0, world_size=1, lag=40)
    try:
        assert sorted(fits) == list(range(len(ds)))
    finally:
        fits.close()


def test_readers_release_shards_they_stopped_reading(tmp_path: Path) -> None:
    out, recs = sharded(tmp_path, shards=80, per_shard=100)
    with smstore.open(out) as store:
        first = store[0]
        most = 0
        for i in range(len(store)):
            assert store[i] == recs[i]
            most = max(most, store.open_shard_count)
        # Sequential reads: a shard goes after 12 * open + 64 reads without it (and a sweep every
        # half of that): two or three shards of ~100 records stay open, never all of them.
        assert most <= 4, (most, store.shard_count)
        assert not store.is_shard_open(0)
        assert bytes(first) == recs[0]  # a view outlives its shard's release
        store.release_shard(store.shard_count - 1)
        assert store.open_shard_count < most
        assert store[len(store) - 1] == recs[-1]  # opens again
        store.auto_release = False
        for i in range(len(store)):
            store[i]
        assert store.open_shard_count == store.shard_count


def collect(loader: Any) -> list[bytes]:
    return [r for batch in loader for r in batch]


def test_daemon_keeps_two_windows_within_its_budget(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    torch = pytest.importorskip("torch")
    out, recs = sharded(tmp_path)
    m = read_manifest(out)
    page = os.sysconf("SC_PAGESIZE")
    largest = max(-(-s.file_size // page) * page for s in m.shards)  # a segment takes whole pages
    budget = 4 * largest
    d = start_daemon(args=("--shm-limit", str(budget)), loaded=0)
    ds = smstore.SharedStoreDataset(out, mode="daemon", decode="bytes")
    sampler = WindowedShuffleSampler(ds, window=2, seed=1, rank=0, world_size=1, lag=128)
    assert isinstance(sampler.residency, Residency)
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            status = d.status()
            used = sum(-(-s["size"] // page) * page for s in status["segments"])
            # Released segments a worker still maps are memory too (and count in the budget).
            used += len(status["released"]) * largest
            peak[0] = max(peak[0], used)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        loader = torch.utils.data.DataLoader(
            ds, sampler=sampler, batch_size=16, num_workers=2, collate_fn=list, multiprocessing_context="fork"
        )
        got = collect(loader)
        sampler.set_epoch(1)
        got1 = collect(loader)
    finally:
        stop.set()
        watcher.join()
    assert sampler.residency.kind == "daemon"
    assert got == [recs[i] for i in order_of(ds.shard_sizes, window=2, seed=1)]
    assert sorted(got1) == sorted(recs)
    assert 0 < peak[0] <= budget
    assert d.status()["released"] == []  # every worker detached what it unmapped, or exited
    sampler.close()
    deadline = time.monotonic() + 10
    while d.status()["held"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert d.status()["held"] == []
    assert d.status()["segments"] == []


def test_a_hold_sent_without_a_reply_is_applied_on_the_same_connection(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """The pre-encoded hold frame is one the daemon accepts, whatever the manifest's path holds.

    A refused frame would not show in the records (the next hold reads the refusal and redoes it
    with a reply, on a new connection): the daemon must apply each hold as sent, on the first one.
    """
    where = tmp_path / 'a "quoted\\ dir", naïve'
    where.mkdir()
    out, _ = sharded(where, shards=4)
    m = read_manifest(out)
    d = start_daemon(loaded=0)
    residency = Residency(out, mode="daemon")
    try:
        residency.hold([0, 1], wait=True)
        conn = residency._session.conn
        assert conn is not None
        for wanted in ([2], [3, 1], [0, 1, 2, 3], [2]):
            residency.hold(wanted)
            expected = sorted(m.shards[k].checksum for k in wanted)
            deadline = time.monotonic() + 10
            while d.status()["held"] != expected and time.monotonic() < deadline:
                time.sleep(0.01)
            assert d.status()["held"] == expected
            assert residency._session.conn is conn  # never refused, never redone
    finally:
        residency.close()


def test_a_shard_whose_hold_moved_on_while_it_loaded_is_released(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """A load finishing after no rank holds its shard any more frees it (it used to stay for good).

    The reads are throttled (50 KB shards at 500 KB/s) so that the second hold arrives while the
    first one's shards are still loading.
    """
    out, _ = sharded(tmp_path, shards=4)
    m = read_manifest(out)
    d = start_daemon(args=("--max-read-rate", "500K"), loaded=0)
    residency = Residency(out, mode="daemon")
    try:
        residency.hold([0, 1], wait=True)
        residency.hold([2], wait=True)
        assert d.status()["loading"]  # the first hold's loads are under way
        deadline = time.monotonic() + 20
        while (d.status()["loading"] or len(d.status()["segments"]) > 1) and time.monotonic() < deadline:
            time.sleep(0.02)
        status = d.status()
        assert [s["checksum"] for s in status["segments"]] == [m.shards[2].checksum]
        assert status["held"] == [m.shards[2].checksum]
    finally:
        residency.close()


def test_a_load_for_a_hold_that_moved_on_counts_in_the_budget_until_it_lands(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """A load under way for a shard no rank holds any more fills /dev/shm all the same (and a reader
    that waited for it may map it): the holds after it wait for its room. The daemon used to leave
    it out of --shm-limit and start them at once (windowed mixtures, whose sources move their
    windows independently, went one shard over the budget).

    The reads are throttled (45 KB shards at 100 KB/s): shard 0 is still loading at the second hold.
    """
    out, _ = sharded(tmp_path, shards=4)
    m = read_manifest(out)
    page = os.sysconf("SC_PAGESIZE")
    largest = max(-(-s.file_size // page) * page for s in m.shards)
    d = start_daemon(args=("--max-read-rate", "100K", "--shm-limit", str(2 * largest)), loaded=0)
    residency = Residency(out, mode="daemon")
    names = [Path(m.shard_path(k)).name for k in range(4)]
    try:
        residency.hold([0], wait=True)
        residency.hold([1, 2], wait=True)
        loading = {Path(p).name for p in d.status()["loading"]}
        assert names[0] in loading  # under way, for no one now
        assert names[1] in loading
        assert names[2] not in loading  # waits for shard 0 to land and go
        wanted = sorted([m.shards[1].checksum, m.shards[2].checksum])
        deadline = time.monotonic() + 20
        while sorted(s["checksum"] for s in d.status()["segments"]) != wanted and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sorted(s["checksum"] for s in d.status()["segments"]) == wanted
    finally:
        residency.close()


def test_a_held_load_under_way_counts_in_the_budget_wherever_the_holds_now_put_it(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """A shard still loading that a new hold names after others is counted before them: its pages
    fill all the same. The daemon used to skip it once the shards before it took the room, and
    start those too (a windowed mixture's daemon went a shard over --shm-limit, 4 runs in 20).
    """
    out, _ = sharded(tmp_path, shards=4)
    m = read_manifest(out)
    page = os.sysconf("SC_PAGESIZE")
    largest = max(-(-s.file_size // page) * page for s in m.shards)
    d = start_daemon(args=("--max-read-rate", "100K", "--shm-limit", str(2 * largest)), loaded=0)
    residency = Residency(out, mode="daemon")
    names = [Path(m.shard_path(k)).name for k in range(4)]
    try:
        residency.hold([0], wait=True)
        residency.hold([1, 2, 0], wait=True)
        loading = {Path(p).name for p in d.status()["loading"]}
        assert {names[0], names[1]} <= loading
        assert names[2] not in loading  # shard 0, under way, and shard 1 fill the budget
    finally:
        residency.close()


def test_budget_smaller_than_a_shard_is_an_error_up_front(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    out, _ = sharded(tmp_path)
    largest = max(s.file_size for s in read_manifest(out).shards)
    start_daemon(args=("--shm-limit", str(largest - 1)), loaded=0)
    ds = smstore.SharedStoreDataset(out, mode="daemon", decode="bytes")
    sampler = WindowedShuffleSampler(ds, window=1, seed=1, lag=16)
    with pytest.raises(DaemonError, match="does not fit the daemon's --shm-limit"):
        next(iter(sampler))
    sampler.close()


def test_page_cache_residency_without_a_daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMSTORE_SOCKET", os.fspath(tmp_path / "none.sock"))
    out, recs = sharded(tmp_path)
    ds = smstore.SharedStoreDataset(out, decode="bytes")
    sampler = WindowedShuffleSampler(ds, window=3, seed=2, lag=10)
    got = [ds[i] for i in sampler]
    assert sorted(got) == sorted(recs)
    assert sampler.residency is not None
    assert sampler.residency.kind == "page cache"
    sampler.close()


def test_daemon_killed_mid_window(tmp_path: Path, start_daemon: Callable[..., Daemon]) -> None:
    """Readers keep the records they hold; the next window fails clearly; a restarted daemon serves it."""
    out, recs = sharded(tmp_path)
    d = start_daemon(loaded=0)
    ds = smstore.SharedStoreDataset(out, mode="daemon", decode=None)
    sampler = WindowedShuffleSampler(ds, window=2, seed=4, lag=8)
    order = sampler.permutation()
    first_window = int(order.window_starts[1])
    it = iter(sampler)
    held = [(i, ds[i]) for i in (next(it) for _ in range(first_window // 2))]
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    assert all(bytes(v) == recs[i] for i, v in held)  # the mappings outlive the daemon
    # The rest of the epoch: a shard not attached before the kill has no daemon to serve it, and
    # the sampler cannot hold the next window; whichever comes first is a DaemonError.
    with pytest.raises(DaemonError, match="smstore daemon"):
        [ds[i] for i in it]
    # A daemon restarted on the same socket adopts or removes what the dead one left, and serves.
    d = start_daemon(loaded=0)
    assert d.status()["unclaimed"]  # the dead daemon's window, adopted
    sampler.set_epoch(1)
    again = [bytes(ds[i]) for i in sampler]
    assert sorted(again) == sorted(recs)
    sampler.close()
    # Nothing stays loaded: the adopted window went when the holds moved on, the rest with them.
    deadline = time.monotonic() + 10
    while d.status()["segments"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert d.status()["segments"] == []


wait_for = tl.wait_status


def checksums(status: dict[str, Any], key: str = "segments") -> set[str]:
    return {s["checksum"] if isinstance(s, dict) else s for s in status[key]}


def restarted_while_holding(
    out: Path, start_daemon: Callable[..., Daemon], shards: list[int], *args: str
) -> Daemon:
    """A daemon killed (-9) while a rank held `shards` of `out` (all loaded), and one started after it."""
    d = start_daemon(args=args, loaded=0)
    rank = Residency(out, mode="daemon")
    rank.hold(shards, wait=True)
    wait_for(d, lambda st: len(st["segments"]) == len(shards) and not st["loading"])
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    rank.close()
    return start_daemon(args=args, loaded=0)


def test_a_restarted_daemon_releases_an_adopted_window_the_holds_moved_past(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """Without a budget: an adopted held segment is claimed by the next hold, or released with the next window."""
    out, _ = sharded(tmp_path, shards=4)
    ck = [s.checksum for s in read_manifest(out).shards]
    d = restarted_while_holding(out, start_daemon, [0, 1])
    status = d.status()
    assert checksums(status) == checksums(status, "unclaimed") == {ck[0], ck[1]}
    residency = Residency(out, mode="daemon")
    try:
        residency.hold([1, 2], wait=True)  # claims shard 1 (no second load), loads shard 2
        status = wait_for(d, lambda st: len(st["held"]) == 2)
        assert set(status["held"]) == {ck[1], ck[2]}
        assert status["unclaimed"] == [ck[0]]  # no window released yet: it may be a slow rank's
        assert d.segment(ck[1])["adopted"] is True
        residency.hold([2, 3], wait=True)  # shard 1 released: the job moved past the dead one's window
        status = wait_for(d, lambda st: checksums(st) == {ck[2], ck[3]})
        assert checksums(status) == set(status["held"]) == {ck[2], ck[3]}
        assert status["unclaimed"] == []
    finally:
        residency.close()
    assert wait_for(d, lambda st: not st["segments"])["segments"] == []


def test_a_restarted_daemon_makes_room_for_held_shards_from_adopted_ones(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """With a budget full of the dead daemon's window, a new hold's loads are not kept waiting for good."""
    out, _ = sharded(tmp_path, shards=4)
    m = read_manifest(out)
    ck = [s.checksum for s in m.shards]
    page = os.sysconf("SC_PAGESIZE")
    limit = 2 * max(-(-s.file_size // page) * page for s in m.shards) + page  # two shards, not three
    d = restarted_while_holding(out, start_daemon, [0, 1], "--shm-limit", str(limit))
    assert set(d.status()["unclaimed"]) == {ck[0], ck[1]}
    residency = Residency(out, mode="daemon")
    try:
        residency.hold([2, 1], wait=True)  # shard 2 needs shard 0's room; shard 1 is claimed
        status = wait_for(d, lambda st: checksums(st) == {ck[1], ck[2]} and not st["loading"])
        assert checksums(status) == set(status["held"]) == {ck[1], ck[2]}
        assert status["unclaimed"] == []
        residency.hold([3], wait=True)  # a budget the first daemon's shards no longer take
        status = wait_for(d, lambda st: checksums(st) == {ck[3]} and not st["loading"])
        assert checksums(status) == set(status["held"]) == {ck[3]}
    finally:
        residency.close()
    assert wait_for(d, lambda st: not st["segments"])["segments"] == []


def test_a_hold_reads_a_rewritten_manifest_again(tmp_path: Path, start_daemon: Callable[..., Daemon]) -> None:
    # The daemon keeps a parsed manifest while its file stays the same; a dataset packed again in
    # place (other shards, another count) is read again at the next hold.
    out, _ = sharded(tmp_path, shards=3)
    d = start_daemon(loaded=0)
    manifest = os.fspath((out / "manifest.json").absolute())

    def hold(shards: str) -> dict[str, Any] | None:
        return tl.exchange(s, {"op": "hold", "manifest": manifest, "shards": shards})

    s = tl.raw(d.sock)
    try:
        assert hold("0") == {"ok": True, "resident": 0, "held": 1, "limit": 0}
        reply = hold("4")
        assert reply is not None
        assert reply["error"] == "bad_request"
        assert "has 3 shards" in reply["message"]
        sharded(tmp_path, shards=6)  # the same directory, packed again
        assert len(read_manifest(out).shards) == 6
        reply = hold("4,0")  # shard 4 is new; shard 0 may be the same as before (resident)
        assert reply is not None
        assert reply["ok"] is True, reply
        assert reply["held"] == 2
        deadline = time.monotonic() + 30
        while len(d.status()["held"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(d.status()["held"]) == sorted(read_manifest(out).shards[k].checksum for k in (0, 4))
    finally:
        s.close()


def test_malformed_holds_are_refused_and_the_daemon_serves_on(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    out, recs = sharded(tmp_path, shards=3)
    d = start_daemon(loaded=0)
    manifest = os.fspath((out / "manifest.json").absolute())
    blob = read_manifest(out).shard_path(0)
    bad = [
        {"op": "hold", "manifest": "ds/manifest.json", "shards": "0"},  # relative
        {"op": "hold", "manifest": manifest, "shards": "0,x"},
        {"op": "hold", "manifest": manifest, "shards": "-1"},
        {"op": "hold", "manifest": manifest, "shards": "3"},  # 3 shards: 0, 1, 2
        {"op": "hold", "manifest": manifest, "shards": 5},
        {"op": "hold", "manifest": os.fspath(Path(blob).absolute()), "shards": "0"},  # not a manifest
        {"op": "detach"},
    ]
    s = tl.raw(d.sock)
    try:
        for message in bad:
            reply = tl.exchange(s, message)
            assert reply is not None, message
            assert reply["ok"] is False, (message, reply)
            assert reply["error"] == "bad_request", (message, reply)
        # Nothing was loaded or held, and a good hold on the same connection works.
        assert d.status()["segments"] == []
        assert tl.exchange(s, {"op": "hold", "manifest": manifest, "shards": "2,0"}) == {
            "ok": True,
            "resident": 0,
            "held": 2,
            "limit": 0,
        }
        deadline = time.monotonic() + 30
        while len(d.status()["segments"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(d.status()["held"]) == sorted(read_manifest(out).shards[k].checksum for k in (0, 2))
    finally:
        s.close()  # the hold goes with the connection
    deadline = time.monotonic() + 10
    while d.status()["segments"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert d.status()["segments"] == []
    with smstore.open_store(out, mode="auto") as store:
        assert store[len(recs) - 1] == recs[-1]


def test_readers_preattach_the_next_window_without_polling(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """A reader's thread asks 'held' once per change of the holds or of what is loaded, and
    attaches a newly held shard when its load ends, before any read of it."""
    out, recs = sharded(tmp_path, shards=4)
    m = read_manifest(out)
    starts = np.concatenate([[0], np.cumsum([s.records for s in m.shards])])
    d = start_daemon(loaded=0)
    rank = Residency(out, mode="daemon")
    store = smstore.open_store(out, mode="daemon")
    try:
        rank.hold([0, 1], wait=True)
        wait_for(d, lambda st: len(st["segments"]) == 2 and not st["loading"])
        assert store[0] == recs[0]  # the first read starts the thread
        # It asked once, attached shard 1 (held, not read yet), and asks again: parked until a change.
        status = wait_for(d, lambda st: st["counts"]["parked"] == 1)
        assert status["counts"]["parked"] == 1
        assert os.getpid() in d.segment(m.shards[1].checksum)["clients"]
        asked = d.status()["counts"]["held_requests"]
        time.sleep(0.5)  # a polling reader would ask about 5 times meanwhile
        assert d.status()["counts"]["held_requests"] == asked
        rank.hold([2, 3])
        status = wait_for(
            d,
            lambda st: (
                {m.shards[k].checksum for k in (2, 3)} <= checksums(st)
                and all(os.getpid() in s["clients"] for s in st["segments"])
                and st["counts"]["parked"] == 1
            ),
        )
        assert all(os.getpid() in s["clients"] for s in status["segments"]), status["segments"]
        # One question per change at most: the hold, each shard's load, each release.
        assert status["counts"]["held_requests"] - asked <= 5, status["counts"]
        # Shard 0 (read, then released by the holds) is unmapped; 2 and 3 read without a round trip.
        assert not store.is_shard_open(0)
        assert store[int(starts[2])] == recs[int(starts[2])]
        assert store[int(starts[3])] == recs[int(starts[3])]
    finally:
        store.close()
        rank.close()


def test_residencies_sharing_the_process_connection_keep_their_own_holds(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """Two residencies of one process (two datasets, as a mixture holds them) send their holds on
    the process's one connection: each hold replaces only its own residency's (the daemon keys
    them by holder), so both datasets stay held; closing one releases only its shards."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, _ = sharded(tmp_path / "a", shards=3)
    b, _ = sharded(tmp_path / "b", shards=3)
    d = start_daemon(loaded=0)
    first, second = Residency(a, mode="daemon"), Residency(b, mode="daemon")
    try:
        first.hold([0, 1], wait=True)
        second.hold([2], wait=True)
        assert first._session is second._session

        def held_becomes(expected: set[str]) -> set[str]:
            deadline = time.monotonic() + 10  # bounds the wait for the daemon's list, not a timing goal
            while (held := set(d.status()["held"])) != expected and time.monotonic() < deadline:
                time.sleep(0.01)
            return held

        ours = {read_manifest(a).shards[k].checksum for k in (0, 1)} | {read_manifest(b).shards[2].checksum}
        assert held_becomes(ours) == ours
        first.hold([1])  # sent without waiting: read back by the next request on the connection
        second.close()
        assert held_becomes({read_manifest(a).shards[1].checksum}) == {read_manifest(a).shards[1].checksum}
    finally:
        first.close()
        second.close()
