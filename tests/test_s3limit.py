"""benchmarks/_s3limit.py, the benchmarks' S3 server: ranges byte-exact through smstore's fetch, errors, counters."""

from __future__ import annotations

import http.client
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("obstore", reason="the remote extra (obstore) is not installed")

from smstore_testlib import AWKWARD

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # last: smstore comes from the installed package, benchmarks from here

import smstore
from benchmarks._s3limit import S3Limit, server_stats
from smstore import _core
from smstore.errors import ChecksumMismatchError, StoreNotFoundError
from smstore.remote import Retry, fetch, object_size

BUCKET = "bench-bucket"
FAST = Retry(attempts=2, base_delay=0.005, max_delay=0.01, timeout=30.0)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[S3Limit]:
    (tmp_path / "root" / BUCKET).mkdir(parents=True)
    s = S3Limit(tmp_path / "root", conn_rate=400e6, total_rate=800e6, latency=0.001).start()
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": s.endpoint,
            "AWS_ALLOW_HTTP": "true",
        }.items():
            mp.setenv(k, v)
        for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
            mp.delenv(k, raising=False)
        try:
            yield s
        finally:
            s.stop()


def test_ranged_fetch_is_byte_exact_and_reads_each_byte_once(server: S3Limit, tmp_path: Path) -> None:
    path = server.root / BUCKET / "blob.smst"
    records = [os.urandom(n) for n in (0, 1, 1 << 20, 3 << 20, 77_777)] + list(AWKWARD)
    smstore.pack(records * 3, path)
    data = path.read_bytes()
    checksum = _core.peek_checksum(str(path)) or ""
    url = f"s3://{BUCKET}/blob.smst"
    assert object_size(url) == len(data)
    buf = bytearray(len(data))
    result = fetch(url, buf, size=len(data), checksum=checksum, chunk_size=1 << 20, concurrency=4, retry=FAST)
    assert bytes(buf) == data
    ranges = [r for m, _, r in server.requests if m == "GET"]
    assert len(ranges) == result.requests > 3
    assert all(r is not None and r.startswith("bytes=") for r in ranges)
    # Every range read only its own bytes: the body bytes sent are the object's, once.
    assert server_stats(server.endpoint) == {
        "bytes_sent": len(data),
        "blob_bytes_sent": len(data),  # a blob (*.smst): counted apart from other objects too
        "requests": len(server.requests),
    }


def test_a_missing_object_a_changed_one_and_bad_requests_are_refused(server: S3Limit) -> None:
    with pytest.raises(StoreNotFoundError, match=f"s3://{BUCKET}/nope.smst"):
        object_size(f"s3://{BUCKET}/nope.smst")
    path = server.root / BUCKET / "b.smst"
    smstore.pack([b"a" * 1000] * 3000, path)
    size = path.stat().st_size
    checksum = _core.peek_checksum(str(path)) or ""
    smstore.pack([b"b" * 1000] * 3000, path.with_name("other.smst"))
    os.replace(path.with_name("other.smst"), path)  # the same size, other bytes
    with pytest.raises(ChecksumMismatchError, match=r"b\.smst"):
        fetch(f"s3://{BUCKET}/b.smst", bytearray(size), size=size, checksum=checksum, retry=FAST)
    host, port = server.endpoint.removeprefix("http://").split(":")
    for headers, status in (
        ({"If-Match": '"not-the-etag"'}, 412),
        ({"Range": f"bytes={size}-"}, 416),
        ({"Range": "bytes=10-19"}, 206),
    ):
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            conn.request("GET", f"/{BUCKET}/b.smst", headers=headers)
            reply = conn.getresponse()
            body = reply.read()
        finally:
            conn.close()
        assert reply.status == status, headers
        if status == 206:
            assert body == path.read_bytes()[10:20]
            assert reply.getheader("Content-Range") == f"bytes 10-19/{size}"
