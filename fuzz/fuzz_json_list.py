"""Fuzz target: a JSON document for convert_json_list, differential against Python's json.loads."""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import atheris
from _common import Finding, check_refusal, difference, feature, main, same, scratch_dir

with atheris.instrument_imports(include=["smstore"]):
    import smstore
    from smstore.convert.json_list import convert_json_list

# Flag byte 0, bit 0: the list is the value of this top-level key (convert_json_list(key=KEY)).
KEY_FLAG, KEY = 1, "k"
# Up to this nesting depth of the whole document (a list is 1) a valid list must convert. Deeper,
# a PackInputError is allowed too (never a RecursionError): json.loads nests about 990 deep in
# Python's default recursion limit, pickle (the records' encoding) about 490.
MUST_CONVERT_DEPTH = 256
WORK = Path(scratch_dir("json-list"))
SOURCE, OUTPUT = WORK / "in.json", WORK / "out.smst"
OFFSET = re.compile(r"(?:character|byte) (\d+)")  # where in the file
DIGITS = re.compile(r"\d+")


def convert(source: Path, output: Path, key: str | None) -> None:
    """The one call into smstore: a JSON list of objects to a blob of pickled objects."""
    convert_json_list(source, output, key=key, progress=False, durable=False)


@dataclass
class Reading:
    """What json.loads makes of the document: the list's elements, or why it is refused."""

    elements: list[Any] | None
    why: str
    depth: int = 0
    strict: bool = True  # beyond doubt: the converter must not refuse it (if not too deep)


def depth(value: Any) -> int:
    """Nesting depth as json counts it: a scalar 0, [] 1, [{}] 2 (iterative: it may be deep)."""
    level, todo = 0, [(value, 0)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (list, dict)):
            level = max(level, d + 1)
            todo.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return level


def loads(text: str | bytes, **options: Any) -> Any:
    """json.loads, given the stack it needs: nesting past the recursion limit is the converter's limit, not JSON's."""
    try:
        return json.loads(text, **options)
    except RecursionError:
        pass
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(limit + 2 * len(text))  # inputs are a few KB: a few MB of C stack at most
    try:
        return json.loads(text, **options)
    finally:
        sys.setrecursionlimit(limit)


@atheris.instrument_func
def read(text: str | bytes, key: str | None) -> Reading:
    """The elements the converter must give for this text: json.loads's list of objects."""
    try:
        doc = loads(text)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, too many integer digits
        return Reading(None, f"json.loads: {type(e).__name__}: {e}")
    value, strict = doc, True
    if key is not None:
        if not isinstance(doc, dict) or key not in doc:
            return Reading(None, f"the top level is not an object holding {key!r}")
        value = doc[key]  # as json.loads: the last of duplicate keys
        # RFC 8259 leaves duplicate names to the parser: refusing them is allowed too.
        pairs = loads(text, object_pairs_hook=lambda p: p)
        strict = [k for k, _ in pairs].count(key) == 1
    if not isinstance(value, list):
        return Reading(None, f"not a list but a {type(value).__name__}")
    for i, element in enumerate(value):
        if not isinstance(element, dict):
            return Reading(None, f"element {i} is a {type(element).__name__}")
    return Reading(value, "", depth(doc), strict)


def readings(data: bytes, key: str | None) -> list[Reading]:
    """The document as UTF-8 text (what the converter documents), and as json.loads(bytes) reads it.

    The two differ only where json.detect_encoding sees a BOM or UTF-16/32: then either is allowed.
    """
    try:
        found = [read(data.decode("utf-8", "surrogatepass"), key)]
    except UnicodeDecodeError as e:
        found = [Reading(None, f"not UTF-8: {e}")]
    if json.detect_encoding(data) != "utf-8":
        found.append(read(data, key))
    return found


def test_one_input(data: bytes) -> None:
    if not data:
        return
    key = KEY if data[0] & KEY_FLAG else None
    text = data[1:]
    SOURCE.write_bytes(text)
    OUTPUT.unlink(missing_ok=True)  # left by an earlier input that raised a finding, where fuzzing goes on
    found = readings(text, key)
    valid = [r for r in found if r.elements is not None]
    must_convert = (
        len(found) == 1 and bool(valid) and valid[0].strict and valid[0].depth <= MUST_CONVERT_DEPTH
    )
    feature(DIGITS.sub("", found[0].why)[:70] if not valid else f"valid, depth {min(valid[0].depth, 8)}")
    try:
        convert(SOURCE, OUTPUT, key)
    except smstore.PackInputError as e:
        offset = OFFSET.search(str(e))
        if offset is None or int(offset.group(1)) > len(text):
            raise Finding(f"the refusal does not name an offset in the file: {e}") from e
        instead = f"a valid list of {len(valid[0].elements or []) if valid else 0} objects"
        check_refusal(e, SOURCE, OUTPUT, must_convert=must_convert, instead=instead)
        return
    if not valid:
        raise Finding(f"converted, but json.loads refuses it ({found[0].why})")
    with smstore.open(OUTPUT, verify=True) as store:
        records = list(store)
    os.unlink(OUTPUT)
    if not any(same(records, r.elements) for r in valid):
        expected = valid[0].elements or []
        raise Finding(
            f"{len(records)} records differ from json.loads's {len(expected)}: {difference(records, expected)}"
        )


if __name__ == "__main__":
    main(test_one_input)
