"""JSON lists and Megatron files: records byte-exact at any chunk and shard size, hostile input named.

JSON records are checked against ``json.loads`` of the file's bytes, element by element; Megatron
records against the tokens written in megatron-core's ``MMIDIDX`` layout (written here by hand:
megatron-core is not a test dependency). Every converter's shards stay within ``shard_size`` plus
one record.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import tarfile
import tempfile
import tracemalloc
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import smstore
from smstore import PackInputError
from smstore.convert import convert_json_list, convert_megatron
from smstore.convert import json_list as jl
from smstore.convert._common import Progress, Spans, _write, write_records
from smstore.format.manifest import read_manifest
from smstore.format.objects import PICKLE_PROTOCOL
from smstore.read.shards import ShardedWriter

from .smstore_testlib import read_records

# ----------------------------------------------------------------------------- helpers


def pickled(objects: Iterable[Any]) -> list[bytes]:
    """Each object as its pickle record: equal bytes mean equal objects, NaN included."""
    return [pickle.dumps(o, protocol=PICKLE_PROTOCOL) for o in objects]


def shard_records(directory: Path) -> list[list[bytes]]:
    """The raw records of each shard of a dataset, shard by shard."""
    m = read_manifest(directory / "manifest.json")
    return [read_records(m.shard_path(k)) for k in range(len(m.shards))]


def assert_within_shard_size(shards: list[list[bytes]], shard_size: int) -> None:
    """Each shard ends at the record that brings it to `shard_size` bytes: it holds at most that plus one record."""
    largest = max(len(r) for shard in shards for r in shard)
    for k, shard in enumerate(shards):
        assert shard, f"shard {k} is empty"
        assert sum(map(len, shard[:-1])) < shard_size, f"shard {k} went on after it was full"
        assert sum(map(len, shard)) <= shard_size + largest


# ----------------------------------------------------------------------------- JSON lists

# Escapes (a surrogate pair, a lone surrogate, quotes and backslashes before a closing quote),
# raw non-ASCII text, numbers json.loads reads in its own way (-0, 1e400, big ints), NaN and
# Infinity, empty objects, nested lists, brackets inside strings, and every kind of whitespace.
ELEMENTS = r"""
  {"id": 0, "s": "caf\u00e9 \ud83d\ude00 \"quoted\" back\\slash \/ tab\t nl\n", "raw": "é ☃ 😀 中文"},
  {},
	{ "k[{": "]}\\", "q": "\\\"", "end": "\\\\", "u0": "\u0000", "lone": "\udc00 \ud800x" } ,
  {"n": [0, -0, -0.0, 1.5e-7, -1E+2, 12345678901234567890123, 1e400, 0.1, 7], "c": [NaN, Infinity, -Infinity]},
  {"nested": [[], [[]], [{}], [[1, [2, [3, {"deep": [true, false, null]}]]]]], "e": {}, "l": [{}, []]},
  {"tokens": [101, 2023, 2003, 1037, 7099, 102], "t": true, "f": false, "z": null},
  {"long": "%s", "after": 1}
""" % ('ab\\"c[{' * 40)
COCO = (
    '{"info": {"description": "brackets ]} and a quote \\" in a string [{", "year": 2017},\r\n'
    ' "licenses": [{"id": 1, "name": "x", "url": "http://example.org/]"}],\n'
    ' "images": ['
    + ",".join(json.dumps({"id": i, "file_name": f"{i:012d}.jpg", "h": 480}) for i in range(12))
    + "],\n"
    ' "annotations": [' + ELEMENTS + "],\n"
    ' "categories": [{"supercategory": "person", "id": 1, "name": "person"}]}\n'
)
JSON_INPUTS = {
    "list": ("[" + ELEMENTS + "]", None),
    "coco annotations": (COCO, "annotations"),
    "coco images": (COCO, "images"),
    "coco categories": (COCO, "categories"),
    "empty list": (" [ ]\n", None),
    "empty under a key": ('{"a": {"b": [1, "]"]}, "annotations": [], "z": 0}', "annotations"),
}


def expected_elements(data: bytes, key: str | None) -> list[Any]:
    doc = json.loads(data)
    return doc if key is None else doc[key]


@pytest.mark.parametrize("name", JSON_INPUTS)
def test_json_list_elements_are_json_loads_at_every_chunk_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    text, key = JSON_INPUTS[name]
    src = tmp_path / "in.json"
    src.write_bytes(text.encode())
    want = pickled(expected_elements(src.read_bytes(), key))
    for chunk in range(1, 65):  # every element, string, escape and number cut at every place
        monkeypatch.setattr(jl, "CHUNK", chunk)
        assert pickled(jl.iter_json_list(os.fspath(src), key=key)) == want, f"CHUNK={chunk}"


@pytest.mark.parametrize("chunk", [5, 1 << 20])
def test_json_list_records_are_byte_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    monkeypatch.setattr(jl, "CHUNK", chunk)
    src = tmp_path / "coco.json"
    src.write_bytes(COCO.encode())
    stats = convert_json_list(src, tmp_path / "a.smst", key="annotations", progress=False)
    want = expected_elements(src.read_bytes(), "annotations")
    assert stats.records == len(want) == 7
    assert read_records(tmp_path / "a.smst") == pickled(want)
    # JSON records: standard JSON only, so the elements without NaN or a lone surrogate.
    plain = '[{"a": "caf\\u00e9 \\ud83d\\ude00", "b": [[], {}]}, {}, {"n": -0.0, "m": 1.5e300}]'
    src.write_text(plain)
    convert_json_list(src, tmp_path / "j.smst", encoding="json", progress=False)
    dump = [json.dumps(o, ensure_ascii=False, separators=(",", ":")).encode() for o in json.loads(plain)]
    assert read_records(tmp_path / "j.smst") == dump


def test_json_list_in_utf8_with_bom_and_utf16(tmp_path: Path) -> None:
    text = '[{"a": "é ☃ 😀"}, {"b": [1, 2]}]'
    for name, data in [("bom", b"\xef\xbb\xbf" + text.encode()), ("utf16", text.encode("utf-16"))]:
        src = tmp_path / f"{name}.json"
        src.write_bytes(data)
        assert list(jl.iter_json_list(os.fspath(src))) == json.loads(data), name


def test_json_list_nesting_up_to_the_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def nested(lists: int) -> bytes:  # the list, an object, then `lists` lists inside it
        return b'[{"a": ' + b"[" * lists + b"]" * lists + b"}]"

    src = tmp_path / "deep.json"
    for chunk in (7, 1 << 20):  # an element split across chunks (scanned) or inside one (decoded)
        monkeypatch.setattr(jl, "CHUNK", chunk)
        src.write_bytes(nested(jl.MAX_DEPTH - 2))
        assert list(jl.iter_json_list(os.fspath(src))) == json.loads(src.read_bytes())  # too deep to pickle
        src.write_bytes(nested(jl.MAX_DEPTH - 1))
        with pytest.raises(
            PackInputError, match=r"deep\.json: character 517: element 0: .* nested deeper than 512"
        ):
            list(jl.iter_json_list(os.fspath(src)))


DEEP = 100_000


@pytest.mark.parametrize(
    ("data", "key", "message"),
    [
        # Nesting that overflows Python's recursive decoder: a RecursionError before.
        (
            b"[" * DEEP + b"]" * DEEP,
            None,
            r"character 512: element 0: lists and objects nested deeper than 512",
        ),
        (
            b'{"x": ' + b"[" * DEEP + b"]" * DEEP + b', "k": []}',
            "k",
            r"character 517: the value of 'x': lists and objects nested deeper than 512",
        ),
        # Invalid UTF-8 (a UnicodeDecodeError before), in the list and in a value skipped.
        (b'[{"a": "caf\xc3\xa9"}, {"b": "\xff"}]', None, r"byte 24: invalid utf-8: invalid start byte"),
        (b'{"x": "\xed\xa0", "k": []}', "k", r"byte 7: invalid utf-8"),
        (b'[{"a": "caf\xc3', None, r"byte 11: invalid utf-8: unexpected end of data"),
        # A number int() refuses (a bare ValueError before).
        (
            b'[{"n": ' + b"1" * 5000 + b"}]",
            None,
            r"character 1: element 0: Exceeds the limit \(4300 digits\)",
        ),
        # What json.load refuses after the list (accepted before).
        (b'{"k": [{"a": 1}],}', "k", r"character 17: expected a key string"),
        (
            b'{"k": [{"a": 1}], "z": [1, 2',
            "k",
            r"character 23: the value of 'z': the list or object is not closed",
        ),
        (b'{"k": [{"a": 1}]} {}', "k", r"character 18: data after the end of the top-level object"),
        (b'{"k": [{"a": 1}], "z": ', "k", r"character 23: the top-level object is not closed"),
        # A top-level number or string skipped is checked as json.load checks it.
        (b'{"x": 01, "k": []}', "k", r"character 7: expected ',' or '}' in the top-level object"),
        (b'{"x": "a\\qb", "k": []}', "k", r"character 8: the value of 'x': Invalid \\escape"),
        # Faults inside the list.
        (b'[{"a": 1}, ]', None, r"character 11: element 1: expected a value"),
        (b'[{"a": 1},', None, r"character 10: the list is not closed"),
        (b'[{"s": "abc}]', None, r"character 1: element 0: the list or object is not closed"),
        (b'[{"s": "a\\x"}]', None, r"character 9: element 0: Invalid \\escape"),
        (b'[{"a": 1}, {"a": 2]]', None, r"character 18: element 1: Expecting ',' delimiter"),
        (b'{"images": [], "annotations": {"a": 1}}', "annotations", r"character 30: expected a JSON list"),
        (b'{"images": []}', "annotations", r"character 13: no top-level key 'annotations'"),
        (b"", None, r"character 0: expected a JSON list"),
    ],
)
def test_bad_json_list_is_named(tmp_path: Path, data: bytes, key: str | None, message: str) -> None:
    src = tmp_path / "bad.json"
    src.write_bytes(data)
    out = tmp_path / "o.smst"
    with pytest.raises(PackInputError, match=r"bad\.json: " + message):
        convert_json_list(src, out, key=key, progress=False)
    assert not out.exists()


def test_json_list_element_that_cannot_be_stored_is_named(tmp_path: Path) -> None:
    """Valid JSON the record encoding refuses: NaN in JSON records, nesting deeper than pickle goes."""
    src = tmp_path / "nan.json"
    src.write_text('[{"a": 1}, {"b": [NaN]}]')
    with pytest.raises(
        PackInputError,
        match=r"nan\.json: character 11: element 1 cannot be encoded as json: ValueError: Out of range",
    ):
        convert_json_list(src, tmp_path / "o.smst", encoding="json", progress=False)
    src = tmp_path / "deep.json"
    src.write_bytes(b'[{"a": 1}, {"a": ' + b"[" * 500 + b"]" * 500 + b"}]")
    assert len(list(jl.iter_json_list(os.fspath(src)))) == 2  # within MAX_DEPTH
    with pytest.raises(
        PackInputError, match=r"deep\.json: character 11: element 1 cannot be encoded as pickle: Recursion"
    ):
        convert_json_list(src, tmp_path / "o.smst", progress=False)
    assert not (tmp_path / "o.smst").exists()


def test_json_list_element_larger_than_max_element(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "big.json"
    src.write_text('[{"a": 1}, {"s": "' + "x" * 100 + '"}]')
    for chunk in (8, 1 << 20):
        monkeypatch.setattr(jl, "CHUNK", chunk)
        with pytest.raises(PackInputError, match=r"character 11: element 1 is larger than 50 characters"):
            list(jl.iter_json_list(os.fspath(src), max_element=50))


class CountingDecoder(json.JSONDecoder):
    """A json decoder that counts its calls and the characters they read."""

    calls = 0
    chars = 0

    def raw_decode(self, s: str, idx: int = 0) -> tuple[Any, int]:
        CountingDecoder.calls += 1
        try:
            value, end = super().raw_decode(s, idx)
        except ValueError:
            CountingDecoder.chars += len(s) - idx  # read up to the fault at most
            raise
        CountingDecoder.chars += end - idx
        return value, end


def test_json_list_decodes_each_element_once_and_skips_in_linear_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Linear work: each character is decoded about once, however large the values.

    The first reader decoded every skipped value whole and re-decoded a value from its start after
    each chunk it read (quadratic). Values skipped are decoded too, to check them as json.loads
    does, but a piece at a time: a few calls per chunk, each character once.
    """
    chunk = 4096
    monkeypatch.setattr(jl, "CHUNK", chunk)
    monkeypatch.setattr(jl.json, "JSONDecoder", CountingDecoder)
    big = "y" * 300_000
    doc = {
        "blob": big,
        "lists": [[i, str(i), {"k": [i]}] for i in range(20_000)],
        "annotations": [{"s": big}, *({"i": i} for i in range(10)), {"l": list(range(60_000))}],
        "after": [big],
    }
    src = tmp_path / "big.json"
    src.write_text(json.dumps(doc))
    size = src.stat().st_size
    CountingDecoder.calls = CountingDecoder.chars = 0
    got = list(jl.iter_json_list(os.fspath(src), key="annotations"))
    assert pickled(got) == pickled(doc["annotations"])
    # Each element at most twice (tried inside its chunk, then whole); values skipped a few calls
    # per chunk (strings are checked without the decoder).
    assert CountingDecoder.calls <= 2 * len(doc["annotations"]) + 2 * (size // chunk)
    assert CountingDecoder.chars <= size


def test_json_list_memory_does_not_grow_with_values_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Peak allocation (traced, not timed) stays near a chunk, not the 4 MB value before the key."""
    chunk = 1 << 16
    monkeypatch.setattr(jl, "CHUNK", chunk)
    src = tmp_path / "skip.json"
    nested = "[" + ",".join(['{"a": [1, "]"], "b": "\\"x\\""}'] * 100_000) + "]"
    src.write_text('{"s": "' + "é" * (4 << 20) + '", "n": ' + nested + ', "k": [{"a": 1}]}')
    tracemalloc.start()
    try:
        assert list(jl.iter_json_list(os.fspath(src), key="k")) == [{"a": 1}]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 48 * chunk, peak  # the string alone is 4 MiB


def test_json_list_reports_progress_while_skipping(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jl, "CHUNK", 1000)
    src = tmp_path / "p.json"
    src.write_text('{"skip": "' + "x" * 50_000 + '", "k": [{"a": 1}]}')
    seen: list[int] = []
    assert list(jl.iter_json_list(os.fspath(src), key="k", on_progress=seen.append)) == [{"a": 1}]
    assert len(seen) >= 40
    assert seen == sorted(seen)
    assert seen[-1] <= src.stat().st_size


# What json.loads refuses inside a top-level value not selected. All were accepted before (such
# values were walked for their structure only); the first three are the fuzz target's findings,
# kept as fuzz/corpus/json_list/regress-* seeds.
SKIPPED_FAULTS = {
    "missing comma in a list before the key": (
        b'{"info": [1 2], "k": [{}]}',
        r"character 12: the value of 'info': (Expecting ',' delimiter|expected ',' or '\]')",
    ),
    "missing comma in a list after the key": (
        b'{"k": [{}], "after": [1 2]}',
        r"character 24: the value of 'after': (Expecting ',' delimiter|expected ',' or '\]')",
    ),
    "raw NUL in a long key": (
        b'{"licenses\x00 of the images": [{"id": 1}], "k": [{}]}',
        r"character 10: a key: Invalid control character",
    ),
    "raw control character in a nested string": (
        b'{"x": [{"s": "a\x1fb"}], "k": [{}]}',
        r"character 15: the value of 'x': Invalid control character",
    ),
    "bad escape in a nested string": (b'{"x": ["a", "\\q"], "k": [{}]}', r"character 13: .*Invalid \\escape"),
    "bad \\u escape in a nested key": (
        b'{"x": {"\\u12x4": 1}, "k": [{}]}',
        r"character 9: .*Invalid \\uXXXX",
    ),
    "missing colon": (b'{"x": {"a" 1}, "k": [{}]}', r"character 11: the value of 'x': "),
    "trailing comma in a list": (b'{"x": [1,], "k": [{}]}', r"character 9: the value of 'x': "),
    "trailing comma in an object": (b'{"k": [{}], "x": {"a": 1,}}', r"character 25: the value of 'x': "),
    "a literal misspelled": (
        b'{"x": [1, tru], "k": [{}]}',
        r"character 10: the value of 'x': Expecting value",
    ),
    "a leading zero": (b'{"x": [[01]], "k": [{}]}', r"character 9: the value of 'x': "),
    "brackets that do not match": (b'{"x": [{"a": [1}], "k": [{}]}', r"character 15: the value of 'x': "),
    "a single-quoted string": (b'{"x": {"a": \'b\'}, "k": [{}]}', r"character 12: the value of 'x': "),
    "an integer int() refuses": (
        b'{"x": [' + b"7" * 5000 + b'], "k": [{}]}',
        r"character [67]: the value of 'x': .*(4300 digits)",  # the list or the number
    ),
}


def _json_loads_refuses(data: bytes) -> bool:
    try:
        json.loads(data)
    except ValueError:  # JSONDecodeError, or an integer of too many digits
        return True
    return False


@pytest.mark.parametrize("name", SKIPPED_FAULTS)
@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_json_list_values_skipped_are_checked_as_json_loads_checks_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, chunk: int
) -> None:
    data, message = SKIPPED_FAULTS[name]
    assert _json_loads_refuses(data)
    monkeypatch.setattr(jl, "CHUNK", chunk)
    src = tmp_path / "bad.json"
    src.write_bytes(data)
    out = tmp_path / "o.smst"
    with pytest.raises(PackInputError, match=r"bad\.json: " + message):
        convert_json_list(src, out, key="k", progress=False)
    assert not out.exists()


def test_json_list_values_skipped_hold_what_json_loads_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NaN, Infinity, lone surrogates (escaped and raw), huge numbers, nesting to the limit."""
    deep = b"[" * (jl.MAX_DEPTH - 1) + b"]" * (jl.MAX_DEPTH - 1)  # 512 deep with the top level
    data = (
        b'{"x": [NaN, -Infinity, {"a": Infinity, "a": 1e400}, -0, 1E-400], '
        b'"\\ud800 key": "\\udc00 \xed\xa0\x80 \\ud83d\\ude00", "d": ' + deep + b", "
        b'"f": 0.' + b"5" * 5000 + b"e-" + b"0" * 3000 + b"1, "
        b'"i": ' + b"9" * 4300 + b', "k": [{"a": 1}], "after": {"": {"": [true, false, null]}}}'
    )
    src = tmp_path / "ok.json"
    src.write_bytes(data)
    want = pickled(json.loads(data)["k"])
    # The 512th '[' of "d" (at depth 513), in characters: the raw surrogate is 3 bytes, 1 character.
    too_deep = data.decode("utf-8", "surrogatepass").index('"d": ') + 5 + jl.MAX_DEPTH - 1
    for chunk, piece in [(1, 1 << 18), (5, 4), (64, 16), (1 << 20, 1 << 18)]:
        monkeypatch.setattr(jl, "CHUNK", chunk)
        monkeypatch.setattr(jl, "_PIECE", piece)
        assert pickled(jl.iter_json_list(os.fspath(src), key="k")) == want, (chunk, piece)
        src.write_bytes(data.replace(b'"d": [', b'"d": [['))  # 513 deep
        with pytest.raises(
            PackInputError, match=rf"character {too_deep}: the value of 'd': .* deeper than 512"
        ):
            list(jl.iter_json_list(os.fspath(src), key="k"))
        src.write_bytes(data)


def test_json_list_numbers_longer_than_a_piece(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A number skipped across many chunks: checked without holding its digits."""
    monkeypatch.setattr(jl, "CHUNK", 3)
    monkeypatch.setattr(jl, "_PIECE", 8)
    src = tmp_path / "n.json"
    for number, ok in [
        (b"1" * 4300, True),
        (b"-1" + b"0" * 4300, False),  # 4,301 digits: int() refuses
        (b"-0." + b"0" * 5000 + b"1e+" + b"0" * 900 + b"7", True),
        (b"1" * 100 + b"." + b"2" * 100 + b"E" + b"3" * 100, True),
        (b"0" + b"1" * 100, False),
        (b"1" * 100 + b".", False),
        (b"1" * 100 + b"e", False),
        (b"1" * 50 + b"-" + b"1" * 50, False),
        (b"1" * 50 + b"x" + b"1" * 50, False),
        (b"-" * 200, False),
    ]:
        data = b'{"n": ' + number + b', "k": [{}]}'
        src.write_bytes(data)
        assert _json_loads_refuses(data) != ok, number[:20]
        if ok:
            assert list(jl.iter_json_list(os.fspath(src), key="k")) == [{}]
        else:
            with pytest.raises(PackInputError, match=r"n\.json: character 6: the value of 'n': "):
                list(jl.iter_json_list(os.fspath(src), key="k"))


def test_json_list_key_twice_converts_the_last_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """json.load keeps the last value of a key: convert_json_list reads the file again for it."""
    src = tmp_path / "twice.json"
    src.write_bytes(b'{"k": [{"a": 1}, {"a": 2}], "x": 0, "k": [{"b": 2}], "k": [{"c": 3}], "z": []}')
    want = pickled(json.loads(src.read_bytes())["k"])
    for chunk in (3, 1 << 20):
        monkeypatch.setattr(jl, "CHUNK", chunk)
        stats = convert_json_list(src, tmp_path / "o.smst", key="k", progress=False)
        assert stats.records == 1
        assert read_records(tmp_path / "o.smst") == want
        convert_json_list(src, tmp_path / "ds", key="k", shard_size=1, progress=False)
        assert [r for shard in shard_records(tmp_path / "ds") for r in shard] == want
        # A fault after the second list is found before anything is written.
        src.write_bytes(src.read_bytes()[:-2] + b"[}")
        with pytest.raises(PackInputError, match=r"twice\.json: character 77: the value of 'z'"):
            convert_json_list(src, tmp_path / "o.smst", key="k", progress=False)
        src.write_bytes(src.read_bytes()[:-2] + b"]}")
    # iter_json_list has given the first list's objects when it meets the second: it refuses.
    it = jl.iter_json_list(os.fspath(src), key="k")
    assert [next(it), next(it)] == [{"a": 1}, {"a": 2}]
    with pytest.raises(PackInputError, match=r"character 36: top-level key 'k' appears twice"):
        next(it)


# Hypothesis: JSON documents (an object holding a list of objects under "k", the key maybe twice),
# written with varied whitespace and escapes, valid or with one character changed.
_WS = st.sampled_from(["", " ", "\n  ", "\t", "\r\n"])
_STRING = st.lists(
    st.one_of(
        st.sampled_from(['\\"', "\\\\", "\\/", "\\b\\f\\n\\r\\t", "\\u00e9", "\\ud83d\\ude00", "\\udc00"]),
        st.sampled_from(["é ☃ 😀", "\ud800", "]},[{:", "x" * 40, "\\\\" * 5 + '\\"']),
        st.text(st.characters(codec="utf-8", exclude_characters='"\\', min_codepoint=32), max_size=8),
    ),
    max_size=5,
).map(lambda parts: '"' + "".join(parts) + '"')
_SCALAR = st.one_of(
    st.sampled_from(["0", "-0", "1.5e-7", "-1E+2", "0.1", "1e400", "123456789012345678901234567890"]),
    st.sampled_from(["NaN", "Infinity", "-Infinity", "true", "false", "null"]),
    st.integers().map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
)


def _listed(items: list[tuple[str, str]], opener: str) -> str:
    body = ",".join(f"{a}{b}{c}" for a, b, c in items)
    return opener + body + ("]" if opener == "[" else "}")


_VALUE = st.recursive(
    st.one_of(_SCALAR, _STRING),
    lambda inner: st.one_of(
        st.lists(st.tuples(_WS, inner, _WS), max_size=5).map(lambda items: _listed(items, "[")),
        st.lists(
            st.tuples(_WS, st.tuples(_STRING, _WS, inner).map(lambda m: f"{m[0]}:{m[1]}{m[2]}"), _WS),
            max_size=5,
        ).map(lambda items: _listed(items, "{")),
    ),
    max_leaves=20,
)
_OBJECT = st.lists(
    st.tuples(_WS, st.tuples(_STRING, _VALUE).map(lambda m: f"{m[0]}: {m[1]}"), _WS), max_size=4
).map(lambda items: _listed(items, "{"))
_SELECTED = st.lists(st.tuples(_WS, _OBJECT, _WS), max_size=4).map(lambda items: _listed(items, "["))


@st.composite
def _documents(draw: st.DrawFn) -> bytes:
    members = draw(st.lists(st.tuples(_STRING, _VALUE), max_size=4))
    for _ in range(draw(st.sampled_from([1, 1, 1, 2]))):
        members.insert(draw(st.integers(0, len(members))), ('"k"', draw(_SELECTED)))
    text = "{" + ",".join(f"{draw(_WS)}{k}{draw(_WS)}:{draw(_WS)}{v}" for k, v in members) + "}"
    change = draw(st.sampled_from(["none", "none", "delete", "insert", "replace"]))
    if change != "none" and text:
        at = draw(st.integers(0, len(text) - 1))
        c = draw(st.sampled_from(list('[]{},:"\\ 0e.-+tuxnN\x00\x1f\ud800')))
        text = text[:at] + ("" if change == "delete" else c) + text[at + (change != "insert") :]
    return text.encode("utf-8", "surrogatepass")


class _Pairs(list):  # type: ignore[type-arg]
    """An object as json.loads's object_pairs_hook sees it."""


def _json_loads_list(data: bytes) -> tuple[list[Any] | None, bool]:
    """(json.loads(data)["k"] if it is a list of objects, else None; whether refusing is allowed).

    Refusing a valid file is allowed only where "k" appears more than once and one before the last
    is not a list of objects: the converter streams the first before it knows of the others.
    """
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return None, True
    value = doc.get("k") if isinstance(doc, dict) else None
    if not isinstance(value, list) or not all(isinstance(e, dict) for e in value):
        return None, True
    pairs = json.loads(data, object_pairs_hook=_Pairs)
    lists = [v for k, v in pairs if k == "k"]
    earlier_bad = any(
        not isinstance(v, list) or not all(isinstance(e, _Pairs) for e in v) for v in lists[:-1]
    )
    return value, earlier_bad


@settings(max_examples=200, deadline=None)
@given(data=_documents())
def test_json_list_converts_exactly_what_json_loads_accepts(data: bytes) -> None:
    """Converted iff json.loads accepts the file (and "k" holds a list of objects), to its records,
    whatever the chunk and piece sizes (so values skipped straddle windows everywhere)."""
    want, may_refuse = _json_loads_list(data)
    saved = jl.CHUNK, jl._PIECE
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "doc.json", Path(tmp) / "o.smst"
        src.write_bytes(data)
        try:
            for jl.CHUNK, jl._PIECE in [(1, 1 << 18), (4, 3), (13, 8), (64, 16), (1 << 20, 1 << 18)]:
                refused = None
                try:
                    convert_json_list(src, out, key="k", durable=False, progress=False)
                except PackInputError as e:
                    refused = str(e)
                if refused is not None:
                    assert may_refuse, f"CHUNK={jl.CHUNK}: json.loads accepts it: {refused}"
                    assert not out.exists()
                    offset = re.search(r"doc\.json: (?:character|byte) (\d+): ", refused)
                    assert offset, refused
                    assert int(offset.group(1)) <= len(data), refused
                    continue
                assert want is not None, f"CHUNK={jl.CHUNK}: converted, json.loads refuses it"
                assert read_records(out) == pickled(want), f"CHUNK={jl.CHUNK}"
                out.unlink()
        finally:
            jl.CHUNK, jl._PIECE = saved


# ----------------------------------------------------------------------------- Megatron

# Megatron's DType codes (megatron/core/datasets/indexed_dataset.py).
MEGATRON_DTYPES = [
    (1, np.uint8),
    (2, np.int8),
    (3, np.int16),
    (4, np.int32),
    (5, np.int64),
    (6, np.float64),
    (7, np.float32),
    (8, np.uint16),
]


def write_mmidx(
    prefix: Path, docs: Sequence[Sequence[np.ndarray]], code: int, *, gap_before: Sequence[int] = ()
) -> None:
    """A ``.bin``/``.idx`` pair in the MMIDIDX layout that megatron-core's ``_IndexWriter`` writes.

    ``gap_before``: documents preceded by a few bytes no sequence uses (a .bin spliced by hand), so
    documents that follow each other in the index do not all follow each other in the file.
    """
    dtype = np.dtype(dict(MEGATRON_DTYPES)[code])
    lengths, pointers, doc_idx = [], [], [0]
    with open(f"{prefix}.bin", "wb") as b:
        for d, doc in enumerate(docs):
            if d in gap_before:
                b.write(b"\xee" * dtype.itemsize * 3)
            for seq in doc:
                pointers.append(b.tell())
                b.write(np.asarray(seq, dtype=dtype).tobytes())
                lengths.append(len(seq))
            doc_idx.append(len(lengths))
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + (1).to_bytes(8, "little") + bytes([code]))
        f.write(len(lengths).to_bytes(8, "little") + len(doc_idx).to_bytes(8, "little"))
        f.write(np.array(lengths, np.int32).tobytes())
        f.write(np.array(pointers, np.int64).tobytes())
        f.write(np.array(doc_idx, np.int64).tobytes())


def document_bytes(docs: Sequence[Sequence[np.ndarray]], dtype: Any) -> list[bytes]:
    return [b"".join(np.asarray(seq, dtype=dtype).tobytes() for seq in doc) for doc in docs]


def some_documents(dtype: Any, n: int, seed: int) -> list[list[np.ndarray]]:
    """Documents of 0 to 3 sequences of 0 to 40 tokens, the extremes of `dtype` among them."""
    rng = np.random.default_rng(seed)
    info = np.finfo(dtype) if np.dtype(dtype).kind == "f" else np.iinfo(dtype)
    docs = []
    for _ in range(n):
        doc = []
        for _ in range(int(rng.integers(0, 4))):
            seq = rng.integers(0, 100, int(rng.integers(0, 40))).astype(dtype)
            if seq.size > 2:
                seq[0], seq[-1] = info.min, info.max
            doc.append(seq)
        docs.append(doc)
    docs[0] = []  # empty documents first, last and side by side
    docs[7:9] = [[], [np.zeros(0, dtype)]]
    docs[-1] = []
    return docs


@pytest.mark.parametrize(("code", "dtype"), MEGATRON_DTYPES)
def test_megatron_every_dtype_is_byte_exact(tmp_path: Path, code: int, dtype: Any) -> None:
    docs = some_documents(dtype, 300, seed=code)
    write_mmidx(tmp_path / "corpus", docs, code, gap_before=(50, 51, 200))
    stats = convert_megatron(tmp_path / "corpus", tmp_path / "m.smst", progress=False)
    assert stats.records == len(docs)
    assert read_records(tmp_path / "m.smst") == document_bytes(docs, dtype)
    with smstore.open(tmp_path / "m.smst") as s:
        assert s.encoding == f"npy:{np.dtype(dtype).str}"
    # The same records across shards, each within shard_size plus one record.
    convert_megatron(tmp_path / "corpus.idx", tmp_path / "sharded", shard_size=700, progress=False)
    shards = shard_records(tmp_path / "sharded")
    assert len(shards) > 3
    assert [r for shard in shards for r in shard] == document_bytes(docs, dtype)
    assert_within_shard_size(shards, 700)


def test_megatron_shard_size_splits_one_call_of_many_documents(tmp_path: Path) -> None:
    """70,000 documents: more than the converter hands the writer at once (the writer must split)."""
    rng = np.random.default_rng(3)
    docs = [[rng.integers(0, 50_000, int(n), dtype=np.uint16)] for n in rng.integers(0, 16, 70_000)]
    write_mmidx(tmp_path / "c", docs, 8)
    shard_size = 64 << 10
    convert_megatron(tmp_path / "c", tmp_path / "ds", shard_size=shard_size, progress=False)
    shards = shard_records(tmp_path / "ds")
    assert [r for shard in shards for r in shard] == document_bytes(docs, np.uint16)
    assert len(shards) >= 15
    assert_within_shard_size(shards, shard_size)


def test_megatron_pointer_that_overflows_is_named(tmp_path: Path) -> None:
    """A pointer near 2**63 whose end wraps around: refused with the index, never written."""
    write_mmidx(tmp_path / "c", [[np.arange(10)], [np.arange(4)]], 8)
    idx = bytearray((tmp_path / "c.idx").read_bytes())
    pointers_at = 34 + 2 * 4
    idx[pointers_at + 8 : pointers_at + 16] = ((1 << 63) - 4).to_bytes(8, "little")
    (tmp_path / "c.idx").write_bytes(idx)
    out = tmp_path / "out.smst"
    out.write_bytes(b"previous")
    with pytest.raises(
        PackInputError, match=r"c\.idx: sequence 1 lies at bytes 9223372036854775804\.\..* of .*c\.bin"
    ):
        convert_megatron(tmp_path / "c", out, progress=False)
    assert out.read_bytes() == b"previous"


@pytest.mark.parametrize("shard_size", [None, 1, 3])
def test_writer_faults_in_spans_name_the_input(tmp_path: Path, shard_size: int | None) -> None:
    """Offsets the writer refuses are reported at the input Spans names, at their place in it."""
    out = tmp_path / ("ds" if shard_size else "o.smst")
    spans = Spans(b"abcdef", np.array([0, 1, 2, 4, 3, 6]), where="in.bin: documents 0..4")
    with pytest.raises(PackInputError, match=r"^in\.bin: documents 0\.\.4: offsets\[3:5\] do not lie") as e:
        write_records(
            [b"first", spans],
            out,
            encoding="bytes",
            source=[],
            metadata=None,
            durable=False,
            shard_size=shard_size,
            input_bytes=0,
            bar=Progress(None, False, ""),
        )
    assert str(out) not in str(e.value)
    assert not out.exists() or not (out / "manifest.json").exists()


@pytest.mark.parametrize("sharded", [False, True])
def test_records_stream_to_the_writer_without_piling_up(tmp_path: Path, sharded: bool) -> None:
    """64 records of 1 MiB: traced memory holds a few of them at once (it held up to 1,024)."""
    out = tmp_path / ("ds" if sharded else "o.smst")
    w = ShardedWriter(out, durable=False) if sharded else smstore.Writer(out, durable=False)
    with w:
        tracemalloc.start()
        try:
            _write(w, (bytes([i]) * (1 << 20) for i in range(64)))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 24 << 20, peak
    records = shard_records(out)[0] if sharded else read_records(out)
    assert records == [bytes([i]) * (1 << 20) for i in range(64)]


# ----------------------------------------------------------------------------- shard sizes


def test_sharded_writer_splits_every_call_where_a_shard_fills(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    sizes = rng.choice([0, 1, 7, 100, 999, 5000], 600)
    recs = [bytes(rng.integers(0, 256, int(n), dtype=np.uint8)) for n in sizes]
    data = b"".join(recs)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    for shard_size in (1, 500, 4096, 100_000):
        out = tmp_path / f"ds{shard_size}"
        with ShardedWriter(out, shard_size=shard_size, durable=False) as w:
            w.extend(recs[:100])  # bytes
            w.extend(iter([bytearray(r) for r in recs[100:200]]))  # any buffer, from an iterator
            w.extend_offsets(memoryview(data), offsets[200:401].astype(np.int32))  # not from 0, int32
            w.extend_offsets(data, offsets[400:501])
            for r in recs[500:510]:
                w.append(r)
            w.extend(np.frombuffer(r, np.uint8) for r in recs[510:])
        shards = shard_records(out)
        assert [r for shard in shards for r in shard] == recs
        assert_within_shard_size(shards, shard_size)
    # Text records count their UTF-8 bytes; shard_records holds too.
    texts = [("é☃" * int(n))[: int(n)] for n in sizes[:300]]
    with ShardedWriter(
        tmp_path / "text", encoding="lines", shard_size=300, shard_records=9, durable=False
    ) as w:
        w.extend(texts)
    shards = shard_records(tmp_path / "text")
    assert [r for shard in shards for r in shard] == [t.encode() for t in texts]
    assert_within_shard_size(shards, 300)
    assert max(map(len, shards)) <= 9


def test_sharded_writer_bad_offsets_named_at_their_place_in_the_call(tmp_path: Path) -> None:
    with ShardedWriter(tmp_path / "ds", shard_size=2, durable=False) as w:
        w.extend_offsets(b"abc", np.array([0, 1, 2, 3]))
        with pytest.raises(
            PackInputError, match=r"offsets\[4:6\] do not lie within the data buffer in order"
        ):
            w.extend_offsets(b"abcdef", np.array([0, 1, 2, 3, 4, 9, 10]))
        with pytest.raises(PackInputError, match=r"offsets\[2:4\] do not lie"):
            w.extend_offsets(b"abcdef", np.array([0, 2, 4, 3, 6]))
        w.abort()


def make_tar(path: Path, samples: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    with tarfile.open(path, "w") as tar:
        for i in range(samples):
            for ext, n in (("jpg", int(rng.integers(0, 3000))), ("cls", 1)):
                data = rng.bytes(n)
                info = tarfile.TarInfo(f"s{seed}-{i:05d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("fmt", ["megatron", "json-list", "arrow column", "arrow rows", "webdataset"])
def test_every_converter_keeps_shards_within_shard_size_plus_one_record(tmp_path: Path, fmt: str) -> None:
    shard_size = 8192

    def convert(out: Path, **kw: Any) -> None:
        if fmt == "megatron":
            convert_megatron(tmp_path / "c", out, progress=False, **kw)
        elif fmt == "json-list":
            convert_json_list(tmp_path / "l.json", out, key="annotations", progress=False, **kw)
        elif fmt.startswith("arrow"):
            from smstore.convert import convert_arrow

            column = "data" if fmt == "arrow column" else None
            convert_arrow(tmp_path / "t.parquet", out, column=column, progress=False, **kw)
        else:
            from smstore.convert import convert_webdataset

            convert_webdataset([tmp_path / "a.tar", tmp_path / "b.tar"], out, progress=False, **kw)

    rng = np.random.default_rng(11)
    if fmt == "megatron":
        write_mmidx(tmp_path / "c", [[np.arange(int(n))] for n in rng.integers(0, 900, 2000)], 4)
    elif fmt == "json-list":
        anns = [
            {"id": i, "segmentation": [list(range(int(n)))]} for i, n in enumerate(rng.integers(0, 300, 3000))
        ]
        (tmp_path / "l.json").write_text(json.dumps({"images": [], "annotations": anns}))
    elif fmt.startswith("arrow"):
        pa = pytest.importorskip("pyarrow")
        pq = pytest.importorskip("pyarrow.parquet")
        values = [bytes(rng.integers(0, 256, int(n), dtype=np.uint8)) for n in rng.integers(0, 500, 5000)]
        pq.write_table(
            pa.table({"data": pa.array(values, pa.binary()), "id": range(5000)}), tmp_path / "t.parquet"
        )
    else:
        make_tar(tmp_path / "a.tar", 150, 1)
        make_tar(tmp_path / "b.tar", 150, 2)
    convert(tmp_path / "one.smst")
    convert(tmp_path / "ds", shard_size=shard_size)
    shards = shard_records(tmp_path / "ds")
    assert len(shards) > 10
    assert [r for shard in shards for r in shard] == read_records(tmp_path / "one.smst")
    assert_within_shard_size(shards, shard_size)
