"""Mixture schedules: each phase's exact-prefix bound, one stream per source across switches, resume at any world size."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import smstore
from smstore import MixtureError
from smstore.sampling import (
    Mixture,
    MixtureSampler,
    MixtureSchedule,
    ScheduledMixtureDataset,
    WindowedMixtureSampler,
    from_megatron_schedule,
    parse_schedule,
)

from .smstore_testlib import interleave, run_child, whole_order

LENGTHS = [37, 101, 12, 250]
PHASES: list[tuple[int, list[float]]] = [
    (0, [0.2, 0.5, 0.3, 1.0]),
    (300, [0.0, 1.0, 1.0, 0.5]),  # source 0 left out of this phase
    (700, [0.1, 0.1, 0.1, 0.7]),  # annealing
]
TOTAL = 1000

epoch_order = partial(whole_order, MixtureSampler)


def schedule() -> MixtureSchedule:
    return MixtureSchedule(LENGTHS, PHASES, TOTAL)


def sources_of(order: list[int], lengths: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(source, index in source) of each global index."""
    offsets = np.cumsum([0, *lengths])
    x = np.asarray(order)
    s = np.searchsorted(offsets, x, side="right") - 1
    return s, x - offsets[s]


def test_a_one_phase_schedule_is_the_mixture_index_for_index() -> None:
    weights = PHASES[0][1]
    one = MixtureSchedule(LENGTHS, [(0, weights)], TOTAL)
    assert epoch_order(one, seed=3, epoch=1) == epoch_order(
        Mixture(LENGTHS, weights, stop=TOTAL), seed=3, epoch=1
    )


def test_each_phase_keeps_its_mixtures_exact_prefix_bound() -> None:
    sch = schedule()
    src, _ = sources_of(epoch_order(sch, seed=5), LENGTHS)
    ends = [*sch.starts[1:], TOTAL]
    for i, (start, end) in enumerate(zip(sch.starts, ends, strict=True)):
        phase, members = sch.phases[i], sch.members[i]
        bounds = phase.deviation_bounds()
        k = np.arange(1, end - start + 1, dtype=np.float64)
        for j, s in enumerate(members):
            c = np.cumsum(src[start:end] == s)
            w = phase.weights[j]
            assert float(np.abs(c - k * (w.numerator / w.denominator)).max()) <= bounds[j] + 1e-9, (i, s)
        for s in set(range(len(LENGTHS))) - set(members):
            assert not (src[start:end] == s).any()  # a weight 0 leaves the source out of the phase
        # The closed form's counts are the order's.
        for s in range(len(LENGTHS)):
            assert sch.count(s, end) == int((src[:end] == s).sum())


def test_every_source_continues_its_own_stream_across_the_switches() -> None:
    """A source's k-th draw of the schedule is its k-th draw of the plain mixture (the same stream):
    nothing repeated early, nothing skipped at a switch."""
    sch = schedule()
    src, local = sources_of(epoch_order(sch, seed=8, epoch=2), LENGTHS)
    mix = Mixture(LENGTHS, [1, 1, 1, 1], stop=4 * TOTAL)  # every source drawn often enough
    msrc, mlocal = sources_of(epoch_order(mix, seed=8, epoch=2), LENGTHS)
    for s, n in enumerate(LENGTHS):
        mine, plain = local[src == s], mlocal[msrc == s]
        assert len(mine) <= len(plain)
        assert np.array_equal(mine, plain[: len(mine)]), s
        for e in range(0, len(mine), n):  # each pass is a permutation of the source
            part = mine[e : e + n]
            assert len(set(part.tolist())) == len(part)
    # The position of each source at each switch is its draws so far.
    for i, start in enumerate(sch.starts):
        assert sch.before[i] == [int((src[:start] == s).sum()) for s in range(len(LENGTHS))]


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    cuts=st.lists(st.integers(1, 399), max_size=4, unique=True),
    data=st.data(),
)
def test_any_schedule_locates_every_position_as_its_sources_next_draw(
    lengths: list[int], cuts: list[int], data: st.DataObject
) -> None:
    starts = [0, *sorted(cuts)]
    weights = st.lists(st.integers(0, 9), min_size=len(lengths), max_size=len(lengths)).filter(any)
    sch = MixtureSchedule(lengths, [(b, data.draw(weights)) for b in starts], 400)
    src, draw = sch.locate(np.arange(400))
    for s in range(len(lengths)):  # each source's draws are 0, 1, 2, ... in order: one stream
        assert draw[src == s].tolist() == list(range(int((src == s).sum())))
    for n in [0, *starts, 399, 400]:
        assert [sch.count(s, n) for s in range(len(lengths))] == [
            int((src[:n] == s).sum()) for s in range(len(lengths))
        ]


def order_digest(q: Any) -> None:
    """A child process: the schedule's order, as the parent computes it."""
    q.put(epoch_order(schedule(), seed=9, epoch=4))


def test_the_order_is_the_same_in_every_process() -> None:
    assert run_child(order_digest) == epoch_order(schedule(), seed=9, epoch=4)
    assert epoch_order(schedule(), seed=9, epoch=4) != epoch_order(schedule(), seed=9, epoch=5)


def run_world(
    state: dict[str, Any] | None, world: int, steps: int | None, batch: int
) -> tuple[list[int], Any]:
    """Every rank of `world` resumes from `state` (None: a fresh epoch 0) and takes `steps` batches
    (None: the rest); what they took, in global order, and rank 0's state after it."""
    streams, rank0 = [], None
    for r in range(world):
        s = MixtureSampler(schedule(), seed=21, rank=r, world_size=world)
        if state is not None:
            s.load_state_dict(state)
        streams.append(list(itertools.islice(iter(s), None if steps is None else steps * batch)))
        if r == 0:
            rank0 = s
    assert rank0 is not None
    return interleave(streams), rank0.state_dict()


@pytest.mark.parametrize("resumed_world", [3, 8])
@pytest.mark.parametrize(
    "steps", [5, 40, 60]
)  # stop at 40, 320, 480: before the switch at 300, past it, between it and 700
def test_stop_at_world_4_resume_at_3_and_8_across_a_switch(resumed_world: int, steps: int) -> None:
    batch = 2
    order = epoch_order(schedule(), seed=21)
    got, state = run_world(None, 4, steps, batch)
    assert state["consumed"] == len(got) == 4 * steps * batch
    assert got == order[: len(got)]
    rest, end = run_world(json.loads(json.dumps(state)), resumed_world, None, batch)  # saved as JSON
    assert end["consumed"] == TOTAL
    k = len(got)
    # The union of what the ranks receive is the global order's continuation (padded to the world).
    assert rest == [order[p % TOTAL] for p in range(k, k + len(rest))]
    assert len(rest) == -(-(TOTAL - k) // resumed_world) * resumed_world
    assert Counter((got + rest)[:TOTAL]) == Counter(order)


def test_a_state_under_another_schedule_or_a_plain_mixture_is_refused() -> None:
    state = MixtureSampler(schedule(), seed=1, rank=0, world_size=1).state_dict()
    other = MixtureSchedule(LENGTHS, [*PHASES[:2], (701, PHASES[2][1])], TOTAL)
    with pytest.raises(MixtureError, match="another order cannot be resumed"):
        MixtureSampler(other, seed=1, rank=0, world_size=1).load_state_dict(state)
    plain = Mixture(LENGTHS, PHASES[0][1], stop=TOTAL)
    with pytest.raises(MixtureError, match="another kind of order"):
        MixtureSampler(plain, seed=1, rank=0, world_size=1).load_state_dict(state)


def test_locating_a_position_late_in_a_huge_schedule_is_immediate() -> None:
    n = 10**12
    sch = MixtureSchedule(
        [10**9] * 50, [(i * n // 100, list(np.arange(1, 51) ** (i % 3))) for i in range(100)], n
    )
    s = MixtureSampler(sch, seed=2, rank=1, world_size=3)
    state = s.state_dict()
    state["consumed"] = n - 10
    s.load_state_dict(state)
    got = [*iter(s)]
    assert got == s.permutation()(np.array([n - 9, n - 6, n - 3, 0])).tolist()
    src, draw = sch.locate(np.array([n - 1]))
    assert draw[0] == sch.count(int(src[0]), n) - 1


def test_the_text_json_and_dict_formats_give_the_same_schedule() -> None:
    text = """
        # start      blend (Megatron's: weight name ...)
        0:           0.7 web 0.2 code 0.1 math
        step 30:     0.4 web 0.3 code 0.3 math   # anneal
        step 40:     end
    """
    spec = {
        "phases": [
            {"start": 0, "weights": {"web": 0.7, "code": 0.2, "math": 0.1}},
            {"step": 30, "weights": [0.4, 0.3, 0.3]},
        ],
        "end": {"step": 40},
    }
    want = ([(0, [0.7, 0.2, 0.1]), (240, [0.4, 0.3, 0.3])], 320, ["web", "code", "math"])
    assert parse_schedule(text, global_batch=8) == want
    assert parse_schedule(json.dumps(spec), global_batch=8) == want
    assert parse_schedule("0: 1 2; 5: 2 1; 9: end") == ([(0, [1.0, 2.0]), (5, [2.0, 1.0])], 9, None)
    opened: list[str] = []

    def open_source(path: str) -> list[int]:
        opened.append(path)
        return list(range({"web": 300, "code": 100, "math": 50}[path]))

    ds = from_megatron_schedule(text, open_source=open_source, global_batch=8)
    assert opened == ["web", "code", "math"]
    assert isinstance(ds, ScheduledMixtureDataset)
    assert len(ds) == 450
    assert ds.schedule.starts == [0, 240]
    assert len(ds.schedule) == 320
    first = next(iter(MixtureSampler(ds, seed=0, rank=0, world_size=1)))
    assert ds[first] == ds.sources[ds.locate(first)[0]][ds.locate(first)[1]]
    assert "0.7" in repr(ds)


@pytest.mark.parametrize(
    ("text", "fault"),
    [
        ("0: 1 1", "end"),
        ("0: 1 1\nstep 5: end", "global_batch"),
        ("0: 1 1\n-5: 1 2\n9: end", "line 2.*'-5' is not a whole number"),
        ("0 1 1\n9: end", "line 1.*has no ':'"),
        ("0: 1 1\n9: end\n12: 1 1", "line 2: 'end' before the last line"),
        ("0: 0.5 web 0.5 code\n4: 1 news\n9: end", "line 2.*'news'.*not among the first phase's sources"),
        ("0: 0.5 web 0.5 web\n9: end", "named twice"),
        ("0: 1 1\n4: 1 web\n9: end", "line 2 names its sources, but phase 0 gave bare weights"),
        ("0: 1 1\n4: 1 1 1\n9: end", r"\[2, 3\] weights"),
        ("0: web code\n9: end", "not a weight"),
        ("{not json", "not valid JSON"),
        ('{"phases": [], "end": 5, "x": 1}', "'phases' and 'end' only"),
        ('{"phases": [{"start": 0}], "end": 5}', "phase 0 has no 'weights'"),
        ('{"phases": [{"start": 0, "step": 1, "weights": [1]}], "end": 5}', "phase 0.*one of 'start'"),
        ('{"phases": [{"start": 0, "weights": 7}], "end": 5}', "phase 0's weights are 7"),
    ],
)
def test_hostile_text_is_a_value_error_naming_the_fault(text: str, fault: str) -> None:
    with pytest.raises(ValueError, match=fault):
        parse_schedule(text)


@pytest.mark.parametrize(
    ("phases", "total", "fault"),
    [
        ([(1, [1, 1])], 10, "phase 0 starts at 1"),
        ([(0, [1, 1]), (0, [1, 2])], 10, "phase 1 starts at 0, not after phase 0"),
        ([(0, [1, 1]), (10, [1, 2])], 10, "at or past the schedule's total"),
        ([(0, [1, 1, 1])], 10, "3 weights for 2 sources"),
        ([(0, [0, 0])], 10, "all 0"),
        ([(0, [1, -1])], 10, "phase 0: weight 1 is -1"),
        ([(0, [1, float("nan")])], 10, "finite"),
        ([(0, "1 1")], 10, "one number per source"),
        ([(0, [1, 1])], 0, "total is 0"),
        ([(True, [1, 1])], 10, "start of phase 0"),
        ([], 10, "at least one phase"),
    ],
)
def test_bad_phases_are_refused_naming_the_fault(phases: list[Any], total: int, fault: str) -> None:
    with pytest.raises(MixtureError, match=fault):
        MixtureSchedule([5, 5], phases, total)


def test_a_schedule_is_refused_by_the_windowed_mixture_sampler_with_the_way_out() -> None:
    with pytest.raises(MixtureError, match="use MixtureSampler for a schedule"):
        WindowedMixtureSampler(schedule(), window=1, seed=0, rank=0, world_size=1)
    ds = ScheduledMixtureDataset([list(range(n)) for n in LENGTHS], schedule())
    with pytest.raises(MixtureError, match="use MixtureSampler for a schedule"):
        WindowedMixtureSampler.windows_for(ds, 1 << 30)
    with pytest.raises(MixtureError, match="sources of"):
        ScheduledMixtureDataset([[1, 2]], schedule())


def test_weights_may_be_numpy_arrays() -> None:
    arrays = [(b, np.asarray(w)) for b, w in PHASES]
    assert MixtureSchedule(LENGTHS, arrays, TOTAL).digest == schedule().digest
    with pytest.raises(MixtureError, match="one number per source"):
        MixtureSchedule(LENGTHS, [(0, np.ones((2, 2)))], TOTAL)


def test_the_loader_gives_the_dataloaders_batches_across_a_switch(tmp_path: Path) -> None:
    """smstore.Loader draws the sampler's chunks as arrays: over the concatenation of the sources
    (one blob), its batches are the DataLoader's, byte for byte, at a rank of 3."""
    torch = pytest.importorskip("torch")
    lengths = [100, 150, 50]
    rng = np.random.default_rng(3)
    records = [
        rng.integers(1, 60000, size=int(rng.integers(0, 20)), dtype=np.uint16) for _ in range(sum(lengths))
    ]
    path = tmp_path / "mix.smst"
    smstore.pack_arrays(records, path, durable=False)
    sch = MixtureSchedule(lengths, [(0, [0.5, 0.3, 0.2]), (200, [0.1, 0.1, 0.8])], 600)

    def sampler() -> MixtureSampler:
        return MixtureSampler(sch, seed=4, rank=1, world_size=3)

    collate = smstore.TokenCollator(path)
    slow = list(
        torch.utils.data.DataLoader(range(len(collate)), sampler=sampler(), batch_size=7, collate_fn=collate)
    )
    with smstore.Loader(path, sampler=sampler(), batch_size=7) as loader:
        fast = [{key: value.clone() for key, value in batch.items()} for batch in loader]
    assert len(fast) == len(slow) == -(-200 // 7)
    for f, s in zip(fast, slow, strict=True):
        assert list(f) == list(s)
        assert all(f[key].numpy().tobytes() == s[key].numpy().tobytes() for key in s)
