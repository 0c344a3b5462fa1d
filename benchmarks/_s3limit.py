"""A small S3-compatible GET/HEAD server over a local directory, with bandwidth limits and latency.

For benchmarks only: moto reads the whole object for every ranged GET, so it punishes exactly the
parallel ranged reads that real S3 rewards. This server answers a range by reading only that range
(os.pread), and can behave like real S3 at the same time: a per-connection bandwidth limit (S3 gives
one connection ~100-200 MB/s), a total one (the node's NIC), both token buckets, and a fixed latency
before each response's first byte (S3's ~10-30 ms time to first byte).

Objects are files under ``root/<bucket>/<key>``; requests are path-style (``/bucket/key``), as obstore
and boto3 send them to an ``AWS_ENDPOINT_URL``. No authentication is checked. PUT is accepted (a
whole object, single request) so a benchmark can upload with boto3 if it wants; multipart is not.

    with S3Limit(root, conn_rate=150e6, total_rate=1.2e9, latency=0.02) as s3:
        os.environ["AWS_ENDPOINT_URL"] = s3.endpoint
"""

from __future__ import annotations

import email.utils
import hashlib
import json
import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import unquote, urlsplit

PIECE = 256 << 10  # bytes written per token-bucket take
# GET: {"bytes_sent": body bytes of GETs so far, "blob_bytes_sent": those of *.smst objects, "requests": count}
STATS_PATH = "/_s3limit/stats"


def server_stats(endpoint: str) -> dict[str, int]:
    """The counters of a server running in another process."""
    import urllib.request

    with urllib.request.urlopen(endpoint + STATS_PATH, timeout=10) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


class TokenBucket:
    """`rate` bytes per second with a burst of `burst` bytes; take() blocks until the bytes are allowed."""

    def __init__(self, rate: float, burst: float | None = None) -> None:
        self.rate = rate
        self.burst = burst if burst is not None else max(rate / 20, 2 * PIECE)
        self.tokens = self.burst
        self.stamp = time.monotonic()
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        with self.lock:  # one taker at a time, so a waiting taker is served in order
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            self.tokens -= n
            owed = -self.tokens / self.rate if self.tokens < 0 else 0.0
            if owed > 0:
                time.sleep(owed)


class S3Limit:
    """The server, in a thread on 127.0.0.1 and a free port; a context manager, or start()/stop().

    Args:
        root: The directory holding one subdirectory per bucket.
        conn_rate: Bytes per second for each connection (None: no limit).
        total_rate: Bytes per second for all connections together (None: no limit).
        latency: Seconds before each response's first byte.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        conn_rate: float | None = None,
        total_rate: float | None = None,
        latency: float = 0.0,
    ) -> None:
        self.root = Path(root)
        self.conn_rate = conn_rate
        self.total = TokenBucket(total_rate) if total_rate else None
        self.latency = latency
        self.bytes_sent = 0  # body bytes of GET responses, all connections
        self.blob_bytes_sent = 0  # ... of blobs (*.smst): a dataset's shards, not its manifest
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range)
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_HEAD(self) -> None:
                server._get(self, body=False)

            def do_GET(self) -> None:
                server._get(self, body=True)

            def do_PUT(self) -> None:
                server._put(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def start(self) -> S3Limit:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join()

    def __enter__(self) -> S3Limit:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _path(self, h: BaseHTTPRequestHandler) -> Path | None:
        parts = unquote(urlsplit(h.path).path).lstrip("/").split("/", 1)
        if len(parts) != 2 or not parts[1] or ".." in parts[1].split("/"):
            return None
        return self.root / parts[0] / parts[1]

    @staticmethod
    def _error(h: BaseHTTPRequestHandler, code: int, name: str, body: bool = True) -> None:
        data = f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{name}</Code></Error>'.encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/xml")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "bytes_sent": self.bytes_sent,
                "blob_bytes_sent": self.blob_bytes_sent,
                "requests": len(self.requests),
            }

    def _get(self, h: BaseHTTPRequestHandler, *, body: bool) -> None:
        if h.path == STATS_PATH:  # not a valid bucket name, so never an object
            data = json.dumps(self.stats()).encode()
            h.send_response(200)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            if body:
                h.wfile.write(data)
            return
        rng = h.headers.get("Range")
        with self._lock:
            self.requests.append((h.command, h.path, rng))
        if self.latency:
            time.sleep(self.latency)
        path = self._path(h)
        try:
            fd = os.open(path, os.O_RDONLY) if path is not None else -1
        except (FileNotFoundError, IsADirectoryError):
            fd = -1
        if fd < 0:
            self._error(h, 404, "NoSuchKey", body)
            return
        try:
            st = os.fstat(fd)
            etag = '"' + hashlib.md5(f"{st.st_ino}-{st.st_size}-{st.st_mtime_ns}".encode()).hexdigest() + '"'
            match = h.headers.get("If-Match")
            if match is not None and match not in ("*", etag):
                self._error(h, 412, "PreconditionFailed", body)
                return
            start, end = 0, st.st_size  # [start, end)
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng or "")
            if rng is not None and m is not None:
                start = int(m.group(1))
                end = min(st.st_size, int(m.group(2)) + 1) if m.group(2) else st.st_size
                if start >= st.st_size or start >= end:
                    self._error(h, 416, "InvalidRange", body)
                    return
                h.send_response(206)
                h.send_header("Content-Range", f"bytes {start}-{end - 1}/{st.st_size}")
            else:
                h.send_response(200)
            h.send_header("Content-Length", str(end - start))
            h.send_header("ETag", etag)
            h.send_header("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True))
            h.send_header("Accept-Ranges", "bytes")
            h.send_header("Content-Type", "application/octet-stream")
            h.end_headers()
            if body:
                self._send(h, fd, start, end)
        finally:
            os.close(fd)

    def _send(self, h: BaseHTTPRequestHandler, fd: int, start: int, end: int) -> None:
        conn = TokenBucket(self.conn_rate) if self.conn_rate else None
        blob = h.path.endswith(".smst")
        pos = start
        while pos < end:
            n = min(PIECE, end - pos)
            if conn is not None:
                conn.take(n)
            if self.total is not None:
                self.total.take(n)
            data = os.pread(fd, n, pos)
            h.wfile.write(data)
            pos += len(data)
            with self._lock:
                self.bytes_sent += len(data)
                self.blob_bytes_sent += len(data) if blob else 0

    def _put(self, h: BaseHTTPRequestHandler) -> None:
        path = self._path(h)
        length = int(h.headers.get("Content-Length") or 0)
        data = h.rfile.read(length)
        if path is None or "uploadId" in h.path:
            self._error(h, 501, "NotImplemented")
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".part")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        h.send_response(200)
        h.send_header("ETag", '"' + hashlib.md5(data).hexdigest() + '"')
        h.send_header("Content-Length", "0")
        h.end_headers()


def main() -> int:
    """Serve ROOT until killed, printing the endpoint on the first line of stdout (a benchmark's own process)."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", type=Path)
    ap.add_argument("--conn-rate", type=float, default=0.0, help="MB/s per connection (0: no limit)")
    ap.add_argument("--total-rate", type=float, default=0.0, help="MB/s for all connections (0: no limit)")
    ap.add_argument("--latency", type=float, default=0.0, help="seconds before a response's first byte")
    args = ap.parse_args()
    server = S3Limit(
        args.root,
        conn_rate=args.conn_rate * 1e6 or None,
        total_rate=args.total_rate * 1e6 or None,
        latency=args.latency,
    ).start()
    print(server.endpoint, flush=True)
    sys.stdin.read()  # until the parent closes our stdin (or kills us)
    server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
