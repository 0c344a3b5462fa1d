"""Writes the seed corpora under fuzz/corpus/<target>/: a few valid and edge inputs per target, deterministic.

Run it from any directory with the test dependencies installed (it needs xxhash, and pyarrow and
webdataset, which write the converters' seeds; with smstore installed it also checks that smstore
opens and verifies the valid blobs it made):

    python fuzz/make_corpus.py

Regression seeds (inputs that once found a defect) are named ``regress-*`` and kept as they are.
"""

from __future__ import annotations

import gzip
import io
import json
import struct
import tarfile
from decimal import Decimal
from pathlib import Path
from typing import Any

import xxhash

CORPUS = Path(__file__).resolve().parent / "corpus"
HEADER = struct.Struct("<8sIIQQQQQQQQQIIQ")  # docs/format.md, "Header"
MAGIC = b"\x89SMST\r\n\x1a"
# fuzz_blob.py's flag byte.
EXPAND_HEADER, FIX_CHECKSUM, FAST_INDEX = 1, 2, 4


def blob(records: list[bytes], meta: bytes = b'{"encoding":"bytes"}') -> bytes:
    """A valid blob written from docs/format.md alone (no smstore code involved)."""
    data = b"".join(records)
    offsets = [0]
    for r in records:
        offsets.append(offsets[-1] + len(r))
    index_offset = 4096 + len(data) + (-len(data) % 8)
    index = struct.pack(f"<{len(offsets)}Q", *offsets)
    meta_offset = index_offset + len(index)
    size = meta_offset + len(meta)
    fields = [MAGIC, 1, 4096, 0, size, len(records), 4096, len(data), index_offset, len(index)]
    header = HEADER.pack(*fields, meta_offset, len(meta), 1, 0, 0).ljust(4096, b"\0")
    body = data.ljust(index_offset - 4096, b"\0") + index + meta
    checksum = xxhash.xxh64(body + header).intdigest()
    return header[:96] + struct.pack("<Q", checksum) + header[104:] + body


def compact(b: bytes) -> bytes:
    """fuzz_blob.py's short form: the header struct without the zeros that pad it to 4096 bytes."""
    return b[: HEADER.size] + b[4096:]


def blob_seeds() -> dict[str, bytes]:
    three = blob([b"zero", b"", b"record two"])
    corrupt = bytearray(three)
    corrupt[4096] ^= 1
    backwards = bytearray(blob([b"ab", b"cd"]))
    index_offset = HEADER.unpack_from(backwards)[8]
    backwards[index_offset + 8 : index_offset + 16] = struct.pack("<Q", 5)  # off = [0, 5, 4]
    return {
        "valid-3-records": bytes([EXPAND_HEADER]) + compact(three),
        "valid-empty": bytes([EXPAND_HEADER]) + compact(blob([])),
        "valid-full-header": bytes([0]) + blob([b"x" * 7, b"\n"]),
        "valid-unicode-meta": bytes([EXPAND_HEADER])
        + compact(blob([b"\xff\x00"], json.dumps({"encoding": "lines", "user": {"k": "\u00e9"}}).encode())),
        "corrupt-data-fixed-checksum": bytes([EXPAND_HEADER | FIX_CHECKSUM]) + compact(bytes(corrupt)),
        "corrupt-data": bytes([EXPAND_HEADER]) + compact(bytes(corrupt)),
        "index-backwards": bytes([EXPAND_HEADER | FIX_CHECKSUM]) + compact(bytes(backwards)),
        "index-backwards-fast": bytes([EXPAND_HEADER | FIX_CHECKSUM | FAST_INDEX])
        + compact(bytes(backwards)),
        "meta-not-json": bytes([EXPAND_HEADER | FIX_CHECKSUM]) + compact(blob([b"a"], b"{not json")),
        "truncated": bytes([EXPAND_HEADER]) + compact(three)[:-3],
        "not-a-blob": b"\0hello",
    }


def jsonl_seeds() -> dict[str, bytes]:
    return {
        "valid": b'{"a": 1, "b": [true, false, null], "c": {"d": "e"}}\n[]\n0\n-1.5e+10\n"x"\n',
        "escapes": b'"caf\\u00e9 \\n \\" \\\\ \\/ \\ud800"\n' + '"h\u00e9llo \U0001f600"\n'.encode(),
        "whitespace-cr": b'  {"spaced" : [ 1 , 2 ] }  \r\n\t{}\r\n',
        "no-final-newline": b'{"k": "v"}\n{"dup": 1, "dup": 2}',
        "empty-line": b"{}\n\n{}\n",
        "bad-third-line": b"1\n2\n{bad}\n4\n",
        "nan": b"NaN\n[Infinity]\n",
        "bad-utf8": b'"\xed\xa0\x80"\n"\xc0\xaf"\n',
        "control-char": b'"a\x01b"\n',
        "deep-512": b"[" * 512 + b"]" * 512 + b"\n",
        "deep-513": b"[" * 513 + b"]" * 513 + b"\n",
        "numbers": b"01\n1.\n-\n1e\n.5\n",
    }


def npy_seeds() -> dict[str, bytes]:
    # Byte 0 picks the dtype: 0 uint8, 1 uint16, 2 int32, 3 int64.
    return {
        "uint8": b"\x00" + b"0 1 255\n\n+7\t-0\r\n",
        "uint8-overflow": b"\x00" + b"1 2\n256\n",
        "uint16": b"\x01" + b"65535 0\n1 2 3",
        "int32": b"\x02" + b"-2147483648 2147483647\n\v5\f\n",
        "int64": b"\x03" + b"-9223372036854775808 9223372036854775807\n",
        "int64-overflow": b"\x03" + b"18446744073709551616\n",
        "bad-token": b"\x01" + b"1 2x 3\n",
        "sign-only": b"\x02" + b"1\n- 2\n",
        "nul": b"\x00" + b"1\x002\n",
    }


def frame(message: dict[str, object] | bytes) -> bytes:
    body = message if isinstance(message, bytes) else json.dumps(message).encode()
    return struct.pack(">I", len(body)) + body


def daemon_seeds() -> dict[str, bytes]:
    # Byte 0: flags (1 not the owner, 2 half-close, 4 read replies late); byte 1: chunk size (0:
    # one write). "@@@@CHECKSUM@@@@" stands for the served segment's checksum.
    attach = frame(b'{"op": "attach", "checksum": "@@@@CHECKSUM@@@@"}')
    return {
        "attach": b"\0\0" + attach,
        "attach-twice-chunked": b"\0\x03" + attach + attach,
        "attach-unknown": b"\0\0" + frame({"op": "attach", "checksum": "0123456789abcdef"}),
        "status": b"\0\0" + frame({"op": "status"}),
        "load": b"\0\0" + frame({"op": "load", "path": "/nonexistent/x.smst"}) + frame({"op": "status"}),
        "unload-then-attach": b"\0\0" + frame(b'{"op": "unload", "checksum": "@@@@CHECKSUM@@@@"}') + attach,
        "stop": b"\x02\0" + frame({"op": "stop"}),
        "not-owner-load": b"\x01\0" + frame({"op": "load", "path": "/etc/passwd"}) + attach,
        "bad-json": b"\0\0" + frame(b"{not json") + frame(b"[1]") + frame({"op": ["list"]}),
        "too-large": b"\0\0" + struct.pack(">I", 1 << 20) + b"{}",
        "partial": b"\x02\x01" + attach[:-3],
        "read-late": b"\x04\0" + attach + frame({"op": "status"}) + attach,
    }


def arrow_seeds() -> dict[str, bytes]:
    import pyarrow as pa
    import pyarrow.ipc
    import pyarrow.parquet as pq

    # fuzz_arrow.py's flag byte: bits 0-1 the container (0: an IPC file without its leading 8
    # bytes of magic, 1: an IPC stream, 2: Parquet without its leading "PAR1", 3: the whole file),
    # 4: convert the column whose index is in bits 3-5 (else rows).
    basic = pa.table(
        {
            "data": pa.array([b"zero", b"", b"\x00\xff two"], pa.binary()),
            "text": pa.array(["a", "\u00e9\U0001f600", ""]),
            "id": pa.array([1, 2, 3], pa.int64()),
        }
    )
    typed = pa.table(
        {
            "lb": pa.array([b"x", b"yy"], pa.large_binary()),
            "ls": pa.array(["p", "q\n"], pa.large_string()),
            "fsb": pa.array([b"abc", b"def"], pa.binary(3)),
            "f": pa.array([float("nan"), -0.0]),
            "list": pa.array([[1, None], []], pa.list_(pa.int32())),
            "struct": pa.array([{"a": 1, "b": "x"}, {"a": None, "b": "y"}]),
            "ts": pa.array([0, 1_700_000_000_000_000], pa.timestamp("us", tz="UTC")),
            "date": pa.array([0, 19000], pa.date32()),
            "dec": pa.array([Decimal("1.25"), Decimal("-3.50")], pa.decimal128(5, 2)),
            "dict": pa.array(["u", "v"]).dictionary_encode(),
            "map": pa.array([[("k", 1)], []], pa.map_(pa.string(), pa.int64())),
            "view": pa.array(["s", "t"], pa.string_view()),
        }
    )
    nulls = pa.table({"data": pa.array([b"a", None], pa.binary())})
    # What a hostile writer makes (patched in after writing, as pyarrow validates what it
    # writes): offsets past the data, text that is not UTF-8, a dictionary index past its dictionary.
    bad_offsets = pa.table({"data": pa.array([b"abc", b"def"], pa.binary())})
    bad_utf8 = pa.table({"text": pa.array(["ok", "ab"])})
    bad_index = pa.DictionaryArray.from_arrays(pa.array([0, 7], pa.int32()), pa.array(["a"]), safe=False)

    def ipc(table: Any, stream: bool, **options: Any) -> bytes:
        sink = io.BytesIO()
        write_options = pa.ipc.IpcWriteOptions(**options)
        new = pa.ipc.new_stream if stream else pa.ipc.new_file
        with new(sink, table.schema, options=write_options) as w:
            for batch in table.to_batches(max_chunksize=2):
                w.write_batch(batch)
        return sink.getvalue()

    def parquet(table: Any, **options: Any) -> bytes:
        sink = io.BytesIO()
        pq.write_table(table, sink, **options)
        return sink.getvalue()

    def file_(b: bytes) -> bytes:
        return b[8:]  # fuzz_arrow.py puts the magic back

    def col(container: int, index: int) -> bytes:
        return bytes([container | 4 | index << 3])

    def patched(b: bytes, old: bytes, new: bytes) -> bytes:
        assert b.count(old) == 1, (b, old)
        return b.replace(old, new)

    offsets = patched(ipc(bad_offsets, True), struct.pack("<3i", 0, 3, 6), struct.pack("<3i", 0, 3, 1 << 20))
    parquet_sum = parquet(basic, write_page_checksum=True, compression="none")
    corrupt_sum = bytearray(parquet_sum)
    at = corrupt_sum.index(b"\x00\xff two")
    corrupt_sum[at] ^= 1
    return {
        "file-rows": b"\x00" + file_(ipc(basic, False)),
        "file-column-binary": col(0, 0) + file_(ipc(basic, False)),
        "file-typed-rows": b"\x00" + file_(ipc(typed, False)),
        "file-lz4": col(0, 1) + file_(ipc(basic, False, compression="lz4")),
        "file-empty": col(0, 0) + file_(ipc(basic.schema.empty_table(), False)),
        "file-truncated": b"\x00" + file_(ipc(basic, False))[:300],
        "stream-column-string": col(1, 1) + ipc(basic, True),
        "stream-typed-fsb": col(1, 2) + ipc(typed, True),
        "stream-zstd-rows": b"\x01" + ipc(typed, True, compression="zstd"),
        "stream-empty": b"\x01" + ipc(basic.schema.empty_table(), True),
        "stream-nulls": col(1, 0) + ipc(nulls, True),
        "stream-bad-offsets": col(1, 0) + offsets,
        "stream-bad-offsets-rows": b"\x01" + offsets,
        "stream-bad-utf8": col(1, 0) + patched(ipc(bad_utf8, True), b"okab", b"ok\xff\xfe"),
        "file-bad-dictionary-index": b"\x00" + file_(ipc(pa.table({"d": bad_index}), False)),
        "parquet-column": col(2, 0) + parquet(basic)[4:],
        "parquet-rows-v2-dict": b"\x02" + parquet(typed, data_page_version="2.0", store_schema=False)[4:],
        "parquet-checksums": col(2, 1) + parquet_sum[4:],
        "parquet-checksum-mismatch": col(2, 0) + bytes(corrupt_sum[4:]),
        "parquet-empty": b"\x02" + parquet(basic.schema.empty_table())[4:],
        "raw-not-arrow": b"\x03" + b"PAR0 hello",
    }


def tar_of(members: list[tuple[tarfile.TarInfo, bytes]], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    """A tar of these members, ended by its two zero blocks without tarfile's padding to 10 KiB."""
    sink = io.BytesIO()
    with tarfile.open(fileobj=sink, mode="w", format=fmt, encoding="utf-8") as tar:
        for info, data in members:
            if info.isreg():
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
        end = tar.offset
    return sink.getvalue()[:end] + bytes(1024)


def member(
    name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, link: str = ""
) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mtime = kind, link, 1_700_000_000
    return info, data


def gnu_sparse(name: str, stored: bytes, real_size: int, at: int) -> bytes:
    """An old-GNU sparse member ('S'): `stored` lies at offset `at` of a file of `real_size` bytes."""
    info = tarfile.TarInfo(name)
    info.size = len(stored)
    header = bytearray(info.tobuf(tarfile.GNU_FORMAT))
    header[156:157] = tarfile.GNUTYPE_SPARSE
    header[386:410] = b"%011o\0%011o\0" % (at, len(stored))
    header[483:495] = b"%011o\0" % real_size
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header) + stored.ljust(-(-len(stored) // 512) * 512, b"\0")


def tar_seeds() -> dict[str, bytes]:
    import webdataset as wds

    # fuzz_tar.py's flag byte: 1 gzips the rest before converting it.
    sink = io.BytesIO()
    with wds.TarWriter(sink, mtime=1_700_000_000) as w:  # an integer mtime: no pax header
        for i in range(2):
            w.write({"__key__": f"shard/s{i:03d}", "jpg": bytes(range(i * 5)), "cls": b"%d" % i})
        end = w.tarstream.offset
    samples = sink.getvalue()[:end] + bytes(1024)
    grouping = tar_of(
        [
            member("dir/a.b.c", b"multi-dot"),
            member("dir/a.TXT", b"upper"),
            member("b.x", b"b"),
            member("a.x", b"a again: a new sample"),
            member("a.", b"empty extension"),
        ]
    )
    # Members webdataset skips (and so must the converter): not regular files, no dot or no
    # stem in the name, metadata names. Empty, so one block each.
    skipped = tar_of(
        [
            member("dir/", kind=tarfile.DIRTYPE),
            member("dir/a.lnk", kind=tarfile.SYMTYPE, link="a.b.c"),
            member("noext"),
            member(".hidden"),
            member("__meta__"),
            member("x/__y__/z.txt"),
            member("__k__/v.txt"),
            member("kept.txt", b"kept"),
        ]
    )
    gnu = tar_of(
        [member("g/" + "long" * 40 + ".txt", b"gnu long name"), member("k.\u00e9", b"e")], tarfile.GNU_FORMAT
    )
    raw_name = tar_of([member("caf\udce9.txt", b"latin-1 name")], tarfile.USTAR_FORMAT)
    bad_sum = bytearray(samples)
    bad_sum[148] ^= 1
    sparse_small = gnu_sparse("s.bin", b"data", 16, 4) + tar_of([member("s.txt", b"t")])
    sparse_huge = gnu_sparse("h.bin", b"data", 4 << 30, (4 << 30) - 4) + bytes(1024)
    return {
        "samples": b"\0" + samples,
        "samples-gzip": b"\1" + samples,
        "names-grouping": b"\0" + grouping,
        "names-skipped": b"\0" + skipped,
        "pax-long-names": b"\0"
        + tar_of([member("p/" + "x" * 150 + ".txt", b"pax"), member("\u00e9t\u00e9.json", b"{}")]),
        "gnu-long-names": b"\1" + gnu,
        "not-utf8-name": b"\0" + raw_name,
        "duplicate-extension": b"\0" + tar_of([member("a.txt", b"1"), member("a.TXT", b"2")]),
        "empty-member": b"\0" + tar_of([member("e.bin")]),
        "sparse": b"\0" + sparse_small,
        "sparse-4gib": b"\0" + sparse_huge,
        "truncated": b"\0" + samples[:1200],
        "bad-checksum": b"\0" + bytes(bad_sum),
        "only-end-blocks": b"\0" + bytes(1024),
        "gzip-not-a-tar": b"\0" + gzip.compress(b"not a tar", mtime=0),
    }


def json_list_seeds() -> dict[str, bytes]:
    # fuzz_json_list.py's flag byte: 1 converts the list under the top-level key "k".
    objs = [
        {"id": 1, "name": "a", "bbox": [1.5, 2, 3e2, -4], "ok": True, "none": None},
        {},
        {"nested": {"x": [[], {}]}, "s": "\u00e9\u2028\U0001f600"},
    ]
    top, key = b"\0", b"\1"
    return {
        "list": top + json.dumps(objs).encode(),
        "list-indented": top + json.dumps(objs, indent=2, ensure_ascii=False).encode(),
        "empty": top + b" [ ] \n",
        "whitespace": top + b" \t\r\n[ \n{ }\r\n,\t{}\n]\n ",
        "under-key": key
        + json.dumps({"info": {"k": 1}, "licenses": [{"id": 1}], "k": objs, "after": [1]}).encode(),
        "key-escaped": key + b'{"\\u006b": [{"a": 1}]}',
        "key-twice": key + b'{"k": [{"a": 1}], "k": [{"b": 2}]}',
        "key-missing": key + b'{"images": []}',
        "key-then-garbage": key + b'{"k": [{"a": 1}], !',
        "nan": top + b'[{"v": NaN}, {"v": -Infinity}, {"v": Infinity, "w": 1e400}]',
        "escapes": top + b'[{"s": "\\ud800 \\udc00 \\u0000 \\" \\\\ \\/ \\b\\f\\n\\r\\t"}]',
        "numbers": top + b'[{"a": 12345678901234567890123, "b": -0, "c": -0.0, "d": 1E-400, "e": 0.1}]',
        "not-objects": top + b'[{"a": 1}, 2, "x"]',
        "not-a-list": top + b'{"a": [1]}',
        "trailing": top + b"[{}] [",
        "bad-separator": top + b'[{"a": 1} {"b": 2}]',
        "unterminated": top + b'[{"a": "b',
        "bad-utf8": top + b'[{"a": "\xff\xfe"}]',
        "surrogate-bytes": top + b'[{"a": "\xed\xa0\x80"}]',
        "control-char": top + b'[{"a": "\x01"}]',
        "bom": top + b"\xef\xbb\xbf[{}]",
        "utf16": top + '[{"a": 1}]'.encode("utf-16-le"),
        "deep-500": top + b'[{"a": ' + b"[" * 498 + b"]" * 498 + b"}]",
        "deep-1100": top + b'[{"a": ' + b"[" * 1098 + b"]" * 1098 + b"}]",
    }


def shard_index_seeds() -> dict[str, bytes]:
    """fuzz_shard_index.cpp's input: a flags byte, then shard sizes (a byte < 0xf0, or 0xff and a u64)."""

    def sizes(*values: int) -> bytes:
        return b"".join(bytes([v]) if v < 0xF0 else b"\xff" + struct.pack("<Q", v) for v in values)

    def uniform(per: int, count: int, last: int) -> bytes:
        return b"\x01" + sizes(per) + bytes([count]) + sizes(last)

    def raw(*starts: int) -> bytes:
        return b"\x02" + b"".join(struct.pack("<Q", v) for v in starts)

    return {
        "sizes-similar": b"\x00" + sizes(100, 98, 101, 100, 99, 100),
        "sizes-with-empty": b"\x00" + sizes(5, 0, 0, 7, 0, 3, 0),
        "sizes-lopsided": b"\x00" + sizes(1, 200, 1, 1, 1 << 40, 2),
        "sizes-near-2-64": b"\x00" + sizes((1 << 64) - 1),
        "uniform-small": uniform(7, 10, 3),
        "uniform-last-empty": uniform(5, 4, 0),
        "uniform-one-record": uniform(1, 200, 1),
        "uniform-huge": uniform((1 << 62) + 3, 2, (1 << 62) + 1),
        "raw-valid": raw(0, 3, 3, 10),
        "raw-decreasing": raw(0, 5, 4),
        "raw-not-from-zero": raw(1, 2),
    }


def main() -> None:
    for target, seeds in [
        ("blob", blob_seeds()),
        ("jsonl", jsonl_seeds()),
        ("npy_lines", npy_seeds()),
        ("daemon", daemon_seeds()),
        ("arrow", arrow_seeds()),
        ("tar", tar_seeds()),
        ("json_list", json_list_seeds()),
        ("shard_index", shard_index_seeds()),
    ]:
        folder = CORPUS / target
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.iterdir():
            if not old.name.startswith("regress-"):
                old.unlink()
        for name, data in seeds.items():
            (folder / name).write_bytes(data)
    try:
        import smstore
    except ImportError:
        return
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "seed.smst"
        path.write_bytes(blob([b"zero", b"", b"record two"]))
        with smstore.open(path, verify=True) as store:
            if [bytes(r) for r in store] != [b"zero", b"", b"record two"]:
                raise SystemExit("make_corpus.py's blob writer disagrees with smstore")


if __name__ == "__main__":
    main()
