"""GlobalShuffleSampler: world-size-independent global order, padding, O(1) resume across world sizes."""

from __future__ import annotations

import itertools
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smstore.sampling import FeistelPermutation, GlobalShuffleSampler

from .smstore_testlib import interleave, whole_order


def rank_streams(
    n: int, seed: int, world: int, *, epoch: int = 0, drop_last: bool = False
) -> list[list[int]]:
    streams = []
    for r in range(world):
        s = GlobalShuffleSampler(n, seed=seed, rank=r, world_size=world, drop_last=drop_last)
        s.set_epoch(epoch)
        streams.append(list(s))
    return streams


reference_order = partial(whole_order, GlobalShuffleSampler)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 64, 97, 1000, 4099])
def test_permutation_is_a_bijection(n: int) -> None:
    perm = FeistelPermutation(n, b"key")
    image = perm(np.arange(n, dtype=np.uint64))
    assert image.dtype == np.int64
    assert sorted(image.tolist()) == list(range(n))
    if n:
        assert perm[n - 1] == image[-1]
        with pytest.raises(IndexError):
            perm[n]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 3000), key=st.binary(max_size=16))
def test_permutation_is_a_bijection_property(n: int, key: bytes) -> None:
    image = FeistelPermutation(n, key)(np.arange(n))
    assert np.array_equal(np.sort(image), np.arange(n))


def test_permutation_actually_shuffles() -> None:
    n = 10_000
    image = FeistelPermutation(n, b"k")(np.arange(n))
    assert np.count_nonzero(image == np.arange(n)) < 20  # ~1 fixed point expected
    # Neighbouring positions land far apart: no local structure survives.
    assert np.median(np.abs(np.diff(image))) > n / 10


@pytest.mark.parametrize("n", [1, 7, 24, 1000, 1001])
def test_world_sizes_1_2_3_8_give_the_same_global_order(n: int) -> None:
    order = reference_order(n, seed=5)
    assert sorted(order) == list(range(n))
    for world in (1, 2, 3, 8):
        streams = rank_streams(n, 5, world)
        per_rank = -(-n // world)
        assert [len(s) for s in streams] == [per_rank] * world
        merged = interleave(streams)
        # Padding, as DistributedSampler: positions p >= n wrap to O[p - n].
        assert merged == [order[p % n] for p in range(per_rank * world)]
        assert set(merged) == set(range(n))


@pytest.mark.parametrize("world", [2, 3, 8])
def test_drop_last_drops_the_tail_of_the_order(world: int) -> None:
    n = 1001
    order = reference_order(n, seed=9)
    streams = rank_streams(n, 9, world, drop_last=True)
    assert [len(s) for s in streams] == [n // world] * world
    assert interleave(streams) == order[: (n // world) * world]


def test_more_ranks_than_records_pads_every_rank() -> None:
    streams = rank_streams(3, 0, 8)
    order = reference_order(3, seed=0)
    assert streams == [[order[r % 3]] for r in range(8)]
    assert rank_streams(3, 0, 8, drop_last=True) == [[] for _ in range(8)]


def test_empty_dataset() -> None:
    s = GlobalShuffleSampler(0, seed=0, rank=0, world_size=2)
    assert len(s) == 0
    assert list(s) == []


def test_seed_and_epoch_change_the_permutation() -> None:
    n = 500
    base = reference_order(n, seed=1, epoch=0)
    others = [reference_order(n, seed=2, epoch=0), reference_order(n, seed=1, epoch=1)]
    for other in others:
        assert sorted(other) == list(range(n))
        assert other != base
        assert sum(a == b for a, b in zip(base, other, strict=True)) < 20
    assert reference_order(n, seed=1, epoch=0) == base  # and it is reproducible


def test_dataset_argument_and_len() -> None:
    s = GlobalShuffleSampler(list(range(10)), seed=0, rank=1, world_size=4)
    assert len(s) == 3
    assert len(list(s)) == 3
    s = GlobalShuffleSampler(10, seed=0, rank=1, world_size=4, drop_last=True)
    assert len(s) == 2


def test_rank_and_world_size_from_torchrun_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    s = GlobalShuffleSampler(30, seed=0)
    assert (s.rank, s.world_size) == (2, 3)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    s = GlobalShuffleSampler(30, seed=0)
    assert (s.rank, s.world_size) == (0, 1)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"seed": 0, "rank": 2, "world_size": 2}, ValueError),
        ({"seed": 0, "rank": 0, "world_size": 0}, ValueError),
        ({"seed": "a", "rank": 0, "world_size": 1}, TypeError),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], error: type[Exception]) -> None:
    with pytest.raises(error):
        GlobalShuffleSampler(10, **kwargs)  # type: ignore[arg-type]


def resume_stream(
    n: int, seed: int, epoch: int, w1: int, k: int, w2: int, drop_last: bool
) -> tuple[int, list[int]]:
    """Consume k samples on each of w1 ranks, save rank 0's state, resume on w2 ranks.

    Returns the saved global position and the concatenated global stream.
    """
    first = []
    state = None
    for r in range(w1):
        s = GlobalShuffleSampler(n, seed=seed, rank=r, world_size=w1, drop_last=drop_last)
        s.set_epoch(epoch)
        first.append(list(itertools.islice(iter(s), k)))
        if r == 0:
            state = s.state_dict()
    assert state is not None
    resumed = []
    for r in range(w2):
        s = GlobalShuffleSampler(n, seed=seed + 1000, rank=r, world_size=w2, drop_last=drop_last)
        s.load_state_dict(state)  # the seed and epoch come from the state
        s.set_epoch(epoch)  # the same epoch keeps the loaded position
        resumed.append(list(s))
    return state["consumed"], interleave(first) + interleave(resumed)


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 400),
    seed=st.integers(-(2**70), 2**70),
    epoch=st.integers(0, 5),
    w1=st.integers(1, 8),
    w2=st.integers(1, 8),
    frac=st.floats(0, 1),
    drop_last=st.booleans(),
)
def test_resume_with_another_world_size_continues_the_global_order(
    n: int, seed: int, epoch: int, w1: int, w2: int, frac: float, drop_last: bool
) -> None:
    per_rank = n // w1 if drop_last else -(-n // w1)
    k = int(frac * per_rank)
    consumed, stream = resume_stream(n, seed, epoch, w1, k, w2, drop_last)
    order = reference_order(n, seed=seed, epoch=epoch)
    if k == per_rank:
        assert consumed == n  # a finished pass finishes the epoch: nothing is left to resume
        assert len(stream) == k * w1
        return
    assert consumed == k * w1
    # Uninterrupted: the global order, then the rest laid out for the new world size.
    remaining = n - consumed
    tail_len = (remaining // w2) * w2 if drop_last else -(-remaining // w2) * w2
    assert stream == order[:consumed] + [order[p % n] for p in range(consumed, consumed + tail_len)]


def test_live_state_counts_what_the_iterator_handed_out() -> None:
    s = GlobalShuffleSampler(10_000, seed=3, rank=1, world_size=4)
    assert s.state_dict()["consumed"] == 0
    it = iter(s)
    for expected in range(1, 700):  # crosses the first chunk boundaries (256, 1024)
        next(it)
        assert s.state_dict()["consumed"] == 4 * expected
    rest = list(it)
    assert len(rest) == 2500 - 699
    assert s.state_dict()["consumed"] == 10_000


def test_state_from_the_training_loop_count_overrides_prefetch() -> None:
    order = reference_order(1000, seed=4)
    s = GlobalShuffleSampler(1000, seed=4, rank=0, world_size=2)
    it = iter(s)
    got = [next(it) for _ in range(100)]  # a DataLoader ran 100 ahead...
    state = s.state_dict(local_consumed=40)  # ...but the loop trained on 40
    assert state["consumed"] == 80
    assert got[:40] == order[0:80:2]
    s2 = GlobalShuffleSampler(1000, seed=4, rank=0, world_size=1)
    s2.load_state_dict(state)
    assert list(s2) == order[80:]
    assert s.state_dict(local_consumed=500)["consumed"] == 1000
    with pytest.raises(ValueError, match="local_consumed"):
        s.state_dict(local_consumed=-1)


def test_epochs_and_pending_resume() -> None:
    s = GlobalShuffleSampler(100, seed=1, rank=0, world_size=1)
    s.load_state_dict({"seed": 1, "epoch": 3, "consumed": 90})
    assert len(s) == 10
    s.set_epoch(3)  # the loop re-selects the loaded epoch: the position is kept
    assert s.state_dict()["consumed"] == 90
    assert list(s) == reference_order(100, seed=1, epoch=3)[90:]
    assert list(s) == reference_order(100, seed=1, epoch=3)  # another pass of the same epoch starts over
    s.set_epoch(4)
    assert list(s) == reference_order(100, seed=1, epoch=4)
    s.load_state_dict({"seed": 1, "epoch": 3, "consumed": 50})
    s.set_epoch(5)  # another epoch drops the loaded position
    assert list(s) == reference_order(100, seed=1, epoch=5)


_U64 = np.uint64


def numpy_feistel(n: int, keys: list[int], positions: np.ndarray) -> np.ndarray:
    """The Feistel network as the sampler computed it in numpy before the C++ kernel: a reference."""
    bits = max(2, (n - 1).bit_length())
    splits, lo = [], bits // 2
    for _ in keys:
        hi = bits - lo
        splits.append((_U64(lo), _U64(hi), _U64((1 << lo) - 1), _U64((1 << hi) - 1)))
        lo = hi

    def network(x: np.ndarray) -> np.ndarray:
        x = x.copy()
        for key, (lo, hi, lo_mask, hi_mask) in zip(keys, splits, strict=True):
            b = x & lo_mask
            x >>= lo
            z = b + _U64(key)
            z ^= z >> _U64(30)
            z *= _U64(0xBF58476D1CE4E5B9)
            z ^= z >> _U64(27)
            z *= _U64(0x94D049BB133111EB)
            z ^= z >> _U64(31)
            x = ((x ^ z) & hi_mask) | (b << hi)
        return x

    with np.errstate(over="ignore"):
        y = network(positions.astype(np.uint64))
        out = np.flatnonzero(y >= _U64(n))
        while out.size:
            walked = network(y[out])
            y[out] = walked
            out = out[walked >= _U64(n)]
    return y.astype(np.int64)


@pytest.mark.parametrize(
    "n", [1, 2, 3, 4, 5, 8, 9, 1000, 1023, 1024, 1025, 2**20 + 7, 2**33 - 1, 2**62 + 1, 2**63]
)
def test_feistel_kernel_matches_the_numpy_reference(n: int) -> None:
    perm = FeistelPermutation(n, f"k{n}".encode())
    rng = np.random.default_rng(n % 1000)
    pos = np.unique(
        np.concatenate([np.arange(min(n, 5000)), rng.integers(0, n, 5000, dtype=np.uint64, endpoint=False)])
    )
    assert (perm(pos) == numpy_feistel(n, perm._keys, pos)).all()


def test_feistel_order_is_the_one_earlier_versions_saved() -> None:
    # Values computed by the numpy implementation: a sampler state saved by an earlier version
    # must resume in the same order.
    golden = {
        (1000, b"smstore"): {0: 244, 1: 33, 333: 150, 500: 367, 999: 682},
        (2**20 + 7, b"big"): {0: 472900, 1: 255422, 349527: 334243, 524291: 382681, 1048582: 239320},
        (2**63, b"max"): {
            0: 4966975606119167299,
            1: 619973553362126598,
            3074457345618258602: 1242962173167382361,
            4611686018427387904: 7225347408981477397,
            9223372036854775807: 4859532752013245019,
        },
    }
    for (n, key), images in golden.items():
        perm = FeistelPermutation(n, key)
        assert perm(np.array(list(images), dtype=np.uint64)).tolist() == list(images.values())


def test_feistel_refuses_positions_outside_its_domain() -> None:
    perm = FeistelPermutation(10, b"k")
    with pytest.raises(IndexError, match="out of range"):
        perm(np.array([3, 10]))
    with pytest.raises(IndexError, match="out of range"):
        perm(np.array([-1]))
    assert perm(np.array([], dtype=np.int64)).tolist() == []
    assert FeistelPermutation(0, b"k")(np.array([], dtype=np.uint64)).tolist() == []


def test_set_epoch_mid_pass_detaches_the_old_iterator() -> None:
    s = GlobalShuffleSampler(100, seed=1, rank=0, world_size=1)
    it = iter(s)
    first = [next(it) for _ in range(10)]
    s.set_epoch(1)
    assert s.state_dict() == {**s.state_dict(), "epoch": 1, "consumed": 0}
    assert first + list(it) == reference_order(100, seed=1, epoch=0)  # the old pass keeps its own epoch
    assert s.state_dict()["consumed"] == 0


@pytest.mark.parametrize(
    "state",
    [
        {"seed": 0, "epoch": 0, "consumed": 5, "num_records": 11},
        {"seed": 0, "epoch": 0, "consumed": 11},
        {"seed": 0, "epoch": 0, "consumed": -1},
        {"seed": 0, "consumed": 1},
        {"seed": "x", "epoch": 0, "consumed": 1},
    ],
)
def test_load_state_dict_rejects_bad_states(state: dict[str, object]) -> None:
    s = GlobalShuffleSampler(10, seed=0, rank=0, world_size=1)
    with pytest.raises(ValueError, match=r"records|consumed|state"):
        s.load_state_dict(state)


def test_resume_near_the_end_of_a_billion_records_is_o1() -> None:
    n = 10**9
    s = GlobalShuffleSampler(n, seed=11, rank=3, world_size=8)
    it = iter(s)
    next(it)
    s.load_state_dict({"seed": 11, "epoch": 2, "consumed": n - 20, "num_records": n})
    start = time.process_time()
    tail = list(s)
    # Generous: iterating the skipped 1e9 positions would take minutes, not milliseconds.
    assert time.process_time() - start < 2.0
    expected = FeistelPermutation(n, f"smstore-global-shuffle-v1:11:2:{n}".encode())(
        np.arange(n - 20 + 3, n, 8, dtype=np.uint64)
    )
    assert tail[: len(expected)] == expected.tolist()
    assert len(tail) == 3  # positions n-17, n-9, n-1


def loader_batches(loader: object, k: int | None = None) -> list[list[int]]:
    out = []
    for i, batch in enumerate(loader):  # type: ignore[call-overload]
        if k is not None and i == k:
            break
        out.append(batch.tolist())
    return out


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_resume_from_the_loop_count_with_another_world_size(num_workers: int) -> None:
    from torch.utils.data import DataLoader

    n, batch, k = 1000, 16, 7
    order = reference_order(n, seed=21, epoch=1)
    first = []
    state = None
    for r in range(2):
        s = GlobalShuffleSampler(n, seed=21, rank=r, world_size=2)
        s.set_epoch(1)
        loader = DataLoader(range(n), batch_size=batch, sampler=s, num_workers=num_workers)
        got = loader_batches(loader, k)
        first.append([x for b in got for x in b])
        if r == 0:
            # The workers prefetched batches beyond k: the sampler's own position would be ahead of
            # the loop, so it refuses to answer; the loop's count is what was trained on.
            if num_workers:
                with pytest.raises(RuntimeError, match="ahead of the training loop"):
                    s.state_dict()
            state = s.state_dict(local_consumed=k * batch)
    assert state is not None
    assert state["consumed"] == 2 * k * batch
    rest = []
    for r in range(3):
        s = GlobalShuffleSampler(n, seed=0, rank=r, world_size=3)
        s.load_state_dict(state)
        loader = DataLoader(range(n), batch_size=batch, sampler=s, num_workers=num_workers)
        rest.append([x for b in loader_batches(loader) for x in b])
    consumed = state["consumed"]
    tail = -(-(n - consumed) // 3) * 3
    assert interleave(first) + interleave(rest) == order[:consumed] + [
        order[p % n] for p in range(consumed, consumed + tail)
    ]


# torchdata 0.11 calls torch.set_vital, deprecated in recent torch.
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_carries_the_sampler_state(num_workers: int) -> None:
    sdl = pytest.importorskip("torchdata.stateful_dataloader")

    n, batch, k = 600, 10, 9
    order = reference_order(n, seed=8)
    first, states = [], []
    for r in range(2):
        s = GlobalShuffleSampler(n, seed=8, rank=r, world_size=2)
        loader = sdl.StatefulDataLoader(range(n), batch_size=batch, sampler=s, num_workers=num_workers)
        it = iter(loader)
        got = [next(it).tolist() for _ in range(k)]
        first.append([x for b in got for x in b])
        states.append(loader.state_dict())
        del it
    # Every rank resumes from rank 0's loader state, here with another world size: the sampler
    # state inside it is the global position, and each new sampler keeps its own rank.
    rest = []
    for r in range(4):
        s = GlobalShuffleSampler(n, seed=8, rank=r, world_size=4)
        loader = sdl.StatefulDataLoader(range(n), batch_size=batch, sampler=s, num_workers=num_workers)
        loader.load_state_dict(states[0])
        rest.append([x for b in loader_batches(loader) for x in b])
    consumed = 2 * k * batch
    assert interleave(first) + interleave(rest) == order[:consumed] + order[consumed:]


# ---- where a plain DataLoader's pass stands: ResumableLoader -----------------------------------


def flat(batches: list[list[int]]) -> list[int]:
    return [x for b in batches for x in b]


def resumed_order(order: list[int], consumed: int, world: int) -> list[int]:
    """The global order from `consumed` as `world` ranks read it (the padding wraps)."""
    n = len(order)
    return [order[p % n] for p in range(consumed, consumed + -(-(n - consumed) // world) * world)]


@pytest.mark.parametrize(("num_workers", "prefetch_factor"), [(0, None), (2, 4)])
def test_resumable_loader_saves_what_the_loop_received(num_workers: int, prefetch_factor: int | None) -> None:
    from torch.utils.data import DataLoader

    from smstore import ResumableLoader

    n, batch, k = 1000, 16, 7
    order = reference_order(n, seed=21, epoch=1)

    def loader(sampler: GlobalShuffleSampler) -> ResumableLoader[object]:
        dl = DataLoader(
            range(n),
            batch_size=batch,
            sampler=sampler,
            num_workers=num_workers,
            prefetch_factor=prefetch_factor,
        )
        return ResumableLoader(dl)

    first, state = [], None
    for r in range(2):
        s = GlobalShuffleSampler(n, seed=21, rank=r, world_size=2)
        rl = loader(s)
        rl.set_epoch(1)
        got = []
        for i, b in enumerate(rl):  # the workers draw batches beyond the k-th; the loop stops there
            got.append(b.tolist())
            if i == k - 1:
                break
        first.append(flat(got))
        if r == 0:
            state = rl.state_dict()  # after the loop let go of its iterator: the count stands
    assert state is not None
    assert (state["epoch"], state["consumed"]) == (1, 2 * k * batch)
    rest = []
    for r in range(3):
        rl = loader(GlobalShuffleSampler(n, seed=0, rank=r, world_size=3))
        rl.load_state_dict(state)
        rl.set_epoch(1)  # the loop re-selects the loaded epoch: the position is kept
        rest.append(flat([b.tolist() for b in rl]))
        assert rl.state_dict()["consumed"] == n  # the whole pass was received: the epoch is done
    consumed = state["consumed"]
    assert interleave(first) + interleave(rest) == order[:consumed] + resumed_order(order, consumed, 3)


def test_resumable_loader_with_drop_last_and_a_batch_sampler() -> None:
    from torch.utils.data import BatchSampler, DataLoader

    from smstore import ResumableLoader

    n, batch = 100, 16  # 50 a rank: 3 full batches, 2 samples dropped
    s = GlobalShuffleSampler(n, seed=2, rank=1, world_size=2)
    rl = ResumableLoader(DataLoader(range(n), batch_sampler=BatchSampler(s, batch, drop_last=True)))
    assert (rl.batch_size, rl.sampler, len(rl)) == (batch, s, 3)
    batches = [b.tolist() for b in rl]
    assert flat(batches) == reference_order(n, seed=2)[1:96:2]
    assert rl.state_dict()["consumed"] == n  # the pass was received whole: the dropped tail too


def test_resumable_loader_refuses_what_it_cannot_count() -> None:
    from torch.utils.data import DataLoader, SequentialSampler

    from smstore import ResumableLoader

    s = GlobalShuffleSampler(100, seed=0, rank=0, world_size=1)
    with pytest.raises(TypeError, match="no GlobalShuffleSampler"):
        ResumableLoader(DataLoader(range(100), sampler=SequentialSampler(range(100))))
    with pytest.raises(TypeError, match="StatefulDataLoader"):
        ResumableLoader(DataLoader(range(100), batch_sampler=[[0, 1], [2]]), sampler=s)
    with pytest.raises(ValueError, match="in_order"):
        ResumableLoader(DataLoader(range(100), batch_size=4, sampler=s, num_workers=2, in_order=False))
    empty = GlobalShuffleSampler(0, seed=0, rank=0, world_size=1)  # given, not found: even when empty
    assert ResumableLoader(DataLoader(range(0), batch_size=4), sampler=empty).sampler is empty


def test_state_dict_refuses_to_answer_ahead_of_a_prefetching_loader() -> None:
    from torch.utils.data import DataLoader

    n, batch, k = 400, 8, 3
    s = GlobalShuffleSampler(n, seed=5, rank=0, world_size=2)
    loader = DataLoader(range(n), batch_size=batch, sampler=s, num_workers=2, prefetch_factor=2)
    for i, _ in enumerate(loader):
        if i == k - 1:
            break
    assert s._live_local() > k * batch  # what the bare position would have said
    with pytest.raises(
        RuntimeError, match=r"ahead of the training loop.*ResumableLoader.*StatefulDataLoader"
    ):
        s.state_dict()
    assert s.state_dict(local_consumed=k * batch)["consumed"] == 2 * k * batch
    for _ in loader:  # a whole pass: the loop may still be behind the sampler, so it still refuses
        pass
    with pytest.raises(RuntimeError, match="ahead"):
        s.state_dict()
    s.set_epoch(1)  # no pass under way: the position is the start of epoch 1
    assert (s.state_dict()["epoch"], s.state_dict()["consumed"]) == (1, 0)
    # A single-process DataLoader draws each batch as the loop asks: its position is exact.
    for i, _ in enumerate(DataLoader(range(n), batch_size=batch, sampler=s)):
        if i == k - 1:
            break
    assert s.state_dict()["consumed"] == 2 * k * batch


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_state_dict_under_a_stateful_dataloader_with_workers() -> None:
    sdl = pytest.importorskip("torchdata.stateful_dataloader")

    n, batch, k = 400, 8, 3
    s = GlobalShuffleSampler(n, seed=5, rank=1, world_size=2)
    loader = sdl.StatefulDataLoader(range(n), batch_size=batch, sampler=s, num_workers=2)
    for i, _ in enumerate(loader):
        if i == k - 1:
            break
    with pytest.raises(RuntimeError, match="ahead"):  # the sampler's own answer would be ahead...
        s.state_dict()
    state = loader.state_dict()  # ...but the loader's snapshot (it asked the sampler as it drew) is not
    s2 = GlobalShuffleSampler(n, seed=5, rank=0, world_size=1)
    loader = sdl.StatefulDataLoader(range(n), batch_size=batch, sampler=s2, num_workers=2)
    loader.load_state_dict(state)
    assert flat([b.tolist() for b in loader]) == reference_order(n, seed=5)[2 * k * batch :]


# ---- training frameworks: what they do to a sampler that is split already ----------------------


def accelerate_loader(
    sampler: GlobalShuffleSampler,
    n: int,
    rank: int,
    world: int,
    batch_sampler: bool = False,
    **kwargs: object,
) -> object:
    """A DataLoader over `sampler` as accelerate's prepare() makes it for process `rank` of `world`."""
    data_loader = pytest.importorskip("accelerate.data_loader")
    from torch.utils.data import BatchSampler, DataLoader

    if batch_sampler:
        loader = DataLoader(range(n), batch_sampler=BatchSampler(sampler, 4, drop_last=False))
    else:
        loader = DataLoader(range(n), batch_size=4, sampler=sampler)
    options = {"put_on_device": False, **kwargs}
    return data_loader.prepare_data_loader(loader, num_processes=world, process_index=rank, **options)


def test_the_sampler_is_a_distributed_sampler() -> None:
    from torch.utils.data.distributed import DistributedSampler

    s = GlobalShuffleSampler(10, seed=0, rank=1, world_size=3)
    # What Lightning and Fabric check before they split a sampler across ranks themselves.
    assert isinstance(s, DistributedSampler)
    assert (s.num_replicas, s.rank, s.shuffle) == (3, 1, True)


@pytest.mark.parametrize("batch_sampler", [False, True])
def test_accelerate_prepare_keeps_each_rank_its_share(batch_sampler: bool) -> None:
    n = 90  # 45 a rank: 11 full batches of 4 and one of 1
    for r in range(2):
        s = GlobalShuffleSampler(n, seed=0, rank=r, world_size=2)
        loader = accelerate_loader(s, n, r, 2, batch_sampler)
        assert len(loader) == 12  # type: ignore[arg-type]  # asked before the first batch (HF Trainer does)
        assert flat([b.tolist() for b in loader]) == rank_streams(n, 0, 2)[r]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"split_batches": True}, "split_batches"),
        ({"dispatch_batches": True, "put_on_device": True}, "dispatch_batches"),
        ({"num_processes": 4}, "process 1 of 4"),
    ],
)
def test_accelerate_splits_the_sampler_cannot_undo_raise(kwargs: dict[str, object], match: str) -> None:
    s = GlobalShuffleSampler(90, seed=0, rank=1, world_size=2)
    world = int(kwargs.pop("num_processes", 2))  # type: ignore[call-overload]
    loader = accelerate_loader(s, 90, 1, world, **kwargs)
    with pytest.raises(ValueError, match=match):
        next(iter(loader))  # type: ignore[call-overload]


def test_accelerate_splits_a_world_size_one_sampler_by_batches() -> None:
    n = 96
    order = reference_order(n, seed=0)
    for r in range(2):
        loader = accelerate_loader(GlobalShuffleSampler(n, seed=0, rank=0, world_size=1), n, r, 2)
        # accelerate's own split of the global order: batches r, r + 2, ...
        assert [b.tolist() for b in loader] == [order[i : i + 4] for i in range(4 * r, n, 8)]  # type: ignore[attr-defined]


def test_accelerate_skip_first_batches_resumes_the_epoch_it_was_given() -> None:
    # The HF Trainer's resume: set_epoch on the prepared loader, then skip_first_batches, whose
    # loader nests the sampler one level deeper than accelerate's set_epoch reaches.
    data_loader = pytest.importorskip("accelerate.data_loader")

    n = 90
    for r in range(2):
        loader = accelerate_loader(GlobalShuffleSampler(n, seed=0, rank=r, world_size=2), n, r, 2)
        loader.set_epoch(1)  # type: ignore[attr-defined]
        skipped = data_loader.skip_first_batches(loader, 3)
        assert flat([b.tolist() for b in skipped]) == rank_streams(n, 0, 2, epoch=1)[r][12:]


def test_accelerate_loader_refuses_to_restart_a_loaded_epoch() -> None:
    n = 90
    state = {"seed": 0, "epoch": 1, "consumed": 24, "num_records": n}
    s = GlobalShuffleSampler(n, seed=0, rank=0, world_size=1)
    loader = accelerate_loader(s, n, 0, 1)
    s.load_state_dict(state)
    # A new prepared loader counts its passes from 0 and sets that epoch as a pass starts.
    with pytest.raises(ValueError, match=r"set_epoch\(1\) on the prepared DataLoader"):
        next(iter(loader))  # type: ignore[call-overload]
    s.load_state_dict(state)
    loader.set_epoch(1)  # type: ignore[attr-defined]
    assert flat([b.tolist() for b in loader]) == reference_order(n, seed=0, epoch=1)[24:]  # type: ignore[attr-defined]
    s.load_state_dict(state)
    s.set_epoch(2)  # asked for by name, another epoch drops the loaded position, as anywhere
    assert s.state_dict()["consumed"] == 0


def test_lightning_refuses_to_split_the_sampler_again() -> None:
    distributed = pytest.importorskip("lightning.fabric.utilities.distributed")
    from torch.utils.data import Sampler

    class Wrapper(Sampler[int]):  # a user's sampler around ours: Lightning would wrap it to split it
        def __init__(self, inner: GlobalShuffleSampler) -> None:
            self.inner = inner

        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(self.inner)

        def __len__(self) -> int:
            return len(self.inner)

    s = GlobalShuffleSampler(90, seed=0, rank=0, world_size=2)
    with pytest.raises(ValueError, match="use_distributed_sampler=False"):
        distributed.DistributedSamplerWrapper(Wrapper(s), num_replicas=2, rank=0)


def _rank_of_a_sampler_made_before_init(rank: int, store: str, out: object) -> None:
    import torch.distributed as dist

    s = GlobalShuffleSampler(90, seed=0)  # as in a LightningDataModule's __init__: no group yet
    before = (s.rank, s.world_size)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        out.put((rank, before, list(s), (s.rank, s.world_size)))  # type: ignore[attr-defined]
        # Neither rank tears the group down while the other may still be connecting to it
        # ("Gloo connectFullMesh failed ... Connection closed by peer", seen under load).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_sampler_made_before_the_process_group_takes_its_rank_from_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import multiprocessing

    # Lightning's launcher sets WORLD_SIZE but no RANK before the group exists.
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_of_a_sampler_made_before_init, args=(r, str(tmp_path / "store"), out))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        results = sorted(out.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in procs] == [0, 0]
    streams = rank_streams(90, 0, 2)
    for rank, before, got, after in results:
        assert before == (0, 1)
        assert (got, after) == (streams[rank], (rank, 2))


# ---- a state names its order: another kind over the same records is refused (issue 36, L8) ----

ORDER_SHARDS = [30, 25, 0, 40, 35, 20, 30]  # 180 records
ORDER_LENGTHS, ORDER_WEIGHTS = [180, 120], [0.6, 0.4]


def order_samplers() -> dict[str, GlobalShuffleSampler]:
    """One sampler of every kind of order, each over the same number of positions as another kind."""
    from smstore.sampling import (
        BlockWindowSampler,
        Mixture,
        MixtureSampler,
        WindowedMixtureSampler,
        WindowedShuffleSampler,
    )

    mix = Mixture(ORDER_LENGTHS, ORDER_WEIGHTS)
    n = sum(ORDER_SHARDS)
    one = {"seed": 3, "rank": 0, "world_size": 1}
    return {
        "global": GlobalShuffleSampler(n, **one),
        "windowed": WindowedShuffleSampler(ORDER_SHARDS, window=2, residency=False, **one),
        "blocks": BlockWindowSampler(ORDER_SHARDS, block=10, spread=2, residency=False, **one),
        "global over the mixture": GlobalShuffleSampler(mix.num_samples, **one),
        "mixture": MixtureSampler(mix, **one),
        "windowed mixture": WindowedMixtureSampler(
            mix, window=2, shard_sizes=[ORDER_SHARDS, None], residency=False, **one
        ),
    }


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [
        ("global", "windowed"),
        ("windowed", "global"),
        ("blocks", "global"),
        ("global", "blocks"),
        ("blocks", "windowed"),
        ("windowed", "blocks"),
        ("windowed mixture", "mixture"),
        ("mixture", "windowed mixture"),
        ("global over the mixture", "mixture"),
        ("mixture", "global over the mixture"),
        ("windowed mixture", "global over the mixture"),
    ],
)
@pytest.mark.parametrize("legacy", [False, True], ids=["", "saved-before-states-named-their-order"])
def test_a_state_of_another_kind_of_order_is_refused(saved: str, loaded: str, legacy: bool) -> None:
    """The same records (or mixture positions), seed and epoch, another order: resumed, the
    position would repeat half the epoch and skip the other half."""
    samplers = order_samplers()
    source, target = samplers[saved], samplers[loaded]
    assert source.num_records == target.num_records
    it = iter(source)
    for _ in range(source.num_records // 2):
        next(it)
    state = source.state_dict()
    assert state["consumed"] == source.num_records // 2
    if legacy:  # a state of format 1 saved before the kind was named is told by the entries its kind saved
        state = {k: v for k, v in state.items() if k != "order"} | source.spec.legacy() | {"version": 1}
    with pytest.raises(ValueError, match="another order cannot be resumed") as err:
        target.load_state_dict(state)
    assert type(target).__name__ in str(err.value)
    assert target.state_dict()["consumed"] == 0  # nothing was taken from the refused state


@pytest.mark.parametrize("kind", ["global", "windowed", "blocks", "mixture", "windowed mixture"])
def test_a_state_of_the_same_order_resumes_after_a_json_round_trip(kind: str) -> None:
    import json

    saved, resumed = order_samplers()[kind], order_samplers()[kind]
    it = iter(saved)
    for _ in range(50):
        next(it)
    state = json.loads(json.dumps(saved.state_dict()))
    resumed.load_state_dict(state)
    assert list(resumed) == list(it)
    legacy = (
        {k: v for k, v in saved.state_dict().items() if k != "order"} | saved.spec.legacy() | {"version": 1}
    )
    order_samplers()[kind].load_state_dict(legacy)  # a state of format 1 saved before it named its order
    named = legacy | {"order": saved.spec.kind}
    order_samplers()[kind].load_state_dict(named)  # one of format 1 that named it
