"""A forked child (DataLoader worker, TransformLoader worker, SharedList's builder) copies none of its parent's heap.

The cyclic garbage collector of a child writes a field of every object it walks; a full
collection in a worker, set off by its own allocations, would copy every page of the rank's
heap. smstore freezes the heap around every fork (smstore/wire/fork.py): these tests measure the
pages a child really copies (Private_Dirty in /proc/self/smaps_rollup) after a full collection,
in a real DataLoader fork worker, and check that the parent's collector is left as it was.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import weakref
from typing import Any

import pytest

import smstore  # noqa: F401 (registers smstore's fork hooks, as any use of smstore does)

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, Dataset

N = 300_000  # small dicts: about 100 MiB of the parent's heap


def private_dirty() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Private_Dirty:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Private_Dirty in smaps_rollup")


class Copied(Dataset[int]):
    """Each item: the bytes this worker has copied since it started, after a full collection."""

    def __init__(self, heap: list[dict[str, Any]]) -> None:
        self.heap = heap  # reached, not read: the collector alone would touch it

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> int:
        gc.collect()  # what a worker's allocations set off sooner or later
        return private_dirty() - _start[0]


_start = [0]


def _note_start(worker_id: int) -> None:
    _start[0] = private_dirty()


def heap_bytes(heap: list[dict[str, Any]]) -> int:
    return sum(sys.getsizeof(d) for d in heap)


def test_a_fork_worker_copies_none_of_the_ranks_heap() -> None:
    heap = [{"id": i, "name": f"img_{i:08d}.jpg", "box": [i, i + 1]} for i in range(N)]
    size = heap_bytes(heap)
    loader = DataLoader(
        Copied(heap),
        batch_size=None,
        num_workers=1,
        multiprocessing_context="fork",
        worker_init_fn=_note_start,
    )
    copied = max(int(x) for x in loader)
    # Unfrozen, the collection writes the header of each of the N dicts (and their lists): the
    # worker copies at least the dicts' pages (measured: about 1x size). Frozen: a few MiB of its own.
    assert copied < size / 4, f"the worker copied {copied >> 20} MiB of a {size >> 20} MiB heap"


def heap_resident() -> int:
    """Resident bytes of this process's C heap (``[heap]`` in /proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                inside = line.rstrip().endswith("[heap]")
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "malloc_trim"), reason="glibc's malloc_trim")
def test_a_forked_child_inherits_none_of_the_heap_its_parent_freed() -> None:
    # 94 MiB of 4 KiB blocks from the C allocator (above pymalloc's 512 B), the last one kept:
    # freed, they stay in the heap (only a free top is given back by free()), resident.
    ctypes.CDLL(None).malloc_trim(0)  # what earlier tests freed goes first: the blocks need new pages
    base = heap_resident()
    blocks = [bytes(4000) + i.to_bytes(8, "little") for i in range(24_000)]
    keep = blocks[-1]
    freed = heap_resident() - base
    del blocks
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.write(w, heap_resident().to_bytes(8, "little"))
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        inherited = int.from_bytes(f.read(), "little")
    assert os.waitpid(pid, 0)[1] == 0
    assert keep
    # Untrimmed, the child starts with the freed memory resident in its heap (measured: all of it).
    # (The heap grows by less than the blocks' size where they reuse free room it had already.)
    assert freed > 48 * 2**20
    extra = inherited - base
    assert extra < freed / 4, (
        f"the child inherited {extra >> 20} MiB of the {freed >> 20} MiB its parent freed"
    )


def test_the_parents_collector_is_left_as_it_was() -> None:
    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle only the collector frees
    gone = weakref.ref(a)
    del a, b
    pid = os.fork()
    if pid == 0:
        os._exit(0 if gc.get_freeze_count() > 0 else 1)  # the child keeps its inherited objects frozen
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert gc.get_freeze_count() == 0  # the parent's objects are its collector's again
    assert gc.isenabled()
    gc.collect()
    assert gone() is None


def test_a_process_that_froze_its_own_heap_is_left_to_manage_it() -> None:
    keep = [object() for _ in range(10)]
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        assert gc.get_freeze_count() == frozen  # neither unfrozen nor grown by smstore
    finally:
        gc.unfreeze()
    del keep
