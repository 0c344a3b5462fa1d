"""A JSON list of objects (COCO-style annotation lists) -> one object record each, streamed.

The file is read in chunks and decoded one element at a time (``json.JSONDecoder.raw_decode``),
so memory holds one element and one chunk, never the whole list.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

from smstore._objects import OBJECT_ENCODINGS, encode_objects
from smstore._pack import PackStats
from smstore.convert._common import _Progress, write_records
from smstore.errors import PackInputError

__all__ = ["convert_json_list", "iter_json_list"]

CHUNK = 1 << 20
_WS = " \t\r\n"


class _Reader:
    """A window over a JSON text read in chunks: decode one value at a time, drop what is done."""

    def __init__(self, f: Any, path: str, max_element: int) -> None:
        self.f = f
        self.path = path
        self.max_element = max_element
        self.buf = ""
        self.base = 0  # characters dropped before buf
        self.eof = False
        self.decoder = json.JSONDecoder()
        self.fill()

    def fill(self) -> bool:
        if self.eof:
            return False
        more = self.f.read(CHUNK)
        if not more:
            self.eof = True
            return False
        self.buf += more
        return True

    def error(self, pos: int, what: str) -> PackInputError:
        return PackInputError(f"{self.path}: character {self.base + pos}: {what}")

    def skip_ws(self, pos: int) -> int:
        while True:
            while pos < len(self.buf) and self.buf[pos] in _WS:
                pos += 1
            if pos < len(self.buf) or not self.fill():
                return pos

    def peek(self, pos: int) -> str:
        return self.buf[pos] if pos < len(self.buf) else ""

    def decode(self, pos: int, what: str) -> tuple[Any, int]:
        """The value at `pos` and the position after it, reading more of the file as needed."""
        while True:
            try:
                value, end = self.decoder.raw_decode(self.buf, pos)
            except json.JSONDecodeError as e:
                truncated = e.pos >= len(self.buf) - 64 or e.msg.startswith("Unterminated")
                if truncated and len(self.buf) - pos <= self.max_element and self.fill():
                    continue
                if truncated and not self.eof:
                    raise self.error(pos, f"{what} is larger than {self.max_element} characters") from None
                raise self.error(e.pos, f"{what}: {e.msg}") from None
            if end == len(self.buf) and self.fill():
                continue  # a number may go on in the next chunk: decode it whole
            return value, end

    def drop(self, pos: int) -> int:
        """Forget the text before `pos` once it is long enough to be worth copying the rest."""
        if pos > CHUNK:
            self.base += pos
            self.buf = self.buf[pos:]
            return 0
        return pos


def iter_json_list(
    path: str,
    *,
    key: str | None = None,
    max_element: int = 1 << 30,
    on_progress: Callable[[int], None] | None = None,
) -> Iterator[Any]:
    """The objects of the JSON list in `path` (or of the list under top-level `key`), one at a time.

    `on_progress(n)`, if given, is called now and then with the characters read so far.

    Raises:
        PackInputError: The file is not a JSON list of objects, naming the character offset.
    """
    with open(path, encoding="utf-8", errors="surrogatepass") as f:
        r = _Reader(f, path, max_element)
        pos = r.skip_ws(0)
        if key is not None:
            # {"images": [...], ...}: skip the top-level values before `key`, one at a time.
            if r.peek(pos) != "{":
                raise r.error(pos, f"expected a JSON object holding {key!r}")
            pos = r.skip_ws(pos + 1)
            while True:
                if r.peek(pos) != '"':
                    raise r.error(pos, f"no top-level key {key!r}")
                name, pos = r.decode(pos, "a key")
                pos = r.skip_ws(pos)
                if r.peek(pos) != ":":
                    raise r.error(pos, "expected ':' in the top-level object")
                pos = r.skip_ws(pos + 1)
                if name == key:
                    break
                _, pos = r.decode(pos, f"the value of {name!r}")
                pos = r.drop(r.skip_ws(pos))
                if r.peek(pos) == ",":
                    pos = r.skip_ws(pos + 1)
        if r.peek(pos) != "[":
            raise r.error(pos, "expected a JSON list '['")
        pos = r.skip_ws(pos + 1)
        if r.peek(pos) == "]":
            return
        index = 0
        while True:
            value, end = r.decode(pos, f"element {index}")
            if not isinstance(value, dict):
                raise r.error(pos, f"element {index} is a {type(value).__name__}, not an object")
            yield value
            index += 1
            if on_progress is not None and index % 1024 == 0:
                on_progress(r.base + end)
            pos = r.skip_ws(end)
            c = r.peek(pos)
            if c == "]":
                if key is None and r.skip_ws(pos + 1) < len(r.buf):
                    raise r.error(r.skip_ws(pos + 1), "data after the end of the list")
                return
            if c != ",":
                raise r.error(pos, f"expected ',' or ']' after element {index - 1}")
            pos = r.skip_ws(r.drop(pos + 1))


def convert_json_list(
    source: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    key: str | None = None,
    encoding: str = "pickle",
    metadata: dict[str, Any] | None = None,
    shard_size: int | None = None,
    durable: bool = True,
    progress: bool | None = None,
) -> PackStats:
    """Convert a JSON list of objects into a blob of object records (``pickle`` or ``json``).

    Args:
        source: A ``.json`` file holding a list of objects, or (with ``key``) an object holding one,
            as COCO files hold ``"images"`` and ``"annotations"``.
        key: The top-level key whose list to convert.

    Raises:
        PackInputError: Not a list of objects, or malformed JSON, naming the character offset.
    """
    if encoding not in OBJECT_ENCODINGS:
        raise PackInputError(f"encoding must be one of {', '.join(OBJECT_ENCODINGS)}, not {encoding!r}")
    path = os.fspath(source)
    if not os.path.isfile(path):
        raise PackInputError(f"{path}: no such file")
    size = os.path.getsize(path)
    bar = _Progress(size, progress, "convert")
    return write_records(
        encode_objects(iter_json_list(path, key=key, on_progress=bar.update), encoding),
        output,
        encoding=encoding,
        source=[path],
        metadata=metadata,
        durable=durable,
        shard_size=shard_size,
        input_bytes=size,
        bar=bar,
    )
