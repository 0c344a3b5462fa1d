"""Fuzz target: arbitrary bytes as an npy-lines input to pack, differential against a Python parser."""

from __future__ import annotations

import os
import re
from pathlib import Path

import atheris
import numpy as np
from _common import Finding, main, scratch_dir

with atheris.instrument_imports():
    import smstore

DTYPES = [np.dtype(t) for t in ("uint8", "uint16", "int32", "int64")]  # picked by input byte 0
WORK = Path(scratch_dir("npy-lines"))
SOURCE, OUTPUT = WORK / "in.txt", WORK / "out.smst"
# The grammar of csrc/npy_lines.cpp: tokens separated by these bytes, each an optional sign and
# ASCII decimal digits (so "-0" is a uint8, "+7" is 7), in the dtype's range.
TOKEN = re.compile(rb"[^ \t\r\v\f]+")
INTEGER = re.compile(rb"[+-]?[0-9]+")


def pack_npy(source: Path, output: Path, dtype: np.dtype) -> None:
    """The one call into smstore: pack an npy-lines file (PackInputError on a bad token)."""
    smstore.pack_npy_lines([source], output, dtype=dtype, progress=False, durable=False)


class BadToken(Exception):
    def __init__(self, column: int) -> None:
        self.column = column


@atheris.instrument_func
def parse_line(line: bytes, dtype: np.dtype) -> bytes:
    """The record for one line, or BadToken with the 1-based column of the first bad token."""
    info = np.iinfo(dtype)
    values = []
    for m in TOKEN.finditer(line):
        token = m.group()
        if not INTEGER.fullmatch(token) or not info.min <= int(token) <= info.max:
            raise BadToken(m.start() + 1)
        values.append(int(token))
    return np.array(values, dtype=dtype.newbyteorder("<")).tobytes()


def test_one_input(data: bytes) -> None:
    if not data:
        return
    dtype, text = DTYPES[data[0] % len(DTYPES)], data[1:]
    SOURCE.write_bytes(text)
    lines = text.split(b"\n")
    if lines[-1] == b"":  # a final \n ends the last line; it does not start another
        lines.pop()
    expected: list[bytes] = []
    bad: tuple[int, int] | None = None
    for k, line in enumerate(lines, 1):
        try:
            expected.append(parse_line(line, dtype))
        except BadToken as e:
            bad = (k, e.column)
            break
    try:
        pack_npy(SOURCE, OUTPUT, dtype)
    except smstore.PackInputError as e:
        if bad is None:
            raise Finding(f"valid {dtype} input refused: {e}") from e
        if f"{SOURCE}:{bad[0]}: column {bad[1]}:" not in str(e):
            raise Finding(
                f"line {bad[0]} column {bad[1]} is the first bad token, but the error says: {e}"
            ) from e
        if OUTPUT.exists():
            raise Finding("a refused pack left its output") from e
        return
    if bad is not None:
        raise Finding(f"line {bad[0]} column {bad[1]} is not a {dtype}, but the pack succeeded")
    with smstore.open(OUTPUT, verify=True) as store:
        records = [bytes(r) for r in store]
        encoding = store.encoding
    os.unlink(OUTPUT)
    if encoding != "npy:" + dtype.str or records != expected:
        raise Finding(f"packed {len(records)} {encoding} records that differ from the {len(lines)} lines")


if __name__ == "__main__":
    main(test_one_input)
