"""How much memory this process may still fill: the kernel's MemAvailable and the limits of its cgroups.

The one reader of those limits, for SharedList's room check and for `smstore doctor`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

__all__ = ["NO_LIMIT", "CgroupLimit", "available_memory", "cgroup_limits"]

# A limit at or above this is "no limit" (cgroup v1 writes a page-rounded 2**63-1 for none).
NO_LIMIT = 1 << 62


class CgroupLimit(NamedTuple):
    limit: int  # bytes
    usage: int | None  # bytes charged now, None if unreadable
    where: str  # the file the limit was read from


def cgroup_limits(
    proc_cgroup: Path = Path("/proc/self/cgroup"), cgroup_root: Path = Path("/sys/fs/cgroup")
) -> list[CgroupLimit]:
    """The memory limits that apply to this process: its memory cgroup's and every ancestor's.

    Both cgroup versions. A cgroup's name is any bytes but '/' and NUL: read as bytes and decoded
    as os.fsdecode decodes paths, so one that is not UTF-8 still names its directory.

    Raises:
        OSError: `proc_cgroup` cannot be read.
    """
    lines = [os.fsdecode(raw) for raw in proc_cgroup.read_bytes().splitlines()]
    found: list[CgroupLimit] = []
    for line in lines:
        hierarchy, _sep, rest = line.partition(":")
        controllers, _sep, rel = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # v2
            base, limit_file, usage_file = cgroup_root, "memory.max", "memory.current"
            if not (base / "cgroup.controllers").exists():
                base = cgroup_root / "unified"
        elif "memory" in controllers.split(","):  # v1
            base, limit_file, usage_file = (
                cgroup_root / "memory",
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        else:
            continue
        # Inside a cgroup namespace, or a container that mounts only its own cgroup at the root,
        # the path /proc names is not under the mount: the mount's root is then our cgroup.
        # A cgroup outside the namespace's root reads as /../outside: '.' and '..' are dropped, so
        # no path read here leaves the mount.
        parts = [p for p in rel.split("/") if p not in ("", ".", "..")]
        for d in (base.joinpath(*parts[:k]) for k in range(len(parts), -1, -1)):
            try:
                text = (d / limit_file).read_bytes().strip()
            except OSError:
                continue
            if not text.isdigit() or int(text) >= NO_LIMIT:  # "max", or not a limit we can read
                continue
            try:
                usage: int | None = int((d / usage_file).read_bytes().strip())
            except (OSError, ValueError):
                usage = None
            found.append(CgroupLimit(int(text), usage, os.fspath(d / limit_file)))
    return found


def available_memory() -> tuple[int, str]:
    """Bytes this process may still fill with shared memory, and where that figure comes from.

    The least of the kernel's MemAvailable and the room under each memory limit of this process's
    cgroups: a memfd's pages are charged there.
    """
    candidates: list[tuple[int, str]] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                candidates.append((int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"))
    except (OSError, ValueError, IndexError):
        pass
    try:
        limits = cgroup_limits()
    except OSError:
        limits = []
    for c in limits:
        if c.usage is not None:
            candidates.append(
                (max(0, c.limit - c.usage), f"the memory limit of cgroup {os.path.dirname(c.where)}")
            )
    if not candidates:
        return NO_LIMIT, "no limit found"
    return min(candidates)
