"""Views: subsets (ranges, index arrays, index files), repeats and concatenations, copying no record."""

from __future__ import annotations

import json
import os
import pickle
import struct
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import smstore_testlib as tl

import smstore
from smstore import IndexFileError, IndexStaleError, StoreChangedError, StoreError
from smstore.read.views import Concat, Repeat, Subset, index_path, open_selection, read_index, select
from smstore.sampling import MixtureDataset, MixtureSampler

N = 97


def rec(i: int, tag: str = "r") -> bytes:
    return f"{tag}{i:04d}".encode() * (1 + i % 5)


@pytest.fixture
def blob(make_blob: Any) -> tuple[Path, list[bytes]]:
    recs = [rec(i) for i in range(N)]
    return make_blob(recs), recs


@pytest.fixture
def sharded(tmp_path: Path) -> tuple[Path, list[bytes]]:
    recs = [rec(i, "s") for i in range(60)]
    return tl.sharded(tmp_path, recs, shard_records=17), recs


def as_bytes(x: Any) -> bytes:
    return bytes(x)


def read_all(view: Any) -> list[bytes]:
    """Every record by index, by batch and by iteration must agree."""
    one = [as_bytes(view[i]) for i in range(len(view))]
    if hasattr(view, "__getitems__"):
        assert [as_bytes(x) for x in view.__getitems__(list(range(len(view))))] == one
    assert [as_bytes(x) for x in view] == one
    return one


# ---- every view kind against a Python list -----------------------------------------------------


def test_subset_ranges_and_indices(blob: tuple[Path, list[bytes]]) -> None:
    path, recs = blob
    store = smstore.open(path)
    ranges = [(3, 10), (50, 20, -3), range(90, 97), (0, 1), (40, 40)]
    v = Subset(store, ranges)
    expect = [recs[i] for r in [range(3, 10), range(50, 20, -3), range(90, 97), range(1)] for i in r]
    assert read_all(v) == expect
    assert len(v._starts) == 4  # O(ranges): the empty range is dropped, nothing else stored
    assert v[-1] == recs[0]
    idx = [5, 5, 96, 0, 33]
    assert read_all(Subset(store, indices=idx)) == [recs[i] for i in idx]
    assert Subset(store, indices=idx)._indices.dtype == np.uint32
    with pytest.raises(IndexError):
        Subset(store, [(90, 98)])
    with pytest.raises(IndexError):
        Subset(store, indices=[N])
    with pytest.raises(IndexError):
        Subset(store, indices=[-1])
    with pytest.raises(ValueError, match="step"):
        Subset(store, [(0, 5, 0)])
    with pytest.raises(IndexError):
        v[len(v)]


@pytest.mark.parametrize("factor", [0, 0.3, 1, 1.5, 2.25, 3])
def test_repeat(blob: tuple[Path, list[bytes]], factor: float) -> None:
    path, recs = blob
    v = Repeat(smstore.open(path), factor, seed=7)
    whole, extra = divmod(int(np.floor(factor * 100)) * N // 100, N)
    assert len(v) == whole * N + extra
    got = read_all(v)
    assert got[: whole * N] == recs * whole
    tail = got[whole * N :]
    assert len(set(tail)) == len(tail) == extra  # distinct records
    assert set(tail) <= set(recs)
    assert read_all(Repeat(smstore.open(path), factor, seed=7)) == got  # deterministic
    if 0 < extra < N - 1:
        assert read_all(Repeat(smstore.open(path), factor, seed=8))[whole * N :] != tail
    with pytest.raises(ValueError, match="finite"):
        Repeat(recs, -1.0)
    with pytest.raises(TypeError):
        Repeat(recs, "2")  # type: ignore[arg-type]


def test_concat_and_compositions(blob: tuple[Path, list[bytes]], sharded: tuple[Path, list[bytes]]) -> None:
    path, recs = blob
    spath, srecs = sharded
    store, sstore = smstore.open(path), smstore.open(spath)
    sub = Subset(sstore, [(2, 40, 3)])
    rep = Repeat(Subset(store, indices=[4, 8, 15, 16, 23, 42]), 2.5, seed=1)
    cat = Concat([sub, store, rep, [b"plain", b"list"]])
    ref_sub = [srecs[i] for i in range(2, 40, 3)]
    ref_rep = read_all(rep)
    assert ref_rep[:12] == [recs[i] for i in [4, 8, 15, 16, 23, 42]] * 2
    expect = ref_sub + recs + ref_rep + [b"plain", b"list"]
    assert read_all(cat) == expect
    assert cat.locate(len(ref_sub)) == (1, 0)
    # views of views of views, and of a MixtureDataset
    nested = Subset(Repeat(Subset(cat, [(0, len(expect), 2)]), 1.5, seed=3), indices=[0, 1, 2, 7])
    ref_nested_src = expect[::2]
    inner = Repeat(Subset(cat, [(0, len(expect), 2)]), 1.5, seed=3)
    assert read_all(inner)[: len(ref_nested_src)] == ref_nested_src
    assert read_all(nested) == [read_all(inner)[i] for i in [0, 1, 2, 7]]
    mix = MixtureDataset([sub, rep], [0.5, 0.5])
    over_mix = Subset(mix, [(0, len(mix))])
    assert read_all(over_mix) == ref_sub + ref_rep


def test_shared_list_source() -> None:
    objs = [{"i": i, "s": "x" * i} for i in range(30)]
    lst = smstore.SharedList(objs)
    try:
        v = Concat([Subset(lst, [(10, 20)]), Repeat(lst, 0.5, seed=2)])
        assert [v[i] for i in range(10)] == objs[10:20]
        tail = [v[i]["i"] for i in range(10, len(v))]
        assert len(tail) == 15 == len(set(tail))
        clone = pickle.loads(pickle.dumps(v))
        assert [clone[i] for i in range(len(v))] == [v[i] for i in range(len(v))]
    finally:
        lst.close()


# ---- index files made by a predicate -----------------------------------------------------------


def test_select_raw_and_decoded(blob: tuple[Path, list[bytes]]) -> None:
    path, recs = blob
    store = smstore.open(path)
    raw_calls: list[type] = []

    def long_raw(r: Any) -> bool:
        raw_calls.append(type(r))
        return len(r) > 15

    v = select(store, long_raw, name="long")
    assert raw_calls
    assert set(raw_calls) == {memoryview}
    assert read_all(v) == [r for r in recs if len(r) > 15]
    assert index_path(path, "long") == f"{path}.long.idx"
    # evaluated once: a second select (any predicate) reads the file
    again = select(store, lambda r: pytest.fail("the predicate ran again"), name="long")
    assert read_all(again) == read_all(v)
    assert read_all(open_selection(store, "long")) == read_all(v)
    # decoded records, the user's choice
    seen: list[type] = []

    def even(r: str) -> bool:
        seen.append(type(r))
        return int(r[1:5]) % 2 == 0

    ev = select(path, even, name="even", decode="utf8")
    assert set(seen) == {str}
    assert read_all(ev) == recs[::2]
    header, _ = read_index(index_path(path, "even"), records=N, checksum=store.checksum)
    assert header["decode"] == "utf8"
    assert header["kind"] == "indices"  # 49 lone indices: 4 bytes each beats 16 a range
    assert header["dtype"] == "<u4"


def test_select_contiguous_is_stored_as_ranges(tmp_path: Path, sharded: tuple[Path, list[bytes]]) -> None:
    spath, srecs = sharded
    ds = smstore.open(spath)
    v = select(ds, lambda r: 10 <= int(bytes(r[1:5])) < 50, name="mid")
    assert index_path(spath, "mid") == os.path.join(spath, "mid.idx")
    assert read_all(v) == srecs[10:50]
    header, array = read_index(index_path(spath, "mid"), records=60, checksum=ds.checksum)
    assert header["kind"] == "ranges"
    assert array.tolist() == [[10, 50]]
    assert v.ranges == [range(10, 50)]
    assert os.path.getsize(index_path(spath, "mid")) < 1024
    none = select(ds, lambda r: False, name="none")
    assert len(none) == 0
    assert list(none) == []


def test_index_refused_after_the_data_changes(make_blob: Any, blob: tuple[Path, list[bytes]]) -> None:
    path, recs = blob
    select(smstore.open(path), lambda r: len(r) > 15, name="long")
    # repack in place: same path, other records (same count, so only the checksum tells)
    smstore.pack([r.upper() for r in recs], path, durable=False)
    store = smstore.open(path)
    with pytest.raises(IndexStaleError) as err:
        open_selection(store, "long")
    assert str(path) in str(err.value)
    assert f"{path}.long.idx" in str(err.value)
    assert isinstance(err.value, StoreError)
    with pytest.raises(IndexStaleError):
        select(store, lambda r: True, name="long")
    rebuilt = select(store, lambda r: len(r) > 15, name="long", rebuild=True)
    assert read_all(rebuilt) == [r.upper() for r in recs if len(r) > 15]


def test_pickled_selection_refused_after_the_data_changes(blob: tuple[Path, list[bytes]]) -> None:
    path, recs = blob
    v = select(path, lambda r: len(r) > 15, name="long")
    state = pickle.dumps(v)
    assert len(state) < 1024  # the path and spec, never the indices or records
    assert read_all(pickle.loads(state)) == read_all(v)
    smstore.pack(recs[:-1], path, durable=False)
    with pytest.raises(StoreError, match="changed"):
        pickle.loads(state)


def test_index_output_refuses_a_link(blob: tuple[Path, list[bytes]], tmp_path: Path) -> None:
    path, _ = blob
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep")
    os.symlink(target, f"{path}.x.idx")
    with pytest.raises(smstore.StoreIOError, match="symbolic link"):
        select(path, lambda r: True, name="x", rebuild=True)
    assert target.read_bytes() == b"keep"
    with pytest.raises(ValueError, match="name"):
        select(path, lambda r: True, name="../up")


def _rewrite(path: str, header: dict[str, Any] | None = None, body: bytes | None = None) -> None:
    raw = Path(path).read_bytes()
    magic, version, hlen = struct.unpack_from("<8sII", raw)
    old = json.loads(raw[16 : 16 + hlen].rstrip(b"\0"))
    new = old if header is None else {**old, **header}
    text = json.dumps(new).encode()
    text += b"\0" * (-(16 + len(text)) % 8)
    Path(path).write_bytes(
        struct.pack("<8sII", magic, version, len(text)) + text + (body or raw[16 + hlen :])
    )


def _digest(body: bytes) -> str:
    import hashlib

    return hashlib.blake2b(body, digest_size=16).hexdigest()


@pytest.mark.parametrize(
    "damage",
    [
        "empty",
        "truncated-prefix",
        "truncated-body",
        "wrong-magic",
        "version",
        "header-not-json",
        "huge-header",
        "huge-count",
        "index-out-of-range",
        "unsorted",
        "ranges-past-end",
        "bad-digest",
        "bad-dtype",
        "count-negative",
        "extra-bytes",
    ],
)
def test_hostile_index_files(blob: tuple[Path, list[bytes]], damage: str) -> None:
    path, _ = blob
    store = smstore.open(path)
    select(store, lambda r: int(bytes(r[1:5])) % 3 == 0, name="h")
    ipath = index_path(path, "h")
    raw = Path(ipath).read_bytes()
    hlen = struct.unpack_from("<I", raw, 12)[0]
    if damage == "empty":
        Path(ipath).write_bytes(b"")
    elif damage == "truncated-prefix":
        Path(ipath).write_bytes(raw[:10])
    elif damage == "truncated-body":
        Path(ipath).write_bytes(raw[:-3])
    elif damage == "wrong-magic":
        Path(ipath).write_bytes(b"NOTANIDX" + raw[8:])
    elif damage == "version":
        Path(ipath).write_bytes(raw[:8] + struct.pack("<I", 99) + raw[12:])
    elif damage == "header-not-json":
        Path(ipath).write_bytes(raw[:16] + b"{" * hlen + raw[16 + hlen :])
    elif damage == "huge-header":
        Path(ipath).write_bytes(raw[:12] + struct.pack("<I", 2**32 - 1) + raw[16:])
    elif damage == "huge-count":
        _rewrite(ipath, {"count": 2**61})
    elif damage == "index-out-of-range":
        body = np.array([0, 3, N + 5], dtype="<u4").tobytes()
        _rewrite(ipath, {"count": 3, "selected": 3, "digest": _digest(body)}, body)
    elif damage == "unsorted":
        body = np.array([6, 3], dtype="<u4").tobytes()
        _rewrite(ipath, {"count": 2, "selected": 2, "digest": _digest(body)}, body)
    elif damage == "ranges-past-end":
        body = np.array([[0, N + 1]], dtype="<u8").tobytes()
        _rewrite(
            ipath,
            {"kind": "ranges", "dtype": "<u8", "count": 1, "selected": N + 1, "digest": _digest(body)},
            body,
        )
    elif damage == "bad-digest":
        body = bytearray(raw[16 + hlen :])
        body[0] ^= 1
        Path(ipath).write_bytes(raw[: 16 + hlen] + bytes(body))
    elif damage == "bad-dtype":
        _rewrite(ipath, {"dtype": "|O"})
    elif damage == "count-negative":
        _rewrite(ipath, {"count": -1})
    elif damage == "extra-bytes":
        Path(ipath).write_bytes(raw + b"\0" * 8)
    with pytest.raises(IndexFileError) as err:
        open_selection(store, "h")
    assert ipath in str(err.value)
    assert isinstance(err.value, StoreError)


def test_select_needs_data_with_a_path() -> None:
    with pytest.raises(TypeError, match="Subset"):
        select([b"a", b"b"], lambda r: True, name="x")


# ---- pickling, DataLoader workers, samplers and mixtures ---------------------------------------


def test_views_over_stores_pickle_as_path_and_spec(
    blob: tuple[Path, list[bytes]], sharded: tuple[Path, list[bytes]]
) -> None:
    path, recs = blob
    spath, _ = sharded
    view = Concat([Subset(smstore.open(path), [(0, 50)]), Repeat(smstore.open(spath), 1.5, seed=4)])
    state = pickle.dumps(view)
    assert len(state) < 2048
    assert recs[10] not in state
    clone = pickle.loads(state)
    assert read_all(clone) == read_all(view)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_global_shuffle_over_a_view_with_workers(blob: tuple[Path, list[bytes]], context: str) -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    path, _recs = blob
    ds = smstore.SharedStoreDataset(path, decode="bytes")
    sel = select(ds, lambda r: len(r) > 10, name="big")
    view = Concat([Repeat(sel, 1.5, seed=5), Subset(ds, [(0, 10)])])
    reference = read_all(view)
    sampler = smstore.GlobalShuffleSampler(view, seed=11, rank=0, world_size=1)
    loader = DataLoader(
        view,
        batch_size=8,
        sampler=sampler,
        num_workers=2,
        multiprocessing_context=context,
        collate_fn=tl.identity_collate,
    )
    got = [r for batch in loader for r in batch]
    assert got == [reference[i] for i in sampler]
    assert Counter(got) == Counter(reference)
    assert torch.utils.data.get_worker_info() is None


def test_view_inside_a_mixture_exact_counts(
    blob: tuple[Path, list[bytes]], sharded: tuple[Path, list[bytes]]
) -> None:
    path, _recs = blob
    spath, srecs = sharded
    a = Subset(smstore.open(path), [(0, 40), (60, 70)])
    b = Repeat(select(smstore.open(spath), lambda r: int(bytes(r[1:5])) % 2 == 1, name="odd"), 1.5, seed=9)
    ref = [read_all(a), read_all(b)]
    assert ref[1][:30] == srecs[1::2]
    ds = MixtureDataset([a, b], [0.7, 0.3], stop="all_exhausted")
    sampler = MixtureSampler(ds, seed=2, rank=0, world_size=1)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        order = list(sampler)
        assert len(order) == ds.mixture.num_samples
        per_source = Counter(ds.locate(i)[0] for i in order)
        assert [per_source[0], per_source[1]] == ds.mixture.counts(len(order))
        for i in order:
            s, j = ds.locate(i)
            assert bytes(ds[i]) == ref[s][j]
        # each source's draws: whole passes over the view plus distinct records of the next
        for s, n in enumerate(ds.mixture.lengths):
            q, r = divmod(per_source[s], n)
            times = Counter(Counter(ds.locate(i)[1] for i in order if ds.locate(i)[0] == s).values())
            assert sum(times.values()) == (n if q else r)
            assert set(times) <= {q, q + 1}


def test_import_stays_light() -> None:
    import subprocess
    import sys

    code = (
        "import smstore, sys; print('torch' in sys.modules, 'numpy' in sys.modules); "
        "import smstore.read.views as v; print(smstore.Subset is v.Subset, smstore.select is v.select); "
        "print('torch' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split() == ["False", "False", "True", "True", "False"]


def test_index_file_that_is_a_fifo_is_refused(blob: tuple[Path, list[bytes]]) -> None:
    path, _ = blob
    os.mkfifo(f"{path}.pipe.idx")
    with pytest.raises(IndexFileError, match="regular file"):
        open_selection(smstore.open(path), "pipe")  # never waits for a writer


def test_view_keeps_the_collate_guard(blob: tuple[Path, list[bytes]]) -> None:
    """A batch read through a view is the dataset's own batch: torch's default collate_fn still
    refuses memoryviews, naming the file."""
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    path, _ = blob
    ds = smstore.SharedStoreDataset(path, decode=None)
    loader = DataLoader(Subset(ds, [(0, 20)]), batch_size=4)
    with pytest.raises(smstore.CollateError, match=str(path)):
        next(iter(loader))


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_selection_selected_again_under_its_name_is_refused_in_a_worker(
    blob: tuple[Path, list[bytes]], method: str
) -> None:
    """A select() view pickles as its index file's path: rebuilt under the same name (other
    records), a spawn or forkserver worker read the new file and so other records, silently."""
    path, recs = blob
    view = select(path, lambda r: len(r) > 15, name="pick")
    state = pickle.dumps(view)
    assert tl.run_child(tl.unpickle_and_read, state, method=method) == [r for r in recs if len(r) > 15]
    # Selected again with another predicate (same data: the data's checksum still matches).
    select(path, lambda r: len(r) <= 15, name="pick", rebuild=True)
    with pytest.raises(StoreChangedError, match="changed since this view was pickled") as err:
        tl.run_child(tl.unpickle_and_read, state, method=method)
    assert f"{path}.pick.idx" in str(err.value)
    with pytest.raises(StoreChangedError, match="changed since this view was pickled"):
        pickle.loads(state)  # in this process too
    # The same selection written again holds the same indices: the pickled view still reads them.
    select(path, lambda r: len(r) > 15, name="pick", rebuild=True)
    assert tl.run_child(tl.unpickle_and_read, state, method=method) == [r for r in recs if len(r) > 15]
