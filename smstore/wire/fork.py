"""What smstore does when its process forks: the one place that registers with ``os.register_at_fork``.

Two jobs. First, a child must not keep what belongs to the parent (daemon connections, a loader's
threads, a local job's server): modules register a function with `in_child`, run after every fork
in the child, in the order registered.

Second, a forked child must not copy the parent's heap. Reading an object in a child writes its
refcount, but the cyclic garbage collector does much worse: a collection of the oldest
generation, set off by the child's own allocations (unpickling a sample, building its tensors),
writes a field in the header of every object the parent left in it, so each worker ends up with
a private copy of every page of the parent's heap (torch's modules, the user's objects): 37 MiB
a worker for a rank that had imported torch and built a dataset (issue 36). So, just before a
fork, the young generations are collected (what the collector would do next anyway) and every
object is moved to the permanent generation (`gc.freeze`), which no collection walks; right
after, the parent takes them back (`gc.unfreeze`), so its collector goes on as if it had just run
a young collection, while the child keeps them frozen: its collections walk only what it made
itself. This is what CPython's documentation of `gc.freeze` advises for a process that forks
workers (DataLoader workers, TransformLoader workers, SharedList's builder), done here so that no
user code has to. A process that froze objects itself (`gc.get_freeze_count() > 0`) or turned
the collector off is left as it is: it manages its collector.

Third, a forked child must not inherit the heap its parent has freed. A rank that built a list
and let it go keeps the freed memory in its C allocator: resident, shared with every worker it
forks, and written into by each worker's first allocations, which copy those pages. So, before
a fork, the allocator gives its free pages back to the system (glibc's ``malloc_trim``; a libc
without it is left alone): measured in benchmarks/results/objects.md, a rank that built and freed
200k dicts otherwise kept several MiB of them in every job's memory.
"""

from __future__ import annotations

import ctypes
import gc
import os
from collections.abc import Callable

_in_child: list[Callable[[], None]] = []
_froze = False  # this fork's before-hook froze the heap, so the parent unfreezes it after


def _find_trim() -> Callable[[int], int] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_trim = _find_trim()


def in_child(fn: Callable[[], None]) -> None:
    """Run ``fn`` in the child after every ``os.fork()`` of this process (after the others registered)."""
    _in_child.append(fn)


def _before() -> None:
    global _froze
    _froze = gc.isenabled() and gc.get_freeze_count() == 0
    if _froze:
        gc.collect(1)
        gc.freeze()
    if _trim is not None:
        _trim(0)  # the freed heap goes back to the system, not into the child


def _after_in_parent() -> None:
    global _froze
    if _froze:
        _froze = False
        gc.unfreeze()


def _after_in_child() -> None:
    global _froze
    _froze = False  # the child keeps what it inherited frozen
    for fn in _in_child:
        fn()


os.register_at_fork(before=_before, after_in_parent=_after_in_parent, after_in_child=_after_in_child)
