"""Array records: pack_arrays() for any iterable of 1-D arrays, and the npy-lines text packer."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from smstore import _core
from smstore.errors import PackInputError
from smstore.write.pack import PackStats, Writer
from smstore.write.packfiles import pack_text_inputs

__all__ = ["array_encoding", "pack_arrays", "pack_npy_lines"]


def _record_dtype(dtype: npt.DTypeLike, where: str) -> np.dtype[Any]:
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        msg = f"{where}: {dtype!r} is not a numpy dtype ({e})"
        raise PackInputError(msg) from None
    if dt.hasobject or dt.itemsize == 0 or dt.fields is not None or dt.subdtype is not None:
        msg = f"{where}: records need a plain fixed-size numeric dtype, not {dt}"
        raise PackInputError(msg)
    return dt.newbyteorder("=") if dt.byteorder not in ("=", "|") else dt


def array_encoding(dtype: npt.DTypeLike) -> str:
    """The blob encoding of arrays of ``dtype``: ``npy:`` and numpy's dtype string, e.g. ``npy:<u2``."""
    return "npy:" + str(_record_dtype(dtype, "array_encoding").str)


def pack_arrays(
    arrays: Iterable[npt.ArrayLike],
    path: str | os.PathLike[str],
    *,
    dtype: npt.DTypeLike | None = None,
    metadata: dict[str, Any] | None = None,
    durable: bool = True,
) -> int:
    """Pack 1-D arrays (token ids, features) into a blob, one array per record.

    The dtype goes into the metadata (encoding ``npy:<dtype.str>``), so ``decode="numpy"`` and
    ``decode="torch"`` read records back as zero-copy arrays or tensors of that dtype.

    Args:
        arrays: 1-D arrays or sequences of numbers, in record order.
        path: The output ``.smst`` file (written atomically).
        dtype: The records' dtype. Arrays of another dtype are cast when every value survives the
            cast unchanged (``int64`` token ids that fit in ``uint16``, say); by default the dtype
            of the first array.
        metadata: Your own JSON-serializable metadata, stored under ``"user"``.
        durable: fsync the file and its directory before publishing it.

    Returns:
        The number of records written.

    Raises:
        PackInputError: An array is not 1-D, or holds a value that ``dtype`` cannot represent.
    """
    where = os.fspath(path)
    it = iter(arrays)
    first: np.ndarray[Any, Any] | None = None
    if dtype is None:
        try:
            first = np.asarray(next(it))
        except StopIteration:
            msg = f"{where}: pack_arrays needs dtype= when there are no arrays to take it from"
            raise PackInputError(msg) from None
        dtype = first.dtype
    dt = _record_dtype(dtype, where)
    with Writer(path, encoding=array_encoding(dt), metadata=metadata, durable=durable) as w:
        if first is not None:
            w.append(_as_record(first, dt, where, 0).data)
        append = w.append
        for i, a in enumerate(it, start=w.record_count):
            append(_as_record(a, dt, where, i).data)
        return w.record_count


def _as_record(a: npt.ArrayLike, dt: np.dtype[Any], where: str, i: int) -> np.ndarray[Any, Any]:
    try:
        arr = np.asarray(a)
    except (ValueError, TypeError) as e:
        msg = f"{where}: record {i}: not an array ({e})"
        raise PackInputError(msg) from None
    if arr.ndim != 1:
        msg = f"{where}: record {i}: expected a 1-D array, got shape {arr.shape}"
        raise PackInputError(msg)
    if arr.dtype != dt:
        # Integers may narrow when their values fit; other kinds only cast within their kind.
        integral = arr.dtype.kind in "biu"
        if arr.dtype.hasobject or not (integral or np.can_cast(arr.dtype, dt, casting="same_kind")):
            msg = f"{where}: record {i}: cannot store {arr.dtype} values as {dt}"
            raise PackInputError(msg)
        if np.can_cast(arr.dtype, dt, casting="safe"):
            arr = arr.astype(dt)
        else:
            cast = arr.astype(dt)
            with np.errstate(invalid="ignore"):
                unchanged = np.array_equal(cast.astype(arr.dtype), arr)
            if not unchanged:
                bad = int(np.flatnonzero(cast.astype(arr.dtype) != arr)[0])
                msg = f"{where}: record {i}: value {arr[bad].item()!r} at position {bad} does not fit in {dt}"
                raise PackInputError(msg)
            arr = cast
    return np.ascontiguousarray(arr)


def pack_npy_lines(
    inputs: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    dtype: npt.DTypeLike = "uint16",
    metadata: dict[str, Any] | None = None,
    progress: bool | None = None,
    durable: bool = True,
    max_line_bytes: int = _core.DEFAULT_MAX_LINE_BYTES,
    jobs: int = 1,
    shard_size: int | None = None,
) -> PackStats:
    """Pack text files of integers (``-`` for stdin), one array record per line, in C++.

    Line ``i`` holds whitespace-separated decimal integers (token ids, say) and becomes record
    ``i``, an array of ``dtype``; an empty line is an empty array.

    Args:
        inputs: Files read in order; their records are concatenated.
        output: The ``.smst`` file to write (atomically).
        dtype: An integer dtype: ``int8`` .. ``int64`` or ``uint8`` .. ``uint64``.
        metadata: Your own JSON-serializable metadata, stored under ``"user"``.
        progress: Show a progress bar; by default only when stderr is a terminal.
        max_line_bytes: A longer line raises PackInputError (a line is parsed whole, in memory).
            Default 1 GiB.
        jobs, shard_size: Write a sharded dataset, packing shards in parallel (as for
            :func:`smstore.pack_files`).

    Raises:
        PackInputError: A token that is not an integer, a value out of the dtype's range, or a
            line longer than ``max_line_bytes``, with its file and line.
    """
    dt = _record_dtype(dtype, os.fspath(output))
    if dt.kind not in "iu":
        msg = f"npy-lines packs integers: dtype must be int8..int64 or uint8..uint64, not {dt}"
        raise PackInputError(msg)

    def run(writer: _core.Writer, names: list[Any], bar: Callable[[int], None] | None) -> int:
        return _core.pack_npy_lines(writer, names, dt.kind, dt.itemsize, bar, max_line_bytes)

    return pack_text_inputs(
        inputs,
        output,
        array_encoding(dt),
        run,
        metadata=metadata,
        progress=progress,
        durable=durable,
        jobs=jobs,
        shard_size=shard_size,
        item_size=dt.itemsize,
    )
