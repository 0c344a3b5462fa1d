"""A JSON list of objects (COCO-style annotation lists) -> one object record each, streamed.

The file is decoded a chunk at a time. An element that lies inside the chunk is decoded there
(``json.JSONDecoder.raw_decode``); one that runs past it is first walked to its end by a scan of
strings, escapes and bracket depth (vectorised with numpy over the chunk), then its text is
decoded once, so no element is ever parsed twice. Top-level lists and objects other than the
selected list are walked by the same scan and never built (their structure is checked, not their
contents). Memory holds one chunk and the largest element, whatever the size of what is skipped.
"""

from __future__ import annotations

import codecs
import json
import os
import re
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

import numpy as np

from smstore._objects import OBJECT_ENCODINGS, encode_objects
from smstore._pack import PackStats
from smstore.convert._common import _Progress, write_records
from smstore.errors import PackInputError

__all__ = ["MAX_DEPTH", "convert_json_list", "iter_json_list"]

CHUNK = 1 << 20  # bytes read (and characters scanned) at a time
# Lists and objects a file may nest, the top level's included: the limit of the C++ JSON checker
# (csrc/json_check.cpp), well inside what Python's recursive json decoder survives.
MAX_DEPTH = 512
# A value's scan starts at a small window, so walking many small values costs no chunk each, and
# grows to a bound that keeps the scan's temporary arrays small.
_FIRST_WINDOW, _LAST_WINDOW = 1 << 12, 1 << 18
_CHECKED = 1 << 20  # a top-level scalar or string value skipped is decoded (checked) up to this size
_WS = re.compile(r"[ \t\n\r]*")
_SCALAR = re.compile(r'[^ \t\n\r,:\[\]{}"]*')  # a number or literal runs until one of these
_OPEN, _CLOSE, _QUOTE, _BACKSLASH = ord("{"), ord("}"), ord('"'), ord("\\")


def _run_end(run: re.Pattern[str], text: str, pos: int) -> int:
    """Where a run of `run` (a pattern that matches the empty string too) starting at `pos` ends."""
    m = run.match(text, pos)
    return m.end() if m else pos


class _Text:
    """The file's text, decoded a chunk at a time: ``text[pos]`` is character ``base + pos``."""

    def __init__(self, f: BinaryIO, path: str) -> None:
        self.f = f
        self.path = path
        head = f.read(max(CHUNK, 4))
        # The encodings json.loads accepts for bytes (UTF-8 with or without a BOM, UTF-16, UTF-32).
        self.encoding = json.detect_encoding(head)
        skip = 0
        if self.encoding == "utf-8-sig":
            self.encoding, skip = "utf-8", len(codecs.BOM_UTF8)
        self.decoder = codecs.getincrementaldecoder(self.encoding)("surrogatepass")
        self.fed = skip  # bytes handed to the decoder so far
        self.text = ""
        self.pos = 0
        self.base = 0
        self.eof = False
        self._codes: np.ndarray[Any, Any] | None = None
        self._append(head[skip:])

    def _decode(self, data: bytes, final: bool) -> str:
        held = len(self.decoder.getstate()[0])  # bytes of a character the last chunk cut in two
        try:
            text: str = self.decoder.decode(data, final)
        except UnicodeDecodeError as e:
            at = self.fed - held + e.start
            raise PackInputError(f"{self.path}: byte {at}: invalid {self.encoding}: {e.reason}") from None
        self.fed += len(data)
        return text

    def _append(self, data: bytes) -> bool:
        while True:
            if not data:
                self.eof = True
            more = self._decode(data, final=self.eof)
            if more:
                self.base += len(self.text)
                self.text, self.pos, self._codes = more, 0, None
                return True
            if self.eof:
                return False
            data = self.f.read(CHUNK)

    def advance(self) -> bool:
        """Drop the current chunk for the next one; False (nothing changed) at the end of the file."""
        return not self.eof and self._append(self.f.read(CHUNK))

    def skip_ws(self) -> str:
        """The next character that is not JSON whitespace ("" at the end), moving `pos` to it."""
        while True:
            self.pos = _run_end(_WS, self.text, self.pos)
            if self.pos < len(self.text) or not self.advance():
                return self.text[self.pos : self.pos + 1]

    def codes(self) -> np.ndarray[Any, Any]:
        """The chunk's characters as integers (computed once per chunk)."""
        if self._codes is None:
            try:  # one byte a character where they all fit (a copy); four otherwise
                self._codes = np.frombuffer(self.text.encode("latin-1"), np.uint8)
            except UnicodeEncodeError:
                self._codes = np.frombuffer(self.text.encode("utf-32-le", "surrogatepass"), "<u4")
        return self._codes

    def error(self, pos: int, what: str) -> PackInputError:
        return PackInputError(f"{self.path}: character {self.base + pos}: {what}")


class _Scan:
    """Finds where a list, object or string ends, window by window, carrying its state between them.

    Brackets inside strings do not count; a quote is escaped after an odd run of backslashes. Only
    the structure is checked here (what lies between is left to the decoder, or skipped).
    """

    def __init__(self, string: bool, depth_limit: int) -> None:
        self.string = string  # a string value: it ends at the first unescaped quote
        self.in_string = string
        self.odd = False  # the window before ended in an odd run of backslashes
        self.depth = 0
        self.limit = depth_limit

    def feed(self, a: np.ndarray[Any, Any]) -> tuple[int, int]:
        """(index just after the value's end in `a`, or -1; index of a bracket nesting too deep, or -1)."""
        n = len(a)
        quotes = np.flatnonzero(a == _QUOTE)
        bs = a == _BACKSLASH
        odd = False
        if self.odd or bs[-1] or (quotes.size and bool(bs.any())):
            runs = np.flatnonzero(bs & ~np.concatenate(([False], bs[:-1])))  # first backslash of each run
            carry = int(self.odd)
            after = np.flatnonzero(bs[quotes - 1] & (quotes > 0))  # quotes just after a backslash
            if after.size:
                q = quotes[after]
                start = runs[np.searchsorted(runs, q - 1, "right") - 1]
                escaped = np.zeros(quotes.size, bool)
                escaped[after] = (q - start + np.where(start == 0, carry, 0)) % 2 == 1
                quotes = quotes[~escaped]
            if carry and quotes.size and quotes[0] == 0:
                quotes = quotes[1:]
            if bs[-1]:
                odd = bool((n - runs[-1] + (carry if runs[-1] == 0 else 0)) % 2)
        self.odd = odd
        if self.string:
            if quotes.size:
                return int(quotes[0]) + 1, -1
            return -1, -1
        folded = a | 32  # '[' -> '{', ']' -> '}': one comparison finds both kinds
        brackets = np.flatnonzero((folded == _OPEN) | (folded == _CLOSE))
        if brackets.size and quotes.size:
            outside = (np.searchsorted(quotes, brackets) + self.in_string) % 2 == 0
            brackets = brackets[outside]
        elif self.in_string:
            brackets = brackets[:0]
        self.in_string = bool((self.in_string + quotes.size) % 2)
        if not brackets.size:
            return -1, -1
        depth = self.depth + np.cumsum(np.where(folded[brackets] == _OPEN, 1, -1))
        closed = np.flatnonzero(depth == 0)
        upto = int(closed[0]) if closed.size else len(depth)
        deep = np.flatnonzero(depth[:upto] > self.limit)
        if deep.size:
            return -1, int(brackets[deep[0]])
        if closed.size:
            return int(brackets[upto]) + 1, -1
        self.depth = int(depth[-1])
        return -1, -1


class _Reader:
    """Walks a JSON text: values skipped without being built, elements decoded once each."""

    def __init__(self, t: _Text, max_element: int, on_progress: Callable[[int], None] | None) -> None:
        self.t = t
        self.max_element = max_element
        self.on_progress = on_progress
        self.decoder = json.JSONDecoder()

    def walk(self, keep: int, what: str, depth: int, *, element: bool = False) -> str | None:
        """Move past the value at ``t.pos``; its text if at most `keep` characters, else None.

        `depth` is the nesting around the value. An `element` longer than `keep` raises; any other
        value is walked to its end in bounded memory (and reports progress: it is being skipped).
        """
        t = self.t
        start, first = t.pos, t.text[t.pos]
        begin = t.base + start
        if first == '"':  # most strings end at the next quote: no scan needed
            q = t.text.find('"', start + 1)
            if q > 0 and t.text[q - 1] != "\\" and (q + 1 - start <= keep or not element):
                t.pos = q + 1
                return t.text[start : q + 1] if q + 1 - start <= keep else None
        pieces: list[str] = []
        kept = 0  # characters of the value in the chunks before this one
        scan = None if first not in '{["' else _Scan(first == '"', MAX_DEPTH - depth)
        p = start + 1 if first == '"' else start
        window = _FIRST_WINDOW
        while True:
            end = -1
            if scan is None:
                end = _run_end(_SCALAR, t.text, p)
                if end == start and kept == 0:
                    raise t.error(start, f"{what}: expected a value")
                if end == len(t.text) and not t.eof:
                    end = -1  # a number may go on in the next chunk
            else:
                a = t.codes()
                while p < len(a):
                    stop = min(len(a), p + window)
                    window = min(2 * window, _LAST_WINDOW)
                    end, deep = scan.feed(a[p:stop])
                    if deep >= 0:
                        raise t.error(p + deep, f"{what}: lists and objects nested deeper than {MAX_DEPTH}")
                    if end >= 0:
                        end += p
                        break
                    p = stop
            size = kept + (end if end >= 0 else len(t.text)) - start
            if size <= keep:
                pieces.append(t.text[start:] if end < 0 else t.text[start:end])
            elif element:
                raise PackInputError(f"{t.path}: character {begin}: {what} is larger than {keep} characters")
            else:
                pieces.clear()
            if end >= 0:
                t.pos = end
                return "".join(pieces) if size <= keep else None
            kept = size
            if not t.advance():
                if scan is None:  # a number or literal that ends the file
                    t.pos = len(t.text)
                    return "".join(pieces) if size <= keep else None
                kind = "string" if scan.string else "list or object"
                raise PackInputError(f"{t.path}: character {begin}: {what}: the {kind} is not closed")
            if not element and self.on_progress is not None:
                self.on_progress(t.base)
            start = p = 0

    def decode(self, text: str, pos: int, begin: int, what: str) -> tuple[Any, int]:
        """``raw_decode(text, pos)``; faults named at their character (`text[0]` is `begin`)."""
        try:
            return self.decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise PackInputError(f"{self.t.path}: character {begin + e.pos}: {what}: {e.msg}") from None
        except RecursionError:
            msg = f"{what}: nested deeper than Python's recursion limit allows"
            raise PackInputError(f"{self.t.path}: character {begin + pos}: {msg}") from None
        except ValueError as e:  # a number of more digits than int() takes
            raise PackInputError(f"{self.t.path}: character {begin + pos}: {what}: {e}") from None

    def decode_whole(self, text: str, begin: int, what: str) -> Any:
        """The value `text` holds, all of it (`text[0]` is character `begin`)."""
        value, end = self.decode(text, 0, begin, what)
        if end != len(text):
            raise PackInputError(
                f"{self.t.path}: character {begin + end}: {what}: extra data after the value"
            )
        return value

    def skip(self, what: str) -> None:
        """Move past a top-level value without building it.

        A number, literal or string of at most ``_CHECKED`` characters is decoded, so checked as
        ``json.load`` checks it; a list, an object or a longer string is walked (its structure
        checked).
        """
        t = self.t
        if t.text[t.pos] in "[{":
            self.walk(0, what, 1)
            return
        begin = t.base + t.pos
        text = self.walk(_CHECKED, what, 1)
        if text is not None:
            self.decode_whole(text, begin, what)

    def key(self, longest: int) -> str | None:
        """The key string at ``t.pos`` (None if longer than `longest` characters); moves past it."""
        t = self.t
        try:
            name, end = self.decoder.raw_decode(t.text, t.pos)
        except ValueError:
            pass  # it runs past the chunk, or is bad: found below
        else:
            t.pos = end
            return str(name)
        begin = t.base + t.pos
        text = self.walk(longest, "a key", 1)
        return None if text is None else str(self.decode(text, 0, begin, "a key")[0])

    def value(self, what: str, depth: int) -> Any:
        """The value at ``t.pos`` (at most ``max_element`` characters), decoded once; moves past it."""
        t = self.t
        text, pos = t.text, t.pos
        try:
            value, end = self.decoder.raw_decode(text, pos)
        except (ValueError, RecursionError):
            pass  # it runs past the chunk, or is bad: found below
        else:
            # At the chunk's end a number may go on in the next one.
            if (end < len(text) or t.eof) and end - pos <= self.max_element:
                if text.count("[", pos, end) + text.count("{", pos, end) > MAX_DEPTH - depth:
                    self.walk(self.max_element, what, depth, element=True)  # raises if too deep
                t.pos = end
                return value
        begin = t.base + pos
        whole = self.walk(self.max_element, what, depth, element=True)
        assert whole is not None  # walk raises first
        return self.decode_whole(whole, begin, what)


def _elements(r: _Reader, depth: int) -> Iterator[tuple[int, Any]]:
    """(character, object) of each element of the list at ``t.pos`` (nested `depth` deep).

    Leaves ``t.pos`` after the list's ']'.
    """
    t = r.t
    if t.skip_ws() != "[":
        raise t.error(t.pos, "expected a JSON list '['")
    t.pos += 1
    c = t.skip_ws()
    if c == "]":
        t.pos += 1
        return
    index = 0
    while c:
        start = t.base + t.pos
        value = r.value(f"element {index}", depth + 1)
        if not isinstance(value, dict):
            msg = f"element {index} is a {type(value).__name__}, not an object"
            raise PackInputError(f"{t.path}: character {start}: {msg}")
        yield start, value
        index += 1
        if r.on_progress is not None and index % 1024 == 0:
            r.on_progress(t.base + t.pos)
        c = t.skip_ws()
        if c == "]":
            t.pos += 1
            return
        if c != ",":
            break
        t.pos += 1
        c = t.skip_ws()
    raise t.error(t.pos, f"expected ',' or ']' after element {index - 1}" if c else "the list is not closed")


def _members(r: _Reader, key: str) -> Iterator[tuple[int, Any]]:
    """The elements of the list under top-level `key`; the other values are walked, never built."""
    t = r.t
    if t.skip_ws() != "{":
        raise t.error(t.pos, f"expected a JSON object holding {key!r}")
    t.pos += 1
    found = False
    longest = 12 * len(key) + 2  # `key` spelled in escapes, quotes included: no longer key is it
    unclosed = "the top-level object is not closed"
    c = t.skip_ws()
    while c != "}":
        if c != '"':
            raise t.error(t.pos, "expected a key string in the top-level object" if c else unclosed)
        begin = t.base + t.pos
        name = r.key(longest)
        if t.skip_ws() != ":":
            raise t.error(t.pos, "expected ':' after a key of the top-level object")
        t.pos += 1
        if not t.skip_ws():
            raise t.error(t.pos, unclosed)
        if name == key:
            if found:
                msg = f"top-level key {key!r} appears twice (json.load would keep the last)"
                raise PackInputError(f"{t.path}: character {begin}: {msg}")
            found = True
            yield from _elements(r, 1)
        else:
            r.skip("a value" if name is None else f"the value of {name!r}")
        c = t.skip_ws()
        if c == ",":
            t.pos += 1
            c = t.skip_ws()
            if c == "}":
                raise t.error(t.pos, "expected a key string in the top-level object")
        elif c != "}":
            raise t.error(t.pos, "expected ',' or '}' in the top-level object" if c else unclosed)
    if not found:
        raise t.error(t.pos, f"no top-level key {key!r}")
    t.pos += 1


def iter_json_list(
    path: str,
    *,
    key: str | None = None,
    max_element: int = 1 << 30,
    on_progress: Callable[[int], None] | None = None,
) -> Iterator[Any]:
    """The objects of the JSON list in `path` (or of the list under top-level `key`), one at a time.

    They are what ``json.loads`` of the file's bytes gives (NaN and Infinity included). The whole
    file is read: what follows the list is checked too (a second `key` is an error, not a list to
    prefer as ``json.load`` would). Lists and objects before and after the list are checked only
    for their structure (strings closed, brackets balanced, nesting), never built; numbers,
    literals and strings there are decoded up to 1 MiB.

    Args:
        path: The file: UTF-8 (or UTF-16/32, as ``json.loads`` takes bytes).
        key: The top-level key whose list to read; None: the file is the list.
        max_element: The most characters one element may have.
        on_progress: Called now and then with the characters read so far.

    Raises:
        PackInputError: The file is not a JSON list of objects (or an object holding one under
            `key`), nests lists and objects deeper than ``MAX_DEPTH``, or is not valid UTF-8,
            naming the character (or byte) offset.
    """
    for _, value in _located(path, key, max_element, on_progress):
        yield value


def _located(
    path: str, key: str | None, max_element: int, on_progress: Callable[[int], None] | None
) -> Iterator[tuple[int, Any]]:
    """:func:`iter_json_list`'s objects, each with the character where it starts."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed when the generator ends
    except OSError as e:
        raise PackInputError(f"{path}: cannot read: {e.strerror}") from None
    with f:
        t = _Text(f, path)
        r = _Reader(t, max_element, on_progress)
        if key is None:
            yield from _elements(r, 0)
        else:
            yield from _members(r, key)
        if t.skip_ws():
            raise t.error(
                t.pos, "data after the end of the " + ("list" if key is None else "top-level object")
            )


def _records(path: str, elements: Iterator[tuple[int, Any]], encoding: str) -> Iterator[bytes]:
    """Each element's record; one that cannot be encoded is named at its place in the file."""
    for index, (start, value) in enumerate(elements):
        try:
            yield from encode_objects((value,), encoding)
        except PackInputError as e:  # pickle nests less deep than JSON; json takes no NaN
            why = e.__cause__ or e
            msg = f"element {index} cannot be encoded as {encoding}: {type(why).__name__}: {why}"
            raise PackInputError(f"{path}: character {start}: {msg}") from None


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
        PackInputError: Not a list of objects, malformed JSON, nesting deeper than ``MAX_DEPTH``
            or invalid UTF-8, naming the character (or byte) offset.
    """
    if encoding not in OBJECT_ENCODINGS:
        raise PackInputError(f"encoding must be one of {', '.join(OBJECT_ENCODINGS)}, not {encoding!r}")
    path = os.fspath(source)
    if not os.path.isfile(path):
        raise PackInputError(f"{path}: no such file")
    size = os.path.getsize(path)
    bar = _Progress(size, progress, "convert")
    return write_records(
        _records(path, _located(path, key, 1 << 30, bar.update), encoding),
        output,
        encoding=encoding,
        source=[path],
        metadata=metadata,
        durable=durable,
        shard_size=shard_size,
        input_bytes=size,
        bar=bar,
    )
