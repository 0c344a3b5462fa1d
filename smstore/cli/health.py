"""A node's health (`smstore doctor`) and readiness (`smstore wait`): read-only probes, nothing loaded."""

from __future__ import annotations

import os
import re
import resource
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from smstore import _core
from smstore.cli.common import argument_source
from smstore.daemon.connections import Limits
from smstore.daemon.segments import SEGMENT_RE
from smstore.errors import DaemonError, StoreError
from smstore.format.manifest import is_manifest, read_manifest
from smstore.read.memory import CgroupLimit, cgroup_limits
from smstore.read.store import read_checksum
from smstore.remote.urls import needs_daemon
from smstore.wire.client import daemon_request
from smstore.wire.ipc import check_socket_path, ensure_private_dir, process_alive, socket_path
from smstore.write.pack import human_bytes

__all__ = [
    "CONTAINER_SHM",
    "DOCTOR_TIMEOUT",
    "Blob",
    "Check",
    "Probes",
    "dataset_blobs",
    "doctor",
    "missing_blobs",
    "wait_served",
]

# Docker's (and so most container runtimes') default size of /dev/shm.
CONTAINER_SHM = 64 << 20
# Descriptors the daemon holds besides its connections and segments: listener, wake pipe, lock,
# state file, the file and segment of a load in progress, a spare for shedding, logs.
FD_RESERVE = 32
# How long doctor may take, reading datasets in object storage included (a systemd unit's
# ExecStartPre= gets 90 s by default).
DOCTOR_TIMEOUT = 30.0
# The fewest connections a node needs to be of use (a few ranks, each with a few workers).
FEW_CONNECTIONS = 64
PAGE = os.sysconf("SC_PAGE_SIZE")
# mountinfo writes a space, tab, newline or backslash in a path as an octal escape (\040).
_OCTAL = re.compile(rb"\\([0-7]{3})")


@dataclass(frozen=True)
class Check:
    """One finding: `status` is "ok", "warn" or "fail"; `fix` says what to do about a warn or fail."""

    name: str
    status: str
    message: str
    fix: str = ""

    def line(self) -> str:
        """The finding as doctor prints it: a path's bytes that are not UTF-8 (held as surrogate
        escapes, as os.fsdecode gives them) shown as \\xNN, so that any terminal can print it."""
        fix = f" Fix: {self.fix}" if self.fix else ""
        text = f"{self.status.upper():<5}{self.name}: {self.message}{fix}"
        return os.fsencode(text).decode("utf-8", "backslashreplace")


@dataclass(frozen=True)
class Probes:
    """Where `doctor` looks: the real node by default; tests point these at fixtures."""

    mountinfo: Path = Path("/proc/self/mountinfo")
    proc_cgroup: Path = Path("/proc/self/cgroup")
    cgroup_root: Path = Path("/sys/fs/cgroup")
    shm_dir: Path = Path(_core.SHM_DIR)
    nofile: Callable[[], tuple[int, int]] = field(default=lambda: resource.getrlimit(resource.RLIMIT_NOFILE))


@dataclass(frozen=True)
class Blob:
    """One blob of a dataset, as its header or its manifest describes it (nothing validated)."""

    path: str
    size: int
    checksum: str
    remote: bool = False  # an object in object storage: only the daemon reads it


def dataset_blobs(path: str, *, deadline: float | None = None) -> list[Blob]:
    """The blobs of `path`: itself, or the shards its manifest lists; reads a header or a manifest only.

    A URL's reads (and their retries) end by `deadline`, a ``time.monotonic()`` instant.

    Raises:
        StoreError: `path` cannot be read, is no blob, or its manifest is invalid (or `deadline`
            passed before object storage answered).
    """
    if is_manifest(path):
        m = read_manifest(path, deadline=deadline)
        return [
            Blob(src.location, s.file_size, s.checksum, src.remote)
            for s, src in zip(m.shards, m.sources, strict=True)
        ]
    source = argument_source(path)
    if source.remote:  # one blob in object storage: its header (one ranged GET of 4 KiB)
        header = source.header(deadline=deadline)
        return [Blob(path, header.file_size, header.checksum, remote=True)]
    try:
        checksum = read_checksum(path)
        size = os.stat(path).st_size
    except OSError as e:
        msg = f"{path}: cannot read it ({e.strerror})"
        raise StoreError(msg) from None
    if checksum is None:
        msg = f"{path}: not an smstore blob or dataset (pack it with 'smstore pack')"
        raise StoreError(msg)
    return [Blob(os.path.abspath(path), size, checksum)]


def _pages(n: int) -> int:
    return _core.shm_footprint(n)  # the daemon's rule for its --shm-limit, not a second one


# ---- the daemon ----------------------------------------------------------------------------------


def _segments(sock: Path, timeout: float) -> tuple[dict[str, Any], dict[str, int]]:
    """The daemon's status and every segment it serves (checksum -> size), a page at a time."""
    first = daemon_request({"op": "status"}, sock, timeout=timeout)
    reply, served = first, {}
    while True:
        served.update({s["checksum"]: int(s["size"]) for s in reply["segments"]})
        offset = reply.get("next_offset")
        if offset is None:
            return first, served
        reply = daemon_request({"op": "status", "offset": offset}, sock, timeout=timeout)


def missing_blobs(blobs: Iterable[Blob], sock: Path, timeout: float = 5.0) -> list[Blob]:
    """The blobs the daemon on `sock` has no loaded segment of (matched by content, as readers attach).

    Raises:
        DaemonError: No daemon answers on `sock`.
    """
    _status, served = _segments(sock, timeout)
    return [b for b in blobs if b.checksum not in served]


def wait_served(
    datasets: list[str],
    sock: Path,
    timeout: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> list[Blob]:
    """Block until the daemon on `sock` serves every blob of `datasets`; return them.

    "Served" means loaded: a segment with each blob's checksum, whatever path it was loaded from.
    Polls the daemon's status, backing off from 20 ms to 0.5 s; a daemon not started yet is
    waited for too. `timeout` counts from the call: reading a dataset in object storage (its
    manifest or header, retried while the store fails) spends it too.

    Raises:
        StoreError: A dataset cannot be read (at once, or when `timeout` passes while object
            storage does not answer), or `timeout` seconds passed; the message says which blobs
            are missing, or why no daemon answered.
    """
    deadline = clock() + timeout
    # `clock` times the polls (tests give their own); the reads time themselves on time.monotonic.
    reads_by = time.monotonic() + timeout
    blobs = [b for d in datasets for b in dataset_blobs(d, deadline=reads_by)]
    check_socket_path(sock)  # a path no socket can have never gets served: fail at once
    delay = 0.02
    while True:
        try:
            missing = missing_blobs(blobs, sock, timeout=max(0.1, min(5.0, deadline - clock())))
            why = ""
        except DaemonError as e:
            missing, why = blobs, str(e)
        if not missing:
            return blobs
        now = clock()
        if now >= deadline:
            names = ", ".join(b.path for b in missing[:3]) + (" ..." if len(missing) > 3 else "")
            if why and (remote := next((b for b in missing if b.remote), None)):
                raise needs_daemon(remote.path, why=f"not served after {timeout:g} s: {why}")
            detail = (
                f"no daemon answered ({why})"
                if why
                else f"{len(missing)} of {len(blobs)} blob(s) not loaded: {names}"
            )
            msg = (
                f"{', '.join(datasets)}: not served after {timeout:g} s: {detail}. Load them with "
                "'smstore load' (or give them to 'smstore serve'), and see 'smstore status'"
            )
            raise StoreError(msg)
        sleep(min(delay, deadline - now))
        delay = min(2 * delay, 0.5)


# ---- the probes ------------------------------------------------------------------------------------


def _mount_of(path: Path, mountinfo: Path) -> tuple[str, str, str] | None:
    """(mount point, file system type, super options) of the mount holding `path`, from mountinfo."""
    target = os.path.realpath(path)
    best: tuple[str, str, str] | None = None
    # Bytes: a mount point is any bytes but '/' and NUL (escaped octal), decoded as os.fsdecode
    # decodes paths, so that it compares with realpath's and a non-UTF-8 name is no error.
    for raw in mountinfo.read_bytes().splitlines():
        line = os.fsdecode(raw)
        left, sep, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if not sep or len(fields) < 5 or len(rest) < 3:
            continue
        point = os.fsdecode(_OCTAL.sub(lambda m: bytes([int(m.group(1), 8) & 0xFF]), os.fsencode(fields[4])))
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        # The last matching line of the longest point wins: later mounts hide earlier ones.
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, rest[0], rest[2])
    return best


def _cgroup_memory(probes: Probes) -> CgroupLimit | None:
    """The tightest memory limit of this process's cgroup and its ancestors; None if none applies."""
    found = cgroup_limits(probes.proc_cgroup, probes.cgroup_root)
    return min(found, key=lambda f: f.limit) if found else None


def _left_in_shm(shm: Path, checksums: set[str]) -> dict[str, int]:
    """Segments of ours in `shm` holding `checksums` that no live daemon serves (checksum -> size).

    A dead daemon's: one restarted on its socket adopts them, and 'smstore gc' frees them
    otherwise; either way their room is the datasets' already.
    """
    found: dict[str, int] = {}
    if not checksums:
        return found
    try:
        entries = list(os.scandir(shm))
    except OSError:
        return found
    for entry in entries:
        m = SEGMENT_RE.match(entry.name)
        if m is None or int(m.group(1)) != os.getuid() or m.group(4) not in checksums:
            continue
        if process_alive(int(m.group(2)), int(m.group(3))):
            continue  # another daemon's, on another socket: not room this one gets
        try:
            found[m.group(4)] = entry.stat(follow_symlinks=False).st_size
        except OSError:
            continue
    return found


# ---- the checks -------------------------------------------------------------------------------------


def _check_shm(probes: Probes, need: int, loaded: int) -> Iterator[Check]:
    shm = probes.shm_dir
    try:
        mount = _mount_of(shm, probes.mountinfo)
        available, total = _core.shm_space(os.fspath(shm))
    except (OSError, StoreError) as e:
        yield Check("shm", "fail", f"cannot inspect {shm}: {e}", "mount a tmpfs there")
        return
    if mount is not None and mount[1] != "tmpfs":
        yield Check(
            "shm",
            "warn",
            f"{shm} is on {mount[1]} (mounted at {mount[0]}), not a tmpfs: segments would use that disk",
            f"mount a tmpfs on {shm} (mount -t tmpfs -o size=SIZE tmpfs {shm})",
        )
    where = f"{shm} ({mount[1]} at {mount[0]})" if mount is not None else os.fspath(shm)
    room = f"{human_bytes(available)} free of {human_bytes(total)}"
    if not need:
        yield Check("shm", "ok", f"{where}: {room}")
    elif available + loaded < need:
        already = f", {human_bytes(loaded)} of it in {shm} already" if loaded else ""
        yield Check(
            "shm",
            "fail",
            f"{where}: {room}; the datasets need {human_bytes(need)}{already}",
            f"free or enlarge {shm} by {human_bytes(need - available - loaded)} ('smstore unload', "
            f"'smstore gc', mount -o remount,size=SIZE {shm}), or read the files with mode='mmap'",
        )
    else:
        yield Check("shm", "ok", f"{where}: {room}; the datasets need {human_bytes(need)}")
    if total <= CONTAINER_SHM:
        fits = need <= total
        yield Check(
            "container shm",
            "warn" if fits else "fail",
            f"{shm} is {human_bytes(total)}, a container runtime's default size"
            + ("" if fits else f": the datasets ({human_bytes(need)}) cannot fit"),
            "give the container more: docker run --shm-size=SIZE (or a tmpfs mount of that size); on "
            f"Kubernetes mount an emptyDir with medium: Memory and sizeLimit: SIZE at {shm}",
        )
    else:
        yield Check("container shm", "ok", f"{shm} is larger than a container's default 64 MiB")


def _check_cgroup(probes: Probes, need: int, loaded: int) -> Check:
    try:
        found = _cgroup_memory(probes)
    except OSError as e:
        return Check("cgroup memory", "warn", f"cannot read {probes.proc_cgroup}: {e.strerror}")
    if found is None:
        return Check("cgroup memory", "ok", "no memory limit applies to this cgroup")
    limit, usage, where = found
    used = f", {human_bytes(usage)} in use" if usage is not None else ""
    said = f"limit {human_bytes(limit)} ({where}){used}"
    fix = (
        "shared memory counts against the memory limit of the cgroup that writes it (the daemon's): "
        "raise it (docker run --memory, Kubernetes resources.limits.memory, systemd MemoryMax=) to the "
        "datasets' size plus the daemon's own memory"
    )
    if need > limit:
        return Check("cgroup memory", "fail", f"{said}; the datasets need {human_bytes(need)}", fix)
    if usage is not None and need - loaded > limit - usage:
        return Check(
            "cgroup memory",
            "warn",
            f"{said}; loading the datasets needs {human_bytes(need - loaded)} more",
            fix,
        )
    return Check("cgroup memory", "ok", said + (f"; the datasets need {human_bytes(need)}" if need else ""))


def _check_nofile(probes: Probes, blobs: int, max_connections: int) -> Check:
    soft, hard = probes.nofile()
    full = max_connections + blobs + FD_RESERVE
    least = FEW_CONNECTIONS + blobs + FD_RESERVE
    said = f"RLIMIT_NOFILE soft {soft}, hard {hard} (the daemon raises its soft limit to the hard one)"
    fix = (
        f"raise the hard limit to {full} or more: ulimit -Hn, LimitNOFILE= in a systemd unit, "
        "docker run --ulimit nofile=N:N, /etc/security/limits.conf"
    )
    if hard < least:
        return Check(
            "open files",
            "fail",
            f"{said}: too few for {blobs} segment(s) and {FEW_CONNECTIONS} connections ({least})",
            fix,
        )
    if hard < full:
        return Check(
            "open files",
            "warn",
            f"{said}: the daemon holds one per segment ({blobs}) and connection; at most "
            f"{hard - blobs - FD_RESERVE} of its {max_connections} connections fit",
            fix,
        )
    return Check("open files", "ok", f"{said}: room for {blobs} segment(s) and {max_connections} connections")


def _check_socket_dir(sock: Path) -> Check:
    try:
        check_socket_path(sock)
    except DaemonError as e:
        return Check("socket dir", "fail", str(e), "give a shorter --socket or $SMSTORE_SOCKET")
    d = sock.parent
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        parent = d.parent
        if os.access(parent, os.W_OK | os.X_OK):
            return Check("socket dir", "ok", f"{d} does not exist; 'smstore serve' creates it (mode 0700)")
        return Check(
            "socket dir",
            "fail",
            f"{d} does not exist and {parent} is not writable for uid {os.getuid()}",
            f"create it: install -d -m 0700 -o {os.getuid()} {d}",
        )
    except OSError as e:
        return Check("socket dir", "fail", f"cannot inspect {d}: {e.strerror}")
    mode = stat.S_IMODE(st.st_mode)
    try:
        ensure_private_dir(d, create=False)
    except (DaemonError, OSError) as e:
        return Check(
            "socket dir",
            "fail",
            str(e),
            f"run the daemon as the directory's owner, or: chown {os.getuid()} {d} && chmod 0700 {d} "
            "(0710 with --group)",
        )
    if mode & 0o007:
        return Check(
            "socket dir",
            "warn",
            f"{d}: mode {mode:04o} lets every user reach the socket (the daemon refuses them by uid)",
            f"chmod 0700 {d} (0710 and its group for 'smstore serve --group')",
        )
    return Check("socket dir", "ok", f"{d}: owner uid {st.st_uid}, mode {mode:04o}")


def doctor(
    datasets: list[str],
    sock: str | os.PathLike[str] | None = None,
    *,
    probes: Probes | None = None,
    max_connections: int | None = None,
    timeout: float = DOCTOR_TIMEOUT,
) -> list[Check]:
    """Inspect this node for what makes the daemon or its readers fail; one `Check` per finding.

    Reads the datasets' headers or manifests (never a record), /proc, /sys/fs/cgroup and the
    daemon's status; changes nothing. The datasets' reads and the daemon's status end within
    `timeout` seconds of the call, all together: a dataset in object storage that does not answer
    by then fails its check.
    """
    deadline = time.monotonic() + timeout
    probes = probes or Probes()
    path = socket_path(sock)
    checks: list[Check] = []
    blobs: dict[str, Blob] = {}  # by checksum: a blob in two datasets is loaded once
    for d in datasets:
        try:
            found = dataset_blobs(d, deadline=deadline)
        except StoreError as e:
            checks.append(Check("dataset", "fail", str(e)))
            continue
        blobs.update((b.checksum, b) for b in found)
        size = sum(b.size for b in found)
        checks.append(Check("dataset", "ok", f"{d}: {len(found)} blob(s), {human_bytes(size)}"))
    need = sum(_pages(b.size) for b in blobs.values())
    status: dict[str, Any] | None = None
    served: dict[str, int] = {}
    try:
        status, served = _segments(path, timeout=max(0.1, min(2.0, deadline - time.monotonic())))
    except DaemonError as e:
        daemon = Check("daemon", "warn", str(e))
    else:
        daemon = Check(
            "daemon",
            "ok",
            f"pid {status['pid']} answers on {path}: {len(served)} segment(s), "
            f"{status['counts']['loading']} loading",
        )
    left = _left_in_shm(probes.shm_dir, set(blobs) - set(served))
    loaded = sum(_pages(size) for ck, size in {**left, **served}.items() if ck in blobs)
    checks += _check_shm(probes, need, loaded)
    checks.append(_check_cgroup(probes, need, loaded))
    limit = max_connections if max_connections is not None else Limits().max_connections
    checks.append(_check_nofile(probes, len(blobs), limit))
    checks.append(_check_socket_dir(path))
    checks.append(daemon)
    if status is not None and status["shm"].get("limit") and need > status["shm"]["limit"]:
        checks.append(
            Check(
                "daemon",
                "fail",
                f"its limit ({status['shm'].get('limit_from')}) is {human_bytes(status['shm']['limit'])}; "
                f"the datasets need {human_bytes(need)}",
                "restart it with a larger --shm-limit",
            )
        )
    return checks
