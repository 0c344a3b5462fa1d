"""Fetching one blob from object storage: parallel ranged GETs, retries, and its checksum verified."""

from __future__ import annotations

import logging
import os
import random
import re
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from smstore import _core
from smstore._protocol import CHECKSUM_WORDING, is_checksum
from smstore.errors import (
    ChecksumMismatchError,
    RemoteError,
    RemoteNotFoundError,
    StoreFormatError,
    StoreTruncatedError,
)
from smstore.remote.urls import RemoteURL, parse_url

if TYPE_CHECKING:
    from obstore import GetOptions
    from typing_extensions import Buffer

__all__ = [
    "DEFAULT_CHUNK",
    "DEFAULT_CONCURRENCY",
    "FetchResult",
    "Retry",
    "fetch",
    "object_size",
    "read_range",
]

log = logging.getLogger("smstore.remote")

DEFAULT_CHUNK = 16 << 20  # one ranged GET: large enough to amortise a request, small enough to retry
DEFAULT_CONCURRENCY = 8  # ranged GETs in flight for one object
PIECE = 1 << 20  # a range's bytes are written and hashed in pieces of this size as they arrive
_STEP = 0.2  # seconds between two looks at the ranges (and at a pending Ctrl-C)
HEADER = _core.BLOB_HEADER_SIZE
_CHECKSUM_FIELD = 96  # docs/format.md: the header's u64 checksum


@dataclass(frozen=True)
class Retry:
    """How a request that failed with a retryable error is tried again.

    Retryable: connection errors (reset, refused, dropped mid-body), timeouts, 5xx, 408 and 429.
    Anything else (403, 404, other 4xx) fails at once. Waits grow exponentially with full jitter:
    before try ``n + 1`` a request sleeps a random time in ``[0, min(max_delay, base_delay * 2**(n - 1))]``.

    Attributes:
        attempts: Tries per request, the first included.
        base_delay: Seconds; the cap of the first wait.
        max_delay: Seconds; no wait is longer.
        timeout: Seconds one request may take, from connect to the last byte of its range.
    """

    attempts: int = 8
    base_delay: float = 0.2
    max_delay: float = 20.0
    timeout: float = 120.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.base_delay < 0 or self.max_delay < 0 or self.timeout <= 0:
            raise ValueError(f"bad Retry: {self}")

    def delay(self, failures: int, rng: random.Random) -> float:
        """The wait after `failures` failed tries of one request."""
        return rng.uniform(0.0, min(self.max_delay, self.base_delay * 2 ** (failures - 1)))


@dataclass(frozen=True)
class FetchResult:
    """What one fetch did.

    Attributes:
        bytes: The blob's size (every byte was fetched and verified).
        requests: Ranged GETs that succeeded.
        retries: Failed tries that were tried again.
    """

    bytes: int
    requests: int
    retries: int


class _ShortRead(Exception):
    """A ranged GET returned fewer bytes than asked: the connection ended early."""


class _Stopped(Exception):
    """Another range failed for good: this one is not tried."""


# A status in object_store's error text ("... status: 503 Service Unavailable" / "status code: 403").
_STATUS = re.compile(r"status(?: code)?:? (\d{3})")


def _retryable(exc: BaseException) -> bool:
    """Whether a failed request deserves another try (connection errors, timeouts, 5xx, 408, 429)."""
    from obstore import exceptions as obx

    if isinstance(exc, FileNotFoundError | PermissionError):
        return False
    fatal = (
        obx.PermissionDeniedError,
        obx.UnauthenticatedError,
        obx.InvalidPathError,
        obx.NotSupportedError,
        obx.UnknownConfigurationKeyError,
        obx.PreconditionError,
    )
    if isinstance(exc, fatal):
        return False
    m = _STATUS.search(str(exc))
    if m:
        status = int(m.group(1))
        return status >= 500 or status in (408, 429)
    return isinstance(exc, obx.BaseError | OSError | TimeoutError | _ShortRead)


def _why(exc: BaseException) -> str:
    # One line, without object_store's "Debug source:" dump of its request state.
    text = " ".join(str(exc).split("Debug source:", 1)[0].split())
    return f"{type(exc).__name__}: {text[:400]}" if text else type(exc).__name__


def _fail(url: RemoteURL, exc: BaseException, tries: int) -> RemoteError:
    after = f" after {tries} tries" if tries > 1 else ""
    if isinstance(exc, FileNotFoundError):
        return RemoteNotFoundError(f"{url}: no such object (or bucket){after}: {_why(exc)}")
    return RemoteError(f"{url}: request failed{after}: {_why(exc)}")


def open_store(url: RemoteURL, timeout: float) -> Any:
    """An obstore store for `url`'s bucket, configured from the cloud's standard environment.

    Credentials, region and endpoint come only from the environment the cloud's own tools read
    (``AWS_*``, ``GOOGLE_*``, ``AZURE_*``, instance metadata): obstore's own defaults, plus
    ``AWS_ALLOW_HTTP=true`` for an ``http://`` endpoint. obstore's
    retries are off: :func:`fetch` retries, so it counts tries and names the object when it stops.
    """
    from obstore.store import AzureStore, GCSStore, HTTPStore, S3Store

    client: Any = {
        "timeout": timedelta(seconds=timeout),
        "connect_timeout": timedelta(seconds=min(timeout, 10.0)),
    }
    if url.scheme == "s3" and os.environ.get("AWS_ALLOW_HTTP", "").lower() in ("1", "true"):
        client["allow_http"] = (
            True  # an http:// AWS_ENDPOINT_URL (MinIO, moto); object_store reads it only as an option
        )
    retry: Any = {"max_retries": 0}
    if url.scheme == "s3":
        return S3Store(url.bucket, client_options=client, retry_config=retry)
    if url.scheme == "gs":
        return GCSStore(url.bucket, client_options=client, retry_config=retry)
    if url.scheme == "az":
        return AzureStore(url.bucket, client_options=client, retry_config=retry)
    return HTTPStore.from_url(f"https://{url.bucket}", client_options=client, retry_config=retry)


def _with_retries(
    url: RemoteURL, retry: Retry, stop: threading.Event, counter: Callable[[], None], call: Callable[[], Any]
) -> Any:
    rng = random.Random()
    for tries in range(1, retry.attempts + 1):
        try:
            return call()
        except Exception as exc:
            if not _retryable(exc) or tries == retry.attempts:
                raise _fail(url, exc, tries) from exc
            pause = retry.delay(tries, rng)
            log.warning("%s: %s; try %d of %d in %.2fs", url, _why(exc), tries + 1, retry.attempts, pause)
            counter()
            if stop.wait(pause):  # another range failed for good: give up quietly
                raise _fail(url, exc, tries) from exc
    raise AssertionError("unreachable")


def object_size(url: str | RemoteURL, *, retry: Retry | None = None) -> int:
    """The size in bytes of the object at `url` (a HEAD request, retried like a fetch)."""
    import obstore

    u = url if isinstance(url, RemoteURL) else parse_url(url)
    r = retry or Retry()
    store = open_store(u, r.timeout)
    meta = _with_retries(u, r, threading.Event(), lambda: None, lambda: obstore.head(store, u.key))
    return int(meta["size"])


def read_range(
    url: str | RemoteURL,
    start: int,
    end: int,
    *,
    if_match: str | None = None,
    retry: Retry | None = None,
    stop: threading.Event | None = None,
) -> tuple[bytearray, str | None]:
    """Bytes ``[start, end)`` of the object at `url`, in one ranged GET (resumed where it stopped on a retry).

    For a part of a blob whose whole cannot be fetched: the caller checks what it reads (a
    block's bytes are located by an index it validated). With `if_match` (an ETag an earlier
    read returned) the object must still be that version, so reads of one object's parts never
    mix two versions (a replaced object fails with a precondition error, not retried).

    Returns:
        The bytes and the object's ETag (None where the store gives none).

    Raises:
        RemoteURLError: A URL smstore will not fetch.
        RemoteNotFoundError: No such object.
        RemoteError: A non-retryable error (a replaced object included), or retryable ones
            `retry.attempts` times, or `stop` set while waiting to retry.
        StoreTruncatedError: The object ends before `end`.
    """
    import obstore

    u = url if isinstance(url, RemoteURL) else parse_url(url)
    if not 0 <= start <= end:
        raise ValueError(f"{u}: a range needs 0 <= start <= end, not {start}-{end}")
    r = retry or Retry()
    store = open_store(u, r.timeout)
    data = bytearray(end - start)
    view = memoryview(data)
    pos = start
    etag: list[str | None] = [if_match]

    def once() -> None:
        nonlocal pos
        if pos == end:
            return
        options: GetOptions = {"range": (pos, end)}
        if etag[0]:
            options["if_match"] = etag[0]
        result = obstore.get(store, u.key, options=options)
        etag[0] = etag[0] or result.meta.get("e_tag")
        for piece in result.stream(min_chunk_size=PIECE):
            n = len(piece)
            if pos + n > end:
                raise _ShortRead(f"range {start}-{end} returned more bytes than asked")
            view[pos - start : pos - start + n] = piece
            pos += n
        if pos != end:
            raise _ShortRead(f"range {start}-{end} ended at {pos}")

    try:
        _with_retries(u, r, stop or threading.Event(), lambda: None, once)
    except RemoteError as e:
        if "range" in str(e).lower() and "416" in str(e):
            raise StoreTruncatedError(f"{u}: the object ends before byte {end}") from e
        raise
    return data, etag[0]


class _Sink:
    """Where fetched bytes go (a writable buffer or a file descriptor), and how they are read back to hash."""

    def __init__(self, into: Buffer | int, size: int, label: str) -> None:
        self.fd: int | None = None
        self.view: memoryview | None = None
        if isinstance(into, int):
            self.fd = into
            return
        view = memoryview(into).cast("B")
        if view.readonly:
            raise ValueError(f"{label}: fetch needs a writable buffer")
        if len(view) < size:
            raise ValueError(f"{label}: the buffer holds {len(view)} bytes, the object {size}")
        self.view = view

    def write(self, offset: int, data: Buffer) -> None:
        src = memoryview(data).cast("B")
        if self.view is not None:
            self.view[offset : offset + len(src)] = src
            return
        assert self.fd is not None
        done = 0
        while done < len(src):
            done += os.pwrite(self.fd, src[done:], offset + done)

    def read(self, offset: int, size: int) -> Buffer:
        if self.view is not None:
            return self.view[offset : offset + size]
        assert self.fd is not None
        data = os.pread(self.fd, size, offset)
        if len(data) != size:
            raise StoreTruncatedError(f"the file written to was truncated under the fetch at offset {offset}")
        return data


class _InOrderHasher:
    """Hashes spans as soon as every byte before them has arrived: the checksum needs file order."""

    def __init__(self, sink: _Sink, size: int) -> None:
        self.sink, self.size = sink, size
        self.hasher = _core.BlobHasher()
        self.pending: dict[int, int] = {}  # start -> end of spans that arrived ahead of the frontier
        self.frontier = HEADER  # every byte before it is hashed (the header is hashed last)
        self.lock = threading.Lock()

    def arrived(self, start: int, end: int) -> None:
        start = max(start, HEADER)
        if end <= start:
            return
        with self.lock:
            self.pending[start] = end
            while self.frontier in self.pending:
                stop = self.pending.pop(self.frontier)
                self.hasher.update(self.sink.read(self.frontier, stop - self.frontier))
                self.frontier = stop

    def finish(self) -> str:
        if self.frontier != self.size:
            raise AssertionError(f"hashed up to {self.frontier} of {self.size} bytes")
        return self.hasher.finish(self.sink.read(0, HEADER))


def fetch(
    url: str | RemoteURL,
    into: Buffer | int,
    *,
    size: int,
    checksum: str,
    chunk_size: int = DEFAULT_CHUNK,
    concurrency: int = DEFAULT_CONCURRENCY,
    retry: Retry | None = None,
) -> FetchResult:
    """Download the blob at `url` into `into` and verify its checksum before returning.

    The object is read with ranged GETs of `chunk_size` bytes, `concurrency` at a time; each is
    retried on retryable errors (see :class:`Retry`). The blob's XXH64 checksum (docs/format.md) is
    computed as the ranges arrive, in file order, and compared with `checksum`.

    Args:
        url: The object (``s3://``, ``gs://``, ``az://`` or ``https://``).
        into: A writable buffer of at least `size` bytes, or a file descriptor open for writing
            (written with ``pwrite`` at the object's offsets, and read back to hash).
        size: The blob's size, as its manifest says; the object must have exactly this size.
        checksum: Its checksum, 16 hex digits (a manifest entry's ``checksum``).
        chunk_size: Bytes per ranged GET.
        concurrency: Ranged GETs in flight.
        retry: Retries and timeouts; ``Retry()`` by default.

    Returns:
        What was fetched: bytes, requests, retries.

    Raises:
        RemoteURLError: A URL smstore will not fetch.
        RemoteNotFoundError: No such object.
        RemoteError: A request failed with a non-retryable error, or with retryable ones `retry.attempts` times.
        StoreTruncatedError, StoreFormatError: The object's size is not `size`.
        ChecksumMismatchError: The bytes do not hash to `checksum` (what `into` holds is then garbage).
    """
    import obstore

    u = url if isinstance(url, RemoteURL) else parse_url(url)
    if not is_checksum(checksum):
        raise ValueError(f"{u}: checksum must be {CHECKSUM_WORDING}, not {checksum!r}")
    if size < HEADER:
        raise StoreTruncatedError(f"{u}: a blob has at least {HEADER} bytes; the size given is {size}")
    if chunk_size < 1 or concurrency < 1:
        raise ValueError(f"{u}: chunk_size and concurrency must be positive")
    r = retry or Retry()
    sink = _Sink(into, size, str(u))
    store = open_store(u, r.timeout)
    stop = threading.Event()
    stats_lock = threading.Lock()
    retries = 0

    def count_retry() -> None:
        nonlocal retries
        with stats_lock:
            retries += 1

    meta = _with_retries(u, r, stop, count_retry, lambda: obstore.head(store, u.key))
    actual = int(meta["size"])
    if actual < size:
        raise StoreTruncatedError(
            f"{u}: the object holds {actual} bytes, the manifest says {size}: an incomplete upload"
        )
    if actual > size:
        raise StoreFormatError(
            f"{u}: the object holds {actual} bytes, the manifest says {size}: another object"
        )

    # Every range must come from the object whose size was checked: one replaced mid-fetch fails
    # with a precondition error instead of mixing two versions' bytes.
    etag = meta.get("e_tag")
    chunks = (size + chunk_size - 1) // chunk_size
    hasher = _InOrderHasher(sink, size)

    def get(i: int, failures: list[BaseException]) -> None:
        try:
            fetch_range(i)
        except BaseException as exc:
            with stats_lock:
                if not stop.is_set():  # the first failure; the others are its consequences
                    failures.append(exc)
                    stop.set()
            raise

    def fetch_range(i: int) -> None:
        start, end = i * chunk_size, min(size, (i + 1) * chunk_size)
        pos = start  # a retry resumes where the bytes stopped

        def once() -> None:
            nonlocal pos
            if stop.is_set():
                raise _Stopped
            options: GetOptions = {"range": (pos, end)}
            if etag:
                options["if_match"] = etag
            result = obstore.get(store, u.key, options=options)
            # Pieces are written and hashed as they arrive, overlapping the transfer.
            for piece in result.stream(min_chunk_size=PIECE):
                n = len(piece)
                if pos + n > end:
                    raise _ShortRead(f"range {start}-{end} returned more bytes than asked")
                sink.write(pos, piece)
                hasher.arrived(pos, pos + n)
                pos += n
                if stop.is_set() and pos < end:
                    raise _Stopped
            if pos != end:
                raise _ShortRead(f"range {start}-{end} ended at {pos}")

        _with_retries(u, r, stop, count_retry, once)

    failures: list[BaseException] = []
    pool = ThreadPoolExecutor(max_workers=min(concurrency, chunks), thread_name_prefix="smstore-fetch")
    try:
        pending = {pool.submit(get, i, failures) for i in range(chunks)}
        # In steps, not one wait: a Ctrl-C that the kernel gives to another thread (the client
        # library's) only sets a flag, which this thread acts on when it next runs Python code.
        while pending and not failures:
            _, pending = wait(pending, timeout=_STEP, return_when=FIRST_EXCEPTION)
    except BaseException:
        stop.set()  # interrupted: the ranges still queued are dropped, those in flight end after their GET
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    if failures:
        raise failures[0]

    got = hasher.finish()
    if got != checksum:
        raise ChecksumMismatchError(
            f"{u}: checksum mismatch: the manifest says {checksum}, the fetched bytes hash to {got}; "
            "the object was replaced or corrupted, re-upload it or fix the manifest"
        )
    stored = int.from_bytes(bytes(sink.read(_CHECKSUM_FIELD, 8)), "little")
    if f"{stored:016x}" != checksum:
        raise ChecksumMismatchError(
            f"{u}: its header's checksum field is {stored:016x}, its bytes hash to {checksum}"
        )
    return FetchResult(size, chunks, retries)
