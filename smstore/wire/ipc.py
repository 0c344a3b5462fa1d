"""What the daemon and its clients share beside the protocol: socket location, the transport (connect, exchange, request), process liveness."""

from __future__ import annotations

import contextlib
import math
import os
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from smstore.errors import DaemonError
from smstore.wire.protocol import BUSY, MAX_MESSAGE, REMOTE_WAIT, decode_body, encode, frame_length

__all__ = [
    "check_default_dir",
    "check_socket_path",
    "connect",
    "default_socket_path",
    "ensure_private_dir",
    "exchange",
    "process_alive",
    "process_start_time",
    "receive",
    "request",
    "socket_path",
    "untrusted_dir_fault",
    "wait_until_served",
]

# The longest path a Unix socket takes (sun_path is 108 bytes with its terminating NUL).
MAX_SOCKET_PATH = 107

# The longest an owner's client refused as busy keeps trying (the daemon says how long is worth it).
MAX_BUSY_WAIT = 60.0


_T = TypeVar("_T")


def wait_until_served(ask: Callable[[], _T | None], what: str) -> _T:
    """What `ask` returns once it is not None: a shard (or block) in object storage, once served.

    Its reader has no file to read instead, and the hold that makes the daemon fetch it may still
    be on its way (a sampler sends its holds from its own thread, without waiting), so "not served"
    is asked again, less often each time, for up to `REMOTE_WAIT` seconds. `ask` raises when the
    daemon says why it never will serve it, or when no daemon answers.

    Raises:
        DaemonError: Not served within `REMOTE_WAIT` seconds (`what` says what holds it).
    """
    deadline = time.monotonic() + REMOTE_WAIT
    pause = 0.001
    while True:
        if time.monotonic() > deadline:
            raise DaemonError(f"{what}: not served after {REMOTE_WAIT:.0f} s")
        time.sleep(pause)
        pause = min(0.05, pause * 2)
        got = ask()
        if got is not None:
            return got


def default_socket_path() -> Path:
    """The per-user default: ``$XDG_RUNTIME_DIR/smstore/smstore.sock`` or ``/tmp/smstore-<uid>/smstore.sock``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "smstore" if runtime else Path(f"/tmp/smstore-{os.getuid()}")
    return base / "smstore.sock"


def socket_path(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The socket to use: ``explicit``, else ``$SMSTORE_SOCKET``, else the per-user default."""
    if explicit is not None:
        return Path(explicit)
    env = os.environ.get("SMSTORE_SOCKET")
    return Path(env) if env else default_socket_path()


def untrusted_dir_fault(st: os.stat_result, *, root_owned_ok: bool = False) -> str | None:
    """Why a directory whose ``lstat`` (or ``fstat``) is `st` may not be trusted, or None.

    Another user who owns a directory, or may write to it, can swap what it holds for a link
    to anywhere, or plant files there, that whoever uses it then acts on with their own rights.
    Root owning it is no such risk where `root_owned_ok` (it can do anything anyway).
    """
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link, not a directory"
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_uid != os.getuid() and not (root_owned_ok and st.st_uid == 0):
        return f"owned by uid {st.st_uid}, not by you (uid {os.getuid()})"
    if st.st_mode & 0o022:
        return f"writable by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def ensure_private_dir(path: Path, *, create: bool, group_gid: int | None = None) -> None:
    """Check (and optionally create) the socket's directory: ours, and closed to other users.

    Raises:
        DaemonError: The directory belongs to someone else or others may write to it (or, without a
            group, enter it).
    """
    mode = 0o700 if group_gid is None else 0o710
    if create and not path.exists():
        path.mkdir(mode=mode, parents=False)
        if group_gid is not None:
            os.chown(path, -1, group_gid)
        path.chmod(mode)
    st = os.lstat(path)
    forbidden = 0o022 if group_gid is not None else 0o077
    if create and stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and st.st_mode & forbidden:
        msg = (
            f"{path}: mode {stat.S_IMODE(st.st_mode):04o} lets other users in; the socket directory must be "
            f"{mode:04o} (chmod {mode:o} {path})"
        )
        raise DaemonError(msg)
    if (fault := untrusted_dir_fault(st)) is not None:
        raise DaemonError(f"{path}: {fault}; refusing to use it for the smstore socket")


def check_default_dir(path: Path) -> None:
    """Refuse the per-user default socket `path` unless its directory is this user's and closed to others.

    The default directory's name is predictable (``/tmp/smstore-<uid>``): another user can create it
    first and listen there. A client must not speak to that listener (it could stall the client, or
    hand it a segment of its own making); the daemon refuses to start there for the same reason.

    Raises:
        DaemonError: The directory is missing (no daemon), not a directory, another user's, or
            writable by others.
    """
    try:
        ensure_private_dir(path.parent, create=False)
    except FileNotFoundError:
        msg = f"cannot reach an smstore daemon on {path} (no such directory); start one with 'smstore serve FILE'"
        raise DaemonError(msg) from None
    except DaemonError as e:
        msg = (
            f"not using the smstore daemon socket {path}: {e}. Another user may have created the "
            f"directory to intercept your processes; remove it, or give the socket of your daemon "
            "with --socket or $SMSTORE_SOCKET"
        )
        raise DaemonError(msg) from None


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def check_socket_path(path: Path) -> None:
    """Raise DaemonError if `path` is too long for a Unix socket (no daemon can listen there).

    Raises:
        DaemonError: `path` is longer than :data:`MAX_SOCKET_PATH` bytes.
    """
    size = len(os.fsencode(path))
    if size > MAX_SOCKET_PATH:
        msg = (
            f"socket path {path} is {size} bytes, longer than the {MAX_SOCKET_PATH} a Unix socket "
            "allows: choose a shorter one with --socket or $SMSTORE_SOCKET"
        )
        raise DaemonError(msg)


def connect(path: Path, timeout: float | None = 10.0) -> socket.socket:
    """A new connection to the daemon at `path`.

    Raises:
        DaemonError: No daemon listens there, its listen queue is full (busy), `path` is too long
            for a Unix socket, any other fault connecting (each naming `path`), or `path` is the
            per-user default and its directory is not this user's own (see :func:`check_default_dir`).
    """
    check_socket_path(path)
    if path == default_socket_path():
        check_default_dir(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(os.fspath(path))
    except ConnectionRefusedError as e:
        sock.close()
        # The socket is there and no one listens: its daemon died (kill -9, out of memory).
        msg = (
            f"cannot reach an smstore daemon on {path} ({e.strerror}): the daemon that made it is gone. "
            f"Restart it on the same socket ('smstore serve --socket {path}', with its --shm-limit and "
            "--group): it adopts the segments the dead one loaded, and readers attach them again. Then "
            "resume: a training job from its last checkpoint (the samplers' state_dict resumes "
            "mid-epoch), or with mode='auto' to read the files while no daemon runs"
        )
        raise DaemonError(msg) from None
    except (FileNotFoundError, PermissionError) as e:
        sock.close()
        msg = f"cannot reach an smstore daemon on {path} ({e.strerror}); start one with 'smstore serve FILE'"
        raise DaemonError(msg) from None
    except BlockingIOError as e:
        sock.close()
        # Its listen queue is full: the daemon is alive but accepts no more for now.
        msg = (
            f"the smstore daemon on {path} is busy ({e.strerror}: its listen queue is full); "
            "try again shortly, or raise its --max-connections"
        )
        raise DaemonError(msg) from None
    except OSError as e:
        sock.close()
        msg = f"cannot connect to an smstore daemon on {path} ({e.strerror or e}); see 'smstore doctor'"
        raise DaemonError(msg) from None
    except BaseException:
        sock.close()
        raise
    return sock


def exchange(
    sock: socket.socket, message: dict[str, Any], path: Path, *, fd: int | None = None
) -> tuple[dict[str, Any], int | None]:
    """Send one request on an open connection and read its reply: (reply, received fd or None).

    On any failure the connection is of no further use: the caller closes it.

    Raises:
        DaemonError: The daemon broke the connection, sent garbage, or timed out.
    """
    # A daemon that refuses us replies at once and closes: read that reply even if sending failed.
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        try:
            data = encode(message)
            sent = socket.send_fds(sock, [data], [fd]) if fd is not None else 0
            sock.sendall(data[sent:])
        except TimeoutError:
            msg = f"the smstore daemon on {path} did not take a request within {sock.gettimeout()} s"
            raise DaemonError(msg) from None
    return receive(sock, path)


def receive(sock: socket.socket, path: Path) -> tuple[dict[str, Any], int | None]:
    """Read the next reply on an open connection: (reply, received fd or None).

    On any failure the connection is of no further use: the caller closes it.

    Raises:
        DaemonError: The daemon broke the connection, sent garbage, or timed out.
    """
    fds: list[int] = []
    try:
        buf = bytearray()
        need = 4
        while len(buf) < need:
            data, got, _flags, _addr = socket.recv_fds(sock, need - len(buf), 4)
            fds.extend(got)
            if not data:
                msg = f"the smstore daemon on {path} closed the connection without a reply"
                raise DaemonError(msg)
            buf += data
            if need == 4 and len(buf) >= 4:
                need = 4 + frame_length(buf)
                if need - 4 > MAX_MESSAGE:
                    msg = f"the smstore daemon on {path} sent an oversized reply"
                    raise DaemonError(msg)
        reply = decode_body(buf[4:need])
        _close_all(fds[1:])
        return reply, (fds[0] if fds else None)
    except BaseException as e:
        _close_all(fds)
        if isinstance(e, TimeoutError):
            msg = f"the smstore daemon on {path} did not answer within {sock.gettimeout()} s"
            raise DaemonError(msg) from None
        if isinstance(e, (ConnectionError, ValueError)) and not isinstance(e, DaemonError):
            msg = f"bad exchange with the smstore daemon on {path}: {e}"
            raise DaemonError(msg) from None
        raise


def request(
    message: dict[str, Any], path: Path, *, timeout: float | None = 10.0, fd: int | None = None
) -> tuple[dict[str, Any], int | None, socket.socket]:
    """Send one request on a new connection; return (reply, received fd or None, the open socket).

    ``fd``, if given, travels with the request (``SCM_RIGHTS``); the caller keeps its own copy.

    A new connection per request: nothing is shared across fork. The caller closes the socket, or
    keeps it open to stay listed as a client of a segment it attached.

    Raises:
        DaemonError: No daemon listens at ``path``, it broke the connection, or it timed out.
    """
    delay, deadline = 0.02, None
    while True:
        sock = connect(path, timeout)
        try:
            reply, got = exchange(sock, message, path, fd=fd)
        except BaseException:
            sock.close()
            raise
        retry_within = reply.get("retry_within") if reply.get("error") == BUSY else None
        # Only a finite, positive figure: the reply is the daemon's word (NaN compares false forever).
        if (
            not isinstance(retry_within, (int, float))
            or isinstance(retry_within, bool)
            or not math.isfinite(retry_within)
            or retry_within <= 0
        ):
            return reply, got, sock
        now = time.monotonic()
        if deadline is None:  # the clock counts connects and exchanges too, not only the sleeps
            deadline = now + min(2.0 * retry_within, MAX_BUSY_WAIT)
        if now >= deadline:
            return reply, got, sock
        # Refused as busy though ours (every connection in use): the daemon drops stalled ones
        # within its I/O timeout, so try again, backing off, for up to twice that.
        sock.close()
        if got is not None:
            os.close(got)
        time.sleep(min(delay, deadline - now))
        delay = min(2 * delay, 0.5)


def process_start_time(pid: int) -> int | None:
    """The start time of a process (clock ticks since boot), or None if it does not run (or is a zombie)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # The command name may contain spaces and parentheses: fields resume after the last ')'.
    fields = raw[raw.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def process_alive(pid: int, start_time: int) -> bool:
    """Whether the process `pid` that started at `start_time` still runs (pid reuse is not liveness)."""
    return process_start_time(pid) == start_time
