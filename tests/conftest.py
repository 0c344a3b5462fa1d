"""Shared fixtures: small corpora with awkward bytes and helpers to pack them."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import settings

# Make the helper module importable by name, here and in spawn/forkserver children (they inherit sys.path).
sys.path.insert(0, str(Path(__file__).parent))

from smstore_testlib import AWKWARD

import smstore

# No example database: the suite leaves nothing behind in the source tree.
settings.register_profile("smstore", database=None)
settings.load_profile("smstore")


@pytest.fixture(autouse=True, scope="session")
def _run_outside_the_source_tree() -> Iterator[None]:
    """Run the suite (and every subprocess it starts) from tests/, not the repository root.

    From the root, `python -m smstore` or `python -c "import smstore"` would import the source
    tree's smstore/ (which has no compiled module) instead of the installed package.
    """
    before = Path.cwd()
    os.chdir(Path(__file__).parent)
    try:
        yield
    finally:
        os.chdir(before)


@pytest.fixture
def awkward_records() -> list[bytes]:
    return list(AWKWARD)


@pytest.fixture
def make_blob(tmp_path: Path) -> Callable[..., Path]:
    """Pack records (with smstore.pack) into a fresh file under tmp_path and return its path."""
    counter = iter(range(10**9))

    def _make(records: list[bytes] | list[str], name: str | None = None, **kw: object) -> Path:
        path = tmp_path / (name or f"blob{next(counter)}.smst")
        kw.setdefault("durable", False)
        smstore.pack(records, path, **kw)  # type: ignore[arg-type]
        return path

    return _make


@pytest.fixture
def awkward_blob(make_blob: Callable[..., Path]) -> Path:
    return make_blob(AWKWARD, name="awkward.smst")
