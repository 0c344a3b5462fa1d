"""`smstore serve`, instrumented for the budget tests: the real pages of its segments at every
piece it writes, and its loads held at a gate the test opens.

    python budget_daemon.py REPORT GATE ROOT serve ARGS...

REPORT: a file this appends to: ``start PATH`` as a load (a shard's or a piece's) begins, and
``pages N`` at each piece written: an upper bound of the pages of this daemon's segments at any
moment of that write, counted as memory is (a file in /dev/shm, or an unlinked one still mapped by
a process under ROOT, each once, in whole pages). Pages only grow by a write (and a piece's write
is the only one in a block epoch), so the largest ``pages`` line is the epoch's peak.
GATE: a FIFO ('-': none); each load reads one byte of it before it begins (EOF: no more gating).
ROOT: the pid whose process tree may map the segments (the test's).

Removal runs late, as on a busy node (a loader thread behind a shard's load, or at its low
priority): a released segment reaches the loader thread only once no piece load is queued or
under way. The budget must count it until it is removed, and never wait on a load for that.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any

from smstore import _core
from smstore.cli import main
from smstore.daemon import loader, serving, sources
from smstore.daemon.segments import SEGMENT_RE


def _tree(root: int) -> list[int]:
    pids = [root]
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                pids += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue  # it ended meanwhile
    return pids


def real_pages(prefix: str, root: int) -> int:
    """The pages of this daemon's segments: each in /dev/shm, or mapped by a process under `root`."""
    by_inode: dict[int, int] = {}
    for entry in os.scandir("/dev/shm"):
        if entry.name.startswith(prefix) and SEGMENT_RE.match(entry.name):
            try:
                st = entry.stat()
            except OSError:
                continue
            by_inode[st.st_ino] = _core.shm_footprint(st.st_size)
    for pid in _tree(root):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(f"/dev/shm/{prefix}"):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                inode = int(fields[4])
                by_inode[inode] = max(by_inode.get(inode, 0), hi - lo)
    return sum(by_inode.values())


def run() -> int:
    report_path, gate_path, root, *args = sys.argv[1:]
    prefix = f"smstore-{os.getuid()}-{os.getpid()}-"
    report = open(report_path, "a", buffering=1)  # noqa: SIM115 - for the process's life
    gate = None if gate_path == "-" else os.open(gate_path, os.O_RDONLY)

    def gated(what: str) -> None:
        report.write(f"start {what}\n")
        if gate is not None:
            os.read(gate, 1)

    load_one = loader.Loader._load_one
    write_piece = sources.Source.write
    reconcile = serving.Serving.reconcile
    lock = threading.Lock()
    late: list[Any] = []  # released segments not handed to the loader thread yet
    residency: list[serving.Serving] = []
    planning = [False]

    def pieces_loading(the_serving: serving.Serving) -> bool:
        """Whether a piece's load is queued or under way (the loop's own view)."""
        return any("#records=" in label for label in the_serving.loading)

    def hand_over(the_loader: loader.Loader) -> None:
        with lock:
            for seg in late:
                the_loader.jobs.put(seg)
            late.clear()

    def free(self: loader.Loader, seg: Any) -> None:
        with lock:
            late.append(seg)
        if not planning[0] and not (residency and pieces_loading(residency[0])):
            hand_over(self)

    def _reconcile(self: serving.Serving) -> None:
        residency[:] = [self]
        planning[0] = True
        try:
            reconcile(self)
        finally:
            planning[0] = False
        if not pieces_loading(self):
            hand_over(self.loader)

    def _load_one(self: loader.Loader, source: Any, piece: Any) -> Any:
        gated(source.label(piece))
        try:
            return load_one(self, source, piece)
        finally:
            if not piece.whole:
                hand_over(self)

    def _write(fd: int, *args: Any) -> int:
        before = real_pages(prefix, int(root))
        written = write_piece(fd, *args)
        # Others only shrink while the piece is written (no other write runs in a block epoch).
        made = _core.shm_footprint(os.fstat(written).st_size)
        report.write(f"pages {max(before + made, real_pages(prefix, int(root)))}\n")
        return written

    loader.Loader._load_one = _load_one  # type: ignore[method-assign]
    loader.Loader.free = free  # type: ignore[method-assign]
    sources.Source.write = staticmethod(_write)  # type: ignore[method-assign, assignment]
    serving.Serving.reconcile = _reconcile  # type: ignore[method-assign]
    return main(args)


if __name__ == "__main__":
    raise SystemExit(run())
