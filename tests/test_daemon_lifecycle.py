"""The daemon's life: `smstore serve` and its settings, stopping, the state file, a restart that
adopts a dead daemon's segments, and `smstore gc`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from daemon_testlib import (
    IS_ROOT,
    SHM,
    Daemon,
    assert_alive_and_clean,
    check_all,
    cli,
    dataset,
    shard,
    wait_status,
)

import smstore
from smstore.daemon.segments import list_segments
from smstore.daemon.state import state_path
from smstore.errors import DaemonError
from smstore.format.manifest import read_manifest
from smstore.wire.client import open_store
from smstore.wire.residency import Residency

# ---- serve and its settings ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (("--shm-limit", "abc"), {}, "'abc' is not a size"),
        (("--io-timeout", "nan"), {}, "'nan' is not a number of seconds"),
        ((), {"SMSTORE_IO_TIMEOUT": "5s"}, "$SMSTORE_IO_TIMEOUT: '5s' is not a number of seconds"),
        ((), {"SMSTORE_SHM_LIMIT": "-1"}, "$SMSTORE_SHM_LIMIT: '-1' is not a size"),
        (("--max-connections", "1"), {}, "invalid connection limits"),
        (("--max-parked", "-1"), {}, "invalid limits on parked requests"),
    ],
)
def test_bad_settings_are_clear_errors(
    tmp_path: Path, args: tuple[str, ...], env: dict[str, str], message: str
) -> None:
    sockdir = tmp_path / "run"
    sockdir.mkdir(mode=0o700)
    res = subprocess.run(
        [sys.executable, "-m", "smstore", "serve", "--socket", os.fspath(sockdir / "s.sock"), *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **env},
        check=False,
    )
    assert res.returncode in (1, 2), res.stderr
    assert message in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert not (sockdir / "s.sock").exists()


def test_serve_of_a_non_utf8_file_name_is_a_clear_error(
    blob: tuple[Path, list[bytes]], tmp_path: Path
) -> None:
    """The old daemon started, loaded the file, then died with a traceback registering it."""
    path, _ = blob
    odd = Path(os.fsdecode(os.fsencode(tmp_path) + b"/\xff.smst"))
    shutil.copyfile(path, odd)
    dataset = Path(os.fsdecode(os.fsencode(tmp_path) + b"/ds\xff"))  # its shards' paths too
    smstore.pack_files([path], tmp_path / "ds", shard_size=1 << 20, progress=False, durable=False)
    (tmp_path / "ds").rename(dataset)
    sock = tmp_path / "run" / "smstore.sock"
    for name in (odd, dataset):
        res = cli("serve", os.fspath(name), sock=sock, check=False, timeout=60)
        assert res.returncode == 1, res.stderr
        assert "not valid UTF-8" in res.stderr, res.stderr
        assert "Traceback" not in res.stderr, res.stderr
        assert not sock.exists()


def test_second_daemon_on_same_socket_refused(start_daemon: Callable[..., Daemon]) -> None:
    d = start_daemon()
    res = cli("serve", sock=d.sock, check=False, timeout=30)
    assert res.returncode == 1
    assert "already listening" in res.stderr
    assert d.status()["ok"]


def test_second_serve_leaves_the_live_daemon_alone(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon]
) -> None:
    path, recs = blob
    d = start_daemon(path)
    state = state_path(d.sock)
    before = state.read_bytes()
    res = cli("serve", os.fspath(path), sock=d.sock, check=False, timeout=30)
    assert res.returncode == 1
    assert "already listening" in res.stderr
    assert "cannot join thread" not in res.stderr
    assert "Traceback" not in res.stderr
    assert state.read_bytes() == before
    assert d.sock.is_socket()
    check_all(open_store(path, mode="daemon"), recs)
    assert_alive_and_clean(d)


def _thread_policies(pid: int) -> set[int]:
    return {os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def test_daemon_threads_never_preempt_the_ranks(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    path, _recs = blob
    d = start_daemon(path, loaded=1)  # the loader thread has run: every thread of the daemon
    assert len(os.listdir(f"/proc/{d.pid}/task")) >= 2
    assert _thread_policies(d.pid) == {os.SCHED_BATCH}
    other = start_daemon(args=("--no-background",), at=tmp_path / "run" / "other.sock")
    assert _thread_policies(other.pid) == {os.SCHED_OTHER}


def test_sigint_stops_cleanly(blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon]) -> None:
    path, _ = blob
    d = start_daemon(path)
    d.proc.send_signal(signal.SIGINT)
    assert d.proc.wait(timeout=10) == 0
    assert list_segments(d.pid) == []
    assert not d.sock.exists()


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


# ---- the state file --------------------------------------------------------------------------


def test_state_file_write_failure_is_not_fatal(
    blob: tuple[Path, list[bytes]],
    second_blob: tuple[Path, list[bytes]],
    start_daemon: Callable[..., Daemon],
) -> None:
    path, _ = blob
    other, other_recs = second_blob
    d = start_daemon(path)
    state = state_path(d.sock)
    blocker = state.with_name(state.name + ".tmp")
    blocker.mkdir()  # the next state write fails (as on a full file system)
    try:
        cli("load", os.fspath(other), sock=d.sock, timeout=30)
        check_all(open_store(other, mode="daemon"), other_recs)
        assert d.proc.poll() is None, d.log.read_text()
        assert "cannot write the state file" in d.log.read_text()
    finally:
        blocker.rmdir()
    assert_alive_and_clean(d)


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
    cli("load", os.fspath(out), sock=d.sock, timeout=300)
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
    summary = cli("status", sock=d.sock).stdout
    assert f"{n} segment(s)" in summary
    assert "smstore status --detail" in summary
    detail = cli("status", "--detail", sock=d.sock).stdout
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
    res = cli("gc", sock=sock, timeout=60)
    assert "Traceback" not in res.stderr
    assert f"set aside as {bad}" in res.stderr
    assert not os.path.lexists(state)
    os.replace(bad, state)
    path, recs = blob
    d = start_daemon(path)  # serves, with the file it was asked to load
    assert f"set aside as {bad}" in d.log.read_text()
    with smstore.open_store(path, mode="daemon") as store:
        check_all(store, recs)
    assert json.loads(state.read_text())["pid"] == d.pid  # its own state file now
    bad.unlink()


# ---- restart and adoption --------------------------------------------------------------------


def test_restart_adopts_and_cleans(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon]
) -> None:
    path, recs = blob
    a = start_daemon(path)
    store = open_store(path, mode="daemon")
    (old,) = list_segments(a.pid)
    inode = (SHM / old).stat().st_ino
    # A half-finished load of the dead daemon (not in its state file) must be cleaned up.
    junk = old.rsplit("-", 1)[0] + "-deadbeef"
    (SHM / junk).write_bytes(b"partial")
    a.proc.kill()
    a.proc.wait()
    b = start_daemon()
    st = b.wait_loaded(1)
    (seg,) = st["segments"]
    assert seg["adopted"]
    assert seg["paths"] == [os.fspath(path)]
    assert list_segments(a.pid) == []
    (new,) = list_segments(b.pid)
    assert (SHM / new).stat().st_ino == inode, "the same pages, not a second copy"
    again = open_store(path, mode="daemon")
    check_all(again, recs)
    check_all(store, recs)


def test_restart_refuses_a_segment_changed_since(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon]
) -> None:
    # The owner can chmod and write a dead daemon's segment: adoption must check it all.
    path, _ = blob
    a = start_daemon(path)
    (old,) = list_segments(a.pid)
    a.proc.kill()
    a.proc.wait()
    seg = SHM / old
    seg.chmod(0o600)
    with open(seg, "r+b") as f:
        f.seek(4096)
        first = f.read(1)
        f.seek(4096)
        f.write(bytes([first[0] ^ 0x01]))
    seg.chmod(0o400)
    b = start_daemon()
    assert b.wait_loaded(0)["segments"] == []
    assert not seg.exists()
    assert list_segments(b.pid) == []
    assert "could not adopt" in b.log.read_text()


def test_after_kill_9_ranks_hear_which_socket_and_how_to_resume(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """The advice was "start one with 'smstore serve FILE'": no socket, no word of adoption or resuming."""
    out = dataset(tmp_path)
    d = start_daemon(loaded=0)
    rank = Residency(out, mode="daemon")
    try:
        rank.hold([0, 1], wait=True)
        wait_status(d, lambda st: len(st["segments"]) == 2)
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


# ---- gc --------------------------------------------------------------------------------------


def test_kill9_mid_epoch_then_gc(blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon]) -> None:
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    path, recs = blob
    d = start_daemon(path)
    ds = smstore.SharedStoreDataset(path, decode="bytes", mode="daemon")
    loader = DataLoader(ds, batch_size=16, num_workers=2, multiprocessing_context="fork", collate_fn=list)
    out: list[bytes] = []
    for k, batch in enumerate(loader):
        out.extend(batch)
        if k == 3:
            d.proc.kill()
            d.proc.wait()
    assert out == recs, "readers finish the epoch with correct bytes"
    assert len(list_segments(d.pid)) == 1, "kill -9 leaves the segment"
    res = cli("gc", sock=d.sock)
    assert list_segments(d.pid) == []
    assert "removed" in res.stdout
    assert not d.sock.exists()
    assert not d.sock.with_name(d.sock.name + ".state").exists()
    check_all(ds.store, recs)


def test_gc_spares_live_daemons(blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon]) -> None:
    path, _ = blob
    d = start_daemon(path)
    cli("gc", sock=d.sock)
    assert len(list_segments(d.pid)) == 1
    assert d.sock.exists()
    assert d.status()["segments"]


def test_gc_from_another_pid_namespace_spares_a_live_daemon(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon]
) -> None:
    path, recs = blob
    d = start_daemon(path)
    segments = list_segments(d.pid)
    assert len(segments) == 1
    user_ns = [] if IS_ROOT else ["-r"]
    res = subprocess.run(
        [
            "unshare",
            *user_ns,
            "--pid",
            "--fork",
            "--mount-proc",
            sys.executable,
            "-m",
            "smstore",
            "gc",
            "--socket",
            os.fspath(d.sock),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if res.returncode != 0 and "unshare" in res.stderr:
        pytest.skip(f"cannot make a PID namespace here: {res.stderr.strip()}")
    assert res.returncode == 0, res.stderr
    assert not any(name in res.stdout for name in segments), res.stdout
    assert list_segments(d.pid) == segments
    assert state_path(d.sock).exists()
    assert d.sock.is_socket()
    check_all(open_store(path, mode="daemon"), recs)
    assert_alive_and_clean(d)
