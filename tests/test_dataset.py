"""SharedStoreDataset: decoding, pickling, DataLoader workers under every start method, DistributedSampler."""

from __future__ import annotations

import copy
import gc
import json
import os
import pickle
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import smstore_testlib as tl

import smstore

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, DistributedSampler

from smstore import SharedStoreDataset

N_DDP = 103  # not divisible by 2, 3 or 4: DistributedSampler has to pad or drop


@pytest.fixture
def json_blob(make_blob) -> tuple[Path, list[object]]:
    values: list[object] = [{"a": 1}, [1, 2, {"b": None}], "caf\u00e9", 3.5, True, None, {"k": "\u6f22" * 10}]
    path = make_blob([json.dumps(v, ensure_ascii=False) for v in values], encoding="jsonl")
    return path, values


@pytest.fixture
def numbered_blob(make_blob) -> tuple[Path, list[bytes]]:
    """Unique, awkward records: index i is recoverable from the bytes, contents are not trivial."""
    extra = tl.random_records(N_DDP, seed=4, max_len=64, newline=True)
    recs = [b"%d|" % i + extra[i] for i in range(N_DDP)]
    return make_blob(recs), recs


# ----------------------------------------------------------------------------- decoding


def test_default_returns_read_only_memoryview(awkward_blob: Path, awkward_records: list[bytes]) -> None:
    ds = SharedStoreDataset(awkward_blob)
    assert isinstance(ds, torch.utils.data.Dataset)
    assert len(ds) == len(awkward_records)
    for i, expected in enumerate(awkward_records):
        view = ds[i]
        assert isinstance(view, memoryview)
        assert view.readonly
        assert bytes(view) == expected
    assert bytes(ds[-1]) == awkward_records[-1]
    with pytest.raises(IndexError):
        ds[len(awkward_records)]


def test_decode_bytes_and_utf8(make_blob) -> None:
    texts = ["plain", "", "caf\u00e9 \u6f22\u5b57 \U0001f600", "cr\r", "nul\x00"]
    path = make_blob(texts, encoding="lines")
    ds_bytes = SharedStoreDataset(path, decode="bytes")
    assert [ds_bytes[i] for i in range(len(texts))] == [t.encode() for t in texts]
    assert all(type(ds_bytes[i]) is bytes for i in range(len(texts)))
    ds_text = SharedStoreDataset(path, decode="utf8")
    assert [ds_text[i] for i in range(len(texts))] == texts


def test_decode_utf8_of_invalid_bytes_raises(make_blob) -> None:
    ds = SharedStoreDataset(make_blob([b"\xff\xfe"]), decode="utf8")
    with pytest.raises(UnicodeDecodeError):
        ds[0]


def test_decode_json(json_blob: tuple[Path, list[object]]) -> None:
    path, values = json_blob
    ds = SharedStoreDataset(path, decode="json")
    assert [ds[i] for i in range(len(values))] == values


@pytest.mark.parametrize("dtype", ["<i4", "<f8", "uint8", ">i2"])
def test_decode_numpy(make_blob, dtype: str) -> None:
    rng = np.random.default_rng(0)
    arrays = [(rng.random(k) * 1000).astype(dtype) for k in (0, 1, 5, 100, 3)]
    path = make_blob(arrays, encoding=f"npy:{dtype}")
    ds = SharedStoreDataset(path, decode="numpy")
    for i, expected in enumerate(arrays):
        got = ds[i]
        assert isinstance(got, np.ndarray)
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got, expected)
        assert not got.flags.writeable  # zero-copy over the read-only mapping
        if len(got):
            with pytest.raises(ValueError, match="read-only"):
                got[0] = 0


def test_decode_numpy_needs_npy_encoding(awkward_blob: Path) -> None:
    with pytest.raises(smstore.StoreFormatError, match="npy"):
        SharedStoreDataset(awkward_blob, decode="numpy")


def test_decode_invalid_option(awkward_blob: Path) -> None:
    with pytest.raises(ValueError, match="decode"):
        SharedStoreDataset(awkward_blob, decode="pickle")


def test_decode_callable_and_transform(awkward_blob: Path, awkward_records: list[bytes]) -> None:
    ds = SharedStoreDataset(awkward_blob, decode=tl.to_bytes, transform=tl.upper)
    assert [ds[i] for i in range(len(ds))] == [r.upper() for r in awkward_records]
    # transform without decode receives the memoryview
    ds = SharedStoreDataset(awkward_blob, transform=len)
    assert [ds[i] for i in range(len(ds))] == [len(r) for r in awkward_records]
    # transform runs after decode
    ds = SharedStoreDataset(awkward_blob, decode="bytes", transform=lambda b: b[::-1])
    assert ds[1] == b"olleh"


def test_getitems_matches_getitem(json_blob: tuple[Path, list[object]]) -> None:
    path, values = json_blob
    ds = SharedStoreDataset(path, decode="json", transform=lambda v: ("t", v))
    idx = [3, 0, -1, 3, 6]
    assert ds.__getitems__(idx) == [ds[i] for i in idx] == [("t", values[i]) for i in idx]
    assert ds.__getitems__([]) == []
    with pytest.raises(IndexError):
        ds.__getitems__([0, len(values)])
    raw = SharedStoreDataset(path).__getitems__([1, 2])
    assert all(isinstance(v, memoryview) and v.readonly for v in raw)


def test_missing_or_bad_file(tmp_path: Path) -> None:
    with pytest.raises(smstore.StoreNotFoundError):
        SharedStoreDataset(tmp_path / "nope.smst")
    bad = tmp_path / "bad.smst"
    bad.write_bytes(b"junk" * 2000)
    with pytest.raises(smstore.StoreFormatError):
        SharedStoreDataset(bad)


@pytest.mark.parametrize("mode", ["auto", "mmap"])
def test_a_directory_or_a_text_file_says_what_to_give(tmp_path: Path, mode: str) -> None:
    folder = tmp_path / "corpus"
    folder.mkdir()
    smstore.pack([b"a"], folder / "part-0.smst")  # shards, but no manifest
    notes = tmp_path / "notes.txt"
    notes.write_text("first line\nsecond line\n")
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"a": 1}\n')
    junk = tmp_path / "junk.bin"
    junk.write_bytes(bytes(range(256)) * 20)
    for open_it in (smstore.open, lambda p: SharedStoreDataset(p, mode=mode)):
        with pytest.raises(smstore.StoreFormatError) as e:
            open_it(folder)
        for text in (f"{folder}: a directory, but not a sharded dataset", "no manifest.json", "smstore pack"):
            assert text in str(e.value)  # was "not a regular file"
        with pytest.raises(smstore.StoreFormatError) as e:
            open_it(notes)
        assert f"it looks like text: pack it into a blob first, 'smstore pack {notes} -o " in str(e.value)
        with pytest.raises(smstore.StoreFormatError) as e:
            open_it(rows)
        assert f"'smstore pack --format jsonl {rows} -o {tmp_path / 'rows.smst'}'" in str(e.value)
        misnamed = (
            tmp_path / "lines.smst"
        )  # text under a blob's name: the advice must not pack it over itself
        misnamed.write_text("first\nsecond\n")
        with pytest.raises(smstore.StoreFormatError) as e:
            open_it(misnamed)
        assert f"'smstore pack {misnamed} -o {tmp_path / 'lines.packed.smst'}'" in str(e.value)
        with pytest.raises(smstore.StoreFormatError) as e:
            open_it(junk)  # no sign of what it is: only the fault
        assert str(e.value) == f"{junk}: not an smstore blob (bad magic bytes)"


# ----------------------------------------------------------------------------- pickling


def test_pickle_is_small_and_independent_of_data_size(make_blob) -> None:
    big = make_blob(tl.random_records(4000, seed=6, max_len=2000), name="big.smst")
    small = make_blob([b"x"], name="small.smst")
    assert big.stat().st_size > 3 * (1 << 20)
    for decode in (None, "bytes", "utf8", "json"):
        ds_big = SharedStoreDataset(big, decode=decode)
        assert (
            len(ds_big.store.get_batch([0, 5])) == 2
        )  # attached and used: still must not pickle the mapping
        blob_big = pickle.dumps(ds_big)
        blob_small = pickle.dumps(SharedStoreDataset(small, decode=decode))
        assert len(blob_big) < 2048
        assert abs(len(blob_big) - len(blob_small)) < 64  # only the path and metadata differ


def test_pickle_round_trip(make_blob) -> None:
    arrays = [np.arange(k, dtype="<i4") for k in range(6)]
    path = make_blob(arrays, encoding="npy:<i4")
    ds = SharedStoreDataset(path, decode="numpy", transform=np.sum)
    ds2 = pickle.loads(pickle.dumps(ds))
    assert len(ds2) == len(ds)
    assert [ds2[i] for i in range(6)] == [ds[i] for i in range(6)] == [a.sum() for a in arrays]
    assert ds2.store is not ds.store  # attached afresh
    ds3 = pickle.loads(pickle.dumps(SharedStoreDataset(path, decode=tl.to_bytes)))
    assert ds3[2] == arrays[2].tobytes()


# ----------------------------------------------------------------------------- DataLoader workers


@pytest.mark.parametrize(
    ("context", "batch_size"),
    [("fork", 8), ("fork", None), ("spawn", None), ("forkserver", 8)],
    ids=["fork-batched", "fork-single", "spawn-single", "forkserver-batched"],
)
def test_dataloader_workers(
    numbered_blob: tuple[Path, list[bytes]], context: str, batch_size: int | None
) -> None:
    """Batched loading goes through __getitems__, batch_size=None through __getitem__."""
    path, recs = numbered_blob
    ds = SharedStoreDataset(path, decode="bytes", transform=tl.tag_with_pid)
    ds[0]  # the parent is attached: fork children inherit the mapping, spawn ones re-attach
    loader = DataLoader(
        ds,
        batch_size=batch_size,
        num_workers=2,
        multiprocessing_context=context,
        collate_fn=tl.identity_collate if batch_size else None,
    )
    got = [item for batch in loader for item in batch] if batch_size else [tuple(x) for x in loader]
    assert [rec for _, rec in got] == recs
    pids = {pid for pid, _ in got}
    assert os.getpid() not in pids
    assert len(pids) == 2


def test_dataloader_numpy_default_collate(make_blob) -> None:
    arrays = [np.arange(i, i + 4, dtype="<i4") for i in range(40)]
    path = make_blob(arrays, encoding="npy:<i4")
    ds = SharedStoreDataset(path, decode="numpy", transform=np.array)  # copy: torch wants writable
    loader = DataLoader(ds, batch_size=10, num_workers=2, multiprocessing_context="fork")
    batches = list(loader)
    assert all(isinstance(b, torch.Tensor) and b.shape == (10, 4) for b in batches)
    np.testing.assert_array_equal(torch.cat(batches).numpy(), np.stack(arrays))


# The defaults must never give wrong tensors: torch's default collate_fn treats a memoryview as a
# sequence (one tensor per byte position), and stacks arrays of one shape only.


def first_batch_error(loader: DataLoader) -> str:
    """The CollateError of the loader's first batch; its workers are stopped before this returns."""
    it = iter(loader)
    try:
        batch = next(it)
    except smstore.CollateError as e:
        return str(e)  # leaving the handler frees the traceback, whose frames hold the iterator
    finally:
        # torch's re-raise leaves the iterator in a reference cycle (frame, exception, traceback):
        # collect it now, or a worker forked later inherits it and runs its __del__.
        del it
        gc.collect()
    raise AssertionError(f"no error; the first batch was {batch!r}")


@pytest.mark.parametrize("workers", [0, 2])
def test_default_collate_refuses_record_views(make_blob, workers: int) -> None:
    path = make_blob([b"A0", b"A1", b"A2", b"A3"])
    # Before: [tensor([65, 65, 65, 65]), tensor([48, 49, 50, 51])], without a word.
    message = first_batch_error(DataLoader(SharedStoreDataset(path), batch_size=4, num_workers=workers))
    for text in (str(path), "one tensor per byte position", "decode=", "'utf8'", "TokenCollator"):
        assert text in message
    # What the message offers works.
    decoded = DataLoader(SharedStoreDataset(path, decode="utf8"), batch_size=4, num_workers=workers)
    assert list(decoded) == [["A0", "A1", "A2", "A3"]]


def test_default_collate_of_other_memoryviews_is_unchanged() -> None:
    # Only views of an smstore mapping are refused; torch's rule for any other memoryview stands.
    batch = torch.utils.data.default_collate([memoryview(b"ab"), memoryview(b"cd")])
    assert [t.tolist() for t in batch] == [[97, 99], [98, 100]]


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable:UserWarning")
@pytest.mark.parametrize("decode", ["torch", "numpy"])
@pytest.mark.parametrize("workers", [0, 2])
def test_default_collate_of_ragged_arrays_names_token_collator(make_blob, workers: int, decode: str) -> None:
    # The longest record first: in a worker, torch's collate then fails resizing its output
    # ("Trying to resize storage that is not resizable"); in the main process, stacking.
    arrays = [np.arange(n, dtype="<i4") for n in (5, 3, 2, 4)]
    path = make_blob(arrays, encoding="npy:<i4")
    ds = SharedStoreDataset(path, decode=decode)
    message = first_batch_error(DataLoader(ds, batch_size=4, num_workers=workers))
    for text in (str(path), "records 0 and 1 have shapes (5,) and (3,)", "TokenCollator", "collate_fn"):
        assert text in message
    # What the message offers works.
    loader = DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=smstore.TokenCollator(ds))
    (batch,) = list(loader)
    assert batch["lengths"].tolist() == [5, 3, 2, 4]


@pytest.mark.parametrize("workers", [0, 2])
def test_default_collate_stacks_equal_arrays(make_blob, workers: int) -> None:
    arrays = [np.arange(i, i + 3, dtype="<i4") for i in range(8)]
    ds = SharedStoreDataset(make_blob(arrays, encoding="npy:<i4"), decode="torch")
    batches = list(DataLoader(ds, batch_size=4, num_workers=workers))
    assert [b.shape for b in batches] == [(4, 3), (4, 3)]
    np.testing.assert_array_equal(torch.cat(batches).numpy(), np.stack(arrays))


def test_dataloader_uses_getitems(
    numbered_blob: tuple[Path, list[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, recs = numbered_blob
    ds = SharedStoreDataset(path, decode="bytes")
    calls: list[list[int]] = []
    original = SharedStoreDataset.__getitems__

    def spy(self: SharedStoreDataset, indices: list[int]) -> list[object]:
        calls.append(list(indices))
        return original(self, indices)

    def no_single(self: SharedStoreDataset, index: int) -> object:
        raise AssertionError("__getitem__ called although batch_size is set")

    monkeypatch.setattr(SharedStoreDataset, "__getitems__", spy)
    monkeypatch.setattr(SharedStoreDataset, "__getitem__", no_single)
    loader = DataLoader(ds, batch_size=16, num_workers=0, collate_fn=tl.identity_collate)
    assert [r for b in loader for r in b] == recs
    assert [len(c) for c in calls] == [16] * (N_DDP // 16) + [N_DDP % 16]


# ----------------------------------------------------------------------------- DistributedSampler


def _expected_per_rank(n: int, world: int, drop_last: bool, seed: int, epoch: int) -> list[list[int]]:
    """What torch's DistributedSampler documents: one shared permutation, padded or cut, dealt round robin."""
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    perm = torch.randperm(n, generator=g).tolist()
    if drop_last:
        total = (n // world) * world
        perm = perm[:total]
    else:
        total = -(-n // world) * world
        perm = perm + perm[: total - n]
    return [perm[r:total:world] for r in range(world)]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_distributed_sampler_reads_every_index_once(
    numbered_blob: tuple[Path, list[bytes]], world: int, drop_last: bool
) -> None:
    path, recs = numbered_blob
    n = len(recs)
    for epoch in (0, 1):
        seen: Counter[int] = Counter()
        per_rank_sizes = []
        for rank in range(world):
            ds = SharedStoreDataset(path, decode="bytes")
            sampler = DistributedSampler(
                ds, num_replicas=world, rank=rank, shuffle=True, seed=7, drop_last=drop_last
            )
            sampler.set_epoch(epoch)
            order = list(sampler)
            loader = DataLoader(ds, batch_size=5, sampler=sampler, collate_fn=tl.identity_collate)
            got = [r for b in loader for r in b]
            assert got == [recs[i] for i in order]  # byte-exact, in sampler order
            indices = [int(r.split(b"|", 1)[0]) for r in got]
            assert indices == order
            seen.update(indices)
            per_rank_sizes.append(len(indices))
            assert order == _expected_per_rank(n, world, drop_last, seed=7, epoch=epoch)[rank]

        assert len(set(per_rank_sizes)) == 1  # every rank gets the same number of samples
        if drop_last:
            kept = (n // world) * world
            assert sum(seen.values()) == kept
            assert set(seen.values()) == {1}
            assert len(seen) == kept  # exactly n % world indices skipped this epoch
        else:
            padded = -(-n // world) * world
            assert set(seen) == set(range(n))  # every index read
            assert sum(seen.values()) == padded
            extra = [i for i, c in seen.items() if c > 1]
            assert all(seen[i] == 2 for i in extra)
            assert len(extra) == padded - n  # read twice only where the sampler padded


def test_distributed_sampler_with_workers(numbered_blob: tuple[Path, list[bytes]]) -> None:
    path, recs = numbered_blob
    world = 3
    seen: Counter[int] = Counter()
    for rank in range(world):
        ds = SharedStoreDataset(path, decode="bytes")
        sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=1)
        loader = DataLoader(
            ds,
            batch_size=4,
            sampler=sampler,
            num_workers=2,
            multiprocessing_context="fork",
            collate_fn=tl.identity_collate,
        )
        got = [r for b in loader for r in b]
        assert got == [recs[i] for i in sampler]
        seen.update(int(r.split(b"|", 1)[0]) for r in got)
    assert set(seen) == set(range(len(recs)))
    assert sum(seen.values()) == -(-len(recs) // world) * world


# ----------------------------------------------------------------------------- indexing and lifetime


def test_dataset_indexing_rules(awkward_blob: Path, awkward_records: list[bytes]) -> None:
    ds = SharedStoreDataset(awkward_blob, decode="bytes")
    n = len(awkward_records)
    assert ds[np.int64(3)] == awkward_records[3]
    assert ds[np.uint8(2)] == awkward_records[2]
    assert ds[-n] == awkward_records[0]
    for bad in (n, -n - 1, 2**70, -(2**70)):
        with pytest.raises(IndexError):
            ds[bad]
    for bad in (1.0, "1", None):
        with pytest.raises(TypeError):
            ds[bad]


def test_dataset_views_outlive_dataset(awkward_blob: Path, awkward_records: list[bytes]) -> None:
    ds = SharedStoreDataset(awkward_blob)
    views = [ds[i] for i in range(len(ds))] + ds.__getitems__(list(range(len(ds))))
    del ds
    gc.collect()
    assert [bytes(v) for v in views] == awkward_records * 2


def test_dataset_after_its_store_is_closed(awkward_blob: Path, awkward_records: list[bytes]) -> None:
    """Closing the Store under a Dataset must never expose unmapped memory: correct bytes or ValueError."""
    ds = SharedStoreDataset(awkward_blob, decode="bytes")
    ds.store.close()
    for i in range(len(ds)):
        try:
            got = ds[i]
        except ValueError:
            continue
        assert got == awkward_records[i]
    try:
        batch = ds.__getitems__([0, 1])
    except ValueError:
        pass
    else:
        assert batch == awkward_records[:2]


def test_dataset_copies_reattach(awkward_blob: Path, awkward_records: list[bytes]) -> None:
    ds = SharedStoreDataset(awkward_blob, decode="bytes", transform=tl.upper)
    for clone in (copy.copy(ds), copy.deepcopy(ds)):
        assert [clone[i] for i in range(len(clone))] == [r.upper() for r in awkward_records]


def test_unpickled_dataset_whose_file_vanished(awkward_blob: Path) -> None:
    state = pickle.dumps(SharedStoreDataset(awkward_blob))
    awkward_blob.unlink()
    ds = pickle.loads(state)  # attaching is lazy ...
    with pytest.raises(smstore.StoreNotFoundError) as ei:
        ds[0]  # ... so the error shows on first access, naming the file
    assert str(awkward_blob) in str(ei.value)


def test_attaching_to_a_repacked_file_refuses(tmp_path: Path) -> None:
    path = tmp_path / "d.smst"
    smstore.pack([b"a", b"b"], path, durable=False)
    ds = SharedStoreDataset(path, mode="mmap")
    clone = pickle.loads(pickle.dumps(ds))  # what a spawn or forkserver worker receives
    smstore.pack([b"x", b"y", b"z"], path, durable=False)
    with pytest.raises(smstore.StoreChangedError, match=r"d\.smst: the file changed since"):
        clone[0]
    assert bytes(ds[0]) == b"a"  # the original still maps the file it was created on


def test_index_that_unbinds_or_rebinds_the_dataset(tmp_path: Path) -> None:
    path, small = tmp_path / "d.smst", tmp_path / "small.smst"
    smstore.pack([b"a", b"b", b"c"], path, durable=False)
    smstore.pack([b"x"], small, durable=False)
    ds = SharedStoreDataset(path, decode="bytes")

    class Unbinds:
        def __index__(self) -> int:
            ds._unbind()
            return 2

    class RebindsSmaller:
        def __index__(self) -> int:
            ds._bind(smstore.open(small), None, None)
            return 2

    assert ds[Unbinds()] == b"c"  # re-attached to its own file
    with pytest.raises(IndexError, match="out of range for 1 records"):
        ds[RebindsSmaller()]
