"""A dataset given as a URL (s3://bucket/ds/): read, held, served, inspected and verified, against moto
behind a fault proxy, with real daemons on real sockets; failed fetches tried again; fetches stopped."""

from __future__ import annotations

import json
import os
import pickle
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
from smstore_testlib import run_ranks
from test_remote import run_rank

import smstore
from smstore import _manifest
from smstore._blocks import BlockReader, BlockResidency, Piece, shard_block
from smstore._manifest import read_manifest
from smstore.daemon.planner import Backoff
from smstore.errors import DaemonError, RemoteError, RemoteURLError, StoreFormatError
from smstore.remote import fetch


def gets(proxy: FaultProxy, key: str) -> list[str | None]:
    """The Range headers of the GETs of `key` the proxy saw (None: a whole object)."""
    return [s.range for s in proxy.seen if s.method == "GET" and s.path == f"/{BUCKET}/{key}"]


def hold(sock: Path, url: str, shards: list[int], dataset: str | None = None) -> tuple[Any, dict[str, Any]]:
    """A rank's hold of shards of the dataset at `url` (its connection, open while it holds), and the reply."""
    msg: dict[str, Any] = {"op": "hold", "manifest": url, "shards": ",".join(map(str, shards))}
    if dataset is not None:
        msg["dataset"] = dataset
    s = tl.raw(sock)
    s.sendall(tl.frame(json.dumps(msg).encode()))
    reply = tl.read_reply(s)
    assert reply is not None
    return s, reply


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
    with pytest.raises(RemoteURLError, match='mode="mmap" cannot read it'):
        smstore.open_store(url, mode="mmap")
    with pytest.raises(RemoteURLError, match="not a dataset URL"):
        smstore.open_store(s3.url("nodaemon/x.smst"), mode="daemon")


def test_a_dataset_url_pickles_with_its_manifest_and_its_copy_reads_without_a_fetch(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    url, records, _local = bucket_dataset(s3, tmp_path, "pickled", shards=2)
    d = start_daemon(loaded=0)
    pytest.importorskip("torch")
    ds = smstore.SharedStoreDataset(url, mode="auto", decode="bytes", socket=d.sock)
    assert ds.path == url
    assert len(ds) == len(records)
    rank, reply = hold(d.sock, url, [0, 1])
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
        ranks = run_ranks(run_rank, [(ds, r, 2) for r in range(2)], method="spawn")
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
    residency = BlockResidency(url, mode="auto", socket=os.fspath(d.sock))
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
            s, reply = hold(d.sock, url + "manifest.json", [0], first.checksum)
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
        s, reply = hold(d.sock, url + "manifest.json", [1], second.checksum)
        conns.append(s)
        assert reply["ok"] is True, reply
        assert gets(proxy, "kept/manifest.json") == [None]
        s, refused = hold(d.sock, url + "manifest.json", [0], first.checksum)
        conns.append(s)
        assert refused["ok"] is False
        assert "the manifest was replaced in the bucket" in refused["message"], refused
        s, refused = hold(d.sock, url + "manifest.json", [2], second.checksum)
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
        s, refused = hold(d.sock, bad, [0])
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
    rank, reply = hold(d.sock, url, [1])
    try:
        assert reply["ok"] is True, reply
        tl.wait_status(d, lambda st: not st["loading"] and st["metrics"]["loads"].get("failed", 0) >= 1)
        # While it is failed, a reader hears why.
        store = smstore.open_store(url, mode="daemon", socket=d.sock)
        with pytest.raises(DaemonError, match="checksum mismatch"):
            store[len(records) - 1]
        store.close()
        s3.put(key, good)  # uploaded again, correctly
        again, reply = hold(d.sock, url, [1])  # a later hold, its backoff over: fetched again
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
    residency = BlockResidency(url, mode="daemon", socket=os.fspath(d.sock))
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
    rank, reply = hold(d.sock, os.fspath(manifest), [0, 1])
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
    rank, reply = hold(d.sock, os.fspath(manifest), [0])
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
