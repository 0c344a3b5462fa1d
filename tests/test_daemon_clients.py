"""The daemon against hostile and broken clients and peers: malformed requests, limits, backpressure,
connections it must shed, descriptors it is sent, other users. Most tests reproduce a defect of an
older daemon.

Every loop here is bounded in count and time; every daemon is a real `smstore serve` on a private
socket, stopped (and /dev/shm checked) by the start_daemon fixture.
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from daemon_testlib import (
    IS_ROOT,
    SHM,
    STATUS,
    Daemon,
    as_user,
    ask,
    assert_alive_and_clean,
    check_all,
    cli,
    dataset,
    exchange,
    frame,
    group_daemon,
    public_rundir,
    raw,
    read_reply,
    read_reply_fds,
    send,
)

import smstore
from smstore import _core
from smstore.daemon.segments import list_segments
from smstore.errors import DaemonError
from smstore.format.manifest import read_manifest
from smstore.wire.client import daemon_request, open_store


def pss_anon_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss_Anon:"):
            return int(line.split()[1])
    raise AssertionError("no Pss_Anon line")


# ---- malformed requests ----------------------------------------------------------------------


def test_hostile_messages(blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon]) -> None:
    path, recs = blob
    d = start_daemon(path, env={"SMSTORE_IO_TIMEOUT": "1"})
    checksum = smstore.open(path).checksum
    # A client that stalls mid-message blocks nobody, and is dropped after the timeout.
    stalled = raw(d.sock)
    stalled.sendall(b"\x00\x00\x01")
    # Malformed bodies get an error reply on a connection that stays usable.
    s = raw(d.sock)
    for body in (
        b"not json",
        b"\xff\xfe",
        b"[1, 2]",
        b"{}",
        b'{"op": "nope"}',
        b'{"op": "attach", "checksum": 5}',
        b'{"op": "load", "path": "relative.smst"}',
        b'{"op": "unload", "path": 7}',
    ):
        reply = exchange(s, body)
        assert reply is not None, body
        assert reply["ok"] is False, body
    assert exchange(s, b'{"op": "status"}')["ok"]  # type: ignore[index]
    s.close()
    # Oversized: an error reply, then the connection is closed.
    s = raw(d.sock)
    s.sendall(struct.pack(">I", 0xFFFFFFF0) + b"x" * 100)
    reply = read_reply(s)
    assert reply is not None
    assert reply["error"] == "too_large"
    assert s.recv(10) == b""
    s.close()
    # Random garbage and truncated frames, then hang-ups.
    for junk in (os.urandom(5000), frame(b'{"op": "status"}')[:7], b"\x00"):
        s = raw(d.sock)
        s.sendall(junk)
        s.close()
    # Several frames in one send, and one frame split over sends.
    s = raw(d.sock)
    s.sendall(frame(b'{"op":"status"}') * 3)
    for _ in range(3):
        assert read_reply(s)["ok"]  # type: ignore[index]
    whole = frame(b'{"op":"status"}')
    for b in whole:
        s.sendall(bytes([b]))
    assert read_reply(s)["ok"]  # type: ignore[index]
    s.close()
    # The daemon still serves attaches, and the stalled client was dropped.
    store = open_store(path, mode="daemon")
    check_all(store, recs)
    assert d.segment(checksum)["clients"] == [os.getpid()]
    stalled.settimeout(10)
    assert stalled.recv(10) == b""
    stalled.close()
    assert d.proc.poll() is None
    assert "Traceback" not in d.log.read_text()


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
        reply = exchange(s, body)
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
    reply = exchange(s, b'{"op":"load","path":"/tmp/\\udcff.smst"}')
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


def test_a_hold_naming_a_fifo_never_blocks_the_daemon(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """Opening the FIFO used to wait for a writer on the event loop: no one was answered any more."""
    fifo = tmp_path / "manifest.json"
    os.mkfifo(fifo)
    d = start_daemon(loaded=0)
    holder = raw(d.sock)
    try:
        send(holder, {"op": "hold", "manifest": os.fspath(fifo), "shards": "0"})
        status = ask(d.sock, {"op": "status"}, timeout=10)  # a socket timeout, not a clock: it answers
        assert status is not None
        assert status["ok"] is True
        reply = read_reply(holder)
        assert reply is not None
        assert reply["error"] == "bad_request"
        assert "not a regular file" in reply["message"]
    finally:
        holder.close()
        # Before the fix the daemon waits in open(): a writer lets it go, so that it stops cleanly.
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


# ---- a queued reply carries the fd it was queued with ----------------------------------------


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


# ---- descriptors sent to the daemon ----------------------------------------------------------


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
                send(s, body)
            else:
                socket.send_fds(s, [frame(body)], [fd])
            reply = read_reply(s)
            assert reply is not None
            assert reply["error"] == error, reply
    # A memfd that is not a blob, sealed: refused as a format error, nothing kept.
    mfd = os.memfd_create("junk", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(mfd, b"x" * 5000)

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


# ---- a client that sends and never reads is throttled, then dropped --------------------------


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


# ---- connection exhaustion -------------------------------------------------------------------


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


def test_an_owner_refused_as_busy_tries_again_until_stalled_connections_are_dropped(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """It failed at once, though the daemon drops the connections in its way within the I/O timeout."""
    d = start_daemon(args=("--max-connections", "8", "--io-timeout", "3"), loaded=0)
    hogs = [raw(d.sock) for _ in range(7)]  # connected, silent: dropped after 3 s
    try:
        assert d.status()["connections"] == 8  # the seven and this one
        hogs.append(raw(d.sock))  # all eight in use: the next connection is refused
        status = smstore.wire.client.daemon_request({"op": "status"}, d.sock)
        assert status["ok"] is True
        assert "refused connection from pid" in d.log.read_text()  # it was refused, then got through
        assert all(h.recv(10) == b"" for h in hogs)  # the silent ones were dropped
    finally:
        for h in hogs:
            h.close()


@pytest.mark.parametrize("retry_within", [float("nan"), float("inf"), -1.0, True])
def test_a_busy_reply_with_a_bad_retry_figure_is_not_retried(tmp_path: Path, retry_within: float) -> None:
    """The retry bound comes from the daemon's reply: NaN compared false with every bound, so a
    hostile or broken daemon kept a client retrying forever. Only a finite positive figure counts."""

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


# ---- other users -----------------------------------------------------------------------------


@pytest.mark.skipif(not IS_ROOT, reason="needs root to act as a second user")
def test_other_users_refused(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon], request: pytest.FixtureRequest
) -> None:
    path, recs = blob
    try:
        group = grp.getgrnam("users")
    except KeyError:
        pytest.skip("no 'users' group")
    # Shared with the group: the socket directory must let the group in (and the path to it: not
    # under pytest's private tmp_path).
    rundir = public_rundir(request, group.gr_gid)
    public = rundir.parent
    d = start_daemon(path, args=("--group", "users"), at=rundir / "smstore.sock")
    (name,) = list_segments(d.pid)
    assert (SHM / name).stat().st_mode & 0o777 == 0o440
    assert (SHM / name).stat().st_gid == group.gr_gid
    sock = os.fspath(d.sock)
    checksum = smstore.open(path).checksum
    # The member reads its own copy of the file (matched to the segment by content).
    spath = os.fspath(public / "data.smst")
    shutil.copyfile(path, spath)
    Path(spath).chmod(0o644)

    def member() -> str:
        store = open_store(spath, mode="daemon", socket=sock)
        ok = all(bytes(store[i]) == recs[i] for i in range(len(recs)))
        try:
            daemon_request({"op": "stop"}, sock)
            stop = "stopped"
        except DaemonError as e:
            stop = str(e)
        return f"{type(store).__name__} {ok} {stop}"

    def outsider() -> str:
        results = []
        try:
            daemon_request({"op": "attach", "checksum": checksum}, sock)
            results.append("attached")
        except DaemonError as e:
            results.append(f"refused: {e}")
        try:
            with open(SHM / name, "rb") as f:
                f.read(10)
            results.append("read the segment")
        except PermissionError:
            results.append("no read")
        return " | ".join(results)

    assert as_user(member, [group.gr_gid]) == "DaemonStore True smstore daemon: only uid 0 may stop"
    got = as_user(outsider, [])
    assert got.startswith("refused:"), got
    assert got.endswith("no read"), got
    # Even with the directory and socket opened up by mistake, the daemon checks credentials.
    d.sock.parent.chmod(0o711)
    d.sock.chmod(0o666)
    got = as_user(outsider, [])
    assert "may not use this smstore daemon" in got, got
    assert got.endswith("no read"), got
    assert d.status()["ok"]


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
