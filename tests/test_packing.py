"""PackedBins: documents packed best-fit into bins, against the documents read directly."""

from __future__ import annotations

import itertools
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from smstore_testlib import (
    interleave,
    packed_bins_digest,
    reference_pack_lengths,
    run_child,
    token_datasets,
    token_documents,
    whole_order,
)

import smstore
from smstore import _core
from smstore.errors import StoreFormatError
from smstore.read.packing import ALGORITHMS, CLOSES, PackedBins, pack_lengths

Data = tuple[dict[str, Path], list[np.ndarray]]


@pytest.fixture(scope="module")
def token_data(tmp_path_factory: pytest.TempPathFactory) -> Data:
    root = tmp_path_factory.mktemp("packing")
    docs = token_documents(3000, 11)
    docs[7] = np.arange(1, 300, dtype=np.uint16)  # longer than every bin below: split
    return token_datasets(root, docs), docs


def check_bins(bins: PackedBins, docs: list[np.ndarray], eod: int | None) -> None:
    """Every token of every document once, byte-exact, bins within length, cu_seqlens and position ids right."""
    full = [np.append(d, eod).astype(np.int64) if eod is not None else d.astype(np.int64) for d in docs]
    covered = [np.zeros(len(d), dtype=np.int64) for d in full]
    for k in range(len(bins)):
        b = bins[k]
        segments = b["segments"]
        assert np.array_equal(segments, bins.segments(k))
        counts = segments[:, 2]
        used = int(counts.sum())
        assert 0 < used <= bins.length
        assert b["tokens"].dtype == np.int64
        assert len(b["tokens"]) == bins.length
        assert np.all(b["tokens"][used:] == bins.pad)
        assert b["cu_seqlens"].dtype == np.int32
        assert b["cu_seqlens"].tolist() == [0, *np.cumsum(counts).tolist()]
        expect_tokens, expect_positions = [], []
        for doc, first, count in segments.tolist():
            expect_tokens.append(full[doc][first : first + count])
            expect_positions.append(np.arange(count))
            covered[doc][first : first + count] += 1
        assert np.array_equal(b["tokens"][:used], np.concatenate(expect_tokens)), k
        assert np.array_equal(b["position_ids"][:used], np.concatenate(expect_positions))
        assert not b["position_ids"][used:].any()
    assert all((c == 1).all() for c in covered)


@pytest.mark.parametrize("kind", ["blob", "sharded"])
@pytest.mark.parametrize(
    ("eod", "algorithm", "seed", "close"),
    [(None, "best-fit", None, "fullest"), (0, "first-fit", 3, "all"), (0, "best-fit", 4, "oldest")],
)
def test_every_token_of_every_document_is_in_exactly_one_bin(
    token_data: Data, kind: str, eod: int | None, algorithm: str, seed: int | None, close: str
) -> None:
    paths, docs = token_data
    bins = PackedBins(
        paths[kind], 128, eod=eod, group=500, open_bins=4, algorithm=algorithm, seed=seed, close=close
    )
    assert sum(bins.group_sizes) == len(bins)
    assert len(bins.group_sizes) == 6
    check_bins(bins, docs, eod)
    # Each bin holds documents of its own group only; padding is small.
    for k in range(len(bins)):
        groups = {d // 500 for d in bins.segments(k)[:, 0].tolist()}
        assert len(groups) == 1
    used = sum(len(d) + (eod is not None) for d in docs)
    assert used / (len(bins) * 128) > 0.9


class CountingStore:
    """A blob's Store that records which records are read."""

    def __init__(self, store: Any) -> None:
        self.inner, self.read = store, set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> Any:
        self.read.add(i)
        return self.inner[i]


def test_construction_reads_no_token_and_a_bin_reads_only_its_group(token_data: Data) -> None:
    paths, docs = token_data
    store = CountingStore(smstore.open(paths["blob"], raw=True))
    bins = PackedBins(type("Source", (), {"store": store})(), 128, eod=0, group=500, cache_groups=1)
    assert store.read == set()
    for k in (0, len(bins) // 2, len(bins) - 1):
        store.read.clear()
        held = set(bins.segments(k)[:, 0].tolist())
        bins[k]
        assert store.read == held
        group = min(held) // 500
        assert held <= set(range(500 * group, 500 * group + 500))
    check_bins(bins, docs, 0)


def test_unpadded_bins_hold_their_tokens_only(token_data: Data) -> None:
    paths, _docs = token_data
    bins = PackedBins(paths["blob"], 96, eod=0, pad=None, group=1000)
    for k in (0, 5, len(bins) - 1):
        b = bins[k]
        assert len(b["tokens"]) == len(b["position_ids"]) == int(b["cu_seqlens"][-1])


def test_a_batch_of_bins_collates_for_varlen_attention_in_a_dataloader(token_data: Data) -> None:
    torch = pytest.importorskip("torch")
    paths, _ = token_data
    bins = PackedBins(smstore.SharedStoreDataset(paths["sharded"], mode="mmap"), 64, eod=0, pad=7, group=300)
    sampler = smstore.GlobalShuffleSampler(len(bins), seed=2, rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(
        bins,
        sampler=sampler,
        batch_size=4,
        num_workers=2,
        collate_fn=PackedBins.collate,
        multiprocessing_context="spawn",
    )
    order = list(sampler)
    for i, batch in enumerate(itertools.islice(loader, 3)):
        got = [bins[k] for k in order[4 * i : 4 * i + 4]]
        assert np.array_equal(batch["tokens"], np.stack([b["tokens"] for b in got]))
        cu = batch["cu_seqlens"].tolist()
        assert cu[0] == 0
        assert cu[-1] == 4 * 64
        assert all(a < b for a, b in itertools.pairwise(cu))
        flat = batch["position_ids"].reshape(-1)
        for a, b in itertools.pairwise(cu):  # every sequence, padding included, counts from 0
            assert flat[a] == 0
            assert np.array_equal(flat[a:b], np.arange(b - a)) or (flat[a:b] == 0).all()
        assert batch["segments"][:, 0].tolist() == [r for r, b in enumerate(got) for _ in b["segments"]]
    with pytest.raises(ValueError, match="pad"):
        PackedBins.collate([{"tokens": np.zeros(3)}, {"tokens": np.zeros(4)}])


def as_bins(segments: np.ndarray, starts: np.ndarray) -> list[list[tuple[int, int, int]]]:
    return [[tuple(r) for r in segments[starts[b] : starts[b + 1]].tolist()] for b in range(len(starts) - 1)]


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), max_size=120),
    length=st.integers(1, 24),
    open_bins=st.integers(1, 6),
    group=st.integers(1, 50),
)
def test_the_cpp_packer_equals_the_reference(
    lengths: list[int], length: int, open_bins: int, group: int
) -> None:
    for algorithm, close in itertools.product(ALGORITHMS, CLOSES):
        rule = {"open_bins": open_bins, "algorithm": algorithm, "close": close}
        got = as_bins(*pack_lengths(lengths, length, **rule))
        assert got == as_bins(*reference_pack_lengths(lengths, length, **rule))
        counts = _core.count_bins(np.array(lengths, dtype=np.int64), group, length=length, **rule)
        expect = [
            len(reference_pack_lengths(lengths[a : a + group], length, **rule)[1]) - 1
            for a in range(0, len(lengths), group)
        ]
        assert counts.tolist() == expect


def test_the_packer_refuses_bad_arguments_and_takes_big_lengths() -> None:
    rule: dict[str, Any] = {"open_bins": 2, "algorithm": "best-fit", "close": "all"}
    for bad in (
        {"algorithm": "worst-fit"},
        {"close": "emptiest"},
        {"open_bins": 0},
        {"length": 0},
        {"lengths": [3, -1]},
        {"lengths": [[1, 2]]},
    ):
        args = {"lengths": [1], "length": 10, **rule, **bad}
        with pytest.raises(ValueError, match=next(iter(bad)).rstrip("s")):
            _core.pack_lengths(args.pop("lengths"), args.pop("length"), **args)
    with pytest.raises(ValueError, match="group"):
        _core.count_bins(np.ones(3, np.int64), 0, length=4, **rule)
    big = 3 * 2**31 + 5  # longer than int32 and than a bin: whole bins, then its rest packed
    segments, starts = pack_lengths([big, 7], 2**31, **rule)
    assert as_bins(segments, starts) == [
        [(0, 0, 2**31)],
        [(0, 2**31, 2**31)],
        [(0, 2**32, 2**31)],
        [(0, 3 * 2**31, 5), (1, 0, 7)],
    ]
    assert _core.count_bins(np.array([big, 2**40], np.int64), 1, length=2**31, **rule).tolist() == [4, 2**9]


def test_grain_closing_rule_closes_every_open_bin() -> None:
    # Two open bins (rooms 3 and 1); 5 fits neither: Grain's rule closes both, so 3 joins 5.
    segments, starts = pack_lengths([7, 9, 5, 3, 2], 10, open_bins=2, close="all")
    assert as_bins(segments, starts) == [[(0, 0, 7)], [(1, 0, 9)], [(2, 0, 5), (3, 0, 3), (4, 0, 2)]]


def test_pack_lengths_best_fit_first_fit_and_splits() -> None:
    segments, starts = pack_lengths([6, 5, 3, 4, 25], 10, algorithm="first-fit")
    bins = [segments[starts[b] : starts[b + 1]].tolist() for b in range(len(starts) - 1)]
    assert bins == [[[0, 0, 6], [2, 0, 3]], [[1, 0, 5], [3, 0, 4]], [[4, 0, 10]], [[4, 10, 10]], [[4, 20, 5]]]
    fits = {}
    for algorithm in ("first-fit", "best-fit"):
        segments, starts = pack_lengths([5, 6, 4], 10, algorithm=algorithm)
        fits[algorithm] = [segments[starts[b] : starts[b + 1]].tolist() for b in range(len(starts) - 1)]
    assert fits["first-fit"] == [[[0, 0, 5], [2, 0, 4]], [[1, 0, 6]]]
    assert fits["best-fit"] == [[[0, 0, 5]], [[1, 0, 6], [2, 0, 4]]]  # the fullest bin that has room
    # One open bin: a piece that does not fit closes it.
    _, starts = pack_lengths([6, 5, 3], 10, open_bins=1)
    assert np.diff(starts).tolist() == [1, 2]
    # Two open bins (rooms 3 and 1) and a third needed for 5: the fullest is closed, so 3 fills the
    # first bin; or the oldest, so 3 joins 5.
    closed = {}
    for close in ("fullest", "oldest"):
        segments, starts = pack_lengths([7, 9, 5, 3], 10, open_bins=2, close=close)
        closed[close] = [segments[starts[b] : starts[b + 1]].tolist() for b in range(len(starts) - 1)]
    assert closed["fullest"] == [[[0, 0, 7], [3, 0, 3]], [[1, 0, 9]], [[2, 0, 5]]]
    assert closed["oldest"] == [[[0, 0, 7]], [[1, 0, 9]], [[2, 0, 5], [3, 0, 3]]]
    with pytest.raises(ValueError, match="algorithm"):
        pack_lengths([1], 10, algorithm="worst-fit")
    with pytest.raises(ValueError, match="close"):
        pack_lengths([1], 10, close="emptiest")


def test_bins_are_the_same_in_a_spawned_process(token_data: Data) -> None:
    paths, _ = token_data
    options: dict[str, Any] = {"length": 64, "eod": 0, "group": 700, "seed": 9}
    here: list[Any] = []
    packed_bins_digest(str(paths["sharded"]), options, type("Q", (), {"put": here.append})())
    assert run_child(packed_bins_digest, str(paths["sharded"]), options) == here[0]
    again = pickle.loads(pickle.dumps(PackedBins(paths["sharded"], **options)))
    assert np.array_equal(again[3]["tokens"], PackedBins(paths["sharded"], **options)[3]["tokens"])


@pytest.mark.parametrize("sampler", ["global", "windowed"])
def test_resume_mid_epoch_at_another_world_size_continues_the_order(token_data: Data, sampler: str) -> None:
    paths, _ = token_data
    bins = PackedBins(paths["sharded"], 128, eod=0, group=400)

    def make(rank: int, world: int) -> Any:
        if sampler == "global":
            return smstore.GlobalShuffleSampler(len(bins), seed=5, rank=rank, world_size=world)
        return smstore.WindowedShuffleSampler(
            list(bins.group_sizes), window=2, seed=5, rank=rank, world_size=world
        )

    whole = whole_order(lambda **kw: make(kw["rank"], kw["world_size"]))
    steps = 13
    ranks = [make(r, 4) for r in range(4)]
    first = [list(itertools.islice(iter(s), steps)) for s in ranks]
    state = ranks[0].state_dict(local_consumed=steps)
    assert interleave(first) == whole[: 4 * steps]
    for world in (3, 8):
        resumed = [make(r, world) for r in range(world)]
        for s in resumed:
            s.load_state_dict(state)
        got = interleave([list(s) for s in resumed])
        assert got[: len(whole) - 4 * steps] == whole[4 * steps :]
    # The bins those positions name are the same in another instance (the packing is data).
    other = PackedBins(paths["sharded"], 128, eod=0, group=400)
    for k in whole[4 * steps : 4 * steps + 20]:
        assert np.array_equal(other.segments(k), bins.segments(k))


def test_bad_input_is_refused_naming_the_file(tmp_path: Path) -> None:
    smstore.pack([b"text"], tmp_path / "text.smst", durable=False)
    with pytest.raises(StoreFormatError, match=r"text\.smst"):
        PackedBins(tmp_path / "text.smst", 8)
    smstore.pack_arrays([np.ones(4, np.float32)], tmp_path / "f.smst", durable=False)
    with pytest.raises(StoreFormatError, match=r"f\.smst.*integer tokens"):
        PackedBins(tmp_path / "f.smst", 8)
    smstore.pack_arrays([np.ones(4, np.uint16)], tmp_path / "u.smst", durable=False)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=r"u\.smst.*length"):
            PackedBins(tmp_path / "u.smst", bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"u\.smst.*group"):
        PackedBins(tmp_path / "u.smst", 8, group=0)
    with pytest.raises(ValueError, match="algorithm"):
        PackedBins(tmp_path / "u.smst", 8, algorithm="worst-fit")
    with pytest.raises(ValueError, match="close"):
        PackedBins(tmp_path / "u.smst", 8, close="emptiest")
    with pytest.raises(ValueError, match="pad"):
        PackedBins(tmp_path / "u.smst", 8, pad=-1, dtype=np.uint16)
    bins = PackedBins(tmp_path / "u.smst", 8)
    assert len(bins) == 1
    assert bins.segments(0).tolist() == [[0, 0, 4]]
    with pytest.raises(IndexError, match=r"u\.smst"):
        bins.segments(1)


def test_batch_segments_are_what_collate_lists(token_data: Data) -> None:
    paths, _ = token_data
    bins = PackedBins(paths["blob"], 64, eod=0, group=100, seed=3, cache_groups=2)
    rng = np.random.default_rng(5)
    for size in (1, 7, 40):
        ids = rng.integers(-len(bins), len(bins), size).tolist()
        expected = PackedBins.collate([bins[k] for k in ids])["segments"]
        got = bins.batch_segments(ids)
        assert got.dtype == np.int64
        assert np.array_equal(got, expected)
    with pytest.raises(IndexError, match=f"bin {len(bins)} out of range"):
        bins.batch_segments([0, len(bins)])


def test_a_batch_over_more_groups_than_the_cache_packs_each_group_once(
    token_data: Data, monkeypatch: pytest.MonkeyPatch
) -> None:
    """batch_segments packs each group its bins lie in once, even when they outnumber
    cache_groups (the old code packed the evicted groups a second time for the copy)."""
    paths, _ = token_data
    bins = PackedBins(paths["blob"], 64, eod=0, group=100, cache_groups=2)
    ids = [int(bins._bin_starts[g]) for g in range(6)]  # the first bin of six groups
    packed: list[int] = []
    pack = _core.pack_lengths

    def counting(lengths: np.ndarray, *args: object, **kwargs: object) -> object:
        packed.append(len(lengths))
        return pack(lengths, *args, **kwargs)

    monkeypatch.setattr(_core, "pack_lengths", counting)
    got = bins.batch_segments(ids)
    assert len(packed) == 6
    monkeypatch.undo()
    assert np.array_equal(got, PackedBins.collate([bins[k] for k in ids])["segments"])
