"""Daemon defects of issue 22, each held to the behaviour that fixed it (each test failed before)."""

from __future__ import annotations

import contextlib
import fcntl
import grp
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import smstore
from smstore.errors import DaemonError
from smstore.read.shards import read_manifest
from smstore.wire.residency import ShardResidency

from . import daemon_testlib as tl
from .daemon_testlib import IS_ROOT, Daemon

PAGE = os.sysconf("SC_PAGESIZE")


def dataset(tmp_path: Path, name: str = "ds", shards: int = 4, seed: int = 7) -> Path:
    """A sharded dataset of `shards` shards of ~50 KB (records differ with `seed`)."""
    rng = np.random.default_rng(seed)
    src = tmp_path / f"{name}.txt"
    src.write_bytes(
        b"".join(bytes(rng.integers(32, 127, size=200, dtype=np.uint8)) + b"\n" for _ in range(1000))
    )
    out = tmp_path / name
    smstore.pack_files([src], out, shard_size=1000 * 201 // shards, progress=False, durable=False)
    assert len(read_manifest(out).shards) == shards
    return out


def shard(out: Path, k: int) -> tuple[str, str]:
    """The absolute path and manifest checksum of shard k."""
    m = read_manifest(out)
    return os.path.abspath(m.shard_path(k)), m.shards[k].checksum


def wait_for(d: Daemon, predicate: Callable[[dict[str, Any]], bool], timeout: float = 20) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while not predicate(status := d.status()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return status


def ask(sock: Path, message: dict[str, Any], timeout: float = 20) -> dict[str, Any] | None:
    """One request on a new raw connection; a reply that does not come within `timeout` fails the test."""
    s = tl.raw(sock)
    s.settimeout(timeout)
    try:
        s.sendall(tl.frame(json.dumps(message).encode()))
        return tl.read_reply(s)
    finally:
        s.close()


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
    rank = ShardResidency(out, mode="daemon")
    try:
        rank.hold([0, 1], wait=True)
        status = wait_for(d, lambda st: bool(st["failed"]) and not st["loading"])
        assert [f["path"] for f in status["failed"]] == [path1]
        assert "re-packed or overwritten" in status["failed"][0]["message"]
        assert [s["checksum"] for s in status["segments"]] == [shard(out, 0)[1]]
        # Another rank holding it is refused with the reason, and nothing is loaded again.
        with pytest.raises(DaemonError, match="re-packed or overwritten"):
            ShardResidency(out, mode="daemon").hold([1, 0], wait=True)
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
        status = wait_for(d, lambda st: [s["checksum"] for s in st["segments"]] == [ck1])
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
    rank = ShardResidency(out, mode="daemon")
    try:
        rank.hold([2], wait=True)
        wait_for(d, lambda st: not st["loading"])
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
    rank = ShardResidency(out, mode="daemon")
    try:
        rank.hold([0], wait=True)
        wait_for(d, lambda st: [s["checksum"] for s in st["segments"]] == [ck0])
        tl.cli("unload", path0, sock=d.sock)
        reply = ask(d.sock, {"op": "attach", "checksum": ck0, "path": path0})
        assert reply is not None
        assert reply["error"] == "not_served"
        assert "unloaded" in reply["message"]
        assert d.status()["segments"] == []  # not loaded again while the hold names it
        rank.hold([0, 1], wait=True)  # a hold naming it anew (after a window without it) loads it
        rank.hold([1], wait=True)
        rank.hold([0, 1], wait=True)
        status = wait_for(d, lambda st: len(st["segments"]) == 2)
        assert {s["checksum"] for s in status["segments"]} == {ck0, shard(out, 1)[1]}
    finally:
        rank.close()


def test_a_hold_naming_a_fifo_never_blocks_the_daemon(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """Opening the FIFO used to wait for a writer on the event loop: no one was answered any more."""
    fifo = tmp_path / "manifest.json"
    os.mkfifo(fifo)
    d = start_daemon(loaded=0)
    holder = tl.raw(d.sock)
    try:
        holder.sendall(
            tl.frame(json.dumps({"op": "hold", "manifest": os.fspath(fifo), "shards": "0"}).encode())
        )
        status = ask(d.sock, {"op": "status"}, timeout=10)  # a socket timeout, not a clock: it answers
        assert status is not None
        assert status["ok"] is True
        reply = tl.read_reply(holder)
        assert reply is not None
        assert reply["error"] == "bad_request"
        assert "not a regular file" in reply["message"]
    finally:
        holder.close()
        # Before the fix the daemon waits in open(): a writer lets it go, so that it stops cleanly.
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


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
    sock = tl.public_rundir(request, group.gr_gid) / "smstore.sock"
    d = start_daemon(args=("--group", "users", "--shm-limit", str(limit)), at=sock, loaded=0)
    ck = [s.checksum for s in m.shards]
    rank = ShardResidency(out, mode="daemon", socket=sock)
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    member = -1
    try:
        rank.hold([0, 1], wait=True)
        wait_for(d, lambda st: {s["checksum"] for s in st["segments"]} == {ck[0], ck[1]})
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
                    s.sendall(tl.frame(json.dumps({"op": "attach", "checksum": checksum}).encode()))
                    reply, fds = tl.read_reply_fds(s)
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
        status = wait_for(d, lambda st: {s["checksum"] for s in st["segments"]} == {ck[2]})
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


def test_loading_many_blobs_writes_the_state_file_rarely_and_status_pages_them(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """The state file was written whole after every load (O(N**2)), and status of all the segments
    in one reply exceeded the message limit ("message of 1441932 bytes exceeds...")."""
    deep = tmp_path
    while len(os.fspath(deep)) < 3300:  # paths of ~3.4 KB: 300 segments describe in ~1 MB
        deep /= "d" * 200
    deep.mkdir(parents=True)
    n = 300
    src = tmp_path / "lines.txt"
    src.write_bytes(b"".join(b"%05d:" % i + b"x" * 60 + b"\n" for i in range(n)))
    out = deep / "ds"
    smstore.pack_files([src], out, shard_size=60, progress=False, durable=False)
    m = read_manifest(out)
    assert len(m.shards) == n
    d = start_daemon(args=("--verbose",), loaded=0)
    tl.cli("load", os.fspath(out), sock=d.sock, timeout=300)
    status = d.status()
    assert status["counts"]["segments"] == n
    assert 0 < len(status["segments"]) < n  # one page
    seen: list[str] = []
    offset: int | None = 0
    while offset is not None:
        page = smstore.wire.client.daemon_request({"op": "status", "offset": offset}, d.sock)
        seen += [s["checksum"] for s in page["segments"]]
        offset = page["next_offset"]
    assert sorted(seen) == sorted(s.checksum for s in m.shards)
    summary = tl.cli("status", sock=d.sock).stdout
    assert f"{n} segment(s)" in summary
    assert "smstore status --detail" in summary
    detail = tl.cli("status", "--detail", sock=d.sock).stdout
    assert all(os.path.abspath(m.shard_path(k)) in detail for k in range(n))
    # Every segment reaches the state file (once the loads stopped), in a few writes.
    state = d.sock.with_name(d.sock.name + ".state")
    deadline = time.monotonic() + 20
    while len(json.loads(state.read_text())["segments"]) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(json.loads(state.read_text())["segments"]) == n
    writes = d.log.read_text().count("state file written")
    assert 1 <= writes <= n // 4, writes


BAD_STATE_FILES: dict[str, Callable[[Path], None]] = {
    "infinity": lambda p: p.write_text('{"pid": Infinity, "start_time": 1, "segments": []}'),
    "garbage": lambda p: p.write_bytes(os.urandom(3000)),
    "symlink to /dev/zero": lambda p: p.symlink_to("/dev/zero"),
    "fifo": lambda p: os.mkfifo(p),
}


@pytest.mark.parametrize("kind", list(BAD_STATE_FILES))
def test_a_bad_state_file_is_set_aside_by_serve_and_gc(
    kind: str, tmp_path: Path, start_daemon: Callable[..., Daemon], blob: tuple[Path, list[bytes]]
) -> None:
    """`Infinity` or a symlink to /dev/zero stopped serve and gc with a traceback (or read forever)."""
    sock = Path(os.environ["SMSTORE_SOCKET"])
    state = sock.with_name(sock.name + ".state")
    bad = state.with_name(state.name + ".bad")
    BAD_STATE_FILES[kind](state)
    res = tl.cli("gc", sock=sock, timeout=60)
    assert "Traceback" not in res.stderr
    assert f"set aside as {bad}" in res.stderr
    assert not os.path.lexists(state)
    os.replace(bad, state)
    path, recs = blob
    d = start_daemon(path)  # serves, with the file it was asked to load
    assert f"set aside as {bad}" in d.log.read_text()
    with smstore.open_store(path, mode="daemon") as store:
        tl.check_all(store, recs)
    assert json.loads(state.read_text())["pid"] == d.pid  # its own state file now
    bad.unlink()


def test_after_kill_9_ranks_hear_which_socket_and_how_to_resume(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """The advice was "start one with 'smstore serve FILE'": no socket, no word of adoption or resuming."""
    out = dataset(tmp_path)
    d = start_daemon(loaded=0)
    rank = ShardResidency(out, mode="daemon")
    try:
        rank.hold([0, 1], wait=True)
        wait_for(d, lambda st: len(st["segments"]) == 2)
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        for fails in (
            lambda: rank.hold([1, 2], wait=True),
            lambda: smstore.open_store(shard(out, 0)[0], mode="daemon"),
        ):
            with pytest.raises(DaemonError) as e:
                fails()
            message = str(e.value)
            assert f"smstore serve --socket {d.sock}" in message
            assert "adopts the segments" in message
            assert "resume" in message
        # As it says: a daemon restarted on the socket adopts the dead one's segments, and the rank goes on.
        d = start_daemon(loaded=0)
        assert len(d.status()["unclaimed"]) == 2
        rank.hold([1, 2], wait=True)
    finally:
        rank.close()


def test_an_owner_refused_as_busy_tries_again_until_stalled_connections_are_dropped(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """It failed at once, though the daemon drops the connections in its way within the I/O timeout."""
    d = start_daemon(args=("--max-connections", "8", "--io-timeout", "3"), loaded=0)
    hogs = [tl.raw(d.sock) for _ in range(7)]  # connected, silent: dropped after 3 s
    try:
        assert d.status()["connections"] == 8  # the seven and this one
        hogs.append(tl.raw(d.sock))  # all eight in use: the next connection is refused
        status = smstore.wire.client.daemon_request({"op": "status"}, d.sock)
        assert status["ok"] is True
        assert "refused connection from pid" in d.log.read_text()  # it was refused, then got through
        assert all(h.recv(10) == b"" for h in hogs)  # the silent ones were dropped
    finally:
        for h in hogs:
            h.close()


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
    rank = ShardResidency(out, mode="daemon")
    reader: socket.socket | None = None
    taken: list[socket.socket] = []  # a share the old code took
    try:
        rank.hold([0, 1], wait=True)
        wait_for(d, lambda st: {s["checksum"] for s in st["segments"]} == {ck[0], ck[1]})
        # A reader of the owner maps shard 0 and stays: released, it still takes its pages.
        reply, fd, reader = request({"op": "attach", "checksum": ck[0]}, socket_path(d.sock))
        assert reply["ok"]
        assert fd is not None
        os.close(fd)
        rank.hold([2], wait=True)
        status = wait_for(d, lambda st: {s["checksum"] for s in st["segments"]} == {ck[2]})
        assert status["released"] == [ck[0]]
        # Shard 3 needs a third shard's room: the budget has one page left.
        path3 = os.path.abspath(m.shard_path(3))
        if how == "load":
            res = tl.cli("load", path3, sock=d.sock, check=False)
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
        wait_for(d, lambda st: st["released"] == [])
        tl.cli("load", path3, sock=d.sock)
        assert {s["checksum"] for s in d.status()["segments"]} == {ck[2], ck[3]}
    finally:
        rank.close()
        if reader is not None:
            reader.close()
        for conn in taken:
            conn.close()


def test_not_served_has_one_wording_and_the_reason_apart(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """`attach` and `unload` of what no segment holds said it two ways ("no segment holds X", "X is
    not loaded"), and a reader told a held shard's failure from a plain refusal by its wording."""
    out = dataset(tmp_path)
    path2, ck2 = shard(out, 2)
    Path(path2).write_bytes(b"not a blob\n" * 1000)
    d = start_daemon(loaded=0)
    rank = ShardResidency(out, mode="daemon")
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
        wait_for(d, lambda st: not st["loading"])
        reply = ask(d.sock, {"op": "attach", "checksum": ck2, "path": path2})
        assert reply is not None
        assert reply["error"] == "not_served"
        assert "no smstore blob" in reply["reason"]
        assert reply["message"] == f"no segment holds {ck2}: {reply['reason']}"
    finally:
        rank.close()


@pytest.mark.parametrize("retry_within", [float("nan"), float("inf"), -1.0, True])
def test_a_busy_reply_with_a_bad_retry_figure_is_not_retried(tmp_path: Path, retry_within: float) -> None:
    """The retry bound comes from the daemon's reply: NaN compared false with every bound, so a
    hostile or broken daemon kept a client retrying forever. Only a finite positive figure counts."""
    import threading

    from smstore.wire import ipc as _ipc
    from smstore.wire.protocol import BUSY, encode

    path = str(tmp_path / "busy.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    server.settimeout(0.05)
    answered = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.sendall(
                    encode({"ok": False, "error": BUSY, "message": "busy", "retry_within": retry_within})
                )
                answered.append(1)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    def hung(signum: int, frame: object) -> None:
        pytest.fail(f"the client retried for ever (answered {len(answered)} times)")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)  # a watchdog: the old code never returned
    try:
        reply, got, sock = _ipc.request({"op": "status"}, Path(path), timeout=5.0)
        sock.close()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        stop.set()
        thread.join(30)
        server.close()
    assert reply["error"] == BUSY
    assert got is None
    assert len(answered) == 1


def test_no_load_starts_once_the_loader_thread_is_stopping() -> None:
    """A load queued behind one under way at shutdown used to start after stop() had drained the
    queue, making a segment the shutdown's scan of /dev/shm could miss (left behind)."""
    import threading

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


CHECKSUM_CANDIDATES = [
    "0123456789abcdef",
    "0123456789ABCDEF",  # upper case: the core writes lower case only
    "0123456789abcde",
    "0123456789abcdef0",
    "0123456789abcdeg",
    "0123456789abcdef\n",  # a regular expression's $ lets a line end through
    " 0123456789abcdef",
    "",
]


def test_one_checksum_format_checked_one_way(tmp_path: Path, start_daemon: Callable[..., Daemon]) -> None:
    """A checksum was checked four ways (a request's argument, a manifest's entry, a segment's name,
    `smstore unload`'s argument), each with its own code: now each takes _protocol's one check, so
    they accept and refuse the same strings; no other module spells the format."""
    from smstore.daemon.segments import SEGMENT_RE
    from smstore.wire import protocol
    from smstore.wire.protocol import CHECKSUM, checksum_in, is_checksum

    out = dataset(tmp_path, shards=2)
    manifest = out / "manifest.json"
    original = json.loads(manifest.read_text())
    d = start_daemon(loaded=0)
    verdicts = {}
    for value in CHECKSUM_CANDIDATES:
        reply = ask(d.sock, {"op": "unload", "checksum": value})
        assert reply is not None
        by_request = reply.get("error") != "bad_request"
        bad = json.loads(json.dumps(original))
        bad["shards"][0]["checksum"] = value
        manifest.write_text(json.dumps(bad))
        try:
            read_manifest(out)
        except smstore.StoreFormatError as e:
            refusal = str(e)
        else:
            refusal = ""
        by_manifest = refusal == ""
        assert by_manifest or "checksum must be 16 lowercase hex digits" in refusal, refusal
        by_name = SEGMENT_RE.match(f"smstore-1-2-3-{value}-0123abcd") is not None
        by_command_line = checksum_in(f"xxh64:{value}") == value and checksum_in(value) == value
        verdicts[value] = (by_request, by_manifest, by_name, by_command_line)
        assert verdicts[value] == (is_checksum(value),) * 4, (value, verdicts[value])
    manifest.write_text(json.dumps(original))
    assert [v for v, (ok, *_) in verdicts.items() if ok] == ["0123456789abcdef"]
    spelled = [
        p.name
        for p in Path(smstore.__file__).parent.rglob("*.py")
        if p != Path(protocol.__file__) and ("{16}" in p.read_text() or "== 16" in p.read_text())
    ]
    assert spelled == [], f"the checksum format spelled outside _protocol.CHECKSUM ({CHECKSUM}): {spelled}"


def test_a_fork_while_another_thread_holds_a_session_lock_leaves_the_child_able_to_attach(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """The pre-attaching thread holds `DaemonSession.lock` during its attaches: a process forked
    meanwhile (a DataLoader worker) got a lock no thread of its would ever release, and its first
    attach blocked forever (here: killed by its own alarm)."""
    from smstore.wire.client import DaemonSession

    path = tmp_path / "b.smst"
    smstore.pack([b"a", b"bc"], path)
    checksum = smstore.open(path).checksum
    d = start_daemon(path)
    session = DaemonSession(d.sock)
    held, done = threading.Event(), threading.Event()

    def hold_the_lock() -> None:
        with session.lock:
            held.set()
            done.wait(30)

    thread = threading.Thread(target=hold_the_lock)
    thread.start()
    try:
        assert held.wait(10)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            code = 3
            try:
                signal.alarm(20)
                reply, fd = session.attach(checksum)
                code = 0 if reply["ok"] and fd is not None else 4
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    finally:
        done.set()
        thread.join()
        session.close()
    assert not os.WIFSIGNALED(status), "the child's attach blocked on its parent's lock"
    assert os.WEXITSTATUS(status) == 0


def test_readers_of_a_dataset_hear_its_held_shards_however_many_another_dataset_holds(
    tmp_path: Path, start_daemon: Callable[..., Daemon], caplog: pytest.LogCaptureFixture
) -> None:
    """The `held` reply listed every held shard of every dataset: past 1 MiB (here 1100 shards
    with 1 KB paths) it became a refusal, and every reader silently attached nothing ahead. A
    reader names the dataset it follows and hears only its shards; a list that still does not fit
    is refused with a warning on both sides, never dropped silently."""
    from smstore.wire.client import Preattacher as _Preattacher

    deep = tmp_path
    for level in range(4):
        deep /= f"{level}" + "x" * 240  # long paths: few shards fill a reply
    deep.mkdir(parents=True)
    src = tmp_path / "lines.txt"
    src.write_bytes(b"".join(b"%05d\n" % i for i in range(1100)))
    big = deep / "big"
    smstore.pack_files([src], big, shard_size=6, progress=False, durable=False)
    assert len(read_manifest(big).shards) == 1100
    small = dataset(tmp_path, "small", shards=4)
    # Room for a few tiny shards: the rest of the big dataset's wait, not resident.
    d = start_daemon(args=("--shm-limit", "256K"), loaded=0)
    holders = [tl.raw(d.sock), tl.raw(d.sock)]
    try:
        for s, ds, n in ((holders[0], big, 1100), (holders[1], small, 4)):
            hold = {"op": "hold", "manifest": os.path.abspath(ds), "shards": ",".join(map(str, range(n)))}
            s.sendall(tl.frame(json.dumps(hold).encode()))
            assert (reply := tl.read_reply(s)) is not None
            assert reply["ok"] is True, reply
        # Loads finished: what is held, and resident, stays as it is (one version) from here on.
        wait_for(d, lambda st: len(st["segments"]) > 0 and not st["loading"])
        ours = ask(d.sock, {"op": "held", "manifest": os.path.abspath(small)})
        assert ours is not None
        assert ours["ok"] is True, ours
        assert ours["shards"] == [list(shard(small, k)) for k in range(4)]
        assert set(ours["not_resident"]) <= {shard(small, k)[1] for k in range(4)}
        for question in ({"op": "held"}, {"op": "held", "manifest": os.path.abspath(big)}):
            refused = ask(d.sock, question)
            assert refused is not None
            assert refused["ok"] is False
            assert refused["error"] == "reply_failed"
            assert refused["version"] == ours["version"]
        assert "held shard(s) of " + os.path.abspath(big) in d.log.read_text()
        # The big dataset's reader logs why it attaches nothing ahead, and keeps what it has.
        m = read_manifest(big)
        ahead = _Preattacher(
            d.sock, m.path, {s.checksum: k for k, s in enumerate(m.shards)}, lambda k: False, lambda k: None
        )
        try:
            with caplog.at_level("WARNING", logger="smstore"):
                assert ahead._once(None) == ours["version"]
            assert any("cannot attach held shards ahead" in r.getMessage() for r in caplog.records)
            assert ahead.ready == {}
        finally:
            ahead.close()
    finally:
        for s in holders:
            s.close()


def test_a_share_or_a_dropped_shared_blob_wakes_every_parked_reader(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """A blob shared with the contents of a held shard makes it resident, and its drop makes it not
    resident again: both change what readers follow, and every parked reader hears at once (before
    the fix, only the next reader to ask saw the change)."""
    from smstore.wire.client import share_with_daemon

    out = dataset(tmp_path, "ds", shards=2)
    path0, ck0 = shard(out, 0)
    d = start_daemon(loaded=0)
    rank = tl.raw(d.sock)
    readers = [tl.raw(d.sock) for _ in range(2)]  # 10 s socket timeouts: a missed wake fails the test
    sharer: socket.socket | None = None
    try:
        hold = {"op": "hold", "manifest": os.path.abspath(out), "shards": "0"}
        rank.sendall(tl.frame(json.dumps(hold).encode()))
        assert (reply := tl.read_reply(rank)) is not None
        assert reply["ok"] is True, reply
        wait_for(d, lambda st: len(st["segments"]) == 1 and not st["loading"])
        tl.cli("unload", path0, sock=d.sock)  # held, not loaded again: not resident

        def park_all() -> int:
            before = ask(d.sock, {"op": "held"})
            assert before is not None
            assert before["not_resident"] == ([] if sharer is not None else [ck0])
            parked = d.status()["counts"]["parked"]
            for s in readers:
                s.sendall(
                    tl.frame(json.dumps({"op": "held", "since": before["version"], "wait": 60}).encode())
                )
            wait_for(d, lambda st: st["counts"]["parked"] == parked + len(readers))
            return int(before["version"])

        version = park_all()
        mfd = os.memfd_create("held", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.write(mfd, Path(path0).read_bytes())
            fcntl.fcntl(mfd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK)
            sharer = share_with_daemon(mfd, "test:" + "cd" * 16, d.sock)[1]
        finally:
            os.close(mfd)
        for s in readers:
            assert (woken := tl.read_reply(s)) is not None
            assert woken["version"] > version
            assert woken["not_resident"] == []
        version = park_all()
        sharer.close()  # the shared blob is dropped: the held shard is not resident again
        sharer = None
        for s in readers:
            assert (woken := tl.read_reply(s)) is not None
            assert woken["version"] > version
            assert woken["not_resident"] == [ck0]
    finally:
        for s in (rank, *readers):
            s.close()
        if sharer is not None:
            sharer.close()


def test_a_preattacher_closed_mid_pass_keeps_no_store(
    tmp_path: Path, start_daemon: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() while the pre-attaching thread is between its attach and keeping the store (here:
    the attach itself ends by closing it, as the dataset's finalizer may at that moment): before
    the fix the thread kept the store in `ready` after close() had emptied it (mapped until the
    process ended); now it closes it, and the daemon hears it detached."""
    from smstore.wire.client import DaemonSession
    from smstore.wire.client import Preattacher as _Preattacher

    out = dataset(tmp_path, "ds", shards=2)
    d = start_daemon(loaded=0)
    rank = tl.raw(d.sock)
    m = read_manifest(out)
    ahead = _Preattacher(
        d.sock, m.path, {s.checksum: k for k, s in enumerate(m.shards)}, lambda k: False, lambda k: None
    )
    attaches: list[str] = []
    session = ahead.session

    def attach_then_close(checksum: str, path: str | None = None) -> tuple[dict[str, Any], int | None]:
        reply = DaemonSession.attach(session, checksum, path)
        attaches.append(checksum)
        ahead.close()
        return reply

    monkeypatch.setattr(session, "attach", attach_then_close)
    try:
        hold = {"op": "hold", "manifest": os.path.abspath(out), "shards": "0,1"}
        rank.sendall(tl.frame(json.dumps(hold).encode()))
        assert (reply := tl.read_reply(rank)) is not None
        assert reply["ok"] is True, reply
        wait_for(d, lambda st: len(st["segments"]) == 2 and not st["loading"])
        ahead._once(None)
        assert len(attaches) == 1  # the pass ended with the close
        assert ahead.ready == {}
        session.pump()
        st = wait_for(d, lambda st: all(seg["clients"] == [] for seg in st["segments"]))
        assert all(seg["clients"] == [] for seg in st["segments"])
    finally:
        for store in ahead.ready.values():
            store.close()
        rank.close()


SERVE_IN_PROCESS = r"""
import json, os, signal, socket, sys, threading, time
from smstore.daemon import serve

def mine(signum, frame):
    pass

os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))  # whatever the test suite runs under
signal.signal(signal.SIGTERM, mine)
signal.signal(signal.SIGINT, mine)
r, w = socket.socketpair()
w.setblocking(False)
signal.set_wakeup_fd(w.fileno())
sock = sys.argv[1]

def stop_when_serving():
    while not os.path.exists(sock):
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=stop_when_serving, daemon=True).start()
status = serve([], sock=sock)  # background: SCHED_BATCH while it runs
print(json.dumps({
    "policy_restored": os.sched_getscheduler(0) == os.SCHED_OTHER,
    "status": status,
    "term_restored": signal.getsignal(signal.SIGTERM) is mine,
    "int_restored": signal.getsignal(signal.SIGINT) is mine,
    "wakeup_restored": signal.set_wakeup_fd(-1) == w.fileno(),
}))
"""


def test_serve_in_process_gives_the_callers_signal_handlers_and_wakeup_fd_back(tmp_path: Path) -> None:
    sock = tmp_path / "d.sock"
    res = subprocess.run(
        [sys.executable, "-c", SERVE_IN_PROCESS, os.fspath(sock)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.splitlines()[-1]) == {
        "policy_restored": True,
        "status": 0,
        "term_restored": True,
        "int_restored": True,
        "wakeup_restored": True,
    }
    assert not sock.exists()


def preattach_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "smstore-preattach"]


def ended(threads: list[threading.Thread], timeout: float = 30) -> bool:
    for t in threads:
        t.join(timeout)
    return not any(t.is_alive() for t in threads)


def test_a_preattaching_thread_of_a_dataset_never_closed_ends_when_its_daemon_is_gone(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """Before the fix the thread asked a stopped daemon again every 0.5 s for as long as the
    process lived; now it ends once the socket is gone."""
    from smstore.wire.client import open_store

    out = dataset(tmp_path, "ds", shards=2)
    before = preattach_threads()
    d = start_daemon(loaded=0)
    store = open_store(out, mode="auto", socket=d.sock)
    assert bytes(store[0]) == smstore.open(out)[0].tobytes()
    threads = [t for t in preattach_threads() if t not in before]
    assert len(threads) == 1
    d.proc.send_signal(signal.SIGTERM)
    d.proc.wait(timeout=30)
    assert not d.sock.exists()
    assert ended(threads)  # the store is still open
    del store


def test_a_preattaching_thread_backs_off_from_a_daemon_that_does_not_answer(tmp_path: Path) -> None:
    """A socket left by a killed daemon: asked less and less often, not every 0.5 s forever."""
    from smstore.wire.client import Preattacher as _Preattacher

    sock = tmp_path / "dead.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(os.fspath(sock))
    listener.close()  # the socket file stays; nobody listens: connection refused
    out = dataset(tmp_path, "ds", shards=2)
    ahead = _Preattacher(sock, os.fspath(out), {}, lambda k: False, lambda k: None)
    waits: list[float] = []

    def wait(timeout: float) -> bool:
        waits.append(timeout)
        if len(waits) == 10:
            ahead._stop.set()
        return ahead._stop.is_set()

    ahead._stop.wait = wait  # type: ignore[method-assign]
    ahead._run()
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0, 30.0]
    ahead.close()


def test_a_residency_never_closed_ends_its_thread_when_collected(tmp_path: Path) -> None:
    """Before the fix the thread held the residency: neither was ever collected."""
    import gc

    out = dataset(tmp_path, "ds", shards=2)
    residency = ShardResidency(out, mode="mmap")
    residency.hold([0])
    thread = residency._thread
    assert thread is not None
    del residency
    gc.collect()
    assert ended([thread])


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
