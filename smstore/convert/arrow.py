"""Parquet, Arrow IPC and Hugging Face ``save_to_disk`` folders -> smstore, batch by batch (pyarrow)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet as pq

from smstore._objects import OBJECT_ENCODINGS, encode_objects
from smstore._pack import PackStats
from smstore.convert._common import Spans, _Progress, write_records
from smstore.errors import PackInputError

__all__ = ["arrow_sources", "convert_arrow", "iter_batches"]

BATCH_ROWS = 4096


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


def iter_batches(path: str, columns: list[str] | None = None) -> Iterator[pa.RecordBatch]:
    """Record batches of one Parquet or Arrow IPC (file or stream) file, never the whole table.

    Raises:
        PackInputError: The file is not readable as Parquet or Arrow, naming it and the batch.
    """
    with open(path, "rb") as f:
        magic = f.read(4)
    k = 0
    try:
        if magic == b"PAR1":
            pf = pq.ParquetFile(path, pre_buffer=False)  # pre-buffering holds whole column chunks
            for k, batch in enumerate(pf.iter_batches(batch_size=BATCH_ROWS, columns=columns)):  # noqa: B007 - k names the batch in errors
                yield batch
            return
        try:
            reader: Any = pa.ipc.open_file(path)
            for k in range(reader.num_record_batches):
                batch = reader.get_batch(k)
                yield batch.select(columns) if columns else batch
            return
        except pa.ArrowInvalid:
            pass  # not the file format: an IPC stream (what save_to_disk writes)
        with pa.ipc.open_stream(path) as stream:
            for k, batch in enumerate(stream):  # noqa: B007 - k names the batch in errors
                yield batch.select(columns) if columns else batch
    except (pa.ArrowException, OSError) as e:
        raise PackInputError(f"{path}: unreadable at record batch {k}: {e}") from None


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
            UTF-8 text (encoding ``lines``; decode ``"utf8"``). Without it, each row is one object
            record (a dict), pickled (``encoding="json"`` for JSON).
        encoding: Override the encoding chosen above.
        shard_size: Bytes of records per shard: write a sharded dataset.

    Raises:
        PackInputError: A missing column, a null value, a corrupt file (named, with its batch).
    """
    files = arrow_sources(source)
    total = sum(os.path.getsize(f) for f in files)
    bar = _Progress(total, progress, "convert")
    schema_kind: str | None = None
    if column is not None:
        schema = _schema(files[0])
        if column not in schema.names:
            raise PackInputError(f"{files[0]}: no column {column!r} (columns: {', '.join(schema.names)})")
        t = schema.field(column).type
        if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
            schema_kind = "bytes"
        elif pa.types.is_string(t) or pa.types.is_large_string(t):
            schema_kind = "lines"
        else:
            raise PackInputError(
                f"{files[0]}: column {column!r} is {t}, not binary or string; omit --column to store rows"
            )
    enc = encoding or schema_kind or "pickle"
    if column is None and enc not in OBJECT_ENCODINGS:
        raise PackInputError(
            f"rows are stored as objects: encoding must be one of {', '.join(OBJECT_ENCODINGS)}, not {enc!r}"
        )

    def records() -> Iterator[Any]:
        done = 0
        for path in files:
            row = 0
            for batch in iter_batches(path, [column] if column else None):
                if column is not None:
                    col = batch.column(0)
                    if col.null_count:
                        bad = row + col.is_null().to_pylist().index(True)
                        raise PackInputError(f"{path}: row {bad}: column {column!r} is null")
                    yield _spans(col)
                else:
                    yield from encode_objects(batch.to_pylist(), enc)
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


def _spans(col: pa.Array) -> Spans:
    """A binary or string array's records as its data buffer and offsets: no Python object per row."""
    if pa.types.is_fixed_size_binary(col.type):
        width = col.type.byte_width
        data = col.buffers()[1]
        offsets = np.arange(col.offset, col.offset + len(col) + 1, dtype=np.int64) * width
        return Spans(data, offsets)
    large = pa.types.is_large_binary(col.type) or pa.types.is_large_string(col.type)
    offs = np.frombuffer(col.buffers()[1], dtype=np.int64 if large else np.int32)
    return Spans(col.buffers()[2] or b"", offs[col.offset : col.offset + len(col) + 1])


def _schema(path: str) -> pa.Schema:
    for batch in iter_batches(path):
        return batch.schema
    try:
        return pq.read_schema(path)
    except (pa.ArrowException, OSError) as e:
        raise PackInputError(f"{path}: cannot read its schema: {e}") from None
