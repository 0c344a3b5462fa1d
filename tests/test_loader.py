"""smstore.Loader: the DataLoader's TokenCollator batches, made by C++ threads into reused buffers."""

from __future__ import annotations

import gc
import os
import select
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import smstore
from smstore import GlobalShuffleSampler, Loader, MixtureSampler, TokenCollator, WindowedShuffleSampler
from smstore.format.manifest import read_manifest
from smstore.sampling import BlockWindowSampler, Mixture, ResumableLoader, WindowedMixtureSampler
from smstore.write.pack import build_metadata

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader

LENGTHS = [5, 0, 13, 1, 8, 8, 2, 30, 4, 0, 7, 11]
N = 240


def record(i: int) -> np.ndarray:
    n = LENGTHS[i % len(LENGTHS)]
    return (np.arange(n, dtype=np.int64) * 7 + i * 100 + 1) % 65000


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loader")
    out = {}
    for name, dtype in (("u2", np.uint16), ("i4", np.int32), ("u1", np.uint8), ("f4", np.float32)):
        out[name] = root / f"{name}.smst"
        smstore.pack_arrays((record(i).astype(dtype) for i in range(N)), out[name], dtype=dtype)
    out["lines"] = root / "lines.smst"
    smstore.pack([bytes(record(i) % 251) for i in range(N)], out["lines"], encoding="lines")
    out["big"] = root / "big.smst"
    smstore.pack_arrays((record(i).astype(np.uint16) for i in range(BIG)), out["big"], dtype=np.uint16)
    # The same records as sharded datasets: shards of uneven sizes (the index's table), and shards
    # of 400 records (its division; the windowed samplers below hold shards of those sizes).
    for name, count, shards in (("u2", N, {"shard_size": 300}), ("big", BIG, {"shard_records": 400})):
        out[f"{name}-sharded"] = root / f"{name}-sharded"
        with smstore.ShardedWriter(
            f"{out[f'{name}-sharded']}/", encoding="npy:<u2", durable=False, **shards
        ) as w:
            w.extend(record(i).astype(np.uint16) for i in range(count))
    return out


DATA = ["u2", "u2-sharded"]  # a blob and a sharded dataset of the same records


def reference(
    path: Path, sampler: Any, batch_size: int, drop_last: bool, **options: Any
) -> list[dict[str, Any]]:
    """The DataLoader's batches, collated by TokenCollator's numpy path (independent of the C++ batcher)."""
    collate = TokenCollator(path, **options)
    loader = DataLoader(
        range(len(collate)),
        sampler=sampler,
        batch_size=batch_size,
        drop_last=drop_last,
        collate_fn=lambda b: collate._collate_numpy(b, b, torch),
    )
    return list(loader)


def assert_same_batches(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert list(g) == list(e)
        for key in e:
            assert g[key].dtype == e[key].dtype, key
            assert g[key].shape == e[key].shape, key
            assert g[key].numpy().tobytes() == e[key].numpy().tobytes(), key


OPTIONS = [
    {},
    {"dtype": torch.long, "pad_value": -100},
    {"dtype": torch.int32, "max_length": 6, "truncation": "left"},
    {"max_length": 6, "padding_side": "left", "pad_to_multiple_of": 8},
    {"max_length": 0},
    {"max_length": 40, "fixed_length": True, "pad_value": 9, "dtype": torch.int16},
    {"dtype": torch.float32, "pad_to_multiple_of": 3},
    {"return_indices": False, "dtype": torch.uint8},
    {"layout": "pack"},
    {"layout": "pack", "max_length": 3, "truncation": "left", "dtype": torch.long},
    {"layout": "pack", "max_length": 7, "return_indices": False},
]


@pytest.mark.parametrize(
    "options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default"
)
@pytest.mark.parametrize(("batch_size", "drop_last"), [(7, False), (7, True), (32, False)])
@pytest.mark.parametrize("data", DATA)
def test_identical_to_the_dataloader(
    stores: dict[str, Path], data: str, options: dict[str, Any], batch_size: int, drop_last: bool
) -> None:
    sampler = GlobalShuffleSampler(N, seed=3, rank=0, world_size=1)
    expected = reference(stores[data], sampler, batch_size, drop_last, **options)
    with Loader(
        stores[data], sampler=sampler, batch_size=batch_size, drop_last=drop_last, **options
    ) as loader:
        got = list(loader)
    assert_same_batches(got, expected)
    assert len(loader) == len(expected)
    # The collator's own call (the C++ gather, in a DataLoader worker) gives the same batches.
    collate = TokenCollator(stores[data], **options)
    dataloader = DataLoader(
        range(N), sampler=sampler, batch_size=batch_size, drop_last=drop_last, collate_fn=collate
    )
    assert_same_batches(list(dataloader), expected)


@pytest.mark.parametrize("name", ["i4", "u1", "f4", "lines"])
@pytest.mark.parametrize("dtype", [None, torch.long, torch.float64])
def test_record_dtypes(stores: dict[str, Path], name: str, dtype: Any) -> None:
    if name != "f4" or dtype is not torch.long:  # float records to integer tokens: refused below
        sampler = GlobalShuffleSampler(N, seed=1, rank=0, world_size=1)
        expected = reference(stores[name], sampler, 16, False, dtype=dtype, max_length=9)
        with Loader(
            stores[name], sampler=sampler, batch_size=16, dtype=dtype, max_length=9, threads=3
        ) as loader:
            assert_same_batches(list(loader), expected)


def test_what_the_batcher_cannot_do_is_refused(stores: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="use DataLoader"):
        Loader(stores["f4"], batch_size=4, dtype=torch.long)
    with pytest.raises(ValueError, match="use DataLoader"):
        Loader(stores["u2"], batch_size=4, dtype=torch.bfloat16)


@pytest.mark.parametrize("data", DATA)
@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("kind", ["global", "windowed", "block", "mixture"])
def test_samplers_and_world_sizes(stores: dict[str, Path], kind: str, world_size: int, data: str) -> None:
    def make(rank: int) -> Any:
        if kind == "global":
            return GlobalShuffleSampler(N, seed=5, rank=rank, world_size=world_size)
        if kind == "windowed":
            return WindowedShuffleSampler(
                [60, 60, 70, 50], window=2, seed=5, rank=rank, world_size=world_size
            )
        if kind == "block":
            return BlockWindowSampler(
                [60, 60, 70, 50], block=9, spread=2, seed=5, rank=rank, world_size=world_size, residency=False
            )
        return MixtureSampler(Mixture([100, 140], [0.7, 0.3]), seed=5, rank=rank, world_size=world_size)

    for rank in range(world_size):
        expected = reference(stores[data], make(rank), 10, False, dtype=torch.long)
        with Loader(stores[data], sampler=make(rank), batch_size=10, dtype=torch.long, depth=2) as loader:
            assert_same_batches(list(loader), expected)


class HoldRecorder:
    """A residency that records each hold with the batches the loop had received when it came."""

    def __init__(self) -> None:
        self.received = 0
        self.holds: list[tuple[int, tuple[int, ...]]] = []

    def hold(self, shards: tuple[int, ...], *, wait: bool = False) -> None:
        self.holds.append((self.received, tuple(shards)))

    def close(self) -> None:
        pass


BIG = 3000  # records: our samplers draw chunks of 256, 1024, 4096 (cut at window starts)


def make_sampler(kind: str, rank: int, world: int, recs: list[HoldRecorder]) -> Any:
    if kind == "global":
        return GlobalShuffleSampler(BIG, seed=5, rank=rank, world_size=world)
    if kind == "windowed":
        sizes = [400] * 7 + [200]
        return WindowedShuffleSampler(
            sizes, window=2, seed=5, rank=rank, world_size=world, lag=30, residency=recs[0]
        )
    if kind == "mixture":
        return MixtureSampler(Mixture([1800, 1200], [0.7, 0.3]), seed=5, rank=rank, world_size=world)
    return WindowedMixtureSampler(
        Mixture([1800, 1200], [0.6, 0.4]),
        window=2,
        shard_sizes=[[300] * 6, [200] * 6],
        seed=5,
        rank=rank,
        world_size=world,
        lag=20,
        residency=recs,
    )


class Plain:
    """Our sampler behind an iterable of another type: the Loader draws it index by index."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __iter__(self) -> Any:
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("world", "rank"), [(1, 0), (3, 2)])
@pytest.mark.parametrize("kind", ["global", "windowed", "mixture", "windowed-mixture"])
@pytest.mark.parametrize("data", ["big", "big-sharded"])
def test_our_samplers_chunks_as_arrays_match_the_dataloader(
    stores: dict[str, Path], data: str, kind: str, world: int, rank: int, drop_last: bool
) -> None:
    """The Loader takes our samplers' chunks as arrays: the same batches, states after each batch
    received and residency holds (at the same batches) as the DataLoader and the index-by-index path."""
    path, b = stores[data], 7
    collate = TokenCollator(path, dtype=torch.long)

    def run(loader: Any, recs: list[HoldRecorder], states: bool) -> tuple[list[Any], list[Any], list[Any]]:
        batches, saved = [], []
        for batch in loader:
            batches.append(batch)
            for r in recs:
                r.received += 1
            if states:
                saved.append({k: v for k, v in loader.state_dict().items() if k != "store_checksum"})
        if states:
            saved.append({k: v for k, v in loader.state_dict().items() if k != "store_checksum"})
        return batches, saved, [r.holds for r in recs]

    recs = [HoldRecorder(), HoldRecorder()]
    reference_loader = ResumableLoader(
        DataLoader(
            range(BIG),
            sampler=make_sampler(kind, rank, world, recs),
            batch_size=b,
            drop_last=drop_last,
            collate_fn=lambda x: collate._collate_numpy(x, x, torch),
        )
    )
    expected, expected_states, expected_holds = run(reference_loader, recs, True)

    recs = [HoldRecorder(), HoldRecorder()]
    sampler = make_sampler(kind, rank, world, recs)
    with Loader(
        path, sampler=sampler, batch_size=b, drop_last=drop_last, dtype=torch.long, depth=3
    ) as loader:
        got, states, holds = run(loader, recs, True)
    assert_same_batches(got, expected)
    assert states == expected_states
    # The holds are those of the DataLoader's pass (which draws a batch at a time: other batches)...
    assert [[h for _, h in r] for r in holds] == [[h for _, h in r] for r in expected_holds]
    if kind.startswith("windowed"):
        assert len(holds[0]) > 2  # the pass went through several windows

    # ... and come at the same batches as when the Loader draws the same pass index by index.
    recs = [HoldRecorder(), HoldRecorder()]
    plain = Plain(make_sampler(kind, rank, world, recs))
    with Loader(path, sampler=plain, batch_size=b, drop_last=drop_last, dtype=torch.long, depth=3) as loader:
        got_plain, _, holds_plain = run(loader, recs, False)
    assert_same_batches(got_plain, expected)
    assert holds == holds_plain


@pytest.mark.parametrize("kind", ["global", "windowed", "mixture", "windowed-mixture"])
def test_chunks_are_the_pass_as_int64_arrays(kind: str) -> None:
    def make() -> Any:
        s = make_sampler(kind, 1, 2, [HoldRecorder(), HoldRecorder()])
        s.set_epoch(2)
        return s

    s, other = make(), make()
    chunks = s._chunks()
    first = [next(chunks), next(chunks)]
    it = iter(other)
    drawn = [next(it) for _ in range(sum(len(c) for c in first))]
    # A chunk counts as handed out once yielded: the state is that of iter() at the same index.
    assert s.state_dict() == other.state_dict()
    rest = list(chunks)
    assert all(isinstance(c, np.ndarray) and c.dtype == np.int64 and c.ndim == 1 for c in first + rest)
    assert len(rest) >= 1
    # The same pass as iter(): the same indices in the same order, the same state at its end.
    assert np.concatenate(first + rest).tolist() == drawn + list(it)
    assert s.state_dict() == other.state_dict()
    assert s.state_dict()["consumed"] == s.num_records


def test_no_threads_makes_each_batch_on_the_loops_thread(stores: dict[str, Path]) -> None:
    sampler = GlobalShuffleSampler(N, seed=6, rank=0, world_size=1)
    expected = reference(stores["u2"], sampler, 9, False, layout="pack", max_length=7)
    before = set(os.listdir("/proc/self/task"))
    with Loader(
        stores["u2"], sampler=sampler, batch_size=9, threads=0, layout="pack", max_length=7
    ) as loader:
        got = []
        for batch in loader:
            assert set(os.listdir("/proc/self/task")) - before == set()
            got.append(batch)
    assert_same_batches(got, expected)


def test_default_sampler_is_sequential(stores: dict[str, Path]) -> None:
    with Loader(stores["u2"], batch_size=50) as loader:
        batches = list(loader)
    assert [b["indices"].tolist() for b in batches] == [
        list(range(i, min(i + 50, N))) for i in range(0, N, 50)
    ]


def test_collate_argument_and_dataset_source(stores: dict[str, Path]) -> None:
    ds = smstore.SharedStoreDataset(stores["u2"])
    sampler = GlobalShuffleSampler(N, seed=2, rank=0, world_size=1)
    expected = reference(stores["u2"], sampler, 9, False, layout="pack")
    with Loader(collate=TokenCollator(ds, layout="pack"), sampler=sampler, batch_size=9) as loader:
        assert_same_batches(list(loader), expected)
    with pytest.raises(TypeError, match="either collate= or a source"):
        Loader(stores["u2"], collate=TokenCollator(ds), batch_size=9)


# -- buffers ----------------------------------------------------------------------------------


def test_a_held_batch_is_never_overwritten(stores: dict[str, Path]) -> None:
    sampler = GlobalShuffleSampler(N, seed=4, rank=0, world_size=1)
    expected = reference(stores["u2"], sampler, 8, False, dtype=torch.long)
    with Loader(stores["u2"], sampler=sampler, batch_size=8, dtype=torch.long, depth=1, threads=2) as loader:
        held = list(loader)  # every batch kept while the ring goes round many times
    assert_same_batches(held, expected)
    # One slice of the tokens alone keeps its batch's buffer too.
    with Loader(stores["u2"], sampler=sampler, batch_size=8, dtype=torch.long, depth=1) as loader:
        rows = [b["tokens"][0] for b in loader]
    assert [r.tolist() for r in rows] == [e["tokens"][0].tolist() for e in expected]


def test_kept_lengths_hold_no_buffer(stores: dict[str, Path]) -> None:
    # A loop that keeps every batch's lengths (for logging) must not keep every batch's buffer.
    with Loader(
        stores["u2"], batch_size=8, dtype=torch.long, depth=2, fixed_length=True, max_length=30
    ) as loader:
        kept = [(b["lengths"], b["indices"], b["tokens"].data_ptr()) for b in loader]
    assert len({ptr for _, _, ptr in kept}) == 4  # depth + 2 buffers, for 30 batches
    assert [i for _, idx, _ in kept for i in idx.tolist()] == list(range(N))


def test_buffers_are_reused_when_dropped(stores: dict[str, Path]) -> None:
    with Loader(
        stores["u2"], batch_size=8, dtype=torch.long, depth=2, fixed_length=True, max_length=30
    ) as loader:
        addresses = {b["tokens"].data_ptr() for b in loader}
    assert len(addresses) == 4  # depth + 2 buffers, for 30 batches


def test_pin_memory_without_cuda_gives_plain_memory(stores: dict[str, Path]) -> None:
    if torch.cuda.is_available():
        with Loader(stores["u2"], batch_size=8, pin_memory=True) as loader:
            assert all(t.is_pinned() for b in loader for t in b.values())
    else:
        with Loader(stores["u2"], batch_size=8, pin_memory=True) as loader:
            assert not next(iter(loader))["tokens"].is_pinned()


# -- resume -----------------------------------------------------------------------------------


def flat_indices(batches: list[dict[str, Any]]) -> list[int]:
    return [i for b in batches for i in b["indices"].tolist()]


@pytest.mark.parametrize("data", DATA)
@pytest.mark.parametrize("kind", ["global", "mixture"])
@pytest.mark.parametrize(("world_before", "world_after"), [(1, 1), (1, 3), (3, 1), (3, 2)])
def test_resume_is_exact(
    stores: dict[str, Path], data: str, kind: str, world_before: int, world_after: int
) -> None:
    def make(rank: int, world: int) -> Any:
        if kind == "global":
            return GlobalShuffleSampler(N, seed=8, rank=rank, world_size=world)
        return MixtureSampler(Mixture([100, 140], [0.6, 0.4]), seed=8, rank=rank, world_size=world)

    b = 6
    whole = make(0, 1)
    order = flat_indices(list(Loader(stores[data], sampler=whole, batch_size=b)))
    # Each rank stops after k batches, with more prefetched (depth 4): the state is at k.
    k = 5
    states = []
    first: list[list[int]] = []
    for rank in range(world_before):
        with Loader(stores[data], sampler=make(rank, world_before), batch_size=b, depth=4) as loader:
            it = iter(loader)
            got = [next(it) for _ in range(k)]
            states.append(loader.state_dict())
        first.append(flat_indices(got))
    assert all(s["consumed"] == states[0]["consumed"] for s in states)
    assert states[0]["consumed"] == k * b * world_before
    rest: list[list[int]] = []
    for rank in range(world_after):
        with Loader(stores[data], sampler=make(rank, world_after), batch_size=b) as loader:
            loader.load_state_dict(states[0])
            rest.append(flat_indices(list(loader)))
    # Interleaving the ranks' streams gives the world-size-1 order (each rank's padding wraps).
    seen = [x for step in zip(*first, strict=True) for x in step]
    seen += [x for step in zip(*rest, strict=True) for x in step]
    m = len(order)
    assert seen[:m] == order
    assert len(seen) - m < world_after  # the last step's padding


def test_the_sampler_alone_refuses_to_answer_ahead_of_the_loop(stores: dict[str, Path]) -> None:
    sampler = GlobalShuffleSampler(N, seed=1, rank=0, world_size=1)
    with Loader(stores["u2"], sampler=sampler, batch_size=7, depth=4) as loader:
        it = iter(loader)
        next(it)
        with pytest.raises(RuntimeError, match="ahead of the training loop"):
            sampler.state_dict()  # it has handed out more than the loop received
        assert loader.state_dict()["consumed"] == 7


def test_state_after_a_whole_pass_and_before_any(stores: dict[str, Path]) -> None:
    sampler = GlobalShuffleSampler(N, seed=1, rank=0, world_size=1)
    loader = Loader(stores["u2"], sampler=sampler, batch_size=7)
    assert loader.state_dict()["consumed"] == 0
    list(loader)
    assert loader.state_dict()["consumed"] == N
    loader.close()


def test_state_of_other_data_is_refused(stores: dict[str, Path]) -> None:
    sampler = GlobalShuffleSampler(N, seed=1, rank=0, world_size=1)
    with Loader(stores["u2"], sampler=sampler, batch_size=7) as loader:
        state = loader.state_dict()
    with (
        Loader(stores["i4"], sampler=sampler, batch_size=7) as other,
        pytest.raises(smstore.StoreChangedError),
    ):
        other.load_state_dict(state)
    with Loader(stores["u2"], batch_size=7) as plain, pytest.raises(TypeError, match="no state_dict"):
        plain.state_dict()


# -- bad input --------------------------------------------------------------------------------


def test_indices_out_of_range(stores: dict[str, Path]) -> None:
    with Loader(stores["u2"], sampler=[0, 1, N], batch_size=2) as loader:
        it = iter(loader)
        with pytest.raises(smstore.RecordIndexError, match=r"u2\.smst: the sampler gave record index 240"):
            next(it)
    with Loader(stores["u2"], sampler=[-1], batch_size=2) as loader, pytest.raises(IndexError):
        list(loader)
    with pytest.raises(IndexError):
        TokenCollator(stores["u2"])([0, N])
    # Our sampler of a larger dataset: its chunk arrives as an array, each index checked.
    with (
        Loader(stores["u2"], sampler=GlobalShuffleSampler(N + 50, seed=0), batch_size=8) as loader,
        pytest.raises(smstore.RecordIndexError, match=r"u2\.smst: the sampler gave record index 2[4-8]\d"),
    ):
        list(loader)


def test_records_of_partial_items(tmp_path: Path) -> None:
    ragged = tmp_path / "ragged.smst"
    w = smstore._core.Writer(str(ragged), False)
    w.extend([b"\x01\x00", b"\x01\x00\x02"])
    w.finish(build_metadata("npy:<u2"))
    with (
        Loader(ragged, batch_size=2) as loader,
        pytest.raises(
            smstore.StoreFormatError, match=r"ragged\.smst: record 1 of 3 bytes is not a whole number"
        ),
    ):
        list(loader)


def test_bad_arguments(stores: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        Loader(stores["u2"], batch_size=0)
    with pytest.raises(ValueError, match="depth"):
        Loader(stores["u2"], batch_size=2, depth=0)
    with pytest.raises(ValueError, match="threads must be an integer >= 0"):
        Loader(stores["u2"], batch_size=2, threads=-1)
    with pytest.raises(TypeError, match="needs a source"):
        Loader(batch_size=2)
    with pytest.raises(smstore.StoreNotFoundError, match=r"missing\.smst"):
        Loader(stores["u2"].parent / "missing.smst", batch_size=2)


def test_wrong_store(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign.bin"
    foreign.write_bytes(b"\0" * 200)
    with pytest.raises(smstore.StoreFormatError, match=r"foreign\.bin: not an smstore blob"):
        Loader(foreign, batch_size=2)


def test_sharded_indices_out_of_range_name_the_dataset(stores: dict[str, Path]) -> None:
    manifest = r"u2-sharded/manifest\.json"
    with Loader(stores["u2-sharded"], sampler=[0, 1, N], batch_size=2) as loader:
        it = iter(loader)
        with pytest.raises(smstore.RecordIndexError, match=rf"{manifest}: the sampler gave record index 240"):
            next(it)
    with (
        Loader(stores["u2-sharded"], sampler=GlobalShuffleSampler(N + 50, seed=0), batch_size=8) as loader,
        pytest.raises(smstore.RecordIndexError, match=rf"{manifest}: the sampler gave record index 2[4-8]\d"),
    ):
        list(loader)


def test_a_shard_changed_since_its_manifest_raises_what_the_dataloader_raises(
    stores: dict[str, Path], tmp_path: Path
) -> None:
    import shutil

    data = tmp_path / "ds"
    shutil.copytree(stores["u2-sharded"], data)
    loader = Loader(data, batch_size=16)  # no shard opened yet
    slow = DataLoader(range(N), batch_size=16, collate_fn=TokenCollator(data))
    # Shard 1 re-packed with other records of the same sizes: the same file size, another checksum.
    shard = Path(read_manifest(data).shard_path(1))
    starts = smstore.open(data).starts
    with smstore.ShardedWriter(f"{tmp_path / 'other'}/", encoding="npy:<u2", durable=False) as w:
        w.extend(record(i).astype(np.uint16) + 1 for i in range(starts[1], starts[2]))
    other = Path(read_manifest(tmp_path / "other").shard_path(0))
    assert other.stat().st_size == shard.stat().st_size
    os.replace(other, shard)
    match = r"shard 1 .* holds checksum .* the manifest records"
    with pytest.raises(smstore.StoreChangedError, match=match):
        list(slow)
    with loader, pytest.raises(smstore.StoreChangedError, match=match):
        list(loader)


class Releasing:
    """A sampler that releases every open shard of `store` before each index it gives: the shards
    of batches queued before are unmapped by the store while those batches are made."""

    def __init__(self, store: Any, order: list[int]) -> None:
        self.store, self.order = store, order

    def __iter__(self) -> Any:
        for i in self.order:
            for k in range(self.store.shard_count):
                self.store.release_shard(k)
            yield i


def test_queued_batches_keep_their_shards_mapped(stores: dict[str, Path]) -> None:
    order = GlobalShuffleSampler(N, seed=2, rank=0, world_size=1)
    expected = reference(stores["u2-sharded"], order, 5, False, dtype=torch.long)
    collate = TokenCollator(stores["u2-sharded"], dtype=torch.long)
    for threads in (0, 2):
        sampler = Releasing(collate.store, list(order))
        with Loader(collate=collate, sampler=sampler, batch_size=5, depth=6, threads=threads) as loader:
            got = [{k: v.clone() for k, v in b.items()} for b in loader]
        assert_same_batches(got, expected)


def test_a_windowed_pass_keeps_few_shards_open(stores: dict[str, Path]) -> None:
    """The store's auto_release counts the Loader's reads: the shards of past windows are released
    as the pass goes on, as they are for reads through the store."""
    collate = TokenCollator(stores["big-sharded"], dtype=torch.long)
    store = collate.store
    sampler = WindowedShuffleSampler(
        store.shard_sizes, window=2, seed=1, rank=0, world_size=1, residency=False
    )
    most = 0
    with Loader(collate=collate, sampler=sampler, batch_size=8) as loader:
        for _ in loader:
            most = max(most, store.open_shard_count)
    assert store.shard_count == 8
    assert most <= 5  # two windows of two, and one more about to be released


def test_sharded_dataset_source(stores: dict[str, Path]) -> None:
    ds = smstore.SharedStoreDataset(stores["u2-sharded"])
    sampler = GlobalShuffleSampler(N, seed=2, rank=0, world_size=1)
    expected = reference(stores["u2-sharded"], sampler, 9, False, layout="pack")
    with Loader(ds, sampler=sampler, batch_size=9, layout="pack") as loader:
        assert_same_batches(list(loader), expected)


@pytest.mark.parametrize("layout", ["pad", "pack"])
def test_sharded_dataset_served_by_the_daemon(
    stores: dict[str, Path], start_daemon: Any, layout: str, tmp_path: Path
) -> None:
    """Shards loaded by a real daemon as a WindowedShuffleSampler holds them: the Loader opens each
    (waiting for its load as a DataLoader worker would) and yields the DataLoader's batches."""
    import shutil

    data = tmp_path / "ds"
    shutil.copytree(stores["big-sharded"], data)
    start_daemon(loaded=0)

    def make(ds: Any) -> Any:
        return WindowedShuffleSampler(ds, window=2, seed=4, rank=0, world_size=1, lag=64)

    mmapped = smstore.SharedStoreDataset(data, mode="mmap")
    expected = reference(data, make(mmapped), 16, False, layout=layout, max_length=9)
    ds = smstore.SharedStoreDataset(data, mode="daemon")
    sampler = make(ds)
    try:
        with Loader(ds, sampler=sampler, batch_size=16, layout=layout, max_length=9, depth=3) as loader:
            got = list(loader)
        assert sampler.residency.kind == "daemon"
    finally:
        sampler.close()
    assert_same_batches(got, expected)


# -- shutdown and fork ------------------------------------------------------------------------


def tasks() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def loader_fds(root: Path) -> set[str]:
    """This process's descriptors of the kinds a Loader could leave open (its store's files under
    `root`, pipes, event fds, shared memory), as "fd -> target": threads that earlier tests left
    behind (read-ahead of shard files, daemon clients) open and close their own meanwhile (seen
    under ASan in CI, where everything runs slower)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since listed
            continue
        if target.startswith((str(root), "pipe:", "anon_inode:", "/memfd:")) or "/dev/shm" in target:
            out.add(f"{fd} -> {target}")
    return out


def left_behind(before: tuple[set[str], set[str]], root: Path) -> tuple[set[str], set[str]]:
    """The threads and descriptors of this process now that were not there `before` (as sets: a
    thread of something else that ends meanwhile does not count)."""
    gc.collect()
    return tasks() - before[0], loader_fds(root) - before[1]


@pytest.mark.parametrize("data", DATA)
def test_clean_shutdown_mid_epoch(stores: dict[str, Path], data: str) -> None:
    sampler = GlobalShuffleSampler(N, seed=1, rank=0, world_size=1)
    # mode="mmap": the threads counted are the Loader's alone (a sharded dataset's reads in mode
    # "auto" start the pre-attaching thread, which ends soon after without a daemon).
    smstore.Store(stores["u2"]).close()  # the unmap thread, if any, starts before the count
    gc.collect()
    root = stores[data].parent
    before = tasks(), loader_fds(root)
    nothing: tuple[set[str], set[str]] = (set(), set())
    loader = Loader(stores[data], sampler=sampler, mode="mmap", batch_size=4, threads=3, depth=3)
    it = iter(loader)
    next(it)
    assert len(tasks() - before[0]) == 3
    loader.close()
    assert left_behind(before, root) == nothing
    with pytest.raises(StopIteration):
        next(it)
    # Stopping by dropping the loader, or leaving a with block, does the same.
    loader = Loader(stores[data], sampler=sampler, mode="mmap", batch_size=4, threads=2)
    it = iter(loader)
    next(it)
    del loader, it
    assert left_behind(before, root) == nothing
    with Loader(stores[data], sampler=sampler, mode="mmap", batch_size=4) as loader:
        next(iter(loader))
    assert left_behind(before, root) == nothing
    # A new pass ends the one before it, threads included.
    loader = Loader(stores[data], sampler=sampler, mode="mmap", batch_size=4, threads=2)
    old = iter(loader)
    next(old)
    new = iter(loader)
    next(new)
    assert len(tasks() - before[0]) == 2
    loader.close()
    assert left_behind(before, root) == nothing


@pytest.mark.parametrize("data", DATA)
def test_fork_after_start_does_not_deadlock(stores: dict[str, Path], data: str) -> None:
    sampler = GlobalShuffleSampler(N, seed=1, rank=0, world_size=1)
    expected = reference(stores[data], sampler, 4, False)
    loader = Loader(stores[data], sampler=sampler, batch_size=4, threads=2, depth=8)
    it = iter(loader)
    next(it)  # the threads are filling the ring while we fork
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's cleanup
        code = 1
        try:
            os.close(read)
            try:
                next(it)
                message = "the parent's pass went on in the child"
            except smstore.StoreClosedError as e:
                message = "refused" if "fork" in str(e) else f"wrong message: {e}"
            batches = list(loader)  # a new pass starts threads of its own
            ok = flat_indices(batches) == flat_indices(expected)
            loader.close()
            del it, loader
            gc.collect()
            os.write(write, f"{message} {ok}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    ready: list[int] = []
    try:
        ready, _, _ = select.select([read], [], [], 60)  # a deadlocked child never writes
        report = os.read(read, 200).decode() if ready else "no answer: the child hangs"
    finally:
        os.close(read)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    assert report == "refused True"
    assert os.waitstatus_to_exitcode(status) == 0
    # The parent's pass is unharmed.
    rest = [next(it)["indices"].tolist() for _ in range(3)]
    assert rest == [b["indices"].tolist() for b in expected[1:4]]
    loader.close()


def test_generator_samplers_give_their_items_in_order(stores: dict[str, Path]) -> None:
    # The Loader takes a generator's items from the list it yields from (gi_yieldfrom): the
    # items around, between and inside such lists must come out as the generator yields them.
    class Sampler:
        def __iter__(self) -> Any:
            yield 3
            yield from [5, 6, 7]
            yield from (i * 2 for i in range(4))  # a generator, not a list
            yield from []
            yield 9
            yield from list(range(100, 131))
            yield 1

    expected = list(Sampler())
    for batch_size in (1, 4, 7, 64):
        with Loader(stores["u2"], sampler=Sampler(), batch_size=batch_size) as loader:
            assert flat_indices(list(loader)) == expected


def test_list_items_taken_in_bulk_are_checked_one_by_one(stores: dict[str, Path]) -> None:
    # submit_from takes a yielded-from list's exact ints in bulk; any other item (a numpy integer,
    # a bool, an int subclass) ends the bulk run and is taken through its __index__, in its place.
    class Flag(int):
        pass

    items = [4, np.int64(8), 2, True, Flag(11), *range(20, 60), np.uint16(3), 0]

    class Sampler:
        def __iter__(self) -> Any:
            yield from list(items)
            yield from [7, 7]

    expected = [int(i) for i in items] + [7, 7]
    for batch_size in (1, 5, 64):
        with Loader(stores["u2"], sampler=Sampler(), batch_size=batch_size, depth=1) as loader:
            assert flat_indices(list(loader)) == expected

    class Bad:
        def __init__(self, bad: Any) -> None:
            self.bad = bad

        def __iter__(self) -> Any:
            yield from [1, 2, 3, self.bad, 4]

    match = r"the sampler gave record index 240"
    with (
        Loader(stores["u2"], sampler=Bad(N), batch_size=2) as loader,
        pytest.raises(smstore.RecordIndexError, match=match),
    ):
        list(loader)
    with Loader(stores["u2"], sampler=Bad(2**70), batch_size=2) as loader, pytest.raises(IndexError):
        list(loader)


def test_the_loops_thread_makes_batches_beside_the_threads(stores: dict[str, Path]) -> None:
    # next() makes the next unstarted batch of the window itself while the one asked for is not
    # ready: with every batch held (no buffer reused) and with them dropped, the batches are the
    # DataLoader's, for every depth and thread count.
    sampler = GlobalShuffleSampler(N, seed=8, rank=0, world_size=1)
    expected = reference(stores["u2"], sampler, 3, False, dtype=torch.long, max_length=9)
    for threads in (0, 1, 3):
        for depth in (1, 2, 5):
            with Loader(
                stores["u2"],
                sampler=sampler,
                batch_size=3,
                threads=threads,
                depth=depth,
                dtype=torch.long,
                max_length=9,
            ) as loader:
                held = list(loader)
                dropped = [{k: v.clone() for k, v in b.items()} for b in loader]
                slow = []  # a loop with a step: the threads work ahead of it
                for b in loader:
                    slow.append({k: v.clone() for k, v in b.items()})
                    time.sleep(0.0005)
            assert_same_batches(held, expected)
            assert_same_batches(dropped, expected)
            assert_same_batches(slow, expected)


CLOSE_FROM_THE_SAMPLER = """
import sys, threading
import smstore
from smstore import Loader, StoreClosedError

path, how = sys.argv[1], sys.argv[2]
holder = {}


class ClosingSampler:
    def __iter__(self):
        for i in range(200):
            if i == 3:
                if how == "close":
                    holder["loader"].close()
                else:
                    iter(holder["loader"])  # a new pass ends this one, threads and ring included
            yield i


loader = Loader(path, sampler=ClosingSampler(), batch_size=4, threads=2, depth=4)
holder["loader"] = loader
try:
    got = list(loader)
except StoreClosedError as e:
    print("closed:", e)
else:
    print("ended after", len(got))
"""


@pytest.mark.parametrize("how", ["close", "new pass"])
def test_a_sampler_that_closes_the_loader_mid_draw_is_refused_not_a_crash(
    stores: dict[str, Path], how: str
) -> None:
    """The sampler's code runs inside the draw (submit_from): a close() or a new pass there used to
    free the Batcher under the draw, which then used it (a segfault); run in a child so that the old
    code fails the test instead of ending the run."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", CLOSE_FROM_THE_SAMPLER, str(stores["u2"]), how],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "loader is closed" in r.stdout, r.stdout


# -- token windows ----------------------------------------------------------------------------


def token_stream(eod: int | None) -> np.ndarray:
    """The documents of the u2 stores concatenated, each followed by eod when given."""
    tail = [] if eod is None else [eod]
    return np.concatenate([np.r_[record(i), tail].astype(np.int64) for i in range(N)])


@pytest.mark.parametrize("threads", [0, 2])
@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint16])
@pytest.mark.parametrize(("length", "eod"), [(1, None), (7, 65001), (40, None), (300, 0)])
@pytest.mark.parametrize("data", DATA)
def test_token_windows_are_the_dataloaders_batches(
    stores: dict[str, Path], data: str, length: int, eod: int | None, dtype: Any, threads: int
) -> None:
    windows = smstore.TokenWindows(stores[data], length, eod=eod, dtype=dtype)
    sampler = GlobalShuffleSampler(len(windows), seed=4, rank=0, world_size=1)
    expected = list(DataLoader(windows, batch_size=5, sampler=sampler))  # the default collate
    with Loader(windows, sampler=sampler, batch_size=5, threads=threads) as loader:
        got = list(loader)
    assert len(got) == len(expected) == len(loader)
    whole, order = token_stream(eod), list(sampler)
    for n, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert list(g) == ["tokens", "indices"]
        assert g["tokens"].dtype == e.dtype
        assert g["tokens"].shape == e.shape
        assert g["tokens"].numpy().tobytes() == e.numpy().tobytes()
        assert g["indices"].tolist() == order[n * 5 : n * 5 + 5]
        # And against the stream itself (not TokenWindows' own reads).
        for row, k in zip(g["tokens"].numpy(), g["indices"].tolist(), strict=True):
            assert np.array_equal(row, whole[k * length : k * length + length + 1].astype(dtype))


@pytest.mark.parametrize("data", DATA)
def test_token_windows_locate_is_the_cores_rule(stores: dict[str, Path], data: str) -> None:
    # TokenWindows.locate and the Loader's threads share one rule (_core.locate_in_shard): check
    # it against the stream's own document boundaries, for every token, with and without eod.
    for eod in (None, 5):
        windows = smstore.TokenWindows(stores[data], 7, eod=eod)
        per_doc = 0 if eod is None else 1
        starts = np.cumsum([0] + [len(record(i)) + per_doc for i in range(N)])
        for t in range(windows.tokens):
            doc = int(np.searchsorted(starts, t, side="right")) - 1
            assert windows.locate(t) == (doc, t - int(starts[doc])), t


def assert_resumes_exactly(
    loader_of: Any, make: Any, world_before: int, world_after: int, k: int = 4
) -> list[dict[str, Any]]:
    """Every rank of world_before stops after k batches (more prefetched) and saves its state; every
    rank of world_after resumes from rank 0's: the ranks' batches interleaved are the order of
    world size 1, continued exactly (the last step padded). Returns the states saved."""
    order = flat_indices(list(loader_of(make(0, 1))))
    states, first, rest = [], [], []
    for rank in range(world_before):
        with loader_of(make(rank, world_before)) as loader:
            it = iter(loader)
            first.append(flat_indices([next(it) for _ in range(k)]))
            states.append(loader.state_dict())
    assert all(s["consumed"] == states[0]["consumed"] for s in states)
    for rank in range(world_after):
        with loader_of(make(rank, world_after)) as loader:
            loader.load_state_dict(states[0])
            rest.append(flat_indices(list(loader)))
    seen = [x for step in zip(*first, strict=True) for x in step]
    seen += [x for step in zip(*rest, strict=True) for x in step]
    assert seen[: len(order)] == order
    assert len(seen) - len(order) < world_after
    return states


@pytest.mark.parametrize(("world_before", "world_after"), [(4, 3), (4, 8), (1, 3)])
@pytest.mark.parametrize("data", DATA)
def test_token_windows_resume_at_another_world_size(
    stores: dict[str, Path], data: str, world_before: int, world_after: int
) -> None:
    windows = smstore.TokenWindows(stores[data], 9, eod=0)

    def make(rank: int, world: int) -> Any:
        return GlobalShuffleSampler(len(windows), seed=2, rank=rank, world_size=world)

    states = assert_resumes_exactly(
        lambda sampler: Loader(windows, sampler=sampler, batch_size=3), make, world_before, world_after
    )
    assert states[0]["consumed"] == 4 * 3 * world_before


def test_token_windows_bad_input_is_a_store_error(stores: dict[str, Path], tmp_path: Path) -> None:
    windows = smstore.TokenWindows(stores["u2-sharded"], 16)
    n = len(windows)
    with (
        Loader(windows, sampler=[0, n], batch_size=2) as loader,
        pytest.raises(
            smstore.RecordIndexError, match=r"u2-sharded.*the sampler gave record index \d+, out of range"
        ),
    ):
        list(loader)
    with pytest.raises(TypeError, match="no TokenCollator options"):
        Loader(windows, dtype=torch.long)
    # Windows made over other data than the store now holds: refused at once, or named per batch.
    other = smstore.TokenWindows(stores["u2"], 16)
    other._record_starts = np.array([0, N + 1], dtype=np.int64)
    with pytest.raises(
        smstore.StoreFormatError, match=r"u2\.smst: the token windows were made over 241 records"
    ):
        list(Loader(other, batch_size=2))
    longer = smstore.TokenWindows(stores["u2"], 16)
    longer._token_starts = np.array(
        [0, longer.tokens + 1000], dtype=np.int64
    )  # as if the blob had more tokens
    with (
        Loader(longer, sampler=[len(longer) + 50], batch_size=1) as loader,
        pytest.raises(smstore.StoreFormatError, match=r"u2\.smst: document \d+ .*made over other data"),
    ):
        list(loader)
    # Records that are not whole tokens (an odd number of bytes under npy:<u2>).
    odd = tmp_path / "odd.smst"
    w = smstore._core.Writer(str(odd), False)
    w.extend([b"\x01\x00", b"\x01\x00\x02\x00\x03"])
    w.finish(build_metadata("npy:<u2"))
    with (
        Loader(smstore.TokenWindows(odd, 1), sampler=[1], batch_size=1) as loader,
        pytest.raises(
            smstore.StoreFormatError,
            match=r"odd\.smst: record 1 of 5 bytes is not a whole number of 2-byte tokens",
        ),
    ):
        list(loader)


@pytest.mark.parametrize("group", [2, 3, 1024])
@pytest.mark.parametrize(("length", "eod"), [(1, None), (7, 65001), (40, 0)])
@pytest.mark.parametrize("data", DATA)
def test_shuffled_token_windows_are_the_dataloaders_batches_every_epoch(
    stores: dict[str, Path], data: str, length: int, eod: int | None, group: int
) -> None:
    # Every window in turn (every token of the stream) and a global shuffle of them, for several
    # epochs: the threads' descent of the groups (keys, bounds, order) is TokenWindows'.
    windows = smstore.TokenWindows(stores[data], length, eod=eod, dtype=np.int32, seed=3, group=group)
    sampler = GlobalShuffleSampler(len(windows), seed=4, rank=0, world_size=1)
    firsts = []
    with Loader(windows, sampler=sampler, batch_size=6, threads=2) as shuffled:
        for epoch in range(3):
            shuffled.set_epoch(epoch)  # the sampler's and the windows' epoch
            assert windows.epoch == epoch
            expected = list(DataLoader(windows, batch_size=6, sampler=sampler))
            with Loader(windows, batch_size=6, threads=1) as in_turn:
                every = list(in_turn)
            assert_same_windows(every, list(DataLoader(windows, batch_size=6)))
            got = list(shuffled)
            assert_same_windows(got, expected)
            firsts.append(every[0]["tokens"].numpy().tobytes())
    assert len(set(firsts)) > 1  # the epochs' orders differ


def assert_same_windows(got: list[dict[str, Any]], expected: list[Any]) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g["tokens"].dtype == e.dtype
        assert g["tokens"].numpy().tobytes() == e.numpy().tobytes()


def test_set_epoch_on_the_windows_reaches_the_next_pass(stores: dict[str, Path]) -> None:
    windows = smstore.TokenWindows(stores["u2-sharded"], 9, eod=1, seed=7, group=4)
    loader = Loader(windows, batch_size=8)
    for epoch in (2, 0, 5):
        windows.set_epoch(epoch)  # not through the Loader: its next pass still reads this order
        assert_same_windows(list(loader), list(DataLoader(windows, batch_size=8)))
    loader.close()


@pytest.mark.parametrize(("world_before", "world_after"), [(4, 3), (4, 8)])
@pytest.mark.parametrize("data", DATA)
def test_shuffled_token_windows_resume_at_another_world_size(
    stores: dict[str, Path], data: str, world_before: int, world_after: int
) -> None:
    windows = smstore.TokenWindows(stores[data], 9, eod=0, seed=11, epoch=1, group=3)

    def make(rank: int, world: int) -> Any:
        sampler = GlobalShuffleSampler(len(windows), seed=2, rank=rank, world_size=world)
        sampler.set_epoch(1)
        return sampler

    def loader_of(sampler: Any) -> Loader:
        return Loader(windows, sampler=sampler, batch_size=3)

    assert_resumes_exactly(loader_of, make, world_before, world_after)
    # And the tokens the resumed ranks receive are the windows' (the document order of epoch 1).
    with loader_of(make(1, world_after)) as loader:
        got = list(loader)
    assert_same_windows(got, list(DataLoader(windows, sampler=make(1, world_after), batch_size=3)))


def test_shuffled_windows_over_other_data_are_named(stores: dict[str, Path]) -> None:
    longer = smstore.TokenWindows(stores["u2"], 16, seed=1, group=2)
    longer._token_starts = np.array([0, longer.tokens + 1000], dtype=np.int64)
    with (
        Loader(longer, sampler=[len(longer) + 50], batch_size=1) as loader,
        pytest.raises(smstore.StoreFormatError, match=r"u2\.smst: document \d+ .*made over other data"),
    ):
        list(loader)


def test_token_windows_close_and_new_pass(stores: dict[str, Path]) -> None:
    windows = smstore.TokenWindows(stores["u2-sharded"], 11, eod=1)
    loader = Loader(windows, batch_size=4, threads=2)
    first = next(iter(loader))
    again = next(iter(loader))  # a new pass starts over
    assert torch.equal(first["tokens"], again["tokens"])
    loader.close()
    assert torch.equal(first["tokens"], torch.from_numpy(np.stack([windows[k] for k in range(4)])))
    assert "TokenWindows" in repr(loader)


# -- packed bins ------------------------------------------------------------------------------


def assert_same_bins(
    got: list[dict[str, Any]], expected: list[dict[str, Any]], order: list[int], size: int
) -> None:
    assert len(got) == len(expected)
    for n, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert list(g) == [*e, "indices"]
        for key in e:
            assert str(g[key].numpy().dtype) == str(e[key].dtype), key
            assert g[key].shape == e[key].shape, key
            assert g[key].numpy().tobytes() == e[key].tobytes(), key
        assert g["indices"].tolist() == order[n * size : n * size + size]


@pytest.mark.parametrize("threads", [0, 2])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(
    ("length", "eod", "pad", "dtype"),
    [(16, None, 0, np.int64), (16, 65001, 7, np.int32), (40, 0, 65535, np.uint16), (1, None, 3, np.int64)],
)
@pytest.mark.parametrize("data", DATA)
def test_packed_bins_are_the_dataloaders_batches(
    stores: dict[str, Path],
    data: str,
    length: int,
    eod: int | None,
    pad: int,
    dtype: Any,
    drop_last: bool,
    threads: int,
) -> None:
    bins = smstore.PackedBins(stores[data], length, eod=eod, pad=pad, dtype=dtype, group=50, seed=1)
    sampler = GlobalShuffleSampler(len(bins), seed=4, rank=0, world_size=1)
    expected = list(
        DataLoader(
            bins, sampler=sampler, batch_size=7, drop_last=drop_last, collate_fn=smstore.PackedBins.collate
        )
    )
    with Loader(bins, sampler=sampler, batch_size=7, drop_last=drop_last, threads=threads) as loader:
        got = list(loader)
        assert len(got) == len(loader)
    assert_same_bins(got, expected, list(sampler), 7)


@pytest.mark.parametrize(("world_before", "world_after"), [(4, 3), (4, 8)])
@pytest.mark.parametrize("data", DATA)
def test_packed_bins_resume_at_another_world_size(
    stores: dict[str, Path], data: str, world_before: int, world_after: int
) -> None:
    bins = smstore.PackedBins(stores[data], 24, eod=0, group=64)

    def make(rank: int, world: int) -> Any:
        return GlobalShuffleSampler(len(bins), seed=9, rank=rank, world_size=world)

    states = assert_resumes_exactly(
        lambda sampler: Loader(bins, sampler=sampler, batch_size=2), make, world_before, world_after
    )
    assert states[0]["consumed"] == 4 * 2 * world_before
    with Loader(bins, sampler=make(2, world_after), batch_size=2) as loader:
        loader.load_state_dict(states[0])
        got = list(loader)
    rest = make(2, world_after)
    rest.load_state_dict({k: v for k, v in states[0].items() if k != "store_checksum"})
    expected = list(DataLoader(bins, sampler=rest, batch_size=2, collate_fn=smstore.PackedBins.collate))
    assert_same_bins(got, expected, [k for b in got for k in b["indices"].tolist()], 2)


def test_packed_bins_bad_input_is_refused(stores: dict[str, Path]) -> None:
    bins = smstore.PackedBins(stores["u2-sharded"], 16, eod=1, group=50)
    with pytest.raises(ValueError, match="bins not padded do not stack"):
        Loader(smstore.PackedBins(stores["u2"], 16, pad=None), batch_size=2)
    with pytest.raises(TypeError, match="no TokenCollator options"):
        Loader(bins, dtype=torch.long)
    with pytest.raises(TypeError, match="not with collate="):
        Loader(bins, collate=TokenCollator(stores["u2"]))
    for index in (len(bins), -1):
        with (
            Loader(bins, sampler=[0, index], batch_size=1) as loader,
            pytest.raises(smstore.RecordIndexError, match=rf"u2-sharded.*bin index {index}, out of range"),
        ):
            list(loader)
    # Bins whose segments name more tokens than their document holds (made over other data).
    other = smstore.PackedBins(stores["u2"], 16, eod=1, group=50)
    other.batch_segments = lambda ks: np.array([[0, 2, 0, 15]], dtype=np.int64)  # type: ignore[method-assign]
    with (
        Loader(other, sampler=[0], batch_size=1) as loader,
        pytest.raises(smstore.StoreFormatError, match=r"u2\.smst: document 2 .*made over other data"),
    ):
        list(loader)
    assert "PackedBins" in repr(Loader(bins))


# -- mixtures of several stores ---------------------------------------------------------------


def mixture_of(stores: dict[str, Path], weights: tuple[float, ...] = (0.5, 0.3, 0.2)) -> Any:
    """Three sources of uint16 records: a blob, a sharded dataset (as a SharedStoreDataset) and another blob."""
    from smstore.sampling import MixtureDataset

    sources = [
        smstore.open(stores["u2"], raw=True),
        smstore.SharedStoreDataset(stores["big-sharded"], mode="mmap"),
        smstore.open(stores["big"], raw=True),
    ]
    return MixtureDataset(sources, list(weights))


MIXTURE_OPTIONS = [{}, {"layout": "pack"}, {"dtype": torch.long, "max_length": 6, "pad_value": -1}]


@pytest.mark.parametrize("options", MIXTURE_OPTIONS, ids=["default", "pack", "long,max6"])
@pytest.mark.parametrize(("world", "rank"), [(1, 0), (3, 1)])
def test_mixture_of_stores_is_the_dataloaders_batches(
    stores: dict[str, Path], world: int, rank: int, options: dict[str, Any]
) -> None:
    ds = mixture_of(stores)

    def make() -> Any:
        return MixtureSampler(ds, seed=6, rank=rank, world_size=world)

    # The slow path: the DataLoader reads each record through the MixtureDataset, TokenCollator
    # collates the records it is given.
    collate = TokenCollator(ds.sources[0], **options)
    expected = list(DataLoader(ds, sampler=make(), batch_size=11, collate_fn=collate))
    order = list(make())
    with Loader(ds, sampler=make(), batch_size=11, threads=2, **options) as loader:
        got = list(loader)
    assert len(got) == len(expected)
    for n, g in enumerate(got):
        assert g["indices"].tolist() == order[n * 11 : n * 11 + 11]
        del g["indices"]
    assert_same_batches(got, expected)
    assert "MixtureDataset" in repr(loader)


@pytest.mark.parametrize(("world_before", "world_after"), [(4, 3), (4, 8)])
def test_mixture_of_stores_resumes_at_another_world_size(
    stores: dict[str, Path], world_before: int, world_after: int
) -> None:
    ds = mixture_of(stores)

    def make(rank: int, world: int) -> Any:
        return MixtureSampler(ds, seed=9, rank=rank, world_size=world)

    b = 8
    states = assert_resumes_exactly(
        lambda sampler: Loader(ds, sampler=sampler, batch_size=b, depth=3), make, world_before, world_after
    )
    assert len(states[0]["store_checksum"]) == 3
    # A state of other sources is refused.
    with Loader(mixture_of(stores, (0.2, 0.3, 0.5)), batch_size=b) as other:
        other.sampler = make(0, 1)
        state = dict(states[0], store_checksum=[1, 2, 3])
        with pytest.raises(smstore.StoreChangedError, match=r"u2\.smst, .*big-sharded"):
            other.load_state_dict(state)


def test_mixture_bad_input_is_a_store_error(stores: dict[str, Path]) -> None:
    from smstore.sampling import MixtureDataset

    ds = mixture_of(stores)
    n = len(ds)
    with (
        Loader(ds, sampler=[0, n], batch_size=2) as loader,
        pytest.raises(
            smstore.RecordIndexError,
            match=r"a mixture of 3 sources \(.*u2\.smst, .*big-sharded.*record index \d+",
        ),
    ):
        list(loader)
    mixed = MixtureDataset(
        [smstore.open(stores["u2"], raw=True), smstore.open(stores["i4"], raw=True)], [1, 1]
    )
    with pytest.raises(ValueError, match="one dtype is needed"):
        Loader(mixed, batch_size=2)
    with pytest.raises(TypeError, match="not with collate="):
        Loader(ds, collate=TokenCollator(stores["u2"]))


# -- through a real daemon: windows of shards, block windows, token windows, mixtures, object storage --


def daemon_sampler(kind: str, ds: Any) -> Any:
    if kind == "windowed":
        return WindowedShuffleSampler(ds, window=2, seed=7, rank=0, world_size=1, lag=32)
    return BlockWindowSampler(ds, block=150, spread=2, seed=7, rank=0, world_size=1)


@pytest.mark.parametrize("kind", ["windowed", "block"])
def test_windows_and_blocks_of_a_dataset_served_by_the_daemon(
    stores: dict[str, Path], start_daemon: Any, kind: str, tmp_path: Path
) -> None:
    """The daemon loads what each sampler holds (whole shards, or blocks of records); the Loader
    opens each shard a batch reads through the dataset's opener and yields the DataLoader's batches."""
    import shutil

    data = tmp_path / "ds"
    shutil.copytree(stores["big-sharded"], data)
    start_daemon(loaded=0)
    mmapped = smstore.SharedStoreDataset(data, mode="mmap")
    reference_sampler = daemon_sampler(kind, mmapped)
    expected = reference(data, reference_sampler, 16, False, max_length=9)
    getattr(reference_sampler, "close", lambda: None)()
    ds = smstore.SharedStoreDataset(data, mode="daemon")
    sampler = daemon_sampler(kind, ds)
    source = ds if kind == "windowed" else block_reader(data, sampler)
    try:
        with Loader(source, sampler=sampler, batch_size=16, max_length=9, depth=3) as loader:
            got = list(loader)
        assert sampler.residency.kind == "daemon"
        if kind == "block":  # the daemon's pieces were read, not (only) the files
            assert source.block_reads > 0
    finally:
        sampler.close()
        getattr(source, "close", lambda: None)()
    assert_same_batches(got, expected)


def block_reader(data: Path, sampler: Any) -> Any:
    """What a block window's records are read through: the daemon's pieces, else the shard files."""
    from smstore.wire.blocks import BlockReader

    return BlockReader(data, block=sampler.block, keep=sampler.keep)


def test_token_windows_and_a_mixture_over_a_dataset_served_by_the_daemon(
    stores: dict[str, Path], start_daemon: Any, tmp_path: Path
) -> None:
    import shutil

    from smstore.sampling import MixtureDataset

    data = tmp_path / "ds"
    shutil.copytree(stores["u2-sharded"], data)
    shards = sorted(data.glob("*.smst"))
    start_daemon(*shards)  # every shard loaded: a global shuffle holds none
    ds = smstore.SharedStoreDataset(data, mode="daemon")
    windows = smstore.TokenWindows(ds, 33, eod=0)
    sampler = GlobalShuffleSampler(len(windows), seed=1, rank=0, world_size=1)
    expected = list(DataLoader(windows, batch_size=6, sampler=sampler))
    with Loader(windows, sampler=sampler, batch_size=6) as loader:
        got = [b["tokens"] for b in loader]
    assert [g.numpy().tobytes() for g in got] == [e.numpy().tobytes() for e in expected]
    mixture = MixtureDataset([ds, smstore.open(stores["u2"], raw=True)], [0.6, 0.4])
    sampler = MixtureSampler(mixture, seed=1, rank=0, world_size=1)
    expected = list(
        DataLoader(mixture, sampler=sampler, batch_size=6, collate_fn=TokenCollator(stores["u2"]))
    )
    with Loader(mixture, sampler=sampler, batch_size=6) as loader:
        got = list(loader)
    for g in got:
        del g["indices"]
    assert_same_batches(got, expected)


@pytest.mark.parametrize("kind", ["windowed", "block"])
def test_shards_in_object_storage_through_the_daemon(
    request: pytest.FixtureRequest, start_daemon: Any, kind: str, tmp_path: Path
) -> None:
    """A manifest naming its shards by URL (moto's S3): the daemon fetches what the sampler holds,
    the Loader reads it and yields the batches of the same records read from local files."""
    for module in ("obstore", "boto3", "moto.server"):
        pytest.importorskip(module, reason="the remote extra and moto[server] are needed")
    from remote_testlib import remote_dataset

    manifest, _data, _checksums = remote_dataset(request.getfixturevalue("s3"), tmp_path, f"loader-{kind}")
    local = tmp_path / f"loader-{kind}-local"  # the same shards, as files
    mmapped = smstore.SharedStoreDataset(local, mode="mmap")
    reference_sampler = daemon_sampler(kind, mmapped)
    expected = reference(local, reference_sampler, 32, False, layout="pack")
    getattr(reference_sampler, "close", lambda: None)()
    d = start_daemon(loaded=0)
    ds = smstore.SharedStoreDataset(manifest, mode="daemon")
    sampler = daemon_sampler(kind, ds)
    source = ds if kind == "windowed" else block_reader(manifest, sampler)
    try:
        with Loader(source, sampler=sampler, batch_size=32, layout="pack", depth=3) as loader:
            got = list(loader)
    finally:
        sampler.close()
        getattr(source, "close", lambda: None)()
    assert_same_batches(got, expected)
    # Each shard's bytes fetched once: as whole shards, or as the blocks held (never both).
    shards = sum(p.stat().st_size for p in local.glob("*.smst"))
    assert d.status()["metrics"]["fetched_bytes"] <= 1.1 * shards


@pytest.mark.parametrize("world_size", [1, 3])
def test_block_windows_through_a_block_reader_without_a_daemon(
    stores: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, world_size: int
) -> None:
    """No daemon answers: the reader gives each block as a run of its shard's file, and the
    Loader's batches are the DataLoader's; an index outside the dataset names its manifest."""
    from smstore.wire.blocks import BlockReader

    monkeypatch.setenv("SMSTORE_SOCKET", str(tmp_path / "none.sock"))
    data = stores["big-sharded"]
    for rank in range(world_size):
        sampler = BlockWindowSampler(
            smstore.SharedStoreDataset(data, mode="mmap"),
            block=170,
            spread=3,
            seed=2,
            rank=rank,
            world_size=world_size,
            residency=False,
        )
        expected = reference(data, sampler, 12, False, layout="pack")
        reader = BlockReader(data, block=170, keep=sampler.keep)
        with Loader(reader, sampler=sampler, batch_size=12, layout="pack") as loader:
            assert_same_batches(list(loader), expected)
        assert reader.file_reads > 0
        assert reader.block_reads == 0
        with (
            Loader(reader, sampler=[0, BIG], batch_size=2) as loader,
            pytest.raises(smstore.RecordIndexError, match=r"big-sharded.*record index 3000"),
        ):
            list(loader)
        reader.close()
