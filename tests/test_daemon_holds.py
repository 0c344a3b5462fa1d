"""Holds of shards and pieces: what ranks hold is loaded once, within the --shm-limit budget, and a
load that fails or is refused is told to every rank and reader at once. Most tests reproduce a
defect of an older daemon (issue 22)."""

from __future__ import annotations

import fcntl
import grp
import json
import os
import select
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from daemon_testlib import (
    IS_ROOT,
    Daemon,
    ask,
    assert_alive_and_clean,
    cli,
    dataset,
    ended,
    exchange,
    public_rundir,
    raw,
    read_reply_fds,
    send,
    shard,
    wait_status,
)
from smstore_testlib import sharded

import smstore
from smstore.daemon.state import state_path
from smstore.errors import DaemonError, StoreFormatError
from smstore.format.manifest import read_manifest
from smstore.wire.residency import Residency

PAGE = os.sysconf("SC_PAGESIZE")


# ---- holds -----------------------------------------------------------------------------------


def test_a_hold_names_its_holder_or_is_refused(tmp_path: Path, start_daemon: Callable[..., Daemon]) -> None:
    """The holds of one connection are kept apart by ``"holder"`` (a process's samplers and readers
    share its connection): a holder that is no integer in range is refused, naming the field."""
    out = dataset(tmp_path, "ds", shards=2)
    d = start_daemon(loaded=0)
    for holder in ("x", -1, 1 << 31, 1.5, True):
        reply = ask(d.sock, {"op": "hold", "manifest": os.path.abspath(out), "pieces": "0", "holder": holder})
        assert reply is not None
        assert reply["error"] == "bad_request", (holder, reply)
        assert "'holder'" in reply["message"]
    assert d.status()["held"] == []


def test_a_manifest_naming_a_non_utf8_shard_is_refused_and_the_daemon_serves_on(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """The old daemon took the hold, then died on its loop loading that shard (TypeError), and again
    in its shutdown (KeyError), leaving its socket and state file behind."""
    lines = [b"%05d line" % i for i in range(1000)]
    ds, good = (sharded(tmp_path, lines, shard_size=4000, name=name) for name in ("ds", "good"))
    doc = json.loads((ds / "manifest.json").read_text())
    odd = os.fsdecode(b"\xffshard.smst")  # a real file by that name: the manifest is right about it
    (ds / doc["shards"][0]["path"]).rename(ds / odd)
    doc["shards"][0]["path"] = odd  # written as the JSON escape "\udcff"
    (ds / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(StoreFormatError, match=r"manifest.json: .*shards\[0\]\.path .* not valid UTF-8"):
        read_manifest(ds)

    d = start_daemon(loaded=0)
    rank = raw(d.sock)
    try:
        hold = {"op": "hold", "manifest": os.fspath(ds / "manifest.json"), "shards": "1,0"}
        reply = exchange(rank, hold)
        assert reply is not None
        assert reply["ok"] is False, reply
        assert "manifest.json" in reply["message"]
        assert "shards[0].path" in reply["message"]
        assert "UTF-8" in reply["message"]
        # The rank's connection still open, the daemon serves on: its next hold, of a dataset
        # it can name, is loaded.
        assert exchange(rank, {**hold, "manifest": os.fspath(good / "manifest.json")}) == {
            "ok": True,
            "resident": 0,
            "held": 2,
            "limit": 0,
        }
        assert len(wait_status(d, lambda st: len(st["segments"]) == 2)["segments"]) == 2
        assert_alive_and_clean(d)
        # Stopped with the rank still connected: a clean exit, nothing left behind.
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(timeout=30) == 0
    finally:
        rank.close()
    log = d.log.read_text()
    assert "Traceback" not in log, log
    assert not d.sock.exists()
    assert not state_path(d.sock).exists()


def test_a_residency_never_closed_ends_its_thread_when_collected(tmp_path: Path) -> None:
    """Before the fix the thread held the residency: neither was ever collected."""
    import gc

    out = dataset(tmp_path, "ds", shards=2)
    residency = Residency(out, mode="mmap")
    residency.hold([0])
    thread = residency._thread
    assert thread is not None
    del residency
    gc.collect()
    assert ended([thread])


# ---- failed and unloaded shards --------------------------------------------------------------


def test_a_held_shard_changed_since_its_manifest_is_loaded_once_and_its_hold_refused(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """It used to be loaded, released and loaded again without end (the ranks never heard why)."""
    out = dataset(tmp_path)
    other = dataset(tmp_path, "other", seed=8)
    path1, ck1 = shard(out, 1)
    original = tmp_path / "shard1.orig"
    shutil.copyfile(path1, original)
    shutil.copyfile(shard(other, 1)[0], path1)  # re-packed in place: a valid blob, other contents
    d = start_daemon(loaded=0)
    rank = Residency(out, mode="daemon")
    try:
        rank.hold([0, 1], wait=True)
        status = wait_status(d, lambda st: bool(st["failed"]) and not st["loading"])
        assert [f["path"] for f in status["failed"]] == [path1]
        assert "re-packed or overwritten" in status["failed"][0]["message"]
        assert [s["checksum"] for s in status["segments"]] == [shard(out, 0)[1]]
        # Another rank holding it is refused with the reason, and nothing is loaded again.
        with pytest.raises(DaemonError, match="re-packed or overwritten"):
            Residency(out, mode="daemon").hold([1, 0], wait=True)
        # The first rank's next window (a hold sent without a reply, as the sampler sends it) is
        # refused: the refusal waits on its connection, and its next hold raises it.
        rank.hold([1, 0])
        conn = rank._session.conn
        assert conn is not None
        assert select.select([conn], [], [], 20)[0] == [conn]  # bounded by 20 s, not a timing goal
        with pytest.raises(DaemonError, match="re-packed or overwritten"):
            rank.hold([1, 0])
        # A reader asking for it hears at once, with the reason.
        reply = ask(d.sock, {"op": "attach", "checksum": ck1, "path": path1})
        assert reply is not None
        assert reply["error"] == "not_served"
        assert "re-packed or overwritten" in reply["message"]
        assert d.status()["loads"] == 2  # shard 0, and one try of shard 1
        # Restored, it is loaded at the next hold.
        shutil.copyfile(original, path1)
        rank.hold([1], wait=True)
        status = wait_status(d, lambda st: [s["checksum"] for s in st["segments"]] == [ck1])
        assert [s["checksum"] for s in status["segments"]] == [ck1]
        assert status["failed"] == []
    finally:
        rank.close()


def test_a_reader_asking_for_a_held_shard_whose_load_failed_hears_not_served_at_once(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """It used to wait for the 300 s load timeout (a socket timeout of 20 s bounds the test)."""
    out = dataset(tmp_path)
    path2, ck2 = shard(out, 2)
    Path(path2).write_bytes(b"not a blob\n" * 1000)
    d = start_daemon(loaded=0)
    rank = Residency(out, mode="daemon")
    try:
        rank.hold([2], wait=True)
        wait_status(d, lambda st: not st["loading"])
        reply = ask(d.sock, {"op": "attach", "checksum": ck2, "path": path2})
        assert reply is not None
        assert reply["error"] == "not_served"
        assert "no smstore blob" in reply["message"]
        # The dataset's reader in mode "daemon" says so too, naming the file.
        store = smstore.open_store(out, mode="daemon")
        try:
            first = sum(s.records for s in read_manifest(out).shards[:2])
            with pytest.raises(DaemonError, match="no smstore blob"):
                store[first]
        finally:
            store.close()
    finally:
        rank.close()


def test_a_reader_asking_for_a_held_shard_that_was_unloaded_hears_not_served_at_once(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    out = dataset(tmp_path)
    path0, ck0 = shard(out, 0)
    d = start_daemon(loaded=0)
    rank = Residency(out, mode="daemon")
    try:
        rank.hold([0], wait=True)
        wait_status(d, lambda st: [s["checksum"] for s in st["segments"]] == [ck0])
        cli("unload", path0, sock=d.sock)
        reply = ask(d.sock, {"op": "attach", "checksum": ck0, "path": path0})
        assert reply is not None
        assert reply["error"] == "not_served"
        assert "unloaded" in reply["message"]
        assert d.status()["segments"] == []  # not loaded again while the hold names it
        rank.hold([0, 1], wait=True)  # a hold naming it anew (after a window without it) loads it
        rank.hold([1], wait=True)
        rank.hold([0, 1], wait=True)
        status = wait_status(d, lambda st: len(st["segments"]) == 2)
        assert {s["checksum"] for s in status["segments"]} == {ck0, shard(out, 1)[1]}
    finally:
        rank.close()


def test_not_served_has_one_wording_and_the_reason_apart(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """`attach` and `unload` of what no segment holds said it two ways ("no segment holds X", "X is
    not loaded"), and a reader told a held shard's failure from a plain refusal by its wording."""
    out = dataset(tmp_path)
    path2, ck2 = shard(out, 2)
    Path(path2).write_bytes(b"not a blob\n" * 1000)
    d = start_daemon(loaded=0)
    rank = Residency(out, mode="daemon")
    try:
        missing = "0123456789abcdef"
        for message in ({"op": "attach", "checksum": missing}, {"op": "unload", "checksum": missing}):
            reply = ask(d.sock, message)
            assert reply is not None
            assert (reply["error"], reply["message"], reply["reason"]) == (
                "not_served",
                f"no segment holds {missing}",
                None,
            )
        rank.hold([2], wait=True)
        wait_status(d, lambda st: not st["loading"])
        reply = ask(d.sock, {"op": "attach", "checksum": ck2, "path": path2})
        assert reply is not None
        assert reply["error"] == "not_served"
        assert "no smstore blob" in reply["reason"]
        assert reply["message"] == f"no segment holds {ck2}: {reply['reason']}"
    finally:
        rank.close()


# ---- the budget ------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["load", "share"])
def test_a_load_or_share_counts_the_budget_as_the_holds_do(
    tmp_path: Path, start_daemon: Callable[..., Daemon], how: str
) -> None:
    """Loads and shares counted raw segment sizes, holds page-rounded sizes plus released segments
    a reader of the owner still maps: a load or share overshot the --shm-limit the holds kept."""
    from smstore.wire.client import share_with_daemon
    from smstore.wire.ipc import request, socket_path

    out = dataset(tmp_path)
    m = read_manifest(out)
    limit = 2 * max(-(-s.file_size // PAGE) * PAGE for s in m.shards) + PAGE  # two shards, not three
    d = start_daemon(args=("--shm-limit", str(limit)), loaded=0)
    ck = [s.checksum for s in m.shards]
    rank = Residency(out, mode="daemon")
    reader: socket.socket | None = None
    taken: list[socket.socket] = []  # a share the old code took
    try:
        rank.hold([0, 1], wait=True)
        wait_status(d, lambda st: {s["checksum"] for s in st["segments"]} == {ck[0], ck[1]})
        # A reader of the owner maps shard 0 and stays: released, it still takes its pages.
        reply, fd, reader = request({"op": "attach", "checksum": ck[0]}, socket_path(d.sock))
        assert reply["ok"]
        assert fd is not None
        os.close(fd)
        rank.hold([2], wait=True)
        status = wait_status(d, lambda st: {s["checksum"] for s in st["segments"]} == {ck[2]})
        assert status["released"] == [ck[0]]
        # Shard 3 needs a third shard's room: the budget has one page left.
        path3 = os.path.abspath(m.shard_path(3))
        if how == "load":
            res = cli("load", path3, sock=d.sock, check=False)
            assert res.returncode != 0
            assert "not enough shared memory under the daemon's limit" in res.stderr
        else:
            blob = Path(path3).read_bytes()
            mfd = os.memfd_create("budget", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            try:
                os.write(mfd, blob)
                fcntl.fcntl(
                    mfd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK
                )
                with pytest.raises(DaemonError, match="does not fit the daemon's --shm-limit"):
                    taken.append(share_with_daemon(mfd, "test:" + "ab" * 16, d.sock)[1])  # closed below
            finally:
                os.close(mfd)
        assert {s["checksum"] for s in d.status()["segments"]} == {ck[2]}
        # Once the reader lets go, the same load fits.
        reader.close()
        reader = None
        wait_status(d, lambda st: st["released"] == [])
        cli("load", path3, sock=d.sock)
        assert {s["checksum"] for s in d.status()["segments"]} == {ck[2], ck[3]}
    finally:
        rank.close()
        if reader is not None:
            reader.close()
        for conn in taken:
            conn.close()


@pytest.mark.skipif(not IS_ROOT, reason="needs root to act as a second user")
def test_a_group_member_mapping_released_shards_never_stalls_the_owner(
    tmp_path: Path, start_daemon: Callable[..., Daemon], request: pytest.FixtureRequest
) -> None:
    """Released shards a member still mapped used to count against --shm-limit until it let go."""
    try:
        group = grp.getgrnam("users")
    except KeyError:
        pytest.skip("no 'users' group")
    out = dataset(tmp_path)
    m = read_manifest(out)
    limit = 2 * max(-(-s.file_size // PAGE) * PAGE for s in m.shards) + PAGE  # two shards, not three
    sock = public_rundir(request, group.gr_gid) / "smstore.sock"
    d = start_daemon(args=("--group", "users", "--shm-limit", str(limit)), at=sock, loaded=0)
    ck = [s.checksum for s in m.shards]
    rank = Residency(out, mode="daemon", socket=sock)
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    member = -1
    try:
        rank.hold([0, 1], wait=True)
        wait_status(d, lambda st: {s["checksum"] for s in st["segments"]} == {ck[0], ck[1]})
        member = os.fork()
        if member == 0:  # pragma: no cover - child: a group member that maps both shards and stays
            try:
                os.setgroups([group.gr_gid])
                os.setgid(65534)
                os.setuid(65534)
                conns = []
                for checksum in ck[:2]:
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    s.connect(os.fspath(sock))
                    send(s, {"op": "attach", "checksum": checksum})
                    reply, fds = read_reply_fds(s)
                    if reply is None or not reply["ok"] or len(fds) != 1:
                        raise RuntimeError(f"attach failed: {reply}")
                    conns.append(s)
                os.write(ready_w, b"y")
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                os.write(ready_w, f"n{e}".encode())
            os.read(go_r, 1)
            os._exit(0)
        assert os.read(ready_r, 4096) == b"y"
        rank.hold([2], wait=True)  # the owner's next window: 0 and 1 released, 2 loaded
        status = wait_status(d, lambda st: {s["checksum"] for s in st["segments"]} == {ck[2]})
        assert {s["checksum"] for s in status["segments"]} == {ck[2]}
        assert status["released"] == []  # the member's mappings pin nothing in the budget
    finally:
        rank.close()
        os.write(go_w, b"x")
        if member > 0:
            os.waitpid(member, 0)
        for fd in (ready_r, ready_w, go_r, go_w):
            os.close(fd)
    assert d.proc.poll() is None
    d.proc.send_signal(signal.SIGTERM)
    d.proc.wait(timeout=15)


def test_a_plan_sizes_each_queued_load_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan runs at every finished load, and it sized every load still queued again (a stat
    each): serving N files given at start cost O(N**2) stats (4,000 one-record files took 32 s,
    2.3 s now: benchmarks/results/load_rate.md). Each load is sized once, when queued, and its
    pages count in the budget until it lands."""
    from smstore.daemon import planner as planner_module
    from smstore.daemon.planner import Planner
    from smstore.daemon.segments import SegmentTable, pages

    stats: list[str] = []

    class CountingOs:
        def __getattr__(self, name: str) -> Any:
            return getattr(os, name)

        def stat(self, path: str) -> os.stat_result:
            stats.append(path)
            return os.stat(path)

    monkeypatch.setattr(planner_module, "os", CountingOs())
    n, size = 200, 5000
    files = [os.fspath(tmp_path / f"{i}.smst") for i in range(n)]
    for f in files:
        Path(f).write_bytes(b"x" * size)
    planner = Planner(
        SegmentTable(),
        shm_limit=1 << 30,
        shm_limit_from="test",
        is_owner=lambda cid: True,
        release=lambda seg: None,
    )
    loading: dict[str, list[int]] = {}
    for f in files:
        loading[f] = []
        planner.load_started(f)
    assert planner.loading_total == n * pages(size)
    for k, f in enumerate(files):
        planner.plan(loading)
        del loading[f]
        if k % 2:
            planner.load_done(f, f"xxh64:{k:016x}", asked=True)
        else:
            planner.load_failed(f, "test")
    assert planner.loading_total == 0
    assert len(stats) <= n, f"{len(stats)} stats for {n} loads"


# ---- the loader thread -----------------------------------------------------------------------


def test_no_load_starts_once_the_loader_thread_is_stopping() -> None:
    """A load queued behind one under way at shutdown used to start after stop() had drained the
    queue, making a segment the shutdown's scan of /dev/shm could miss (left behind)."""

    from smstore.daemon.loader import Loader
    from smstore.daemon.sources import Source
    from smstore.wire.protocol import Piece

    loader = Loader(None, None, str, gid=None, read_rate=0)  # type: ignore[arg-type]
    started, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def load_one(source: Source, piece: Piece) -> Any:
        calls.append(source.location)
        if source.location == "a":
            started.set()
            release.wait(30)
        raise OSError(
            f"{source.location}: cannot be read"
        )  # a failed load: not the Loaded the old check looked at

    loader._load_one = load_one  # type: ignore[method-assign]
    loader.load(Source("a"), Piece(0))
    loader.load(Source("b"), Piece(0))
    loader.start()
    assert started.wait(30)
    stopper = threading.Thread(target=loader.stop)
    stopper.start()
    while not loader.stopping:
        time.sleep(0.001)
    release.set()
    stopper.join(30)
    loader.thread.join(30)
    loader.wake_r.close()
    loader.wake_w.close()
    assert not loader.thread.is_alive()
    assert calls == ["a"]
