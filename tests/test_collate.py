"""TokenCollator: padded and packed token batches from one gather, in DataLoader workers."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

import smstore
from smstore import GlobalShuffleSampler
from smstore.loading.collate import TokenCollator, pinned_memory_available
from smstore.write.pack import build_metadata

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader

LENGTHS = [5, 0, 13, 1, 8, 8, 2, 30, 4, 0, 7, 11]


def record(i: int) -> np.ndarray:
    n = LENGTHS[i % len(LENGTHS)]
    return (np.arange(n, dtype=np.int64) * 7 + i * 100 + 1) % 65000


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("collate") / "tokens.smst"
    smstore.pack_arrays((record(i) for i in range(240)), path, dtype=np.uint16)
    return path


def reference_pad(
    ids: list[int],
    *,
    pad: int,
    max_length: int | None,
    trunc: str,
    side: str,
    multiple: int | None,
    fixed: bool,
) -> tuple[list[list[int]], list[int]]:
    rows = []
    for i in ids:
        r = record(i).tolist()
        if max_length is not None and len(r) > max_length:
            r = r[len(r) - max_length :] if trunc == "left" else r[:max_length]
        rows.append(r)
    width = max_length if fixed else max((len(r) for r in rows), default=0)
    if multiple:
        width = -(-width // multiple) * multiple
    padded = [
        ([pad] * (width - len(r)) + r) if side == "left" else (r + [pad] * (width - len(r))) for r in rows
    ]
    return padded, [len(r) for r in rows]


@pytest.mark.parametrize(
    ("max_length", "multiple", "fixed"),
    [
        (None, None, False),
        (6, None, False),
        (0, None, False),
        (None, 8, False),
        (6, 8, False),
        (6, None, True),
        (40, None, True),
    ],
)
@pytest.mark.parametrize("trunc", ["left", "right"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_pad(
    tokens: Path, max_length: int | None, multiple: int | None, fixed: bool, trunc: str, side: str
) -> None:
    ids = [7, 1, 0, 2, 3, 19, 9]
    collate = TokenCollator(
        tokens,
        max_length=max_length,
        truncation=trunc,  # type: ignore[arg-type]
        padding_side=side,  # type: ignore[arg-type]
        pad_to_multiple_of=multiple,
        fixed_length=fixed,
        pad_value=65535,
    )
    out = collate(ids)
    rows, lengths = reference_pad(
        ids, pad=65535, max_length=max_length, trunc=trunc, side=side, multiple=multiple, fixed=fixed
    )
    assert out["tokens"].dtype == torch.uint16
    assert out["tokens"].tolist() == rows
    assert out["lengths"].tolist() == lengths
    assert out["indices"].tolist() == ids


def test_pad_converts_dtype_and_checks_the_pad_value(tokens: Path) -> None:
    out = TokenCollator(tokens, dtype=torch.long, pad_value=-100)([2, 3])
    assert out["tokens"].dtype == torch.int64
    assert out["tokens"][1].tolist() == record(3).tolist() + [-100] * 12
    with pytest.raises(ValueError, match=r"pad_value=-100 does not fit in torch\.uint16"):
        TokenCollator(tokens, dtype=torch.uint16, pad_value=-100)


@pytest.mark.parametrize("max_length", [None, 3])
@pytest.mark.parametrize("trunc", ["left", "right"])
def test_pack(tokens: Path, max_length: int | None, trunc: str) -> None:
    ids = [7, 1, 0, 2, 3]
    out = TokenCollator(tokens, layout="pack", max_length=max_length, truncation=trunc)(ids)  # type: ignore[arg-type]
    rows, lengths = reference_pad(
        ids, pad=0, max_length=max_length, trunc=trunc, side="right", multiple=None, fixed=False
    )
    expected = [r[:n] for r, n in zip(rows, lengths, strict=True)]
    assert out["tokens"].tolist() == [x for r in expected for x in r]
    cu = out["cu_seqlens"]
    assert cu.dtype == torch.int32
    assert cu.tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
    assert [out["tokens"][cu[i] : cu[i + 1]].tolist() for i in range(len(ids))] == expected
    assert out["lengths"].tolist() == lengths


def test_records_and_indices_give_the_same_batch(tokens: Path) -> None:
    ds = smstore.SharedStoreDataset(tokens)
    ids = [4, 0, 11, 9]
    for layout in ("pad", "pack"):
        collate = TokenCollator(ds, layout=layout, max_length=9)  # type: ignore[arg-type]
        by_index = collate(ids)
        by_record = collate(ds.__getitems__(ids))
        by_array = collate([np.frombuffer(ds[i], dtype=np.uint16) for i in ids])
        by_tensor = collate(torch.tensor(ids))
        assert "indices" not in by_record
        for key in by_record:
            assert torch.equal(by_index[key], by_record[key])
            assert torch.equal(by_index[key], by_array[key])
            assert torch.equal(by_index[key], by_tensor[key])


def test_text_records_are_byte_tokens(tmp_path: Path) -> None:
    lines = tmp_path / "lines.smst"
    smstore.pack([b"abc", b"", "h\u00e9".encode()], lines, encoding="lines")
    out = TokenCollator(lines, pad_value=0, dtype=torch.long)([0, 1, 2])
    assert out["tokens"].tolist() == [[97, 98, 99], [0, 0, 0], [104, 0xC3, 0xA9]]
    assert out["lengths"].tolist() == [3, 0, 3]


def test_empty_batch(tokens: Path) -> None:
    out = TokenCollator(tokens)([])
    assert out["tokens"].shape == (0, 0)
    out = TokenCollator(tokens, layout="pack")([])
    assert out["cu_seqlens"].tolist() == [0]


def test_bad_arguments(tokens: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="layout"):
        TokenCollator(tokens, layout="ragged")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fixed_length=True needs max_length"):
        TokenCollator(tokens, fixed_length=True)
    with pytest.raises(IndexError):
        TokenCollator(tokens)([0, 240])
    with pytest.raises(TypeError, match="dtype int32, expected uint16"):
        TokenCollator(tokens)([np.zeros(3, dtype=np.int32)])


def test_pin_memory(tokens: Path) -> None:
    for layout in ("pad", "pack"):
        out = TokenCollator(tokens, layout=layout, pin_memory=True)([0, 2])  # type: ignore[arg-type]
        # Pinned where torch has an accelerator; ordinary memory (and no error) where it has none.
        assert out["tokens"].is_pinned() == pinned_memory_available()
        plain = TokenCollator(tokens, layout=layout)([0, 2])  # type: ignore[arg-type]
        assert torch.equal(out["tokens"], plain["tokens"])


def test_pickles_as_path_and_options(tokens: Path) -> None:
    collate = TokenCollator(tokens, max_length=4)
    collate([0])  # attach
    blob = pickle.dumps(collate)
    assert len(blob) < 2000
    clone = pickle.loads(blob)
    assert not clone._handle.attached
    assert torch.equal(clone([3, 2])["tokens"], collate([3, 2])["tokens"])


def epoch_batches(loader: DataLoader) -> list[dict[str, torch.Tensor]]:  # type: ignore[type-arg]
    return list(loader)


def check_batches(batches: list[dict[str, torch.Tensor]], max_length: int) -> list[int]:
    seen = []
    for b in batches:
        for row, n, i in zip(b["tokens"].tolist(), b["lengths"].tolist(), b["indices"].tolist(), strict=True):
            assert row[:n] == record(i)[:max_length].tolist()
            assert all(x == 0 for x in row[n:])
            seen.append(i)
    return seen


@pytest.mark.parametrize(
    "options",
    [
        {"num_workers": 2},
        {"num_workers": 2, "in_order": False},
        {"num_workers": 2, "persistent_workers": True},
        {"num_workers": 2, "pin_memory": True},
    ],
    ids=["workers", "in_order=False", "persistent_workers", "pin_memory"],
)
def test_dataloader_with_workers_and_global_shuffle(tokens: Path, options: dict[str, object]) -> None:
    def batches(loader: DataLoader[int]) -> list[int]:
        if options.get("pin_memory") and not pinned_memory_available():
            # CPU-only torch: the DataLoader says it cannot pin and goes on; batches must still be right.
            with pytest.warns(UserWarning, match="no accelerator"):
                return check_batches(epoch_batches(loader), 10)
        return check_batches(epoch_batches(loader), 10)

    collate = TokenCollator(tokens, max_length=10)
    n = len(collate)
    for epoch in (0, 1):
        orders = []
        for rank in range(2):
            sampler = GlobalShuffleSampler(n, seed=3, rank=rank, world_size=2)
            sampler.set_epoch(epoch)
            loader = DataLoader(range(n), batch_size=16, sampler=sampler, collate_fn=collate, **options)  # type: ignore[arg-type]
            seen = batches(loader)
            expected = list(sampler)
            if options.get("in_order") is False:
                assert sorted(seen) == sorted(expected)  # every index once, in whatever order workers finish
            else:
                assert seen == expected
            orders.append(seen)
        assert sorted(orders[0] + orders[1]) == list(range(n))


def test_persistent_workers_follow_set_epoch(tokens: Path) -> None:
    collate = TokenCollator(tokens, layout="pack")
    n = len(collate)
    sampler = GlobalShuffleSampler(n, seed=1, rank=0, world_size=1)
    loader = DataLoader(
        range(n), batch_size=32, sampler=sampler, collate_fn=collate, num_workers=2, persistent_workers=True
    )
    epochs = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        epochs.append([i for b in loader for i in b["indices"].tolist()])
        assert epochs[-1] == sampler.global_order().tolist()
    assert epochs[0] != epochs[1]


def test_spawned_worker_attaches_by_path(tokens: Path) -> None:
    collate = TokenCollator(tokens, max_length=10)
    sampler = GlobalShuffleSampler(len(collate), seed=2, rank=1, world_size=3)
    loader = DataLoader(
        range(len(collate)),
        batch_size=16,
        sampler=sampler,
        collate_fn=collate,
        num_workers=1,
        multiprocessing_context="spawn",
    )
    assert check_batches(epoch_batches(loader), 10) == list(sampler)


def test_return_indices_off(tokens: Path) -> None:
    out = TokenCollator(tokens, return_indices=False)([1, 2])
    assert set(out) == {"tokens", "lengths"}


def test_records_of_partial_items_are_a_format_error(tmp_path: Path) -> None:
    # Two 3-byte records make 6 bytes: a whole number of uint16 tokens in all, so the gathered
    # buffer alone would split them silently into 1 + 1 tokens.
    path = tmp_path / "ragged.smst"
    w = smstore._core.Writer(str(path), False)
    w.extend([b"\x01\x00\x02", b"\x03\x00\x04"])
    w.finish(build_metadata("npy:<u2"))
    collate = TokenCollator(path, layout="pack")
    with pytest.raises(
        smstore.StoreFormatError, match=r"ragged\.smst: record 0 of 3 bytes is not a whole number"
    ):
        collate([0, 1])
    with pytest.raises(
        smstore.StoreFormatError, match=r"ragged\.smst: a record of 3 bytes is not a whole number"
    ):
        collate([collate.store[0], collate.store[1]])


@pytest.mark.parametrize("record_dtype", [np.uint8, np.int8, np.uint16, np.int32, np.uint64, np.float32])
@pytest.mark.parametrize("dtype", [None, "int64", "int32", "uint8", "float64"])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_length": 6, "truncation": "left", "padding_side": "left", "pad_value": 3},
        {"max_length": 9, "fixed_length": True, "pad_to_multiple_of": 4},
        {"layout": "pack", "max_length": 5},
        {"layout": "pack", "return_indices": False},
    ],
)
def test_batcher_path_is_byte_identical_to_numpy(
    tmp_path: Path, record_dtype: type, dtype: str | None, options: dict[str, object]
) -> None:
    path = tmp_path / "t.smst"
    smstore.pack_arrays((record(i).astype(record_dtype) for i in range(24)), path, dtype=record_dtype)
    torch_dtype = None if dtype is None else getattr(torch, dtype)
    collate = TokenCollator(path, dtype=torch_dtype, **options)  # type: ignore[arg-type]
    float_to_int = np.dtype(record_dtype).kind == "f" and dtype is not None and dtype != "float64"
    assert (collate.batch_spec() is None) == float_to_int  # the C++ batcher does the rest
    ids = [7, 1, 0, 23, 3, 19, 9, 7]
    fast, slow = collate(ids), collate._collate_numpy(ids, ids, torch)
    assert list(fast) == list(slow)
    for key in slow:
        assert fast[key].dtype == slow[key].dtype
        assert fast[key].shape == slow[key].shape
        assert fast[key].numpy().tobytes() == slow[key].numpy().tobytes()
