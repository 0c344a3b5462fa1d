"""What the fuzz targets share: the finding exception, a scratch directory, coverage labels, the entry point."""

from __future__ import annotations

import os
import re
import sys
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import atheris


class Finding(Exception):
    """An invariant of a target does not hold: the input that raised it is a bug report."""


def scratch_dir(name: str) -> str:
    """A fresh directory for one fuzzing process.

    libFuzzer ends the process with exit(), so no Python cleanup runs: fuzz/run.py points
    $SMSTORE_FUZZ_TMPDIR at a directory it removes afterwards; a direct run leaves an empty
    directory under the system temp dir.
    """
    return tempfile.mkdtemp(prefix=f"smstore-{name}-", dir=os.environ.get("SMSTORE_FUZZ_TMPDIR"))


def _label_leaves(n: int) -> Callable[[int], None]:
    """An instrumented function with one branch per value below `n`: each value reached is one edge."""
    source = "def leaf(h):\n" + "".join(f"    if h == {k}:\n        return\n" for k in range(n))
    scope: dict[str, Any] = {}
    exec(source, scope)  # noqa: S102 - generated from constants above
    return atheris.instrument_func(scope["leaf"])


_LEAF = _label_leaves(256)


def feature(label: str) -> None:
    """Count `label` as coverage, so that an input bringing a new one is kept in the corpus.

    For targets whose parser is not instrumented (pyarrow is a plain wheel): labels such as a
    column's type or the first words of the library's error message stand in for the parser's
    branches. A label hashes to one of 256 branches; how often one is hit counts too, as libFuzzer
    buckets hit counts.
    """
    _LEAF(zlib.crc32(label.encode("utf-8", "surrogatepass")) & 255)


def same(a: Any, b: Any) -> bool:
    """Deep equality of decoded records: the same types throughout, NaN equal to NaN, no recursion.

    Iterative, as a record may be nested close to the recursion limit.
    """
    todo = [(a, b)]
    while todo:
        x, y = todo.pop()
        if type(x) is not type(y):
            return False
        if isinstance(x, dict):
            if list(x) != list(y):
                return False
            todo.extend((x[k], y[k]) for k in x)
        elif isinstance(x, (list, tuple)):
            if len(x) != len(y):
                return False
            todo.extend(zip(x, y, strict=True))
        elif not _equal_scalars(x, y):
            return False
    return True


def _equal_scalars(x: Any, y: Any) -> bool:
    if isinstance(x, float):
        return repr(x) == repr(y)  # nan equals nan; 0.0 and -0.0 differ
    try:
        return bool(x == y) or repr(x) == repr(y)  # Decimal('NaN') equals itself by repr only
    except ArithmeticError:  # Decimal('sNaN') refuses comparison
        return repr(x) == repr(y)


def difference(records: list[Any], expected: list[Any]) -> str:
    """Where two lists of records first differ, for a finding's message."""
    for i, (a, b) in enumerate(zip(records, expected, strict=False)):
        if not same(a, b):
            return f"record {i} is {a!r:.200}, expected {b!r:.200}"
    return f"{len(records)} records, expected {len(expected)}"


def main(test_one_input: Callable[[bytes], None]) -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


_DIGITS = re.compile(r"\d+")


def check_refusal(error: Exception, source: Path, output: Path, *, must_convert: bool, instead: str) -> None:
    """What every converter target holds a PackInputError to: it labels coverage by its wording,
    leaves no output, names the input file, and comes only where a refusal is allowed.

    Raises:
        Finding: One of these does not hold; `instead` says what the library reads (``"pyarrow
            reads 3 records"``) for a refusal where the input must convert.
    """
    feature(_DIGITS.sub("", str(error).replace(str(source), ""))[:70])
    if output.exists():
        raise Finding("a refused conversion left its output") from error
    if str(source) not in str(error):
        raise Finding(f"the refusal does not name the file: {error}") from error
    if must_convert:
        raise Finding(f"{instead}, but: {error}") from error
