"""DecodedCache and TransformLoader(cache="node"): decoded samples computed once per node, in daemon-owned memory.

Real daemons on real sockets, real worker processes (forkserver), real jobs (separate Python
processes), counted decodes (each decode appends its record's index to a log), byte-exact outputs.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import cache_testlib
import numpy as np
import pytest
import torch
import transform_testlib as tt
from cache_testlib import SIDE, Decode, FailingDecode, Uncached, augment, decoded_counts, shifted
from daemon_testlib import (
    Daemon,
    as_user,
    ask,
    assert_alive_and_clean,
    group_daemon,
    hold,
    raw,
    read_reply_fds,
    send,
    wait_status,
)
from daemon_testlib import dataset as sharded_dataset
from torch.utils.data import DataLoader

import smstore
from smstore import _core, daemon_request
from smstore.daemon.caches import DESCRIPTORS_KEPT
from smstore.daemon.metrics import render
from smstore.errors import CollateError
from smstore.format.manifest import read_manifest
from smstore.loading import decoded_cache
from smstore.loading.decoded_cache import DecodedCache, _layout_from_json, _layout_json, transform_identity
from smstore.loading.layout import Layout
from smstore.wire.client.session import DaemonSession, session_for

N = 300
TESTS = Path(__file__).parent
CHUNK = 4096  # chunk_bytes: 20 records a chunk, 15 chunks (a record's row is 192 + 4 + 8 bytes)


@pytest.fixture
def numbered(tmp_path: Path) -> Path:
    path = tmp_path / "numbered.smst"
    smstore.pack([tt.numbered_record(i) for i in range(N)], path)
    return path


def dataset(path: Path) -> smstore.SharedStoreDataset:
    return smstore.SharedStoreDataset(path, decode="bytes", mode="mmap")


def check(got: Any, i: int, scale: int = 3) -> None:
    want = Decode(None, scale)(tt.numbered_record(i))
    assert got["image"].dtype == np.uint8
    assert got["image"].shape == (SIDE, SIDE, 3)
    assert np.array_equal(got["image"], want["image"]), i
    assert got["label"] == want["label"], i


def caches(d: Daemon) -> list[dict[str, Any]]:
    return list(d.status()["decoded_caches"])


def read_job(d: Daemon, numbered: Path, log: Path | str, scale: int = 3) -> subprocess.Popen[str]:
    """A job of its own (cache_testlib's `read`): every record through a DecodedCache, checked; its
    counts come on its stdout as JSON."""
    args = ["read", os.fspath(d.sock), os.fspath(numbered), os.fspath(log), str(scale)]
    return subprocess.Popen(
        [sys.executable, TESTS / "cache_testlib.py", *args], stdout=subprocess.PIPE, text=True
    )


def finished(job: subprocess.Popen[str]) -> dict[str, int]:
    """A read job's counts, once it ended well."""
    out, _err = job.communicate(timeout=120)
    assert job.returncode == 0
    counts: dict[str, int] = json.loads(out)
    return counts


def batches(loader: smstore.TransformLoader) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in b.items()} for b in loader]


# ---- the rules: byte-identical, once per node -----------------------------------------------------------


def test_cached_batches_are_byte_identical_to_uncached_ones_and_each_record_is_decoded_once(
    numbered: Path, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    d = start_daemon()
    ds = dataset(numbered)
    log = tmp_path / "decodes"
    sampler = smstore.GlobalShuffleSampler(ds, seed=5)

    def run(**kw: Any) -> list[list[dict[str, torch.Tensor]]]:
        torch.manual_seed(11)  # the workers' seeds: the random part draws the same either way
        epochs = []
        with smstore.TransformLoader(
            ds, augment, batch_size=16, sampler=sampler, num_workers=2, **kw
        ) as loader:
            for epoch in range(2):
                sampler.set_epoch(epoch)
                epochs.append(batches(loader))
        return epochs

    want = run(prepare=Decode())
    before = decoded_counts(log)
    got = run(prepare=Decode(log), cache="node", socket=d.sock)
    assert before == {}
    for g_epoch, w_epoch in zip(got, want, strict=True):
        assert len(g_epoch) == len(w_epoch) == -(-N // 16)
        for g, w in zip(g_epoch, w_epoch, strict=True):
            assert list(g) == list(w)
            for key in w:
                assert g[key].dtype == w[key].dtype
                assert torch.equal(g[key], w[key])
    # Record 0 once more: the constructing process decodes it to learn the layout (and caches it).
    assert decoded_counts(log) == dict.fromkeys(range(N), 1)
    (entry,) = caches(d)
    assert entry["fills"] == N
    assert entry["hits"] >= N
    assert entry["uncached"] == 0
    assert entry["ready"] == N
    assert entry["held"] == entry["chunks"]


def test_racing_workers_of_two_loaders_decode_each_record_once(
    numbered: Path, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """Two loaders of 4 workers each read the same order at once: every record is decoded by one
    process, the others wait for it; nothing they receive is wrong."""
    d = start_daemon()
    ds = dataset(numbered)
    log = tmp_path / "decodes"
    decode = Decode(log, slow=0.002)
    spec = {"image": ((SIDE, SIDE, 3), "uint8"), "label": ((), "float32")}  # no decode to learn it
    loaders = [
        smstore.TransformLoader(
            ds, None, prepare=decode, cache="node", socket=d.sock, batch_size=4, num_workers=4, spec=spec
        )
        for _ in range(2)
    ]
    try:
        for a, b in zip(*loaders, strict=True):
            for batch in (a, b):
                for row, i in enumerate(batch["label"].mul(7).round().long().tolist()):
                    check({k: v[row].numpy() for k, v in batch.items()}, i)
    finally:
        for loader in loaders:
            loader.close()
    assert decoded_counts(log) == dict.fromkeys(range(N), 1)
    (entry,) = caches(d)
    assert entry["fills"] == N
    assert (
        entry["hits"] + entry["fills"] == 2 * N
    )  # every read of the second loader was a hit or a wait's hit


def test_two_jobs_share_one_cache_and_another_transform_is_another_cache(
    numbered: Path, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    d = start_daemon()
    log = tmp_path / "decodes"

    jobs = [read_job(d, numbered, log), read_job(d, numbered, log)]
    counts = [finished(job) for job in jobs]
    assert sum(c["fills"] for c in counts) == N
    assert sum(c["hits"] for c in counts) >= N
    decoded = decoded_counts(log)
    # Record 0 twice at most: when both jobs learn the layout by a decode at the same moment.
    assert decoded.pop(0) in (1, 2)
    assert decoded == dict.fromkeys(range(1, N), 1)
    assert caches(d)[0]["fills"] == N

    assert finished(read_job(d, numbered, log, scale=5))["fills"] == N  # a miss for every record
    assert sorted(c["fills"] for c in caches(d)) == [N, N]


def test_a_changed_transform_is_another_identity() -> None:
    base = transform_identity(Decode(None, 3))
    assert transform_identity(Decode(None, 3)) == base
    assert transform_identity(Decode(None, 4)) != base  # an attribute
    assert transform_identity(Decode(None, 3), version="pillow 11") != base  # a declared version
    assert transform_identity(Decode(Path("/x"), 3)) != base

    def scaled(k: int) -> Callable[[bytes], bytes]:
        def f(record: bytes) -> bytes:
            return record * k

        return f

    assert transform_identity(scaled(2)) == transform_identity(scaled(2))
    assert transform_identity(scaled(2)) != transform_identity(scaled(3))  # a closure

    def default(record: bytes, k: int = 2) -> bytes:
        return record * k

    def default3(record: bytes, k: int = 3) -> bytes:
        return record * k

    def code(record: bytes, k: int = 2) -> bytes:
        return record * k + b"."

    assert transform_identity(default) != transform_identity(default3)  # a default
    assert transform_identity(default) != transform_identity(code)  # the code
    assert transform_identity(functools.partial(default, k=2)) != transform_identity(
        functools.partial(default, k=3)
    )
    assert transform_identity(np.sin) != transform_identity(np.cos)


# ---- failures: a killed worker, a killed daemon ------------------------------------------------------


@pytest.fixture
def claimer() -> Iterator[Callable[[Daemon, Path, Path, int], tuple[subprocess.Popen[str], int]]]:
    """Starts a job that claims a record, writes half its row and waits; killed (by pid) at the end."""
    started: list[subprocess.Popen[str]] = []

    def start(d: Daemon, numbered: Path, log: Path, index: int) -> tuple[subprocess.Popen[str], int]:
        args = ["claim", os.fspath(d.sock), os.fspath(numbered), os.fspath(log), str(index)]
        cmd = [sys.executable, os.fspath(TESTS / "cache_testlib.py"), *args]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        started.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line[:1] == ["claimed"], line
        return proc, int(line[1])

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_a_worker_killed_while_writing_a_record_leaves_it_unseen_and_decoded_again(
    numbered: Path, tmp_path: Path, start_daemon: Callable[..., Daemon], claimer: Any
) -> None:
    d = start_daemon()
    log = tmp_path / "decodes"
    index = 47
    proc, token = claimer(d, numbered, log, index)
    cache = DecodedCache(dataset(numbered), Decode(log), socket=d.sock, chunk_bytes=CHUNK)
    k, r = divmod(index, cache.rows)
    chunk = cache._chunk(k)
    assert chunk is not None
    assert _core.claim_state(chunk.words, r) == token  # claimed, half written: not readable
    assert chunk.fields[0][r, 0, 0, 0] == 255
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(cache[index]))
    reader.start()  # it waits for the claimant: its record is not there to read
    while cache.counts()["waits"] == 0:
        time.sleep(0.005)
    assert reader.is_alive()
    assert not got
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    reader.join(60)
    check(got[0], index)  # the daemon gave the record back: this process decoded it
    assert cache.counts()["waits"] == 1
    assert cache.counts()["fills"] == 1
    assert decoded_counts(log).get(index) == 1  # the killed claimant never decoded it
    st = wait_status(d, lambda st: st["decoded_caches"][0]["resets"] == 1)
    assert st["decoded_caches"][0]["resets"] == 1
    check(cache[index], index)
    assert cache.counts()["hits"] == 1


def test_a_daemon_killed_mid_epoch_leaves_every_read_right_and_its_successor_starts_a_new_cache(
    numbered: Path, tmp_path: Path, start_daemon: Callable[..., Daemon], claimer: Any
) -> None:
    d = start_daemon()
    log = tmp_path / "decodes"
    ds = dataset(numbered)
    cache = DecodedCache(ds, Decode(log), socket=d.sock, chunk_bytes=CHUNK)
    for i in range(N // 2):
        check(cache[i], i)
    index = N - 3
    claimer(d, numbered, log, index)  # a worker writing a record when the daemon dies
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    for i in range(N):  # ready rows are read, the rest decoded: the dead claimant's record too
        check(cache[i], i)
    # Record 0 counts twice: its fill (the decode that told the layout) at the first use, then its read.
    assert cache.counts()["hits"] == N // 2 + 1
    assert decoded_counts(log).get(N // 2, 0) == 1  # uncached: decoded, not claimed
    successor = start_daemon()
    fresh = DecodedCache(ds, Decode(log), socket=successor.sock, chunk_bytes=CHUNK)
    for i in range(N):
        check(fresh[i], i)
    assert fresh.counts()["fills"] == N  # nothing of the dead daemon's cache was adopted
    assert [c["ready"] for c in caches(successor)] == [N]


# ---- the budget: partial caches, eviction ------------------------------------------------------------


def _limit(chunks: int, cache: DecodedCache) -> int:
    return 4096 + chunks * _core.shm_footprint(cache.layout.slot_bytes)


def test_a_cache_larger_than_the_budget_is_filled_in_part_and_hits_what_it_holds(
    numbered: Path, start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    ds = dataset(numbered)
    probe = DecodedCache(ds, Decode(), socket=tmp_path / "none.sock", chunk_bytes=CHUNK)
    limit = _limit(3, probe)
    d = start_daemon(args=("--shm-limit", str(limit)))
    cache = DecodedCache(ds, Decode(), socket=d.sock, chunk_bytes=CHUNK)
    for _epoch in range(2):
        for i in range(N):
            check(cache[i], i)
    held = 3 * cache.rows
    # Record 0 is read once more from the cache: the decode that told the layout filled it first.
    assert cache.counts() == {"hits": held + 1, "fills": held, "waits": 0, "uncached": 2 * (N - held)}
    (entry,) = caches(d)
    assert entry["held"] == 3
    assert entry["ready"] == held
    assert entry["bytes"] <= limit
    assert d.status()["shm"]["used"] <= limit


def test_an_idle_cache_is_evicted_for_another_cache_and_for_a_hold(
    numbered: Path, start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    ds = dataset(numbered)
    probe = DecodedCache(ds, Decode(), socket=tmp_path / "none.sock", chunk_bytes=CHUNK)
    shards = sharded_dataset(tmp_path, shards=2)
    shard_pages = max(_core.shm_footprint(s.file_size) for s in read_manifest(shards).shards)
    limit = _limit(15, probe) + shard_pages // 2  # one whole cache, or half of one and a shard
    d = start_daemon(args=("--shm-limit", str(limit)))
    log = tmp_path / "decodes"
    finished(read_job(d, numbered, log))
    assert [c["held"] for c in caches(d)] == [15]  # the whole cache, idle now (its job ended)
    other = DecodedCache(ds, Decode(None, 5), socket=d.sock, chunk_bytes=CHUNK)
    for i in range(N):
        check(other[i], i, scale=5)
    assert other.counts()["uncached"] == 0  # the idle cache made room for the one in use
    st = d.status()
    held = {c["id"]: c["held"] for c in st["decoded_caches"]}
    assert held.pop(other.identity) == 15
    left = sum(held.values())  # of the idle cache: what the budget still had room for
    assert st["metrics"]["decoded_evictions"] == 15 - left > 0
    assert st["shm"]["used"] <= limit
    # While it is in use, a rank's hold waits for room rather than take the cache's; once idle,
    # its parts go for the hold.
    rank, reply = hold(d.sock, shards, [0])
    try:
        assert reply["ok"], reply
        st = d.status()  # the hold's plan ran before its reply: no room, so nothing loads
        assert (st["counts"]["held"], st["loading"]) == (0, [])
        assert [c["clients"] for c in st["decoded_caches"] if c["id"] == other.identity] == [[os.getpid()]]
        del other
        gc.collect()
        session_for(d.sock).close()  # this process's connection: its cache is idle now
        st = wait_status(d, lambda st: st["counts"]["held"] == 1)
        assert st["counts"]["held"] == 1
        assert st["shm"]["used"] <= limit
        assert st["metrics"]["decoded_evictions"] > 15 - left
    finally:
        rank.close()


# ---- who may use it -----------------------------------------------------------------------------------


def _cache_message(cache: DecodedCache, chunk: int) -> dict[str, Any]:
    return {
        "op": "cache",
        "cache": cache.identity,
        "records": len(cache),
        "rows": cache.rows,
        "slot_bytes": cache.layout.slot_bytes,
        "last_bytes": cache._last.slot_bytes,
        "chunk": chunk,
    }


def test_a_group_member_can_neither_make_nor_read_a_cache(
    numbered: Path,
    blob: tuple[Path, list[bytes]],
    start_daemon: Callable[..., Daemon],
    request: pytest.FixtureRequest,
) -> None:
    d, group = group_daemon(blob, start_daemon, request)
    cache = DecodedCache(dataset(numbered), Decode(), socket=d.sock, chunk_bytes=CHUNK)
    check(cache[5], 5)
    messages = [
        _cache_message(cache, -1),
        _cache_message(cache, 0),
        {"op": "attach", "key": f"{cache.identity}:0"},
        {"op": "attach", "checksum": f"{cache.identity}:0"},
        {"op": "attach", "key": f"{cache.identity}:meta"},
    ]

    def member() -> str:
        answers = []
        for message in messages:
            with raw(d.sock) as s:
                send(s, message)
                reply, fds = read_reply_fds(s)
                for fd in fds:
                    os.close(fd)
                answers.append(f"{bool(reply and reply['ok'])}:{len(fds)}:{reply and reply.get('error')}")
        return " ".join(answers)

    answers = as_user(member, [group.gr_gid]).split()
    assert answers[:2] == ["False:0:permission_denied"] * 2, answers
    assert all(a.startswith("False:0:") for a in answers), answers
    assert_alive_and_clean(d)


@pytest.mark.parametrize(
    ("change", "fault"),
    [
        ({"cache": "xyz"}, "'cache' must be 64"),
        ({"cache": "A" * 64}, "'cache' must be 64"),
        ({"records": 0}, "'records' must be"),
        ({"records": True}, "'records' must be"),
        ({"rows": 1 << 30}, "'rows' must be"),
        ({"slot_bytes": 100}, "multiple of 64"),
        ({"slot_bytes": 64}, "8 bytes a row"),
        ({"chunk": 15}, "no chunk 15"),
        ({"last_bytes": 8192}, "at most 'slot_bytes'"),
        ({"last_bytes": 65}, "'last_bytes' must be a multiple of 64"),
        ({"lookup": True, "chunk": 2}, "a lookup asks for the meta page"),
        ({"chunk": -2}, "'chunk' must be"),
        ({"records": N + 1}, "has 300 records"),
    ],
)
def test_a_malformed_cache_request_is_refused_by_name(
    numbered: Path, start_daemon: Callable[..., Daemon], change: dict[str, Any], fault: str
) -> None:
    d = start_daemon()
    cache = DecodedCache(dataset(numbered), Decode(), socket=d.sock, chunk_bytes=CHUNK)
    check(cache[0], 0)  # the cache exists: a request of another geometry is refused
    reply = ask(d.sock, {**_cache_message(cache, 1), **change})
    assert (reply["ok"], reply["error"]) == (False, "bad_request"), reply
    assert fault in reply["message"], reply
    fresh = {**_cache_message(cache, 3), "cache": "b" * 64}
    assert ask(d.sock, fresh)["message"].endswith("ask for its meta page (chunk -1) first")
    assert_alive_and_clean(d)


# ---- the API --------------------------------------------------------------------------------------------


def test_what_the_api_refuses(numbered: Path, tmp_path: Path) -> None:
    ds = dataset(numbered)
    with pytest.raises(ValueError, match="cache must be None or 'node'"):
        smstore.TransformLoader(ds, None, prepare=Decode(), cache="disk", batch_size=4)
    with pytest.raises(ValueError, match="pass the transform's deterministic part as prepare="):
        smstore.TransformLoader(ds, Decode(), cache="node", batch_size=4)
    with pytest.raises(TypeError, match="pass key="):
        DecodedCache([b"0:a", b"1:b"], Decode())
    with pytest.raises(ValueError, match="empty"):
        DecodedCache([], Decode(), key="none")
    keyed = DecodedCache(
        [tt.numbered_record(i) for i in range(3)], Decode(), key="three", socket=tmp_path / "no.sock"
    )
    with pytest.raises(IndexError):
        keyed[3]
    check(keyed[-1], 2)  # no daemon: decoded, not cached (and said once in the log)
    assert keyed.counts()["uncached"] == 1


def test_the_prepare_argument_alone_composes_the_two_parts(numbered: Path) -> None:
    ds = dataset(numbered)
    torch.manual_seed(3)
    with smstore.TransformLoader(ds, augment, prepare=Decode(), batch_size=10, num_workers=1) as loader:
        got = batches(loader)
    torch.manual_seed(3)
    with smstore.TransformLoader(
        ds, lambda r: augment(Decode()(r)), batch_size=10, num_workers=1, multiprocessing_context="fork"
    ) as loader:
        want = batches(loader)
    assert all(torch.equal(g[k], w[k]) for g, w in zip(got, want, strict=True) for k in w)


def test_status_and_metrics_say_what_the_caches_do(
    numbered: Path, start_daemon: Callable[..., Daemon]
) -> None:
    d = start_daemon()
    spec = {"image": ((SIDE, SIDE, 3), "uint8"), "label": ((), "float32")}
    cache = DecodedCache(dataset(numbered), Decode(), socket=d.sock, chunk_bytes=5000, spec=spec)
    assert (cache.rows, cache.chunks) == (24, 13)  # the last chunk holds 12 records: it is smaller
    for i in (*range(40), *range(10)):
        check(cache[i], i)
    (entry,) = caches(d)
    assert {
        k: entry[k] for k in ("records", "rows", "chunks", "held", "ready", "hits", "fills", "uncached")
    } == {
        "records": N,
        "rows": cache.rows,
        "chunks": -(-N // cache.rows),
        "held": -(-40 // cache.rows),
        "ready": 40,
        "hits": 10,
        "fills": 40,
        "uncached": 0,
    }
    assert entry["clients"] == [os.getpid()]
    st = d.status()
    text = render(st["metrics"])
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("smstore_decoded"))
    assert {k: float(v) for k, v in values.items()} == {
        "smstore_decoded_hits_total": 10,
        "smstore_decoded_fills_total": 40,
        "smstore_decoded_uncached_total": 0,
        "smstore_decoded_evictions_total": 0,
        "smstore_decoded_bytes": entry["bytes"],
    }
    assert any(s["segment"].startswith("memfd:smstore-cache-") for s in st["segments"])
    for i in range(N):
        check(cache[i], i)
    bytes_ = caches(d)[0]["bytes"]
    assert bytes_ == 4096 + 12 * _core.shm_footprint(cache.layout.slot_bytes) + _core.shm_footprint(
        cache._last.slot_bytes
    )
    assert cache._last.slot_bytes < cache.layout.slot_bytes


def test_a_process_learns_the_layout_from_the_cache_and_decodes_nothing_to_build_it(
    numbered: Path, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    d = start_daemon()
    log = tmp_path / "decodes"
    ds = dataset(numbered)
    first = DecodedCache(ds, Decode(log), socket=d.sock, chunk_bytes=CHUNK)
    assert decoded_counts(log) == {0: 1}  # the first learns the layout by a decode...
    check(first[7], 7)  # ...which is record 0's fill, once it has the cache
    assert first.counts()["fills"] == 2
    second = DecodedCache(ds, Decode(log), socket=d.sock, chunk_bytes=CHUNK)
    assert decoded_counts(log) == {0: 1, 7: 1}  # the second learns it from the cache
    assert (second.identity, second.rows, second.layout.describe()) == (
        first.identity,
        first.rows,
        first.layout.describe(),
    )
    for i in (0, 7):
        check(second[i], i)
    assert second.counts() == {"hits": 2, "fills": 0, "waits": 0, "uncached": 0}


def test_a_dataset_with_a_transform_through_the_dataloader(
    numbered: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """The same for a Dataset: DecodedCache(transform=) is what DataLoader reads, batches as uncached."""
    d = start_daemon()
    ds = dataset(numbered)
    cached = DecodedCache(ds, Decode(), transform=augment, socket=d.sock, chunk_bytes=CHUNK)

    def epochs(data: Any) -> list[dict[str, torch.Tensor]]:
        torch.manual_seed(2)  # the DataLoader seeds each worker's random from it
        loader = DataLoader(data, batch_size=16, num_workers=2, multiprocessing_context="forkserver")
        return [b for _ in range(2) for b in loader]

    got, want = epochs(cached), epochs(Uncached(ds))
    assert len(got) == len(want) == 2 * -(-N // 16)
    for g, w in zip(got, want, strict=True):
        assert all(torch.equal(g[k], w[k]) for k in w)
    (entry,) = caches(d)
    assert (entry["fills"], entry["hits"]) == (N, N)


def test_smstore_status_says_what_each_cache_holds(
    numbered: Path, start_daemon: Callable[..., Daemon]
) -> None:
    d = start_daemon()
    cache = DecodedCache(dataset(numbered), Decode(), socket=d.sock, chunk_bytes=CHUNK)
    for i in range(30):
        check(cache[i], i)
    out = subprocess.run(
        [sys.executable, "-m", "smstore", "status", "--socket", os.fspath(d.sock)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert f"decoded cache {cache.identity[:12]}: 30 of {N} records ready, 2 of 15 chunks held" in out
    assert "fills 30" in out
    assert "smstore-cache-" not in out  # its parts are not listed as segments


@pytest.mark.parametrize(
    "text",
    [
        b"",
        b"[]",
        b"{}",
        b'{"kind": "dict", "fields": []}',
        b'{"kind": "tree", "fields": [["x", [2], "<u1"]]}',
        b'{"kind": "dict", "fields": [[0, [2], "<u1"]]}',
        b'{"kind": "seq", "fields": [[1, [2], "<u1"]]}',
        b'{"kind": "single", "fields": [[null, [2], "<u1"], [null, [2], "<u1"]]}',
        b'{"kind": "dict", "fields": [["x", [-1], "<u1"]]}',
        b'{"kind": "dict", "fields": [["x", [2.5], "<u1"]]}',
        b'{"kind": "dict", "fields": [["x", [2], "O"]]}',
        b'{"kind": "dict", "fields": [["x", [2], "no such dtype"]]}',
        b'{"kind": "dict", "fields": [["x", [2]]]}',
        b'{"kind": "dict", "fields": [["x", [2], "<u1", 4]]}',
        b'{"kind": "dict", "fields": [["x", ' + b"[1]" * 1 + b', "<u1"]]' + b"}" * 2,
        b"\xff\xfe",
    ],
)
def test_a_meta_page_that_tells_no_layout_is_refused(text: bytes) -> None:
    """What another process wrote is checked: anything but a layout is an error, never a wrong layout."""
    with pytest.raises((ValueError, TypeError, CollateError)):
        _layout_from_json(text)


def test_a_layout_round_trips_through_its_text() -> None:
    for spec in (
        {"image": ((8, 8, 3), "uint8"), "label": ((), "float32")},
        ((4,), "int16"),
        [((2,), "f8"), ((), "i4")],
    ):
        layout = Layout.from_spec(spec, 1)
        back = _layout_from_json(_layout_json(layout))
        assert (back.kind, back.describe()) == (layout.kind, layout.describe())


# ---- what a review found: stale tokens, stopped claimants, identity, read-only views, room ---------------


def test_a_replaced_connection_never_claims_with_its_old_token(
    numbered: Path, tmp_path: Path, start_daemon: Callable[..., Daemon], claimer: Any
) -> None:
    """The session reconnects (a failed exchange): the daemon reset the old connection's claims, so
    this process starts over on the new one; a record it claims after is reset if it dies too."""
    d = start_daemon()
    cache = DecodedCache(dataset(numbered), Decode(), socket=d.sock, chunk_bytes=CHUNK)
    check(cache[5], 5)
    old = cache._token
    session_for(d.sock)._drop_connection()  # as a failed exchange does; the next ask reconnects
    check(cache[6], 6)
    assert cache._token not in (old, 0)
    chunk = cache._chunks[0]
    assert _core.claim(chunk.words, 9, cache._token) == _core.CLAIM_EMPTY  # claimed with the new token
    session_for(d.sock).close()  # ... whose connection closes as if the process died
    st = wait_status(d, lambda st: st["decoded_caches"][0]["resets"] == 1)
    assert st["decoded_caches"][0]["resets"] == 1
    assert _core.claim_state(chunk.words, 9) == _core.CLAIM_EMPTY


def test_a_stopped_claimant_stalls_a_reader_no_longer_than_its_wait_timeout(
    numbered: Path, tmp_path: Path, start_daemon: Callable[..., Daemon], claimer: Any
) -> None:
    d = start_daemon()
    log = tmp_path / "decodes"
    proc, _token = claimer(d, numbered, log, 33)
    proc.send_signal(signal.SIGSTOP)  # stopped mid-write, alive: its claim stays
    try:
        cache = DecodedCache(
            dataset(numbered), Decode(log), socket=d.sock, chunk_bytes=CHUNK, wait_timeout=0.3
        )
        check(cache[33], 33)  # decoded here, not cached
        assert cache.counts()["waits"] == 1
        assert cache.counts()["uncached"] == 1
    finally:
        proc.send_signal(signal.SIGCONT)


def test_a_record_whose_prepare_raises_is_left_unclaimed(
    numbered: Path, start_daemon: Callable[..., Daemon]
) -> None:
    d = start_daemon()
    cache = DecodedCache(dataset(numbered), FailingDecode(13), socket=d.sock, chunk_bytes=CHUNK)
    with pytest.raises(ValueError, match="record 13 is bad"):
        cache.__getitems__([12, 13, 14])
    words = cache._chunks[0].words
    assert [_core.claim_state(words, r) for r in (12, 13, 14)] == [_core.CLAIM_READY, 0, 0]
    check(cache[14], 14)


def test_what_the_dataset_does_to_a_record_is_part_of_the_identity(numbered: Path, tmp_path: Path) -> None:
    none = tmp_path / "none.sock"
    plain = DecodedCache(dataset(numbered), Decode(), socket=none, key=None)
    cropped = DecodedCache(
        smstore.SharedStoreDataset(numbered, decode="bytes", mode="mmap", transform=tt.ragged),
        Decode(),
        socket=none,
    )
    assert plain.identity != cropped.identity


def test_a_global_list_the_transform_reads_is_part_of_its_identity() -> None:
    before = transform_identity(shifted)
    cache_testlib.SHIFT[1] = 5
    try:
        assert transform_identity(shifted) != before
    finally:
        cache_testlib.SHIFT[1] = 0
    assert transform_identity(shifted) == before


def test_writing_into_a_cached_record_through_torch_faults_and_changes_nothing(
    numbered: Path, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """The views are of a read-only mapping: a transform writing through torch.from_numpy kills its
    process (SIGSEGV) rather than change every job's copy; a numpy write raises."""
    d = start_daemon()
    cache = DecodedCache(dataset(numbered), Decode(), socket=d.sock, chunk_bytes=CHUNK)
    got = cache[4]
    with pytest.raises(ValueError, match="read-only"):
        got["image"] += 1
    args = ["scribble", os.fspath(d.sock), os.fspath(numbered), os.fspath(tmp_path / "log"), "4"]
    out = subprocess.run(
        [sys.executable, os.fspath(TESTS / "cache_testlib.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)),  # no core file
    )
    assert out.returncode == -signal.SIGSEGV, (out.returncode, out.stdout, out.stderr)
    assert out.stdout.split() == ["read"]
    check(cache[4], 4)
    fresh = DecodedCache(dataset(numbered), Decode(), socket=d.sock, chunk_bytes=CHUNK)
    check(fresh[4], 4)
    assert fresh.counts()["hits"] == 1


def test_a_cache_in_use_leaves_a_window_room_to_move_on(
    numbered: Path, start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """A rank holds a shard, a cache in use fills the rest of the budget: the cache keeps the room
    of the largest held piece free, so the rank's next window (a shard as large) loads."""
    ds = dataset(numbered)
    shards = sharded_dataset(tmp_path, shards=4)
    shard_pages = max(_core.shm_footprint(s.file_size) for s in read_manifest(shards).shards)
    probe = DecodedCache(ds, Decode(), socket=tmp_path / "none.sock", chunk_bytes=CHUNK)
    limit = 2 * shard_pages + _limit(10, probe)  # two shards and two thirds of the cache
    d = start_daemon(args=("--shm-limit", str(limit)))
    rank, reply = hold(d.sock, shards, [0])
    try:
        assert reply["ok"], reply
        wait_status(d, lambda st: st["counts"]["held"] == 1)
        cache = DecodedCache(ds, Decode(), socket=d.sock, chunk_bytes=CHUNK)
        for i in range(N):
            check(cache[i], i)
        assert cache.counts()["uncached"] > 0  # the cache took what the holds leave, not more
        for shard in (1, 2, 3):  # the rank moves on, window by window, beside the cache in use
            send(rank, {"op": "hold", "manifest": os.fspath(shards), "shards": str(shard)})
            st = wait_status(d, lambda st, k=shard: shard_resident(st, shards, k))
            assert shard_resident(st, shards, shard), st
            assert st["shm"]["used"] <= limit
    finally:
        rank.close()


def shard_resident(st: dict[str, Any], manifest: Path, k: int) -> bool:
    checksum = read_manifest(manifest).shards[k].checksum
    return any(s["checksum"] == checksum for s in st["segments"])


def test_an_idle_cache_makes_way_for_an_owners_load(
    numbered: Path, start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    blob = tmp_path / "blob.smst"
    smstore.pack([bytes(range(256)) * 40] * 30, blob)  # about 300 KiB
    probe = DecodedCache(dataset(numbered), Decode(), socket=tmp_path / "none.sock", chunk_bytes=CHUNK)
    limit = max(_limit(15, probe), _core.shm_footprint(blob.stat().st_size)) + 4096  # the cache, or the blob
    d = start_daemon(args=("--shm-limit", str(limit)))
    finished(read_job(d, numbered, "/dev/null"))
    assert [c["held"] for c in caches(d)] == [15]  # idle
    reply = daemon_request({"op": "load", "path": os.fspath(blob)}, d.sock, timeout=60)
    assert reply["ok"], reply
    st = d.status()
    assert st["metrics"]["decoded_evictions"] > 0
    assert st["shm"]["used"] <= limit


def test_no_room_is_asked_about_once_a_second_not_once_a_record(
    numbered: Path, start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    ds = dataset(numbered)
    probe = DecodedCache(ds, Decode(), socket=tmp_path / "none.sock", chunk_bytes=CHUNK)
    d = start_daemon(args=("--shm-limit", str(_limit(1, probe))))
    cache = DecodedCache(ds, Decode(), socket=d.sock, chunk_bytes=CHUNK)
    asked: list[dict[str, Any]] = []
    ask_daemon = DaemonSession.ask

    def counting(self: DaemonSession, message: dict[str, Any], timeout: float) -> Any:
        asked.append(message)
        return ask_daemon(self, message, timeout)

    start = time.monotonic()
    with mock.patch.object(DaemonSession, "ask", counting):
        for _ in range(3):
            for i in range(N):
                check(cache[i], i)
    seconds = time.monotonic() - start
    assert cache.counts()["uncached"] == 3 * (N - cache.rows)
    # The meta page and chunk 0 once; then one question about room a second at most.
    assert len(asked) <= 3 + int(seconds / 1.0), (len(asked), seconds)


LOW_NOFILE = """
import resource, runpy, sys
resource.setrlimit(resource.RLIMIT_NOFILE, ({few}, {few}))
sys.argv = ["smstore", *sys.argv[1:]]
runpy.run_module("smstore", run_name="__main__")
"""


def test_a_daemon_short_of_descriptors_serves_few_cache_parts_and_still_loads(
    numbered: Path, start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    blob = tmp_path / "blob.smst"
    smstore.pack([b"x" * 100] * 10, blob)
    few = DESCRIPTORS_KEPT + 2 * 64  # the fewest parts served: 64
    d = start_daemon(launcher=("-c", LOW_NOFILE.format(few=few)))
    cache = DecodedCache(dataset(numbered), Decode(), socket=d.sock, chunk_bytes=64)  # a chunk a record
    for i in range(N):
        check(cache[i], i)
    (entry,) = caches(d)
    assert entry["held"] == 63  # and its meta page: 64 parts
    assert daemon_request({"op": "load", "path": os.fspath(blob)}, d.sock, timeout=60)["ok"]


def test_a_process_told_no_room_still_reads_the_chunks_others_made(
    numbered: Path, start_daemon: Callable[..., Daemon], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = dataset(numbered)
    probe = DecodedCache(ds, Decode(), socket=tmp_path / "none.sock", chunk_bytes=CHUNK)
    d = start_daemon(args=("--shm-limit", str(_limit(3, probe))))
    monkeypatch.setattr(decoded_cache, "_RETRY_S", 3600.0)  # no new chunk asked for in this test
    filler = DecodedCache(ds, Decode(), socket=d.sock, chunk_bytes=CHUNK)
    for i in range(N):
        check(filler[i], i)  # chunks 0, 1 and 2 are made; no room for the others
    reader = DecodedCache(ds, Decode(), socket=d.sock, chunk_bytes=CHUNK)
    check(reader[N - 1], N - 1)  # no room for its chunk: uncached, and no new chunk for an hour
    for i in range(3 * reader.rows):
        check(reader[i], i)  # the chunks the daemon serves are still mapped and read
    assert reader.counts() == {"hits": 3 * reader.rows, "fills": 0, "waits": 0, "uncached": 1}
