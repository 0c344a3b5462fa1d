"""Converters, on files written by the real libraries: byte-exact record by record, bad input named."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import smstore_testlib as tl

import smstore
from smstore import PackInputError, SharedStoreDataset
from smstore.convert import convert_arrow, convert_json_list, convert_megatron, convert_webdataset

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def awkward(n: int) -> list[bytes]:
    recs = [f"{i}:".encode() + bytes((i * 31 + j) % 256 for j in range(i % 200)) for i in range(n)]
    recs[1] = b""
    recs[2] = b"\n\r\x00\xff"
    return recs


def texts(n: int) -> list[str]:
    return [f"row {i} " + "é€😀"[i % 3] * (i % 17) + ("\n" if i % 5 == 0 else "") for i in range(n)]


# ----------------------------------------------------------------------------- Parquet / Arrow / HF


@pytest.fixture
def table() -> object:
    n = 3000
    return pa.table(
        {
            "data": pa.array(awkward(n), pa.binary()),
            "text": pa.array(texts(n), pa.string()),
            "id": pa.array(range(n), pa.int64()),
            "tags": pa.array([[f"t{i % 3}"] * (i % 3) for i in range(n)]),
        }
    )


@pytest.mark.parametrize("kind", ["parquet", "ipc-file", "ipc-stream"])
def test_arrow_column_records_are_byte_exact(tmp_path: Path, table: object, kind: str) -> None:
    src = tmp_path / ("t.parquet" if kind == "parquet" else "t.arrow")
    if kind == "parquet":
        pq.write_table(table, src, row_group_size=700)
    else:
        with pa.OSFile(os.fspath(src), "wb") as sink:
            open_writer = pa.ipc.new_file if kind == "ipc-file" else pa.ipc.new_stream
            with open_writer(sink, table.schema) as w:
                for batch in table.to_batches(max_chunksize=512):
                    w.write_batch(batch)
    out = tmp_path / "data.smst"
    stats = convert_arrow(src, out, column="data", progress=False)
    assert stats.records == table.num_rows
    assert tl.read_records(out) == table.column("data").to_pylist()
    convert_arrow(src, tmp_path / "text.smst", column="text", progress=False)
    with smstore.open(tmp_path / "text.smst") as s:
        assert s.encoding == "lines"
        assert [str(r, "utf-8") for r in s] == table.column("text").to_pylist()
    convert_arrow(src, tmp_path / "rows.smst", progress=False)
    with smstore.open(tmp_path / "rows.smst") as s:
        assert isinstance(s, smstore.ObjectStore)
        assert list(s) == table.to_pylist()


def test_hugging_face_save_to_disk_folder(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = {"text": texts(2500), "label": [i % 7 for i in range(2500)]}
    folder = tmp_path / "hf"
    datasets.Dataset.from_dict(rows).save_to_disk(os.fspath(folder), max_shard_size="40KB")
    assert len(list(folder.glob("*.arrow"))) > 1  # several files, read in their order
    convert_arrow(folder, tmp_path / "hf.smst", column="text", progress=False)
    with smstore.open(tmp_path / "hf.smst") as s:
        assert [str(r, "utf-8") for r in s] == rows["text"]
    convert_arrow(folder, tmp_path / "rows.smst", encoding="json", progress=False)
    ds = SharedStoreDataset(tmp_path / "rows.smst")
    assert ds[1234] == {"text": rows["text"][1234], "label": rows["label"][1234]}
    # And as a sharded dataset.
    convert_arrow(folder, tmp_path / "sharded", column="text", shard_size=20_000, progress=False)
    with smstore.open(tmp_path / "sharded") as s:
        assert s.shard_count > 2
        assert [str(s[i], "utf-8") for i in range(len(s))] == rows["text"]


def test_corrupt_parquet_names_the_file(tmp_path: Path, table: object) -> None:
    src = tmp_path / "t.parquet"
    pq.write_table(table, src, row_group_size=500)
    blob = bytearray(src.read_bytes())
    mid = len(blob) // 2
    blob[mid : mid + 4000] = os.urandom(4000)
    src.write_bytes(blob)
    out = tmp_path / "out.smst"
    out.write_bytes(b"previous")
    with pytest.raises(PackInputError, match=r"t\.parquet"):
        convert_arrow(src, out, column="data", progress=False)
    assert out.read_bytes() == b"previous"  # the interrupted conversion left it untouched
    src.write_bytes(b"PAR1 not really")
    with pytest.raises(PackInputError, match=r"t\.parquet: unreadable at record batch 0"):
        convert_arrow(src, out, column="data", progress=False)


def test_arrow_bad_column(tmp_path: Path, table: object) -> None:
    src = tmp_path / "t.parquet"
    pq.write_table(table, src)
    with pytest.raises(PackInputError, match="no column 'nope'"):
        convert_arrow(src, tmp_path / "o.smst", column="nope", progress=False)
    with pytest.raises(PackInputError, match="column 'id' is int64, not binary or string"):
        convert_arrow(src, tmp_path / "o.smst", column="id", progress=False)
    nulls = tmp_path / "n.parquet"
    pq.write_table(pa.table({"data": pa.array([b"a", None, b"c"], pa.binary())}), nulls)
    with pytest.raises(PackInputError, match=r"n\.parquet: row 1: column 'data' is null"):
        convert_arrow(nulls, tmp_path / "o.smst", column="data", progress=False)


def test_cli_parquet(tmp_path: Path, table: object) -> None:
    src = tmp_path / "t.parquet"
    pq.write_table(table, src)
    r = subprocess.run(
        [
            *(sys.executable, "-m", "smstore", "pack", "--format", "parquet", "--column", "data"),
            *(os.fspath(src), "-o", os.fspath(tmp_path / "c.smst"), "-q"),
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=tl.SAFE_CWD,
    )
    assert r.returncode == 0, r.stderr
    assert tl.read_records(tmp_path / "c.smst") == table.column("data").to_pylist()
    code = "import sys, smstore.cli, smstore.convert; print(sorted(m for m in ('pyarrow', 'torch') if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tl.SAFE_CWD
    )
    assert out.stdout.strip() == "[]"  # converters load their libraries only when used


# ----------------------------------------------------------------------------- WebDataset


def test_webdataset_samples_keep_their_members(tmp_path: Path) -> None:
    wds = pytest.importorskip("webdataset")
    samples = []
    for i in range(300):
        s = {"__key__": f"sample{i:05d}", "jpg": os.urandom(i * 7 % 5000), "cls": str(i % 10).encode()}
        if i % 3 == 0:
            s["json"] = json.dumps({"i": i}).encode()
        samples.append(s)
    pattern = os.fspath(tmp_path / "shard-%04d.tar")
    with wds.ShardWriter(pattern, maxcount=120, verbose=0) as sink:
        for s in samples:
            sink.write(s)
    tars = sorted(tmp_path.glob("shard-*.tar"))
    assert len(tars) == 3
    stats = convert_webdataset(tars, tmp_path / "w.smst", progress=False)
    assert stats.records == len(samples)
    with smstore.open(tmp_path / "w.smst") as s:
        assert s.encoding == "wds"
        got = list(s)
    assert got == [{k: (v.encode() if k == "__key__" else v) for k, v in x.items()} for x in samples]
    ds = SharedStoreDataset(tmp_path / "w.smst")
    assert ds[3]["json"] == b'{"i": 3}'


def test_truncated_tar_is_named(tmp_path: Path) -> None:
    src = tmp_path / "t.tar"
    with tarfile.open(src, "w") as tar:
        for i in range(20):
            data = os.urandom(3000)
            info = tarfile.TarInfo(f"s{i:03d}.bin")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    src.write_bytes(src.read_bytes()[:25_000])
    with pytest.raises(
        PackInputError, match=r"t\.tar: corrupt or truncated tar after member 's00[0-9]\.bin'"
    ):
        convert_webdataset([src], tmp_path / "o.smst", progress=False)
    assert not (tmp_path / "o.smst").exists()


# ----------------------------------------------------------------------------- Megatron


def write_megatron(prefix: Path, docs: list[list[np.ndarray]], dtype: type, code: int) -> None:
    """The MMIDIDX layout of Megatron-LM's _IndexWriter (megatron/core/datasets/indexed_dataset.py)."""
    lengths, pointers, doc_idx = [], [], [0]
    with open(f"{prefix}.bin", "wb") as b:
        for doc in docs:
            for seq in doc:
                pointers.append(b.tell())
                b.write(np.asarray(seq, dtype=dtype).tobytes(order="C"))
                lengths.append(len(seq))
            doc_idx.append(len(lengths))
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write((1).to_bytes(8, "little"))
        f.write(bytes([code]))
        f.write(len(lengths).to_bytes(8, "little"))
        f.write(len(doc_idx).to_bytes(8, "little"))
        f.write(np.array(lengths, np.int32).tobytes())
        f.write(np.array(pointers, np.int64).tobytes())
        f.write(np.array(doc_idx, np.int64).tobytes())


@pytest.mark.parametrize(("dtype", "code"), [(np.uint16, 8), (np.int32, 4)])
def test_megatron_documents_become_array_records(tmp_path: Path, dtype: type, code: int) -> None:
    rng = np.random.default_rng(0)
    docs = [
        [rng.integers(0, 30000, rng.integers(0, 50)) for _ in range(rng.integers(1, 4))] for _ in range(400)
    ]
    docs[5] = []  # a document of no sequences
    write_megatron(tmp_path / "corpus_text_document", docs, dtype, code)
    stats = convert_megatron(tmp_path / "corpus_text_document", tmp_path / "m.smst", progress=False)
    assert stats.records == len(docs)
    ds = SharedStoreDataset(tmp_path / "m.smst", decode="numpy")
    assert ds.store.encoding == f"npy:{np.dtype(dtype).str}"
    for i, doc in enumerate(docs):
        want = np.concatenate(doc).astype(dtype) if doc else np.zeros(0, dtype)
        assert np.array_equal(ds[i], want)


def test_megatron_index_that_disagrees_with_its_bin(tmp_path: Path) -> None:
    docs = [[np.arange(10)], [np.arange(20)]]
    write_megatron(tmp_path / "c", docs, np.uint16, 8)
    with open(tmp_path / "c.bin", "r+b") as f:
        f.truncate(30)
    with pytest.raises(
        PackInputError, match=r"c\.idx: sequence 1 lies at bytes 20\.\.60 of .*c\.bin, which has 30"
    ):
        convert_megatron(tmp_path / "c", tmp_path / "o.smst", progress=False)
    (tmp_path / "c.idx").write_bytes(
        b"MMIDIDX\x00\x00" + (1).to_bytes(8, "little") + bytes([8]) + (99).to_bytes(8, "little") * 2
    )
    with pytest.raises(PackInputError, match=r"c\.idx: 99 sequences and 99 document indices need"):
        convert_megatron(tmp_path / "c", tmp_path / "o.smst", progress=False)
    # Two sequences of one document that do not follow each other in the .bin.
    write_megatron(tmp_path / "g", [[np.arange(4), np.arange(4)], [np.arange(2)]], np.uint16, 8)
    idx = bytearray((tmp_path / "g.idx").read_bytes())
    pointers_at = 34 + 3 * 4
    idx[pointers_at + 8 : pointers_at + 16] = (10).to_bytes(8, "little")  # sequence 1 at byte 10, not 8
    (tmp_path / "g.idx").write_bytes(idx)
    with pytest.raises(PackInputError, match=r"g\.idx: document 0: its sequences are not contiguous"):
        convert_megatron(tmp_path / "g", tmp_path / "o.smst", progress=False)
    (tmp_path / "c.idx").write_bytes(b"not an index at all, no")
    with pytest.raises(PackInputError, match="not a Megatron MMIDIDX index"):
        convert_megatron(tmp_path / "c", tmp_path / "o.smst", progress=False)


# ----------------------------------------------------------------------------- JSON lists


def test_json_list_streams_objects(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import smstore.convert.json_list as jl

    monkeypatch.setattr(jl, "CHUNK", 97)  # elements, strings and numbers split across chunks
    objs = [tl.annotation(i) for i in range(500)]
    objs[7] = {"big": 12345678901234567890, "s": "x" * 1000, "nested": {"a": [1, 2.5, None, True]}}
    src = tmp_path / "anns.json"
    src.write_text(json.dumps(objs, indent=1))
    convert_json_list(src, tmp_path / "a.smst", progress=False)
    with smstore.open(tmp_path / "a.smst") as s:
        assert list(s) == json.loads(src.read_text())
    coco = {"info": {"year": 2017}, "licenses": [{"id": 1}], "images": objs[:50], "annotations": objs}
    (tmp_path / "coco.json").write_text(json.dumps(coco))
    convert_json_list(
        tmp_path / "coco.json", tmp_path / "imgs.smst", key="images", encoding="json", progress=False
    )
    with smstore.open(tmp_path / "imgs.smst") as s:
        assert s.encoding == "json"
        assert list(s) == json.loads(json.dumps(objs[:50]))


def test_json_list_reports_progress_as_it_reads(tmp_path: Path) -> None:
    from smstore.convert.json_list import iter_json_list

    src = tmp_path / "list.json"
    src.write_text(json.dumps([{"id": i, "name": f"image {i}"} for i in range(5000)]))
    seen: list[int] = []
    assert sum(1 for _ in iter_json_list(os.fspath(src), on_progress=seen.append)) == 5000
    assert len(seen) == 4  # every 1024 elements
    assert seen == sorted(seen)
    assert 0 < seen[0] < seen[-1] <= src.stat().st_size


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"a": 1}', "expected a JSON list"),
        ("[1, 2]", "element 0 is a int, not an object"),
        ('[{"a": 1} {"b": 2}]', "expected ',' or ']' after element 0"),
        ('[{"a": 1}, {"b": ]', r"character 17: element 1: Expecting value"),
        ('[{"a": 1}', "not closed|expected ','"),
        ('[{"a": 1}] [', "data after the end of the list"),
    ],
)
def test_bad_json_list_names_the_place(tmp_path: Path, text: str, message: str) -> None:
    src = tmp_path / "bad.json"
    src.write_text(text)
    with pytest.raises(PackInputError, match=message):
        convert_json_list(src, tmp_path / "o.smst", progress=False)
    assert not (tmp_path / "o.smst").exists()
