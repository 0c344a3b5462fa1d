"""The one rule for ``mode="auto" | "daemon" | "mmap"``: which modes there are, and what a reader does and says without a daemon."""

from __future__ import annotations

import logging
import os
from typing import Literal

from smstore.errors import DaemonError
from smstore.wire.ipc import default_socket_path, socket_path

__all__ = ["MODES", "Instead", "Mode", "check_mode", "fall_back", "log_once", "warn_once"]

log = logging.getLogger("smstore")

Mode = Literal["auto", "daemon", "mmap"]
MODES: tuple[Mode, ...] = ("auto", "daemon", "mmap")

# What each kind of reader does instead of using the daemon, and what that costs: the only words
# that differ between the readers' fallback warnings.
Instead = Literal["file", "shards", "list"]
_INSTEAD: dict[Instead, tuple[str, str]] = {
    "file": ("mapping the file", "every process reads the file through the page cache"),
    "shards": (
        "reading the next shards ahead into the page cache",
        "every process reads them through the page cache",
    ),
    "list": (
        "keeping this node's copy without the daemon",
        "other jobs on this node cannot attach to this copy, and it is freed with this job",
    ),
}

_logged: set[tuple[str, str]] = set()  # (subject, choice) already logged in this process
_warned_fallback = False  # whether this process has warned that mode="auto" went without a daemon


def check_mode(mode: object) -> Mode:
    """``mode`` if it is one of :data:`MODES`.

    Raises:
        ValueError: Any other value, naming the allowed ones.
    """
    # A str first: == on an array (or any object with its own ==) is no yes/no answer.
    if isinstance(mode, str):
        for allowed in MODES:
            if mode == allowed:
                return allowed
    msg = f"mode must be one of {', '.join(map(repr, MODES))}, not {mode!r}"
    raise ValueError(msg)


def log_once(subject: str, choice: str, message: str, *args: object) -> None:
    """Log ``message`` at INFO the first time this process makes ``choice`` for ``subject``."""
    if (subject, choice) not in _logged:
        _logged.add((subject, choice))
        log.info(message, *args)


def warn_once(subject: str, message: str, *args: object) -> None:
    """Log ``message`` as a warning the first time this process meets ``subject``."""
    if (subject, "warning") not in _logged:
        _logged.add((subject, "warning"))
        log.warning(message, *args)


def fall_back(
    mode: Mode, subject: str, reason: str, sock: str | os.PathLike[str] | None, instead: Instead
) -> None:
    """Go on without the daemon, which cannot serve ``subject`` for ``reason``: mode "auto" only.

    ``mode="daemon"`` raises. ``mode="auto"`` says it falls back: a warning, once per process (a
    forked child inherits its parent's), when a daemon was meant to serve (a socket named with
    ``socket=`` or ``$SMSTORE_SOCKET``, one there at all, a daemon that refused or failed, or a
    default socket directory that is not this user's); every later fallback in the process, and
    any with no daemon at the per-user default socket (the normal case without one), is logged at
    INFO, once per subject. ``mode="mmap"`` never gets here: it never contacts a daemon.

    Args:
        mode: The reader's mode.
        subject: What the reader reads (a file, manifest or ``SharedList 'name'``).
        reason: Why the daemon cannot serve it, naming its socket and what to do.
        sock: The daemon's socket (None: ``$SMSTORE_SOCKET`` or the per-user default).
        instead: What the reader does without the daemon.

    Raises:
        DaemonError: ``mode="daemon"``, with ``reason``.
    """
    if mode == "daemon":
        raise DaemonError(f"{subject}: {reason}") from None  # the reason says it all
    global _warned_fallback
    what, cost = _INSTEAD[instead]
    sock_at = socket_path(sock)
    # "cannot reach" is how _ipc.connect says that nothing listens: any other reason (a refusal, a
    # failed exchange, a default directory that is not this user's) means a daemon was meant.
    expected = sock_at != default_socket_path() or os.path.lexists(sock_at) or "cannot reach" not in reason
    if expected and not _warned_fallback:
        _warned_fallback = True
        _logged.add((subject, "fallback"))
        log.warning(
            "%s: %s instead of using the smstore daemon: %s. Without it, %s (pass mode='mmap' to skip the "
            "daemon without this warning; later fallbacks in this process are logged at INFO)",
            subject,
            what,
            reason,
            cost,
        )
        return
    log_once(subject, "fallback", "%s: %s (%s)", subject, what, reason)
