"""LoaderStats: the wait for each batch and the share of step time it is, around any batch iterable."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import smstore
from smstore import LoaderStats

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader


class FakeClock:
    """A clock the test moves: the loader's waits and the loop's work take exactly what it says."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def slow_batches(clock: FakeClock, waits: list[float], closed: list[bool]) -> Iterator[int]:
    try:
        for k, w in enumerate(waits):
            clock.now += w
            yield k
    finally:
        closed.append(True)


def test_waits_and_their_share_of_the_steps_are_what_the_loader_and_the_loop_took() -> None:
    clock = FakeClock()
    waits = [0.5, 0.0, 0.25, 1.0]
    work = [1.5, 2.0, 0.75, 3.0]
    stats = LoaderStats(window=2, clock=clock)
    closed: list[bool] = []
    seen = []
    for k, batch in enumerate(stats.wrap(slow_batches(clock, waits, closed))):
        seen.append(batch)
        assert stats.steps == k + 1
        assert stats.last_wait == waits[k]  # known inside the step it delays
        clock.now += work[k]
    assert seen == [0, 1, 2, 3]
    assert closed == [True]
    assert stats.total_wait == sum(waits)
    assert stats.total_time == sum(waits) + sum(work)
    assert stats.total_wait_share == sum(waits) / (sum(waits) + sum(work))
    # The window holds the last two steps: (0.25 + 0.75) and (1.0 + 3.0).
    assert stats.mean_wait == (0.25 + 1.0) / 2
    assert stats.wait_share == (0.25 + 1.0) / (1.0 + 4.0)
    assert stats.summary() == {
        "steps": 4,
        "wait_ms": 1000.0,
        "mean_wait_ms": 625.0,
        "wait_share": 0.25,
        "total_wait_share": 1.75 / 9.0,
    }
    assert stats.postfix() == {"wait": "625.0ms", "data": "25.0%"}
    stats.reset()
    assert stats.summary() == {
        "steps": 0,
        "wait_ms": 0.0,
        "mean_wait_ms": 0.0,
        "wait_share": 0.0,
        "total_wait_share": 0.0,
    }


def test_a_loop_left_early_closes_the_loader_and_counts_only_finished_steps() -> None:
    clock = FakeClock()
    stats = LoaderStats(clock=clock)
    closed: list[bool] = []
    it = stats.wrap(slow_batches(clock, [1.0, 2.0, 3.0], closed))
    for batch in it:
        clock.now += 1.0
        if batch == 1:
            break
    it.close()  # what the end of a `for` over a generator does when the loop holds it
    assert closed == [True]
    assert stats.steps == 2
    # The step under way when the loop left (waited 2.0, its work unknown) is not in the share.
    assert stats.total_time == 2.0
    assert stats.total_wait_share == 0.5


def test_a_bad_window_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one step"):
        LoaderStats(window=0)


def test_a_dataloader_wrapped_yields_the_same_batches() -> None:
    dl = DataLoader(range(50), batch_size=8)
    stats = LoaderStats()
    got = [b.tolist() for b in stats.wrap(dl)]
    assert got == [b.tolist() for b in dl]
    assert stats.steps == len(dl) == 7
    assert 0.0 <= stats.total_wait_share <= 1.0


def test_loader_and_transform_loader_count_every_batch_of_every_pass(tmp_path: Path) -> None:
    path = tmp_path / "tokens.smst"
    smstore.pack_arrays((np.arange(i % 9 + 1, dtype=np.uint16) for i in range(100)), path, dtype=np.uint16)
    loader = smstore.Loader(path, sampler=range(100), batch_size=16, dtype=torch.long)
    try:
        assert loader.stats().steps == 0
        first = [b["tokens"].clone() for b in loader]
        assert loader.stats().steps == len(first) == 7
        second = [b["tokens"].clone() for b in loader]
        assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
        assert loader.stats().steps == 14
        assert loader.stats().total_wait <= loader.stats().total_time
    finally:
        loader.close()

    ds = smstore.SharedStoreDataset(path, decode="bytes")
    with smstore.TransformLoader(
        ds, lambda r: len(r), batch_size=25, num_workers=1, multiprocessing_context="fork"
    ) as tl:
        sizes = [int(x) for b in tl for x in b]
        assert tl.stats().steps == 4
    assert sizes == [2 * (i % 9 + 1) for i in range(100)]
