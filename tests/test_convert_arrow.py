"""convert_arrow against pyarrow and datasets: every record as the library reads it, or a named PackInputError."""

from __future__ import annotations

import decimal
import json
import os
import random
import struct
import subprocess
import sys
from datetime import date, datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import smstore_testlib as tl

import smstore
from smstore import PackInputError
from smstore.convert import convert_arrow

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


# ----------------------------------------------------------------------------- helpers


def write_ipc(path: Path, table: Any, kind: str, rows: int = 128, **options: Any) -> Path:
    """`table` as an Arrow IPC file (``kind="file"``) or stream, in batches of `rows`."""
    with pa.OSFile(os.fspath(path), "wb") as sink:
        new = pa.ipc.new_file if kind == "file" else pa.ipc.new_stream
        with new(sink, table.schema, options=pa.ipc.IpcWriteOptions(**options)) as w:
            for batch in table.to_batches(max_chunksize=rows):
                w.write_batch(batch)
    return path


def write(path: Path, table: Any, kind: str) -> Path:
    """`table` written by pyarrow as Parquet (several row groups) or an IPC file or stream."""
    if kind == "parquet":
        pq.write_table(table, path, row_group_size=150)
        return path
    return write_ipc(path, table, kind.removeprefix("ipc-"))


def library_rows(path: Path) -> list[dict[str, Any]]:
    """What pyarrow itself reads from one file: Parquet, IPC file or IPC stream."""
    magic = path.read_bytes()[:6]
    if magic[:4] == b"PAR1":
        return list(pq.read_table(path).to_pylist())
    with pa.memory_map(os.fspath(path)) as mm:
        reader = pa.ipc.open_file(mm) if magic == b"ARROW1" else pa.ipc.open_stream(mm)
        return list(reader.read_all().to_pylist())


def blob_records(path: Path) -> list[Any]:
    """Every record of a blob or sharded dataset: bytes, or objects for an object encoding."""
    with smstore.open(path) as s:
        records = (s[i] for i in range(len(s)))
        return [bytes(r) if isinstance(r, memoryview) else r for r in records]


def as_bytes(values: list[Any]) -> list[bytes]:
    return [v.encode() if isinstance(v, str) else bytes(v) for v in values]


def fidelity_table(n: int = 700) -> Any:
    """Columns of every kind a converter must carry: awkward bytes and text, nulls, nesting, dictionaries."""
    rng = random.Random(3)
    blob = [bytes(rng.randrange(256) for _ in range(i % 37)) for i in range(n)]
    blob[1], blob[2] = b"", b"\x00\x00\n\x00"
    text = [f"{i}:" + "é€😀\n\x00"[i % 5] * (i % 11) for i in range(n)]
    text[3] = ""
    stamp = datetime(2024, 2, 29, 23, 59, 59, 999999, tzinfo=timezone.utc)
    return pa.table(
        {
            "blob": pa.array(blob, pa.binary()),
            "text": pa.array(text, pa.string()),
            "big": pa.array(text[::-1], pa.large_string()),
            "cat": pa.array([f"class {i % 7}" for i in range(n)]).dictionary_encode(),
            "maybe": pa.array([None if i % 4 == 0 else f"m{i}" for i in range(n)]),
            "num": pa.array([None if i % 5 == 0 else i * 7 - 900 for i in range(n)], pa.int64()),
            "tags": pa.array([None if i % 9 == 0 else [f"t{j}" for j in range(i % 4)] for i in range(n)]),
            "point": pa.array(
                [None if i % 6 == 0 else {"x": i / 3, "label": None if i % 2 else "p"} for i in range(n)]
            ),
            "attrs": pa.array(
                [[("k", i), ("z", None)][: i % 3] for i in range(n)], pa.map_(pa.string(), pa.int32())
            ),
            "deep": pa.array(
                [[{"a": i, "b": [b"\x00", b""][: i % 3]}] * (i % 2) for i in range(n)],
                pa.list_(pa.struct([("a", pa.int32()), ("b", pa.list_(pa.binary()))])),
            ),
            "when": pa.array([None if i % 8 == 0 else stamp for i in range(n)], pa.timestamp("us", tz="UTC")),
            "price": pa.array(
                [decimal.Decimal(f"{i}.{i % 1000:03d}") for i in range(n)], pa.decimal128(12, 3)
            ),
            "day": pa.array([date(1970 + i % 500, 1 + i % 12, 1 + i % 28) for i in range(n)], pa.date32()),
        }
    )


# ----------------------------------------------------------------------------- fidelity


@pytest.mark.parametrize("kind", ["parquet", "ipc-file", "ipc-stream"])
def test_every_record_is_what_pyarrow_reads(tmp_path: Path, kind: str) -> None:
    table = fidelity_table()
    src = write(tmp_path / "t.data", table, kind)
    want = library_rows(src)
    assert want == table.to_pylist()  # the library's own round trip, the oracle below
    for column in ("blob", "text", "big", "cat"):
        out = tmp_path / f"{column}.smst"
        stats = convert_arrow(src, out, column=column, durable=False, progress=False)
        assert stats.records == table.num_rows
        assert blob_records(out) == as_bytes([r[column] for r in want]), column
    with smstore.open(tmp_path / "text.smst") as s:
        assert s.encoding == "lines"
    with smstore.open(tmp_path / "cat.smst") as s:
        assert s.encoding == "lines"  # a dictionary of strings is text
    convert_arrow(src, tmp_path / "rows.smst", durable=False, progress=False)
    assert blob_records(tmp_path / "rows.smst") == want  # nulls as None, timestamps, decimals, maps
    with pytest.raises(PackInputError, match=r"t\.data: row 0: column 'maybe' is null"):
        convert_arrow(src, tmp_path / "maybe.smst", column="maybe", progress=False)  # a record is never null


def test_parquet_folder_in_many_shards(tmp_path: Path) -> None:
    table = fidelity_table(9000)
    folder = tmp_path / "parts"
    folder.mkdir()
    # Files of more than a batch, of a single row, of none.
    for k, (start, end) in enumerate([(0, 5000), (5000, 5001), (5001, 9000), (9000, 9000)]):
        pq.write_table(table.slice(start, end - start), folder / f"part-{k}.parquet", row_group_size=97)
    want: list[dict[str, Any]] = []
    for f in sorted(folder.iterdir()):
        want += library_rows(f)
    assert len(want) == 9000
    convert_arrow(folder, tmp_path / "text", column="text", shard_size=3000, durable=False, progress=False)
    with smstore.open(tmp_path / "text") as s:
        assert s.shard_count >= 3
    assert blob_records(tmp_path / "text") == as_bytes([r["text"] for r in want])
    convert_arrow(folder, tmp_path / "rows", shard_size=20_000, durable=False, progress=False)
    with smstore.open(tmp_path / "rows") as s:
        assert s.shard_count >= 3
        assert [s[i] for i in range(len(s))] == want


def test_hugging_face_folder_is_what_datasets_reads(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    n = 1200
    rows = {
        "text": [f"doc {i} " + "\x00é\n"[i % 3] * (i % 40) for i in range(n)],
        "label": [None if i % 10 == 0 else i % 7 for i in range(n)],
        "tokens": [list(range(i % 13)) for i in range(n)],
        "meta": [{"source": f"s{i % 3}", "score": i / 7} for i in range(n)],
        "image": [bytes([i % 256]) * (i % 50) for i in range(n)],
    }
    folder = tmp_path / "hf"
    datasets.Dataset.from_dict(rows).save_to_disk(os.fspath(folder), max_shard_size="30KB")
    assert len(list(folder.glob("*.arrow"))) > 2
    ds = datasets.load_from_disk(os.fspath(folder))
    convert_arrow(folder, tmp_path / "rows.smst", durable=False, progress=False)
    assert blob_records(tmp_path / "rows.smst") == list(ds)
    convert_arrow(folder, tmp_path / "image.smst", column="image", shard_size=5000, progress=False)
    assert blob_records(tmp_path / "image.smst") == ds["image"]


def test_rows_become_objects_a_bounded_slice_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from smstore.convert import arrow

    big = [b"x" * (i * 97 % 5000) for i in range(3000)]
    t = pa.table({"blob": big, "n": range(3000), "tags": [["t"] * (i % 50) for i in range(3000)]})
    src = write_ipc(tmp_path / "one-batch.arrow", t, "stream", rows=3000)
    sizes: list[int] = []
    row_objects = arrow._row_objects

    def spy(piece: Any, where: str, row: int) -> Any:
        sizes.append(piece.num_rows)
        return row_objects(piece, where, row)

    monkeypatch.setattr(arrow, "_row_objects", spy)
    monkeypatch.setattr(arrow, "SLICE_BYTES", 200_000)
    convert_arrow(src, tmp_path / "rows.smst", progress=False)
    assert blob_records(tmp_path / "rows.smst") == t.to_pylist()
    assert sum(sizes) == 3000
    assert 1 < max(sizes) < 200  # about 200 kB of objects a slice: 2.5 kB of bytes and 25 tags a row


# ----------------------------------------------------------------------------- dictionaries, views


def test_dictionary_columns_are_their_values(tmp_path: Path) -> None:
    pd = pytest.importorskip("pandas")
    words = [["alpha", "", "gamma\x00", "δέλτα"][i % 4] for i in range(5000)]
    src = tmp_path / "cat.parquet"
    pd.DataFrame({"word": pd.Categorical(words), "n": range(5000)}).to_parquet(src, row_group_size=1000)
    assert pa.types.is_dictionary(pq.read_schema(src).field("word").type)  # what pandas wrote
    convert_arrow(src, tmp_path / "w.smst", column="word", progress=False)
    assert blob_records(tmp_path / "w.smst") == as_bytes(words)
    convert_arrow(src, tmp_path / "rows.smst", progress=False)
    assert blob_records(tmp_path / "rows.smst") == library_rows(src)
    # Binary values, and an IPC stream whose dictionary grows batch by batch (deltas).
    values = [bytes([i % 5]) * (i % 3) for i in range(600)]
    t = pa.table({"b": pa.array(values, pa.binary()).dictionary_encode()})
    s = write_ipc(tmp_path / "d.arrow", t, "stream", rows=100, emit_dictionary_deltas=True)
    convert_arrow(s, tmp_path / "b.smst", column="b", progress=False)
    assert blob_records(tmp_path / "b.smst") == values
    # A dictionary holding a null: the row that refers to it is a null value.
    dictionary = pa.DictionaryArray.from_arrays(
        pa.array([0, 1, 0, 2], pa.int32()), pa.array(["a", None, "c"])
    )
    write_ipc(tmp_path / "n.arrow", pa.table({"c": dictionary}), "file")
    with pytest.raises(PackInputError, match=r"n\.arrow: row 1: column 'c' is null"):
        convert_arrow(tmp_path / "n.arrow", tmp_path / "n.smst", column="c", progress=False)


@pytest.mark.parametrize(
    ("arrow_type", "encoding"),
    [
        (pa.large_binary(), "bytes"),
        (pa.large_string(), "lines"),
        (pa.binary_view(), "bytes"),
        (pa.string_view(), "lines"),
        (pa.binary(3), "bytes"),
        (pa.uuid(), "bytes"),  # an extension type: records are its storage, rows hold uuid.UUID
    ],
)
def test_large_and_view_columns(tmp_path: Path, arrow_type: Any, encoding: str) -> None:
    n = 500
    storage = getattr(arrow_type, "storage_type", arrow_type)
    if pa.types.is_fixed_size_binary(storage):
        values: list[Any] = [bytes([i % 256, 0, 255] * 6)[: storage.byte_width] for i in range(n)]
    else:
        # Longer than 12 bytes: a view then points into a data buffer instead of holding it inline.
        values = [f"value {i} " * (i % 4) + "\x00" for i in range(n)]
        values = values if encoding == "lines" else as_bytes(values)
    t = pa.table({"v": pa.array(values, arrow_type), "i": range(n)})
    for kind in ("file", "stream"):
        src = write_ipc(tmp_path / f"v.{kind}", t, kind, rows=77)
        convert_arrow(src, tmp_path / "v.smst", column="v", progress=False)
        with smstore.open(tmp_path / "v.smst") as s:
            assert s.encoding == encoding
        assert blob_records(tmp_path / "v.smst") == as_bytes(values)
        convert_arrow(src, tmp_path / "rows.smst", progress=False)
        assert blob_records(tmp_path / "rows.smst") == library_rows(src)


# ----------------------------------------------------------------------------- schemas across files


def test_files_that_disagree_on_a_column_type_are_named_before_writing(tmp_path: Path) -> None:
    folder = tmp_path / "mixed"
    folder.mkdir()
    pq.write_table(pa.table({"x": ["a", "b"], "y": [1, 2]}), folder / "a.parquet")
    pq.write_table(pa.table({"x": ["c"], "y": [3]}), folder / "b.parquet")
    pq.write_table(pa.table({"x": pa.array([4, 5], pa.int64()), "y": [6, 7]}), folder / "c.parquet")
    out = tmp_path / "out.smst"
    out.write_bytes(b"previous")
    with pytest.raises(
        PackInputError, match=r"c\.parquet: column 'x' is int64, but in .*a\.parquet it is string"
    ):
        convert_arrow(folder, out, column="x", progress=False)
    with pytest.raises(
        PackInputError, match=r"c\.parquet: column 'x' is int64, but in .*a\.parquet it is string"
    ):
        convert_arrow(folder, out, progress=False)
    assert out.read_bytes() == b"previous"
    # A file without the column, or without one of the rows' columns.
    (folder / "c.parquet").unlink()
    pq.write_table(pa.table({"y": [8]}), folder / "c.parquet")
    with pytest.raises(PackInputError, match=r"c\.parquet: no column 'x' \(columns: y\)"):
        convert_arrow(folder, out, column="x", progress=False)
    with pytest.raises(PackInputError, match=r"c\.parquet: columns \['y'\] differ from \['x', 'y'\]"):
        convert_arrow(folder, out, progress=False)
    assert out.read_bytes() == b"previous"


def test_files_whose_types_give_the_same_values_agree(tmp_path: Path) -> None:
    folder = tmp_path / "ok"
    folder.mkdir()
    pq.write_table(
        pa.table({"x": pa.array(["a"], pa.string()), "n": pa.array([1], pa.int32())}), folder / "a.parquet"
    )
    pq.write_table(
        pa.table({"n": pa.array([None], pa.null()), "x": pa.array(["b"], pa.large_string())}),
        folder / "b.parquet",
    )
    pq.write_table(
        pa.table({"x": pa.array(["c"]).dictionary_encode(), "n": pa.array([2], pa.int64())}),
        folder / "c.parquet",
    )
    convert_arrow(folder, tmp_path / "x.smst", column="x", progress=False)
    assert blob_records(tmp_path / "x.smst") == [b"a", b"b", b"c"]
    convert_arrow(folder, tmp_path / "rows.smst", progress=False)
    assert blob_records(tmp_path / "rows.smst") == [
        {"x": "a", "n": 1},
        {"x": "b", "n": None},
        {"x": "c", "n": 2},
    ]


# ----------------------------------------------------------------------------- corrupt values


def invalid_utf8_strings() -> Any:
    """Three strings, the second not UTF-8: pyarrow holds such bytes unchecked (Parquet writes them)."""
    offsets = pa.array([0, 2, 5, 7], pa.int32()).buffers()[1]
    return pa.Array.from_buffers(pa.string(), 3, [None, offsets, pa.py_buffer(b"ok\xff\xfeaok")])


def test_invalid_utf8_is_named_with_its_row_and_column(tmp_path: Path) -> None:
    src = tmp_path / "u.parquet"
    strings = pa.concat_arrays([pa.array([f"fine {i}" for i in range(5000)]), invalid_utf8_strings()])
    pq.write_table(pa.table({"n": range(5003), "s": strings}), src)
    with pytest.raises(UnicodeDecodeError):
        pq.read_table(src).column("s").to_pylist()  # what the library itself gives
    out = tmp_path / "out.smst"
    out.write_bytes(b"previous")
    match = r"u\.parquet: record batch 1, row 5001, column 's': .*UTF8"
    with pytest.raises(PackInputError, match=match):
        convert_arrow(src, out, progress=False)
    with pytest.raises(PackInputError, match=match):
        convert_arrow(src, out, column="s", progress=False)
    assert out.read_bytes() == b"previous"


def test_page_checksums_are_verified(tmp_path: Path) -> None:
    needle = "needle-7f3a9c"
    values = [f"value {i}" for i in range(2000)]
    values[1234] = needle
    src = tmp_path / "crc.parquet"
    pq.write_table(
        pa.table({"s": values}),
        src,
        write_page_checksum=True,
        compression="none",
        use_dictionary=False,
        write_statistics=False,  # else the needle is also the column's minimum
    )
    convert_arrow(src, tmp_path / "good.smst", column="s", progress=False)
    assert blob_records(tmp_path / "good.smst") == as_bytes(values)
    blob = bytearray(src.read_bytes())
    at = blob.find(needle.encode())
    assert at > 0
    assert blob.find(needle.encode(), at + 1) < 0  # one copy: inside a data page
    blob[at + 3] ^= 0x01  # still valid UTF-8 ("needle" -> "neeele"): only the checksum can tell
    src.write_bytes(blob)
    with pytest.raises(OSError, match=r"CRC|checksum"):
        pq.ParquetFile(src, page_checksum_verification=True).read()  # pyarrow refuses it too
    out = tmp_path / "out.smst"
    out.write_bytes(b"previous")
    for column in ("s", None):
        with pytest.raises(
            PackInputError, match=r"crc\.parquet: unreadable at record batch 0: .*(CRC|checksum)"
        ):
            convert_arrow(src, out, column=column, progress=False)
        assert out.read_bytes() == b"previous"


def test_timestamp_beyond_python_is_named(tmp_path: Path) -> None:
    t = pa.table({"ok": [1, 2, 3], "t": pa.array([0, 2**62, 0], pa.timestamp("s"))})
    src = write_ipc(tmp_path / "t.arrow", t, "stream")  # Parquet cannot hold it
    with pytest.raises(PackInputError, match=r"t\.arrow: record batch 0, row 1, column 't': no Python value"):
        convert_arrow(src, tmp_path / "o.smst", progress=False)


def test_json_rows_that_json_cannot_hold_name_the_row(tmp_path: Path) -> None:
    src = tmp_path / "t.parquet"
    pq.write_table(
        pa.table({"d": pa.array([None] * 5000 + [decimal.Decimal("1.5")], pa.decimal128(4, 1))}), src
    )
    with pytest.raises(
        PackInputError, match=r"t\.parquet: record batch 1, row 5000: cannot be encoded as json"
    ):
        convert_arrow(src, tmp_path / "o.smst", encoding="json", progress=False)


# ----------------------------------------------------------------------------- corrupt IPC, in a child

# Runs conversions in a child process (a segfault shows as a negative return code) whose address
# space is capped: each case ends as records equal to what pyarrow reads after full validation,
# or a PackInputError; one JSON line per case on stdout, a "start" line before each.
CHILD = r"""
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
import pyarrow as pa
import smstore
from smstore import PackInputError
from smstore.convert import convert_arrow

def reference(path, column):
    with pa.memory_map(path) as mm:
        is_file = mm.read(6) == b"ARROW1"
        mm.seek(0)
        schema = pa.ipc.open_file(mm).schema if is_file else pa.ipc.open_stream(mm).schema
        mm.seek(0)
        options = pa.ipc.IpcReadOptions(included_fields=[schema.get_field_index(column)] if column else None)
        if is_file:
            r = pa.ipc.open_file(mm, options=options)
            batches = [r.get_batch(i) for i in range(r.num_record_batches)]
        else:
            batches = list(pa.ipc.open_stream(mm, options=options))
        out = []
        for b in batches:
            b.validate(full=True)
            out += b.column(0).to_pylist() if column else b.to_pylist()
        return out

for i, (path, column) in enumerate(json.loads(sys.argv[1])):
    print(json.dumps({"start": i}), flush=True)
    out = path + ".smst"
    result = {"case": i}
    try:
        convert_arrow(path, out, column=column, durable=False, progress=False)
    except PackInputError as e:
        result["refused"] = str(e)
    except BaseException as e:
        result["raw"] = f"{type(e).__name__}: {e}"
    else:
        with smstore.open(out) as s:
            got = list(s) if column is None else [bytes(r) for r in s]
        try:
            want = reference(path, column)
        except Exception as e:
            result["pyarrow refuses"] = f"{type(e).__name__}: {e}"
        else:
            if column is not None:
                want = [v.encode() if isinstance(v, str) else v for v in want]
            result["equal"] = got == want
    print(json.dumps(result), flush=True)
"""


def run_cases(cases: list[tuple[str, str | None]]) -> list[dict[str, Any]]:
    """Run each (path, column) conversion in one capped child; its per-case results."""
    r = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(cases)],
        capture_output=True,
        text=True,
        check=False,
        cwd=tl.SAFE_CWD,
        timeout=300,
    )
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    results = [x for x in lines if "case" in x]
    if r.returncode != 0:
        started = [x["start"] for x in lines if "start" in x]
        last = cases[started[-1]] if started else None
        pytest.fail(f"child exited {r.returncode} during case {last}: {r.stderr[-3000:]}")
    assert len(results) == len(cases)
    return results


def assert_named_or_equal(results: list[dict[str, Any]], cases: list[tuple[str, str | None]]) -> None:
    for res, (path, column) in zip(results, cases, strict=True):
        assert "raw" not in res, (path, column, res["raw"])
        if "refused" in res:
            assert res["refused"].startswith(path), res["refused"]
            assert "malloc" not in res["refused"], res["refused"]  # memory would have grown unchecked
        else:
            assert "pyarrow refuses" not in res, (path, column, res["pyarrow refuses"])
            assert res["equal"], (path, column)


def ipc_source(n: int = 200) -> Any:
    return pa.table(
        {
            "s": pa.array([f"r{i}" * (i % 5) for i in range(n)]),
            "b": pa.array([bytes([i % 256]) * (i % 7) for i in range(n)], pa.binary()),
            "l": pa.array([[i] * (i % 4) for i in range(n)], pa.list_(pa.int32())),
            "st": pa.array([{"x": i, "y": str(i)} for i in range(n)]),
            "d": pa.array([f"c{i % 3}" for i in range(n)]).dictionary_encode(),
            "n": pa.array([None if i % 3 == 0 else i for i in range(n)], pa.int64()),
            "z": pa.nulls(n),
        }
    )


def corruptions(data: bytes, rng: random.Random, count: int) -> list[bytes]:
    """`count` damaged copies of an IPC file: truncations, flipped bits, huge lengths."""
    out = []
    fifty = struct.pack("<q", 50)  # the batch length and every field node's length
    at_fifty = [i for i in range(len(data)) if data.startswith(fifty, i)]
    for k in range(count):
        d = bytearray(data)
        how = k % 5
        if how == 0:
            d = d[: rng.randrange(len(d))]
        elif how == 1:
            for _ in range(rng.randint(1, 3)):
                d[rng.randrange(len(d))] ^= 1 << rng.randrange(8)
        elif how == 2:  # in the metadata: the first message, or a file's footer
            region = rng.choice([range(min(len(d), 600)), range(max(0, len(d) - 600), len(d))])
            d[rng.choice(region)] ^= 1 << rng.randrange(8)
        elif how == 3:
            i = rng.randrange(len(d) - 8) & ~3
            d[i : i + 4] = rng.choice([b"\xff\xff\xff\x7f", b"\x00\x00\x00\x80", b"\xff\xff\xff\xff"])
        else:  # a batch or node claims far more rows than it has
            i = rng.choice(at_fifty)
            d[i : i + 8] = struct.pack("<q", rng.choice([51, 2**31 - 1, 2**40, -1]))
        out.append(bytes(d))
    return out


def test_corrupt_ipc_is_refused_or_read_exactly(tmp_path: Path) -> None:
    rng = random.Random(21)
    cases: list[tuple[str, str | None]] = []
    for kind in ("file", "stream"):
        data = write_ipc(tmp_path / f"src.{kind}", ipc_source(), kind, rows=50).read_bytes()
        for k, bad in enumerate(corruptions(data, rng, 60)):
            p = tmp_path / f"bad-{kind}-{k}.arrow"
            p.write_bytes(bad)
            cases += [(os.fspath(p), None), (os.fspath(p), "s")]
    results = run_cases(cases)
    assert_named_or_equal(results, cases)
    refused = sum("refused" in r for r in results)
    assert 0 < refused < len(results)  # both ends of the property were exercised


def test_corrupt_offsets_are_named_in_the_input(tmp_path: Path) -> None:
    t = pa.table({"s": pa.array(["aa", "bbbb", "cc", "d"]), "i": pa.array([1, 2, 3, 4], pa.int64())})
    good = write_ipc(tmp_path / "good.arrow", t, "stream").read_bytes()
    offsets = struct.pack("<5i", 0, 2, 6, 8, 9)
    at = good.find(offsets)
    assert at > 0
    assert good.find(offsets, at + 1) < 0
    cases: list[tuple[str, str | None]] = []
    for name, patched in [
        ("beyond", struct.pack("<5i", 0, 2, 600, 8, 9)),
        ("backwards", struct.pack("<5i", 0, 6, 2, 8, 9)),
        ("negative", struct.pack("<5i", -4, 2, 6, 8, 9)),
        ("huge", struct.pack("<5i", 0, 2, 6, 8, 2**31 - 1)),
    ]:
        p = tmp_path / f"{name}.arrow"
        p.write_bytes(good[:at] + patched + good[at + len(offsets) :])
        cases += [(os.fspath(p), "s"), (os.fspath(p), None)]
    results = run_cases(cases)
    for res, (path, _) in zip(results, cases, strict=True):
        assert "refused" in res, res
        assert res["refused"].startswith(f"{path}: record batch 0"), res["refused"]


def test_lengths_no_data_backs_are_refused(tmp_path: Path) -> None:
    cases: list[tuple[str, str | None]] = []
    # A batch of 2**40 null rows, and a row holding a list of 2**31 - 1 nulls: valid Arrow, but
    # no file of this size holds them honestly, and their Python values would not fit in memory.
    rows = write_ipc(tmp_path / "rows.arrow", pa.table({"z": pa.nulls(50)}), "file").read_bytes()
    (tmp_path / "rows-huge.arrow").write_bytes(rows.replace(struct.pack("<q", 50), struct.pack("<q", 2**40)))
    lists = pa.table({"l": pa.array([[None] * 3] * 4, pa.list_(pa.null())), "s": ["a", "b", "c", "d"]})
    data = write_ipc(tmp_path / "lists.arrow", lists, "stream").read_bytes()
    last = struct.pack("<5i", 0, 3, 6, 9, 12)
    assert data.count(last) == 1
    data = data.replace(last, struct.pack("<5i", 0, 3, 6, 9, 2**31 - 1))
    (tmp_path / "lists-huge.arrow").write_bytes(
        data.replace(struct.pack("<q", 12), struct.pack("<q", 2**31 - 1))
    )
    for name in ("rows-huge", "lists-huge"):
        cases += [(os.fspath(tmp_path / f"{name}.arrow"), None)]
    cases += [(os.fspath(tmp_path / "lists-huge.arrow"), "s")]  # the column is fine: read exactly
    results = run_cases(cases)
    rows_msg, lists_msg = (r.get("refused", "") for r in results[:2])
    assert rows_msg.endswith("record batch 0: declares 1099511627776 rows, more than the file can hold"), (
        results
    )
    assert "record batch 0, column 'l': declares 2147483647 values" in lists_msg, results
    assert results[2] == {"case": 2, "equal": True}


def test_message_lengths_beyond_the_file_are_refused_before_reading(tmp_path: Path) -> None:
    t = pa.table({"s": pa.array(["x" * 1000, "y" * 333])})
    cases: list[tuple[str, str | None]] = []
    for kind in ("stream", "file"):
        data = write_ipc(tmp_path / f"{kind}.arrow", t, kind).read_bytes()
        messages = pa.ipc.MessageReader.open_stream(pa.BufferReader(data if kind == "stream" else data[8:]))
        messages.read_next_message()  # the schema
        body = struct.pack("<q", messages.read_next_message().body.size)
        assert data.count(body) == (1 if kind == "stream" else 2)  # a file's footer repeats it
        (tmp_path / f"{kind}-body.arrow").write_bytes(data.replace(body, struct.pack("<q", 2**40)))
        cases += [(os.fspath(tmp_path / f"{kind}-body.arrow"), column) for column in ("s", None)]
    stream = (tmp_path / "stream.arrow").read_bytes()
    second = stream.find(b"\xff\xff\xff\xff", 4)  # the record batch's continuation marker
    huge_metadata = stream[: second + 4] + struct.pack("<i", 2**31 - 1) + stream[second + 8 :]
    (tmp_path / "stream-metadata.arrow").write_bytes(huge_metadata)
    cases += [(os.fspath(tmp_path / "stream-metadata.arrow"), "s")]
    results = run_cases(cases)
    for res, (path, _) in zip(results, cases, strict=True):
        want = (
            "declares 2147483647 bytes of metadata"
            if "metadata" in path
            else "declares a body of 1099511627776"
        )
        assert res.get("refused", "").startswith(
            f"{path}: unreadable at record batch 0: its message at byte"
        ), res
        assert want in res["refused"], res


def footer_blocks(data: bytes | bytearray) -> tuple[int, list[int]]:
    """An IPC file footer's record-batch count's position and its dictionary blocks' offsets
    (Footer.dictionaries is field 2, .recordBatches field 3)."""
    footer = len(data) - 10 - struct.unpack_from("<i", data, len(data) - 10)[0]

    def field(table: int, index: int) -> int:
        vtable = table - struct.unpack_from("<i", data, table)[0]
        return table + struct.unpack_from("<H", data, vtable + 4 + 2 * index)[0]

    root = footer + struct.unpack_from("<I", data, footer)[0]
    batches_at, dicts_at = field(root, 3), field(root, 2)
    batches_vec = batches_at + struct.unpack_from("<I", data, batches_at)[0]
    dicts_vec = dicts_at + struct.unpack_from("<I", data, dicts_at)[0]
    n = struct.unpack_from("<I", data, dicts_vec)[0]
    dicts = [struct.unpack_from("<q", data, dicts_vec + 4 + 24 * i)[0] for i in range(n)]
    return batches_vec, dicts


def test_a_dictionary_block_is_read_as_pyarrow_reads_it_with_the_first_record_batch(tmp_path: Path) -> None:
    """pyarrow reads an IPC file's dictionaries with its first record batch: a file listing none
    reads as no records whatever its dictionary blocks hold (fuzz_arrow found us refusing one);
    a file with a record batch and a broken dictionary block is refused, naming that block."""
    t = pa.table({"d": pa.array(["a", "b", "a"]).dictionary_encode(), "s": ["x", "y", "z"]})
    data = bytearray(write_ipc(tmp_path / "src.arrow", t, "file").read_bytes())
    batches_vec, dicts = footer_blocks(data)
    assert len(dicts) == 1
    assert struct.unpack_from("<I", data, batches_vec)[0] == 1
    struct.pack_into("<i", data, dicts[0] + 4, 14 << 20)  # its metadata runs past the file's end
    (tmp_path / "one-batch.arrow").write_bytes(data)
    struct.pack_into("<I", data, batches_vec, 0)  # the footer lists no record batch
    (tmp_path / "no-batch.arrow").write_bytes(data)
    cases: list[tuple[str, str | None]] = [
        (os.fspath(tmp_path / name), column)
        for name in ("no-batch.arrow", "one-batch.arrow")
        for column in (None, "s")
    ]
    results = run_cases(cases)
    assert results[:2] == [{"case": 0, "equal": True}, {"case": 1, "equal": True}], results
    assert pa.ipc.open_file(cases[0][0]).read_all().num_rows == 0
    for res, (path, _) in zip(results[2:], cases[2:], strict=True):
        assert res.get("refused", "").startswith(
            f"{path}: unreadable at dictionary batch 0: its message at byte {dicts[0]} declares 14680064 bytes"
        ), res
    with pytest.raises(pa.ArrowInvalid):  # as pyarrow, whichever column is read
        pa.ipc.open_file(cases[3][0], options=pa.ipc.IpcReadOptions(included_fields=[1])).get_batch(0)


@pytest.mark.parametrize("kind", ["parquet", "ipc-file"])
def test_rows_with_a_column_name_twice_are_what_pyarrow_reads(tmp_path: Path, kind: str) -> None:
    """A name given to two columns of different types: the rows are to_pylist's (the last wins),
    not a refusal comparing the file with itself (fuzz_arrow found it)."""
    table = pa.Table.from_arrays([pa.array([1, 2], pa.int32()), pa.array(["a", "b"])], names=["date", "date"])
    src = tmp_path / ("t.parquet" if kind == "parquet" else "t.arrow")
    if kind == "parquet":
        pq.write_table(table, src)
    else:
        with pa.ipc.new_file(src, table.schema) as w:
            w.write_table(table)
    out = tmp_path / "out.smst"
    convert_arrow(src, out, progress=False, durable=False)
    with smstore.open(out) as s:
        assert list(s) == table.to_pylist()
