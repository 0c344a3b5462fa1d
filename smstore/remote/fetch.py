"""Fetching one blob from object storage: parallel ranged GETs, retries, and its checksum verified."""

from __future__ import annotations

import logging
import os
import queue
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from smstore import _core
from smstore.errors import (
    ChecksumMismatchError,
    RemoteError,
    RemoteNotFoundError,
    StoreFormatError,
    StoreTruncatedError,
)
from smstore.remote.urls import RemoteURL, parse_url
from smstore.wire.protocol import CHECKSUM_WORDING, is_checksum

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
    "parse_header",
    "read_header",
    "read_object",
    "read_range",
    "verify_object",
]

log = logging.getLogger("smstore.remote")

DEFAULT_CHUNK = 16 << 20  # one ranged GET: large enough to amortise a request, small enough to retry
DEFAULT_CONCURRENCY = 8  # ranged GETs in flight for one object
PIECE = 1 << 20  # a range's bytes are written and hashed in pieces of this size as they arrive
_STEP = 0.2  # seconds between two looks at the ranges (and at a pending Ctrl-C)


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
        deadline: A ``time.monotonic()`` instant by which the whole read ends, its tries, waits
            and requests together (each request's timeout is cut to what is left of it), or
            None. Past it the read fails with ``RemoteError``: a caller with a deadline of its own
            (``smstore wait --timeout``) passes it here rather than timing the read itself.
    """

    attempts: int = 8
    base_delay: float = 0.2
    max_delay: float = 20.0
    timeout: float = 120.0
    deadline: float | None = None

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.base_delay < 0 or self.max_delay < 0 or self.timeout <= 0:
            raise ValueError(f"bad Retry: {self}")

    def delay(self, failures: int, rng: random.Random) -> float:
        """The wait after `failures` failed tries of one request."""
        return rng.uniform(0.0, min(self.max_delay, self.base_delay * 2 ** (failures - 1)))

    def left(self) -> float:
        """Seconds left before the deadline (infinite without one; 0 or less once it passed)."""
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()


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
    """Another range failed for good (or the caller stopped the fetch): this one is not tried."""


def _stopped(url: RemoteURL) -> RemoteError:
    return RemoteError(f"{url}: the fetch was stopped (the process is stopping)")


class _Pacer:
    """Holds a transfer to `rate` bytes a second (0: no limit), over every range of it together.

    A piece's bytes are counted as they arrive; the thread that took them then waits until the
    transfer's average is back under the rate. The wait ends early when `stop` is set.
    """

    def __init__(self, rate: int, stop: threading.Event, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.stop, self.clock = rate, stop, clock
        self.start = clock()
        self.bytes = 0
        self.lock = threading.Lock()

    def took(self, n: int) -> None:
        if not self.rate:
            return
        with self.lock:
            self.bytes += n
            due = self.start + self.bytes / self.rate
        pause = due - self.clock()
        if pause > 0:
            self.stop.wait(pause)


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


class _Client:
    """The obstore store that one read's requests go through, each request ending by the read's deadline.

    obstore fixes a request's timeout when its store is made: without a deadline one store serves
    every try; with one, each try gets a store whose timeout is what is left of the deadline (about
    10 ms to make, against a stalled request that would outlive the deadline by `Retry.timeout`).
    """

    def __init__(self, url: RemoteURL, retry: Retry) -> None:
        self.url, self.retry = url, retry
        self._store: Any = None if retry.deadline is not None else open_store(url, retry.timeout)

    def store(self) -> Any:
        if self._store is not None:
            return self._store
        return open_store(self.url, max(0.001, min(self.retry.timeout, self.retry.left())))


def _late(url: RemoteURL, exc: BaseException | None, tries: int) -> RemoteError:
    why = f" after {tries} tr{'y' if tries == 1 else 'ies'}: {_why(exc)}" if exc is not None else ""
    return RemoteError(f"{url}: no answer before the deadline{why}")


def _with_retries(
    url: RemoteURL, retry: Retry, stop: threading.Event, counter: Callable[[], None], call: Callable[[], Any]
) -> Any:
    rng = random.Random()
    for tries in range(1, retry.attempts + 1):
        if retry.left() <= 0:  # spent by what came before this read (a manifest's, another range's)
            raise _late(url, None, 0)
        try:
            return call()
        except _Stopped:
            raise _stopped(url) from None
        except Exception as exc:
            if not _retryable(exc) or tries == retry.attempts:
                raise _fail(url, exc, tries) from exc
            pause = retry.delay(tries, rng)
            if pause >= retry.left():  # the next try could not start before the deadline
                raise _late(url, exc, tries) from exc
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
    client = _Client(u, r)
    meta = _with_retries(u, r, threading.Event(), lambda: None, lambda: obstore.head(client.store(), u.key))
    return int(meta["size"])


def _stream_range(
    client: _Client,
    u: RemoteURL,
    start: int,
    end: int,
    *,
    if_match: str | None,
    retry: Retry,
    stop: threading.Event,
    take: Callable[[int, memoryview], None],
    count: Callable[[], None] = lambda: None,
) -> str | None:
    """Bytes ``[start, end)`` of `u` in one ranged GET, each piece handed to ``take(offset, piece)`` in
    order as it arrives; a retry resumes where the bytes stopped. Returns the object's ETag.

    With `if_match` the object must still be that version (a replaced one fails with a
    precondition error, not retried). `stop` set ends it between two pieces (``RemoteError``).
    """
    import obstore

    pos = start
    etag: list[str | None] = [if_match]

    def once() -> None:
        nonlocal pos
        if pos == end:
            return
        if stop.is_set():
            raise _Stopped
        options: GetOptions = {"range": (pos, end)}
        if etag[0]:
            options["if_match"] = etag[0]
        result = obstore.get(client.store(), u.key, options=options)
        etag[0] = etag[0] or result.meta.get("e_tag")
        for piece in result.stream(min_chunk_size=PIECE):
            n = len(piece)
            if pos + n > end:
                raise _ShortRead(f"range {start}-{end} returned more bytes than asked")
            take(pos, memoryview(piece))
            pos += n
            if stop.is_set() and pos < end:
                raise _Stopped
        if pos != end:
            raise _ShortRead(f"range {start}-{end} ended at {pos}")

    try:
        _with_retries(u, retry, stop, count, once)
    except RemoteError as e:
        if "range" in str(e).lower() and "416" in str(e):
            raise StoreTruncatedError(f"{u}: the object ends before byte {end}") from e
        raise
    return etag[0]


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
            `retry.attempts` times, or `stop` set (between two pieces, or while waiting to retry).
        StoreTruncatedError: The object ends before `end`.
    """
    u = url if isinstance(url, RemoteURL) else parse_url(url)
    if not 0 <= start <= end:
        raise ValueError(f"{u}: a range needs 0 <= start <= end, not {start}-{end}")
    r = retry or Retry()
    data = bytearray(end - start)
    view = memoryview(data)

    def take(pos: int, piece: memoryview) -> None:
        view[pos - start : pos - start + len(piece)] = piece

    etag = _stream_range(
        _Client(u, r),
        u,
        start,
        end,
        if_match=if_match,
        retry=r,
        stop=stop or threading.Event(),
        take=take,
    )
    return data, etag


def parse_header(head: Buffer, file_size: int | None, label: str) -> _core.BlobHeader:
    """The blob header in `head` (a blob's first bytes), checked by the core's one header check.

    Args:
        head: The header's bytes.
        file_size: The blob's size, if known (else the header's own word for it).
        label: What the errors name (the object's URL).

    Raises:
        StoreFormatError: Not a valid blob header (or not one of `file_size` bytes).
    """
    return _core.parse_header(memoryview(head).cast("B"), label, file_size)


def read_header(
    url: str | RemoteURL, *, retry: Retry | None = None, stop: threading.Event | None = None
) -> _core.BlobHeader:
    """The header of the blob at `url`: one ranged GET of its first 4 KiB (never the whole object),
    checked by the core's one header check.

    Raises:
        RemoteURLError, RemoteError: A URL smstore will not fetch, or the read failed (or `stop`,
            or `retry.deadline`).
        StoreFormatError: Not an smstore blob.
    """
    head, _etag = read_range(url, 0, _core.BLOB_HEADER_SIZE, retry=retry, stop=stop)
    return parse_header(head, None, str(url))


def read_object(
    url: str | RemoteURL,
    *,
    max_bytes: int,
    what: str = "the object",
    retry: Retry | None = None,
    stop: threading.Event | None = None,
) -> bytes:
    """The whole (small) object at `url` in one GET, retried; refused if it holds more than `max_bytes`.

    The size the server reports is checked before the body is read, and the body is cut off if it
    runs past the limit anyway: a hostile object never fills memory.

    Raises:
        RemoteURLError: A URL smstore will not fetch.
        RemoteNotFoundError: No such object.
        RemoteError: As :func:`read_range`.
        StoreFormatError: It holds more than `max_bytes` bytes.
    """
    import obstore

    u = url if isinstance(url, RemoteURL) else parse_url(url)
    r = retry or Retry()
    client = _Client(u, r)

    def too_large(size: int | str) -> StoreFormatError:
        return StoreFormatError(f"{u}: {what} holds {size} bytes, more than the {max_bytes} it may hold")

    def once() -> bytes:
        result = obstore.get(client.store(), u.key)
        size = int(result.meta["size"])
        if size > max_bytes:
            raise too_large(size)
        data = bytearray()
        for piece in result.stream(min_chunk_size=PIECE):
            data += piece
            if len(data) > max_bytes:
                raise too_large(f"at least {len(data)}")
        if len(data) != size:
            raise _ShortRead(f"the object of {size} bytes ended at {len(data)}")
        return bytes(data)

    try:
        data: bytes = _with_retries(u, r, stop or threading.Event(), lambda: None, once)
    except RemoteError as e:
        if isinstance(e.__cause__, StoreFormatError):
            raise e.__cause__ from None
        raise
    return data


def verify_object(
    url: str | RemoteURL,
    *,
    size: int,
    checksum: str,
    retry: Retry | None = None,
    stop: threading.Event | None = None,
) -> FetchResult:
    """Check the blob at `url` against `checksum`, streaming it once (one GET, resumed on a retry):
    nothing is kept but its header, whatever its size.

    Raises:
        As :func:`fetch`: ``ChecksumMismatchError`` naming the object when its bytes do not hash to
        `checksum`, ``StoreTruncatedError`` / ``StoreFormatError`` when its size is not `size`.
    """
    u = url if isinstance(url, RemoteURL) else parse_url(url)
    _check_args(u, size, checksum)
    r = retry or Retry()
    client = _Client(u, r)
    hasher = _core.FileHasher()
    etag = _check_size(u, client, size, r, stop or threading.Event(), lambda: None)
    _stream_range(
        client,
        u,
        0,
        size,
        if_match=etag,
        retry=r,
        stop=stop or threading.Event(),
        take=lambda _pos, piece: hasher.update(piece),
    )
    _check_checksum(u, *hasher.finish(str(u)), checksum)
    return FetchResult(size, 1, 0)


def _check_args(u: RemoteURL, size: int, checksum: str) -> None:
    if not is_checksum(checksum):
        raise ValueError(f"{u}: checksum must be {CHECKSUM_WORDING}, not {checksum!r}")
    if size < _core.BLOB_HEADER_SIZE:
        raise StoreTruncatedError(
            f"{u}: a blob has at least {_core.BLOB_HEADER_SIZE} bytes; the size given is {size}"
        )


def _check_size(
    u: RemoteURL, client: _Client, size: int, r: Retry, stop: threading.Event, count_retry: Callable[[], None]
) -> str | None:
    """One HEAD: the object must hold exactly `size` bytes. Returns its ETag (every range pins it)."""
    import obstore

    meta = _with_retries(u, r, stop, count_retry, lambda: obstore.head(client.store(), u.key))
    actual = int(meta["size"])
    if actual < size:
        raise StoreTruncatedError(
            f"{u}: the object holds {actual} bytes, the manifest says {size}: an incomplete upload"
        )
    if actual > size:
        raise StoreFormatError(
            f"{u}: the object holds {actual} bytes, the manifest says {size}: another object"
        )
    etag = meta.get("e_tag")
    return str(etag) if etag else None


def _check_checksum(u: RemoteURL, got: str, stored: str, checksum: str) -> None:
    """The fetched bytes hash to `checksum`, and the header's checksum field (`stored`) says so too."""
    if got != checksum:
        raise ChecksumMismatchError(
            f"{u}: checksum mismatch: the manifest says {checksum}, the fetched bytes hash to {got}; "
            "the object was replaced or corrupted, re-upload it or fix the manifest"
        )
    if stored != checksum:
        raise ChecksumMismatchError(
            f"{u}: its header's checksum field is {stored}, its bytes hash to {checksum}"
        )


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

    def close(self) -> None:
        """Close the descriptor written through (the fetch's own duplicate)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class _InOrderHasher:
    """Hashes spans as soon as every byte before them has arrived: the checksum needs file order."""

    def __init__(self, sink: _Sink, size: int) -> None:
        self.sink, self.size = sink, size
        self.hasher = _core.FileHasher()  # it keeps the header aside, hashed last
        self.pending: dict[int, int] = {}  # start -> end of spans that arrived ahead of the frontier
        self.frontier = 0  # every byte before it is hashed
        self.lock = threading.Lock()

    def arrived(self, start: int, end: int) -> None:
        if end <= start:
            return
        with self.lock:
            self.pending[start] = end
            while self.frontier in self.pending:
                stop = self.pending.pop(self.frontier)
                self.hasher.update(self.sink.read(self.frontier, stop - self.frontier))
                self.frontier = stop

    def finish(self, label: str) -> tuple[str, str]:
        """(checksum, the header's checksum field)."""
        if self.frontier != self.size:
            raise AssertionError(f"hashed up to {self.frontier} of {self.size} bytes")
        return self.hasher.finish(label)


def fetch(
    url: str | RemoteURL,
    into: Buffer | int,
    *,
    size: int,
    checksum: str,
    chunk_size: int = DEFAULT_CHUNK,
    concurrency: int = DEFAULT_CONCURRENCY,
    retry: Retry | None = None,
    rate: int = 0,
    stop: threading.Event | None = None,
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
        rate: Fetch at most this many bytes a second, all ranges together (0: no limit).
        stop: Set by another thread to end the fetch at once: it raises ``RemoteError`` within
            a fraction of a second, without waiting for the requests in flight (their threads
            end on their own; an fd `into` is written through a duplicate they close).

    Returns:
        What was fetched: bytes, requests, retries.

    Raises:
        RemoteURLError: A URL smstore will not fetch.
        RemoteNotFoundError: No such object.
        RemoteError: A request failed with a non-retryable error, or with retryable ones
            `retry.attempts` times; or `stop` was set.
        StoreTruncatedError, StoreFormatError: The object's size is not `size`.
        ChecksumMismatchError: The bytes do not hash to `checksum` (what `into` holds is then garbage).
    """
    u = url if isinstance(url, RemoteURL) else parse_url(url)
    _check_args(u, size, checksum)
    if chunk_size < 1 or concurrency < 1 or rate < 0:
        raise ValueError(f"{u}: chunk_size and concurrency must be positive, rate not negative")
    r = retry or Retry()
    client = _Client(u, r)
    ended = threading.Event()  # the ranges must end: one failed for good, or `stop` was set
    stats_lock = threading.Lock()
    retries = 0

    def count_retry() -> None:
        nonlocal retries
        with stats_lock:
            retries += 1

    # Every range must come from the object whose size was checked: one replaced mid-fetch fails
    # with a precondition error instead of mixing two versions' bytes.
    etag = _check_size(u, client, size, r, stop or ended, count_retry)
    chunks = (size + chunk_size - 1) // chunk_size
    # A descriptor of our own: threads abandoned by `stop` may still write through it after we return.
    sink = _Sink(os.dup(into) if isinstance(into, int) else into, size, str(u))
    hasher = _InOrderHasher(sink, size)
    pacer = _Pacer(rate, ended)
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(chunks):
        todo.put(i)
    failures: list[BaseException] = []
    finished = threading.Event()  # every range is in
    left = [chunks]

    def take(pos: int, piece: memoryview) -> None:
        # Pieces are written and hashed as they arrive, overlapping the transfer.
        sink.write(pos, piece)
        hasher.arrived(pos, pos + len(piece))
        pacer.took(len(piece))

    # Threads still writing, and whether the caller has gone (the last thread then closes the sink).
    alive = [min(concurrency, chunks), False]

    def worker() -> None:
        try:
            work()
        finally:
            with stats_lock:
                alive[0] -= 1
                last = not alive[0] and alive[1]
            if last:
                sink.close()

    def work() -> None:
        while not ended.is_set():
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            start, end = i * chunk_size, min(size, (i + 1) * chunk_size)
            try:
                _stream_range(
                    client, u, start, end, if_match=etag, retry=r, stop=ended, take=take, count=count_retry
                )
            except BaseException as exc:  # noqa: BLE001 - the caller raises it (a thread has no one else)
                with stats_lock:
                    if not ended.is_set():  # the first failure; the others are its consequences
                        failures.append(exc)
                        ended.set()
                return
            with stats_lock:
                left[0] -= 1
                if not left[0]:
                    finished.set()

    threads = [
        threading.Thread(target=worker, name="smstore-fetch", daemon=True)
        for _ in range(min(concurrency, chunks))
    ]
    abandoned = False
    try:
        try:
            for t in threads:
                t.start()
            # In steps, not one wait: a Ctrl-C that the kernel gives to another thread (the client
            # library's) only sets a flag, which this thread acts on when it next runs Python code.
            while not finished.wait(_STEP) and not ended.is_set():
                late = r.left() <= 0  # a range pacing itself would wait past it
                if late or (stop is not None and stop.is_set()):
                    # The requests in flight are not waited for when the bytes go to a descriptor (the
                    # threads write through our duplicate); a buffer's owner may free it once we return.
                    abandoned = isinstance(into, int)
                    ended.set()
                    raise _late(u, None, 0) if late else _stopped(u)
        except BaseException:
            ended.set()  # interrupted: the ranges still queued are dropped, those in flight end after their GET
            raise
        finally:
            if not abandoned:
                for t in threads:
                    if t.ident is not None:  # started
                        t.join()
        if failures:
            raise failures[0]
        _check_checksum(u, *hasher.finish(str(u)), checksum)
    finally:
        if abandoned:
            with stats_lock:
                alive[1] = True
                last = not alive[0]
            if last:
                sink.close()
        else:
            sink.close()
    return FetchResult(size, chunks, retries)
