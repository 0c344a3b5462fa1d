"""What a client's request to the daemon may hold: each argument checked, a bad one refused as `bad_request`."""

from __future__ import annotations

import re
from typing import Any

from smstore.daemon.connections import ProtocolError

__all__ = [
    "MAX_HOLD",
    "STATUS_PAGE",
    "checksum_arg",
    "hold_arg",
    "key_arg",
    "not_served",
    "page_arg",
    "path_arg",
]

# At most this many shards in one 'hold' (a window and the next of a large dataset fit many times).
MAX_HOLD = 65536

# A status reply lists at most this many segments (a page: the request's "offset" asks for the next).
STATUS_PAGE = 1000


def checksum_arg(req: dict[str, Any]) -> str | None:
    value = req.get("checksum")
    if value is None:
        return None
    if not (isinstance(value, str) and len(value) == 16 and all(c in "0123456789abcdef" for c in value)):
        raise ProtocolError("bad_request", "'checksum' must be 16 lowercase hex digits")
    return value


# A content key of a shared blob, e.g. "blake2b-128:<32 hex>" (SharedList's hash of its records).
_KEY_RE = re.compile(r"^[a-z0-9-]{1,32}:[0-9a-f]{16,128}$")


def key_arg(req: dict[str, Any], *, required: bool) -> str | None:
    value = req.get("key")
    if value is None and not required:
        return None
    if not (isinstance(value, str) and _KEY_RE.match(value)):
        raise ProtocolError("bad_request", "'key' must be '<algorithm>:<16 to 128 hex digits>'")
    return value


def path_arg(req: dict[str, Any], *, required: bool) -> str | None:
    value = req.get("path")
    if value is None and not required:
        return None
    return path_value(value)


def path_value(value: object) -> str:
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value or len(value) > 4096:
        raise ProtocolError(
            "bad_request", "'path' must be an absolute path (at most 4096 characters, no NUL)"
        )
    try:
        value.encode()
    except UnicodeEncodeError:
        # A file name that is not UTF-8 reaches us as lone surrogates: refuse it here, in the request,
        # rather than in the loader thread.
        raise ProtocolError("bad_request", f"'path' is not valid UTF-8: {value!r}") from None
    return value


def not_served(what: str, why: str | None = None) -> dict[str, Any]:
    """The one refusal of an attach the daemon cannot serve (now, and not later either)."""
    message = f"no segment holds {what}" + (f": {why}" if why else "")
    return {"ok": False, "error": "not_served", "message": message}


def page_arg(req: dict[str, Any]) -> tuple[int, int]:
    """A 'status' request's page of segments: (offset, limit)."""
    offset, limit = req.get("offset", 0), req.get("limit", STATUS_PAGE)
    if type(offset) is not int or type(limit) is not int or offset < 0 or not 0 <= limit <= STATUS_PAGE:
        msg = f"'offset' must be an integer >= 0 and 'limit' one from 0 to {STATUS_PAGE}"
        raise ProtocolError("bad_request", msg)
    return offset, limit


def hold_arg(req: dict[str, Any]) -> tuple[str, list[int]]:
    """A 'hold' request: the manifest, and the indices of its shards in the order to load them."""
    manifest = path_value(req.get("manifest"))
    value = req.get("shards")
    if not isinstance(value, str) or len(value) > 16 * MAX_HOLD:
        raise ProtocolError("bad_request", "'shards' must be a string of comma-separated shard indices")
    try:
        shards = [int(k) for k in value.split(",")] if value else []
    except ValueError:
        raise ProtocolError(
            "bad_request", "'shards' must be a string of comma-separated shard indices"
        ) from None
    if len(shards) > MAX_HOLD or any(k < 0 for k in shards):
        raise ProtocolError("bad_request", f"'shards' must hold at most {MAX_HOLD} indices, each >= 0")
    return manifest, shards
