"""Windowed mixtures: sources larger than memory read window by window, exact, elastic and resumable."""

from __future__ import annotations

import itertools
import os
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import smstore
from smstore import MixtureError
from smstore.format.manifest import read_manifest
from smstore.sampling import Mixture, MixtureDataset, MixtureSampler, ResumableLoader, WindowedMixtureSampler
from smstore.sampling.plan import check_room
from smstore.wire.residency import Residency

from .daemon_testlib import Daemon
from .smstore_testlib import interleave, loader_batches, sharded, stateful_resume, whole_order

# Three sources: two sharded (uneven shards, an empty one), one without shards.
SHARDS = [[30, 25, 0, 40, 35, 20, 30], [12, 15, 10, 14, 9, 11, 13, 8, 12, 16], None]
LENGTHS = [180, 120, 45]
WEIGHTS = [0.5, 0.3, 0.2]


def sampler(
    mix: Mixture, window: int | list[int] = 2, *, seed: int = 3, rank: int = 0, world: int = 1, **kw: Any
) -> WindowedMixtureSampler:
    kw.setdefault("shard_sizes", SHARDS)
    return WindowedMixtureSampler(mix, window=window, seed=seed, rank=rank, world_size=world, **kw)


epoch_order = partial(whole_order, WindowedMixtureSampler, window=2, seed=3, shard_sizes=SHARDS)


def split(mix: Mixture, indices: list[int]) -> list[tuple[int, int]]:
    offsets = mix.offsets
    return [(s := int(np.searchsorted(offsets, i, side="right")) - 1, i - offsets[s]) for i in indices]


# The first positions of one epoch, as this version computes them (see the test that pins them).
PINNED = [153, 237, 2, 338, 10, 286, 25, 328, 1, 220, 27, 298, 160, 340, 28, 284]

# ---- the order --------------------------------------------------------------------------------


@pytest.mark.parametrize("stop", ["all_exhausted", "first_exhausted", 1000])
@pytest.mark.parametrize("window", [1, 3, [2, 4, 1], 50])
def test_every_record_drawn_as_often_as_its_policy_says(stop: str | int, window: int | list[int]) -> None:
    mix = Mixture(LENGTHS, WEIGHTS, stop=stop)
    order = epoch_order(mix, window=window)
    assert len(order) == mix.num_samples
    seen = Counter(split(mix, order))
    for s, (m, c) in enumerate(zip(LENGTHS, mix.counts(mix.num_samples), strict=True)):
        q, r = divmod(c, m)
        times = Counter(seen[(s, j)] for j in range(m))
        # Each source's draws are q whole passes over it plus r distinct records of the next.
        assert times == Counter({q + 1: r, q: m - r} if r else {q: m}), s


def test_sources_follow_the_mixture_rule_and_its_bound() -> None:
    mix = Mixture(LENGTHS, WEIGHTS, stop=3000)  # every source upsampled many times over
    order = epoch_order(mix, window=[2, 3, 1])
    sources = np.array([s for s, _ in split(mix, order)])
    assert sources.tolist() == mix.locate(np.arange(mix.num_samples))[0].tolist()
    k = np.arange(1, mix.num_samples + 1)
    for s, (w, bound) in enumerate(zip(mix.weights, mix.deviation_bounds(), strict=True)):
        assert np.abs(np.cumsum(sources == s) - k * float(w)).max() <= bound + 1e-9


def shard_of(sizes: list[int]) -> np.ndarray:
    return np.repeat(np.arange(len(sizes)), sizes)


def test_each_source_pass_is_read_window_by_window_with_its_own_shard_order() -> None:
    mix = Mixture(LENGTHS, WEIGHTS, stop=1500)
    s = sampler(mix, [2, 3, 1], seed=8)
    order = s.permutation()
    draws = split(mix, list(s))
    for src in (0, 1):
        sizes = SHARDS[src]
        assert sizes is not None
        records = [j for t, j in draws if t == src]
        passes = [records[i : i + LENGTHS[src]] for i in range(0, len(records), LENGTHS[src])]
        shard_orders = set()
        for e, got in enumerate(passes):
            wo = order.source_order(src, e)
            shard_orders.add(tuple(wo.shard_order.tolist()))
            assert sorted(wo.shard_order.tolist()) == list(range(len(sizes)))
            for j in range(wo.window_count):
                block = got[wo.window_start(j) : wo.window_start(j + 1)]
                # The draws of window j are records of window j's shards, and no others.
                assert set(shard_of(sizes)[block].tolist()) <= set(wo.window_shards(j)), (src, e, j)
                if len(block) == wo.window_start(j + 1) - wo.window_start(j):
                    assert sorted(block) == sorted(
                        i for k in wo.window_shards(j) for i in range(sum(sizes[:k]), sum(sizes[: k + 1]))
                    )
        assert len(passes) > 3
        assert len(shard_orders) > 1  # each pass starts its own shard order


def test_the_kernel_is_the_windowed_order_of_each_source_pass() -> None:
    """The C++ order equals its definition: offset_s + the source pass's WindowedOrder (numpy side)."""
    mix = Mixture(LENGTHS, WEIGHTS, stop=2500)
    order = sampler(mix, [3, 2, 1], seed=2).permutation(4)
    rng = np.random.default_rng(0)
    positions = np.concatenate([np.arange(600), rng.integers(0, mix.num_samples, 2000)])
    src, draws = mix.locate(positions)
    expected = []
    for s, k in zip(src.tolist(), draws.tolist(), strict=True):
        e, j = divmod(k, LENGTHS[s])
        wo = order.source_order(s, e)  # the Python side's WindowedOrder of the pass
        assert wo.window == [3, 2, 1][s]
        expected.append(mix.offsets[s] + int(wo(np.array([j]))[0]))
    assert order(positions).tolist() == expected
    assert (
        order.strided(5, 7, 300, mix.num_samples)
        == order(np.arange(5, 5 + 7 * 300, 7) % mix.num_samples).tolist()
    )
    with pytest.raises(IndexError, match="out of range"):
        order(np.array([mix.num_samples]))


def test_a_source_pass_does_not_depend_on_the_other_sources() -> None:
    """Source s's records, in the order it draws them, are its own: other weights or sources only
    change how many it draws (upsampling advances each source's window schedule on its own)."""
    draws = []
    for weights, stop in [(WEIGHTS, 2000), ([0.1, 0.6, 0.3], 2000), ([0.8, 0.1, 0.1], 3000)]:
        mix = Mixture(LENGTHS, weights, stop=stop)
        draws.append([j for s, j in split(mix, epoch_order(mix, window=[2, 3, 1], seed=6)) if s == 1])
    shortest = min(map(len, draws))
    assert shortest > 2 * LENGTHS[1]  # past two passes of the source
    assert draws[0][:shortest] == draws[1][:shortest] == draws[2][:shortest]


def test_the_order_is_the_one_earlier_versions_saved() -> None:
    """A saved state means a position in this order: changing the order would break resumes."""
    mix = Mixture(LENGTHS, WEIGHTS)
    assert epoch_order(mix, window=[2, 3, 1], seed=7, epoch=1)[:16] == PINNED


def test_the_order_depends_on_seed_epoch_and_windows_only() -> None:
    mix = Mixture(LENGTHS, WEIGHTS)
    a = epoch_order(mix, window=2, seed=1)
    assert a == epoch_order(mix, window=2, seed=1)
    assert a != epoch_order(mix, window=2, seed=2)
    assert a != epoch_order(mix, window=2, seed=1, epoch=1)
    assert a != epoch_order(mix, window=3, seed=1)
    assert a != list(MixtureSampler(mix, seed=1, rank=0, world_size=1))


def test_a_window_of_every_shard_is_a_shuffle_of_each_pass() -> None:
    mix = Mixture(LENGTHS, WEIGHTS, stop="first_exhausted")
    got = split(mix, epoch_order(mix, window=100))
    first = [j for s, j in got if s == 1]
    assert first != sorted(first)
    assert abs(np.corrcoef(np.arange(len(first)), first)[0, 1]) < 0.5


# ---- ranks and resume -------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("drop_last", [False, True])
def test_world_sizes_give_the_world_size_one_order(world: int, drop_last: bool) -> None:
    mix = Mixture(LENGTHS, WEIGHTS)
    order = epoch_order(mix, window=[2, 3, 1], seed=9)
    n = len(order)
    streams = [
        list(sampler(mix, [2, 3, 1], seed=9, rank=r, world=world, drop_last=drop_last)) for r in range(world)
    ]
    if drop_last:
        assert interleave(streams) == order[: n // world * world]
    else:
        assert interleave(streams) == [order[p % n] for p in range(-(-n // world) * world)]


def test_resume_across_world_sizes_1_3_8_2_is_the_uninterrupted_run() -> None:
    mix = Mixture(LENGTHS, WEIGHTS, stop=900)
    order = epoch_order(mix, window=2, seed=4, epoch=2)
    n = len(order)
    rng = np.random.default_rng(1)
    got: list[int] = []
    state = None
    streams: list[list[int]] = []
    for i, world in enumerate([1, 3, 8, 2]):
        streams = []
        steps = int(rng.integers(1, 40)) if i < 3 else None
        rank0 = None
        for r in range(world):
            s = sampler(mix, 2, seed=4 if state is None else 0, rank=r, world=world)
            if state is None:
                s.set_epoch(2)
            else:
                s.load_state_dict(state)
            streams.append(list(itertools.islice(iter(s), steps)))
            rank0 = rank0 or s
        got += interleave(streams)
        assert rank0 is not None
        state = rank0.state_dict()
        assert len(repr(state)) < 400
    before_last = len(got) - len(interleave(streams))
    assert got[:before_last] == order[:before_last]
    assert got[before_last:] == [order[p % n] for p in range(before_last, len(got))]
    assert Counter(got[:n]) == Counter(order)


def test_a_state_of_other_windows_or_shards_is_refused() -> None:
    mix = Mixture(LENGTHS, WEIGHTS)
    state = sampler(mix, 2).state_dict()
    for other in (
        sampler(mix, 3),
        sampler(mix, 2, shard_sizes=[[90, 90], SHARDS[1], None]),
    ):
        with pytest.raises(MixtureError, match=r"windows=.*another order cannot be resumed"):
            other.load_state_dict(state)
    with pytest.raises(MixtureError, match="another order cannot be resumed"):
        sampler(mix, 2).load_state_dict(MixtureSampler(mix, seed=3, rank=0, world_size=1).state_dict())


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_workers_resume_1_3_8_2(num_workers: int) -> None:
    from torch.utils.data import DataLoader

    mix = Mixture(LENGTHS, WEIGHTS)
    order = epoch_order(mix, window=[2, 2, 1], seed=11)
    n, batch = len(order), 4
    rng = np.random.default_rng(num_workers)
    state = None
    got: list[int] = []
    last_start = 0
    for i, world in enumerate([1, 3, 8, 2]):
        k = None if i == 3 else int(rng.integers(1, 5))
        streams, saved = [], None
        for r in range(world):
            s = sampler(mix, [2, 2, 1], seed=11, rank=r, world=world)
            if state is not None:
                s.load_state_dict(state)
            loader = ResumableLoader(
                DataLoader(range(sum(LENGTHS)), batch_size=batch, sampler=s, num_workers=num_workers)
            )
            streams.append(loader_batches(loader, k))
            if r == 0:
                saved = loader.state_dict()
        last_start = len(got)
        got += interleave(streams)
        state = saved
    assert got[:last_start] == order[:last_start]
    assert got[last_start:] == [order[p % n] for p in range(last_start, len(got))]
    assert len(got) >= n


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_stateful_dataloader_resume_1_3_8_2() -> None:
    sdl = pytest.importorskip("torchdata.stateful_dataloader")

    mix = Mixture(LENGTHS, WEIGHTS, stop="first_exhausted")
    order = epoch_order(mix, window=3, seed=12)
    n, batch = len(order), 3
    got, starts = stateful_resume(
        sdl, lambda r, world: sampler(mix, 3, seed=12, rank=r, world=world), sum(LENGTHS), batch, 2
    )
    last_start = starts[-1]
    assert got[:last_start] == order[:last_start]
    assert got[last_start:] == [order[p % n] for p in range(last_start, len(got))]


# ---- residency --------------------------------------------------------------------------------


class HoldRecorder:
    """A residency that records every hold with the number of samples yielded before it."""

    def __init__(self) -> None:
        self.yielded = 0
        self.holds: list[tuple[int, frozenset[int], bool]] = []

    def hold(self, shards: tuple[int, ...], *, wait: bool = False) -> None:
        assert len(set(shards)) == len(shards)
        self.holds.append((self.yielded, frozenset(shards), wait))

    def close(self) -> None:
        pass


def windows_in_order(s: WindowedMixtureSampler, source: int, draws: int) -> list[frozenset[int]]:
    """The shards of each window of `source` that the epoch's first `draws` draws go through."""
    order = s.permutation()
    n = s.mixture.lengths[source]
    out: list[frozenset[int]] = []
    for e in range(-(-draws // n)):
        wo = order.source_order(source, e)
        out += [
            frozenset(wo.window_shards(j))
            for j in range(wo.window_count)
            if e * n + wo.window_start(j) < draws
        ]
    return out


@pytest.mark.parametrize(("world", "rank"), [(1, 0), (2, 1), (3, 2)])
def test_holds_cover_what_is_read_and_stay_within_three_windows(world: int, rank: int) -> None:
    mix = Mixture(LENGTHS, WEIGHTS, stop=1200)  # the sources go through several passes
    lag = 4
    recs = [HoldRecorder(), HoldRecorder(), None]
    s = sampler(mix, [2, 3, 1], seed=5, rank=rank, world=world, lag=lag, residency=recs)
    n = mix.num_samples
    order = s.permutation()
    src_all, draw_all = mix.locate(np.arange(n))
    sequences = {t: windows_in_order(s, t, mix.counts(n)[t]) for t in (0, 1)}
    for index in s:
        at = (rank + recs[0].yielded * world) % n  # type: ignore[union-attr]
        t = int(src_all[at])
        if t < 2:
            shard = int(shard_of(SHARDS[t])[index - mix.offsets[t]])  # type: ignore[arg-type]
            assert shard in recs[t].holds[-1][1], (at, t)  # type: ignore[union-attr]
            assert shard in order.window_shards(t, order.window_of_draw(t, int(draw_all[at])))
        for rec in recs[:2]:
            rec.yielded += 1  # type: ignore[union-attr]
    for t in (0, 1):
        rec = recs[t]
        assert rec is not None
        assert rec.holds[0][0] == 0
        assert [wait for _, _, wait in rec.holds] == [True] + [False] * (len(rec.holds) - 1)
        seq = sequences[t]
        for _, held, _ in rec.holds:
            # Held: within the previous, current and next windows of the source's schedule.
            assert any(
                held <= seq[max(0, u - 1)] | seq[u] | seq[min(len(seq) - 1, u + 1)] for u in range(len(seq))
            )
        assert len(rec.holds) >= len(seq)  # it moved with every window


def test_a_lag_over_half_a_window_is_warned_of() -> None:
    mix = Mixture([1000, 1000], [0.5, 0.5])
    sizes = [[100] * 10, [100] * 10]  # windows of 2 shards: 200 draws, about 400 positions

    def make(lag: int, residency: Any) -> WindowedMixtureSampler:
        return WindowedMixtureSampler(
            mix, window=2, seed=1, rank=0, world_size=2, lag=lag, shard_sizes=sizes, residency=residency
        )

    with pytest.warns(UserWarning, match=r"lag=101 samples a rank \(202 in all\) is more than half"):
        make(101, [HoldRecorder(), None])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make(100, [HoldRecorder(), HoldRecorder()])
        make(8192, False)


def test_bad_shards_windows_and_residencies_name_the_fault() -> None:
    assert smstore.WindowedMixtureSampler is WindowedMixtureSampler
    mix = Mixture(LENGTHS, WEIGHTS)
    with pytest.raises(MixtureError, match="source 1: its shard sizes add up to 119 records, but it has 120"):
        sampler(mix, shard_sizes=[SHARDS[0], [119], None])
    with pytest.raises(MixtureError, match="2 lists of shard sizes for 3 sources"):
        sampler(mix, shard_sizes=SHARDS[:2])
    for window in (0, [1, 2], True, 1.5):
        with pytest.raises(MixtureError, match="window="):
            sampler(mix, window)  # type: ignore[arg-type]
    with pytest.raises(MixtureError, match="2 residencies for 3 sources"):
        sampler(mix, residency=[None, None])


def pack(tmp_path: Path, name: str, shards: int, per_shard: int, seed: int) -> tuple[Path, list[bytes]]:
    rng = np.random.default_rng(seed)
    recs = [
        bytes(rng.integers(32, 127, size=int(rng.integers(150, 300)), dtype=np.uint8)) + name.encode()
        for _ in range(shards * per_shard)
    ]
    return sharded(tmp_path, recs, shard_size=per_shard * 230, name=name), recs


def test_windows_for_a_budget(tmp_path: Path) -> None:
    a, _ = pack(tmp_path, "a", 12, 100, 1)
    b, _ = pack(tmp_path, "b", 6, 100, 2)
    ds = MixtureDataset(
        [
            smstore.SharedStoreDataset(a, mode="mmap"),
            smstore.SharedStoreDataset(b, mode="mmap"),
            list(range(50)),
        ],
        [0.6, 0.2, 0.2],
    )
    page = os.sysconf("SC_PAGESIZE")
    raw_a = max(s.file_size for s in read_manifest(a).shards)
    raw_b = max(s.file_size for s in read_manifest(b).shards)
    la, lb = -(-raw_a // page) * page, -(-raw_b // page) * page  # as the daemon counts: whole pages
    assert raw_a % page
    assert raw_b % page
    with pytest.raises(ValueError, match="whole pages"):  # by the files' sizes, the daemon deadlocked
        WindowedMixtureSampler.windows_for(ds, 2 * raw_a + 2 * raw_b)
    assert WindowedMixtureSampler.windows_for(ds, 2 * la + 2 * lb) == [1, 1, 1]
    budget = 2 * la + 2 * lb + 8 * la  # the rest splits 3:1 as the sharded weights: 6 la and 2 la
    windows = WindowedMixtureSampler.windows_for(ds, budget)
    assert windows == [1 + 3, 1 + (2 * la) // (2 * lb), 1]
    assert 2 * windows[0] * la + 2 * windows[1] * lb <= budget
    assert WindowedMixtureSampler.windows_for(ds, 10**12)[:2] == [12, len(read_manifest(b).shards)]
    with pytest.raises(ValueError, match="cannot hold two of the largest shards of every sharded source"):
        WindowedMixtureSampler.windows_for(ds, 2 * la + 2 * lb - 1)
    # The rule that refuses windows picked by hand once a daemon says its limit never refuses
    # those windows_for picks (one rule of pages, two callers); windows too large for it, it does.
    ma, mb = read_manifest(a), read_manifest(b)
    for limit in (2 * la + 2 * lb, budget, 3 * budget):
        w = WindowedMixtureSampler.windows_for(ds, limit)
        check_room([(ma, w[0]), (mb, w[1])], limit, "test")
    with pytest.raises(ValueError, match=r"two windows of 12, 6 shards need .*--shm-limit of"):
        check_room([(ma, 12), (mb, 6)], budget, "test")


def mixture_of_packed(tmp_path: Path, mode: str) -> tuple[MixtureDataset, list[list[bytes]], list[Path]]:
    a, ra = pack(tmp_path, "a", 8, 150, 1)
    b, rb = pack(tmp_path, "b", 6, 100, 2)
    small = [b"small-%d" % i for i in range(40)]
    sources = [
        smstore.SharedStoreDataset(a, mode=mode, decode="bytes"),  # type: ignore[arg-type]
        smstore.SharedStoreDataset(b, mode=mode, decode="bytes"),  # type: ignore[arg-type]
        small,
    ]
    return MixtureDataset(sources, [0.5, 0.3, 0.2]), [ra, rb, small], [a, b]


def expected_records(ds: MixtureDataset, recs: list[list[bytes]], indices: list[int]) -> list[bytes]:
    return [recs[s][j] for s, j in map(ds.locate, indices)]


def test_daemon_holds_a_window_per_source_within_its_budget(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    torch = pytest.importorskip("torch")
    ds, recs, paths = mixture_of_packed(tmp_path, "daemon")
    page = os.sysconf("SC_PAGESIZE")
    manifests = [read_manifest(p) for p in paths]
    largest = [max(-(-s.file_size // page) * page for s in m.shards) for m in manifests]
    windows = [2, 1, 1]
    budget = 2 * windows[0] * largest[0] + 2 * windows[1] * largest[1]  # the memory rule, no more
    d = start_daemon(args=("--shm-limit", str(budget)), loaded=0)
    s = WindowedMixtureSampler(ds, window=windows, seed=1, rank=0, world_size=1, lag=128)
    assert [type(r) for r in s.residencies] == [Residency, Residency, type(None)]
    which = {sh.checksum: (t, k) for t, m in enumerate(manifests) for k, sh in enumerate(m.shards)}
    pages = {sh.checksum: -(-sh.file_size // page) * page for m in manifests for sh in m.shards}
    n = s.num_records
    sequences = {t: windows_in_order(s, t, ds.mixture.counts(ds.mixture.num_samples)[t]) for t in (0, 1)}
    peak, snapshots, at_peak = [0], [], [{}]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            status = d.status()
            used = sum(-(-seg["size"] // page) * page for seg in status["segments"])
            # Released segments a worker still maps are memory too (and count in the budget).
            used += sum(pages[c] for c in status["released"])
            if used > peak[0]:
                peak[0], at_peak[0] = used, status
            snapshots.append(status["held"])
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        loader = torch.utils.data.DataLoader(
            ds, sampler=s, batch_size=16, num_workers=2, collate_fn=list, multiprocessing_context="fork"
        )
        got = [r for batch in loader for r in batch]
    finally:
        stop.set()
        watcher.join()
    assert got == expected_records(ds, recs, s.permutation()(np.arange(n)).tolist())  # byte-exact
    assert all(r.kind == "daemon" for r in s.residencies[:2])
    shown = {
        "segments": [(which[x["checksum"]], x["size"]) for x in at_peak[0].get("segments", [])],
        "released": [(which[c], pages[c]) for c in at_peak[0].get("released", [])],
        "held": [which[c] for c in at_peak[0].get("held", [])],
        "loading": at_peak[0].get("loading"),
    }
    assert 0 < peak[0] <= budget, shown
    assert any(snapshots)
    for held in snapshots:
        for t in (0, 1):
            mine = frozenset(k for c in held if (ts := which.get(c)) and ts[0] == t for k in [ts[1]])
            seq = sequences[t]
            assert any(
                mine <= seq[max(0, u - 1)] | seq[u] | seq[min(len(seq) - 1, u + 1)] for u in range(len(seq))
            ), (t, sorted(mine))
    s.close()
    deadline = time.monotonic() + 10
    while (d.status()["held"] or d.status()["segments"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert d.status()["held"] == []
    assert d.status()["segments"] == []


def test_without_a_daemon_the_page_cache_reads_ahead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMSTORE_SOCKET", os.fspath(tmp_path / "none.sock"))
    ds, recs, _ = mixture_of_packed(tmp_path, "auto")
    s = WindowedMixtureSampler(ds, window=2, seed=2, rank=0, world_size=1, lag=10)
    got = [ds[i] for i in s]
    assert got == expected_records(ds, recs, s.permutation()(np.arange(s.num_records)).tolist())
    assert [r.kind for r in s.residencies[:2]] == ["page cache", "page cache"]  # type: ignore[union-attr]
    assert s.residencies[2] is None
    s.close()
