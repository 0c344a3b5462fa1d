"""A JSON list of objects (COCO-style annotation lists) -> one object record each, streamed.

The file is decoded a chunk at a time. An element that lies inside the chunk is decoded there
(``json.JSONDecoder.raw_decode``); one that runs past it is first walked to its end by a scan of
strings, escapes and bracket depth (vectorised with numpy over the chunk), then its text is
decoded once, so no element is ever parsed twice. Values not selected are checked as ``json.loads``
checks them but never built whole: runs of their members are decoded a bounded piece at a time
(where the pieces end is found by the same scan, once per chunk), and what runs past a chunk is
entered, its strings checked a chunk at a time. Memory holds one chunk and the largest element,
whatever the size of what is skipped.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Generator, Iterator
from typing import Any

from smstore.convert._common import Progress, write_records
from smstore.convert.json_text import (
    NUMBER,
    Open,
    Scan,
    Text,
    count_digits,
    escape_boundary,
    run_end,
    squeeze,
)
from smstore.errors import PackInputError
from smstore.format.objects import OBJECT_ENCODINGS, encode_objects
from smstore.write.pack import PackStats

__all__ = ["MAX_DEPTH", "convert_json_list", "iter_json_list"]

CHUNK = 1 << 20  # bytes read (and characters scanned) at a time
# Lists and objects a file may nest, the top level's included: the limit of the C++ JSON checker
# (csrc/json_check.cpp), well inside what Python's recursive json decoder survives.
MAX_DEPTH = 512
# A value's scan starts at a small window, so walking many small values costs no chunk each, and
# grows to a bound that keeps the scan's temporary arrays small.
_FIRST_WINDOW, _LAST_WINDOW = 1 << 12, 1 << 18
# The most characters of a value not selected decoded in one call (to check them): the objects
# they make are built and dropped together, so this bounds their memory.
_PIECE = 1 << 18
_SCALAR = re.compile(r'[^ \t\n\r,:\[\]{}"]*')  # a number or literal runs until one of these
_CLOSER = {"[": "]", "{": "}"}
_scanstring: Callable[[str, int, bool], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]


class _Reader:
    """Walks a JSON text: elements decoded once each, other values checked without being built."""

    def __init__(self, t: Text, max_element: int) -> None:
        self.t = t
        self.max_element = max_element
        self.decoder = json.JSONDecoder()

    def walk(self, what: str, depth: int) -> str:
        """Move past the element at ``t.pos`` (nested `depth` deep); its text.

        Raises if it is longer than ``max_element`` characters, unclosed or nested too deep.
        """
        t = self.t
        keep = self.max_element
        start, first = t.pos, t.text[t.pos]
        begin = t.base + start
        if first == '"':  # most strings end at the next quote: no scan needed
            q = t.text.find('"', start + 1)
            if q > 0 and t.text[q - 1] != "\\" and q + 1 - start <= keep:
                t.pos = q + 1
                return t.text[start : q + 1]
        pieces: list[str] = []
        kept = 0  # characters of the value in the chunks before this one
        scan = None if first not in '{["' else Scan(first == '"', MAX_DEPTH - depth)
        p = start + 1 if first == '"' else start
        window = _FIRST_WINDOW
        while True:
            end = -1
            if scan is None:
                end = run_end(_SCALAR, t.text, p)
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
            if size > keep:
                raise PackInputError(f"{t.path}: character {begin}: {what} is larger than {keep} characters")
            pieces.append(t.text[start:] if end < 0 else t.text[start:end])
            if end >= 0:
                t.pos = end
                return "".join(pieces)
            kept = size
            if not t.advance():
                if scan is None:  # a number or literal that ends the file
                    t.pos = len(t.text)
                    return "".join(pieces)
                kind = "string" if scan.string else "list or object"
                raise PackInputError(f"{t.path}: character {begin}: {what}: the {kind} is not closed")
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

    def skip(self, what: str, depth: int) -> None:
        """Move past the value at ``t.pos`` (inside `depth` lists and objects), checked as
        ``json.loads`` checks it, without building it whole.

        A list or object that ends within ``_PIECE`` characters in the chunk is decoded in one call
        (its objects built and dropped at once); a larger one is entered, and runs of its members
        that end in the chunk are decoded ``_PIECE`` characters at a time; what is left (a member
        across the chunk's end) is entered in turn. Strings are checked a chunk at a time, numbers
        and literals decoded. So memory holds a chunk, however large the value.
        """
        t = self.t
        stack: list[Open] = []
        at_value = True  # t.pos is at a value; else just after one
        while True:
            if at_value:
                c = t.text[t.pos]
                if c in "[{":
                    if not self._whole(what, depth + len(stack)):
                        if depth + len(stack) >= MAX_DEPTH:
                            raise t.error(t.pos, f"{what}: lists and objects nested deeper than {MAX_DEPTH}")
                        stack.append(Open(_CLOSER[c], t))
                        t.pos += 1
                        at_value = self._member(stack, what, depth, first=True)
                        continue
                elif c == '"':
                    self.string(what)
                else:
                    self.scalar(what)
            if not stack:
                return
            top = stack[-1]
            c = t.skip_ws()
            if c == ",":
                t.pos += 1
                at_value = self._member(stack, what, depth, first=False)
            elif c == top.closer:
                t.pos += 1
                stack.pop()
                at_value = False
            elif c:
                raise t.error(t.pos, f"{what}: expected ',' or '{top.closer}'")
            else:
                raise top.unclosed(t, what)

    def _member(self, stack: list[Open], what: str, depth: int, *, first: bool) -> bool:
        """Move to the next member of the list or object entered last (after its opening bracket
        or a comma): past a run of members checked at once, the list or object itself if it ends
        (False: after a value), or to the member's value (True)."""
        t = self.t
        top = stack[-1]
        c = t.skip_ws()
        if not c:
            raise top.unclosed(t, what)
        if c == top.closer:
            if not first:
                raise t.error(t.pos, f"{what}: expected a {'value' if c == ']' else 'key string'} after ','")
            t.pos += 1
            stack.pop()
            return False
        if self._run(top, what, depth + len(stack)):
            return False
        if top.closer == "}":
            if c != '"':
                raise t.error(t.pos, f"{what}: expected a key string")
            self.string(what)
            if t.skip_ws() != ":":
                raise t.error(t.pos, f"{what}: expected ':' after a key")
            t.pos += 1
            if not t.skip_ws():
                raise top.unclosed(t, what)
        return True

    def _whole(self, what: str, around: int) -> bool:
        """Decode the list or object at ``t.pos`` in one call, if it ends within ``_PIECE``
        characters in the chunk and nests no deeper than allowed (`around`: those it lies in)."""
        t = self.t
        pos = t.pos
        ix = t.index(pos)
        end = ix.close(pos)
        if end < 0 or end - pos >= _PIECE or around + ix.deepest(pos, end) - ix.depth_at(pos) > MAX_DEPTH:
            return False
        t.pos = self.decode(t.text, pos, t.base, what)[1]
        return True

    def _run(self, top: Open, what: str, level: int) -> bool:
        """Decode in one call the members of `top` (nested `level` deep) from ``t.pos`` to the last
        comma before ``_PIECE`` characters, or to its end if that comes first, if they lie in the
        chunk; leaves ``t.pos`` at that comma or closing bracket."""
        t = self.t
        pos = t.pos
        ix = t.index(pos)
        inside = ix.depth_at(pos)
        close = ix.close(top.pos) if top.index is ix else ix.close_around(pos)
        if pos < close <= pos + _PIECE:
            cut = close
        else:
            cut = ix.last_comma(inside, pos, min(pos + _PIECE, len(t.text)) if close < 0 else close)
            if cut < 0:
                return False
        if level + ix.deepest(pos, cut) - inside > MAX_DEPTH:
            return False
        opener = "[" if top.closer == "]" else "{"
        self.decode_whole(opener + t.text[pos:cut] + top.closer, t.base + pos - 1, what)
        t.pos = cut
        return True

    def string(self, what: str, keep: int = 0) -> str | None:
        """Move past the string at ``t.pos``, checked as ``json.loads`` checks it; its value if it
        is at most `keep` characters long in the file, quotes included, else None."""
        t = self.t
        start = t.pos
        try:
            value, end = _scanstring(t.text, start + 1, True)
        except json.JSONDecodeError as e:
            # A string that goes on in the next chunk runs off this one's end, perhaps in an escape.
            runs_off = e.msg.startswith("Unterminated") or e.pos >= len(t.text) - 6
            if t.eof or not runs_off:
                where = start if e.msg.startswith("Unterminated") else e.pos
                raise t.error(where, f"{what}: {e.msg}") from None
        else:
            t.pos = end
            return value if end - start <= keep else None
        # A chunk at a time: each one's content, cut where no escape is cut, checked with a quote
        # added (that quote closes it unless the string closes before).
        begin = t.base + start
        seg = t.text[start + 1 :]
        at = begin + 1  # the character seg[0] is
        kept: list[str] | None = ['"'] if keep else None
        size = 1
        while True:
            cut = len(seg) if t.eof else escape_boundary(seg)
            piece = seg[:cut] + '"'
            try:
                _, end = _scanstring(piece, 0, True)
            except json.JSONDecodeError as e:
                if e.msg.startswith("Unterminated"):  # the file ends in an escape
                    raise PackInputError(
                        f"{t.path}: character {begin}: {what}: the string is not closed"
                    ) from None
                raise PackInputError(f"{t.path}: character {at + e.pos}: {what}: {e.msg}") from None
            if end < len(piece) or t.eof:
                if end == len(piece):  # closed by the quote added: the file ends in the string
                    raise PackInputError(f"{t.path}: character {begin}: {what}: the string is not closed")
                t.pos = at + end - t.base
                if kept is not None and size + end <= keep:
                    text = "".join(kept) + seg[:end]
                    return str(_scanstring(text, 1, True)[0])
                return None
            size += cut
            if kept is not None and size <= keep:
                kept.append(seg[:cut])
            else:
                kept = None
            tail = seg[cut:]
            at += cut
            seg = tail + t.text if t.advance() else tail

    def scalar(self, what: str) -> None:
        """Move past the number or literal at ``t.pos``, checked as ``json.loads`` checks it (NaN
        and Infinity too, an integer of more digits than ``int()`` takes refused)."""
        t = self.t
        start = t.pos
        end = run_end(_SCALAR, t.text, start)
        if end == start:
            raise t.error(start, f"{what}: expected a value")
        if end < len(t.text) or t.eof:
            t.pos = self.decode(t.text, start, t.base, what)[1]
            return
        # It goes on in the next chunk. Beyond _PIECE characters only a number is valid: its digits
        # are counted and its text squeezed (see squeeze), so memory stays small.
        begin = t.base + start
        text, size, digits, integer = t.text[start:], end - start, -1, True
        while t.advance():
            end = run_end(_SCALAR, t.text, 0)
            piece = t.text[:end]
            size += end
            if size > max(_PIECE, 16):  # longer than any literal ("-Infinity")
                new = piece if digits >= 0 else text + piece  # what is not counted yet
                if run_end(NUMBER, new, 0) < len(new):
                    raise PackInputError(f"{t.path}: character {begin}: {what}: expected a value")
                digits = max(digits, 0) + count_digits(new)
                integer = integer and not ("." in new or "e" in new or "E" in new)
                text = squeeze(text + piece)
                if len(text) > 64:  # a number squeezed is a dozen characters: this is none
                    raise PackInputError(f"{t.path}: character {begin}: {what}: not a valid number")
            else:
                text += piece
            t.pos = end
            if end < len(t.text):
                break
        else:
            t.pos = len(t.text)
        if digits < 0:
            self.decode_whole(text, begin, what)
            return
        if self.decode(text, 0, begin, what)[1] != len(text):
            raise PackInputError(f"{t.path}: character {begin}: {what}: not a valid number")
        limit = getattr(sys, "get_int_max_str_digits", lambda: 0)()
        if integer and limit and digits > limit:
            msg = f"an integer of {digits} digits: int() takes at most {limit}"
            raise PackInputError(f"{t.path}: character {begin}: {what}: {msg}")

    def key(self, longest: int) -> str | None:
        """The key string at ``t.pos`` (None if longer than `longest` characters); moves past it."""
        return self.string("a key", longest)

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
                    self.walk(what, depth)  # raises if too deep
                t.pos = end
                return value
        begin = t.base + pos
        return self.decode_whole(self.walk(what, depth), begin, what)


class _KeyAgain(Exception):
    """The top-level key appears `count` times: ``json.load`` keeps the last list."""

    def __init__(self, count: int) -> None:
        super().__init__(count)
        self.count = count


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
        if t.on_progress is not None and index % 1024 == 0:
            t.on_progress(t.base + t.pos)
        c = t.skip_ws()
        if c == "]":
            t.pos += 1
            return
        if c != ",":
            break
        t.pos += 1
        c = t.skip_ws()
    raise t.error(t.pos, f"expected ',' or ']' after element {index - 1}" if c else "the list is not closed")


def _members(r: _Reader, key: str, take: int | None) -> Generator[tuple[int, Any], None, int]:
    """The elements of the list under top-level `key`; the other values are checked, never built.

    `take`: which appearance of `key` to read (the others are checked as values skipped); None:
    the first, and a second one is refused. Returns how many times `key` appears.
    """
    t = r.t
    if t.skip_ws() != "{":
        raise t.error(t.pos, f"expected a JSON object holding {key!r}")
    t.pos += 1
    found = 0
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
            found += 1
            if take is None and found > 1:
                msg = f"top-level key {key!r} appears twice (json.load would keep the last list)"
                raise PackInputError(f"{t.path}: character {begin}: {msg}")
        if name == key and found == (take or 1):
            yield from _elements(r, 1)
        else:
            r.skip("a value" if name is None else f"the value of {name!r}", 1)
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
    return found


def iter_json_list(
    path: str,
    *,
    key: str | None = None,
    max_element: int = 1 << 30,
    on_progress: Callable[[int], None] | None = None,
) -> Iterator[Any]:
    """The objects of the JSON list in `path` (or of the list under top-level `key`), one at a time.

    They are what ``json.loads`` of the file's bytes gives (NaN and Infinity included), and the
    file is refused where ``json.loads`` refuses it: the whole file is read and checked, the values
    before and after the list too, but those are never built whole. A second `key` is refused when
    it is met (``json.load`` keeps the last list; the objects of the first are given by then; only
    :func:`convert_json_list` reads the last).

    Args:
        path: The file: UTF-8 (or UTF-16/32, as ``json.loads`` takes bytes).
        key: The top-level key whose list to read; None: the file is the list.
        max_element: The most characters one element may have.
        on_progress: Called with the characters read so far as each chunk is read, and every
            1,024 elements.

    Raises:
        PackInputError: The file is not JSON, not a list of objects (or an object holding one
            under `key`), nests lists and objects deeper than ``MAX_DEPTH``, or is not valid
            UTF-8, naming the character (or byte) offset.
    """
    for _, value in _located(path, key, max_element, on_progress, None):
        yield value


def _located(
    path: str,
    key: str | None,
    max_element: int,
    on_progress: Callable[[int], None] | None,
    take: int | None,
) -> Iterator[tuple[int, Any]]:
    """:func:`iter_json_list`'s objects, each with the character where it starts.

    `take`: which appearance of `key` to read; raises :class:`_KeyAgain`, once the whole file is
    checked, if `key` appears more often. None: a second `key` is refused.
    """
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed when the generator ends
    except OSError as e:
        raise PackInputError(f"{path}: cannot read: {e.strerror}") from None
    with f:
        t = Text(f, path, on_progress, chunk=CHUNK)
        r = _Reader(t, max_element)
        found = 0
        if key is None:
            yield from _elements(r, 0)
        else:
            found = yield from _members(r, key, take)
        if t.skip_ws():
            raise t.error(
                t.pos, "data after the end of the " + ("list" if key is None else "top-level object")
            )
        if take is not None and found > take:
            raise _KeyAgain(found)


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

    The records are the list's elements as ``json.load`` gives them. Where `key` appears more than
    once at the top level, that is the last list: the file is read a second time for it (the
    first reading, which stored the first list, is discarded).

    Args:
        source: A ``.json`` file holding a list of objects, or (with ``key``) an object holding one,
            as COCO files hold ``"images"`` and ``"annotations"``.
        key: The top-level key whose list to convert.

    Raises:
        PackInputError: Malformed JSON anywhere in the file, not a list of objects, nesting deeper
            than ``MAX_DEPTH`` or invalid UTF-8, naming the character (or byte) offset.
    """
    if encoding not in OBJECT_ENCODINGS:
        raise PackInputError(f"encoding must be one of {', '.join(OBJECT_ENCODINGS)}, not {encoding!r}")
    path = os.fspath(source)
    if not os.path.isfile(path):
        raise PackInputError(f"{path}: no such file")
    size = os.path.getsize(path)
    take = 1
    while True:
        bar = Progress(size, progress, "convert")
        try:
            return write_records(
                _records(path, _located(path, key, 1 << 30, bar.update, take), encoding),
                output,
                encoding=encoding,
                source=[path],
                metadata=metadata,
                durable=durable,
                shard_size=shard_size,
                input_bytes=size,
                bar=bar,
            )
        except _KeyAgain as again:  # the whole file is checked; the last list is the one to store
            take = again.count
