"""A dataset given as a URL (s3://bucket/ds/): read, held, served, inspected and verified, against moto
behind a fault proxy, with real daemons on real sockets; failed fetches tried again; fetches stopped."""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("obstore", reason="the remote extra (obstore) is not installed")
pytest.importorskip("moto.server", reason="moto[server] is not installed")

import daemon_testlib as tl
from daemon_testlib import Daemon
from remote_testlib import BUCKET, S3, SECRET, FaultProxy, bucket_dataset, remote_dataset
from smstore_testlib import read_records, run_cli, run_ranks, windowed_rank

import smstore
from smstore.daemon.planner import Backoff
from smstore.errors import DaemonError, RemoteError, RemoteNeedsDaemonError, RemoteURLError, StoreFormatError
from smstore.format import manifest as _manifest
from smstore.format.manifest import read_manifest
from smstore.remote import fetch
from smstore.wire.blocks import BlockReader, Piece, shard_block
from smstore.wire.residency import Residency


def gets(proxy: FaultProxy, key: str) -> list[str | None]:
    """The Range headers of the GETs of `key` the proxy saw (None: a whole object)."""
    return [s.range for s in proxy.seen if s.method == "GET" and s.path == f"/{BUCKET}/{key}"]


def put_manifest(s3: S3, key: str, doc: dict[str, Any]) -> str:
    return s3.put(key, json.dumps(doc).encode())


# --- read_manifest of a URL ------------------------------------------------------------------------


def test_a_manifest_url_is_read_with_one_get_and_its_shards_resolved_under_its_prefix(
    s3: S3, proxy: FaultProxy, tmp_path: Path
) -> None:
    url, _records, local = bucket_dataset(s3, tmp_path, "read")
    m = read_manifest(url)
    assert [s.range for s in proxy.seen] == [None]  # one GET of the whole manifest, no HEAD
    assert gets(proxy, "read/manifest.json") == [None]
    assert m.path == url + "manifest.json"
    assert read_manifest(m.path) == m  # the prefix or the manifest's own URL
    here = read_manifest(local)
    assert m.checksum == here.checksum
    assert [m.shard_path(k) for k in range(len(m.shards))] == [
        url + os.path.basename(here.shard_path(k)) for k in range(len(here.shards))
    ]


@pytest.mark.parametrize(
    ("path", "fault"),
    [
        ("../other/x.smst", "leaves the manifest's prefix ('..')"),
        ("sub/../../x.smst", "leaves the manifest's prefix ('..')"),
        ("/etc/passwd", "is a local path"),
        ("file:///etc/passwd", "scheme 'file' is not allowed"),
        ("http://example.com/x.smst", "scheme 'http' is not allowed"),
        ("a//b.smst", "empty, '.' or '..' path segments"),
        ("./b.smst", "empty, '.' or '..' path segments"),
        ("s3://AKIA:" + SECRET + "@bucket/x.smst", "userinfo"),
    ],
)
def test_a_remote_manifest_naming_a_shard_outside_its_prefix_is_refused_naming_the_manifest(
    s3: S3, proxy: FaultProxy, tmp_path: Path, path: str, fault: str
) -> None:
    _url, _records, local = bucket_dataset(s3, tmp_path, "hostile", shards=2)
    doc = json.loads((local / "manifest.json").read_text())
    doc["shards"][1]["path"] = path
    bad = put_manifest(s3, "hostile/bad.json", doc)
    with pytest.raises(StoreFormatError) as info:
        read_manifest(bad)
    msg = str(info.value)
    assert msg.startswith(f"{bad}: not a valid smstore manifest: shards[1].path"), msg
    assert fault in msg, msg
    assert SECRET not in msg


@pytest.mark.parametrize(
    ("body", "fault"),
    [
        (b"{not json", "invalid JSON"),
        (
            b'{"format": "smstore-manifest", "version": 1, "encoding": "bytes", "shards": {}}',
            "shards must be a list",
        ),
        (b'{"format": "smstore-manifest", "version": 99}', "newer than this smstore reads"),
    ],
)
def test_a_remote_manifest_is_validated_as_a_local_one(
    s3: S3, proxy: FaultProxy, body: bytes, fault: str
) -> None:
    url = s3.put("bad/manifest.json", body)
    with pytest.raises(StoreFormatError, match=fault) as info:
        read_manifest(s3.url("bad/"))
    assert str(info.value).startswith(url)


def test_a_remote_manifest_larger_than_the_limit_is_refused_by_its_size(
    s3: S3, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = s3.put("huge/manifest.json", b" " * 5000)
    monkeypatch.setattr(_manifest, "MAX_MANIFEST_BYTES", 4096)
    with pytest.raises(StoreFormatError, match="the manifest holds 5000 bytes, more than the 4096") as info:
        read_manifest(url)
    assert str(info.value).startswith(url)
    assert gets(proxy, "huge/manifest.json") == [None]  # refused at once, not retried


def test_a_missing_or_disallowed_manifest_url_is_a_clear_error(s3: S3, proxy: FaultProxy) -> None:
    with pytest.raises(smstore.StoreError, match="no such object") as info:
        read_manifest(s3.url("nothing-here/"))
    assert s3.url("nothing-here/manifest.json") in str(info.value)
    with pytest.raises(RemoteURLError, match="scheme 'file' is not allowed"):
        read_manifest("file:///etc/")
    assert proxy.seen == [] or all("nothing-here" in s.path for s in proxy.seen)


# --- readers of a dataset URL ----------------------------------------------------------------------


def test_a_dataset_url_without_a_daemon_says_to_run_smstore_serve(
    s3: S3, proxy: FaultProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _records, _local = bucket_dataset(s3, tmp_path, "nodaemon", shards=2)
    monkeypatch.setenv("SMSTORE_SOCKET", os.fspath(tmp_path / "none.sock"))
    for mode in ("auto", "daemon"):
        with pytest.raises(DaemonError, match="a dataset in object storage is read through the node daemon"):
            smstore.open_store(url, mode=mode)  # type: ignore[arg-type]
    with pytest.raises(RemoteNeedsDaemonError, match='mode="mmap" cannot read it'):
        smstore.open_store(url, mode="mmap")
    # One blob there (once loaded: 'smstore load URL') is read through the daemon too.
    with pytest.raises(DaemonError, match="read through the node daemon"):
        smstore.open_store(s3.url("nodaemon/x.smst"), mode="daemon")


def _says_to_serve(url: str, what: str) -> str:
    """The one message of an object reached without the daemon, as a pattern."""
    return re.escape(
        f"{url}: {what} in object storage is read through the node daemon: start 'smstore serve'"
    )


def test_every_way_to_an_object_without_a_daemon_raises_the_one_error(
    s3: S3, proxy: FaultProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """smstore.open, open_store in every mode, a dataset, a local manifest naming objects, and the
    CLI's get and wait: each gives RemoteNeedsDaemonError naming the object and 'smstore serve'."""
    from smstore.read.dataset import SharedStoreDataset

    url, _records, _local = bucket_dataset(s3, tmp_path, "noserve", shards=2)
    blob = s3.url("noserve/x.smst")
    manifest, _data, _checksums = remote_dataset(s3, tmp_path, "noserve-local", shards=2)
    first = json.loads(manifest.read_text())["shards"][0]["path"]
    monkeypatch.setenv("SMSTORE_SOCKET", os.fspath(tmp_path / "none.sock"))
    for mode in ("auto", "daemon", "mmap"):
        with pytest.raises(RemoteNeedsDaemonError, match=_says_to_serve(url, "a dataset")):
            smstore.open_store(url, mode=mode)  # type: ignore[arg-type]
        with pytest.raises(RemoteNeedsDaemonError, match=_says_to_serve(first, "a shard")):
            smstore.open_store(manifest, mode=mode)[0]  # type: ignore[arg-type]
    with pytest.raises(RemoteNeedsDaemonError, match=_says_to_serve(url, "a dataset")):
        smstore.open(url)
    with pytest.raises(RemoteNeedsDaemonError, match=_says_to_serve(blob, "a blob")):
        smstore.open(blob)
    with pytest.raises(RemoteNeedsDaemonError, match=_says_to_serve(first, "a shard")):
        smstore.open(manifest)
    with pytest.raises(RemoteNeedsDaemonError, match=_says_to_serve(url, "a dataset")):
        SharedStoreDataset(url)
    for args in (("get", url, "0"), ("get", blob, "0"), ("wait", url, "--timeout", "0.1")):
        res = run_cli(*args)
        assert res.returncode == 1, res
        err = res.stderr.decode()
        assert re.search(r"in object storage is read through the node daemon: start 'smstore serve'", err), (
            err
        )
    # A URL given with credentials is shown without them, as every URL error shows it.
    with pytest.raises(RemoteNeedsDaemonError) as info:
        smstore.open(f"s3://user:{SECRET}@{BUCKET}/noserve/")
    assert SECRET not in str(info.value)


def test_a_dataset_url_pickles_with_its_manifest_and_its_copy_reads_without_a_fetch(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    url, records, _local = bucket_dataset(s3, tmp_path, "pickled", shards=2)
    d = start_daemon(loaded=0)
    pytest.importorskip("torch")
    ds = smstore.SharedStoreDataset(url, mode="auto", decode="bytes", socket=d.sock)
    assert ds.path == url
    assert len(ds) == len(records)
    rank, reply = tl.hold(d.sock, url, [0, 1])
    try:
        assert reply["ok"] is True, reply
        tl.wait_status(d, lambda st: len(st["segments"]) == 2 and not st["loading"], timeout=60)
        copy = pickle.loads(pickle.dumps(ds))
        proxy.inject(*["403"] * 50)  # the copy fetches nothing (a spawned worker needs no credentials)
        proxy.seen.clear()
        assert [copy[i] for i in range(len(records))] == records
        assert proxy.seen == []
    finally:
        rank.close()
        ds.store.close()


def test_a_windowed_epoch_from_a_dataset_url_at_2_ranks_x_2_workers(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    pytest.importorskip("torch")
    url, records, _local = bucket_dataset(s3, tmp_path, "windowed", shards=6)
    cache = tmp_path / "cache"
    d = start_daemon(args=("--cache-dir", os.fspath(cache), "--cache-limit", str(64 << 20)), loaded=0)
    # Opened (its manifest fetched) here, in the parent; the ranks are processes of their own, as a
    # launcher starts them (spawned: obstore's runtime, which this process used, does not survive a
    # fork; a rank forked from here hung once beside busy processes), and read it as pickled.
    ds = smstore.SharedStoreDataset(url, decode="bytes")  # mode "auto": a URL is read through the daemon
    try:
        ranks = run_ranks(windowed_rank, [(ds, r, 2) for r in range(2)], method="spawn")
        results = {rank: (kind, got) for rank, kind, got in ranks}
    finally:
        ds.store.close()
    assert [results[r][0] for r in range(2)] == ["daemon", "daemon"]
    assert sorted(results[0][1] + results[1][1]) == sorted(records)  # every record once, byte-exact
    m = d.status()["metrics"]
    assert m["cache_misses"] == 6  # each shard fetched once for the node
    log = d.log.read_text()
    assert log.count("read the manifest") == 1, log  # kept by URL: every later hold uses it
    assert SECRET not in log


def test_spawned_workers_of_a_windowed_sampler_read_a_dataset_url(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    torch = pytest.importorskip("torch")
    url, records, _local = bucket_dataset(s3, tmp_path, "spawned", shards=4)
    d = start_daemon(loaded=0)
    ds = smstore.SharedStoreDataset(url, decode="bytes", socket=d.sock)
    sampler = smstore.WindowedShuffleSampler(ds, window=2, seed=3, lag=32)
    try:
        loader = torch.utils.data.DataLoader(
            ds,
            sampler=sampler,
            batch_size=32,
            num_workers=2,
            collate_fn=list,
            multiprocessing_context="spawn",
        )
        assert sorted(r for batch in loader for r in batch) == sorted(records)
        assert sampler.residency is not None
        assert sampler.residency.kind == "daemon"
    finally:
        sampler.close()
        ds.store.close()


def test_block_residency_and_reader_over_a_dataset_url(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    url, records, _local = bucket_dataset(s3, tmp_path, "blocks", shards=2)
    d = start_daemon(loaded=0)
    sizes = [s.records for s in read_manifest(url).shards]
    residency = Residency(url, mode="auto", socket=os.fspath(d.sock))
    reader = BlockReader(url, block=500, socket=os.fspath(d.sock))
    try:
        pieces = sorted({Piece(k, *shard_block(n, 500, i)) for k, n in enumerate(sizes) for i in range(n)})
        residency.hold(pieces, wait=True)
        assert residency.kind == "daemon"
        assert [reader[i] for i in range(len(records))] == records
        assert reader.file_reads == 0
    finally:
        reader.close()
        residency.close()


# --- a shard or block read while no sampler holds it --------------------------------------------------
# A local shard not held is read from its file; one in object storage has none. The reader used to
# wait for a hold that never came (REMOTE_WAIT, 600 s): with a plain sampler, or when a sampler's
# lag released a shard that DataLoader workers still read (a rank of the windowed epoch above hung
# so, beside busy processes). Now it holds the shard (or block) itself and the daemon fetches it.


@pytest.fixture
def short_remote_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader that waits for a hold gives up after 20 s, not 600 (the old code failed so, not hung)."""
    monkeypatch.setattr(smstore.wire.ipc, "REMOTE_WAIT", 20.0)


def test_a_reader_of_a_dataset_url_no_sampler_holds_gets_every_record_fetched_for_it(
    s3: S3,
    proxy: FaultProxy,
    tmp_path: Path,
    start_daemon: Callable[..., Daemon],
    short_remote_wait: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url, records, _local = bucket_dataset(s3, tmp_path, "unheld", shards=3)
    d = start_daemon(args=("--cache-dir", os.fspath(tmp_path / "cache"), "--cache-limit", "64M"), loaded=0)
    ds = smstore.open_store(url, mode="daemon", socket=d.sock)
    try:
        with caplog.at_level("WARNING", logger="smstore"):
            got = read_records(ds)
        # Backwards too: each shard is held (replacing the last) and fetched again through the cache.
        back = [bytes(ds[i]) for i in reversed(range(len(ds)))]
    finally:
        ds.close()
    assert got == records
    assert back == records[::-1]
    warned = [r.getMessage() for r in caplog.records if "no sampler holds it" in r.getMessage()]
    assert len(warned) == 1, warned  # once per process and dataset
    assert "smstore load" in warned[0]
    m = d.status()["metrics"]
    assert m["cache_misses"] == 3  # each shard fetched from the bucket once
    assert m["held_wanted"] == 0  # a reader's own hold is none of the ranks' windows


def test_a_shard_a_reader_holds_for_itself_makes_room_for_a_samplers_shard(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon], short_remote_wait: None
) -> None:
    """A reader's own hold stays (no fetch again while there is room) but never keeps a sampler's
    shard out: under a budget of two shards, the rank's hold of two others releases it (its pages
    count until the reader unmaps it), and both load once it does."""
    url, records, local = bucket_dataset(s3, tmp_path, "roomy", shards=3)
    shards = read_manifest(local).shards
    budget = 2 * max(-(-s.file_size // 4096) * 4096 for s in shards)
    d = start_daemon(args=("--shm-limit", str(budget)), loaded=0)
    ds = smstore.open_store(url, mode="daemon", socket=d.sock)
    rank = None
    try:
        assert bytes(ds[0]) == records[0]  # shard 0, held by the reader for itself
        assert [seg["checksum"] for seg in d.status()["segments"]] == [shards[0].checksum]
        rank, reply = tl.hold(d.sock, url, [1, 2], dataset=read_manifest(url).checksum)
        assert reply["ok"] is True, reply
        tl.wait_status(d, lambda st: shards[1].checksum in {seg["checksum"] for seg in st["segments"]})
        status = d.status()
        assert shards[0].checksum not in {seg["checksum"] for seg in status["segments"]}  # released for room
        ds.release_shard(0)  # the reader unmaps it: its pages are room now
        tl.wait_status(d, lambda st: len(st["segments"]) == 2)
        assert {seg["checksum"] for seg in d.status()["segments"]} == {shards[1].checksum, shards[2].checksum}
    finally:
        ds.close()
        if rank is not None:
            rank.close()


def test_a_reader_of_a_local_manifest_of_url_shards_named_relatively_holds_them_by_its_absolute_path(
    s3: S3,
    proxy: FaultProxy,
    tmp_path: Path,
    start_daemon: Callable[..., Daemon],
    short_remote_wait: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    manifest, data, _checksums = remote_dataset(s3, tmp_path, "relative", shards=2)
    d = start_daemon(loaded=0)
    monkeypatch.chdir(tmp_path)
    ds = smstore.open_store(os.path.relpath(manifest, tmp_path), mode="daemon", socket=d.sock)
    try:
        first = bytes(ds[0])
    finally:
        ds.close()
    with smstore.open(tmp_path / "relative-local") as here:
        assert first == bytes(here[0])
    assert len(data) == 2
    reader = BlockReader(os.path.relpath(manifest, tmp_path), block=300, socket=os.fspath(d.sock))
    try:
        assert reader[0] == first
    finally:
        reader.close()


def test_a_forked_worker_reading_a_dataset_url_no_sampler_holds_reads_every_record(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon], short_remote_wait: None
) -> None:
    torch = pytest.importorskip("torch")
    url, records, local = bucket_dataset(s3, tmp_path, "plain", shards=3)
    d = start_daemon(loaded=0)
    ds = smstore.SharedStoreDataset(url, decode="bytes", socket=d.sock)
    loader = torch.utils.data.DataLoader(
        ds,
        sampler=torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(5)),
        batch_size=64,
        num_workers=2,
        collate_fn=list,
        multiprocessing_context="fork",
    )
    try:
        assert sorted(r for batch in loader for r in batch) == sorted(records)
    finally:
        ds.store.close()
    # Each worker fetched each shard at most once: a reader's own hold is no window the others
    # follow (they unmapped every shard but the one held, and fetched it again: 2,500 fetches).
    total = sum(s.file_size for s in read_manifest(local).shards)
    assert d.status()["metrics"]["fetched_bytes"] <= 2 * total


def test_a_reader_whose_own_hold_is_refused_gets_the_daemons_reason_at_once(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon], short_remote_wait: None
) -> None:
    url, _records, _local = bucket_dataset(s3, tmp_path, "toobig", shards=2)
    d = start_daemon(args=("--shm-limit", "4K"), loaded=0)  # a shard (about 12 KiB) never fits
    ds = smstore.open_store(url, mode="daemon", socket=d.sock)
    try:
        with pytest.raises(DaemonError, match=r"toobig/part-.*\.smst.*--shm-limit"):
            ds[0]
    finally:
        ds.close()


def test_a_block_reader_of_a_dataset_url_no_sampler_holds_gets_every_record_fetched_for_it(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon], short_remote_wait: None
) -> None:
    url, records, _local = bucket_dataset(s3, tmp_path, "blocks-unheld", shards=2)
    d = start_daemon(loaded=0)
    reader = BlockReader(url, block=400, socket=os.fspath(d.sock))
    try:
        assert [reader[i] for i in range(len(records))] == records
        assert (reader.block_reads, reader.file_reads) == (len(records), 0)
    finally:
        reader.close()


# --- the daemon and a manifest URL -----------------------------------------------------------------


def test_the_daemon_reads_a_held_manifest_url_once_and_again_when_another_dataset_is_held(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    url, _records, local = bucket_dataset(s3, tmp_path, "kept", shards=3)
    first = read_manifest(url)
    d = start_daemon(loaded=0)
    proxy.seen.clear()
    conns = []
    try:
        for _ in range(3):
            s, reply = tl.hold(d.sock, url + "manifest.json", [0], dataset=first.checksum)
            conns.append(s)
            assert reply["ok"] is True, reply
        assert gets(proxy, "kept/manifest.json") == [None]  # fetched once, kept by URL
        # The manifest is replaced in the bucket (a dataset of its first two shards): a reader of the
        # new one makes the daemon fetch it again; a reader of the old one is then told it was replaced.
        doc = json.loads((local / "manifest.json").read_text())
        doc["shards"] = doc["shards"][:2]
        doc["records"] = sum(e["records"] for e in doc["shards"])
        doc["data_bytes"] = sum(e["data_bytes"] for e in doc["shards"])
        put_manifest(s3, "kept/manifest.json", doc)
        second = read_manifest(url)
        proxy.seen.clear()
        s, reply = tl.hold(d.sock, url + "manifest.json", [1], dataset=second.checksum)
        conns.append(s)
        assert reply["ok"] is True, reply
        assert gets(proxy, "kept/manifest.json") == [None]
        s, refused = tl.hold(d.sock, url + "manifest.json", [0], dataset=first.checksum)
        conns.append(s)
        assert refused["ok"] is False
        assert "the manifest was replaced in the bucket" in refused["message"], refused
        s, refused = tl.hold(d.sock, url + "manifest.json", [2], dataset=second.checksum)
        conns.append(s)
        assert refused["ok"] is False
        assert "has 2 shards" in refused["message"], refused
    finally:
        for s in conns:
            s.close()


def test_a_hold_naming_a_manifest_url_the_daemon_will_not_fetch_is_refused(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    d = start_daemon(loaded=0)
    proxy.seen.clear()
    for bad, fault in [
        ("file:///etc/passwd", "scheme 'file' is not allowed"),
        (f"s3://AKIA:{SECRET}@{BUCKET}/x/manifest.json", "userinfo"),
        (s3.url("missing/manifest.json"), "no such object"),
    ]:
        s, refused = tl.hold(d.sock, bad, [0])
        s.close()
        assert refused["ok"] is False, refused
        assert fault in refused["message"], refused
        assert SECRET not in json.dumps(refused)
    assert [s.path for s in proxy.seen] == [f"/{BUCKET}/missing/manifest.json"]
    assert SECRET not in d.log.read_text()


# --- the command line ------------------------------------------------------------------------------


def smstore_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "smstore", *args], capture_output=True, text=True, timeout=120, check=False
    )


# --- smstore load / unload / serve of a URL, and smstore.open(url) -----------------------------------


def test_smstore_load_of_a_dataset_url_pins_every_shard_until_unload(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    url, records, local = bucket_dataset(s3, tmp_path, "pinned", shards=3)
    here = read_manifest(local)
    d = start_daemon(loaded=0)
    res = smstore_cli("load", "--socket", os.fspath(d.sock), url)
    assert res.returncode == 0, res.stderr
    assert f"{url}: loaded 3 shards" in res.stdout
    status = d.status()
    assert sorted(seg["checksum"] for seg in status["segments"]) == sorted(s.checksum for s in here.shards)
    assert status["metrics"]["held_wanted"] == 0  # pinned by the load, not held by a rank
    proxy.seen.clear()
    with smstore.open(url, socket=d.sock) as ds:  # every shard served: nothing fetched, no hold
        assert read_records(ds) == records
    assert [s for s in proxy.seen if s.path.endswith(".smst")] == []
    res = smstore_cli("unload", "--socket", os.fspath(d.sock), url)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("unloaded") == 3
    assert d.status()["segments"] == []


def test_smstore_serve_of_a_dataset_url_loads_every_shard_at_start(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    url, _records, local = bucket_dataset(s3, tmp_path, "atstart", shards=2)
    here = read_manifest(local)
    d = start_daemon(args=(url, "--require"), loaded=2)
    assert sorted(seg["checksum"] for seg in d.status()["segments"]) == sorted(
        s.checksum for s in here.shards
    )
    assert SECRET not in d.log.read_text()


def test_a_blob_url_is_opened_once_loaded_and_said_how_before(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    url, records, local = bucket_dataset(s3, tmp_path, "oneblob", shards=2)
    blob = read_manifest(local).shards[0]
    blob_url = url + blob.path
    d = start_daemon(loaded=0)
    with pytest.raises(DaemonError, match=r"oneblob/part-.*\.smst.*smstore load"):
        smstore.open(blob_url, socket=d.sock)
    assert d.status()["segments"] == []  # nothing fetched for a reader that asked to open it
    res = smstore_cli("load", "--socket", os.fspath(d.sock), blob_url)
    assert res.returncode == 0, res.stderr
    assert f"xxh64:{blob.checksum}" in res.stdout
    res = smstore_cli("wait", "--socket", os.fspath(d.sock), "--timeout", "60", blob_url)
    assert res.returncode == 0, res.stderr
    assert "served (1 blob(s)" in res.stdout
    with smstore.open(blob_url, socket=d.sock) as store:
        assert [bytes(r) for r in store] == records[: blob.records]
        assert store.checksum == blob.checksum


def test_a_blob_url_of_objects_opens_decoded_unless_raw(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    objects = [{"id": i, "text": "x" * (i % 13)} for i in range(200)]
    local = tmp_path / "objects.smst"
    smstore.pack_objects(objects, local)
    blob_url = s3.put("objects/objects.smst", local.read_bytes())
    d = start_daemon(loaded=0)
    res = smstore_cli("load", "--socket", os.fspath(d.sock), blob_url)
    assert res.returncode == 0, res.stderr
    with smstore.open(blob_url, socket=d.sock) as store:
        assert list(store) == objects
        assert store[7] == objects[7]
    with smstore.open(blob_url, socket=d.sock, raw=True) as raw, smstore.open(local, raw=True) as here:
        assert [bytes(r) for r in raw] == [bytes(r) for r in here]


def test_a_load_naming_a_url_checks_the_allow_list_and_the_checksum_it_names(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    url, _records, local = bucket_dataset(s3, tmp_path, "checked", shards=2)
    here = read_manifest(local)
    d = start_daemon(loaded=0)
    proxy.seen.clear()
    oversized = "s3://smstore-test/" + "x" * 5000 + ".smst"
    for bad in (
        {"op": "load", "path": "file:///etc/passwd"},
        {"op": "load", "path": "gopher://example.com/x.smst"},
        {"op": "load", "path": oversized},
        {"op": "load", "path": ["s3://smstore-test/x.smst"]},
        {"op": "load", "path": url + here.shards[0].path, "checksum": "not-a-checksum"},
        {"op": "unload", "path": oversized},
    ):
        reply = tl.ask(d.sock, bad)
        assert (reply["ok"], reply["error"]) == (False, "bad_request"), reply
    wrong = here.shards[1].checksum
    reply = tl.ask(d.sock, {"op": "load", "path": url + here.shards[0].path, "checksum": wrong})
    assert reply["ok"] is False, reply
    assert f"records {wrong}" in reply["message"]
    assert "checked/part-" in reply["message"]
    assert [s.range for s in proxy.seen] == ["bytes=0-4095"]  # its header only: nothing loaded
    assert d.status()["segments"] == []


def test_info_of_a_dataset_url_and_of_a_blob_url_reading_only_its_header(
    s3: S3, proxy: FaultProxy, tmp_path: Path
) -> None:
    url, records, local = bucket_dataset(s3, tmp_path, "info", shards=3)
    res = smstore_cli("info", "--json", url)
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    here = read_manifest(local)
    assert info["path"] == url + "manifest.json"
    assert (info["records"], info["shards"]) == (len(records), 3)
    assert info["checksum"] == f"manifest:{here.checksum}"
    blob = here.shards[1]
    proxy.seen.clear()
    res = smstore_cli("info", "--json", url + blob.path)
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert (info["records"], info["file_bytes"], info["checksum"]) == (
        blob.records,
        blob.file_size,
        f"xxh64:{blob.checksum}",
    )
    assert [(s.method, s.range) for s in proxy.seen] == [("GET", "bytes=0-4095")]  # the header only


def test_verify_of_a_dataset_url_streams_every_shard_and_names_a_bad_one(
    s3: S3, proxy: FaultProxy, tmp_path: Path
) -> None:
    url, _records, local = bucket_dataset(s3, tmp_path, "verify", shards=3)
    res = smstore_cli("verify", url)
    assert res.returncode == 0, res.stderr
    assert "all checksums match" in res.stdout
    m = read_manifest(local)
    bad = bytearray((local / m.shards[2].path).read_bytes())
    bad[-1] ^= 1  # same size, one byte flipped
    s3.put(f"verify/{m.shards[2].path}", bytes(bad))
    res = smstore_cli("verify", url)
    assert res.returncode == 1
    assert f"shard 2 FAILED: {url}{m.shards[2].path}: checksum mismatch" in res.stderr, res.stderr
    assert "shard 0" not in res.stderr
    assert "shard 1" not in res.stderr
    res = smstore_cli("verify", url + m.shards[2].path)  # one blob: its header's checksum is the word
    assert res.returncode == 1
    assert "checksum mismatch" in res.stderr, res.stderr
    assert SECRET not in res.stderr


@pytest.mark.parametrize("command", ["wait", "doctor"])
def test_wait_and_doctor_of_a_url_end_by_their_timeout_while_the_store_stalls(
    s3: S3, proxy: FaultProxy, tmp_path: Path, command: str
) -> None:
    """The readiness probes' deadline counts from the start: a manifest or header read that object
    storage never answers (nor its retries) fails the command by it."""
    url, _records, local = bucket_dataset(s3, tmp_path, f"stalled-{command}", shards=2)
    blob = url + read_manifest(local).shards[0].path
    sock = tmp_path / "run" / "smstore.sock"  # no daemon: the datasets are read first
    for target in (url, blob):
        proxy.stalled.clear()
        proxy.inject(*["stall"] * 50)  # every request, each until the test ends
        # The old code read the dataset before its deadline began: a stalled GET timed out after
        # 120 s, 8 times. The subprocess's own timeout ends the test's wait for that.
        res = subprocess.run(
            [sys.executable, "-m", "smstore", command, "--timeout", "2", "--socket", str(sock), target],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proxy.stalled.is_set()  # the read did stall
        assert res.returncode == 1, (res.stdout, res.stderr)
        said = res.stderr if command == "wait" else res.stdout
        assert "no answer before the deadline" in said, said
        if command == "doctor":
            assert "FAIL dataset: s3://" in res.stdout
        assert SECRET not in res.stdout + res.stderr


# --- a failed fetch is tried again after its backoff -----------------------------------------------


def test_backoff_doubles_to_its_longest_and_is_forgotten_on_success() -> None:
    now = [100.0]
    b = Backoff(30.0, 600.0, clock=lambda: now[0])
    assert b.due("u")
    assert [b.failed("u") for _ in range(7)] == [30.0, 60.0, 120.0, 240.0, 480.0, 600.0, 600.0]
    assert not b.due("u")
    now[0] += 599.0
    assert not b.due("u")
    now[0] += 1.0
    assert b.due("u")
    b.succeeded("u")
    assert b.failed("u") == 30.0
    assert Backoff(0.0).failed("v") == 0.0
    assert Backoff(0.0).due("v")


@pytest.mark.parametrize("cached", [False, True])
def test_a_shard_that_failed_its_checksum_is_fetched_again_by_a_hold_after_its_backoff(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon], cached: bool
) -> None:
    url, records, local = bucket_dataset(s3, tmp_path, f"again{int(cached)}", shards=2)
    m = read_manifest(local)
    key = f"again{int(cached)}/{m.shards[1].path}"
    good = (local / m.shards[1].path).read_bytes()
    s3.put(key, good[:-1] + bytes([good[-1] ^ 1]))  # a corrupt upload
    args = ["--fetch-backoff", "0"]
    if cached:
        args += ["--cache-dir", os.fspath(tmp_path / "cache"), "--cache-limit", str(64 << 20)]
    d = start_daemon(args=tuple(args), loaded=0)
    rank, reply = tl.hold(d.sock, url, [1])
    try:
        assert reply["ok"] is True, reply
        tl.wait_status(d, lambda st: not st["loading"] and st["metrics"]["loads"].get("failed", 0) >= 1)
        # While it is failed, a reader hears why.
        store = smstore.open_store(url, mode="daemon", socket=d.sock)
        with pytest.raises(DaemonError, match="checksum mismatch"):
            store[len(records) - 1]
        store.close()
        s3.put(key, good)  # uploaded again, correctly
        again, reply = tl.hold(d.sock, url, [1])  # a later hold, its backoff over: fetched again
        rank.close()
        rank = again
        assert reply["ok"] is True, reply
        tl.wait_status(d, lambda st: len(st["segments"]) == 1 and not st["loading"])
        store = smstore.open_store(url, mode="daemon", socket=d.sock)
        assert bytes(store[len(records) - 1]) == records[-1]
        store.close()
    finally:
        rank.close()


def test_a_block_shard_that_failed_is_read_again_by_a_hold_after_its_backoff(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    url, records, local = bucket_dataset(s3, tmp_path, "blockagain", shards=2)
    m = read_manifest(local)
    key = f"blockagain/{m.shards[0].path}"
    proxy.inject("403", matches=lambda method, path, headers: method == "GET" and path.endswith(key))
    d = start_daemon(args=("--fetch-backoff", "0"), loaded=0)
    residency = Residency(url, mode="daemon", socket=os.fspath(d.sock))
    pieces = [Piece(0, 0, m.shards[0].records)]
    try:
        residency.hold(pieces, wait=True)
        tl.wait_status(d, lambda st: st["metrics"]["loads"].get("failed", 0) >= 1 or bool(st["segments"]))
        failing = BlockReader(url, block=m.shards[0].records, socket=os.fspath(d.sock))
        with pytest.raises(DaemonError, match=r"403|AccessDenied|Forbidden"):
            failing[0]
        failing.close()
        residency.hold(pieces, wait=True)  # a later hold: read again (the 403 was a one-off)
        reader = BlockReader(url, block=m.shards[0].records, socket=os.fspath(d.sock))
        assert [reader[i] for i in range(m.shards[0].records)] == records[: m.shards[0].records]
        assert reader.file_reads == 0
        reader.close()
    finally:
        residency.close()


# --- a direct fetch honours --max-read-rate and stops with the daemon ------------------------------


def test_fetch_is_paced_to_its_rate_and_stops_when_told(s3: S3, proxy: FaultProxy, tmp_path: Path) -> None:
    url, _records, local = bucket_dataset(s3, tmp_path, "paced", shards=1)
    m = read_manifest(local)
    shard = m.shards[0]
    stop = threading.Event()
    out: list[object] = []

    def run() -> None:
        buf = bytearray(shard.file_size)
        try:
            # 1000 seconds' worth at this rate: only `stop` ends it.
            out.append(fetch(url + shard.path, buf, size=shard.file_size, checksum=shard.checksum,
                             rate=max(1, shard.file_size // 1000), stop=stop))  # fmt: skip
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            out.append(e)

    t = threading.Thread(target=run)
    t.start()
    try:
        while not any(s.method == "GET" for s in proxy.answered) and t.is_alive():
            t.join(0.01)  # every byte was sent: an unpaced fetch ends now
        t.join(0.5)
        assert t.is_alive()  # held by the rate
        assert not out
    finally:
        stop.set()
        t.join(60)
    assert isinstance(out[0], RemoteError), out
    assert "stopped" in str(out[0])


def test_a_direct_fetch_is_paced_by_max_read_rate_and_a_stop_ends_it(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    manifest, data, _checksums = remote_dataset(s3, tmp_path, "paced-daemon", shards=2)
    m = read_manifest(manifest)
    assert len(data[0]) > 16 << 10  # over 16 s at 1 KiB/s
    d = start_daemon(args=("--max-read-rate", "1K"), loaded=0)
    rank, reply = tl.hold(d.sock, os.fspath(manifest), [0, 1])
    try:
        assert reply["ok"] is True, reply
        key = m.shards[0].path.split("://", 1)[1]
        while not any(s.path == f"/{key}" and s.range for s in proxy.answered):
            time.sleep(0.01)
        # Every byte of shard 0 was sent: an unpaced fetch would serve it now.
        st = d.status()
        assert st["segments"] == [], st
        assert len(st["loading"]) == 2, st  # under way (paced) and queued
    finally:
        rank.close()
    tl.cli("stop", sock=d.sock)
    assert d.proc.wait(timeout=60) == 0  # the paced fetch ends at once, not after its 16 s
    log = d.log.read_text()
    assert "loaded " not in log, log


def test_a_daemon_told_to_stop_mid_fetch_does_not_wait_for_a_stalled_request(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    manifest, _data, _checksums = remote_dataset(s3, tmp_path, "stalled", shards=1)
    url = read_manifest(manifest).shards[0].path
    # The shard's ranged GET stalls (no byte ever comes, until the test ends): only its timeout,
    # two minutes, would end it.
    proxy.inject("stall", matches=lambda method, path, headers: method == "GET" and "range" in headers)
    d = start_daemon(loaded=0)
    rank, reply = tl.hold(d.sock, os.fspath(manifest), [0])
    try:
        assert reply["ok"] is True, reply
        assert proxy.stalled.wait(60)
    finally:
        rank.close()
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout=60) == 0  # not after the stalled request's timeout
    log = d.log.read_text()
    assert f"loaded {url}" not in log, log
    assert SECRET not in log


def test_fetch_stop_is_not_a_failure_of_a_done_fetch(s3: S3, proxy: FaultProxy, tmp_path: Path) -> None:
    url, _records, local = bucket_dataset(s3, tmp_path, "unstopped", shards=1)
    shard = read_manifest(local).shards[0]
    buf = bytearray(shard.file_size)
    result = fetch(
        url + shard.path, buf, size=shard.file_size, checksum=shard.checksum, stop=threading.Event()
    )
    assert result.bytes == shard.file_size
    assert bytes(buf) == (local / shard.path).read_bytes()
