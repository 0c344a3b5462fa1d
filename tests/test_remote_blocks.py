"""Blocks of shards in object storage: the daemon reads each one with one ranged GET (moto behind a fault proxy)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest

pytest.importorskip("obstore", reason="the remote extra (obstore) is not installed")
pytest.importorskip("moto.server", reason="moto[server] is not installed")

from remote_testlib import S3, SECRET, FaultProxy, remote_dataset
from smstore_testlib import block_rank, read_records, run_ranks

import smstore
from smstore.errors import DaemonError
from smstore.format.manifest import read_manifest
from smstore.sampling import BlockWindowSampler, block_bounds
from smstore.wire.blocks import BlockReader, Piece
from smstore.wire.residency import Residency

from .daemon_testlib import Daemon


def block_ranges(manifest: Path, block: int, data: list[bytes]) -> dict[int, set[str]]:
    """Per shard, the Range headers of its blocks' bytes (``bytes=A-B``, B inclusive), from the local bytes."""
    m = read_manifest(manifest)
    first, length, shard = block_bounds([s.records for s in m.shards], block)
    starts = [0]
    for s in m.shards:
        starts.append(starts[-1] + s.records)
    out: dict[int, set[str]] = {k: set() for k in range(len(m.shards))}
    for f, n, k in zip(first.tolist(), length.tolist(), shard.tolist(), strict=True):
        index = int.from_bytes(data[k][56:64], "little")  # the header's index_offset (docs/format.md)
        lo, hi = (
            int.from_bytes(data[k][index + 8 * i : index + 8 * i + 8], "little")
            for i in (f - starts[k], f - starts[k] + n)
        )
        out[k].add(f"bytes={4096 + lo}-{4096 + hi - 1}")
    return out


def test_a_block_epoch_from_a_bucket_reads_each_block_with_one_ranged_get(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """R=2 ranks x K=2 workers, BlockWindowSampler over shards in a bucket: every record once,
    byte-exact, and the daemon's only reads of each shard are its header, its index and metadata,
    and one ranged GET of exactly each block's bytes, each once (read amplification 1.0)."""
    pytest.importorskip("torch")
    manifest, data, _checksums = remote_dataset(s3, tmp_path, "blocks", shards=3)
    recs = read_records(tmp_path / "blocks-local")
    block, spread = 150, 3
    d = start_daemon(loaded=0)
    proxy.seen.clear()
    rank = partial(block_rank, seed=9, lag=64, batch=16)
    results = dict(run_ranks(rank, [(os.fspath(manifest), r, 2, block, spread) for r in range(2)]))
    n = len(recs)
    merged = [results[i % 2][i // 2] for i in range(n)]
    ref = BlockWindowSampler(
        [s.records for s in read_manifest(manifest).shards],
        block=block,
        spread=spread,
        seed=9,
        residency=False,
    )
    assert [i for i, _d, _b in merged] == list(ref)  # the sampler's order, across ranks and workers
    assert sorted(i for i, _d, _b in merged) == list(range(n))  # every record once
    assert all(got == recs[i] for i, got, _b in merged)  # byte-exact
    assert all(b == 1 for _i, _d, b in merged)  # every record from a block the daemon fetched
    # What the daemon read of each object: its header, then its index and metadata (one GET each),
    # then each block once, one ranged GET of exactly its bytes.
    expected = block_ranges(manifest, block, data)
    gets = [s for s in proxy.seen if s.method == "GET"]
    for k, url in enumerate(s.path for s in read_manifest(manifest).shards):
        path = "/" + url.split("://", 1)[1]
        mine = [s.range for s in gets if s.path == path]
        index_offset = int.from_bytes(data[k][56:64], "little")
        assert mine[0] == "bytes=0-4095", mine
        assert mine[1] == f"bytes={index_offset}-{len(data[k]) - 1}", mine
        assert sorted(mine[2:]) == sorted(expected[k]), (k, mine)  # each block once, nothing else
    status = d.status()
    assert status["metrics"]["fetched_bytes"] == sum(
        int(r.split("=")[1].split("-")[1]) - int(r.split("=")[1].split("-")[0]) + 1
        for ranges in expected.values()
        for r in ranges
    )
    assert SECRET not in json.dumps(status)
    assert SECRET not in d.log.read_text()


def test_a_shard_replaced_in_the_bucket_is_refused_and_its_readers_hear_why(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    manifest, data, checksums = remote_dataset(s3, tmp_path, "replaced", shards=2)
    doc = json.loads(manifest.read_text())
    url = doc["shards"][0]["path"]
    # Another blob (of another checksum) under shard 0's name, of the size the manifest now says.
    doc["shards"][0]["file_size"] = len(data[1])
    manifest.write_text(json.dumps(doc))
    s3.put(url.split("/", 3)[3], data[1])
    start_daemon(loaded=0)
    residency = Residency(manifest, mode="daemon")
    reader = BlockReader(manifest, block=10**6)
    records = doc["shards"][0]["records"]
    try:
        residency.hold([Piece(0, 0, records)], wait=True)
        with pytest.raises(
            DaemonError, match=rf"{re.escape(url)}.*holds checksum {checksums[1]}.*{checksums[0]}"
        ):
            reader[0]
        with pytest.raises(DaemonError, match="publish the dataset again"):
            residency.hold([Piece(0, 0, records)], wait=True)
        assert reader.block_reads == reader.file_reads == 0
    finally:
        reader.close()
        residency.close()


def test_a_block_read_that_fails_is_retried_then_served(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    manifest, _data, _checksums = remote_dataset(s3, tmp_path, "retried", shards=2)
    m = read_manifest(manifest)
    d = start_daemon(loaded=0)
    # The index reads go through; the block's ranged GET meets a reset, then a 503.
    proxy.inject(
        "reset",
        "503",
        matches=lambda _method, _path, headers: any(
            k.lower() == "range" and v.startswith("bytes=4096-") for k, v in headers.items()
        ),
    )
    residency = Residency(manifest, mode="daemon")
    reader = BlockReader(manifest, block=10**6)
    try:
        residency.hold([Piece(1, 0, m.shards[1].records)], wait=True)
        first = m.shards[0].records
        local = smstore.open(tmp_path / "retried-local")
        try:
            assert reader[first] == bytes(local[first])
            assert reader[first + 5] == bytes(local[first + 5])
        finally:
            local.close()
        assert reader.block_reads == 2
        faults = [s.fault for s in proxy.seen if s.fault]
        assert faults == ["reset", "503"], proxy.seen
        assert d.status()["metrics"]["fetched_bytes"] > 0
    finally:
        reader.close()
        residency.close()


def test_blocks_of_a_bucket_without_the_daemon_say_to_run_it(s3: S3, tmp_path: Path) -> None:
    manifest, _data, _checksums = remote_dataset(s3, tmp_path, "nodaemon-blocks", shards=2)
    url = json.loads(manifest.read_text())["shards"][0]["path"]
    reader = BlockReader(manifest, block=100, socket=os.fspath(tmp_path / "none" / "smstore.sock"))
    try:
        with pytest.raises(
            DaemonError, match=rf"{re.escape(url)}#records=0-\d+: a shard in object storage is read through"
        ):
            reader[0]
        assert reader.block_reads == reader.file_reads == 0
    finally:
        reader.close()
