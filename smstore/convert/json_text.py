"""The text of a JSON file read a chunk at a time, and the vectorised scans that walk it (json_list's reader).

A chunk's strings, escapes and bracket depths are found with numpy over the whole chunk at once
(``Index``), so a value that runs past a chunk is walked to its end (``Scan``) without a character
loop in Python; ``Text`` keeps one chunk decoded and knows where it lies in the file.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable
from typing import Any, BinaryIO

import numpy as np

from smstore.errors import PackInputError

_WS = re.compile(r"[ \t\n\r]*")
_LONG_DIGITS = re.compile(r"[0-9]{3,}")
NUMBER = re.compile(r"[0-9+\-.eE]*")  # what a number may hold
_HEX = frozenset("0123456789abcdefABCDEF")
_OPEN, _CLOSE, _QUOTE, _BACKSLASH, _COMMA = ord("{"), ord("}"), ord('"'), ord("\\"), ord(",")


def run_end(run: re.Pattern[str], text: str, pos: int) -> int:
    """Where a run of `run` (a pattern that matches the empty string too) starting at `pos` ends."""
    m = run.match(text, pos)
    return m.end() if m else pos


def escape_boundary(s: str) -> int:
    """Where string content `s` (starting where an escape may start) can be cut without cutting an
    escape: before an escape it ends in the middle of, else its end."""
    k = s.rfind("\\", max(0, len(s) - 6))
    if k < 0:
        return len(s)
    j = len(s[:k].rstrip("\\"))  # where the run of backslashes ending at k starts
    rest = s[k + 1 :]
    if (k + 1 - j) % 2 and (not rest or (rest[0] == "u" and len(rest) < 5 and _HEX.issuperset(rest[1:]))):
        return k  # an odd run's last backslash starts an escape, and the escape goes on
    return len(s)


def squeeze(number: str) -> str:
    """`number` with each run of digits cut to its first two: as valid as `number`, and short."""
    return _LONG_DIGITS.sub(lambda m: m.group()[:2], number)


def count_digits(number: str) -> int:
    """How many digits `number` (of the characters `NUMBER` takes) holds."""
    return len(number) - sum(number.count(c) for c in "+-.eE")


class Text:
    """The file's text, decoded a chunk at a time: ``text[pos]`` is character ``base + pos``."""

    def __init__(
        self, f: BinaryIO, path: str, on_progress: Callable[[int], None] | None, *, chunk: int
    ) -> None:
        self.f = f
        self.path = path
        self.on_progress = on_progress
        self.chunk = chunk  # bytes read (and characters scanned) at a time
        head = f.read(max(chunk, 4))
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
        self._index: Index | None = None
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
                self.text, self.pos, self._codes, self._index = more, 0, None, None
                return True
            if self.eof:
                return False
            data = self.f.read(self.chunk)

    def advance(self) -> bool:
        """Drop the current chunk for the next one; False (nothing changed) at the end of the file."""
        if self.eof or not self._append(self.f.read(self.chunk)):
            return False
        if self.on_progress is not None:
            self.on_progress(self.base)
        return True

    def skip_ws(self) -> str:
        """The next character that is not JSON whitespace ("" at the end), moving `pos` to it."""
        while True:
            self.pos = run_end(_WS, self.text, self.pos)
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

    def index(self, pos: int) -> Index:
        """The chunk's :class:`Index` from `pos` (outside any string) or from an earlier place."""
        if self._index is None or self._index.start > pos:
            self._index = Index(self.codes(), pos)
        return self._index

    def error(self, pos: int, what: str) -> PackInputError:
        return PackInputError(f"{self.path}: character {self.base + pos}: {what}")


def unescaped_quotes(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Where the quotes of `a` (starting outside any escape) are that no backslash escapes."""
    quotes = np.flatnonzero(a == _QUOTE)
    if not quotes.size:
        return quotes
    bs = a == _BACKSLASH
    after = np.flatnonzero(bs[quotes - 1] & (quotes > 0))  # quotes just after a backslash
    if not after.size:
        return quotes
    runs = np.flatnonzero(bs & ~np.concatenate(([False], bs[:-1])))  # first backslash of each run
    q = quotes[after]
    escaped = np.zeros(quotes.size, bool)
    escaped[after] = (q - runs[np.searchsorted(runs, q - 1, "right") - 1]) % 2 == 1
    return quotes[~escaped]


class Index:
    """The brackets and commas of a chunk that lie outside strings, from `start` (outside any string).

    It tells where a list or object ends within the chunk and where its members are separated, so a
    run of members can be decoded by one call without cutting a member in two. It is exact for
    valid JSON; where the text is not, the decoder that reads what it points to refuses it.
    """

    def __init__(self, codes: np.ndarray[Any, Any], start: int) -> None:
        a = codes[start:]
        quotes = unescaped_quotes(a)
        folded = a | 32  # '[' -> '{', ']' -> '}': one comparison finds both kinds
        b = np.flatnonzero((folded == _OPEN) | (folded == _CLOSE))
        c = np.flatnonzero(a == _COMMA)
        if quotes.size:  # outside strings: after an even number of quotes
            b = b[np.searchsorted(quotes, b) % 2 == 0]
            c = c[np.searchsorted(quotes, c) % 2 == 0]
        opens = folded[b] == _OPEN
        depth = np.cumsum(np.where(opens, 1, -1))  # after each bracket, `start` at 0
        # A bracket that opens and the one that closes it share a key (the depth between them), and
        # no bracket of that key lies between them: in key order they are neighbours.
        key = np.where(opens, depth, depth + 1)
        order = np.argsort(key, kind="stable")
        first, second = order[:-1], order[1:]
        pair = (key[first] == key[second]) & opens[first] & ~opens[second]
        self.match = np.full(b.size, -1, np.int64)
        self.match[first[pair]] = second[pair]
        self.start = start
        self.brackets = b + start
        self.depth = depth
        self._depth_before = np.concatenate(([0], depth))
        # How far below `start`'s depth the text has been, up to each bracket (never decreasing).
        self._fallen = -np.minimum.accumulate(depth) if depth.size else depth
        comma_depth = self._depth_before[np.searchsorted(b, c)]
        by_depth = np.argsort(comma_depth, kind="stable")
        self._comma_depth = comma_depth[by_depth]
        self._commas = c[by_depth] + start  # by depth, then by place

    def depth_at(self, pos: int) -> int:
        """The depth of the text at `pos` (not a bracket) relative to `start`."""
        return int(self._depth_before[np.searchsorted(self.brackets, pos)])

    def close(self, pos: int) -> int:
        """Where the list or object opening at `pos` ends (its closing bracket), or -1: not here."""
        i = int(np.searchsorted(self.brackets, pos))
        if i == self.brackets.size or self.brackets[i] != pos or self.match[i] < 0:
            return -1
        return int(self.brackets[self.match[i]])

    def close_around(self, pos: int) -> int:
        """Where the list or object holding `pos`, opened before `start`, ends, or -1: not here."""
        j = int(np.searchsorted(self._fallen, -self.depth_at(pos), "right"))
        return int(self.brackets[j]) if j < self.brackets.size else -1

    def last_comma(self, depth: int, lo: int, hi: int) -> int:
        """The last comma at `depth` after `lo` and before `hi`, or -1."""
        g0, g1 = np.searchsorted(self._comma_depth, [depth, depth + 1])
        k = int(g0 + np.searchsorted(self._commas[g0:g1], hi)) - 1
        return int(self._commas[k]) if k >= g0 and self._commas[k] > lo else -1

    def deepest(self, lo: int, hi: int) -> int:
        """The greatest depth reached by a bracket from `lo` to before `hi` (-1 if none is there)."""
        i, j = np.searchsorted(self.brackets, [lo, hi])
        return int(self.depth[i:j].max()) if j > i else -1


class Scan:
    """Finds where a list, object or string ends, window by window, carrying its state between them.

    Brackets inside strings do not count; a quote is escaped after an odd run of backslashes. Only
    the structure is checked here (what lies between is left to the decoder).
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


class Open:
    """A list or object a skipped value has entered: its closing bracket, and where it opened."""

    __slots__ = ("at", "closer", "index", "pos")

    def __init__(self, closer: str, t: Text) -> None:
        self.closer = closer
        self.pos = t.pos
        self.at = t.base + t.pos
        self.index = t.index(t.pos)  # the chunk's index it opened under: none other knows `pos`

    def unclosed(self, t: Text, what: str) -> PackInputError:
        return PackInputError(f"{t.path}: character {self.at}: {what}: the list or object is not closed")
