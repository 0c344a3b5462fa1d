"""Writes the seed corpora under fuzz/corpus/<target>/: a few valid and edge inputs per target, deterministic.

Run it from any directory with the test dependencies installed (it needs xxhash; with smstore
installed it also checks that smstore opens and verifies the valid blobs it made):

    python fuzz/make_corpus.py

Regression seeds (inputs that once found a defect) are named ``regress-*`` and kept as they are.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

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


def main() -> None:
    for target, seeds in [
        ("blob", blob_seeds()),
        ("jsonl", jsonl_seeds()),
        ("npy_lines", npy_seeds()),
        ("daemon", daemon_seeds()),
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
