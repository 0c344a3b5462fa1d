"""The memory of a tree of processes: PSS from ``/proc/PID/smaps_rollup``, summed over descendants."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path


def rollup(pid: int) -> dict[str, int]:
    """The fields of ``/proc/PID/smaps_rollup`` in bytes (``Pss``, ``Pss_Shmem``, ``Private_Dirty``...; empty if it is gone)."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
            key, _, value = line.partition(":")
            with contextlib.suppress(ValueError, IndexError):
                out[key] = int(value.split()[0]) * 1024
    return out


def pss_bytes(pid: int) -> int:
    """The proportional set size of one process (0 if it is gone)."""
    return rollup(pid).get("Pss", 0)


def descendants(roots: Sequence[int]) -> list[int]:
    """``roots`` and every process below them (DataLoader workers, their helpers)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out
