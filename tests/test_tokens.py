"""TokenWindows: samples of length + 1 tokens over documents concatenated, against the stream itself."""

from __future__ import annotations

import itertools
import pickle
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from smstore_testlib import token_datasets
from smstore_testlib import token_documents as documents

import smstore
from smstore.errors import StoreFormatError
from smstore.read.tokens import TokenWindows
from smstore.sampling.orders import FeistelPermutation

from .smstore_testlib import interleave, run_ranks, whole_order


def group_key(seed: int, epoch: int, shard: int, lo: int, hi: int) -> bytes:
    """The Feistel key that orders the parts of documents ``[lo, hi)`` of ``shard`` in an epoch
    (``shard`` -1: the order of the shards themselves): the oracle's, which the core's
    ``_core.shuffle_group`` must hash alike."""
    return b"smstore-token-docs:%d:%d:%d:%d:%d" % (seed, epoch, shard, lo, hi)


def group_bounds(lo: int, hi: int, group: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    """The bounds of the parts of documents ``[lo, hi)`` (the oracle's): each document when there
    are at most ``group`` of them, else ``group`` runs of consecutive documents of nearly equal counts."""
    if hi - lo <= group:
        return np.arange(lo, hi + 1, dtype=np.int64)
    return lo + np.arange(group + 1, dtype=np.int64) * (hi - lo) // group


def stream(docs: list[np.ndarray], eod: int | None) -> np.ndarray:
    parts = [np.append(d, eod).astype(np.int64) if eod is not None else d.astype(np.int64) for d in docs]
    return np.concatenate(parts)


@pytest.fixture(scope="module")
def token_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Path], list[np.ndarray]]:
    root = tmp_path_factory.mktemp("tokens")
    docs = documents(3000, 5)
    return token_datasets(root, docs), docs


@pytest.mark.parametrize("kind", ["blob", "sharded"])
@pytest.mark.parametrize("eod", [None, 0])
@pytest.mark.parametrize("length", [1, 7, 64, 2048])
def test_every_sample_is_its_slice_of_the_concatenated_documents(
    token_data: tuple[dict[str, Path], list[np.ndarray]], kind: str, eod: int | None, length: int
) -> None:
    paths, docs = token_data
    whole = stream(docs, eod)
    windows = TokenWindows(paths[kind], length, eod=eod)
    assert windows.tokens == len(whole)
    assert len(windows) == (len(whole) - 1) // length
    ks = np.unique(np.r_[0, len(windows) - 1, np.random.default_rng(length).integers(0, len(windows), 500)])
    for k in ks.tolist():
        sample = windows[k]
        assert sample.dtype == np.int64
        assert np.array_equal(sample, whole[k * length : k * length + length + 1]), k
    assert np.array_equal(windows[-1], windows[len(windows) - 1])


def test_locate_names_the_document_and_offset_of_every_token(
    token_data: tuple[dict[str, Path], list[np.ndarray]],
) -> None:
    paths, docs = token_data
    lengths = np.array([len(d) + 1 for d in docs])  # eod after each
    starts = np.r_[0, np.cumsum(lengths)]
    windows = TokenWindows(paths["sharded"], 16, eod=0)
    for t in np.random.default_rng(1).integers(0, windows.tokens, 2000).tolist():
        doc = int(np.searchsorted(starts, t, side="right") - 1)
        assert windows.locate(t) == (doc, t - int(starts[doc]))
    with pytest.raises(IndexError):
        windows.locate(windows.tokens)


def test_a_dataset_source_pickles_and_reads_the_same_in_a_dataloader(
    token_data: tuple[dict[str, Path], list[np.ndarray]],
) -> None:
    torch = pytest.importorskip("torch")
    paths, docs = token_data
    whole = stream(docs, 0)
    ds = smstore.SharedStoreDataset(paths["sharded"], mode="mmap")
    windows = TokenWindows(ds, 32, eod=0)
    again = pickle.loads(pickle.dumps(windows))
    assert np.array_equal(again[5], windows[5])
    sampler = smstore.GlobalShuffleSampler(len(windows), seed=3, rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(
        windows, sampler=sampler, batch_size=8, num_workers=2, multiprocessing_context="forkserver"
    )
    order = list(sampler)
    got = torch.cat(list(loader)).numpy()
    assert got.shape == (len(windows), 33)
    assert np.array_equal(got, np.stack([whole[k * 32 : k * 32 + 33] for k in order]))


def test_records_that_are_not_integer_tokens_are_refused(tmp_path: Path) -> None:
    smstore.pack([b"text"], tmp_path / "text.smst", durable=False)
    with pytest.raises(StoreFormatError, match=r"text\.smst"):
        TokenWindows(tmp_path / "text.smst", 8)
    smstore.pack_arrays([np.ones(4, np.float32)], tmp_path / "f.smst", durable=False)
    with pytest.raises(StoreFormatError, match="integer tokens"):
        TokenWindows(tmp_path / "f.smst", 8)
    smstore.pack_arrays([np.ones(4, np.uint16)], tmp_path / "u.smst", durable=False)
    with pytest.raises(ValueError, match="length"):
        TokenWindows(tmp_path / "u.smst", 0)
    with pytest.raises(ValueError, match="eod"):
        TokenWindows(tmp_path / "u.smst", 2, eod=70000, dtype=np.uint16)
    assert len(TokenWindows(tmp_path / "u.smst", 8)) == 0  # 4 tokens: no sample of 9


def token_rank(
    path: str, length: int, state: dict[str, Any] | None, rank: int, world: int, steps: int | None, q: Any
) -> None:
    """One rank's process: resume a global shuffle of the windows from ``state`` (None: a fresh
    epoch) and read ``steps`` batches of 4 (None: the rest); puts the indices, samples and state."""
    windows = TokenWindows(path, length, eod=0)
    sampler = smstore.GlobalShuffleSampler(len(windows), seed=13, rank=rank, world_size=world)
    if state is not None:
        sampler.load_state_dict(state)
    taken = list(itertools.islice(iter(sampler), None if steps is None else 4 * steps))
    samples = np.stack([windows[k] for k in taken]) if taken else np.empty((0, length + 1), np.int64)
    q.put((rank, taken, samples, sampler.state_dict()))


@pytest.mark.parametrize("resumed_world", [3, 8])
def test_windows_stopped_at_world_4_resume_at_3_and_8_as_the_global_orders_continuation(
    token_data: tuple[dict[str, Path], list[np.ndarray]], resumed_world: int
) -> None:
    paths, docs = token_data
    whole, length = stream(docs, 0), 512
    path = str(paths["sharded"])
    n = (len(whole) - 1) // length
    order = whole_order(smstore.GlobalShuffleSampler, n, seed=13)

    def ranks(
        state: dict[str, Any] | None, world: int, steps: int | None
    ) -> tuple[list[int], dict[str, Any]]:
        results = sorted(
            run_ranks(token_rank, [(path, length, state, r, world, steps) for r in range(world)])
        )
        for _, taken, samples, _ in results:  # each rank read the windows it was given
            assert np.array_equal(
                samples.reshape(-1, length + 1), [whole[k * length : k * length + length + 1] for k in taken]
            )
        return interleave([taken for _, taken, _, _ in results]), results[0][3]

    got, state = ranks(None, 4, 3)
    assert got == order[: 4 * 3 * 4]
    assert state["consumed"] == len(got)
    rest, end = ranks(state, resumed_world, None)
    k = len(got)
    assert rest == [order[p % n] for p in range(k, k + len(rest))]  # the union is the continuation
    assert len(rest) == -(-(n - k) // resumed_world) * resumed_world
    assert end["consumed"] == n


def shuffled_documents(shard_records: list[int], seed: int, epoch: int, group: int) -> list[int]:
    """The epoch's document order as the docstring states it: the shards in a Feistel order, each
    shard's documents cut into runs of at most ``group`` parts, recursively, each in its own."""

    def order(n: int, key: bytes) -> list[int]:
        return FeistelPermutation(n, key)(np.arange(n, dtype=np.uint64)).tolist()

    def visit(shard: int, lo: int, hi: int) -> list[int]:
        bounds = group_bounds(lo, hi, group).tolist()
        parts = order(len(bounds) - 1, group_key(seed, epoch, shard, lo, hi))
        if hi - lo <= group:
            return [bounds[p] for p in parts]
        return [d for p in parts for d in visit(shard, bounds[p], bounds[p + 1])]

    starts = np.r_[0, np.cumsum(shard_records)].tolist()
    shards = order(len(shard_records), group_key(seed, epoch, -1, 0, len(shard_records)))
    return [starts[k] + d for k in shards for d in visit(k, 0, shard_records[k])]


@pytest.mark.parametrize("kind", ["blob", "sharded"])
@pytest.mark.parametrize("eod", [None, 0])
@pytest.mark.parametrize("group", [2, 7, 1024])
def test_shuffled_windows_are_slices_of_the_documents_concatenated_in_the_epochs_order(
    token_data: tuple[dict[str, Path], list[np.ndarray]], kind: str, eod: int | None, group: int
) -> None:
    paths, docs = token_data
    shard_records = [len(docs)] if kind == "blob" else [457] * 6 + [len(docs) - 6 * 457]
    windows = TokenWindows(paths[kind], 64, eod=eod, seed=11, group=group)
    for epoch in range(3):
        windows.set_epoch(epoch)
        order = shuffled_documents(shard_records, 11, epoch, group)
        assert sorted(order) == list(range(len(docs)))
        whole = stream([docs[d] for d in order], eod)
        assert windows.tokens == len(whole)
        assert len(windows) == (len(whole) - 1) // 64
        rng = np.random.default_rng(epoch)
        ks = np.r_[0, len(windows) - 1, rng.integers(0, len(windows), 150)].tolist()
        for k in ks:
            assert np.array_equal(windows[k], whole[k * 64 : k * 64 + 65]), (epoch, k)
        starts = np.r_[0, np.cumsum([len(docs[d]) + (eod is not None) for d in order])]
        for t in rng.integers(0, windows.tokens, 100).tolist():
            j = int(np.searchsorted(starts, t, side="right") - 1)
            assert windows.locate(t) == (order[j], t - int(starts[j]))


def test_shuffled_orders_differ_by_epoch_and_repeat_in_another_process(
    token_data: tuple[dict[str, Path], list[np.ndarray]],
) -> None:
    paths, _ = token_data
    stored = TokenWindows(paths["sharded"], 128, eod=0)
    windows = TokenWindows(paths["sharded"], 128, eod=0, seed=4, epoch=1)
    first = np.stack([windows[k] for k in range(40)])
    assert not np.array_equal(first, np.stack([stored[k] for k in range(40)]))
    windows.set_epoch(2)
    assert not np.array_equal(first, np.stack([windows[k] for k in range(40)]))
    again = pickle.loads(pickle.dumps(TokenWindows(paths["sharded"], 128, eod=0, seed=4, epoch=1)))
    assert np.array_equal(first, np.stack([again[k] for k in range(40)]))
    code = (
        "import sys, numpy as np\n"
        "from smstore.read.tokens import TokenWindows\n"
        "w = TokenWindows(sys.argv[1], 128, eod=0, seed=4, epoch=1)\n"
        "sys.stdout.write(np.stack([w[k] for k in range(40)]).tobytes().hex())\n"
    )
    spawned = subprocess.run(
        [sys.executable, "-c", code, str(paths["sharded"])], capture_output=True, text=True, check=True
    )
    assert spawned.stdout == first.tobytes().hex()


def test_a_shuffled_epoch_builds_nothing_of_the_documents_size(tmp_path: Path) -> None:
    count = 300_000
    smstore.pack_arrays(
        (np.full(1 + i % 3, 7, np.uint16) for i in range(count)), tmp_path / "small.smst", durable=False
    )
    tracemalloc.start()
    try:
        windows = TokenWindows(tmp_path / "small.smst", 16, eod=0, seed=1)
        for k in np.random.default_rng(0).integers(0, len(windows), 200).tolist():
            assert windows[k].size == 17
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < count * 8 // 8, peak  # an int64 per document would be 2.4 MB: this is < 300 kB
    assert len(windows._groups) <= 3  # the shards' order and one group per level of 1024


def test_a_group_of_fewer_than_two_parts_is_refused(tmp_path: Path) -> None:
    smstore.pack_arrays([np.ones(4, np.uint16)], tmp_path / "u.smst", durable=False)
    with pytest.raises(ValueError, match="group"):
        TokenWindows(tmp_path / "u.smst", 2, seed=0, group=1)


@pytest.mark.parametrize(("seed", "epoch"), [(2**63, 0), (-(2**63) - 1, 0), (1.5, 0), (0, -1), (0, 2**63)])
def test_a_seed_or_epoch_the_shuffle_keys_cannot_hold_is_refused_when_given(
    tmp_path: Path, seed: Any, epoch: int
) -> None:
    """The core keys shuffled groups with 64-bit seeds and epochs: one outside is refused by name at
    construction or set_epoch, not as a binding's TypeError at the first read."""
    smstore.pack_arrays([np.ones(4, np.uint16)], tmp_path / "u.smst", durable=False)
    what = "seed" if epoch == 0 else "epoch"
    with pytest.raises(ValueError, match=f"{what} must be an integer"):
        TokenWindows(tmp_path / "u.smst", 2, seed=seed, epoch=epoch)
    windows = TokenWindows(tmp_path / "u.smst", 2, seed=-(2**63), epoch=2**63 - 1)
    assert windows[0].tolist() == [1, 1, 1]
    if what == "epoch":
        with pytest.raises(ValueError, match="epoch must be an integer"):
            windows.set_epoch(epoch)


def test_the_cores_round_keys_are_blake2b_of_the_key() -> None:
    # The Loader's threads key the shuffled groups with the core's BLAKE2b: it is hashlib's, for
    # keys of every block count.
    import hashlib

    rng = np.random.default_rng(0)
    for size in (0, 1, 27, 127, 128, 129, 256, 300):
        key = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        for rounds in (1, 6, 8):
            digest = hashlib.blake2b(key, digest_size=8 * rounds, person=b"smstore-feistel").digest()
            want = [int.from_bytes(digest[8 * i : 8 * i + 8], "little") for i in range(rounds)]
            assert smstore._core.feistel_round_keys(key, rounds) == want
    with pytest.raises(ValueError, match="1 to 8 rounds"):
        smstore._core.feistel_round_keys(b"x", 9)
