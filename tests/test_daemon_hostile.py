"""The daemon against hostile and broken clients: each test is a defect reproduced on the old daemon.

Every loop here is bounded in count and time; every daemon is a real `smstore serve` on a private
socket, stopped (and /dev/shm checked) by the start_daemon fixture.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from daemon_testlib import (
    IS_ROOT,
    Daemon,
    as_user,
    check_all,
    cli,
    frame,
    make_records,
    public_rundir,
    raw,
    read_reply,
    read_reply_fds,
    wait_status,
)

import smstore
from smstore import _core
from smstore.daemon.segments import list_segments
from smstore.daemon.state import state_path
from smstore.errors import StoreFormatError
from smstore.format.manifest import read_manifest
from smstore.wire.client import daemon_request, open_store

STATUS = frame(b'{"op":"status"}')


def pss_anon_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss_Anon:"):
            return int(line.split()[1])
    raise AssertionError("no Pss_Anon line")


def assert_alive_and_clean(d: Daemon) -> None:
    assert d.proc.poll() is None, d.log.read_text()
    assert d.status()["ok"]
    assert "Traceback" not in d.log.read_text(), d.log.read_text()


@pytest.fixture
def second_blob(tmp_path: Path) -> tuple[Path, list[bytes]]:
    recs = make_records(500, seed=7)
    path = tmp_path / "other.smst"
    smstore.pack(recs, path)
    return path, recs


# ---- 1. a queued reply carries the fd it was queued with -------------------------------------------


def test_queued_attach_reply_carries_the_requested_fd(
    blob: tuple[Path, list[bytes]],
    second_blob: tuple[Path, list[bytes]],
    start_daemon: Callable[..., Daemon],
) -> None:
    """Unloading a segment while an attach reply to it waits, then loading another blob (which may
    get the same fd number), must never hand the waiting client the other blob."""
    path, _recs = blob
    other, _ = second_blob
    d = start_daemon(path)
    checksum = smstore.open(path).checksum
    s = raw(d.sock)
    n = 3000  # status replies (~600 bytes each) fill both socket buffers; the attach reply waits behind them
    s.sendall(STATUS * n + frame(f'{{"op":"attach","checksum":"{checksum}"}}'.encode()))
    time.sleep(0.5)
    cli("unload", os.fspath(path), sock=d.sock)
    cli("load", os.fspath(other), sock=d.sock)
    attach: dict[str, Any] | None = None
    for replies in range(n + 1):
        reply, fds = read_reply_fds(s)
        assert reply is not None, f"connection closed after {replies} replies"
        try:
            if "segments" not in reply:  # the attach reply (every status reply lists segments)
                attach = reply
                if reply["ok"]:
                    assert len(fds) == 1
                    held = _core.Store._from_fd(fds[0], "received", False)
                    assert held.checksum == reply["checksum"] == checksum
                    held.close()
            else:
                assert fds == []
        finally:
            for fd in fds:
                os.close(fd)
    s.close()
    assert attach is not None
    assert_alive_and_clean(d)


# ---- 2. no request, however malformed, ends the daemon ----------------------------------------------


def test_deep_nesting_and_non_scalar_values_refused(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon]
) -> None:
    path, recs = blob
    d = start_daemon(path)
    s = raw(d.sock)
    for body in (
        b"[" * 60_000,
        b'{"op":"status","x":' + b"[" * 30_000 + b"]" * 30_000 + b"}",
        b'{"op":"status","x":{"a":1}}',
        b'{"op":"attach","checksum":"' + b"0" * 40_000 + b'"}',
        b'{"op":"attach","checksum":"ABCDEF0123456789"}',
        b'{"op":"load","path":"/x\\u0000y"}',
        b'{"op":"unload","checksum":[1]}',
        b'{"op":' + b"9" * 5000 + b"}",  # an int past Python's digit limit
    ):
        s.sendall(frame(body))
        reply = read_reply(s)
        assert reply is not None, body[:40]
        assert reply["ok"] is False, body[:40]
        assert reply["error"] == "bad_request", (body[:40], reply)
    s.sendall(STATUS)
    assert read_reply(s)["ok"]  # type: ignore[index]
    s.close()
    check_all(open_store(path, mode="daemon"), recs)
    assert d.proc.poll() is None, d.log.read_text()


def test_request_size_limit(blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon]) -> None:
    path, _ = blob
    d = start_daemon(path)
    s = raw(d.sock)
    s.sendall(struct.pack(">I", 64 * 1024 + 1))
    reply = read_reply(s)
    assert reply is not None
    assert reply["error"] == "too_large"
    assert "65536-byte limit" in reply["message"]
    assert s.recv(10) == b""
    s.close()
    assert_alive_and_clean(d)


# ---- 3. a client that sends and never reads is throttled, then dropped -----------------------------------


def test_flood_without_reading_is_bounded(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon]
) -> None:
    path, _ = blob
    d = start_daemon(path, env={"SMSTORE_IO_TIMEOUT": "1"})
    before = pss_anon_kib(d.pid)
    s = raw(d.sock)
    s.setblocking(False)
    sent = 0
    dropped = False
    chunk = STATUS * 256
    deadline = time.monotonic() + 4.0
    while time.monotonic() < deadline:
        try:
            sent += s.send(chunk)
        except BlockingIOError:
            time.sleep(0.01)
        except (BrokenPipeError, ConnectionResetError):
            dropped = True
            break
    grown = pss_anon_kib(d.pid) - before
    s.close()
    # Backpressure: only the socket buffers' worth gets in (the old daemon took everything: MiBs a second).
    assert sent < 4 << 20, sent
    assert dropped, "a client that never reads its replies is dropped after the I/O timeout"
    assert grown < 16 << 10, f"daemon grew by {grown} KiB"
    assert_alive_and_clean(d)


def test_slow_request_dropped_after_timeout(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon]
) -> None:
    path, _ = blob
    d = start_daemon(path, env={"SMSTORE_IO_TIMEOUT": "1"})
    s = raw(d.sock)
    t0 = time.monotonic()
    closed = False
    for b in STATUS * 20:  # one byte every 0.2 s: progress, but never a request within the timeout
        try:
            s.send(bytes([b]))
        except (BrokenPipeError, ConnectionResetError):
            closed = True
            break
        time.sleep(0.2)
        if time.monotonic() - t0 > 3.5:
            break
    if not closed:
        s.settimeout(3)
        closed = s.recv(100) == b""
    s.close()
    assert closed
    assert time.monotonic() - t0 < 4.5
    assert_alive_and_clean(d)


# ---- 4. connection exhaustion -------------------------------------------------------------------------


def test_silent_connections_are_dropped_so_the_owner_gets_through(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon]
) -> None:
    path, _ = blob
    d = start_daemon(path, args=("--io-timeout", "1", "--max-connections", "32"))
    idle = [raw(d.sock) for _ in range(40)]  # more than the daemon takes; none ever sends
    try:
        t0 = time.monotonic()
        # Within the timeout (plus a loop tick) the silent ones are gone and the owner stops the daemon.
        while True:
            res = cli("status", sock=d.sock, check=False, timeout=10)
            if res.returncode == 0:
                break
            assert time.monotonic() - t0 < 5, res.stderr
            time.sleep(0.1)
        for s in idle:  # each was refused ("busy") or dropped: either way the daemon closed it
            s.settimeout(5)
            for _ in range(100):
                if s.recv(4096) == b"":
                    break
            else:
                raise AssertionError("a silent connection was kept")
    finally:
        for s in idle:
            s.close()
    assert_alive_and_clean(d)


def group_daemon(
    blob: tuple[Path, list[bytes]],
    start_daemon: Callable[..., Daemon],
    request: pytest.FixtureRequest,
    *args: str,
) -> tuple[Daemon, grp.struct_group]:
    """A daemon serving `blob` to the group 'users' too (skips without one), with `args`."""
    try:
        group = grp.getgrnam("users")
    except KeyError:
        pytest.skip("no 'users' group")
    sock = public_rundir(request, group.gr_gid) / "smstore.sock"
    return start_daemon(blob[0], args=("--group", "users", *args), at=sock, loaded=1), group


@pytest.mark.skipif(not IS_ROOT, reason="needs root to act as a second user")
def test_other_uid_limited_while_the_owner_gets_through(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon], request: pytest.FixtureRequest
) -> None:
    d, group = group_daemon(blob, start_daemon, request, "--max-per-uid", "8", "--io-timeout", "30")
    sock = d.sock

    held: list[socket.socket] = []  # the child's connections, kept open until it exits

    def member() -> str:
        outcome = []
        for _ in range(20):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect(os.fspath(sock))
            with contextlib.suppress(BrokenPipeError):  # refused at once: the refusal is still readable
                s.sendall(STATUS)
            reply = read_reply(s)
            outcome.append("ok" if reply and reply["ok"] else str((reply or {}).get("message", "closed")))
            held.append(s)
        return ",".join(outcome)

    # Run the member in a child that holds its connections until we have checked the owner's access.
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.close(r)
            os.setgroups([group.gr_gid])
            os.setgid(65534)
            os.setuid(65534)
            result = member()
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            result = f"{type(e).__name__}: {e}"
        os.write(w, result.encode() + b"\n")
        time.sleep(3)  # keep the connections while the parent asks for status
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        line = f.readline().decode().strip()
        outcome = line.split(",")
        assert outcome[:8] == ["ok"] * 8, line
        assert all("too many connections from uid 65534" in o for o in outcome[8:]), line
        status = d.status()  # the owner gets through while the member holds its 8
        assert status["ok"]
    os.waitpid(pid, 0)
    assert_alive_and_clean(d)


def test_out_of_file_descriptors_does_not_spin(blob: tuple[Path, list[bytes]], tmp_path: Path) -> None:
    """With its descriptors exhausted, the daemon sheds new connections instead of busy-looping."""
    path, _ = blob
    sockdir = tmp_path / "fdrun"
    sockdir.mkdir(mode=0o700)
    sock = sockdir / "smstore.sock"

    # 40 descriptors, soft and hard: the daemon cannot raise it, and runs out after ~25 clients.
    low_limit = (
        "import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40)); "
        "sys.argv = ['smstore', *sys.argv[1:]]; runpy.run_module('smstore', run_name='__main__')"
    )
    log = tmp_path / "fd.log"
    serve = ["serve", "--socket", os.fspath(sock), "--io-timeout", "30", os.fspath(path)]
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", low_limit, *serve], stderr=err)
    held: list[socket.socket] = []
    try:
        d = Daemon(proc, sock, log)
        d.wait_loaded(1)
        for _ in range(60):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            try:
                s.connect(os.fspath(sock))
            except OSError:
                s.close()
                break
            held.append(s)
        time.sleep(0.3)
        ticks = os.sysconf("SC_CLK_TCK")

        def cpu() -> float:
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / ticks

        c0 = cpu()
        time.sleep(2.0)
        used = cpu() - c0
        assert used < 0.5, f"the daemon used {used:.2f} s of CPU in 2 s while out of descriptors"
        assert proc.poll() is None, log.read_text()
    finally:
        for s in held:
            s.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
    assert proc.returncode == 0, log.read_text()
    assert "Traceback" not in log.read_text(), log.read_text()
    assert list_segments(proc.pid, locks=True) == [], log.read_text()


# ---- 5. a path that is not UTF-8 -----------------------------------------------------------------------


def test_non_utf8_path_refused_and_later_loads_work(
    blob: tuple[Path, list[bytes]],
    second_blob: tuple[Path, list[bytes]],
    start_daemon: Callable[..., Daemon],
    tmp_path: Path,
) -> None:
    path, _ = blob
    other, other_recs = second_blob
    d = start_daemon(path)
    s = raw(d.sock)
    s.sendall(frame(b'{"op":"load","path":"/tmp/\\udcff.smst"}'))
    reply = read_reply(s)
    assert reply is not None
    assert reply["error"] == "bad_request"
    assert "UTF-8" in reply["message"]
    s.close()
    # A real file with such a name, through the CLI: a clear error, no hang.
    odd = Path(os.fsdecode(os.fsencode(tmp_path) + b"/\xff.smst"))
    shutil.copyfile(other, odd)
    res = cli("load", os.fspath(odd), sock=d.sock, check=False, timeout=30)
    assert res.returncode == 1
    assert "UTF-8" in res.stderr
    # Later loads are served, and nothing stays "loading".
    cli("load", os.fspath(other), sock=d.sock, timeout=30)
    st = d.status()
    assert st["loading"] == []
    check_all(open_store(other, mode="daemon"), other_recs)
    assert_alive_and_clean(d)


def test_a_manifest_naming_a_non_utf8_shard_is_refused_and_the_daemon_serves_on(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """The old daemon took the hold, then died on its loop loading that shard (TypeError), and again
    in its shutdown (KeyError), leaving its socket and state file behind."""
    src = tmp_path / "in.txt"
    src.write_bytes(b"".join(b"%05d line\n" % i for i in range(1000)))
    ds, good = tmp_path / "ds", tmp_path / "good"
    for out in (ds, good):
        smstore.pack_files([src], out, shard_size=4000, progress=False, durable=False)
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
        rank.sendall(frame(json.dumps(hold).encode()))
        reply = read_reply(rank)
        assert reply is not None
        assert reply["ok"] is False, reply
        assert "manifest.json" in reply["message"]
        assert "shards[0].path" in reply["message"]
        assert "UTF-8" in reply["message"]
        # The rank's connection still open, the daemon serves on: its next hold, of a dataset
        # it can name, is loaded.
        rank.sendall(frame(json.dumps({**hold, "manifest": os.fspath(good / "manifest.json")}).encode()))
        assert read_reply(rank) == {"ok": True, "resident": 0, "held": 2}
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


# ---- 6. the state file cannot be written -------------------------------------------------------------


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


# ---- 7. a second serve on a live socket -------------------------------------------------------------


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


# ---- 8. gc from another PID namespace ------------------------------------------------------------------


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


# ---- 10. the daemon's own settings are checked, not trusted -------------------------------------------


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


@pytest.mark.skipif(not IS_ROOT, reason="needs root to act as a second user")
def test_refused_other_user_cannot_hold_a_slot(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon], request: pytest.FixtureRequest
) -> None:
    """A refused peer that never reads its refusal is closed anyway (the refusal fits the buffer)."""
    path, _ = blob
    rundir = public_rundir(request)
    d = start_daemon(path, at=rundir / "smstore.sock")
    rundir.chmod(0o711)
    d.sock.chmod(0o666)

    def outsider() -> str:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(os.fspath(d.sock))
        time.sleep(0.3)
        reply = read_reply(s)
        return f"{(reply or {}).get('error')} {s.recv(10) == b''}"

    assert as_user(outsider, []) == "permission_denied True"
    assert d.status()["connections"] == 1  # only this status request's own
    assert_alive_and_clean(d)


# ---- descriptors sent to the daemon -----------------------------------------------------------------


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_stray_descriptors_are_closed_and_share_checks_its_input(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    path, _ = blob
    d = start_daemon(path)
    before = open_fds(d.pid)
    key = "blake2b-128:" + "ab" * 16
    s = raw(d.sock)
    with open(path, "rb") as f:
        for body in (b'{"op":"status"}', b'{"op":"nope"}', b"junk"):
            for _ in range(20):  # descriptors riding on requests that take none
                socket.send_fds(s, [frame(body)], [f.fileno(), f.fileno()])
                assert read_reply(s) is not None
        # share: without a descriptor, with an unsealed one, with a bad key
        for body, fd, error in (
            (f'{{"op":"share","key":"{key}"}}'.encode(), None, "bad_request"),
            (f'{{"op":"share","key":"{key}"}}'.encode(), f.fileno(), "bad_request"),
            (b'{"op":"share","key":"../../etc"}', f.fileno(), "bad_request"),
        ):
            if fd is None:
                s.sendall(frame(body))
            else:
                socket.send_fds(s, [frame(body)], [fd])
            reply = read_reply(s)
            assert reply is not None
            assert reply["error"] == error, reply
    # A memfd that is not a blob, sealed: refused as a format error, nothing kept.
    mfd = os.memfd_create("junk", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(mfd, b"x" * 5000)
    import fcntl

    fcntl.fcntl(mfd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK)
    socket.send_fds(s, [frame(f'{{"op":"share","key":"{key}"}}'.encode())], [mfd])
    reply = read_reply(s)
    os.close(mfd)
    assert reply is not None
    assert reply["ok"] is False
    assert reply["error"] in ("StoreFormatError", "StoreTruncatedError"), reply
    s.close()
    time.sleep(0.2)
    assert open_fds(d.pid) <= before  # none of the 120 descriptors sent was kept
    assert len(d.status()["segments"]) == 1
    assert_alive_and_clean(d)


# ---- readers parked on 'held' ------------------------------------------------------------------------


def ask_held(s: socket.socket, **args: Any) -> None:
    s.sendall(frame(json.dumps({"op": "held", **args}).encode()))


def test_parked_held_requests_are_bounded_and_released(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon]
) -> None:
    """At most --max-parked wait for a change; the rest are answered at once. A parked request is
    answered when its client sends more, dropped when it closes, and ends with the daemon."""
    path, _ = blob
    d = start_daemon(path, args=("--max-parked", "4"))
    first = raw(d.sock)
    ask_held(first)
    now = read_reply(first)
    assert now is not None
    assert now["ok"] is True
    assert now["shards"] == []
    assert now["not_resident"] == []
    version = now["version"]
    socks = [raw(d.sock) for _ in range(6)]
    try:
        for s in socks:
            ask_held(s, since=version, wait=60)
        status = wait_status(d, lambda st: st["counts"]["held_requests"] == 7)
        assert status["counts"]["parked"] == 4
        # The two over the limit were answered at once (before status was), with nothing new.
        answered = select.select(socks, [], [], 0)[0]
        assert len(answered) == 2
        for s in answered:
            assert read_reply(s) == now
        parked = [s for s in socks if s not in answered]
        parked[0].close()  # a client that goes takes its parked request with it
        assert wait_status(d, lambda st: st["counts"]["parked"] == 3)["counts"]["parked"] == 3
        parked[1].sendall(STATUS)  # one request at a time: the parked one is answered first
        assert read_reply(parked[1]) == now
        assert (reply := read_reply(parked[1])) is not None
        assert reply["counts"]["parked"] == 2
        # Stopping the daemon ends the two left (a socket timeout of 10 s, a wait of 60 s).
        cli("stop", sock=d.sock)
        for s in parked[2:]:
            assert s.recv(10) == b""
    finally:
        first.close()
        for s in socks:
            s.close()
    d.proc.wait(timeout=30)


def test_pipelined_requests_after_a_parked_held_are_answered_in_order(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon]
) -> None:
    """One request at a time holds for parked ones too: a `held` that parks and a request sent in
    the same write get their replies in order, at once, and a second `held` parks in its turn
    (before the fix the status came first, and of two parked `held` only one was ever answered)."""
    path, _ = blob
    d = start_daemon(path)
    s = raw(d.sock)  # 10 s socket timeout: a reply that does not come fails the test
    try:
        ask_held(s)
        now = read_reply(s)
        assert now is not None
        version = now["version"]
        held = frame(json.dumps({"op": "held", "since": version, "wait": 60}).encode())
        s.sendall(held + STATUS)
        assert read_reply(s) == now  # the parked held first, answered because more came
        reply = read_reply(s)
        assert reply is not None
        assert reply["counts"]["held_requests"] == 2
        assert reply["counts"]["parked"] == 0
        s.sendall(held + held)  # the first answered when the second is read; the second parks
        assert read_reply(s) == now
        assert wait_status(d, lambda st: st["counts"]["held_requests"] == 4)["counts"]["parked"] == 1
        s.sendall(STATUS)
        assert read_reply(s) == now  # the second, answered before the status
        reply = read_reply(s)
        assert reply is not None
        assert reply["counts"]["parked"] == 0
    finally:
        s.close()
    assert_alive_and_clean(d)


def test_max_parked_zero_parks_nothing(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon]
) -> None:
    """`--max-parked 0` means no parking (readers poll), not the default of 1024."""
    path, _ = blob
    d = start_daemon(path, args=("--max-parked", "0"))
    s = raw(d.sock)  # 10 s socket timeout: a parked request fails the test
    try:
        ask_held(s)
        now = read_reply(s)
        assert now is not None
        ask_held(s, since=now["version"], wait=60)
        assert read_reply(s) == now
        assert d.status()["counts"]["parked"] == 0
    finally:
        s.close()
    assert_alive_and_clean(d)


@pytest.mark.skipif(not IS_ROOT, reason="needs root to act as a second user")
def test_max_parked_leaves_the_owners_connection_reserve_alone(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon], request: pytest.FixtureRequest
) -> None:
    """The owner's reserve of connections is an eighth of --max-connections whatever --max-parked
    says (--max-parked 16 cut it to 2: other users got 62 of 64 connections instead of 56)."""
    d, group = group_daemon(
        blob, start_daemon, request, "--max-connections", "64", "--max-parked", "16", "--max-per-uid", "100"
    )
    sock = d.sock

    def member() -> str:
        conns = []
        try:
            for _ in range(64):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(10)
                s.connect(os.fspath(sock))
                conns.append(s)
                with contextlib.suppress(BrokenPipeError):  # refused at once: the refusal is still readable
                    s.sendall(STATUS)
                reply = read_reply(s)
                if not (reply and reply["ok"]):
                    return f"{len(conns) - 1} served, then: {(reply or {}).get('message', 'closed')}"
            return "all served"
        finally:
            for s in conns:
                s.close()

    outcome = as_user(member, [group.gr_gid])
    assert outcome == "56 served, then: too many connections (56 for other users)", outcome
    assert_alive_and_clean(d)


def test_held_arguments_are_checked(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon]
) -> None:
    path, _ = blob
    d = start_daemon(path)
    s = raw(d.sock)
    try:
        for body in (
            b'{"op":"held","since":-1}',
            b'{"op":"held","since":"1"}',
            b'{"op":"held","since":1.5}',
            b'{"op":"held","since":true}',
            b'{"op":"held","wait":-1}',
            b'{"op":"held","wait":61}',
            b'{"op":"held","wait":NaN}',
            b'{"op":"held","wait":Infinity}',
            b'{"op":"held","wait":"5"}',
        ):
            s.sendall(frame(body))
            reply = read_reply(s)
            assert reply is not None, body
            assert reply["error"] == "bad_request", (body, reply)
        assert d.status()["counts"]["parked"] == 0
    finally:
        s.close()
    assert_alive_and_clean(d)


@pytest.mark.skipif(not IS_ROOT, reason="needs root to act as a second user")
def test_other_uid_cannot_take_the_owners_parked_requests(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon], request: pytest.FixtureRequest
) -> None:
    """A group member parks at most --max-parked less the owner's reserve; the owner still parks."""
    d, group = group_daemon(blob, start_daemon, request, "--max-parked", "16")  # an eighth, 2, the owner's
    sock = d.sock
    version = daemon_request({"op": "held"}, sock)["version"]
    r, w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.close(r)
            os.close(go_w)
            os.setgroups([group.gr_gid])
            os.setgid(65534)
            os.setuid(65534)
            conns = []
            for _ in range(20):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(10)
                s.connect(os.fspath(sock))
                ask_held(s, since=version, wait=60)
                conns.append(s)
            wait_status(d, lambda st: st["counts"]["held_requests"] == 21)
            result = str(len(select.select(conns, [], [], 0)[0]))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            result = f"{type(e).__name__}: {e}"
        os.write(w, result.encode() + b"\n")
        os.read(go_r, 1)  # keep the connections until the parent checked
        os._exit(0)
    os.close(w)
    os.close(go_r)
    try:
        with os.fdopen(r, "rb") as f:
            answered_at_once = f.readline().decode().strip()
        assert answered_at_once == "6", answered_at_once  # 14 parked, the other 6 answered
        owner = [raw(sock) for _ in range(2)]
        for s in owner:
            ask_held(s, since=version, wait=60)
        status = wait_status(d, lambda st: st["counts"]["held_requests"] == 23)
        assert status["counts"]["parked"] == 16
        assert select.select(owner, [], [], 0)[0] == []  # both parked, in the owner's reserve
        for s in owner:
            s.close()
    finally:
        os.close(go_w)
        os.waitpid(pid, 0)
    assert_alive_and_clean(d)


@pytest.mark.skipif(not IS_ROOT, reason="needs root to act as a second user")
def test_another_users_reader_names_only_held_manifests(
    tmp_path: Path, start_daemon: Callable[..., Daemon], request: pytest.FixtureRequest
) -> None:
    """A reader names the dataset it follows in `held`; the daemon reads that manifest for the owner
    only: another user naming a file no hold named (a secret the daemon may read, a FIFO) hears an
    empty list, and the manifest the ranks hold is answered as for the owner."""
    src = tmp_path / "lines.txt"
    src.write_bytes(b"".join(b"%03d\n" % i for i in range(40)))
    out = tmp_path / "ds"
    smstore.pack_files([src], out, shard_size=40, progress=False, durable=False)
    os.chmod(tmp_path, 0o755)
    secret = tmp_path / "secret.json"
    secret.write_text('{"not": "a manifest"}')
    secret.chmod(0o600)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    blob = tmp_path / "b.smst"
    smstore.pack([b"x"], blob)
    d, group = group_daemon((blob, []), start_daemon, request)
    manifest = read_manifest(out)
    rank = raw(d.sock)
    try:
        hold = {"op": "hold", "manifest": os.path.abspath(manifest.path), "shards": "1,0"}
        rank.sendall(frame(json.dumps(hold).encode()))
        assert (reply := read_reply(rank)) is not None
        assert reply["ok"] is True, reply
        sock = d.sock

        def member() -> str:
            answers = []
            for m in (os.fspath(secret), os.fspath(fifo), os.path.abspath(manifest.path)):
                s = raw(sock)
                try:
                    ask_held(s, manifest=m)
                    answers.append(read_reply(s))
                finally:
                    s.close()
            return json.dumps(answers)

        secret_reply, fifo_reply, held_reply = json.loads(as_user(member, [group.gr_gid]))
        for empty in (secret_reply, fifo_reply):
            assert empty["ok"] is True, empty
            assert empty["shards"] == []
            assert empty["not_resident"] == []
        assert held_reply["ok"] is True, held_reply
        assert [c for _p, c in held_reply["shards"]] == [
            manifest.shards[1].checksum,
            manifest.shards[0].checksum,
        ]
    finally:
        rank.close()
    assert_alive_and_clean(d)
