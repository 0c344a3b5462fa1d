"""Fuzz target: arbitrary bytes as a jsonl input to pack, differential against Python's json module."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import atheris
from _common import Finding, main, scratch_dir

with atheris.instrument_imports():
    import smstore

# csrc/json_check.cpp refuses nesting deeper than this (Python's limit is the recursion limit).
MAX_DEPTH = 512
WORK = Path(scratch_dir("jsonl"))
SOURCE, OUTPUT = WORK / "in.jsonl", WORK / "out.smst"


def pack_jsonl(source: Path, output: Path) -> None:
    """The one call into smstore: pack a jsonl file (PackInputError on a bad line)."""
    smstore.pack_files([source], output, format="jsonl", progress=False, durable=False)


def depth(value: Any) -> int:
    """Nesting depth as the C++ checker counts it: a scalar 0, [] 1, [[]] 2."""
    level, todo = 0, [(value, 0)]
    while todo:  # iterative: the value may be nested close to the recursion limit
        v, d = todo.pop()
        if isinstance(v, (list, dict)):
            level = max(level, d + 1)
            todo.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return level


@atheris.instrument_func
def accepts(line: bytes) -> bool:
    """RFC 8259 as tests/test_pack.py's oracle has it: Python's json without NaN/Infinity."""

    def reject_constant(name: str) -> object:
        raise ValueError(name)

    try:
        value = json.loads(line.decode("utf-8"), parse_constant=reject_constant)
    except (ValueError, RecursionError):
        return False
    return depth(value) <= MAX_DEPTH


def lines_of(data: bytes) -> list[bytes]:
    """Records as `smstore pack` cuts them: at each \\n, a final line without one included."""
    lines = data.split(b"\n")
    return lines[:-1] if lines[-1] == b"" else lines


def test_one_input(data: bytes) -> None:
    SOURCE.write_bytes(data)
    lines = lines_of(data)
    first_bad = next((k for k, line in enumerate(lines, 1) if not accepts(line)), None)
    try:
        pack_jsonl(SOURCE, OUTPUT)
    except smstore.PackInputError as e:
        if first_bad is None:
            raise Finding(f"valid jsonl refused: {e}") from e
        if f"{SOURCE}:{first_bad}:" not in str(e):
            raise Finding(f"line {first_bad} is the first bad one, but the error says: {e}") from e
        if OUTPUT.exists():
            raise Finding("a refused pack left its output") from e
        return
    if first_bad is not None:
        raise Finding(f"line {first_bad} is not JSON, but the pack succeeded: {lines[first_bad - 1]!r}")
    with smstore.open(OUTPUT, verify=True) as store:
        records = [bytes(r) for r in store]
    os.unlink(OUTPUT)
    if records != lines:
        raise Finding(f"packed {len(records)} records that differ from the {len(lines)} input lines")


if __name__ == "__main__":
    main(test_one_input)
