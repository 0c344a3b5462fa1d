"""Fuzz target: a Parquet file or an Arrow IPC file or stream for convert_arrow, differential against pyarrow."""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import atheris
import numpy  # noqa: F401 - imported before the instrumentation, which covers smstore alone
import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet as pq
from _common import Finding, check_refusal, difference, feature, main, same, scratch_dir

with atheris.instrument_imports(include=["smstore"]):
    import smstore
    from smstore.convert.arrow import convert_arrow

# One thread each: the same input takes the same path every time, and two targets share CI's cores.
pa.set_cpu_count(1)
pa.set_io_thread_count(1)

# Byte 0: bits 0-1 pick the container, whose leading magic the target puts before the rest of the
# input (the rest is an IPC file without its first 8 bytes, a stream, a Parquet file without its
# first 4, or with RAW the whole file); bit 2 converts one column (else whole rows); bits 3-7 pick
# that column by its index in the schema, modulo the number of fields.
IPC_FILE, IPC_STREAM, PARQUET, RAW = range(4)
MAGIC = {IPC_FILE: b"ARROW1\0\0", IPC_STREAM: b"", PARQUET: b"PAR1", RAW: b""}
COLUMN_FLAG = 4
# convert_arrow's --column types (docs/convert.md): their values are the records, as bytes.
BINARY: list[Callable[[pa.DataType], bool]] = [
    pa.types.is_binary,
    pa.types.is_large_binary,
    pa.types.is_fixed_size_binary,
]
STRING: list[Callable[[pa.DataType], bool]] = [pa.types.is_string, pa.types.is_large_string]
# Binary and string views hold the same values; converting them or refusing them are both allowed.
VIEWS: list[Callable[[pa.DataType], bool]] = [pa.types.is_binary_view, pa.types.is_string_view]
# Refusing a file whose arrays hold more values than this per byte of it is allowed: lengths no
# data backs (a null column of 2**40 rows in 1 KB) are a way to make a converter spin.
VALUES_PER_BYTE = 8
# Valid Arrow describes billions of values in a few bytes (a null, zero-width or field-less column,
# run-end encoding, a compressed buffer): converting them takes time in proportion to the values,
# which is no defect, so an input whose reading holds more values or bytes than this is skipped.
MAX_VALUES, MAX_BYTES = 100_000, 64 << 20
LISTS = [
    pa.types.is_list,
    pa.types.is_large_list,
    pa.types.is_fixed_size_list,
    pa.types.is_list_view,
    pa.types.is_large_list_view,
    pa.types.is_map,
    pa.types.is_run_end_encoded,
]
WORK = Path(scratch_dir("arrow"))
SOURCE, OUTPUT = WORK / "in.arrow", WORK / "out.smst"
DIGITS = re.compile(r"\d+")


def convert(source: Path, output: Path, column: str | None) -> None:
    """The one call into smstore: rows as pickled objects, or one column's values as records."""
    convert_arrow(source, output, column=column, progress=False, durable=False)


class TooLarge(Exception):
    """The input holds more than MAX_VALUES values or MAX_BYTES bytes: it is skipped."""


@dataclass
class Reading:
    """What pyarrow reads from the file, each batch validated in full, or why it refuses."""

    schema: pa.Schema | None = None
    batches: list[pa.RecordBatch] = field(default_factory=list)
    why: str = ""  # empty: accepted
    opened: bool = False  # the reader got as far as the schema
    too_large: bool = False  # more than MAX_VALUES values or MAX_BYTES bytes: not fuzzed
    values: int = 0  # at every level of nesting, as values_in counts them


def values_in(array: pa.Array) -> int:
    """The values an array holds at every level of nesting (a run-end encoded one: its logical length)."""
    total, todo = 0, [array]
    while todo and total <= MAX_VALUES:
        a = todo.pop()
        total += len(a)
        t = a.type
        if isinstance(a, pa.ExtensionArray):
            todo.append(a.storage)
        elif pa.types.is_dictionary(t):
            todo.append(a.dictionary)
        elif any(is_type(t) for is_type in LISTS):
            todo.append(a.values)
        elif pa.types.is_struct(t) or pa.types.is_union(t):
            todo.extend(a.field(i) for i in range(t.num_fields))
    return total


def opened(schema: pa.Schema) -> Reading:
    """A reading of this schema, or a refusal if pyarrow cannot name its fields (names are UTF-8 in Arrow)."""
    try:
        schema.names, [str(f.type) for f in schema]  # every field's name, nested ones too
    except UnicodeDecodeError as e:
        return Reading(why=f"a field name is not UTF-8: {e}", opened=True)
    return Reading(schema, opened=True)


def validated(reading: Reading, batches: Any) -> Reading:
    """Read `batches` into `reading`, each checked by RecordBatch.validate(full=True) before any use."""
    size = 0
    try:
        for batch in batches:
            batch.validate(full=True)
            reading.batches.append(batch)
            reading.values += batch.num_rows + sum(values_in(c) for c in batch.columns)
            size += batch.nbytes
            if reading.values > MAX_VALUES or size > MAX_BYTES:
                reading.too_large = True
                break
    except Exception as e:  # noqa: BLE001 - whatever pyarrow raises, it refuses the file
        reading.why = f"{type(e).__name__}: {e}"
    return reading


def open_ipc(opener: Callable[..., Any], path: Path, columns: list[str] | None) -> Any:
    """An IPC file or stream reader of `columns` only (all if None): pyarrow reads no other buffers."""
    if columns is None:
        return opener(path)
    with opener(path) as whole:
        fields = [whole.schema.get_field_index(c) for c in columns]
    return opener(path, options=pa.ipc.IpcReadOptions(included_fields=fields))


def read_ipc_file(path: Path, columns: list[str] | None = None) -> Reading:
    try:
        reader = open_ipc(pa.ipc.open_file, path, columns)
    except Exception as e:  # noqa: BLE001
        return Reading(why=f"{type(e).__name__}: {e}")
    with reader:
        reading = opened(reader.schema)
        if reading.why:
            return reading
        return validated(reading, (reader.get_batch(k) for k in range(reader.num_record_batches)))


def read_ipc_stream(path: Path, columns: list[str] | None = None) -> Reading:
    try:
        reader = open_ipc(pa.ipc.open_stream, path, columns)
    except Exception as e:  # noqa: BLE001
        return Reading(why=f"{type(e).__name__}: {e}")
    with reader:
        reading = opened(reader.schema)
        return reading if reading.why else validated(reading, reader)


def read_parquet(path: Path, columns: list[str] | None = None) -> Reading:
    try:
        pf = pq.ParquetFile(path, page_checksum_verification=True)
    except Exception as e:  # noqa: BLE001
        return Reading(why=f"{type(e).__name__}: {e}")
    reading = opened(pf.schema_arrow)
    md = pf.metadata
    # Rows times columns, not the column chunks' value counts: pyarrow aborts the process (a
    # ParquetException through a noexcept accessor) reading a damaged chunk's metadata with
    # md.row_group(i).column(j) (seed regress-parquet-column-chunk-metadata).
    reading.too_large = md.num_rows * max(1, md.num_columns) > MAX_VALUES
    if reading.why or reading.too_large:  # not decoded: a few bytes of levels may stand for millions
        pf.close()
        return reading
    try:
        return validated(reading, pf.iter_batches(columns=columns))
    finally:
        pf.close()


Reader = Callable[[Path, list[str] | None], Reading]


def readings(path: Path, data: bytes) -> tuple[list[tuple[Reader, Reading]], bool]:
    """The readings of the whole file the converter may give (each with its reader, to read one
    column on its own), and whether the format is beyond doubt.

    `PAR1` first is Parquet, `ARROW1` first an IPC file. Otherwise it is an IPC stream, or, when
    pyarrow's file reader opens it (that reader checks only the magic at the end), also an IPC
    file: either reading may be the converter's.
    """
    if data.startswith(b"PAR1"):
        return [(read_parquet, read_parquet(path))], True
    as_file = read_ipc_file(path)
    if data.startswith(b"ARROW1"):
        return [(read_ipc_file, as_file)], True
    found: list[tuple[Reader, Reading]] = [(read_ipc_stream, read_ipc_stream(path))]
    if as_file.opened:
        found.append((read_ipc_file, as_file))
    return found, not as_file.opened


@dataclass
class Expected:
    """The records a reading gives, or why the converter must refuse; `strict`: it must not refuse."""

    records: list[Any] | None
    why: str = ""
    strict: bool = True
    encoding: str = "pickle"


def rows(reading: Reading) -> Expected:
    """Each row as a dict, as pickled and loaded (what an object record decodes to)."""
    try:
        objects = [row for batch in reading.batches for row in batch.to_pylist()]
        return Expected([pickle.loads(pickle.dumps(row, protocol=5)) for row in objects])
    except Exception as e:  # noqa: BLE001 - a value pyarrow cannot make a Python object of
        return Expected(None, f"rows: {type(e).__name__}: {e}")


def plain(t: pa.DataType) -> pa.DataType:
    """The type a column's records hold: an extension's storage, a dictionary's values."""
    while isinstance(t, pa.ExtensionType) or pa.types.is_dictionary(t):
        t = t.storage_type if isinstance(t, pa.ExtensionType) else t.value_type
    return t


def plain_array(a: pa.Array) -> pa.Array:
    """The array's values as `plain` types them: an extension's storage, a dictionary decoded."""
    while isinstance(a, (pa.ExtensionArray, pa.DictionaryArray)):
        a = a.storage if isinstance(a, pa.ExtensionArray) else a.dictionary_decode()
    return a


def column(reading: Reading, name: str, part: Reading) -> Expected:
    """One column's values as bytes (strings UTF-8 encoded), or why they cannot be records.

    `part` is pyarrow's reading of that column alone: another column's fault need not stop the
    conversion of this one, but a refusal is allowed then too.
    """
    schema = reading.schema
    assert schema is not None
    strict = not reading.why
    if part.too_large:
        raise TooLarge
    if part.why:
        return Expected(None, f"column {name!r}: {part.why}")
    t = plain(schema.field(name).type)
    if t != schema.field(name).type:  # a dictionary or extension column: converting its values is allowed
        strict = False
    if any(is_type(t) for is_type in BINARY + STRING):
        encoding = "lines" if any(is_type(t) for is_type in STRING) else "bytes"
    elif any(is_type(t) for is_type in VIEWS):
        encoding, strict = "lines" if pa.types.is_string_view(t) else "bytes", False
    else:
        return Expected(None, f"column {name!r} is {schema.field(name).type}")
    values = [v for batch in part.batches for v in plain_array(batch.column(name)).to_pylist()]
    if None in values:
        return Expected(None, f"column {name!r}: row {values.index(None)} is null")
    records = [v.encode() if isinstance(v, str) else v for v in values]
    return Expected(records, strict=strict, encoding=encoding)


def expect(reader: Reader, reading: Reading, name: str | None, path: Path) -> Expected:
    feature(DIGITS.sub("", reading.why)[:70] if reading.why else f"{len(reading.batches) > 1} batches")
    for f in reading.schema or []:
        feature(str(f.type)[:70])
    if reading.schema is None or (name is None and reading.why):
        return Expected(None, reading.why)
    if name is None:
        return rows(reading)
    if reading.schema.names.count(name) != 1:
        return Expected(None, f"{reading.schema.names.count(name)} columns are named {name!r}")
    return column(reading, name, reader(path, [name]))


def column_name(found: list[Reading], index: int) -> str:
    """The name of field `index` (modulo their number) of the first schema read; any name if none is."""
    names = next((r.schema.names for r in found if r.schema is not None and r.schema.names), ["data"])
    return names[index % len(names)]


def test_one_input(data: bytes) -> None:
    if not data:
        return
    flags = data[0]
    file = MAGIC[flags & 3] + data[1:]
    SOURCE.write_bytes(file)
    OUTPUT.unlink(missing_ok=True)  # left by an earlier input that raised a finding, where fuzzing goes on
    found, certain = readings(SOURCE, file)
    name = column_name([r for _, r in found], flags >> 3) if flags & COLUMN_FLAG else None
    try:
        if any(r.too_large for _, r in found):
            raise TooLarge
        options = [expect(reader, r, name, SOURCE) for reader, r in found]
    except TooLarge:
        feature("too large")
        return
    valid = [e for e in options if e.records is not None]
    dense = all(r.values <= VALUES_PER_BYTE * len(file) for _, r in found)
    must_convert = certain and dense and bool(valid) and valid[0].strict
    try:
        convert(SOURCE, OUTPUT, name)
    except smstore.PackInputError as e:
        instead = f"pyarrow reads {len(valid[0].records or []) if valid else 0} records"
        check_refusal(e, SOURCE, OUTPUT, must_convert=must_convert, instead=instead)
        return
    if not valid:
        raise Finding(f"converted, but pyarrow refuses it: {options[0].why[:300]}")
    if name is None:
        with smstore.open(OUTPUT, verify=True) as store:
            records, encoding = list(store), store.encoding
    else:
        with smstore.Store(OUTPUT) as raw:
            records, encoding = [bytes(r) for r in raw], raw.encoding
    os.unlink(OUTPUT)
    if not any(encoding == e.encoding and same(records, e.records) for e in valid):
        expected = valid[0]
        raise Finding(
            f"{encoding} records differ from pyarrow's {expected.encoding} ones: "
            f"{difference(records, expected.records or [])}"
        )


if __name__ == "__main__":
    main(test_one_input)
