"""Mixtures: exact per-epoch multisets, the proportion bound, world-size independence, O(1) resume."""

from __future__ import annotations

import itertools
from collections import Counter
from functools import partial

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smstore import MixtureError, _core
from smstore.sampling import (
    GlobalShuffleSampler,
    Mixture,
    MixtureDataset,
    MixtureOrder,
    MixtureSampler,
    ResumableLoader,
    from_megatron_blend,
    parse_megatron_blend,
    round_keys,
)

from .smstore_testlib import RESUME_PLAN, interleave, loader_batches, stateful_resume, whole_order

epoch_order = partial(whole_order, MixtureSampler)


def max_deviation(mix: Mixture, n: int) -> np.ndarray:
    """max over prefixes [0, k), k <= n, of |count_s(k) - k w_s|, per source (from locate)."""
    src, _ = mix.locate(np.arange(n, dtype=np.int64))
    k = np.arange(1, n + 1, dtype=np.float64)
    out = []
    for s, w in enumerate(mix.weights):
        c = np.cumsum(src == s)
        out.append(float(np.abs(c - k * (w.numerator / w.denominator)).max()))
    return np.array(out)


# ---- the order: exact per epoch -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("lengths", "weights", "stop"),
    [
        ([10, 20, 5], [0.5, 0.3, 0.2], "all_exhausted"),
        ([10, 20, 5], [0.5, 0.3, 0.2], "first_exhausted"),
        ([7, 300, 41, 1], [1, 1, 1, 1], "all_exhausted"),
        ([7, 300, 41, 1], [3, 0.5, 2, 0.01], "first_exhausted"),
        ([100, 50], [0.7, 0.3], 1234),
        ([1], [1.0], 17),
    ],
)
def test_every_index_drawn_as_often_as_its_policy_says(
    lengths: list[int], weights: list[float], stop: str | int
) -> None:
    mix = Mixture(lengths, weights, stop=stop)
    n = mix.num_samples
    counts = mix.counts(n)
    assert sum(counts) == n
    if stop == "all_exhausted":
        assert all(c >= m for c, m in zip(counts, lengths, strict=True))
        assert any(c < m for c, m in zip(mix.counts(n - 1), lengths, strict=True))  # the fewest positions
    elif stop == "first_exhausted":
        assert all(c <= m for c, m in zip(counts, lengths, strict=True))
        assert any(c > m for c, m in zip(mix.counts(n + 1), lengths, strict=True))  # the most positions
    order = epoch_order(mix, seed=3)
    assert len(order) == n
    ds = MixtureDataset([list(range(m)) for m in lengths], weights, stop=stop)
    seen = Counter(ds.locate(i) for i in order)
    for s, (m, c) in enumerate(zip(lengths, counts, strict=True)):
        q, r = divmod(c, m)
        times = Counter(seen[(s, j)] for j in range(m))
        # Each source's draws are q whole permutations of it plus r distinct records of the next.
        assert times == Counter({q + 1: r, q: m - r} if r else {q: m})


def test_draw_numbers_follow_each_source_in_order_and_count_matches_locate() -> None:
    mix = Mixture([5, 9, 13], [2, 3, 4], stop=500)
    src, k = mix.locate(np.arange(500))
    for s in range(3):
        assert k[src == s].tolist() == list(range(int((src == s).sum())))
    for n in [0, 1, 2, 77, 499, 500, 10**15 + 3]:
        counts = mix.counts(n)
        assert sum(counts) == n
        assert counts == [mix.count(s, n) for s in range(3)]
        if n <= 500:
            assert counts == [int((src[:n] == s).sum()) for s in range(3)]


def test_upsampled_source_starts_a_new_permutation_each_pass() -> None:
    mix = Mixture([4, 100], [1, 1], stop="all_exhausted")  # the small source is drawn 25 times over
    ds = MixtureDataset([list(range(4)), list(range(100))], [1, 1])
    order = [ds.locate(i) for i in epoch_order(mix, seed=5)]
    small = [j for s, j in order if s == 0]
    passes = [tuple(small[i : i + 4]) for i in range(0, len(small), 4)]
    assert all(sorted(p) == [0, 1, 2, 3] for p in passes)
    assert len(set(passes)) > 1  # not the same permutation every pass


def test_seed_and_epoch_change_the_order_but_not_the_sources() -> None:
    mix = Mixture([50, 60], [0.4, 0.6])
    a, b, c = epoch_order(mix, seed=1), epoch_order(mix, seed=2), epoch_order(mix, seed=1, epoch=1)
    assert a != b
    assert a != c
    src = [int(i >= 50) for i in a]
    assert src == [int(i >= 50) for i in b] == [int(i >= 50) for i in c]  # the blend is the rule's


# ---- the proportion bound -----------------------------------------------------------------------


def test_two_sources_within_half_and_three_within_one() -> None:
    rng = np.random.default_rng(0)
    for _ in range(5):
        two = Mixture([10**9] * 2, list(rng.random(2) + 1e-3), stop=10**5)
        assert max(two.deviation_bounds()) <= 0.5
        assert max_deviation(two, 10**5).max() <= 0.5
        three = Mixture([10**9] * 3, list(rng.random(3) + 1e-3), stop=10**5)
        assert max(three.deviation_bounds()) < 1
        assert max_deviation(three, 10**5).max() < 1


@pytest.mark.parametrize("sources", [5, 20, 100])
def test_proportions_stay_within_the_bound_over_a_million_positions(sources: int) -> None:
    rng = np.random.default_rng(sources)
    weights = list(rng.random(sources) ** 3 + 1e-4)
    mix = Mixture([10**9] * sources, weights, stop=10**6)
    bounds = np.array(mix.deviation_bounds())
    dev = max_deviation(mix, 10**6)
    assert (dev <= bounds + 1e-9).all()
    assert bounds.max() < 2  # it does not grow with the number of positions or of sources


@settings(max_examples=150, deadline=None)
@given(
    weights=st.lists(st.integers(1, 1000), min_size=1, max_size=12),
    n=st.integers(0, 3000),
    far=st.integers(0, 2**50),
)
def test_counts_bound_and_monotonicity_property(weights: list[int], n: int, far: int) -> None:
    mix = Mixture([10**12] * len(weights), weights, stop=n)
    bounds = mix.deviation_bounds()
    src, _ = mix.locate(np.arange(n, dtype=np.int64))
    running = [0] * len(weights)
    for p in range(n):
        running[int(src[p])] += 1
        for s, w in enumerate(mix.weights):
            assert abs(running[s] - (p + 1) * w) <= bounds[s] + 1e-12
    for m in (far, far + 1):
        counts = mix.counts(m)
        assert sum(counts) == m
        assert all(abs(c - m * w) <= b + 1e-12 for c, w, b in zip(counts, mix.weights, bounds, strict=True))
    step = [b - a for a, b in zip(mix.counts(far), mix.counts(far + 1), strict=True)]
    assert sorted(step) == [0] * (len(weights) - 1) + [1]  # exactly one source takes each position
    got_src, got_k = mix.locate(np.array([far]))
    assert step[int(got_src[0])] == 1
    assert int(got_k[0]) == mix.count(int(got_src[0]), far)


def test_decimal_weights_are_exact_ratios() -> None:
    mix = Mixture([10**9, 10**9], [0.7, 0.3], stop=10)
    assert mix.shares == [7, 3]
    assert mix.counts(10 * 123457) == [7 * 123457, 3 * 123457]


# ---- the C++ kernel against the numpy reference -------------------------------------------------


def reference_locate(mix: Mixture, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The numpy descent the C++ kernel replaced: one divmod pair a level, in int64."""
    p = np.asarray(positions, dtype=np.int64).ravel()
    src = np.zeros(p.size, dtype=np.int64)
    m = p.copy()
    if mix.root < 0:
        src[:] = -mix.root - 1
        return src, m
    a_, q_, h_, l_, r_ = (
        np.array(x, dtype=np.int64) for x in (mix._a, mix._q, mix._h, mix._left, mix._right)
    )
    node = np.full(p.size, mix.root, dtype=np.int64)
    active = np.arange(p.size)
    while active.size:
        nd, mm = node[active], m[active]
        a, q, h = a_[nd], q_[nd], h_[nd]
        d, r = np.divmod(mm, q)
        y, t = np.divmod(r * a + h, q)
        before = d * a + y
        goes_left = t >= q - a
        child = np.where(goes_left, l_[nd], r_[nd])
        m[active] = np.where(goes_left, before, mm - before)
        leaf = child < 0
        src[active[leaf]] = -child[leaf] - 1
        inner = ~leaf
        node[active[inner]] = child[inner]
        active = active[inner]
    return src, m


def reference_pairs(
    mix: Mixture, seed: int, epoch: int, positions: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(source, record within it): the reference descent, then one Feistel call per source pass."""
    src, k = reference_locate(mix, positions)
    lengths = np.array(mix.lengths, dtype=np.int64)
    passes, within = np.divmod(k, lengths[src])
    out = np.empty_like(k)
    for s, e in {(int(s), int(e)) for s, e in zip(src, passes, strict=True)}:
        at = (src == s) & (passes == e)
        keys = round_keys(f"smstore-mixture-v1:{seed}:{epoch}:{s}:{e}:{mix.lengths[s]}".encode())
        out[at] = _core.feistel_permute(within[at].astype(np.uint64), mix.lengths[s], keys)
    return src, out


TOP = 2**63 - 1  # the largest position (an epoch holds at most 2**63)


def extreme_positions(mix: Mixture, rng: np.random.Generator, count: int) -> np.ndarray:
    """Random positions below 2**63, the ends, and multiples of every node's share (+-1) near both."""
    picks = [0, 1, 2, TOP, TOP - 1, TOP - 2, 2**62, 2**62 - 1, 2**32, 2**32 - 1]
    for q in mix._q:
        top = TOP // q * q
        picks += [q - 1, q, q + 1, top - 1, top, min(top + 1, TOP)]
    picks += rng.integers(0, TOP, size=count, dtype=np.int64, endpoint=True).tolist()
    picks += rng.integers(0, 10**6, size=count, dtype=np.int64).tolist()
    return np.array(picks, dtype=np.int64)


@settings(max_examples=60, deadline=None)
@given(
    weights=st.lists(
        st.one_of(st.integers(1, 2**31), st.floats(1e-6, 1e6, allow_nan=False, allow_infinity=False)),
        min_size=1,
        max_size=40,
    ),
    seed=st.integers(0, 2**64),
    draw=st.integers(0, 2**32 - 1),
)
def test_kernel_matches_the_numpy_reference_on_random_trees(
    weights: list[float], seed: int, draw: int
) -> None:
    rng = np.random.default_rng(draw)
    lengths = [int(x) for x in rng.integers(1, 2**57, size=len(weights))]  # their sum stays below 2**63
    mix = Mixture(lengths, weights, stop=2**63)
    assert mix.total <= 2**31
    p = extreme_positions(mix, rng, 200)
    src, k = mix.locate(p)
    ref_src, ref_k = reference_locate(mix, p)
    assert src.tolist() == ref_src.tolist()
    assert k.tolist() == ref_k.tolist()
    # And against exact (unbounded) integer arithmetic: k is the count of the source before p.
    for i in rng.choice(p.size, size=20, replace=False):
        assert mix.count(int(src[i]), int(p[i])) == int(k[i])
        assert mix.count(int(src[i]), int(p[i]) + 1) == int(k[i]) + 1
    order = MixtureOrder(mix, seed, 3)
    got_src, got_local = order.pairs(p)
    want_src, want_local = reference_pairs(mix, seed, 3, p)
    assert got_src.tolist() == want_src.tolist()
    assert got_local.tolist() == want_local.tolist()
    offsets = np.array(mix.offsets[:-1], dtype=np.int64)
    assert order(p).tolist() == (offsets[want_src] + want_local).tolist()


@pytest.mark.parametrize(
    ("weights", "lengths"),
    [
        ([2**31 - 1, 1], [2**62, 2**62]),  # the largest share total, so the largest remainder times share
        ([1, 2**31 - 1], [3, 2**62]),  # a source of 3 records drawn ~2**32 times over at the end
        ([2**30, 2**30 - 1, 1], [1, 2, 2**62]),
        ([1.0] * 100, [10**9] * 100),
        ([1 / 3, 2**-40, 0.1234567891234], [7, 2**61, 5]),  # rounded to a total of 2**30
        ([5.0], [2**63 - 1]),  # one source: no tree
    ],
)
def test_kernel_matches_the_reference_at_the_extremes(weights: list[float], lengths: list[int]) -> None:
    mix = Mixture(lengths, weights, stop=2**63)
    p = extreme_positions(mix, np.random.default_rng(0), 2000)
    src, k = mix.locate(p)
    ref_src, ref_k = reference_locate(mix, p)
    assert (src == ref_src).all()
    assert (k == ref_k).all()
    for i in range(0, p.size, 37):
        assert mix.count(int(src[i]), int(p[i])) == int(k[i])
    order = MixtureOrder(mix, 11, 0)
    for got, want in zip(order.pairs(p), reference_pairs(mix, 11, 0, p), strict=True):
        assert (got == want).all()
    # The strided form (what the sampler draws) is the array form at the same positions, wrapped.
    n = 2**63
    first, step = n - 5 * 3 + 1, 3
    strided = order.strided(first, step, 8, n)
    wrapped = np.array([(first + i * step) % n for i in range(8)], dtype=np.uint64)
    assert strided == order(wrapped).tolist()


@settings(max_examples=200, deadline=None)
@given(
    q=st.integers(2, 2**31),
    data=st.data(),
)
def test_one_split_is_exact_for_every_share_and_position(q: int, data: st.DataObject) -> None:
    # The kernel divides by one multiply (a magic reciprocal); check it against Python's integers
    # where division errors show: multiples of q, +-1, and the top of the range.
    a = data.draw(st.integers(1, q - 1))
    top = TOP // q * q
    m = np.array(
        sorted(
            {
                0,
                1,
                q - 1,
                q,
                q + 1,
                top - q,
                top - 1,
                top,
                min(top + 1, TOP),
                TOP,
                data.draw(st.integers(0, TOP)),
            }
        ),
        dtype=np.int64,
    )
    tree = _core.MixtureTree([a], [q], [-1], [-2], 0, 2)
    src, before = tree.locate(m.astype(np.uint64))
    h = (q - 1) // 2
    for i, x in enumerate(m.tolist()):
        lo, hi = (x * a + h) // q, ((x + 1) * a + h) // q
        assert (int(src[i]), int(before[i])) == ((0, lo) if hi > lo else (1, x - lo))


def test_kernel_refuses_what_it_cannot_compute_exactly() -> None:
    with pytest.raises(ValueError, match="2\\*\\*31"):
        _core.MixtureTree([1], [2**31 + 1], [-1], [-2], 0, 2)
    with pytest.raises(ValueError, match="0 < a < q"):
        _core.MixtureTree([3], [3], [-1], [-2], 0, 2)
    with pytest.raises(ValueError, match="out of range"):
        _core.MixtureTree([1], [2], [0], [-2], 0, 2)  # a node that is its own child
    with pytest.raises(ValueError, match="out of range"):
        _core.MixtureTree([1], [2], [-1], [-3], 0, 2)  # a source that does not exist
    tree = _core.MixtureTree([1], [2], [-1], [-2], 0, 2)
    with pytest.raises(IndexError, match="2\\*\\*63"):
        tree.locate(np.array([2**63], dtype=np.uint64))
    with pytest.raises(ValueError, match="below 2\\*\\*63"):
        _core.MixtureOrder(tree, [2**62, 2**62 + 1], [0, 2**62], 10, lambda s, e: [1, 2])
    mix = Mixture([3, 4], [1, 1], stop=10)
    with pytest.raises(IndexError, match="out of range"):
        MixtureOrder(mix, 0, 0)(np.array([10]))
    with pytest.raises(IndexError, match="negative"):
        mix.locate(np.array([-1]))


def test_kernel_is_safe_from_several_threads_without_the_gil() -> None:
    from concurrent.futures import ThreadPoolExecutor

    mix = Mixture([5, 7, 1000, 3] * 5, list(range(1, 21)), stop=10**7)
    order = MixtureOrder(mix, 2, 0)  # one order (one cache of source passes) shared by the threads
    rng = np.random.default_rng(4)
    batches = [rng.integers(0, 10**7, size=20000) for _ in range(8)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(order, batches))
    for p, g in zip(batches, got, strict=True):
        src, local = reference_pairs(mix, 2, 0, p)
        assert g.tolist() == (np.array(mix.offsets[:-1])[src] + local).tolist()


def test_a_pickled_sampler_and_dataset_give_the_same_order() -> None:
    import pickle

    ds = MixtureDataset([list(range(30)), list(range(50))], [0.3, 0.7])
    s = MixtureSampler(ds, seed=6, rank=1, world_size=2)
    before = list(s)
    copy = pickle.loads(pickle.dumps(s))
    assert list(copy) == before
    ds2 = pickle.loads(pickle.dumps(ds))
    assert [ds2[i] for i in before] == [ds[i] for i in before]


# ---- ranks and resume ---------------------------------------------------------------------------


def rank_streams(mix: Mixture, seed: int, world: int, *, drop_last: bool = False) -> list[list[int]]:
    return [
        list(MixtureSampler(mix, seed=seed, rank=r, world_size=world, drop_last=drop_last))
        for r in range(world)
    ]


@pytest.mark.parametrize("world", [2, 3, 8])
def test_world_sizes_give_the_world_size_one_order(world: int) -> None:
    mix = Mixture([37, 101, 12], [0.2, 0.5, 0.3])
    order = epoch_order(mix, seed=9)
    n = len(order)
    padded = -(-n // world) * world
    assert interleave(rank_streams(mix, 9, world)) == [order[p % n] for p in range(padded)]
    assert interleave(rank_streams(mix, 9, world, drop_last=True)) == order[: n // world * world]


def test_resume_across_world_sizes_1_3_8_2_is_the_uninterrupted_run() -> None:
    mix = Mixture([37, 101, 12, 250], [0.2, 0.5, 0.3, 1.0])
    order = epoch_order(mix, seed=4, epoch=2)
    n = len(order)
    rng = np.random.default_rng(1)
    got: list[int] = []
    state = None
    worlds = [1, 3, 8, 2]
    for i, world in enumerate(worlds):
        streams = []
        steps = int(rng.integers(1, 30)) if i < len(worlds) - 1 else None
        for r in range(world):
            s = MixtureSampler(mix, seed=4 if state is None else 0, rank=r, world_size=world)
            if state is None:
                s.set_epoch(2)
            else:
                s.load_state_dict(state)
            it = iter(s)
            streams.append(list(itertools.islice(it, steps)))
            if r == 0:
                rank0 = s
        got += interleave(streams)
        state = rank0.state_dict()
        assert state["consumed"] == len(got) or state["consumed"] == n
    consumed_before_last = len(got) - len(interleave(streams))
    assert got[:consumed_before_last] == order[:consumed_before_last]
    tail = got[consumed_before_last:]
    assert tail == [order[p % n] for p in range(consumed_before_last, consumed_before_last + len(tail))]
    assert Counter(got[:n]) == Counter(order)


def test_state_is_small_and_refused_by_another_mixture() -> None:
    mix = Mixture([10**9] * 100, list(np.arange(1, 101)))
    s = MixtureSampler(mix, seed=1, rank=0, world_size=1)
    state = s.state_dict()
    assert len(repr(state)) < 400
    for other in (
        Mixture([10**9] * 100, list(np.arange(2, 102))),
        Mixture([10**9] * 99 + [10**9 + 1], list(np.arange(1, 101))),
        Mixture([10**9] * 100, list(np.arange(1, 101)), stop="first_exhausted"),
    ):
        with pytest.raises(MixtureError, match=r"mixture=.*another order cannot be resumed"):
            MixtureSampler(other, seed=1, rank=0, world_size=1).load_state_dict(state)
    plain = GlobalShuffleSampler(mix.num_samples, seed=1, rank=0, world_size=1).state_dict()
    with pytest.raises(MixtureError, match="another kind of order"):
        MixtureSampler(mix, seed=1, rank=0, world_size=1).load_state_dict(plain)


def test_resume_near_the_end_of_a_huge_mixture_is_immediate_and_exact() -> None:
    mix = Mixture([10**9] * 100, list(np.arange(1, 101)), stop="first_exhausted")
    s = MixtureSampler(mix, seed=7, rank=1, world_size=3)
    state = s.state_dict()
    state["consumed"] = mix.num_samples - 10
    s.load_state_dict(state)
    got = [*iter(s)]  # not list(s): it asks len() after iter(), which is then the whole epoch's
    n = mix.num_samples
    # Rank 1 of 3 takes positions n-9, n-6, n-3 and, padding, wraps to position 0.
    assert got == s.permutation()(np.array([n - 9, n - 6, n - 3, 0])).tolist()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_workers_resume_1_3_8_2_with_resumable_loader(num_workers: int) -> None:
    from torch.utils.data import DataLoader

    mix = Mixture([150, 40, 90], [0.5, 0.2, 0.3])
    order = epoch_order(mix, seed=11)
    n, batch = len(order), 4
    rng = np.random.default_rng(num_workers)
    state = None
    got: list[int] = []
    last_start = 0
    for i, world in enumerate([1, 3, 8, 2]):
        last = i == 3
        k = None if last else int(rng.integers(1, 5))
        streams, saved = [], None
        for r in range(world):
            s = MixtureSampler(mix, seed=11, rank=r, world_size=world)
            if state is not None:
                s.load_state_dict(state)
            loader = ResumableLoader(
                DataLoader(range(280), batch_size=batch, sampler=s, num_workers=num_workers)
            )
            streams.append(loader_batches(loader, k))
            if r == 0:
                saved = loader.state_dict()
        last_start = len(got)
        got += interleave(streams)
        state = saved
    assert got[:last_start] == order[:last_start]
    assert got[last_start:] == [order[p % n] for p in range(last_start, len(got))]
    assert set(got) == set(order)
    assert len(got) >= n


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_resume_1_3_8_2(num_workers: int) -> None:
    sdl = pytest.importorskip("torchdata.stateful_dataloader")

    mix = Mixture([150, 40, 90], [0.5, 0.2, 0.3], stop="first_exhausted")
    order = epoch_order(mix, seed=12)
    n, batch = len(order), 3
    got, starts = stateful_resume(
        sdl, lambda r, world: MixtureSampler(mix, seed=12, rank=r, world_size=world), 280, batch, num_workers
    )
    for i, (world, k) in enumerate(RESUME_PLAN[:-1]):
        assert starts[i + 1] - starts[i] == world * k * batch  # type: ignore[operator]
    last_start = starts[-1]
    assert got[:last_start] == order[:last_start]
    assert got[last_start:] == [order[p % n] for p in range(last_start, len(got))]


def test_prefetching_loader_makes_state_dict_refuse_to_guess() -> None:
    from torch.utils.data import DataLoader

    mix = Mixture([300, 300], [1, 1])
    s = MixtureSampler(mix, seed=1, rank=0, world_size=1)
    it = iter(DataLoader(range(600), batch_size=4, sampler=s, num_workers=2, prefetch_factor=2))
    next(it)
    with pytest.raises(RuntimeError, match="ahead of the training loop"):
        s.state_dict()
    assert s.state_dict(local_consumed=4)["consumed"] == 4
    del it


def test_the_sampler_is_a_distributed_sampler_and_resumable_loader_finds_it() -> None:
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    s = MixtureSampler(Mixture([5, 5], [1, 1]), seed=0, rank=0, world_size=1)
    assert isinstance(s, DistributedSampler)
    assert ResumableLoader(DataLoader(range(10), batch_size=2, sampler=s)).sampler is s


# ---- the dataset and config forms ---------------------------------------------------------------


def test_mixture_dataset_reads_each_source_by_its_own_index() -> None:
    a = [f"a{i}" for i in range(10)]
    b = [f"b{i}" for i in range(3)]
    ds = MixtureDataset([a, b], [0.5, 0.5])
    s = MixtureSampler(ds, seed=2, rank=0, world_size=1)
    seen = Counter(ds[i] for i in s)
    assert all(seen[x] == 1 for x in a)
    assert sum(seen[x] for x in b) == ds.mixture.count(1, len(s)) == 9
    assert sorted(seen[x] for x in b) == [3, 3, 3]
    assert [ds.locate(i) for i in (0, 9, 10, 12)] == [(0, 0), (0, 9), (1, 0), (1, 2)]
    assert len(ds) == 13
    with pytest.raises(IndexError):
        ds[13]


def test_megatron_blend_syntax() -> None:
    assert parse_megatron_blend("0.7 path_a 0.3 path_b") == [(0.7, "path_a"), (0.3, "path_b")]
    assert parse_megatron_blend(["1", "x", "2", "y"]) == [(1.0, "x"), (2.0, "y")]
    assert parse_megatron_blend("only") == [(1.0, "only")]
    sizes = {"path_a": 70, "path_b": 30}
    ds = from_megatron_blend("0.7 path_a 0.3 path_b", open_source=lambda p: list(range(sizes[p])))
    assert ds.mixture.shares == [7, 3]
    assert ds.mixture.lengths == [70, 30]
    for bad in ("0.7 a 0.3", "a 0.7 b 0.3", ""):
        with pytest.raises(MixtureError, match="blend"):
            parse_megatron_blend(bad)


@pytest.mark.parametrize(
    ("sources", "weights", "kwargs", "match"),
    [
        ([], [], {}, "at least one source"),
        ([3, 4], [1.0], {}, "2 sources"),
        ([3, 0], [1.0, 1.0], {}, "empty source"),
        ([3, 4], [1.0, -1.0], {}, "must be > 0"),
        ([3, 4], [1.0, 0.0], {}, "must be > 0"),
        ([3, 4], [float("nan"), 1.0], {}, "finite"),
        ([3, 4], [float("inf"), 1.0], {}, "finite"),
        ([3, 4], ["1", 1.0], {}, "numbers"),
        ([3, 4], [1, 1], {"stop": "longest"}, "all_exhausted"),
        ([3, 4], [1, 1], {"stop": -1}, "integer >= 0"),
    ],
)
def test_hostile_input_names_the_fault(
    sources: list[int], weights: list[object], kwargs: dict[str, object], match: str
) -> None:
    with pytest.raises(MixtureError, match=match):
        Mixture(sources, weights, **kwargs)  # type: ignore[arg-type]


def test_huge_or_irrational_weights_round_to_a_bounded_total() -> None:
    mix = Mixture([10**9] * 3, [1 / 3, 2**-40, 0.1234567891234], stop=10**6)
    assert mix.total <= 2**31
    assert min(mix.shares) >= 1
    assert (max_deviation(mix, 10**6) <= np.array(mix.deviation_bounds()) + 1e-9).all()


def test_import_smstore_stays_light() -> None:
    import subprocess
    import sys

    code = (
        "import smstore, sys; print('torch' in sys.modules, 'numpy' in sys.modules); "
        "import smstore.sampling as m; print(smstore.MixtureSampler is m.MixtureSampler)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "True"]
