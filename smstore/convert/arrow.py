"""Parquet, Arrow IPC and Hugging Face ``save_to_disk`` folders -> smstore, batch by batch (pyarrow)."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import struct
from collections.abc import Generator, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet as pq

from smstore.convert._common import Progress, Spans, write_records
from smstore.errors import PackInputError
from smstore.format.objects import OBJECT_ENCODINGS, encode_objects
from smstore.write.pack import PackStats

__all__ = ["arrow_sources", "convert_arrow", "iter_batches", "read_schema"]

BATCH_ROWS = 4096
# Whole rows become Python objects a slice at a time, each slice at most about this many bytes of
# them (estimated by _cost), so one batch of huge rows never lives as objects all at once.
SLICE_BYTES = 64 << 20
_VALUE_BYTES = 64  # a Python value and the reference to it, roughly

_ARROW_ERRORS = (pa.ArrowException, OSError)
# What building a Python value from a valid Arrow value can raise (a date beyond year 9999).
_AS_PY_ERRORS = (pa.ArrowException, ValueError, TypeError, ArithmeticError, LookupError)


def arrow_sources(path: str | os.PathLike[str]) -> list[str]:
    """The files of a source, in order: a Parquet or Arrow file, a directory of them, or an HF folder.

    A Hugging Face ``save_to_disk`` folder is recognised by its ``state.json``, whose
    ``_data_files`` list its Arrow stream files in order.
    """
    p = os.fspath(path)
    if not os.path.isdir(p):
        if not os.path.exists(p):
            raise PackInputError(f"{p}: no such file or directory")
        return [p]
    state = os.path.join(p, "state.json")
    if os.path.isfile(state):
        try:
            with open(state, encoding="utf-8") as f:
                files = [os.path.join(p, d["filename"]) for d in json.load(f)["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise PackInputError(f"{state}: not a Hugging Face save_to_disk state file ({e})") from None
        return files
    files = sorted(
        os.path.join(p, n) for n in os.listdir(p) if n.endswith((".parquet", ".arrow", ".feather", ".ipc"))
    )
    if not files:
        raise PackInputError(f"{p}: no .parquet or .arrow files in this directory")
    return files


def _format(path: str) -> str:
    """``"parquet"``, ``"ipc-file"`` or ``"ipc-stream"``, from the file's first bytes."""
    with open(path, "rb") as f:
        magic = f.read(6)
    if magic[:4] == b"PAR1":
        return "parquet"
    return "ipc-file" if magic == b"ARROW1" else "ipc-stream"


def read_schema(path: str) -> pa.Schema:
    """A file's schema from its footer (Parquet, IPC file) or first message (IPC stream), no data.

    Raises:
        PackInputError: The file is not readable as Parquet or Arrow, naming it.
    """
    try:
        kind = _format(path)
        if kind == "parquet":
            schema = pq.read_schema(path)
        else:
            _check_ipc_lengths(path, kind, schema_only=True)
            with pa.memory_map(path) as mm:
                if kind == "ipc-file":
                    schema = pa.ipc.open_file(mm).schema
                else:
                    with pa.ipc.open_stream(mm) as stream:
                        schema = stream.schema
        _check_names(schema)
    except (*_ARROW_ERRORS, UnicodeDecodeError) as e:
        raise PackInputError(f"{path}: unreadable at record batch 0: cannot read its schema: {e}") from None
    return schema


class _Flat:
    """Bounds-checked reads of one flatbuffer (an IPC message's metadata, or a file's footer)."""

    def __init__(self, buf: bytes, where: str) -> None:
        self.buf = buf
        self.where = where

    def read(self, fmt: str, at: int) -> int:
        if at < 0 or at + struct.calcsize(fmt) > len(self.buf):
            raise PackInputError(f"{self.where}: corrupt metadata (an offset beyond it)")
        value: int = struct.unpack_from(fmt, self.buf, at)[0]
        return value

    def field(self, table: int, index: int) -> int | None:
        """Where field `index` of the table at `table` lies; None if absent (it has its default)."""
        vtable = table - self.read("<i", table)
        entry = 4 + 2 * index
        if entry + 2 > self.read("<H", vtable):
            return None
        at = self.read("<H", vtable + entry)
        return table + at if at else None

    def block_offsets(self, table: int, index: int) -> list[int]:
        """The message offsets of a footer's vector of Block structs (offset, metadata and body length)."""
        at = self.field(table, index)
        if at is None:
            return []
        vec = at + self.read("<I", at)
        n = self.read("<I", vec)
        if vec + 4 + 24 * n > len(self.buf):
            raise PackInputError(f"{self.where}: corrupt metadata ({n} blocks do not fit)")
        return [self.read("<q", vec + 4 + 24 * i) for i in range(n)]


_RECORD_BATCH = 3  # MessageHeader.RecordBatch (Arrow's Message.fbs)


def _message_end(data: mmap.mmap, at: int, where: str) -> tuple[int, int] | None:
    """The end and header type of the IPC message at byte `at`, checked to lie in `data`.

    None at the end of a stream. pyarrow allocates the metadata and body lengths a message
    declares before it finds the file shorter: checking them first keeps a corrupt length from
    costing that much memory.
    """
    if at + 4 > len(data):
        return None
    n: int = struct.unpack_from("<i", data, at)[0]
    start = at + 4
    if n == -1:  # the continuation marker, then the length (format 0.15 on)
        if at + 8 > len(data):
            return None
        n = struct.unpack_from("<i", data, at + 4)[0]
        start = at + 8
    if n == 0:
        return None
    if n < 0 or start + n > len(data):
        raise PackInputError(
            f"{where}: its message at byte {at} declares {n} bytes of metadata; the file ends first"
        )
    meta = _Flat(data[start : start + n], f"{where}: the message at byte {at}")
    root = meta.read("<I", 0)
    at_type, at_body = meta.field(root, 1), meta.field(root, 3)  # Message.header_type, .bodyLength
    body = meta.read("<q", at_body) if at_body is not None else 0
    if body < 0 or start + n + body > len(data):
        raise PackInputError(
            f"{where}: its message at byte {at} declares a body of {body} bytes; the file ends first"
        )
    return start + n + body, meta.read("<B", at_type) if at_type is not None else 0


def _check_ipc_lengths(path: str, kind: str, *, schema_only: bool = False) -> None:
    """Check that every message of an IPC stream, or every block of an IPC file, lies inside it.

    `schema_only`: only what reading the schema reads, a stream's first message (pyarrow checks
    a file's footer length itself).
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return  # pyarrow names what is wrong with an empty file
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if kind == "ipc-stream":
                message: tuple[int, int] | None = (0, 0)
                batches = 0  # a fault is named by the record batch it stops, as pyarrow's are
                while message is not None:
                    message = _message_end(data, message[0], f"{path}: unreadable at record batch {batches}")
                    if message is not None and message[1] == _RECORD_BATCH:
                        batches += 1
                    if schema_only:
                        return
                return
            if schema_only or size < 10 or data[-6:] != b"ARROW1":
                return  # without a footer, pyarrow names the fault
            footer_len = struct.unpack_from("<i", data, size - 10)[0]
            if not 0 < footer_len <= size - 10:
                raise PackInputError(f"{path}: unreadable at record batch 0: a footer of {footer_len} bytes")
            footer = _Flat(data[size - 10 - footer_len : size - 10], f"{path}: unreadable at its footer")
            root = footer.read("<I", 0)
            records = footer.block_offsets(root, 3)  # Footer.recordBatches
            # pyarrow reads a file's dictionaries with its first record batch: a file of none never
            # reads them, and is read as no records whatever its dictionary blocks hold.
            dictionaries = footer.block_offsets(root, 2) if records else []  # Footer.dictionaries
            for name, offsets in (("dictionary batch", dictionaries), ("record batch", records)):
                for k, offset in enumerate(offsets):
                    if not 0 <= offset < size:
                        raise PackInputError(f"{path}: unreadable at {name} {k}: it lies at byte {offset}")
                    _message_end(data, offset, f"{path}: unreadable at {name} {k}")


def _check_names(fields: Any) -> None:
    """Decode every field name, nested ones too: pyarrow decodes them (as UTF-8) only when asked."""
    for f in fields:
        f.name  # noqa: B018 - raises UnicodeDecodeError for a name that is not UTF-8
        t = f.type
        while isinstance(t, pa.BaseExtensionType) or pa.types.is_dictionary(t):
            t = t.storage_type if isinstance(t, pa.BaseExtensionType) else t.value_type
        _check_names([t.field(i) for i in range(t.num_fields)])


def _raw_batches(path: str, columns: list[str] | None) -> Generator[pa.RecordBatch, None, None]:
    kind = _format(path)
    if kind == "parquet":
        # Pre-buffering holds whole column chunks; page checksums are verified where the file has them.
        with pq.ParquetFile(path, pre_buffer=False, page_checksum_verification=True) as pf:
            yield from pf.iter_batches(batch_size=BATCH_ROWS, columns=columns)
        return
    # A mapping, not reads: a buffer the metadata declares is a view of the file (checked to lie
    # inside it), never an allocation of whatever length a corrupt header claims.
    with pa.memory_map(path) as mm:
        schema = read_schema(path)
        _check_ipc_lengths(path, kind)
        fields = None if columns is None else [schema.get_field_index(c) for c in columns]
        options = pa.ipc.IpcReadOptions(included_fields=fields)
        if kind == "ipc-file":
            reader = pa.ipc.open_file(mm, options=options)
            for k in range(reader.num_record_batches):
                yield reader.get_batch(k)
        else:
            with pa.ipc.open_stream(mm, options=options) as stream:
                yield from stream


def iter_batches(path: str, columns: list[str] | None = None) -> Iterator[pa.RecordBatch]:
    """Record batches of one Parquet or Arrow IPC (file or stream) file, never the whole table.

    Every batch is validated in full before it is yielded (offsets, dictionary indices, UTF-8 of
    strings, Parquet page checksums where the file carries them), so reading its values can
    neither crash nor build more values than the file and its decoded data hold.

    Raises:
        PackInputError: The file is not readable as Parquet or Arrow, or a batch is invalid, naming
            the file and the batch (and the row and column where one is at fault).
    """
    size = os.path.getsize(path)
    with contextlib.closing(_raw_batches(path, columns)) as batches:  # unmapped however this ends
        k = row = 0
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except _ARROW_ERRORS as e:
                raise PackInputError(f"{path}: unreadable at record batch {k}: {e}") from None
            _validate(batch, f"{path}: record batch {k}", row, size)
            yield batch
            k += 1
            row += batch.num_rows


def _validate(batch: pa.RecordBatch, where: str, row: int, file_size: int) -> None:
    """Raise PackInputError at `where` unless every value of `batch` can be read safely.

    `row` is the batch's first row in its file.
    """
    try:
        batch.validate(full=True)  # first: wrapping a column in Python may mend its null count
    except _ARROW_ERRORS as e:
        with contextlib.suppress(LookupError):
            for name, col in zip(batch.schema.names, batch.columns, strict=True):
                try:
                    col.validate(full=True)
                except _ARROW_ERRORS as ce:
                    bad = _first_invalid_row(col)
                    at = "" if bad is None else f", row {row + bad}"
                    raise PackInputError(f"{where}{at}, column {name!r}: {ce}") from None
        raise PackInputError(f"{where}: {e}") from None
    try:
        columns = batch.columns
    except LookupError as e:  # a type pyarrow has no Python class for (a day-time interval)
        raise PackInputError(f"{where}: a column pyarrow cannot read in Python (type id {e})") from None
    # A valid array may still declare lengths no data backs (null values, empty structs, long
    # runs): every honest value takes at least a bit of a buffer in the file or decoded from it.
    bound = 8 * (file_size + pa.total_allocated_bytes()) + BATCH_ROWS
    if batch.num_rows > bound:
        raise PackInputError(f"{where}: declares {batch.num_rows} rows, more than the file can hold")
    for name, col in zip(batch.schema.names, columns, strict=True):
        n = max(_lengths(col))
        if n > bound:
            raise PackInputError(
                f"{where}, column {name!r}: declares {n} values, more than the file and its decoded data hold"
            )


def _first_invalid_row(col: pa.Array) -> int | None:
    """The first row whose value fails full validation, if validating prefixes can tell.

    A nested array validates its whole child whatever the slice, so only top-level faults (a
    string's UTF-8, a binary's offsets) are found; otherwise None.
    """

    def valid(n: int) -> bool:
        try:
            col.slice(0, n).validate(full=True)
        except _ARROW_ERRORS:
            return False
        return True

    try:
        col.validate()  # structure first: slicing a structurally broken array reads nothing sane
    except _ARROW_ERRORS:
        return None
    if not valid(0):
        return None
    lo, hi = 0, len(col)  # the prefix of lo rows is valid, that of hi rows is not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if valid(mid) else (lo, mid)
    return lo


def _children(arr: pa.Array) -> list[pa.Array]:
    """The arrays `arr` is built from, unsliced: what its metadata declares."""
    t = arr.type
    if isinstance(t, pa.BaseExtensionType):
        return [arr.storage]
    if pa.types.is_dictionary(t):
        return [arr.dictionary]
    if pa.types.is_run_end_encoded(t):
        return [arr.run_ends, arr.values]
    if (
        pa.types.is_list(t)
        or pa.types.is_large_list(t)
        or pa.types.is_fixed_size_list(t)
        or pa.types.is_list_view(t)
        or pa.types.is_large_list_view(t)
        or pa.types.is_map(t)
    ):
        return [arr.values]
    if pa.types.is_struct(t) or pa.types.is_union(t):
        return [arr.field(i) for i in range(t.num_fields)]
    return []


def _lengths(arr: pa.Array) -> Iterator[int]:
    """The length of `arr` and of every array nested in it."""
    yield len(arr)
    for child in _children(arr):
        yield from _lengths(child)


def _offsets(arr: pa.Array) -> np.ndarray[Any, Any]:
    """A validated (large) binary or string array's offsets, its slice only: len(arr) + 1 of them."""
    if len(arr) == 0:
        return np.zeros(1, np.int64)  # an empty array may have no offsets buffer at all
    large = pa.types.is_large_binary(arr.type) or pa.types.is_large_string(arr.type)
    # Validation checked that the buffer holds these; it may hold a few bytes more.
    offs = np.frombuffer(arr.buffers()[1], np.int64 if large else np.int32, count=arr.offset + len(arr) + 1)
    return offs[arr.offset :]


def _cost(arr: pa.Array) -> int:
    """Bytes the Python objects of `arr` (a slice, maybe) take, roughly; from offsets, never per value."""
    n = len(arr)
    if n == 0:
        return 0
    t = arr.type
    values = n * _VALUE_BYTES
    if isinstance(t, pa.BaseExtensionType):
        return _cost(arr.storage)
    if (
        pa.types.is_binary(t)
        or pa.types.is_string(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_large_string(t)
    ):
        offs = _offsets(arr)
        return values + int(offs[-1]) - int(offs[0])
    if pa.types.is_fixed_size_binary(t):
        return values + n * int(t.byte_width)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_map(t):
        offs = arr.offsets
        lo, hi = offs[0].as_py(), offs[-1].as_py()
        return values + _cost(arr.values.slice(lo, hi - lo))
    if pa.types.is_fixed_size_list(t):
        k = t.list_size
        return values + _cost(arr.values.slice(arr.offset * k, n * k))
    if pa.types.is_struct(t) or pa.types.is_union(t):
        return values + sum(_cost(arr.field(i)) for i in range(t.num_fields))
    if pa.types.is_dictionary(t) or pa.types.is_run_end_encoded(t):
        # Every row builds its own copy of the value it refers to: the average value, n times.
        shared = arr.dictionary if pa.types.is_dictionary(t) else arr.values
        return values + (n * _cost(shared) // len(shared) if len(shared) else 0)
    if pa.types.is_list_view(t) or pa.types.is_large_list_view(t):
        return values + _cost(arr.values)  # views may share or skip values: the most they can build
    if pa.types.is_binary_view(t) or pa.types.is_string_view(t):
        return values + int(arr.nbytes)
    return values


def _slices(batch: pa.RecordBatch) -> Iterator[tuple[int, pa.RecordBatch]]:
    """`batch` in consecutive slices (with their first row) of at most SLICE_BYTES of objects, or one row."""
    start, step = 0, BATCH_ROWS
    while start < batch.num_rows:
        size = min(step, batch.num_rows - start)
        piece = batch.slice(start, size)
        while size > 1 and size * _VALUE_BYTES + sum(_cost(c) for c in piece.columns) > SLICE_BYTES:
            size //= 2
            piece = batch.slice(start, size)
        yield start, piece
        start += size
        step = min(BATCH_ROWS, 2 * size)


def _row_objects(piece: pa.RecordBatch, where: str, row: int) -> list[dict[str, Any]]:
    """`piece.to_pylist()`, or PackInputError naming the row and column a value cannot be built from."""
    try:
        rows: list[dict[str, Any]] = piece.to_pylist()
        return rows
    except _AS_PY_ERRORS as e:
        for name, col in zip(piece.schema.names, piece.columns, strict=True):
            for i in range(len(col)):  # the error path only: find the value
                try:
                    col[i].as_py()
                except _AS_PY_ERRORS as ce:
                    msg = (
                        f"{where}, row {row + i}, column {name!r}: no Python value: {type(ce).__name__}: {ce}"
                    )
                    raise PackInputError(msg) from None
        raise PackInputError(f"{where}: no Python values: {type(e).__name__}: {e}") from None


def _column_kind(t: pa.DataType) -> str | None:
    """``"bytes"`` or ``"lines"`` for a type whose values are bytes or text, else None."""
    if isinstance(t, pa.BaseExtensionType):
        return _column_kind(t.storage_type)
    if pa.types.is_dictionary(t):
        return _column_kind(t.value_type)
    if (
        pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_binary_view(t)
        or pa.types.is_fixed_size_binary(t)
    ):
        return "bytes"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "lines"
    return None


def _plain(col: pa.Array) -> pa.Array:
    """A column of _column_kind as a binary, string or fixed-size binary array (one C++ call, no rows)."""
    while True:
        t = col.type
        if isinstance(t, pa.BaseExtensionType):
            col = col.storage
        elif pa.types.is_dictionary(t):
            col = col.dictionary_decode()
        elif pa.types.is_binary_view(t):
            col = col.cast(pa.large_binary())
        elif pa.types.is_string_view(t):
            col = col.cast(pa.large_string())
        else:
            return col


def _canon(t: pa.DataType) -> pa.DataType:
    """The type that stands for every type whose values Python sees as the same kind of object."""
    if pa.types.is_dictionary(t):
        return _canon(t.value_type)
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return pa.string()
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return pa.binary()
    if pa.types.is_integer(t):
        return pa.int64()
    if pa.types.is_floating(t):
        return pa.float64()
    if (
        pa.types.is_list(t)
        or pa.types.is_large_list(t)
        or pa.types.is_list_view(t)
        or pa.types.is_large_list_view(t)
    ):
        return pa.list_(_canon(t.value_type))
    return t


def _agree(a: pa.DataType, b: pa.DataType) -> bool:
    """Whether rows of type `a` and of type `b` become the same kind of Python objects (null: any)."""
    a, b = _canon(a), _canon(b)
    if pa.types.is_null(a) or pa.types.is_null(b):
        return True
    if pa.types.is_list(a) and pa.types.is_list(b):
        return _agree(a.value_type, b.value_type)
    if pa.types.is_fixed_size_list(a) and pa.types.is_fixed_size_list(b):
        return a.list_size == b.list_size and _agree(a.value_type, b.value_type)
    if pa.types.is_map(a) and pa.types.is_map(b):
        return _agree(a.key_type, b.key_type) and _agree(a.item_type, b.item_type)
    if pa.types.is_struct(a) and pa.types.is_struct(b):
        return [f.name for f in a] == [f.name for f in b] and all(
            _agree(x.type, y.type) for x, y in zip(a, b, strict=True)
        )
    return bool(a == b)


def _check_schemas(files: list[str], column: str | None) -> str | None:
    """Read every file's schema before anything is written; the column's kind (``bytes``/``lines``).

    Raises:
        PackInputError: A file lacks the column, or its type is not bytes or text, or the files
            disagree on a column's type, naming the file, the column and both types.
    """
    first = read_schema(files[0])
    kind = None
    for path in files:
        schema = first if path is files[0] else read_schema(path)
        if column is not None:
            at = schema.get_all_field_indices(column)
            if not at:
                raise PackInputError(f"{path}: no column {column!r} (columns: {', '.join(schema.names)})")
            if len(at) > 1:
                raise PackInputError(f"{path}: {len(at)} columns are named {column!r}")
            t = schema.field(at[0]).type
            k = _column_kind(t)
            if kind is not None and k != kind:
                t0 = first.field(column).type
                raise PackInputError(
                    f"{path}: column {column!r} is {t}, but in {files[0]} it is {t0}; every file must agree"
                )
            if k is None:
                raise PackInputError(
                    f"{path}: column {column!r} is {t}, not binary or string; omit --column to store rows"
                )
            kind = k
        elif path is files[0]:
            continue  # rows: the first file is what the others are compared with
        elif sorted(schema.names) != sorted(first.names):  # the order of a row's keys does not matter
            raise PackInputError(
                f"{path}: columns {schema.names} differ from {first.names} in {files[0]}; every file must agree"
            )
        else:
            # A name may stand twice (a row's dict keeps the last, as to_pylist does): compare the
            # n-th column of a name with the n-th of that name in the first file.
            types: dict[str, list[pa.DataType]] = {}
            for f in first:
                types.setdefault(f.name, []).append(f.type)
            seen: dict[str, int] = {}
            for f in schema:
                n = seen[f.name] = seen.get(f.name, -1) + 1
                if not _agree(f.type, types[f.name][n]):
                    raise PackInputError(
                        f"{path}: column {f.name!r} is {f.type}, but in {files[0]} it is {types[f.name][n]}; "
                        "every file must agree"
                    )
    return kind


def convert_arrow(
    source: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    column: str | None = None,
    encoding: str | None = None,
    metadata: dict[str, Any] | None = None,
    shard_size: int | None = None,
    durable: bool = True,
    progress: bool | None = None,
) -> PackStats:
    """Convert Parquet / Arrow IPC / a Hugging Face ``save_to_disk`` folder into a blob.

    Args:
        source: A ``.parquet`` or Arrow file, a directory of them, or an HF dataset folder.
        output: The ``.smst`` blob (with ``shard_size``, a dataset directory).
        column: Records are this column's values: a binary column as ``bytes``, a string column as
            UTF-8 text (encoding ``lines``; decode ``"utf8"``); a dictionary column as its values.
            Without it, each row is one object record (a dict), pickled (``encoding="json"`` for JSON).
        encoding: Override the encoding chosen above.
        metadata: JSON-able metadata stored with the blob.
        shard_size: Bytes of records per shard: write a sharded dataset.
        durable: fsync the output before it is moved into place.
        progress: Show a progress bar (default: on a terminal).

    Raises:
        PackInputError: A missing column, files that disagree on a column's type, a null value,
            invalid UTF-8 in a string, a corrupt file (named, with its batch, and the row and
            column where known). Nothing is written unless every file's schema fits.
    """
    files = arrow_sources(source)
    schema_kind = _check_schemas(files, column)
    enc = encoding or schema_kind or "pickle"
    if column is None and enc not in OBJECT_ENCODINGS:
        raise PackInputError(
            f"rows are stored as objects: encoding must be one of {', '.join(OBJECT_ENCODINGS)}, not {enc!r}"
        )
    total = sum(os.path.getsize(f) for f in files)
    bar = Progress(total, progress, "convert")

    def records() -> Iterator[Any]:
        done = 0
        for path in files:
            row = 0
            for k, batch in enumerate(iter_batches(path, [column] if column else None)):
                where = f"{path}: record batch {k}"
                if column is not None:
                    yield _column_spans(batch.column(0), where, path, row, column)
                else:
                    yield from _row_records(batch, where, row, enc)
                row += batch.num_rows
            done += os.path.getsize(path)
            bar.update(done)

    return write_records(
        records(),
        output,
        encoding=enc,
        source=files,
        metadata=metadata,
        durable=durable,
        shard_size=shard_size,
        input_bytes=total,
        bar=bar,
    )


def _column_spans(col: pa.Array, where: str, path: str, row: int, column: str) -> Spans:
    col = _plain(col)
    if col.null_count:
        bad = row + col.is_null().to_pylist().index(True)  # the error path only
        raise PackInputError(f"{path}: row {bad}: column {column!r} is null")
    return _spans(col, where)


_OBJECT_PREFIX = re.compile(r"^object \d+ \([^)]*\) ")


def _row_records(batch: pa.RecordBatch, where: str, row: int, enc: str) -> Iterator[bytes]:
    """Each row of `batch` as one encoded object record, built a bounded slice at a time."""
    for start, piece in _slices(batch):
        objects = _row_objects(piece, where, row + start)
        done = 0
        try:
            for record in encode_objects(objects, enc):
                yield record
                done += 1
        except PackInputError as e:
            # encode_objects counts within the slice: name the row in the file instead.
            raise PackInputError(
                f"{where}, row {row + start + done}: {_OBJECT_PREFIX.sub('', str(e))}"
            ) from None


def _spans(col: pa.Array, where: str = "") -> Spans:
    """A binary or string array's records as its data buffer and offsets: no Python object per row.

    `where` names the input (file and batch) for the writer's errors.
    """
    if pa.types.is_fixed_size_binary(col.type):
        width = col.type.byte_width
        data = col.buffers()[1]
        offsets = np.arange(col.offset, col.offset + len(col) + 1, dtype=np.int64) * width
        return Spans(data if data is not None else b"", offsets, where)
    return Spans(col.buffers()[2] or b"", _offsets(col), where)
