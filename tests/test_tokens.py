"""TokenWindows: samples of length + 1 tokens over documents concatenated, against the stream itself."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
from smstore_testlib import token_datasets
from smstore_testlib import token_documents as documents

import smstore
from smstore.errors import StoreFormatError
from smstore.read.tokens import TokenWindows


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
