"""Where a SharedList's objects come from when only one process per node loads them: files, parsers, keys."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = ["PARSERS", "daemon_key", "file_key", "file_loader"]

PARSERS = ("json", "jsonl", "pickle")


def file_key(path: str | os.PathLike[str], parser: str, field: str | None, encoding: str) -> str:
    """A key that changes whenever the file does: its identity, size and mtime, and how it is parsed.

    Raises:
        OSError: The file cannot be found (as ``os.stat``).
    """
    real = os.path.realpath(path)
    st = os.stat(real)
    return (
        f"file:{real}:dev={st.st_dev}:ino={st.st_ino}:size={st.st_size}:mtime_ns={st.st_mtime_ns}"
        f":parser={parser}:field={field}:encoding={encoding}"
    )


def daemon_key(key: str) -> str:
    """The daemon's content key for a source key (its keys are '<algorithm>:<hex>')."""
    return "source-blake2b-128:" + hashlib.blake2b(key.encode(), digest_size=16).hexdigest()


def _json_items(path: str, field: str | None) -> Iterable[Any]:
    with open(path, "rb") as f:
        data = json.load(f)
    if field is not None:
        if not isinstance(data, dict) or field not in data:
            msg = f"{path}: field {field!r} not found at the top level (a JSON object's keys)"
            raise ValueError(msg)
        data = data[field]
    if not isinstance(data, list):
        msg = f"{path}: expected a JSON array{'' if field is None else f' at {field!r}'}, got {type(data).__name__}; pass field="
        raise TypeError(msg)
    return data


def _jsonl_items(path: str) -> Iterator[Any]:
    # One line at a time: the file's objects never sit in memory all at once.
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    msg = f"{path}: line {number} is not JSON: {e}"
                    raise ValueError(msg) from None


def _pickle_items(path: str) -> Iterable[Any]:
    with open(path, "rb") as f:
        data = pickle.load(f)  # a pickle file runs code when loaded: the user's own file only
    if not isinstance(data, Iterable):
        msg = f"{path}: the pickle holds a {type(data).__name__}, not a list"
        raise TypeError(msg)
    return data


def file_loader(
    path: str | os.PathLike[str], parser: str | Callable[[str], Iterable[Any]], field: str | None
) -> Callable[[], Iterable[Any]]:
    """A function returning the objects of ``path`` parsed by ``parser`` (a name in PARSERS or a function).

    Raises:
        ValueError: ``parser`` is unknown, or ``field`` is given with a parser other than "json".
    """
    where = os.fspath(path)
    if callable(parser):
        return lambda: parser(where)
    if parser not in PARSERS:
        msg = (
            f"parser must be one of {', '.join(map(repr, PARSERS))} or a function of the path, not {parser!r}"
        )
        raise ValueError(msg)
    if field is not None and parser != "json":
        msg = f"field= selects a key of a JSON object; it does not apply to parser={parser!r}"
        raise ValueError(msg)
    if parser == "json":
        return lambda: _json_items(where, field)
    if parser == "jsonl":
        return lambda: _jsonl_items(where)
    return lambda: _pickle_items(where)
