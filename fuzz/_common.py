"""What the fuzz targets share: the finding exception, a scratch directory, the atheris entry point."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable

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


def main(test_one_input: Callable[[bytes], None]) -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
