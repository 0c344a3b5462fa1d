"""Object records: pack_objects, the pickle and JSON encodings, ObjectStore and decoding by default."""

from __future__ import annotations

import json
import math
import pickle
import threading
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from smstore_testlib import annotation, stray_temps

import smstore
from smstore import SharedStoreDataset

OBJECTS: list[Any] = [
    {"file_name": "a.jpg", "boxes": [[1.5, 2, 3, 4]], "labels": [3]},
    [1, 2, 3],
    (1, "tuple", b"bytes", None),
    {"nested": {"set": frozenset({1, 2}), "big": 10**40, "float": 1e-300}},
    "h\u00e9llo \U0001f600",
    b"\x00\xff" * 1000,
    None,
    {},
    bytearray(b"mutable"),
    math.pi,
]


def test_pickle_round_trip_is_byte_exact(tmp_path: Path) -> None:
    path = tmp_path / "o.smst"
    assert smstore.pack_objects(OBJECTS, path, durable=False) == len(OBJECTS)
    store = smstore.open(path)
    assert isinstance(store, smstore.ObjectStore)
    assert store.encoding == "pickle"
    assert [store[i] for i in range(len(OBJECTS))] == OBJECTS
    assert store[-1] == OBJECTS[-1]
    assert store.get_batch([4, 0]) == [OBJECTS[4], OBJECTS[0]]
    assert list(store) == OBJECTS
    for i, obj in enumerate(OBJECTS):
        assert bytes(store.raw(i)) == pickle.dumps(obj, protocol=5)
        assert bytes(smstore.Store(path)[i]) == pickle.dumps(obj, protocol=5)
    store.verify()


def test_every_access_is_a_fresh_object(tmp_path: Path) -> None:
    path = tmp_path / "o.smst"
    smstore.pack_objects([{"boxes": [1, 2]}], path, durable=False)
    store = smstore.open(path)
    first = store[0]
    first["boxes"].append(3)  # a fresh object: changing it changes nothing shared
    assert store[0] == {"boxes": [1, 2]}
    assert store[0] is not store[0]


def test_json_encoding_is_plain_json(tmp_path: Path) -> None:
    objs = [{"a": [1, 2.5, "x", None, True]}, [], "s", 3, {"t": (1, 2)}]
    path = tmp_path / "j.smst"
    smstore.pack_objects(objs, path, encoding="json", durable=False)
    store = smstore.open(path)
    assert store.encoding == "json"
    assert list(store) == [*objs[:4], {"t": [1, 2]}]  # JSON has no tuples
    raw = smstore.Store(path)
    assert [json.loads(bytes(raw[i])) for i in range(len(raw))] == list(store)


@pytest.mark.parametrize(
    ("encoding", "bad", "type_name"),
    [
        ("pickle", lambda: None, "function"),
        ("pickle", threading.Lock(), "lock"),
        ("json", b"bytes", "bytes"),
        ("json", {1, 2}, "set"),
        ("json", float("nan"), "float"),
    ],
)
def test_unencodable_object_names_index_and_type(
    tmp_path: Path, encoding: str, bad: Any, type_name: str
) -> None:
    path = tmp_path / "bad.smst"
    path.write_bytes(b"previous")
    with pytest.raises(smstore.PackInputError, match=rf"object 3 \([\w.]*{type_name}\)"):
        smstore.pack_objects([{}, {}, {}, bad, {}], path, encoding=encoding, durable=False)
    assert path.read_bytes() == b"previous"  # nothing written over it
    assert stray_temps(tmp_path) == []


def test_unknown_encoding(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="encoding must be one of"):
        smstore.pack_objects([1], tmp_path / "x.smst", encoding="yaml")
    assert not (tmp_path / "x.smst").exists()


def test_packing_streams_one_object_at_a_time(tmp_path: Path) -> None:
    n = 50_000

    def generate() -> Iterator[dict[str, Any]]:
        for i in range(n):
            yield annotation(i)

    tracemalloc.start()
    try:
        smstore.pack_objects(generate(), tmp_path / "big.smst", durable=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    size = smstore.Store(tmp_path / "big.smst").nbytes
    assert size > 10 << 20
    assert peak < size / 10  # the objects and their pickles were never all held at once
    assert smstore.open(tmp_path / "big.smst")[n - 1] == annotation(n - 1)


def test_dataset_decodes_objects_by_default(tmp_path: Path) -> None:
    path = tmp_path / "o.smst"
    smstore.pack_objects(OBJECTS, path, durable=False)
    ds = SharedStoreDataset(path)
    assert [ds[i] for i in range(len(ds))] == OBJECTS
    assert ds.__getitems__([2, 0]) == [OBJECTS[2], OBJECTS[0]]
    restored = pickle.loads(pickle.dumps(ds))
    assert restored[3] == OBJECTS[3]
    raw = SharedStoreDataset(path, decode=None)
    assert isinstance(raw[0], memoryview)


def test_other_blobs_keep_memoryviews_by_default(awkward_blob: Path) -> None:
    ds = SharedStoreDataset(awkward_blob)
    assert isinstance(ds[1], memoryview)
    assert type(smstore.open(awkward_blob)) is smstore.Store
    with pytest.raises(smstore.StoreFormatError, match="not as objects"):
        smstore.ObjectStore(awkward_blob)


def test_unknown_encoding_is_refused_at_the_call(tmp_path: Path) -> None:
    from smstore.format.objects import encode_objects

    def never_read() -> Iterator[Any]:
        raise AssertionError("the objects were read before the encoding was checked")
        yield

    with pytest.raises(ValueError, match="encoding must be one of"):
        encode_objects(never_read(), "yaml")
    with pytest.raises(ValueError, match="encoding must be one of"):
        smstore.pack_objects(never_read(), tmp_path / "o.smst", encoding="yaml")
    assert list(tmp_path.iterdir()) == []
