"""Object-storage URLs: the scheme allow-list and the one parser every remote call goes through."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from smstore.errors import RemoteNeedsDaemonError, RemoteURLError

__all__ = ["SCHEMES", "RemoteURL", "is_remote_url", "needs_daemon", "parse_url"]

# The only schemes smstore fetches from or uploads to. Everything else (file:, http:, memory:,
# abfs:, gcs: ...) is refused, so a URL taken from a manifest cannot reach a local file or a
# plain-text endpoint.
SCHEMES = ("s3", "gs", "az", "https")
MAX_URL = 2048
# S3, GCS and Azure bucket / container names: lowercase letters, digits, dots and hyphens, starting
# and ending with a letter or digit (each cloud narrows this further; the server refuses the rest).
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,220}[a-z0-9]")
_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?(?::[0-9]{1,5})?")
# Printable ASCII without space, backslash, quotes, angle brackets, braces, pipe, caret, backtick.
_URL_CHARS = re.compile(r"[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]*")


@dataclass(frozen=True)
class RemoteURL:
    """A checked object-storage URL.

    Attributes:
        scheme: One of ``SCHEMES``.
        bucket: The bucket (s3, gs), container (az) or host[:port] (https).
        key: The object's key (or a prefix ending in ``/``); never starts with ``/``.
    """

    scheme: str
    bucket: str
    key: str

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}"

    def join(self, name: str) -> RemoteURL:
        """The URL of the object `name` (a relative key such as a shard's file name) under this prefix."""
        if self.key and not self.key.endswith("/"):
            raise RemoteURLError(f"{self}: names an object, not a prefix ending in '/'")
        return parse_url(f"{self.scheme}://{self.bucket}/{self.key}{name}")


def _redact(url: str) -> str:
    """`url` safe to show: its query and fragment cut off, anything up to its last '@' as ``***@``.

    Up to the last '@', not only the host's userinfo: a secret key may hold a '/' (AWS's do), which
    would end the host early and leave the rest of the secret in the path.
    """
    head, sep, rest = url.partition("://")
    rest = re.split(r"[?#]", rest, maxsplit=1)[0]
    if "@" in rest:
        rest = "***@" + rest.rsplit("@", 1)[1]
    return head + sep + rest


def _refuse(url: str, fault: str) -> RemoteURLError:
    # Redacted before it is cut: a cut could drop the '@' and leave the secret before it.
    shown = _redact(url)
    shown = shown if len(shown) <= 200 else shown[:200] + "..."
    # repr() shows control characters escaped.
    return RemoteURLError(f"{shown!r}: {fault}")


def is_remote_url(value: object) -> bool:
    """Whether `value` is a string that names object storage (``scheme://``): a path never does.

    smstore's one "is it a URL?": asked where a user's string enters (``smstore.open``, a
    dataset, ``read_manifest``, the command line); past that the answer travels as data (a
    manifest's shard sources, :class:`smstore.format.manifest.Source`).
    """
    return isinstance(value, str) and _SCHEME.match(value) is not None


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")  # compiled once: a manifest asks once a shard


def needs_daemon(
    url: str, what: str = "an object", *, why: str = "", part: str = ""
) -> RemoteNeedsDaemonError:
    """The one error for object storage reached without the node daemon (only ``smstore serve`` fetches).

    Args:
        url: The object (or dataset) reached; shown redacted, as every URL error shows it.
        what: What it is, for the message ("a dataset", "a shard", "a blob").
        why: What stood in the way (no daemon answers on the socket, ``mode="mmap"``).
        part: What of the object was read (a block's ``#records=a-b``), shown after it.
    """
    msg = (
        f"{_redact(url)}{part}: {what} in object storage is read through the node daemon: start "
        "'smstore serve' (with --cache-dir DIR --cache-limit SIZE to keep it on the node)"
    )
    return RemoteNeedsDaemonError(f"{msg}; {why}" if why else msg)


def parse_url(url: str, *, prefix: bool = False) -> RemoteURL:
    """Check `url` and split it into scheme, bucket and key.

    Args:
        url: ``s3://bucket/key``, ``gs://bucket/key``, ``az://container/key`` or ``https://host/path``.
        prefix: Whether `url` names a prefix (a dataset's directory, ending in ``/``) rather than one
            object; an object's key must not end in ``/``.

    Returns:
        The parsed URL.

    Raises:
        RemoteURLError: The URL names a scheme off the allow-list, holds userinfo (``user:pass@``),
            a query or fragment (credentials come from the environment, never from a URL), control
            characters, spaces or non-ASCII text, empty or ``.``/``..`` path segments, or a bad bucket.
    """
    if not isinstance(url, str):
        raise RemoteURLError(f"a URL must be a str, not {type(url).__name__}")
    if len(url) > MAX_URL:
        raise _refuse(url, f"longer than {MAX_URL} characters")
    if not _URL_CHARS.fullmatch(url):
        raise _refuse(
            url, "holds a control character, space, non-ASCII or other character a URL may not hold"
        )
    scheme, sep, _ = url.partition("://")
    if not sep:
        raise _refuse(
            url, f"not a URL: expected scheme://..., one of {', '.join(s + '://' for s in SCHEMES)}"
        )
    if scheme not in SCHEMES:
        raise _refuse(
            url, f"scheme {scheme!r} is not allowed; use one of {', '.join(s + '://' for s in SCHEMES)}"
        )
    if "?" in url or "#" in url:
        raise _refuse(
            url,
            "a query or fragment is not allowed (credentials come from the environment, never from a URL)",
        )
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        raise _refuse(
            url, "userinfo (user:password@) is not allowed: credentials come from the cloud's environment"
        )
    # A host cut short by a '/' in a secret (user:se/cret@bucket) would show the secret's start.
    named = "" if "@" in url else f" {netloc!r}"
    if scheme == "https":
        if not _HOST.fullmatch(netloc):
            raise _refuse(url, f"bad host{named}")
    elif not _BUCKET.fullmatch(netloc) or ".." in netloc:
        raise _refuse(url, f"bad bucket name{named}: 3-222 lowercase letters, digits, dots and hyphens")
    key = parts.path.removeprefix("/")
    if prefix:
        if key and not key.endswith("/"):
            key += "/"
        segments = key.split("/")[:-1] if key else []
    else:
        if not key or key.endswith("/"):
            raise _refuse(url, "names no object (the key is empty or ends in '/')")
        segments = key.split("/")
    for seg in segments:
        if seg in ("", ".", ".."):
            raise _refuse(url, "empty, '.' or '..' path segments are not allowed")
    return RemoteURL(scheme, netloc, key)
