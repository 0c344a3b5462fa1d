"""TokenWindows: samples of length + 1 tokens over documents concatenated, against the stream itself."""

from __future__ import annotations

import itertools
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import smstore
from smstore.errors import StoreFormatError
from smstore.read.tokens import TokenWindows

from .smstore_testlib import interleave, run_ranks, whole_order


def documents(count: int, seed: int) -> list[np.ndarray]:
    """Documents of uint16 tokens of skewed lengths, some empty, none containing the eod token 0."""
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(3.0, 1.2, size=count).astype(np.int64)
    lengths[rng.integers(0, count, size=count // 10)] = 0
    return [rng.integers(1, 60000, size=int(n), dtype=np.uint16) for n in lengths]


def stream(docs: list[np.ndarray], eod: int | None) -> np.ndarray:
    parts = [np.append(d, eod).astype(np.int64) if eod is not None else d.astype(np.int64) for d in docs]
    return np.concatenate(parts)


@pytest.fixture(scope="module")
def token_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Path], list[np.ndarray]]:
    root = tmp_path_factory.mktemp("tokens")
    docs = documents(3000, 5)
    smstore.pack_arrays(docs, root / "docs.smst", durable=False)
    with smstore.ShardedWriter(
        f"{root / 'sharded'}/", encoding="npy:<u2", shard_records=457, durable=False
    ) as w:
        w.extend(d.tobytes() for d in docs)
    return {"blob": root / "docs.smst", "sharded": root / "sharded"}, docs


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
