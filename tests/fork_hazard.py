"""Run a script as ``__main__`` in a process where ``os.fork()`` cannot return in the child: a recipe's torture rank.

``python fork_hazard.py SCRIPT ARGS...`` first starts a thread that holds a lock while a
thread-local object of its needs that lock to be destroyed, then runs SCRIPT. A forked child
clears every other thread's state before it returns from ``os.fork()`` (CPython's
``PyOS_AfterFork_Child``), so it destroys that object, which would wait for the lock forever. This
is the deterministic shape of the hang seen under load (issue 36): torch's gloo thread held a
Python thread state when a DataLoader forked its workers. Instead of hanging, the child says so
and exits 70, so a test fails at once. Spawn and forkserver children, and ``subprocess``, exec
before running Python and are not affected.
"""

from __future__ import annotations

import os
import runpy
import sys
import threading

_PID = os.getpid()
_lock = threading.Lock()
_held = threading.Event()
_local = threading.local()


class _NeedsTheLock:
    def __del__(self) -> None:
        if os.getpid() == _PID:
            return  # this process's own exit: the lock's holder is gone with it
        # A forked child, inside os.fork(): the lock's holder does not exist here, so it never frees it.
        os.write(
            2, b"fork_hazard: a child forked from a process with a thread inside Python would hang here\n"
        )
        os._exit(70)


def _hold() -> None:
    _local.hazard = _NeedsTheLock()
    _lock.acquire()  # never released: the thread is a daemon and ends with the process
    _held.set()
    threading.Event().wait()


if __name__ == "__main__":
    threading.Thread(target=_hold, name="fork-hazard", daemon=True).start()
    _held.wait()
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
