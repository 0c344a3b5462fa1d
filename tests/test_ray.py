"""Packing on a real local Ray cluster: one shard per write task, joined into a manifest, byte-exact
with a one-process pack of the same records."""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from smstore_testlib import read_records

import smstore

ray = pytest.importorskip("ray")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from smstore.integrations.ray import SmstoreDatasink


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """A local Ray cluster (GCS, raylet, 2 worker CPUs) whose files live in a temp dir of its own."""
    # Ray's socket paths go deep under it: a short name keeps them under the 107-byte limit.
    short = Path(tempfile.mkdtemp(prefix="ray"))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # Ray's notices about its own fields
            ray.init(
                num_cpus=2,
                include_dashboard=False,
                _temp_dir=os.fspath(short),
                object_store_memory=200 << 20,
                log_to_driver=False,
                configure_logging=False,
            )
            ctx = ray.data.DataContext.get_current()
            ctx.execution_options.preserve_order = True
            ctx.enable_progress_bars = False
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(short, ignore_errors=True)


def awkward(n: int) -> list[bytes]:
    recs = [f"{i}:".encode() + bytes((i * 13 + j) % 256 for j in range(i % 300)) for i in range(n)]
    recs[3] = b""
    recs[4] = b"\n\r\x00\xff"
    return recs


def test_ray_write_tasks_make_the_shards_of_one_dataset(cluster: None, tmp_path: Path) -> None:
    recs = awkward(5000)
    src = tmp_path / "in.parquet"
    pq.write_table(
        pa.table({"data": pa.array(recs, pa.binary()), "n": list(range(len(recs)))}), src, row_group_size=600
    )
    one = tmp_path / "one.smst"
    smstore.pack(recs, one)

    ds = ray.data.read_parquet(os.fspath(src)).repartition(6)
    out = tmp_path / "ds"
    ds.write_datasink(SmstoreDatasink(out, column="data", metadata={"engine": "ray"}))

    with smstore.open(out, verify=True) as s, smstore.open(one) as o:
        assert isinstance(s, smstore.ShardedStore)
        assert s.shard_count == 6
        assert s.encoding == "bytes"
        assert s.metadata["user"] == {"engine": "ray"}
        assert read_records(s) == [bytes(r) for r in o]
    shards = sorted(p.name for p in out.iterdir() if p.suffix == ".smst")
    assert len(shards) == 6
    assert len({name.split("-")[1] for name in shards}) == 1  # one run id for every task


def test_ray_rows_as_objects(cluster: None, tmp_path: Path) -> None:
    rows = [
        {"id": i, "caption": f"image {i} " + "é" * (i % 7), "boxes": [[i, i + 1, 2.5, 3.5]]}
        for i in range(800)
    ]
    ds = ray.data.from_items(rows).repartition(3)
    out = tmp_path / "objs"
    ds.write_datasink(SmstoreDatasink(out))
    with smstore.open(out) as s:
        assert isinstance(s, smstore.ShardedObjectStore)
        assert s.encoding == "pickle"
        got = list(s)
        assert pickle.loads(s.raw(0)) == got[0]
    assert [
        {"id": r["id"], "caption": r["caption"], "boxes": [list(b) for b in r["boxes"]]} for r in got
    ] == rows


def test_a_failed_write_leaves_the_previous_dataset(cluster: None, tmp_path: Path) -> None:
    out = tmp_path / "ds"
    ray.data.from_items([{"text": f"line {i}"} for i in range(100)]).repartition(2).write_datasink(
        SmstoreDatasink(out, column="text")
    )
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def boom(row: dict[str, object]) -> dict[str, object]:
        if row["text"] == "line 70":
            raise RuntimeError("bad row")
        return row

    bad = ray.data.from_items([{"text": f"line {i}"} for i in range(100)]).repartition(2).map(boom)
    with pytest.raises(Exception, match="bad row"):
        bad.write_datasink(SmstoreDatasink(out, column="text"))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    with smstore.open(out) as s:
        assert s.encoding == "lines"
        assert bytes(s[99]) == b"line 99"
