"""Another user who takes the names smstore's processes meet at, for the tests: run as uid 65534.

As a script (started by :class:`Squatter`, already as the other user): binds the abstract socket
names and the socket file it is given, prints ``ready``, then accepts every connection (when told
to), prints ``accepted <name>`` for each and never sends a byte, until it is killed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

NOBODY = 65534


@functools.cache
def python_for_nobody() -> str | None:
    """A Python interpreter the other user can run (ours may live in a directory closed to it)."""
    for candidate in (sys.executable, os.path.realpath(sys.executable), "/usr/bin/python3"):
        try:
            done = subprocess.run(
                [candidate, "-I", "-c", "pass"],
                user=NOBODY,
                group=NOBODY,
                extra_groups=[],
                cwd="/",
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=60,
                check=False,
            )
        except OSError:
            continue
        if done.returncode == 0:
            return candidate
    return None


class Squatter:
    """A process of uid 65534 holding the given names until :meth:`stop`.

    Args:
        listen: Abstract socket addresses (with their leading NUL) to bind and listen on.
        bind_only: Abstract addresses to bind without listening (connecting is refused).
        accept: Accept connections on the listening sockets (and hold them, silent).
        socket_dir: A directory (writable by the other user, e.g. sticky like /tmp) in which to
            create ``smstore/`` (mode 0777) holding a listening ``smstore.sock``: the per-user
            daemon directory of whoever uses ``socket_dir`` as ``$XDG_RUNTIME_DIR``.
    """

    def __init__(
        self,
        *,
        listen: list[bytes] = [],  # noqa: B006 - never mutated
        bind_only: list[bytes] = [],  # noqa: B006
        accept: bool = True,
        socket_dir: Path | None = None,
    ) -> None:
        spec: dict[str, Any] = {
            "listen": [a.hex() for a in listen],
            "bind": [a.hex() for a in bind_only],
            "accept": accept,
            "dir_fd": None,
        }
        fds: list[int] = []
        if socket_dir is not None:
            # The other user cannot walk down to socket_dir (pytest's temp root is 0700): give it the
            # directory itself, whose *at() calls check only that directory's permissions.
            fd = os.open(socket_dir, os.O_RDONLY | os.O_DIRECTORY)
            fds.append(fd)
            spec["dir_fd"] = fd
        python = python_for_nobody()
        assert python is not None, "skip the test where python_for_nobody() finds none"
        try:
            self.proc = subprocess.Popen(
                # With -c: the other user may not be able to read this file.
                [python, "-I", "-c", Path(__file__).read_text(), json.dumps(spec)],
                user=NOBODY,
                group=NOBODY,
                extra_groups=[],
                pass_fds=fds,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                text=True,
                cwd="/",
            )
        finally:
            for fd in fds:
                os.close(fd)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # bounded: the script binds and answers at once, or dies
        if line.strip() != "ready":
            self.stop()
            raise AssertionError(f"the squatter did not start: {line!r}")

    def stop(self) -> list[str]:
        """Kill it (by pid) and return the names it accepted connections on, one per connection."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        assert self.proc.stdout is not None
        out = self.proc.stdout.read()
        self.proc.stdout.close()
        return [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("accepted ")]


def _main(spec: dict[str, Any]) -> None:
    assert os.getuid() == NOBODY, "run me as the other user"
    sel = selectors.DefaultSelector()
    held: list[socket.socket] = []
    for hexname in spec["listen"]:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(bytes.fromhex(hexname))
        s.listen(128)
        sel.register(s, selectors.EVENT_READ, bytes.fromhex(hexname)[1:].decode())
    for hexname in spec["bind"]:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(bytes.fromhex(hexname))
        held.append(s)
    if spec["dir_fd"] is not None:
        fd = spec["dir_fd"]
        os.mkdir("smstore", 0o777, dir_fd=fd)
        os.chmod("smstore", 0o777, dir_fd=fd)
        path = f"/proc/self/fd/{fd}/smstore/smstore.sock"
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(path)
        os.chmod(path, 0o777)
        s.listen(128)
        sel.register(s, selectors.EVENT_READ, "daemon socket")
    print("ready", flush=True)
    while not spec["accept"]:
        signal.pause()  # connections wait in the backlogs, never accepted
    while True:
        for key, _ in sel.select():
            listener: socket.socket = key.fileobj  # type: ignore[assignment]
            with contextlib.suppress(OSError):
                conn, _ = listener.accept()
                held.append(conn)  # never answered, never closed
                print(f"accepted {key.data}", flush=True)


if __name__ == "__main__":
    _main(json.loads(sys.argv[1]))
