"""Fuzz target: a hostile client's bytes through the daemon's event loop, in-process, with one segment served."""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import struct
from pathlib import Path

import atheris
from _common import Finding, main, scratch_dir

with atheris.instrument_imports():
    import smstore
    from smstore.daemon.loader import Loaded
    from smstore.daemon.segments import Segment, unlink_quietly
    from smstore.daemon.server import Daemon
    from smstore.daemon.sources import Source
    from smstore.wire.protocol import Piece

# Input byte 0 holds these flags, byte 1 the chunk size (0: one write); the rest is what the client sends.
NOT_OWNER = 1  # the client is another uid the daemon admitted (a group member): no load/unload/stop
HALF_CLOSE = 2  # the client shuts its write side after sending
READ_LATE = 4  # the client reads replies only at the end (backpressure: one reply in flight)
# Replaced in the input by the served segment's checksum, so that seeds can attach to it although
# the blob (and its checksum) is made anew by each fuzzing process. As long as a checksum, so
# that the frame lengths in the seeds stay right.
PLACEHOLDER = b"@@@@CHECKSUM@@@@"
MAX_CHUNKS = 64
MAX_TURNS = 16  # run_once calls after the last write, while replies keep coming
MAX_REPLY = 1 << 20  # docs/daemon.md, "Limits"
FD_CHECK_EVERY = 256

WORK = Path(scratch_dir("daemon"))


class LoggedBugs(logging.Handler):
    """The daemon logs an unexpected exception in a request or connection (log.exception): a bug."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.records.append(record)


def open_segment_fd(fd: int) -> smstore.Store:
    """The one way into the received segment: map it as a client would, by its fd."""
    return smstore.open(f"/proc/self/fd/{fd}", verify=True)


def serve_one_segment() -> tuple[Daemon, Segment, int]:
    """A daemon that is not started (no socket file, no loader thread) with one small segment loaded.

    Loaded by the daemon's own path (the loader's `_load_one`: shm_load, checksum checked; `Serving.register`), then
    unlinked at once, so that nothing is left in /dev/shm however this process ends. Returns the
    daemon, the segment, and a duplicate of its fd to serve it again after a fuzzed `unload`.
    """
    daemon = Daemon(WORK / "d.sock")
    blob = WORK / "served.smst"
    smstore.pack([b"zero", b"", b"two"], blob, durable=False)
    seg = daemon.serving.register(
        os.fspath(blob), daemon.serving.loader._load_one(Source.named(os.fspath(blob)), Piece(0))
    )
    unlink_quietly(seg.name)
    return daemon, seg, os.dup(seg.fd)


DAEMON, SEGMENT, SEGMENT_FD = serve_one_segment()
BUGS = LoggedBugs()
logging.getLogger("smstore.daemon").addHandler(BUGS)
logging.getLogger("smstore.daemon").propagate = False  # refused clients are expected: no noise
iterations = 0
fd_baseline: int | None = None


def check_table() -> None:
    """The connection table agrees with itself after every turn of the loop."""
    if len(DAEMON.conns) > 1:
        raise Finding(f"{len(DAEMON.conns)} connections for one client")
    counted: dict[int, int] = {}
    for conn in DAEMON.conns.values():
        counted[conn.uid] = counted.get(conn.uid, 0) + 1
    if counted != dict(DAEMON.per_uid()):
        raise Finding(f"per_uid {DAEMON.per_uid()} but connections by uid {counted}")
    if BUGS.records:
        record = BUGS.records[0]
        raise Finding(f"the daemon hit an unexpected error: {record.getMessage()}") from record.exc_info[1]


class Client:
    """The client end: reads replies without blocking and checks each frame and each fd."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.pos = 0  # stream offset of buf[0]
        self.fds: list[tuple[int, int]] = []  # (stream offset of the last byte that came with them, fd)
        self.eof = False

    def read(self) -> bool:
        """Take what has arrived; True if anything did."""
        got_any = False
        for _ in range(1024):
            try:
                data, fds, _flags, _addr = socket.recv_fds(self.sock, 1 << 16, 8)
            except (BlockingIOError, InterruptedError):
                break
            except ConnectionResetError:
                self.eof = True
                break
            # The kernel ends a read after the message that carried descriptors: they belong to
            # the frame holding this read's last byte.
            self.fds.extend((self.pos + len(self.buf) + len(data) - 1, fd) for fd in fds)
            if not data:
                self.eof = True
                break
            got_any = True
            self.buf += data
        self.frames()
        return got_any

    def frames(self) -> None:
        while len(self.buf) >= 4:
            (n,) = struct.unpack_from(">I", self.buf)
            if n > MAX_REPLY:
                raise Finding(f"a reply announces {n} bytes")
            if len(self.buf) < 4 + n:
                return
            body, end = bytes(self.buf[4 : 4 + n]), self.pos + 4 + n
            del self.buf[: 4 + n]
            self.pos = end
            fds = [fd for at, fd in self.fds if at < end]
            self.fds = [(at, fd) for at, fd in self.fds if at >= end]
            try:
                self.check_frame(body, fds)
            finally:
                for fd in fds:
                    os.close(fd)

    def check_frame(self, body: bytes, fds: list[int]) -> None:
        reply = json.loads(body)  # a ValueError here is a finding too
        if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
            raise Finding(f"reply without an ok flag: {body[:200]!r}")
        if not fds:
            return
        if len(fds) > 1 or not reply["ok"] or reply.get("checksum") != SEGMENT.checksum:
            raise Finding(f"{len(fds)} fd(s) came with {body[:200]!r}")
        with open_segment_fd(fds[0]) as store:
            if store.checksum != reply["checksum"] or len(store) != reply.get("records"):
                raise Finding(f"the fd maps blob {store.checksum}, the reply names {reply['checksum']}")

    def close(self) -> None:
        self.sock.close()
        for _at, fd in self.fds:
            os.close(fd)


def turn() -> None:
    DAEMON.run_once(0)
    check_table()


def reset_daemon() -> None:
    """Undo what a request may leave for a loader that is not running, and serve the segment again."""
    DAEMON.stopping = False
    DAEMON.serving.loading.clear()
    while True:
        try:
            DAEMON.serving.loader.jobs.get_nowait()
        except queue.Empty:
            break
    if SEGMENT.checksum not in DAEMON.segments:  # a fuzzed `unload` dropped it
        DAEMON.serving.register(
            SEGMENT.paths[0], Loaded(SEGMENT.name, os.dup(SEGMENT_FD), SEGMENT.checksum, 0.0)
        )


def check_clean() -> None:
    """Nothing of the connection outlives it; no descriptor leaks across inputs."""
    global fd_baseline, iterations
    if DAEMON.conns or DAEMON.per_uid() or DAEMON.sel.get_map():
        raise Finding(f"after close: conns {DAEMON.conns}, per_uid {DAEMON.per_uid()}")
    if any(seg.clients for seg in DAEMON.segments.values()):
        raise Finding("a closed connection is still listed as a segment's client")
    iterations += 1
    if iterations % FD_CHECK_EVERY == 0:
        open_fds = len(os.listdir("/proc/self/fd"))
        if fd_baseline is None:
            fd_baseline = open_fds
        elif open_fds > fd_baseline + 4:
            raise Finding(f"{open_fds} fds open, {fd_baseline} after the first inputs: a leak")


def test_one_input(data: bytes) -> None:
    if len(data) < 2:
        return
    flags, size = data[0], data[1]
    payload = data[2:].replace(PLACEHOLDER, SEGMENT.checksum.encode())
    size = size or max(len(payload), 1)
    chunks = [payload[i : i + size] for i in range(0, len(payload), size)]
    if len(chunks) > MAX_CHUNKS:
        chunks[MAX_CHUNKS - 1 :] = [b"".join(chunks[MAX_CHUNKS - 1 :])]
    reset_daemon()
    client_sock, server_sock = socket.socketpair()
    client_sock.setblocking(False)
    client = Client(client_sock)
    cid = DAEMON.add_connection(server_sock)
    if flags & NOT_OWNER and cid in DAEMON.conns:
        DAEMON.conns[cid].owner = False
    try:
        check_table()
        for chunk in chunks:
            try:
                client_sock.send(chunk)
            except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                break  # the daemon stopped reading (backpressure) or hung up: what is sent is sent
            turn()
            if not flags & READ_LATE:
                client.read()
        if flags & HALF_CLOSE:
            client_sock.shutdown(socket.SHUT_WR)
        for _ in range(MAX_TURNS):
            turn()
            if not client.read() or client.eof:
                break
    finally:
        client.close()
        if cid in DAEMON.conns:
            DAEMON.close(cid)  # a connection waiting on a load that never finishes, or one left open
    check_clean()


if __name__ == "__main__":
    main(test_one_input)
