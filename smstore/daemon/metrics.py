"""The daemon's metrics: the counters the loop keeps, their Prometheus text, and the exporter that serves it.

The event loop keeps the counts (`Counters`) and, at most once a second, publishes a snapshot of
every value (the ``metrics`` section of ``status``, built by the server) to the `Exporter`, which
renders it once. The exporter's thread only reads the last rendered text: a scrape or a textfile
write never touches the daemon's state and never waits for its loop.
"""

from __future__ import annotations

import contextlib
import http.server
import io
import logging
import os
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from smstore.errors import DaemonError

__all__ = ["COUNTED", "METRICS", "Counters", "Exporter", "parse_address", "render"]

log = logging.getLogger("smstore.daemon")

# Seconds between two writes of the textfile at most (node_exporter reads it at its own pace).
TEXTFILE_PERIOD = 5.0

# Scrapes served at once, at most: each holds a thread and a descriptor of the daemon, and anyone
# who can reach the port can open connections (the owner's requests need descriptors too). More are
# answered 503 at once. A scraper asks once every few seconds.
MAX_SCRAPES = 8

# Seconds a scrape may take, its whole request and reply: a client trickling its request a byte at a
# time holds its slot no longer (a timeout per read would let it hold the slot for ever).
SCRAPE_SECONDS = 5.0

# The longest request head served: a GET /metrics is a few hundred bytes.
MAX_REQUEST_HEAD = 8192

_TURNED_AWAY = b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: 1\r\n\r\n"

# The one table of metrics: key in status's ``metrics`` section -> (Prometheus name, type, label, help).
# A value is a number, or (with a label) a mapping from the label's value to a number.
METRICS: dict[str, tuple[str, str, str | None, str]] = {
    "segments": ("smstore_segments", "gauge", None, "Segments the daemon serves"),
    "resident_bytes": ("smstore_resident_bytes", "gauge", None, "Bytes of the segments the daemon serves"),
    "shm_limit_bytes": ("smstore_shm_limit_bytes", "gauge", None, "The --shm-limit budget (0: no limit)"),
    "shm_used_bytes": ("smstore_shm_used_bytes", "gauge", None, "Bytes counted against the budget"),
    "shm_available_bytes": ("smstore_shm_available_bytes", "gauge", None, "Bytes free in /dev/shm"),
    "loading": ("smstore_loading", "gauge", None, "Loads queued or running"),
    "loads": (
        "smstore_loads",
        "counter",
        "result",
        "Loads ended, by result (loaded, already_loaded, failed)",
    ),
    "load_bytes": ("smstore_load_bytes", "counter", None, "Bytes copied into shared memory by loads"),
    "load_seconds": ("smstore_load_seconds", "counter", None, "Seconds the loads took"),
    "load_failures": ("smstore_load_failures", "counter", "kind", "Loads failed, by the error's kind"),
    "held_wanted": ("smstore_held_shards_wanted", "gauge", None, "Shards the ranks hold (window and next)"),
    "held_resident": ("smstore_held_shards_resident", "gauge", None, "Held shards loaded"),
    "attach_waits": ("smstore_attach_waits", "counter", None, "Attaches that waited for a held shard's load"),
    "attach_wait_seconds": (
        "smstore_attach_wait_seconds",
        "counter",
        None,
        "Seconds readers waited for a load",
    ),
    "fetched_bytes": ("smstore_fetched_bytes", "counter", None, "Bytes fetched from object storage"),
    "cache_hits": ("smstore_cache_hits", "counter", None, "Shards named by URL found in the node cache"),
    "cache_misses": (
        "smstore_cache_misses",
        "counter",
        None,
        "Shards named by URL fetched into the node cache",
    ),
    "cache_bytes": ("smstore_cache_bytes", "gauge", None, "Bytes of the node cache's entries"),
    "decoded_hits": ("smstore_decoded_hits", "counter", None, "Decoded samples read from a node cache"),
    "decoded_fills": ("smstore_decoded_fills", "counter", None, "Decoded samples written into a node cache"),
    "decoded_uncached": (
        "smstore_decoded_uncached",
        "counter",
        None,
        "Decoded samples of chunks that did not fit the budget (decoded, not cached)",
    ),
    "decoded_evictions": (
        "smstore_decoded_evictions",
        "counter",
        None,
        "Parts of idle decoded caches evicted for room",
    ),
    "decoded_bytes": ("smstore_decoded_bytes", "gauge", None, "Bytes of the decoded caches' parts"),
    "connections": ("smstore_connections", "gauge", "uid", "Open connections, by the peer's uid"),
    "refusals": ("smstore_refusals", "counter", "reason", "Requests refused, by the reply's error code"),
}


# What the event loop counts (`Counters`), with each one's value before its first count.
COUNTED: dict[str, Any] = {
    "loads": {},
    "load_bytes": 0,
    "load_seconds": 0.0,
    "load_failures": {},
    "attach_waits": 0,
    "attach_wait_seconds": 0.0,
    "refusals": {},
    "decoded_hits": 0,
    "decoded_fills": 0,
    "decoded_uncached": 0,
    "decoded_evictions": 0,
}


@dataclass
class Counters:
    """What the event loop counts as it serves (the gauges are read from its state when published):
    one table, by (key of `COUNTED`, the label's value, or "" for a metric without one)."""

    table: dict[tuple[str, str], float] = field(default_factory=dict)

    def add(self, key: str, amount: float = 1, label: str = "") -> None:
        self.table[key, label] = self.table.get((key, label), 0) + amount

    def values(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            key: dict(value) if isinstance(value, dict) else value for key, value in COUNTED.items()
        }
        for (key, label), n in self.table.items():
            if label:
                out[key][label] = n
            else:
                out[key] += n
        return out


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render(values: dict[str, Any]) -> str:
    """The Prometheus text exposition (version 0.0.4) of a ``metrics`` section of ``status``."""
    lines: list[str] = []
    for key, (name, kind, label, text) in METRICS.items():
        value = values.get(key)
        if value is None:
            continue
        sample = f"{name}_total" if kind == "counter" else name
        lines.append(f"# HELP {name} {text}")
        lines.append(f"# TYPE {name} {kind}")
        if label is None:
            lines.append(f"{sample} {float(value)!r}")
        else:
            for lv, v in sorted(value.items()):
                lines.append(f'{sample}{{{label}="{_escape(str(lv))}"}} {float(v)!r}')
    return "\n".join(lines) + "\n"


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``:PORT`` or ``PORT`` (host 127.0.0.1) as (host, port).

    Raises:
        ValueError: Naming what is wrong with `text`.
    """
    host, sep, port = text.rpartition(":")
    host = host.strip("[]") if sep else ""
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"--metrics {text!r}: expected HOST:PORT (a port number after the colon)") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"--metrics {text!r}: port {number} is out of range")
    return host or "127.0.0.1", number


def _read_head(sock: socket.socket, deadline: float) -> bytes:
    """A request's head (up to its blank line), read by `deadline`; b"" if it did not all come by then."""
    head = b""
    while b"\r\n\r\n" not in head and b"\n\n" not in head:
        left = deadline - time.monotonic()
        if left <= 0 or len(head) > MAX_REQUEST_HEAD:
            return b""
        sock.settimeout(left)
        try:
            chunk = sock.recv(4096)
        except OSError:  # the deadline passed in the read, or the client reset
            return b""
        if not chunk:
            return b""
        head += chunk
    return head


class _ScrapeServer(http.server.ThreadingHTTPServer):
    """An HTTP server of at most `max_scrapes` connections at once (each on its own thread); more are turned away."""

    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[http.server.BaseHTTPRequestHandler],
        max_scrapes: int,
    ) -> None:
        self._slots = threading.BoundedSemaphore(max_scrapes)
        if ":" in address[0]:  # an IPv6 address ("[::1]:9464" as parse_address gives it)
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            # Answered here, on the accepting thread, without waiting: a full socket buffer (a
            # client that reads nothing) only loses it the 503.
            with contextlib.suppress(OSError):
                request.setblocking(False)
                request.send(_TURNED_AWAY)
            self.close_request(request)
            return
        super().process_request(request, client_address)  # a thread that fails to start: shutdown_request

    def shutdown_request(self, request: Any) -> None:
        # Called once for every request process_request took a slot for (served, or failed).
        # The slot is free before the close: a client that sees its connection end finds it free.
        self._slots.release()
        super().shutdown_request(request)

    def handle_error(self, _request: Any, client_address: Any) -> None:
        # A scraper that went away mid-reply is no traceback on the daemon's stderr.
        log.debug("metrics request from %s failed: %s", client_address, sys.exc_info()[1])


class Exporter:
    """Serves the last published metrics over HTTP and/or writes them to a textfile, from its own threads.

    Args:
        address: (host, port) to serve ``GET /metrics`` on, or None.
        textfile: A file for node_exporter's textfile collector (written by rename), or None.

    Raises:
        DaemonError: The address cannot be listened on, or the textfile's directory does not exist.
    """

    def __init__(self, address: tuple[str, int] | None, textfile: Path | None) -> None:
        if textfile is not None and not textfile.parent.is_dir():
            msg = f"--metrics-file {textfile}: its directory does not exist; create it or name another"
            raise DaemonError(msg)
        self.textfile = textfile
        self._text = b""
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._started = False
        self._httpd: _ScrapeServer | None = None
        if address is not None:
            try:
                self._httpd = _ScrapeServer(address, self._handler(), MAX_SCRAPES)
            except OSError as e:
                msg = f"--metrics {address[0]}:{address[1]}: cannot listen there ({e.strerror or e})"
                raise DaemonError(msg) from None
            self._threads.append(
                threading.Thread(target=self._httpd.serve_forever, name="smstore-metrics-http", daemon=True)
            )
        if textfile is not None:
            self._threads.append(
                threading.Thread(target=self._write_loop, name="smstore-metrics-file", daemon=True)
            )

    @property
    def url(self) -> str | None:
        """Where the metrics are served (the port the system chose for port 0), or None."""
        if self._httpd is None:
            return None
        host, port = self._httpd.server_address[:2]
        host = f"[{host!s}]" if ":" in str(host) else str(host)
        return f"http://{host}:{port}/metrics"

    def start(self) -> None:
        self._started = True
        for t in self._threads:
            t.start()
        if self.url:
            log.info("metrics at %s", self.url)

    def publish(self, values: dict[str, Any]) -> None:
        """Render `values` (on the caller's thread): the threads serve this text from now on."""
        self._text = render(values).encode()  # one reference swapped: readers see old or new, whole
        self._changed.set()

    def stop(self) -> None:
        self._stop.set()
        self._changed.set()
        if self._httpd is not None:
            if self._started:  # shutdown() waits for serve_forever, which only start() runs
                self._httpd.shutdown()
            self._httpd.server_close()
        if not self._started:
            return
        for t in self._threads:
            t.join(timeout=5)
        if self.textfile is not None and self._text:
            self._write()  # the last figures, for a collector that reads it after we stopped

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        exporter = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def setup(self) -> None:
                super().setup()
                # One deadline for the whole exchange: the head is read here, by it (the parser
                # then reads it from memory), and the reply is sent within what is left of it.
                deadline = time.monotonic() + SCRAPE_SECONDS
                self.rfile = io.BytesIO(_read_head(self.connection, deadline))
                self.connection.settimeout(max(deadline - time.monotonic(), 0.001))

            def do_GET(self) -> None:
                if self.path.split("?")[0] not in ("/", "/metrics"):
                    self.send_error(404, "the metrics are at /metrics")
                    return
                body = exporter._text
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # a scrape every few seconds is not worth a log line

        return Handler

    def _write_loop(self) -> None:
        while not self._stop.is_set():
            self._changed.wait()
            if self._stop.is_set():
                return
            self._changed.clear()
            self._write()
            self._stop.wait(TEXTFILE_PERIOD)

    def _write(self) -> None:
        """Write the textfile whole: a temporary file in its directory, then a rename over it."""
        assert self.textfile is not None
        try:
            # mkstemp opens with O_CREAT | O_EXCL | O_NOFOLLOW: a new file of ours, never a link's target.
            fd, tmp = tempfile.mkstemp(prefix=f".{self.textfile.name}.", dir=self.textfile.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    # Through the descriptor, never the name: whatever was put at `tmp` since (a
                    # link to another file of the daemon's user) is not made world-readable.
                    os.fchmod(f.fileno(), 0o644)
                    f.write(self._text)
                os.replace(tmp, self.textfile)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as e:
            log.error("cannot write the metrics file %s: %s", self.textfile, e)
