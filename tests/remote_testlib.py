"""A real S3 API server for the remote tests (moto's, on a free port) and a proxy that injects faults."""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import boto3
from moto.server import ThreadedMotoServer
from smstore_testlib import sharded

BUCKET = "smstore-test"
SECRET = "s3cr3t-never-shown-0f9e8d7c"  # a test asserts it never appears in errors or logs

logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request otherwise

# Faults the proxy can inject, each on one request it would otherwise forward:
#   reset  - close the connection with a TCP RST before answering
#   cut    - forward, send the headers and half the body, then RST
#   500    - answer 500 InternalError;  503 - SlowDown;  429 - TooManyRequests
#   403    - answer 403 AccessDenied (not retryable)
#   stall  - read the request, answer nothing until released or the proxy stops (or the client's timeout ends it)
FAULTS = ("reset", "cut", "500", "503", "429", "403", "stall")

_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


class MotoS3:
    """moto's S3 server in a thread on 127.0.0.1 and a free port; stop() shuts it down."""

    def __init__(self) -> None:
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.port = port
        self.endpoint = f"http://{host}:{port}"

    def stop(self) -> None:
        self.server.stop()


@dataclass
class Seen:
    method: str
    path: str
    range: str | None
    fault: str | None


@dataclass
class FaultProxy:
    """Forwards HTTP to `upstream_port`; requests for which `matches` is true take the next fault queued."""

    upstream_port: int
    faults: list[str] = field(default_factory=list)
    matches: Callable[[str, str, dict[str, str]], bool] = lambda method, path, headers: True
    seen: list[Seen] = field(default_factory=list)
    stalled: threading.Event = field(default_factory=threading.Event)  # set when a request stalls
    answered: list[Seen] = field(default_factory=list)  # requests whose whole answer was sent, in order
    _stop: threading.Event = field(default_factory=threading.Event)
    _release: threading.Event = field(default_factory=threading.Event)  # ends the stalls
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                proxy._serve(self)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def inject(self, *faults: str, matches: Callable[[str, str, dict[str, str]], bool] | None = None) -> None:
        assert all(f in FAULTS for f in faults), faults
        with self._lock:
            self.faults = list(faults)
            if matches is not None:
                self.matches = matches

    def hold_stalls(self) -> None:
        """Stall the requests given the "stall" fault from now on (until :meth:`release`)."""
        self._release.clear()

    def release(self) -> None:
        """End the requests stalled now and later (each is reset, as a timeout would end it)."""
        self._release.set()

    def stop(self) -> None:
        self._stop.set()
        self._release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join()

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        headers = dict(h.headers.items())
        with self._lock:
            fault = None
            # `matches` sees every request (a test may act on one), and takes the next fault queued.
            if self.matches(h.command, h.path, {k.lower(): v for k, v in headers.items()}) and self.faults:
                fault = self.faults.pop(0)
            self.seen.append(Seen(h.command, h.path, h.headers.get("Range"), fault))
        h.close_connection = True
        if fault == "reset":
            _reset(h.connection)
            return
        if fault == "stall":
            self.stalled.set()
            self._release.wait(300)
            _reset(h.connection)
            return
        if fault in ("500", "503", "429", "403"):
            code, name = {
                "500": (500, "InternalError"),
                "503": (503, "SlowDown"),
                "429": (429, "TooManyRequests"),
                "403": (403, "AccessDenied"),
            }[fault]
            payload = (
                f"<?xml version='1.0'?><Error><Code>{name}</Code><Message>injected</Message></Error>".encode()
            )
            h.send_response(code)
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(payload)))
            h.send_header("Connection", "close")
            h.end_headers()
            if h.command != "HEAD":
                h.wfile.write(payload)
            return
        conn = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=60)
        try:
            conn.request(
                h.command,
                h.path,
                body=body,
                headers={k: v for k, v in headers.items() if k.lower() not in _HOP},
            )
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        h.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in _HOP and k.lower() != "content-length":
                h.send_header(k, v)
        h.send_header(
            "Content-Length", str(len(data)) if h.command != "HEAD" else resp.getheader("Content-Length", "0")
        )
        h.send_header("Connection", "close")
        h.end_headers()
        if h.command == "HEAD":
            return
        if fault == "cut":
            h.wfile.write(data[: len(data) // 2])
            h.wfile.flush()
            _reset(h.connection)
            return
        h.wfile.write(data)
        h.wfile.flush()
        with self._lock:
            self.answered.append(Seen(h.command, h.path, h.headers.get("Range"), None))


def _reset(sock: socket.socket) -> None:
    """Close `sock` so that the peer sees a connection reset (RST), not an orderly end."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


class S3:
    def __init__(self, moto: MotoS3, proxy: FaultProxy) -> None:
        self.moto, self.proxy = moto, proxy
        self.client = boto3.client("s3", endpoint_url=moto.endpoint)  # straight to moto: no faults

    def url(self, key: str) -> str:
        return f"s3://{BUCKET}/{key}"

    def put(self, key: str, data: bytes) -> str:
        self.client.put_object(Bucket=BUCKET, Key=key, Body=data)
        return self.url(key)

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=BUCKET, Key=key)["Body"].read()  # type: ignore[no-any-return]

    def object_keys(self) -> list[str]:
        return [o["Key"] for o in self.client.list_objects_v2(Bucket=BUCKET).get("Contents", [])]

    def multipart_uploads(self) -> list[dict[str, object]]:
        return self.client.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])  # type: ignore[no-any-return]


def bucket_dataset(s3: S3, tmp_path: Path, prefix: str, shards: int = 3) -> tuple[str, list[bytes], Path]:
    """A sharded dataset published whole under ``s3://BUCKET/prefix/`` (its manifest names its
    shards relative to that prefix, as ``smstore pack -o s3://...`` writes it).

    Returns the dataset's URL (the prefix), its records, and the local copy it was packed into.
    """
    records = [b"%06d %s" % (i, b"y" * (i % 89)) for i in range(2500)]
    local = sharded(
        tmp_path, records, shard_size=sum(len(r) + 1 for r in records) // shards + 1, name=f"{prefix}-local"
    )
    for name in os.listdir(local):
        s3.put(f"{prefix}/{name}", (local / name).read_bytes())
    return s3.url(f"{prefix}/"), records, local


def remote_dataset(
    s3: S3, tmp_path: Path, prefix: str, shards: int = 3
) -> tuple[Path, list[bytes], list[str]]:
    """A sharded dataset whose shards are in the bucket and whose manifest (local) names them by URL.

    Returns the manifest's path, each shard's bytes and checksum.
    """
    records = [b"%06d %s" % (i, b"x" * (i % 97)) for i in range(3000)]
    local = sharded(
        tmp_path, records, shard_size=sum(len(r) + 1 for r in records) // shards + 1, name=f"{prefix}-local"
    )
    doc = json.loads((local / "manifest.json").read_text())
    data, checksums = [], []
    for entry in doc["shards"]:
        blob = (local / entry["path"]).read_bytes()
        entry["path"] = s3.put(f"{prefix}/{entry['path']}", blob)
        data.append(blob)
        checksums.append(entry["checksum"])
    assert len(data) == shards
    remote = tmp_path / f"{prefix}-remote"
    remote.mkdir()
    (remote / "manifest.json").write_text(json.dumps(doc))
    return remote / "manifest.json", data, checksums
