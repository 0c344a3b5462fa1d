"""The daemon's state file: which segments it holds, written for a successor to adopt, read back safely."""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["StateFile", "read_state", "set_aside", "state_path", "write_state"]

log = logging.getLogger("smstore.daemon")


def state_path(sock: Path) -> Path:
    """The state file beside a daemon's socket."""
    return sock.with_name(sock.name + ".state")


def write_state(path: Path, state: dict[str, Any]) -> None:
    """Replace the state file atomically (a reader never sees half of it)."""
    tmp = path.with_name(path.name + ".tmp")
    # O_NONBLOCK: a FIFO put in its place fails the write (logged) instead of blocking the daemon.
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    fd = os.open(tmp, flags, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            # dumps, not dump: dump streams through the pure-Python encoder (a millisecond for a
            # few dozen segments, on the daemon's loop at every window switch); dumps runs in C.
            f.write(json.dumps(state))
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# A state file larger than this is not one (100,000 segments under long paths take ~50 MB).
MAX_STATE_BYTES = 256 << 20


def _no_constant(name: str) -> None:
    msg = f"{name} is not a number a state file holds"
    raise ValueError(msg)


def read_state(path: Path) -> dict[str, Any] | None:
    """The state file's contents, or None if there is none.

    Only a regular file is opened (a symlink, a FIFO or a device never is), and only up to
    `MAX_STATE_BYTES`.

    Raises:
        ValueError: It exists but is not a state file (not a regular file, too large, unreadable,
            not JSON, fields missing or of the wrong type).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: a symlink
        msg = f"{path}: not a valid state file (cannot open it as a regular file: {e.strerror})"
        raise ValueError(msg) from None
    try:
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_STATE_BYTES:
                msg = (
                    f"{path}: not a valid state file (not a regular file of at most {MAX_STATE_BYTES} bytes)"
                )
                raise ValueError(msg)
            state = json.loads(f.read(MAX_STATE_BYTES + 1), parse_constant=_no_constant)
        if not (
            isinstance(state, dict)
            and all(type(state.get(k)) is int for k in ("pid", "start_time"))
            and isinstance(state.get("segments"), list)
        ):
            msg = "not an object with integer 'pid' and 'start_time' and a 'segments' list"
            raise ValueError(msg)
    except (OSError, ValueError, RecursionError) as e:
        if str(e).startswith(f"{path}: "):
            raise
        msg = f"{path}: not a valid state file ({e})"
        raise ValueError(msg) from None
    return state


def set_aside(path: Path, why: object) -> Path | None:
    """Move a bad state file out of the way (to ``<name>.bad``) with a warning; the new path, or None."""
    bad = path.with_name(path.name + ".bad")
    try:
        os.replace(path, bad)
    except OSError as e:
        log.warning("%s; cannot set it aside (%s): remove it", why, e.strerror)
        return None
    log.warning("%s; set aside as %s, going on without it", why, bad)
    return bad


# The state file is written once the changes reach 1/STATE_FRACTION of its segments, or after
# STATE_DELAY seconds without a change.
STATE_FRACTION = 8
STATE_DELAY = 1.0


class StateFile:
    """When the daemon's state file is written: often enough for a successor, never O(N) per load.

    Writing the whole file at every load made loading N blobs O(N**2) (5,000 took 126 s). It is
    written when the changes since the last write reach an eighth of what it lists (at once while
    it lists under 8 segments), else once no change came for `STATE_DELAY` seconds (`flush`): N
    loads write O(N) bytes in all. A daemon killed meanwhile leaves those latest segments out;
    its successor removes them as leftovers.

    Args:
        path: The state file.
        contents: What to write: the state, and how many segments it lists.
    """

    def __init__(self, path: Path, contents: Callable[[], tuple[dict[str, Any], int]]) -> None:
        self.path = path
        self.contents = contents
        self.rows = 0  # segments it lists
        self.changes = 0  # changes since it was written
        self.changed_at = 0.0  # when the last came

    def changed(self) -> None:
        """Note a change of the segments, and write the file if enough changed."""
        self.changes += 1
        self.changed_at = time.monotonic()
        if self.changes >= max(1, self.rows // STATE_FRACTION):
            self.save()

    def flush(self) -> None:
        """Write the changes the file is missing once the segments stopped changing."""
        if self.changes and time.monotonic() - self.changed_at >= STATE_DELAY:
            self.save()

    def save(self) -> None:
        """Record the segments for a successor; a failure (a full disk) costs only that, never the daemon."""
        state, rows = self.contents()
        self.changes = 0
        self.rows = rows
        try:
            write_state(self.path, state)
            log.debug("state file written: %d segment(s)", rows)
        except OSError as e:
            log.error(
                "cannot write the state file %s (%s): a restarted daemon will not adopt the segments",
                self.path,
                e,
            )
