"""The daemon test harness: real `smstore serve` processes on private sockets, raw protocol clients."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import smstore
from smstore.errors import DaemonError
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


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


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
