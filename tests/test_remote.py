"""smstore.remote against a real S3 API server (moto's, started here) behind a fault-injecting proxy."""

from __future__ import annotations

import errno
import fcntl
import grp
import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import xxhash

pytest.importorskip("obstore", reason="the remote extra (obstore) is not installed")
pytest.importorskip("boto3", reason="the remote extra (boto3) is not installed")
pytest.importorskip("moto.server", reason="moto[server] is not installed")

import daemon_testlib as tl
from daemon_testlib import Daemon, as_user, public_rundir
from remote_testlib import BUCKET, S3, SECRET, FaultProxy, remote_dataset
from smstore_testlib import outcome_past_a_fifo, read_records, run_ranks, windowed_rank

import smstore
from smstore import _core
from smstore.errors import (
    ChecksumMismatchError,
    RemoteError,
    RemoteNotFoundError,
    RemoteURLError,
    StoreClosedError,
    StoreError,
    StoreIOError,
)
from smstore.remote import CacheStats, NodeCache, Retry, fetch, parse_url, publish_remote_dataset, upload

CHUNK = 256 << 10  # small ranges, so a blob of a few MiB takes many
FAST = Retry(attempts=4, base_delay=0.005, max_delay=0.02, timeout=30.0)


# --- URLs -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "fault"),
    [
        ("file:///etc/passwd", "scheme 'file' is not allowed"),
        ("http://example.com/a", "scheme 'http' is not allowed"),
        ("S3://bucket/a", "scheme 'S3' is not allowed"),
        ("memory:///a", "scheme 'memory' is not allowed"),
        ("/local/path", "not a URL"),
        ("s3://user:pass@bucket/a", "userinfo"),
        ("https://user@host.example/a", "userinfo"),
        ("s3://bucket/a?X-Amz-Signature=abc", "query"),
        ("https://host.example/a#frag", "query or fragment"),
        ("s3://bucket/a\nb", "control character"),
        ("s3://bucket/a\x00", "control character"),
        ("s3://bucket/a b", "control character"),
        ("s3://bucket/caf\u00e9", "non-ASCII"),
        ("s3://bucket/a/../b", "'..'"),
        ("s3://bucket//a", "empty"),
        ("s3://bucket/", "names no object"),
        ("s3://Bucket/a", "bad bucket"),
        ("s3://b/a", "bad bucket"),
        ("gs://bu..cket/a", "bad bucket"),
        ("s3://" + "a" * 3000, "longer than"),
    ],
)
def test_bad_urls_are_refused_naming_the_url(url: str, fault: str) -> None:
    with pytest.raises(RemoteURLError, match=re.escape(fault)) as info:
        parse_url(url)
    msg = str(info.value)
    assert isinstance(info.value, StoreError)
    shown = re.split(r"[?#]", url, maxsplit=1)[0]
    if "@" in shown:  # userinfo is redacted
        shown = shown.split("://", 1)[0] + "://***@" + shown.rsplit("@", 1)[1]
    assert msg.startswith(repr(shown[:30])[:-1])  # names the URL, control characters escaped
    assert "X-Amz-Signature" not in msg  # a query (where a token would be) is never echoed
    assert "user:pass@bucket" not in msg


@pytest.mark.parametrize(
    "url",
    [
        "s3://AKIAXXXX:SeCrEt@bucket/key",
        "s3://AKIAXXXX:SeCrEt@bucket/key?x=1",
        "https://AKIAXXXX:SeCrEt@host.example/a",
        "gs://SeCrEt@bucket/a/../b",
        "s3://AKIAXXXX:SeC/rEt@bucket/key",  # a secret holding '/' ends the host early
        "s3://AKIAXXXX:SeCrEt@Bad_Bucket/key",
        "s3://AKIAXXXX:SeCrEt@bucket/a\nb",
        "s3://" + "A" * 190 + ":SeCrEt@bucket/key",  # the secret straddles the 200-character cut
        "s3://AKIAXXXX:SeCrEt@bucket/" + "k" * 3000,
    ],
)
def test_a_secret_in_a_url_never_appears_in_the_error(url: str) -> None:
    with pytest.raises(RemoteURLError) as info:
        parse_url(url)
    for text in (str(info.value), repr(info.value), str(info.value.args)):
        assert "SeC" not in text, text
        assert "rEt" not in text, text
    assert "***@" in str(info.value)


def test_good_urls_parse() -> None:
    assert parse_url("s3://my-bucket/ds/shard-000.smst") == smstore.remote.RemoteURL(
        "s3", "my-bucket", "ds/shard-000.smst"
    )
    assert str(parse_url("gs://b.example.com/x")) == "gs://b.example.com/x"
    assert parse_url("az://container/a/b").key == "a/b"
    assert parse_url("https://host.example:8443/data/x.smst").bucket == "host.example:8443"
    prefix = parse_url("s3://my-bucket/ds", prefix=True)
    assert prefix.key == "ds/"
    assert str(prefix.join("shard-000.smst")) == "s3://my-bucket/ds/shard-000.smst"
    with pytest.raises(RemoteURLError, match="not a prefix"):
        parse_url("s3://my-bucket/ds/x").join("y")


# --- the incremental checksum --------------------------------------------------------------------


def test_blob_hasher_follows_the_format_rule_in_any_chunking(tmp_path: Path) -> None:
    path = tmp_path / "a.smst"
    smstore.pack([os.urandom(n) for n in range(0, 20_000, 37)], path)
    blob = path.read_bytes()
    header = bytearray(blob[:4096])
    header[96:104] = bytes(8)
    want = xxhash.xxh64(blob[4096:] + bytes(header)).hexdigest()
    assert want == _core.peek_checksum(str(path))
    for step in (1, 7, 4096, 100_000, len(blob)):
        h = _core.BlobHasher()
        for at in range(4096, len(blob), step):
            h.update(memoryview(blob)[at : at + step])
        assert h.fed == len(blob) - 4096
        assert h.finish(blob[:4096]) == want  # the stored checksum field is ignored, as the rule says
    h = _core.BlobHasher()
    with pytest.raises(ValueError, match="4096-byte header"):
        h.finish(b"short")
    h.finish(blob[:4096])
    with pytest.raises(StoreClosedError, match="finished"):
        h.update(b"more")
    with pytest.raises(StoreClosedError, match="finished"):
        h.finish(blob[:4096])


def test_blob_hasher_fed_is_read_consistently_while_threads_update() -> None:
    """fed is read under the hasher's mutex while update() runs without the GIL in other threads.

    On x86 an unlocked read shows no torn value either: the race was a data race by the C++ memory
    model (what ThreadSanitizer reports), so this checks only what a locked read promises.
    """
    chunk = bytes(1 << 20)
    threads, rounds = 4, 16
    h = _core.BlobHasher()
    start = threading.Barrier(threads + 1)

    def feed() -> None:
        start.wait()
        for _ in range(rounds):
            h.update(chunk)

    workers = [threading.Thread(target=feed) for _ in range(threads)]
    for w in workers:
        w.start()
    start.wait()
    seen = []
    while any(w.is_alive() for w in workers):
        seen.append(h.fed)
    for w in workers:
        w.join()
    seen.append(h.fed)
    assert all(v % len(chunk) == 0 for v in seen)  # never mid-chunk
    assert seen == sorted(seen)
    assert seen[-1] == threads * rounds * len(chunk)


# --- a real S3 server -----------------------------------------------------------------------------


def make_blob(path: Path, mib: float, seed: int = 0) -> tuple[bytes, str]:
    """A blob of about `mib` MiB of awkward records; its bytes and checksum."""
    rng = __import__("random").Random(seed)
    n = int(mib * (1 << 20)) // 40_000 + 1
    smstore.pack([rng.randbytes(rng.randrange(0, 80_000)) for _ in range(n)] + [b"", b"\x00\r\n\xff"], path)
    blob = path.read_bytes()
    return blob, _core.peek_checksum(str(path)) or ""


@pytest.fixture(scope="module")
def blob(s3: S3, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, bytes, str]:
    """One blob of ~3 MiB in the bucket: url, bytes, checksum."""
    data, checksum = make_blob(tmp_path_factory.mktemp("blob") / "b.smst", 3)
    return s3.put("blob/b.smst", data), data, checksum


def ranged_gets(proxy: FaultProxy) -> list[str]:
    return [s.range or "" for s in proxy.seen if s.method == "GET" and s.range]


# --- fetch ----------------------------------------------------------------------------------------


def test_fetch_round_trip_byte_exact_into_a_buffer_and_a_file(
    s3: S3, proxy: FaultProxy, blob: tuple[str, bytes, str], tmp_path: Path
) -> None:
    url, data, checksum = blob
    buf = bytearray(len(data))
    res = fetch(url, buf, size=len(data), checksum=checksum, chunk_size=CHUNK, concurrency=4, retry=FAST)
    assert bytes(buf) == data
    chunks = -(-len(data) // CHUNK)
    assert (res.bytes, res.requests, res.retries) == (len(data), chunks, 0)
    assert sorted(ranged_gets(proxy)) == sorted(
        f"bytes={i * CHUNK}-{min(len(data), (i + 1) * CHUNK) - 1}" for i in range(chunks)
    )
    out = tmp_path / "copy.smst"
    fd = os.open(out, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fetch(url, fd, size=len(data), checksum=checksum, chunk_size=CHUNK, concurrency=3, retry=FAST)
    finally:
        os.close(fd)
    assert out.read_bytes() == data
    with smstore.open(out, verify=True) as st:
        assert len(st) > 0


def test_checksum_mismatch_is_a_clear_error(s3: S3, proxy: FaultProxy, blob: tuple[str, bytes, str]) -> None:
    url, data, checksum = blob
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0x01  # one bit in the records: the header still claims the old checksum
    bad_url = s3.put("blob/flipped.smst", bytes(bad))
    with pytest.raises(ChecksumMismatchError, match=rf"{bad_url}: checksum mismatch.*{checksum}"):
        fetch(bad_url, bytearray(len(bad)), size=len(bad), checksum=checksum, chunk_size=CHUNK, retry=FAST)
    other = "0123456789abcdef"
    with pytest.raises(ChecksumMismatchError, match=rf"{url}: checksum mismatch: the manifest says {other}"):
        fetch(url, bytearray(len(data)), size=len(data), checksum=other, chunk_size=CHUNK, retry=FAST)


def test_a_wrong_size_is_refused_before_any_range(
    s3: S3, proxy: FaultProxy, blob: tuple[str, bytes, str]
) -> None:
    url, data, checksum = blob
    with pytest.raises(
        smstore.StoreTruncatedError, match=rf"{url}: the object holds {len(data)} bytes, the manifest says"
    ):
        fetch(url, bytearray(len(data) + 1), size=len(data) + 1, checksum=checksum, retry=FAST)
    with pytest.raises(smstore.StoreFormatError, match="another object"):
        fetch(url, bytearray(len(data)), size=len(data) - 1, checksum=checksum, retry=FAST)
    assert ranged_gets(proxy) == []


@pytest.mark.parametrize("fault", ["reset", "cut", "500", "503", "429", "stall"])
def test_retryable_failures_are_retried_then_succeed(
    s3: S3, proxy: FaultProxy, blob: tuple[str, bytes, str], fault: str
) -> None:
    url, data, checksum = blob
    proxy.inject(fault, fault, matches=lambda method, path, headers: method == "GET" and "range" in headers)
    retry = Retry(attempts=4, base_delay=0.005, max_delay=0.02, timeout=1.0 if fault == "stall" else 30.0)
    buf = bytearray(len(data))
    res = fetch(url, buf, size=len(data), checksum=checksum, chunk_size=CHUNK, concurrency=2, retry=retry)
    assert bytes(buf) == data
    assert res.retries == 2
    assert [s.fault for s in proxy.seen if s.fault] == [fault, fault]
    assert proxy.faults == []


def test_retries_give_up_with_a_clear_error(s3: S3, proxy: FaultProxy, blob: tuple[str, bytes, str]) -> None:
    url, data, checksum = blob
    proxy.inject(*["500"] * 4, matches=lambda method, path, headers: method == "GET" and "range" in headers)
    with pytest.raises(RemoteError, match=rf"{url}: request failed after 4 tries: .*500") as info:
        fetch(
            url,
            bytearray(len(data)),
            size=len(data),
            checksum=checksum,
            chunk_size=CHUNK,
            concurrency=1,
            retry=FAST,
        )
    assert SECRET not in str(info.value)


def test_non_retryable_errors_fail_at_once_naming_the_object(
    s3: S3, proxy: FaultProxy, blob: tuple[str, bytes, str]
) -> None:
    url, data, checksum = blob
    proxy.inject("403", matches=lambda method, path, headers: method == "GET" and "range" in headers)
    with pytest.raises(RemoteError, match=rf"{url}: request failed: PermissionDeniedError.*403") as info:
        fetch(
            url,
            bytearray(len(data)),
            size=len(data),
            checksum=checksum,
            chunk_size=CHUNK,
            concurrency=1,
            retry=FAST,
        )
    assert [s.fault for s in proxy.seen if s.fault] == ["403"]
    # The one failed range is not tried again, and with one range in flight no other is started.
    assert len(ranged_gets(proxy)) == 1
    assert SECRET not in str(info.value)
    assert SECRET not in repr(info.value)
    missing = s3.url("blob/missing.smst")
    with pytest.raises(RemoteNotFoundError, match=rf"{missing}: no such object"):
        fetch(missing, bytearray(8192), size=8192, checksum=checksum, retry=FAST)


# --- the node cache -------------------------------------------------------------------------------


def test_cache_keeps_lru_entries_within_its_limit_across_restarts(
    s3: S3, proxy: FaultProxy, tmp_path: Path
) -> None:
    blobs = {}
    for name in "abc":
        data, checksum = make_blob(tmp_path / f"{name}.smst", 1, seed=ord(name))
        blobs[name] = (s3.put(f"lru/{name}.smst", data), data, checksum)
    sizes = [len(d) for _, d, _ in blobs.values()]
    limit = sizes[0] + sizes[1] + max(sizes) // 2  # room for two entries, not three
    cache_dir = tmp_path / "cache"
    cache = NodeCache(cache_dir, limit)

    def get(c: NodeCache, name: str) -> tuple[str, bool]:
        url, data, checksum = blobs[name]
        before = c.stats.fetches
        path = c.get(url, checksum=checksum, size=len(data), chunk_size=CHUNK, retry=FAST)
        assert Path(path).read_bytes() == data
        return path, c.stats.fetches > before

    assert get(cache, "a")[1]
    assert get(cache, "b")[1]
    assert not get(cache, "a")[1]  # cached; a is now the most recently used
    before = len(proxy.seen)
    _, fetched = get(cache, "c")
    assert fetched
    assert cache.total_bytes() <= limit
    kept = {Path(e.path).read_bytes() for e in cache.entries()}
    assert kept == {blobs["a"][1], blobs["c"][1]}  # b, the least recently used, went
    # b's lock file went with it; the others' stay.
    assert sorted(os.listdir(cache_dir / "locks")) == sorted(
        ["cache.lock", *(f"entry-{Path(e.path).stem}.lock" for e in cache.entries())]
    )
    # The cache is its user's: directories 0700, entries 0600.
    for d in (cache_dir, cache_dir / "entries", cache_dir / "locks"):
        assert d.stat().st_mode & 0o777 == 0o700, d
    for e in cache.entries():
        assert os.stat(e.path).st_mode & 0o777 == 0o600, e.path
    # A new cache on the same directory (a restart) serves what is there without a request.
    again = NodeCache(cache_dir, limit)
    seen = len(proxy.seen)
    assert not get(again, "a")[1]
    assert not get(again, "c")[1]
    assert len(proxy.seen) == seen
    assert seen > before
    with pytest.raises(StoreError, match="does not fit the node cache's limit"):
        NodeCache(tmp_path / "tiny", 4096).get(blobs["a"][0], checksum=blobs["a"][2], size=len(blobs["a"][1]))


EVICTING_CHILD = textwrap.dedent(
    """
    import sys
    from smstore.remote import NodeCache
    NodeCache(sys.argv[1], int(sys.argv[2])).get(sys.argv[3], checksum=sys.argv[4], size=int(sys.argv[5]))
    """
)


def test_get_fd_hands_over_the_entry_it_verified_whatever_another_process_evicts(
    s3: S3, proxy: FaultProxy, tmp_path: Path
) -> None:
    """get()'s path could be evicted by another process before the caller opened it (the reader
    then failed, or read a newer entry); get_fd() hands over the file it checked, open."""
    blobs = {}
    for name in "ab":
        data, checksum = make_blob(tmp_path / f"{name}.smst", 1, seed=ord(name))
        blobs[name] = (s3.put(f"fd/{name}.smst", data), data, checksum)
    limit = max(len(d) for _, d, _ in blobs.values()) * 3 // 2  # room for one entry, not two
    cache_dir = tmp_path / "cache"
    cache = NodeCache(cache_dir, limit)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    def evict_by_fetching(name: str) -> None:
        url, data, checksum = blobs[name]
        args = [str(cache_dir), str(limit), url, checksum, str(len(data))]
        subprocess.run([sys.executable, "-c", EVICTING_CHILD, *args], env=env, check=True, timeout=120)

    url, data, checksum = blobs["a"]

    def read_after_eviction(fd: int) -> bytes:
        try:
            evict_by_fetching("b")  # another process needs the room: a's entry goes
            assert not os.path.exists(cache.path_of(url, checksum))
            with pytest.raises(OSError, match="Bad file descriptor"):
                os.write(fd, b"x")  # read-only
            return os.pread(fd, len(data) + 1, 0)
        finally:
            os.close(fd)

    assert read_after_eviction(cache.get_fd(url, checksum=checksum, size=len(data), retry=FAST)) == data
    assert cache.stats.fetches == 1  # the descriptor of a fresh fetch
    assert Path(cache.get(url, checksum=checksum, size=len(data), retry=FAST)).read_bytes() == data
    assert cache.stats.fetches == 2  # a, fetched again
    assert read_after_eviction(cache.get_fd(url, checksum=checksum, size=len(data), retry=FAST)) == data
    assert cache.stats.fetches == 2  # the descriptor of an entry found cached
    # get() still gives the path (here: of the entry evict_by_fetching left).
    url, data, checksum = blobs["b"]
    assert Path(cache.get(url, checksum=checksum, size=len(data), retry=FAST)).read_bytes() == data


def test_cache_checks_an_entry_before_use_and_caches_nothing_bad(
    s3: S3, proxy: FaultProxy, blob: tuple[str, bytes, str], tmp_path: Path
) -> None:
    url, data, checksum = blob
    cache = NodeCache(tmp_path / "cache", 64 << 20)
    with pytest.raises(ChecksumMismatchError):
        cache.get(url, checksum="0123456789abcdef", size=len(data), chunk_size=CHUNK, retry=FAST)
    assert cache.entries() == []
    assert os.listdir(tmp_path / "cache" / "entries") == []
    path = cache.get(url, checksum=checksum, size=len(data), chunk_size=CHUNK, retry=FAST)
    # A damaged entry (its header's checksum field rewritten) is dropped and fetched again.
    with open(path, "r+b") as f:
        f.seek(96)
        f.write(b"\xff" * 8)
    path2 = cache.get(url, checksum=checksum, size=len(data), chunk_size=CHUNK, retry=FAST)
    assert cache.stats.fetches == 2
    assert path2 == path
    assert Path(path).read_bytes() == data
    os.truncate(path, len(data) - 1)  # a truncated entry: the header's own checks refuse it
    cache.get(url, checksum=checksum, size=len(data), chunk_size=CHUNK, retry=FAST)
    assert cache.stats.fetches == 3
    assert Path(path).read_bytes() == data
    cache.get(url, checksum=checksum, size=len(data), chunk_size=CHUNK, retry=FAST)
    assert cache.stats == CacheStats(
        hits=1, fetches=3, bytes_fetched=3 * len(data), retries=0
    )  # served as it is


def test_a_read_only_cache_serves_its_entries_and_refuses_a_fetch_naming_its_directory(
    s3: S3, blob: tuple[str, bytes, str], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url, data, checksum = blob
    cache_dir = public_rundir(request).parent / "cache"  # tmp_path is private: nobody could not reach it
    path = NodeCache(cache_dir, 64 << 20).get(
        url, checksum=checksum, size=len(data), chunk_size=CHUNK, retry=FAST
    )
    other_data, other_checksum = make_blob(tmp_path / "o.smst", 1, seed=7)
    other = s3.put("ro/other.smst", other_data)
    # Shared read-only: another user may read and search it, not write it.
    for d in (cache_dir, cache_dir / "entries", cache_dir / "locks"):
        d.chmod(0o555)
    os.chmod(path, 0o444)

    def use() -> str:
        warned: list[str] = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda r: warned.append(r.getMessage())  # type: ignore[method-assign]
        logging.getLogger("smstore").addHandler(handler)
        try:
            cache = NodeCache(cache_dir, 64 << 20)
            got = cache.get(url, checksum=checksum, size=len(data), chunk_size=CHUNK, retry=FAST)
            got = cache.get(url, checksum=checksum, size=len(data), chunk_size=CHUNK, retry=FAST)
        finally:
            logging.getLogger("smstore").removeHandler(handler)
        said = [f"hit {got == path} {Path(got).read_bytes() == data} {len(warned)} {warned[:1]}"]
        try:
            cache.get(other, checksum=other_checksum, size=len(other_data), chunk_size=CHUNK, retry=FAST)
        except StoreError as e:
            said.append(f"{type(e).__name__}: {e}")
        return "\n".join(said)

    try:
        # Root writes anywhere: the reader is then uid 65534 (nobody), in a forked child.
        result = as_user(use, []) if os.geteuid() == 0 else use()
    finally:
        for d in (cache_dir, cache_dir / "entries", cache_dir / "locks"):
            d.chmod(0o700)
    hit, refused = result.split("\n")
    assert hit.startswith("hit True True 1 ["), result  # served twice, one warning
    assert "the node cache is not writable by this process" in hit
    assert refused.startswith(f"StoreIOError: {cache_dir}: cannot take the node cache's lock "), result
    assert "writable by the user that fetches into it" in refused
    assert Path(path).read_bytes() == data


CHILD = textwrap.dedent(
    """
    import sys
    from smstore.remote import CacheStats, NodeCache, Retry
    cache = NodeCache(sys.argv[1], 1 << 30)
    cache.get(sys.argv[2], checksum=sys.argv[3], size=int(sys.argv[4]), chunk_size=int(sys.argv[5]),
              concurrency=1, retry=Retry(timeout=120.0))
    """
)


def test_kill_9_mid_fetch_leaves_no_servable_entry(
    s3: S3, proxy: FaultProxy, blob: tuple[str, bytes, str], tmp_path: Path
) -> None:
    url, data, checksum = blob
    cache_dir = tmp_path / "cache"
    third = f"bytes={2 * CHUNK}-"
    proxy.inject("stall", matches=lambda method, path, headers: headers.get("range", "").startswith(third))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(cache_dir), url, checksum, str(len(data)), str(CHUNK)], env=env
    )
    try:
        assert proxy.stalled.wait(120), "the child never reached its third range"
        assert child.poll() is None
        os.kill(child.pid, signal.SIGKILL)  # two ranges written into its file, the third in flight
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    leftovers = os.listdir(cache_dir / "entries")
    assert not [n for n in leftovers if n.endswith(".smst")]
    cache = NodeCache(cache_dir, 1 << 30)  # a restart removes what a dead process left
    assert os.listdir(cache_dir / "entries") == []
    proxy.inject()
    path = cache.get(url, checksum=checksum, size=len(data), chunk_size=CHUNK, retry=FAST)
    assert Path(path).read_bytes() == data


def test_a_part_file_of_a_dead_process_is_removed_and_a_live_ones_kept(tmp_path: Path) -> None:
    cache = NodeCache(tmp_path / "cache", 1 << 20)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    entries = tmp_path / "cache" / "entries"
    orphan = entries / f"{'0' * 16}-{'1' * 16}.smst.{dead.pid}.abcd1234.part"
    mine = entries / f"{'0' * 16}-{'2' * 16}.smst.{os.getpid()}.abcd1234.part"
    orphan.write_bytes(b"half a blob")
    mine.write_bytes(b"in flight")
    NodeCache(tmp_path / "cache", 1 << 20)
    assert sorted(os.listdir(entries)) == [mine.name]
    assert cache.entries() == []


def _plant(cache_dir: Path, where: str, victim: Path) -> Path:
    """Give the cache directory what another user could have made of it; the directory refused."""
    cache_dir.mkdir(mode=0o700)
    if where in ("entries", "locks"):  # a link in a directory others may write (or the owner's own)
        (cache_dir / where).symlink_to(victim)
        return cache_dir / where
    if where == "writable":
        cache_dir.chmod(0o777)
        return cache_dir
    if where == "entries writable":
        (cache_dir / "entries").mkdir()
        (cache_dir / "entries").chmod(0o770)
        return cache_dir / "entries"
    os.chown(cache_dir, 65534, 65534)  # another owner: it may swap what the directory holds
    return cache_dir


@pytest.mark.parametrize(
    ("where", "fault"),
    [
        pytest.param("entries", "a symbolic link or not a directory", id="entries-link"),
        pytest.param("locks", "a symbolic link or not a directory", id="locks-link"),
        pytest.param("writable", "writable by other users (mode 0777)", id="writable"),
        pytest.param("entries writable", "writable by other users (mode 0770)", id="entries-writable"),
        pytest.param(
            "another owner",
            "owned by uid 65534, not by you",
            id="another-owner",
            marks=pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory away"),
        ),
    ],
)
def test_a_cache_directory_another_user_controls_is_refused_and_nothing_outside_it_touched(
    s3: S3, blob: tuple[str, bytes, str], tmp_path: Path, where: str, fault: str
) -> None:
    """An `entries` link planted in a cache another user controls made eviction remove the
    owner's own *.smst files (and a restart their *.part files); a `locks` link made the cache
    create lock files wherever its user may write. Such a directory is refused, as the socket's is."""
    url, data, checksum = blob
    victim = tmp_path / "mine"
    victim.mkdir()
    own = {"model.smst": b"the user's own blob", "upload.part": b"the user's own upload"}
    for name, body in own.items():
        (victim / name).write_bytes(body)
    cache_dir = tmp_path / "cache"
    refused = _plant(cache_dir, where, victim)

    def fetch_into_it() -> None:
        cache = NodeCache(cache_dir, len(data))  # room for one blob: a fetch evicts every other
        cache.get(url, checksum=checksum, size=len(data), chunk_size=CHUNK, retry=FAST)

    with pytest.raises(StoreIOError) as info:
        fetch_into_it()
    assert str(info.value).startswith(f"{refused}: {fault}"), info.value
    assert "refusing to use it for the node cache" in str(info.value)
    assert {p.name: p.read_bytes() for p in victim.iterdir()} == own


def test_serve_refuses_a_cache_dir_other_users_may_write(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    cache_dir.chmod(0o777)
    sock = tmp_path / "s.sock"
    cache_args = ["--cache-dir", os.fspath(cache_dir), "--cache-limit", "1G"]
    res = subprocess.run(
        [sys.executable, "-m", "smstore", "serve", "--socket", os.fspath(sock), *cache_args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 1, res.stderr
    assert (
        f"{cache_dir}: writable by other users (mode 0777); refusing to use it for the node cache"
        in res.stderr
    )
    assert "Traceback" not in res.stderr
    assert os.listdir(cache_dir) == []
    assert not sock.exists()


def test_a_fifo_at_an_entrys_name_is_never_opened_but_fetched_anew(
    s3: S3, blob: tuple[str, bytes, str], tmp_path: Path
) -> None:
    """Opening a FIFO planted at an entry's name waited for a writer forever: the daemon's one
    loader thread with it, so every later load (of local files too) hung."""
    url, data, checksum = blob
    cache = NodeCache(tmp_path / "cache", 64 << 20)
    entry = cache.path_of(url, checksum)
    os.mkfifo(entry)
    fifo = tmp_path / "fifo"
    os.link(entry, fifo)  # to let a blocked open go once the cache removed the name
    got = outcome_past_a_fifo(
        lambda: cache.get(url, checksum=checksum, size=len(data), chunk_size=CHUNK, retry=FAST),
        fifo,
        "the node cache's get",
    )
    assert got == entry, got
    assert Path(entry).read_bytes() == data
    assert cache.stats.fetches == 1  # the FIFO was a bad entry: fetched anew


# --- upload ---------------------------------------------------------------------------------------


# --- upload ---------------------------------------------------------------------------------------


def test_upload_round_trip_single_and_multipart(s3: S3, proxy: FaultProxy, tmp_path: Path) -> None:
    small, _ = make_blob(tmp_path / "small.smst", 0.5, seed=1)
    big, checksum = make_blob(tmp_path / "big.smst", 12, seed=2)
    upload(tmp_path / "small.smst", s3.url("up/small.smst"))
    parts: list[tuple[int, int]] = []
    upload(
        tmp_path / "big.smst",
        s3.url("up/big.smst"),
        part_size=5 << 20,
        on_part=lambda n, t: parts.append((n, t)),
    )
    assert s3.get("up/small.smst") == small
    assert s3.get("up/big.smst") == big
    assert parts == [(1, 3), (2, 3), (3, 3)]
    buf = bytearray(len(big))
    fetch(s3.url("up/big.smst"), buf, size=len(big), checksum=checksum, retry=FAST)
    assert bytes(buf) == big
    assert s3.multipart_uploads() == []
    with pytest.raises(RemoteURLError, match="s3:// only"):
        upload(tmp_path / "small.smst", "gs://bucket/x.smst")


def test_an_interrupted_or_failed_multipart_upload_is_aborted(
    s3: S3, proxy: FaultProxy, tmp_path: Path
) -> None:
    make_blob(tmp_path / "big.smst", 12, seed=3)

    def interrupt(n: int, total: int) -> None:
        if n == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        upload(tmp_path / "big.smst", s3.url("up/interrupted.smst"), part_size=5 << 20, on_part=interrupt)
    assert s3.multipart_uploads() == []
    assert "up/interrupted.smst" not in s3.object_keys()
    proxy.inject("403", matches=lambda method, path, headers: method == "PUT" and "partNumber=2" in path)
    with pytest.raises(
        RemoteError, match=r"s3://smstore-test/up/failed.smst: upload of .* failed:.*AccessDenied"
    ):
        upload(tmp_path / "big.smst", s3.url("up/failed.smst"), part_size=5 << 20)
    assert [s.fault for s in proxy.seen if s.fault] == ["403"]
    assert s3.multipart_uploads() == []
    assert "up/failed.smst" not in s3.object_keys()


def test_publish_uploads_shards_then_the_manifest(s3: S3, proxy: FaultProxy, tmp_path: Path) -> None:
    local = tmp_path / "ds"
    rng = __import__("random").Random(5)
    with smstore.ShardedWriter(local, shard_size=1 << 20) as w:
        w.extend(rng.randbytes(rng.randrange(1, 50_000)) for _ in range(150))
    names = sorted(os.listdir(local))
    assert len(names) > 3
    assert "manifest.json" in names
    manifest_url = publish_remote_dataset(local, s3.url("pub/ds"))
    assert manifest_url == s3.url("pub/ds/manifest.json")
    puts = [s.path for s in proxy.seen if s.method in ("PUT", "POST")]
    assert puts[-1].startswith(f"/{BUCKET}/pub/ds/manifest.json")
    assert all("manifest.json" not in p for p in puts[:-1])
    for name in names:
        assert s3.get(f"pub/ds/{name}") == (local / name).read_bytes()
    # A shard replaced after the manifest was written is refused before anything is uploaded.
    shard = next(n for n in names if n != "manifest.json")
    smstore.pack([b"other"], local / shard)
    proxy.seen.clear()
    with pytest.raises(
        smstore.StoreChangedError, match=f"{shard}: its header's checksum is not the manifest's"
    ):
        publish_remote_dataset(local, s3.url("pub/ds2/"))
    assert [s for s in proxy.seen if s.method in ("PUT", "POST")] == []


def flock_waiters(path: Path) -> int:
    """How many processes wait for a flock on `path` (the `->` lines of /proc/locks for its inode)."""
    ino = os.stat(path).st_ino
    with open("/proc/locks") as f:
        return sum(1 for line in f if "->" in line and line.split()[6].endswith(f":{ino}"))


def test_two_processes_sharing_a_cache_fetch_a_blob_once(
    s3: S3, proxy: FaultProxy, blob: tuple[str, bytes, str], tmp_path: Path
) -> None:
    url, data, checksum = blob
    cache_dir = tmp_path / "cache"
    cache = NodeCache(cache_dir, 1 << 30)
    entry = Path(cache.path_of(url, checksum))
    lock = cache_dir / "locks" / f"entry-{entry.name.removesuffix('.smst')}.lock"
    lock.touch()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    args = [str(cache_dir), url, checksum, str(len(data)), str(CHUNK)]
    fd = os.open(lock, os.O_RDWR)
    children = []
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # both children queue behind the test on the entry's lock
        children = [subprocess.Popen([sys.executable, "-c", CHILD, *args], env=env) for _ in range(2)]
        while flock_waiters(lock) < 2:
            assert all(c.poll() is None for c in children), "a child ended before it reached the lock"
            threading.Event().wait(0.05)
    finally:
        os.close(fd)  # releases the lock: one child fetches, the other then finds the entry
        for c in children:
            c.wait()
    assert [c.returncode for c in children] == [0, 0]
    assert entry.read_bytes() == data
    assert len(ranged_gets(proxy)) == -(-len(data) // CHUNK)  # one fetch's ranges, not two


def test_an_interrupted_fetch_caches_nothing(
    s3: S3, proxy: FaultProxy, blob: tuple[str, bytes, str], tmp_path: Path, ctrl_c: None
) -> None:
    url, data, checksum = blob
    cache = NodeCache(tmp_path / "cache", 1 << 30)
    second = f"bytes={CHUNK}-"
    proxy.inject("stall", matches=lambda method, path, headers: headers.get("range", "").startswith(second))
    main = threading.main_thread().ident
    assert main is not None

    def unwinding() -> bool:
        """Whether the main thread waits for the ranges in flight after its KeyboardInterrupt."""
        frame = sys._current_frames().get(main)
        while frame is not None:
            if frame.f_code.co_name == "join" and frame.f_code.co_filename == threading.__file__:
                return True
            frame = frame.f_back
        return False

    def interrupt() -> None:
        # The stalled range waits for the test, not for a timeout: no clock decides the order.
        if proxy.stalled.wait(120):
            signal.pthread_kill(main, signal.SIGINT)  # Ctrl-C while a range is in flight
            while not unwinding() and t_main_alive():
                time.sleep(0.005)
        proxy.release()  # the range in flight ends (reset); fetch gives up, as it was told to stop

    done = threading.Event()

    def t_main_alive() -> bool:
        return not done.is_set()

    t = threading.Thread(target=interrupt)
    t.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            cache.get(
                url,
                checksum=checksum,
                size=len(data),
                chunk_size=CHUNK,
                concurrency=2,
                retry=Retry(attempts=4, base_delay=0.005, max_delay=0.02, timeout=300.0),
            )
    finally:
        done.set()
        t.join()
    assert cache.entries() == []
    assert os.listdir(tmp_path / "cache" / "entries") == []
    path = cache.get(url, checksum=checksum, size=len(data), chunk_size=CHUNK, retry=FAST)
    assert Path(path).read_bytes() == data


def test_an_object_replaced_mid_fetch_is_a_clear_error(s3: S3, proxy: FaultProxy, tmp_path: Path) -> None:
    data, checksum = make_blob(tmp_path / "v1.smst", 1, seed=7)
    other, _ = make_blob(tmp_path / "v2.smst", 1, seed=8)
    other = other[: len(data)].ljust(len(data), b"\0")  # the same size: only the ETag tells them apart
    url = s3.put("replaced/x.smst", data)
    replaced = []

    def replace_once(method: str, path: str, headers: dict[str, str]) -> bool:
        if method == "GET" and "range" in headers and not replaced:
            s3.put("replaced/x.smst", other)  # after the HEAD, before the first range
            replaced.append(headers.get("if-match"))
        return False

    proxy.inject(matches=replace_once)
    with pytest.raises(RemoteError, match=rf"{url}: request failed: PreconditionError"):
        fetch(url, bytearray(len(data)), size=len(data), checksum=checksum, chunk_size=CHUNK, retry=FAST)
    assert replaced[0]  # the range asked for the object the HEAD saw


def test_cache_without_o_tmpfile_uses_a_part_file_and_leaves_none(
    s3: S3, proxy: FaultProxy, blob: tuple[str, bytes, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, data, checksum = blob
    real_open = os.open
    tried = []

    def no_tmpfile(path: str, flags: int, mode: int = 0o777, **kw: object) -> int:
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            tried.append(path)
            raise OSError(errno.EOPNOTSUPP, "no O_TMPFILE here")
        return real_open(path, flags, mode, **kw)  # type: ignore[arg-type]

    cache = NodeCache(tmp_path / "cache", 1 << 30)
    monkeypatch.setattr(os, "open", no_tmpfile)
    with pytest.raises(ChecksumMismatchError):
        cache.get(url, checksum="0123456789abcdef", size=len(data), chunk_size=CHUNK, retry=FAST)
    assert os.listdir(tmp_path / "cache" / "entries") == []  # the failed fetch's .part file is gone
    path = cache.get(url, checksum=checksum, size=len(data), chunk_size=CHUNK, retry=FAST)
    assert tried
    assert os.listdir(tmp_path / "cache" / "entries") == [os.path.basename(path)]
    assert Path(path).read_bytes() == data


# --- the daemon fetches held shards named by URL ------------------------------------------------


def segment_bytes(d: Daemon) -> dict[str, bytes]:
    """Checksum -> the bytes of each segment the daemon serves, read from /dev/shm."""
    out = {}
    for seg in d.status()["segments"]:
        with open(Path(_core.SHM_DIR) / seg["segment"].lstrip("/"), "rb") as f:
            out[seg["checksum"]] = f.read()
    return out


def served(d: Daemon, n: int) -> dict[str, Any]:
    st = tl.wait_status(d, lambda st: len(st["segments"]) >= n and not st["loading"], timeout=60)
    assert len(st["segments"]) == n, (st, d.log.read_text())
    return st


def test_daemon_fetches_held_shards_named_by_url_byte_exact(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    manifest, data, checksums = remote_dataset(s3, tmp_path, "direct")
    d = start_daemon(loaded=0)
    rank, reply = tl.hold(d.sock, manifest, [0, 1, 2])
    try:
        assert reply["ok"] is True, reply
        st = served(d, 3)
        assert segment_bytes(d) == dict(zip(checksums, data, strict=True))
        m = st["metrics"]
        assert m["fetched_bytes"] == sum(map(len, data))
        assert (m["cache_hits"], m["cache_misses"], m["cache_bytes"]) == (0, 0, 0)
        assert len(ranged_gets(proxy)) >= 3
        assert SECRET not in json.dumps(st)
        assert SECRET not in d.log.read_text()
    finally:
        rank.close()


def test_a_daemon_with_a_node_cache_fetches_once_then_restarts_on_the_cache(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    manifest, data, checksums = remote_dataset(s3, tmp_path, "cached")
    cache_dir = tmp_path / "cache"
    args = ("--cache-dir", os.fspath(cache_dir), "--cache-limit", str(10 << 20))
    d = start_daemon(args=args, loaded=0)
    rank, reply = tl.hold(d.sock, manifest, [0, 1, 2])
    try:
        assert reply["ok"] is True, reply
        m = served(d, 3)["metrics"]
        assert segment_bytes(d) == dict(zip(checksums, data, strict=True))
        assert (m["fetched_bytes"], m["cache_misses"], m["cache_hits"]) == (sum(map(len, data)), 3, 0)
        assert m["cache_bytes"] == sum(map(len, data))
    finally:
        rank.close()
    tl.cli("stop", sock=d.sock)
    d.proc.wait(timeout=30)
    proxy.seen.clear()
    # A second job on the node (a fresh daemon): every shard from the cache, not a byte fetched.
    d2 = start_daemon(args=args, loaded=0)
    rank, reply = tl.hold(d2.sock, manifest, [0, 1, 2])
    try:
        assert reply["ok"] is True, reply
        m = served(d2, 3)["metrics"]
        assert segment_bytes(d2) == dict(zip(checksums, data, strict=True))
        assert (m["fetched_bytes"], m["cache_misses"], m["cache_hits"]) == (0, 0, 3)
        assert ranged_gets(proxy) == []
    finally:
        rank.close()


def test_the_daemons_node_cache_keeps_within_its_limit(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    manifest, data, checksums = remote_dataset(s3, tmp_path, "limited")
    limit = len(data[0]) + len(data[1]) + len(data[2]) // 2  # two shards fit, not three
    cache_dir = tmp_path / "cache"
    d = start_daemon(args=("--cache-dir", os.fspath(cache_dir), "--cache-limit", str(limit)), loaded=0)
    rank, reply = tl.hold(d.sock, manifest, [0, 1, 2])
    try:
        assert reply["ok"] is True, reply
        m = served(d, 3)["metrics"]
        assert segment_bytes(d) == dict(zip(checksums, data, strict=True))
        assert m["cache_misses"] == 3
        assert 0 < m["cache_bytes"] <= limit
        assert NodeCache(cache_dir, limit).total_bytes() <= limit
    finally:
        rank.close()


@pytest.mark.parametrize("cached", [False, True])
def test_a_checksum_mismatch_is_a_clear_error_nothing_served_nothing_cached(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon], cached: bool
) -> None:
    manifest, data, _checksums = remote_dataset(s3, tmp_path, f"mismatch{int(cached)}", shards=2)
    doc = json.loads(manifest.read_text())
    url = doc["shards"][1]["path"]
    # The object is replaced by other bytes of the same size: the manifest's checksum no longer holds.
    s3.put(url.removeprefix(f"s3://{BUCKET}/"), data[1][:-1] + bytes([data[1][-1] ^ 1]))
    cache_dir = tmp_path / "cache"
    args = ("--cache-dir", os.fspath(cache_dir), "--cache-limit", str(10 << 20)) if cached else ()
    d = start_daemon(args=args, loaded=0)
    rank, reply = tl.hold(d.sock, manifest, [1])
    try:
        assert reply["ok"] is True, reply
        tl.wait_status(d, lambda st: not st["loading"] and st["metrics"]["loads"].get("failed", 0) >= 1)
        assert d.status()["segments"] == []
        # The rank hears why at its next hold, naming the object.
        again, refused = tl.hold(d.sock, manifest, [1])
        again.close()
        assert refused["ok"] is False
        assert url in refused["message"], refused
        assert "checksum" in refused["message"], refused
        assert d.status()["segments"] == []
        if cached:
            assert NodeCache(cache_dir, 10 << 20).entries() == []
    finally:
        rank.close()


def test_a_cache_entry_whose_records_rotted_is_dropped_and_fetched_again(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """The cache checks an entry's header before use, not its records: an entry rotted past its
    header failed every load of its shard, for good (counted a cache hit, the error naming
    /proc/self/fd/N and advising a re-pack)."""
    manifest, data, checksums = remote_dataset(s3, tmp_path, "rotted", shards=2)
    url = json.loads(manifest.read_text())["shards"][1]["path"]
    cache_dir = tmp_path / "cache"
    limit = 10 << 20
    # The entry as an earlier job left it, then one bit of a record flipped on disk.
    entry = NodeCache(cache_dir, limit).get(url, checksum=checksums[1], size=len(data[1]), retry=FAST)
    at = _core.read_header(entry).data_offset + 10
    with open(entry, "r+b") as f:
        f.seek(at)
        f.write(bytes([data[1][at] ^ 0x10]))
    d = start_daemon(args=("--cache-dir", os.fspath(cache_dir), "--cache-limit", str(limit)), loaded=0)
    rank, reply = tl.hold(d.sock, manifest, [1])
    try:
        assert reply["ok"] is True, reply
        m = served(d, 1)["metrics"]
        assert segment_bytes(d) == {checksums[1]: data[1]}
        assert (m["cache_hits"], m["cache_misses"]) == (1, 1)  # found, found bad, fetched anew
        assert Path(entry).read_bytes() == data[1]
        log = d.log.read_text()
        assert f"{url}: its node cache entry {entry} is corrupt (checksum mismatch: " in log, log
        assert "dropped, fetching it again" in log
        assert "/proc/self/fd" not in log
        assert "re-pack" not in log
    finally:
        rank.close()


def test_the_daemon_retries_injected_failures_then_serves(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    manifest, data, checksums = remote_dataset(s3, tmp_path, "faulty", shards=2)
    proxy.inject("reset", "500", "503", matches=lambda method, path, headers: method == "GET")
    d = start_daemon(loaded=0)
    rank, reply = tl.hold(d.sock, manifest, [0, 1])
    try:
        assert reply["ok"] is True, reply
        served(d, 2)
        assert segment_bytes(d) == dict(zip(checksums, data, strict=True))
        assert [s.fault for s in proxy.seen if s.fault] == ["reset", "500", "503"]
    finally:
        rank.close()


def test_the_daemon_names_the_object_it_cannot_fetch(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    manifest, _data, _checksums = remote_dataset(s3, tmp_path, "forbidden", shards=2)
    url = json.loads(manifest.read_text())["shards"][0]["path"]
    proxy.inject(
        "403", matches=lambda method, path, headers: method == "GET" and path.endswith(url.rsplit("/", 1)[1])
    )
    d = start_daemon(loaded=0)
    rank, reply = tl.hold(d.sock, manifest, [0])
    try:
        assert reply["ok"] is True, reply
        tl.wait_status(d, lambda st: not st["loading"] and st["metrics"]["loads"].get("failed", 0) >= 1)
        again, refused = tl.hold(d.sock, manifest, [0])
        again.close()
        assert refused["ok"] is False
        assert url in refused["message"], refused
        assert SECRET not in refused["message"]
        assert SECRET not in d.log.read_text()
        assert d.status()["segments"] == []
    finally:
        rank.close()


def test_a_manifest_naming_a_url_outside_the_allow_list_is_refused(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    manifest, _data, _checksums = remote_dataset(s3, tmp_path, "badscheme", shards=2)
    doc = json.loads(manifest.read_text())
    doc["shards"][0]["path"] = "file:///etc/passwd"
    manifest.write_text(json.dumps(doc))
    d = start_daemon(loaded=0)
    rank, reply = tl.hold(d.sock, manifest, [0])
    try:
        assert reply["ok"] is True, reply
        tl.wait_status(d, lambda st: not st["loading"] and st["metrics"]["loads"].get("failed", 0) >= 1)
        again, refused = tl.hold(d.sock, manifest, [0])
        again.close()
        assert refused["ok"] is False
        assert "scheme 'file' is not allowed" in refused["message"], refused
        assert d.status()["segments"] == []
    finally:
        rank.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")
def test_a_group_member_cannot_make_the_daemon_fetch_a_url(
    s3: S3,
    proxy: FaultProxy,
    tmp_path: Path,
    start_daemon: Callable[..., Daemon],
    request: pytest.FixtureRequest,
) -> None:
    try:
        group = grp.getgrnam("users")
    except KeyError:
        pytest.skip("no 'users' group")
    manifest, _data, _checksums = remote_dataset(s3, tmp_path, "ssrf", shards=2)
    public = tmp_path / "public"
    public.mkdir()
    (public / "manifest.json").write_text(manifest.read_text())
    public.chmod(0o755)
    tmp_path.chmod(0o755)
    sock = public_rundir(request, group.gr_gid) / "smstore.sock"
    d = start_daemon(args=("--group", "users"), at=sock, loaded=0)
    proxy.seen.clear()

    shard_url = json.loads(manifest.read_text())["shards"][0]["path"]

    def ask() -> str:
        replies = []
        s, reply = tl.hold(sock, public / "manifest.json", [0])
        s.close()
        replies.append(reply)
        for message in (  # an object named alone ('smstore load URL'), and a reader's own hold
            {"op": "load", "path": shard_url},
            {"op": "hold", "manifest": os.fspath(public / "manifest.json"), "shards": "0", "reader": True},
        ):
            s = tl.raw(sock)
            replies.append(tl.exchange(s, message))
            s.close()
        return json.dumps(replies)

    answers = json.loads(as_user(ask, [group.gr_gid]))
    assert len(answers) == 3
    for answer in answers:
        assert answer["error"] == "permission_denied", answer
        assert "only uid" in answer["message"], answer
    assert proxy.seen == []
    assert d.status()["segments"] == []


def test_a_windowed_epoch_at_2_ranks_x_2_workers_from_a_bucket_reads_every_record_once(
    s3: S3, proxy: FaultProxy, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    pytest.importorskip("torch")
    manifest, data, _checksums = remote_dataset(s3, tmp_path, "windowed", shards=6)
    recs = read_records(tmp_path / "windowed-local")
    cache_dir = tmp_path / "cache"
    d = start_daemon(args=("--cache-dir", os.fspath(cache_dir), "--cache-limit", str(64 << 20)), loaded=0)
    results = {
        rank: (kind, got)
        for rank, kind, got in run_ranks(windowed_rank, [(os.fspath(manifest), r, 2) for r in range(2)])
    }
    assert [results[r][0] for r in range(2)] == ["daemon", "daemon"]
    got = results[0][1] + results[1][1]
    assert sorted(got) == sorted(recs)  # every record once, byte-exact
    m = d.status()["metrics"]
    assert m["cache_misses"] == 6  # each shard fetched once for the node, whatever rank held it
    assert m["fetched_bytes"] == sum(map(len, data))


def test_a_reader_of_a_url_shard_ahead_of_its_samplers_hold_holds_it_itself_and_it_is_fetched_once(
    s3: S3,
    proxy: FaultProxy,
    tmp_path: Path,
    start_daemon: Callable[..., Daemon],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker may read a shard of the next window before its sampler's hold (sent from the
    sampler's thread, without waiting) reaches the daemon. A local shard would be read from its
    file; one in object storage has none: the reader holds it itself (seen under load in the
    windowed epoch above: first "does not serve this file", then a reader waiting for a hold its
    sampler's lag had already released), and the sampler's hold arriving after finds it loaded."""
    monkeypatch.setattr(smstore.wire.ipc, "REMOTE_WAIT", 20.0)  # a reader that waits gives up, not hangs
    manifest, data, _checksums = remote_dataset(s3, tmp_path, "early", shards=2)
    local = smstore.open(tmp_path / "early-local")
    first, second = bytes(local[0]), bytes(local[1])
    local.close()
    d = start_daemon(loaded=0)
    ds = smstore.open_store(manifest, mode="daemon", socket=d.sock)
    rank = None
    try:
        assert bytes(ds[0]) == first  # no rank holds shard 0 yet
        rank, reply = tl.hold(d.sock, manifest, [0])  # the sampler's hold, late
        assert (reply["ok"], reply["resident"], reply["held"]) == (True, 1, 1), reply
        assert bytes(ds[1]) == second
        m = d.status()["metrics"]
        assert m["fetched_bytes"] == len(data[0])  # fetched once, for the reader
    finally:
        ds.close()
        if rank is not None:
            rank.close()


def test_a_dataset_of_url_shards_opened_without_the_daemon_says_to_use_it(s3: S3, tmp_path: Path) -> None:
    manifest, _data, _checksums = remote_dataset(s3, tmp_path, "nodaemon", shards=2)
    url = json.loads(manifest.read_text())["shards"][0]["path"]
    with pytest.raises(
        smstore.StoreError, match=rf"{re.escape(url)}: a shard in object storage is read through"
    ):
        smstore.open(manifest)


@pytest.mark.parametrize(
    ("args", "fault"),
    [
        (("--cache-dir", "DIR"), "--cache-dir needs --cache-limit SIZE"),
        (("--cache-limit", "1G"), "--cache-limit needs --cache-dir"),
    ],
)
def test_serve_wants_a_cache_dir_and_its_limit_together(
    tmp_path: Path, args: tuple[str, ...], fault: str
) -> None:
    argv = [a.replace("DIR", os.fspath(tmp_path / "cache")) for a in args]
    res = subprocess.run(
        [sys.executable, "-m", "smstore", "serve", "--socket", os.fspath(tmp_path / "s.sock"), *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 2, res.stderr
    assert fault in res.stderr
    assert not (tmp_path / "cache").exists()
    assert not (tmp_path / "s.sock").exists()
