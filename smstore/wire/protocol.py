"""What the daemon and its clients say to each other: framing, requests and their arguments, replies and error codes.

One place for the wire format, used by both sides (the daemon's connection layer and requests, and
`_ipc`'s transport under the clients): a change of a frame, an argument or a refusal is made here
once. Standard library only: a DataLoader worker imports it without reaching the daemon.

Every reply is a JSON object with ``"ok"``; a refusal adds ``"error"`` (one of `CODES`, or for a
fault of a file the request named, the name of its `smstore.errors` class) and ``"message"``.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Iterable
from typing import Any, NamedTuple, TypeGuard

from smstore.errors import DaemonError

__all__ = [
    "BAD_REQUEST",
    "BUSY",
    "CHECKSUM",
    "CHECKSUM_WORDING",
    "CODES",
    "LOAD_FAILED",
    "MAX_CACHE_CHUNK_BYTES",
    "MAX_CACHE_RECORDS",
    "MAX_CACHE_ROWS",
    "MAX_HOLD",
    "MAX_MESSAGE",
    "MAX_WAIT",
    "NOT_FOUND",
    "NOT_SERVED",
    "NO_ROOM",
    "PERMISSION_DENIED",
    "REMOTE_WAIT",
    "STATUS_PAGE",
    "TOO_LARGE",
    "CacheRequest",
    "Location",
    "Piece",
    "ProtocolError",
    "cache_arg",
    "checksum_arg",
    "checksum_in",
    "checksums_arg",
    "dataset_arg",
    "decode_body",
    "encode",
    "frame",
    "frame_length",
    "held_arg",
    "hold_arg",
    "is_checksum",
    "is_utf8",
    "key_arg",
    "manifest_value",
    "not_served",
    "page_arg",
    "parse_request",
    "path_arg",
    "path_value",
    "piece_id",
    "piece_path",
    "pieces_value",
    "refusal",
]

# ---- framing --------------------------------------------------------------------------------------

# Requests and replies are tiny (a status of thousands of segments fits); anything larger is hostile.
MAX_MESSAGE = 1 << 20
_LEN = struct.Struct(">I")


def frame(body: bytes) -> bytes:
    """``body`` as one frame: its 4-byte big-endian length, then the body."""
    return _LEN.pack(len(body)) + body


def frame_length(buf: bytes | bytearray) -> int:
    """The body length announced by the first 4 bytes of buf."""
    return int(_LEN.unpack_from(buf)[0])


def encode(message: dict[str, Any]) -> bytes:
    """One frame: a 4-byte big-endian length, then that many bytes of UTF-8 JSON.

    Raises:
        DaemonError: The message is longer than `MAX_MESSAGE`.
    """
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE:
        msg = f"message of {len(body)} bytes exceeds the {MAX_MESSAGE}-byte limit"
        raise DaemonError(msg)
    return frame(body)


def decode_body(body: bytes | bytearray) -> dict[str, Any]:
    """Parse a frame body; ValueError unless it is a JSON object."""
    obj = json.loads(body.decode("utf-8"))
    if not isinstance(obj, dict):
        msg = "a message must be a JSON object"
        raise ValueError(msg)  # noqa: TRY004 - callers treat every malformed message alike
    return obj


# ---- error codes: the one table ------------------------------------------------------------------

BAD_REQUEST = "bad_request"
TOO_LARGE = "too_large"
BUSY = "busy"
PERMISSION_DENIED = "permission_denied"
NOT_SERVED = "not_served"
NOT_FOUND = "not_found"
NO_ROOM = "no_room"
LOAD_FAILED = "load_failed"

CODES = {
    BAD_REQUEST: "the request is malformed, or an argument is invalid (the message says which)",
    TOO_LARGE: "the request is longer than the daemon accepts; the connection is closed",
    BUSY: "every connection is in use; an owner's refusal carries retry_within (seconds)",
    PERMISSION_DENIED: "this uid may not use the daemon, or not this operation (owner only)",
    NOT_SERVED: "no segment holds what was asked for; a held shard's refusal carries the reason",
    NOT_FOUND: "a file the request names does not exist",
    NO_ROOM: "it does not fit the daemon's --shm-limit",
    LOAD_FAILED: "a held shard cannot be loaded (the reason follows)",
}


class ProtocolError(Exception):
    """A request that cannot be served as sent; `error` is the reply's code (one of `CODES`)."""

    def __init__(self, error: str, message: str) -> None:
        super().__init__(message)
        self.error = error


def refusal(error: str, message: str, **extra: Any) -> dict[str, Any]:
    """The one form of a refusing reply."""
    return {"ok": False, "error": error, "message": message, **extra}


def not_served(what: str, why: str | None = None) -> dict[str, Any]:
    """The one refusal of something the daemon does not serve (now, and not later either).

    `why`: the reason a held shard is not served (its load failed, the owner unloaded it), also
    sent alone as ``"reason"`` so that a client needs no parsing of the message.
    """
    message = f"no segment holds {what}" + (f": {why}" if why else "")
    return refusal(NOT_SERVED, message, reason=why)


# ---- pieces: what a hold names -------------------------------------------------------------------


class Piece(NamedTuple):
    """Records ``[first, end)`` of shard ``shard`` (indices within the shard); ``end`` None: the
    whole shard, which is the piece of all its records (served as the shard's own blob)."""

    shard: int
    first: int = 0
    end: int | None = None

    @property
    def whole(self) -> bool:
        return self.end is None

    @property
    def stop(self) -> int:
        """``end`` of a record range (a whole shard's end is its record count, which only its manifest knows)."""
        if self.end is None:
            msg = f"shard {self.shard} is held whole: its end is its manifest's record count"
            raise ValueError(msg)
        return self.end


def piece_id(shard_checksum: str, first: int, end: int | None) -> str:
    """The daemon's name for a piece: a whole shard's is its checksum; a record range's, 16 hex
    digits, as a checksum is written (never a blob's own)."""
    if end is None:
        return shard_checksum
    return hashlib.blake2b(f"block:{shard_checksum}:{first}:{end}".encode(), digest_size=8).hexdigest()


def piece_path(shard_path: str, first: int, end: int | None) -> str:
    """What the daemon's loads and logs call a piece: its shard's absolute path (or URL), and a
    record range's range."""
    if end is None:
        return shard_path
    return f"{shard_path}#records={first}-{end}"


def pieces_value(pieces: Iterable[Piece | int]) -> str:
    """A hold's ``"pieces"``: ``k`` for whole shard ``k``, ``k:first:end`` for records of it, comma-separated."""
    return ",".join(
        str(p) if isinstance(p, int) else str(p.shard) if p.end is None else f"{p.shard}:{p.first}:{p.end}"
        for p in pieces
    )


def _piece(item: str, *, whole_only: bool) -> Piece:
    """One piece as `pieces_value` writes it (ValueError if it is not one)."""
    numbers = [int(x) for x in item.split(":")]
    if numbers[0] < 0 or len(numbers) not in ((1,) if whole_only else (1, 3)):
        raise ValueError(item)
    if len(numbers) == 1:
        return Piece(numbers[0])
    shard, first, end = numbers
    if not 0 <= first < end:
        raise ValueError(item)
    return Piece(shard, first, end)


# ---- requests and their arguments ---------------------------------------------------------------

# At most this many pieces in one 'hold' (a window and the next of a large dataset fit many times).
MAX_HOLD = 65536

# The longest a 'held' request may wait for a change (seconds): a parked request never pins a
# connection for longer, and a client's timeout for it is this and a margin.
MAX_WAIT = 60.0

# How long a reader waits for a shard (or block) in object storage to be served: it has no file to
# read instead, and the hold that makes the daemon fetch it may still be on its way.
REMOTE_WAIT = 600.0

# A status reply lists at most this many segments (a page: the request's "offset" asks for the next).
STATUS_PAGE = 1000

# A content key of a shared blob, e.g. "blake2b-128:<32 hex>" (SharedList's hash of its records).
_KEY_RE = re.compile(r"^[a-z0-9-]{1,32}:[0-9a-f]{16,128}$")


def parse_request(body: bytes) -> dict[str, Any]:
    """A request body as a flat JSON object of scalars (strings, numbers, booleans, null).

    Raises:
        ProtocolError: Anything else: not UTF-8, not JSON, nested too deep for the parser, not an
            object, or holding a list or object as a value.
    """
    try:
        obj = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        # RecursionError: deep nesting ([[[[...) exhausts the parser's stack; refused like any junk.
        raise ProtocolError(BAD_REQUEST, f"malformed message: {type(e).__name__}: {e}"[:300]) from None
    if not isinstance(obj, dict):
        raise ProtocolError(BAD_REQUEST, "a request must be a JSON object")
    if not all(isinstance(v, (str, int, float, bool)) or v is None for v in obj.values()):
        raise ProtocolError(BAD_REQUEST, "a request's values must be strings, numbers, booleans or null")
    return obj


# A blob's checksum as every part of smstore writes it: its XXH64 in 16 lowercase hex digits (the
# header's, as `_core` formats it). Requests, manifests, segment names and the command line check it
# with this pattern and nothing else; people see it as "xxh64:<digits>".
CHECKSUM = "[0-9a-f]{16}"
_CHECKSUM_RE = re.compile(CHECKSUM)
CHECKSUM_WORDING = "16 lowercase hex digits"


def is_checksum(value: object) -> TypeGuard[str]:
    """Whether `value` is a checksum as smstore writes it (`CHECKSUM`)."""
    return isinstance(value, str) and _CHECKSUM_RE.fullmatch(value) is not None


def checksum_in(text: str) -> str | None:
    """The checksum `text` gives, with or without its "xxh64:" prefix; None if it gives none."""
    digits = text.removeprefix("xxh64:")
    return digits if is_checksum(digits) else None


def checksum_arg(req: dict[str, Any]) -> str | None:
    value = req.get("checksum")
    if value is None:
        return None
    if not is_checksum(value):
        raise ProtocolError(BAD_REQUEST, f"'checksum' must be {CHECKSUM_WORDING}")
    return value


def checksums_arg(req: dict[str, Any]) -> list[str]:
    """A 'stale_blocks' request's segments a reader maps: ``"checksums"``, comma-separated."""
    value = req.get("checksums")
    if not isinstance(value, str) or len(value) > 17 * MAX_HOLD:
        raise ProtocolError(BAD_REQUEST, "'checksums' must be a string of comma-separated checksums")
    return value.split(",")


def key_arg(req: dict[str, Any], *, required: bool) -> str | None:
    value = req.get("key")
    if value is None and not required:
        return None
    if not (isinstance(value, str) and _KEY_RE.match(value)):
        raise ProtocolError(BAD_REQUEST, "'key' must be '<algorithm>:<16 to 128 hex digits>'")
    return value


def path_arg(req: dict[str, Any], *, required: bool) -> str | None:
    value = req.get("path")
    if value is None and not required:
        return None
    return path_value(value)


def is_utf8(text: str) -> bool:
    """Whether `text` is valid UTF-8 as a name: a file name that is not reaches Python as lone
    surrogates, which no reply, log line or the core can carry. smstore names files in UTF-8 only."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


class Location(NamedTuple):
    """A name a request gives, decided once where the request is parsed: an absolute path, or an
    object's URL (`remote`). The daemon carries the decision from here and never asks again."""

    name: str
    remote: bool


def _url(value: object) -> Location | None:
    """`value` if it names an object (`is_remote_url`, at most 4096 characters, UTF-8, no NUL);
    what it may name is the reader's check (``parse_url``)."""
    # Here, not at import: the clients import this module, and smstore.remote pulls in its fetching.
    from smstore.remote.urls import is_remote_url

    if (
        is_remote_url(value)
        and isinstance(value, str)
        and len(value) <= 4096
        and "\0" not in value
        and is_utf8(value)
    ):
        return Location(value, True)
    return None


def _location(req: dict[str, Any], *, required: bool) -> Location | None:
    """A request's 'path': an object's URL, or an absolute path."""
    url = _url(req.get("path"))
    if url is not None:
        return url
    path = path_arg(req, required=required)
    return None if path is None else Location(path, False)


def attach_path_arg(req: dict[str, Any]) -> Location | None:
    """An attach's 'path': a held shard's file, or its URL (only a name to wait on: nothing is read or fetched)."""
    return _location(req, required=False)


def load_path_arg(req: dict[str, Any], *, required: bool) -> Location | None:
    """A load's or unload's 'path': a blob's absolute path, or an object's URL (the daemon checks
    it with ``parse_url`` before it fetches anything)."""
    return _location(req, required=required)


def manifest_value(value: object) -> Location:
    """A request's 'manifest': an absolute path, or a dataset's URL (the daemon checks it with ``parse_url``)."""
    return _url(value) or Location(path_value(value), False)


def dataset_arg(req: dict[str, Any]) -> str | None:
    """A hold's 'dataset': the checksum of the manifest its client read (a dataset in object storage)."""
    value = req.get("dataset")
    if value is not None and not is_checksum(value):
        raise ProtocolError(BAD_REQUEST, f"'dataset' must be {CHECKSUM_WORDING}")
    return value


def path_value(value: object) -> str:
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value or len(value) > 4096:
        raise ProtocolError(BAD_REQUEST, "'path' must be an absolute path (at most 4096 characters, no NUL)")
    if not is_utf8(value):
        # Refused here, in the request, rather than in the loader thread.
        raise ProtocolError(BAD_REQUEST, f"'path' is not valid UTF-8: {value!r}")
    return value


def page_arg(req: dict[str, Any]) -> tuple[int, int]:
    """A 'status' request's page of segments: (offset, limit)."""
    offset, limit = req.get("offset", 0), req.get("limit", STATUS_PAGE)
    if type(offset) is not int or type(limit) is not int or offset < 0 or not 0 <= limit <= STATUS_PAGE:
        msg = f"'offset' must be an integer >= 0 and 'limit' one from 0 to {STATUS_PAGE}"
        raise ProtocolError(BAD_REQUEST, msg)
    return offset, limit


def hold_arg(req: dict[str, Any]) -> tuple[Location, list[Piece], bool, int]:
    """A 'hold' request: the manifest, the pieces of its shards in the order to load them,
    whether a reader holds them for itself (``"reader": true``) rather than a rank's sampler, and
    which holder of its connection holds them (``"holder"``, default 0): a process's samplers and
    readers share its one connection, and each hold replaces only what its own holder held.

    ``"pieces"`` lists them as `pieces_value` writes them. ``"shards"``, a list of whole shards
    only, is the same field under its former name (a client of an earlier release).
    """
    manifest = manifest_value(req.get("manifest"))
    field = "shards" if "shards" in req and "pieces" not in req else "pieces"
    value = req.get(field)
    wording = f"'{field}' must be a string of comma-separated pieces (a shard index, or shard:first:end)"
    if not isinstance(value, str) or len(value) > 64 * MAX_HOLD:
        raise ProtocolError(BAD_REQUEST, wording)
    try:
        pieces = [_piece(item, whole_only=field == "shards") for item in value.split(",")] if value else []
    except (TypeError, ValueError):
        raise ProtocolError(BAD_REQUEST, wording) from None
    if len(pieces) > MAX_HOLD:
        raise ProtocolError(BAD_REQUEST, f"'{field}' must hold at most {MAX_HOLD} pieces")
    holder = req.get("holder", 0)
    if type(holder) is not int or not 0 <= holder < 1 << 31:
        raise ProtocolError(BAD_REQUEST, "'holder' must be an integer from 0 to 2**31 - 1")
    return manifest, pieces, req.get("reader") is True, holder


def held_arg(req: dict[str, Any]) -> tuple[int | None, float, Location | None]:
    """A 'held' request: the version its client saw last (None: none yet), how long it may wait for a
    change, and the manifest of the one dataset it follows (None: every held shard)."""
    since, wait = req.get("since"), req.get("wait", 0)
    manifest = req.get("manifest")
    if since is not None and (type(since) is not int or since < 0):
        raise ProtocolError(BAD_REQUEST, "'since' must be an integer >= 0 (a 'version' the daemon sent)")
    if type(wait) not in (int, float) or not 0 <= wait <= MAX_WAIT:  # NaN fails the range check too
        raise ProtocolError(BAD_REQUEST, f"'wait' must be a number of seconds from 0 to {MAX_WAIT:g}")
    return since, float(wait), None if manifest is None else manifest_value(manifest)


# Bounds of a decoded cache's geometry ('cache' requests): records per chunk, bytes of a chunk,
# records in a cache.
MAX_CACHE_ROWS = 1 << 20
MAX_CACHE_CHUNK_BYTES = 1 << 34
MAX_CACHE_RECORDS = 1 << 40


class CacheRequest(NamedTuple):
    """A 'cache' request: chunk `chunk` (-1: the meta page) of the cache `cache` (64 hex digits) of
    `records` records, `rows` a chunk, each chunk `slot_bytes` bytes (claim words, then rows) but
    the last, `last_bytes` (it holds what is left). With `lookup` (``records`` 0, the rest absent):
    the meta page of a cache only if it exists, with its geometry (a process learning the layout)."""

    cache: str
    records: int
    rows: int
    slot_bytes: int
    last_bytes: int
    chunk: int

    @property
    def chunks(self) -> int:
        return -(-self.records // self.rows)

    def chunk_rows(self, chunk: int) -> int:
        """Records in chunk `chunk` (the last one holds what is left)."""
        return min(self.rows, self.records - chunk * self.rows)

    def chunk_bytes(self, chunk: int) -> int:
        return self.last_bytes if chunk == self.chunks - 1 else self.slot_bytes

    @property
    def lookup(self) -> bool:
        return self.records == 0


def cache_arg(req: dict[str, Any]) -> CacheRequest:
    """A 'cache' request's fields, checked: what a chunk holds must fit its bytes."""
    cache = req.get("cache")
    if not isinstance(cache, str) or re.fullmatch(r"[0-9a-f]{64}", cache) is None:
        raise ProtocolError(BAD_REQUEST, "'cache' must be 64 lowercase hex digits (the cache's identity)")
    if req.get("lookup") is True:
        if req.get("chunk", -1) != -1:
            raise ProtocolError(BAD_REQUEST, "a lookup asks for the meta page (chunk -1)")
        return CacheRequest(cache, 0, 1, 64, 64, -1)
    values = []
    for name, lo, hi in (
        ("records", 1, MAX_CACHE_RECORDS),
        ("rows", 1, MAX_CACHE_ROWS),
        ("slot_bytes", 64, MAX_CACHE_CHUNK_BYTES),
        ("last_bytes", 64, MAX_CACHE_CHUNK_BYTES),
        ("chunk", -1, MAX_CACHE_RECORDS),
    ):
        value = req.get(name)
        if type(value) is not int or not lo <= value <= hi:
            raise ProtocolError(BAD_REQUEST, f"'{name}' must be an integer from {lo} to {hi}")
        values.append(value)
    got = CacheRequest(cache, *values)
    last = got.chunk_rows(got.chunks - 1)
    if got.slot_bytes % 64 or got.slot_bytes < 8 * got.rows:
        raise ProtocolError(
            BAD_REQUEST, "'slot_bytes' must be a multiple of 64 holding 8 bytes a row at least"
        )
    if got.last_bytes % 64 or not 8 * last <= got.last_bytes <= got.slot_bytes:
        raise ProtocolError(
            BAD_REQUEST,
            "'last_bytes' must be a multiple of 64 holding 8 bytes a row of the last chunk, at most 'slot_bytes'",
        )
    if got.chunk >= got.chunks:
        raise ProtocolError(BAD_REQUEST, f"no chunk {got.chunk}: the cache has {got.chunks}")
    return got
