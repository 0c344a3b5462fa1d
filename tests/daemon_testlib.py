"""The daemon test harness: real `smstore serve` processes on private sockets, raw protocol clients."""

from __future__ import annotations

import contextlib
import errno
import grp
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from smstore_testlib import printable_records, sharded

import smstore
from smstore.errors import DaemonError
from smstore.format.manifest import read_manifest
from smstore.wire.client import daemon_request

SHM = Path("/dev/shm")
IS_ROOT = os.geteuid() == 0


def make_records(n: int, seed: int = 0) -> list[bytes]:
    # Awkward bytes on purpose: NULs, CRs, invalid UTF-8, empty records, one large record.
    recs = [f"{seed}:{i}:".encode() + bytes((i * 7 + j) % 256 for j in range(i % 50)) for i in range(n)]
    recs[1] = b""
    recs[2] = b"\x00\r\n\xff"
    recs[n // 2] = os.urandom(300_000)
    return recs


def cli(*args: str, sock: Path, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(
        [sys.executable, "-m", "smstore", *args, "--socket", os.fspath(sock)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check and res.returncode != 0:
        raise AssertionError(f"smstore {' '.join(args)} failed ({res.returncode}): {res.stderr}")
    return res


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    sock: Path
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def status(self) -> dict[str, Any]:
        return daemon_request({"op": "status"}, self.sock)

    def segment(self, checksum: str) -> dict[str, Any]:
        (seg,) = [s for s in self.status()["segments"] if s["checksum"] == checksum]
        return seg

    def wait_loaded(self, count: int, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited ({self.proc.returncode}): {self.log.read_text()}")
            with contextlib.suppress(DaemonError):
                st = self.status()
                if len(st["segments"]) >= count and not st["loading"]:
                    return st
            if time.monotonic() > deadline:
                raise AssertionError(f"daemon not ready: {self.log.read_text()}")
            time.sleep(0.02)


def wait_status(
    d: Daemon, predicate: Callable[[dict[str, Any]], bool], timeout: float = 20
) -> dict[str, Any]:
    """The daemon's status once `predicate` holds for it, or the last one after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate(status := d.status()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return status


def check_all(store: smstore.Store, recs: list[bytes]) -> None:
    assert len(store) == len(recs)
    for i, r in enumerate(recs):
        assert bytes(store[i]) == r, i


def raw(sock: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(os.fspath(sock))
    return s


def read_reply_fds(s: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """One reply frame and the fds that came with it; (None, fds) if the daemon closed first."""
    fds: list[int] = []

    def exactly(n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            # Never past this frame: replies may arrive back to back.
            data, got, _flags, _addr = socket.recv_fds(s, n - len(buf), 4)
            fds.extend(got)
            if not data:
                return None
            buf += data
        return buf

    head = exactly(4)
    body = exactly(struct.unpack(">I", head)[0]) if head is not None else None
    return (json.loads(body) if body is not None else None), fds


def read_reply(s: socket.socket) -> dict[str, Any] | None:
    """One reply frame (a 4-byte big-endian length, then JSON); None if the daemon closed first."""
    reply, fds = read_reply_fds(s)
    for fd in fds:
        os.close(fd)
    return reply


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def send(s: socket.socket, message: dict[str, Any] | bytes) -> None:
    """One request frame on `s`: `message` as JSON, or a body sent as it is."""
    s.sendall(frame(message if isinstance(message, bytes) else json.dumps(message).encode()))


def exchange(s: socket.socket, message: dict[str, Any] | bytes) -> dict[str, Any] | None:
    """One request on an open connection and its reply; None if the daemon closed first."""
    send(s, message)
    return read_reply(s)


def ask(sock: Path, message: dict[str, Any] | bytes, timeout: float = 20) -> dict[str, Any]:
    """One request on a new raw connection and its reply, which must come within `timeout` seconds."""
    with raw(sock) as s:
        s.settimeout(timeout)
        reply = exchange(s, message)
    assert reply is not None, message
    return reply


def hold(
    sock: Path, manifest: str | os.PathLike[str], shards: Iterable[int], **more: Any
) -> tuple[socket.socket, dict[str, Any]]:
    """A rank's hold of `shards` (its connection, open while it holds) and the daemon's reply."""
    s = raw(sock)
    message = {"op": "hold", "manifest": os.fspath(manifest), "shards": ",".join(map(str, shards)), **more}
    reply = exchange(s, message)
    assert reply is not None
    return s, reply


STATUS = frame(b'{"op":"status"}')


def assert_alive_and_clean(d: Daemon) -> None:
    """The daemon still runs, answers, and has logged no traceback."""
    assert d.proc.poll() is None, d.log.read_text()
    assert d.status()["ok"]
    assert "Traceback" not in d.log.read_text(), d.log.read_text()


def dataset(where: Path, name: str = "ds", shards: int = 4, seed: int = 7) -> Path:
    """A sharded dataset of `shards` shards of ~50 KB (records differ with `seed`)."""
    out = sharded(
        where, printable_records(1000, 200, seed, vary=False), shard_size=1000 * 201 // shards, name=name
    )
    assert len(read_manifest(out).shards) == shards
    return out


def shard(out: Path, k: int) -> tuple[str, str]:
    """The absolute path and manifest checksum of shard k."""
    m = read_manifest(out)
    return os.path.abspath(m.shard_path(k)), m.shards[k].checksum


def ended(threads: list[threading.Thread], timeout: float = 30) -> bool:
    """Whether every thread of `threads` ended within `timeout` seconds (each)."""
    for t in threads:
        t.join(timeout)
    return not any(t.is_alive() for t in threads)


def remove_tree(path: Path, tries: int = 100) -> None:
    """shutil.rmtree, tried again while a daemon still running writes into the tree (its state file
    as a rank's connection closes: the test's finalizers run before the daemon fixture stops it)."""
    for _ in range(tries - 1):
        try:
            shutil.rmtree(path)
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.ENOTEMPTY:
                raise
            time.sleep(0.05)
    shutil.rmtree(path)


def public_rundir(request: Any, group_gid: int | None = None) -> Path:
    """A socket directory another user can reach (pytest's tmp_path is private to us), removed after.

    With `group_gid`, the directory is 0710 and belongs to that group (as `smstore serve --group`
    wants it); else 0700, for the test to open up after the daemon started.
    """
    public = Path(tempfile.mkdtemp(prefix="smstore-test-"))
    request.addfinalizer(lambda: remove_tree(public))
    public.chmod(0o755)
    rundir = public / "run"
    rundir.mkdir(mode=0o700 if group_gid is None else 0o710)
    if group_gid is not None:
        os.chown(rundir, -1, group_gid)
    return rundir


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


def as_user(fn: Callable[[], str], groups: list[int]) -> str:
    """Run fn in a forked child as uid/gid 65534 (nobody) with the given supplementary groups."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.close(r)
            os.setgroups(groups)
            os.setgid(65534)
            os.setuid(65534)
            result = fn()
        except BaseException as e:  # noqa: BLE001 - reported to the parent, which asserts on it
            result = f"{type(e).__name__}: {e}"
        os.write(w, result.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read().decode()
    os.waitpid(pid, 0)
    return data
