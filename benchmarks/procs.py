"""The memory of a tree of processes: PSS from ``/proc/PID/smaps_rollup``, summed over descendants."""

from __future__ import annotations

import contextlib
import os
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


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds of these processes so far (``/proc/PID/stat``; one that is gone counts 0)."""
    ticks = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def mapping_pss(pid: int, name: str) -> int:
    """PSS in bytes of the mappings of one process whose path contains ``name`` (``/proc/PID/smaps``; 0 if it is gone)."""
    total, matched = 0, False
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
            head = line.split(maxsplit=5)
            if head and not head[0].endswith(":"):  # a mapping: "start-end perms offset dev inode [path]"
                matched = len(head) == 6 and name in head[5]
            elif matched and head[0] == "Pss:":
                total += int(head[1]) * 1024
    return total
