"""The blob format: header layout, checksum rule, bit-flip detection, and rejection of malformed files."""

from __future__ import annotations

import contextlib
import json
import os
import random
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import smstore_testlib as tl
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import smstore
from smstore import (
    ChecksumMismatchError,
    StoreError,
    StoreFormatError,
    StoreIOError,
    StoreNotFoundError,
    StoreTruncatedError,
    StoreVersionError,
)

# ----------------------------------------------------------------------------- layout


def test_header_layout_matches_docs(awkward_blob: Path, awkward_records: list[bytes]) -> None:
    blob = awkward_blob.read_bytes()
    h = tl.parse_header(blob)
    n = len(awkward_records)
    data = b"".join(awkward_records)

    assert h["magic"] == tl.MAGIC
    assert h["version"] == 1
    assert h["header_size"] == 4096
    assert h["flags"] == 0
    assert h["file_size"] == len(blob)
    assert h["record_count"] == n
    assert h["data_offset"] == 4096
    assert h["data_size"] == len(data)
    assert h["checksum_algo"] == 1
    assert h["reserved0"] == 0
    # Everything between the 104-byte struct and the data is zero.
    assert blob[tl.HEADER_STRUCT.size : 4096] == bytes(4096 - tl.HEADER_STRUCT.size)
    # Data section: the records back to back.
    assert blob[4096 : 4096 + len(data)] == data
    # Index: 8-aligned, right after the data (zero padding only), N+1 little-endian u64 offsets.
    data_end = 4096 + len(data)
    assert h["index_offset"] % 8 == 0
    assert data_end <= h["index_offset"] < data_end + 8
    assert blob[data_end : h["index_offset"]] == bytes(h["index_offset"] - data_end)
    assert h["index_size"] == (n + 1) * 8
    index = struct.unpack_from(f"<{n + 1}Q", blob, h["index_offset"])
    expected = [0]
    for r in awkward_records:
        expected.append(expected[-1] + len(r))
    assert list(index) == expected
    # Metadata: a JSON object, last in the file.
    assert h["meta_offset"] == h["index_offset"] + h["index_size"]
    assert h["meta_offset"] + h["meta_size"] == len(blob)
    meta = json.loads(blob[h["meta_offset"] :])
    assert meta["encoding"] == "bytes"
    assert meta["smstore_version"] == smstore.__version__
    assert {"created", "source"} <= meta.keys()


def test_empty_blob_layout(make_blob) -> None:
    path = make_blob([])
    blob = path.read_bytes()
    h = tl.parse_header(blob)
    assert h["record_count"] == 0
    assert h["data_size"] == 0
    assert h["index_offset"] == 4096
    assert h["index_size"] == 8
    assert blob[4096:4104] == bytes(8)
    with smstore.open(path, verify=True) as s:
        assert len(s) == 0
        assert list(s.offsets) == [0]


def test_unaligned_data_pads_index(make_blob) -> None:
    for k in range(1, 9):
        blob = make_blob([b"a" * k]).read_bytes()
        h = tl.parse_header(blob)
        assert h["index_offset"] % 8 == 0
        assert h["index_offset"] == 4096 + 8 * ((k + 7) // 8)


def test_checksum_rule(awkward_blob: Path, make_blob) -> None:
    for path in (awkward_blob, make_blob([]), make_blob([b"x" * 100_000, b"y"])):
        blob = path.read_bytes()
        stored = tl.parse_header(blob)["checksum"]
        assert stored == tl.expected_checksum(blob)
        with smstore.open(path) as s:
            assert s.checksum == f"{stored:016x}"
            assert s.compute_checksum() == s.checksum
            s.verify()


def test_user_metadata_and_encoding_stored(make_blob) -> None:
    path = make_blob([b"abcd"], encoding="npy:<i4", metadata={"k": "v", "n": [1, 2]})
    with smstore.open(path) as s:
        assert s.encoding == "npy:<i4"
        assert s.metadata["user"] == {"k": "v", "n": [1, 2]}


# ----------------------------------------------------------------------------- bit flips


@pytest.fixture
def tiny_blob(make_blob) -> Path:
    return make_blob([b"ab", b"", b"\x00c\r"], metadata={"u": 1})


def test_every_single_bit_flip_fails_verify(tiny_blob: Path) -> None:
    original = tiny_blob.read_bytes()
    assert len(original) < 4500  # keeps the exhaustive loop a couple of seconds
    smstore.open(tiny_blob, verify=True).close()
    fd = os.open(tiny_blob, os.O_RDWR)
    missed = []
    try:
        for pos in range(len(original)):
            byte = original[pos]
            for bit in range(8):
                os.pwrite(fd, bytes([byte ^ (1 << bit)]), pos)
                try:
                    with smstore.open(tiny_blob) as s:
                        s.verify()
                except StoreFormatError:
                    pass
                else:
                    missed.append((pos, bit))
            os.pwrite(fd, bytes([byte]), pos)
    finally:
        os.close(fd)
    assert missed == []
    assert tiny_blob.read_bytes() == original
    smstore.open(tiny_blob, verify=True).close()


def test_bit_flip_in_data_is_a_checksum_mismatch_naming_the_file(tiny_blob: Path) -> None:
    blob = bytearray(tiny_blob.read_bytes())
    blob[4097] ^= 0x10
    tiny_blob.write_bytes(blob)
    # The structure is still fine, so open succeeds and only verify() notices.
    with smstore.open(tiny_blob) as s, pytest.raises(ChecksumMismatchError, match="checksum") as ei:
        s.verify()
    assert str(tiny_blob) in str(ei.value)
    with pytest.raises(ChecksumMismatchError):
        smstore.open(tiny_blob, verify=True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_bit_flips_in_a_larger_blob_fail_verify(make_blob, data: st.DataObject) -> None:
    path = make_blob([bytes([i % 251]) * (i % 300) for i in range(400)], name="large.smst")
    size = path.stat().st_size
    pos = data.draw(st.integers(0, size - 1), label="pos")
    bit = data.draw(st.integers(0, 7), label="bit")
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([b ^ (1 << bit)]))
    with pytest.raises(StoreFormatError):
        smstore.open(path, verify=True)


# ----------------------------------------------------------------------------- malformed files


def _expect(path: Path, cls: type[BaseException], exact: bool = False) -> BaseException:
    with pytest.raises(StoreError) as ei:
        smstore.open(path)
    assert isinstance(ei.value, cls), f"{type(ei.value).__name__}: {ei.value}"
    if exact:
        assert type(ei.value) is cls, f"{type(ei.value).__name__}: {ei.value}"
    assert str(path) in str(ei.value)
    return ei.value


def _boundaries(blob: bytes) -> list[int]:
    h = tl.parse_header(blob)
    points = {
        1,
        7,
        8,
        9,
        100,
        103,
        104,
        4095,
        4096,
        4097,
        4096 + h["data_size"] // 2,
        4096 + h["data_size"],
        h["index_offset"],
        h["index_offset"] + 4,
        h["index_offset"] + h["index_size"] - 1,
        h["meta_offset"],
        h["meta_offset"] + 1,
        len(blob) - 1,
    }
    return sorted(p for p in points if 0 < p < len(blob))


def test_truncated_at_each_boundary_and_at_random_lengths(awkward_blob: Path, tmp_path: Path) -> None:
    blob = awkward_blob.read_bytes()
    rng = random.Random(1)
    lengths = _boundaries(blob) + [rng.randrange(1, len(blob)) for _ in range(40)]
    target = tmp_path / "cut.smst"
    for n in lengths:
        target.write_bytes(blob[:n])
        # Shorter than the magic: cannot tell it is a blob. Otherwise: a blob cut short.
        _expect(target, StoreTruncatedError if n >= 8 else StoreFormatError)


def test_empty_file(tmp_path: Path) -> None:
    p = tmp_path / "empty.smst"
    p.write_bytes(b"")
    err = _expect(p, StoreFormatError, exact=True)
    assert "empty" in str(err)


def test_file_longer_than_header_says(awkward_blob: Path) -> None:
    awkward_blob.write_bytes(awkward_blob.read_bytes() + b"\0")
    err = _expect(awkward_blob, StoreFormatError)
    assert not isinstance(err, StoreTruncatedError)


@pytest.mark.parametrize(
    "content",
    [
        b"hello world\n",
        b"\x89PNG\r\n\x1a\n" + bytes(5000),
        bytes(8192),
        random.Random(2).randbytes(9000),
        b"\x89SMST\r\n\x1b" + bytes(5000),  # one bit off the magic
    ],
    ids=["text", "png", "zeros", "random", "near-magic"],
)
def test_foreign_files(tmp_path: Path, content: bytes) -> None:
    p = tmp_path / "foreign.bin"
    p.write_bytes(content)
    err = _expect(p, StoreFormatError, exact=True)
    assert "smstore blob" in str(err) or "magic" in str(err)


def test_not_found(tmp_path: Path) -> None:
    p = tmp_path / "missing.smst"
    err = _expect(p, StoreNotFoundError)
    assert isinstance(err, FileNotFoundError)
    assert isinstance(err, StoreIOError)


def test_directory(tmp_path: Path) -> None:
    d = tmp_path / "adir.smst"
    d.mkdir()
    _expect(d, (StoreFormatError, StoreIOError))  # type: ignore[arg-type]


def test_dev_null() -> None:
    _expect(Path("/dev/null"), (StoreFormatError, StoreIOError))  # type: ignore[arg-type]


def test_fifo_does_not_hang(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.smst"
    os.mkfifo(fifo)
    code = (
        "import sys, smstore\n"
        "try:\n"
        "    smstore.open(sys.argv[1])\n"
        "except (smstore.StoreFormatError, smstore.StoreIOError) as e:\n"
        "    assert sys.argv[1] in str(e), e\n"
        "    print('REFUSED', type(e).__name__)\n"
    )
    # In a child so that a regression shows as a timeout instead of a hung test session.
    r = subprocess.run(
        [sys.executable, "-c", code, str(fifo)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tl.SAFE_CWD,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("REFUSED")


def _patched(src: Path, dst: Path, reseal: bool = True, **fields: int) -> Path:
    blob = src.read_bytes()
    for name, value in fields.items():
        blob = tl.set_field(blob, name, value)
    dst.write_bytes(tl.reseal(blob) if reseal else blob)
    return dst


def test_bad_version(awkward_blob: Path, tmp_path: Path) -> None:
    for v in (0, 2, 0xFFFFFFFF):
        err = _expect(_patched(awkward_blob, tmp_path / f"v{v}.smst", version=v), StoreVersionError)
        assert str(v) in str(err)


def test_unknown_flags(awkward_blob: Path, tmp_path: Path) -> None:
    for bit in (0, 1, 31, 63):
        _expect(_patched(awkward_blob, tmp_path / f"f{bit}.smst", flags=1 << bit), StoreVersionError)


def test_unknown_checksum_algorithm(awkward_blob: Path, tmp_path: Path) -> None:
    _expect(_patched(awkward_blob, tmp_path / "algo.smst", checksum_algo=7), StoreFormatError)


def test_bad_header_size_and_data_offset(awkward_blob: Path, tmp_path: Path) -> None:
    _expect(_patched(awkward_blob, tmp_path / "hs.smst", header_size=104), StoreFormatError, exact=True)
    _expect(_patched(awkward_blob, tmp_path / "do.smst", data_offset=4104), StoreFormatError, exact=True)


def test_sections_out_of_bounds(awkward_blob: Path, tmp_path: Path) -> None:
    h = tl.parse_header(awkward_blob.read_bytes())
    size = h["file_size"]
    cases = {
        "data_size_past_end": {"data_size": size},
        "data_size_wraps": {"data_size": 2**64 - 1},
        "index_offset_past_end": {"index_offset": size + 8},
        "index_offset_wraps": {"index_offset": 2**64 - 8},
        "meta_size_past_end": {"meta_size": h["meta_size"] + 1},
        "meta_offset_wraps": {"meta_offset": 2**64 - 1},
        "index_misaligned": {"index_offset": h["index_offset"] + 4},
        "index_overlaps_data": {"index_offset": h["index_offset"] - 8},
        "meta_overlaps_index": {"meta_offset": h["index_offset"], "meta_size": h["meta_size"]},
        "index_size_mismatch": {"index_size": h["index_size"] - 8},
        "record_count_mismatch": {"record_count": h["record_count"] + 1},
        "record_count_2**61": {"record_count": 2**61, "index_size": 8},  # (2**61+1)*8 wraps to 8
        "record_count_2**61-1": {"record_count": 2**61 - 1, "index_size": 0},  # wraps to 0
        "record_count_max": {"record_count": 2**64 - 1, "index_size": 0},
    }
    for name, fields in cases.items():
        err = _expect(_patched(awkward_blob, tmp_path / f"{name}.smst", **fields), StoreFormatError)
        assert not isinstance(err, (StoreTruncatedError, ChecksumMismatchError)), name


def _patch_index(src: Path, dst: Path, k: int, value: int) -> Path:
    blob = bytearray(src.read_bytes())
    h = tl.parse_header(blob)
    struct.pack_into("<Q", blob, h["index_offset"] + 8 * k, value)
    dst.write_bytes(tl.reseal(blob))
    return dst


def test_corrupt_index(awkward_blob: Path, tmp_path: Path, awkward_records: list[bytes]) -> None:
    h = tl.parse_header(awkward_blob.read_bytes())
    n, data_size = h["record_count"], h["data_size"]
    offsets = [0]
    for r in awkward_records:
        offsets.append(offsets[-1] + len(r))
    k = next(i for i in range(1, n) if offsets[i] > 0)
    cases = {
        "first_not_zero": (0, 1),
        "decreasing": (k, offsets[k - 1] - 1 if offsets[k - 1] > 0 else 2**64 - 1),
        "decreasing_huge": (k, 2**64 - 1),
        "last_short": (n, data_size - 1),
        "last_long": (n, data_size + 1),
        "last_huge": (n, 2**64 - 1),
    }
    for name, (i, value) in cases.items():
        err = _expect(_patch_index(awkward_blob, tmp_path / f"{name}.smst", i, value), StoreFormatError)
        assert "index" in str(err), name


def test_metadata_not_json_raises_format_error(awkward_blob: Path) -> None:
    blob = bytearray(awkward_blob.read_bytes())
    h = tl.parse_header(blob)
    blob[h["meta_offset"]] = ord("[")  # still valid structure, but not a JSON object any more
    awkward_blob.write_bytes(tl.reseal(blob))
    with smstore.open(awkward_blob, verify=True) as s, pytest.raises(StoreFormatError) as ei:
        _ = s.metadata
    assert str(awkward_blob) in str(ei.value)


# ----------------------------------------------------------------------------- header fuzzing

_INTERESTING = [0, 1, 7, 8, 4095, 4096, 4104, 2**31, 2**32 - 1, 2**32, 2**61, 2**63, 2**64 - 8, 2**64 - 1]
_MUTABLE = [f for f in tl.HEADER_FIELDS if f not in ("magic", "checksum")]


def _value_for(field: str) -> st.SearchStrategy[int]:
    bits = 32 if tl.FIELDS[field][1] == "<I" else 64
    top = 2**bits - 1
    return st.one_of(
        st.sampled_from([v for v in _INTERESTING if v <= top]),
        st.integers(0, 9000),
        st.integers(0, top),
    )


@st.composite
def _mutations(draw: st.DrawFn) -> list[tuple[str, int | tuple[int, int]]]:
    out: list[tuple[str, int | tuple[int, int]]] = []
    for _ in range(draw(st.integers(1, 3))):
        field = draw(st.sampled_from([*_MUTABLE, "index_entry", "relative"]))
        if field == "index_entry":
            out.append((field, (draw(st.integers(0, 16)), draw(_value_for("data_size")))))
        elif field == "relative":  # nudge a field by a small amount: the off-by-one cases
            out.append((field, (draw(st.sampled_from(range(len(_MUTABLE)))), draw(st.integers(-9, 9)))))
        else:
            out.append((field, draw(_value_for(field))))
    return out


@pytest.fixture
def fuzz_source(make_blob) -> bytes:
    recs = [b"alpha", b"", b"\r\x00\xff", b"beta" * 10, b"g"] + [bytes([i]) * i for i in range(12)]
    return make_blob(recs, name="fuzz_source.smst").read_bytes()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=_mutations(), reseal=st.booleans())
def test_mutated_header_opens_in_bounds_or_raises_format_error(
    fuzz_source: bytes, tmp_path: Path, mutations: list[tuple[str, object]], reseal: bool
) -> None:
    blob = bytearray(fuzz_source)
    h0 = tl.parse_header(blob)
    for field, value in mutations:
        if field == "index_entry":
            k, v = value  # type: ignore[misc]
            struct.pack_into("<Q", blob, h0["index_offset"] + 8 * k, v)
        elif field == "relative":
            which, delta = value  # type: ignore[misc]
            name = _MUTABLE[which]
            bits = 32 if tl.FIELDS[name][1] == "<I" else 64
            blob = tl.set_field(blob, name, (tl.parse_header(blob)[name] + delta) % 2**bits)
        else:
            blob = tl.set_field(blob, field, value)
    if reseal:
        blob = tl.reseal(blob)
    path = tmp_path / "fuzz.smst"
    path.write_bytes(blob)

    try:
        store = smstore.open(path)
    except StoreFormatError as e:
        message, kind = str(e), type(e).__name__
        store = None
    if store is None:
        assert str(path) in message
        event(f"rejected: {kind}")
        return
    event("opened")
    with store:
        h = tl.parse_header(blob)
        n = len(store)
        assert n == h["record_count"]
        offs = store.offsets
        assert len(offs) == n + 1
        data_lo, data_hi = h["data_offset"], h["data_offset"] + h["data_size"]
        assert data_hi <= len(blob)
        assert h["index_offset"] + h["index_size"] <= len(blob)
        for i in range(n):
            lo, hi = int(offs[i]), int(offs[i + 1])
            assert 0 <= lo <= hi <= h["data_size"]
            assert bytes(store[i]) == bytes(blob[data_lo + lo : data_lo + hi])
        assert bytes(store.gather(list(range(n)))[0]) == bytes(blob[data_lo : data_lo + int(offs[n])])
        try:
            store.verify()
        except ChecksumMismatchError:
            assert not reseal
        with contextlib.suppress(StoreFormatError):  # a moved metadata section may not be JSON
            assert isinstance(store.metadata, dict)


def test_deeply_nested_metadata_is_a_format_error(tmp_path: Path) -> None:
    # Found by fuzz/fuzz_blob.py: json.loads raised RecursionError through Store.metadata.
    path = tmp_path / "nested.smst"
    w = smstore._core.Writer(str(path), False)
    w.append(b"x")
    w.finish("[" * 200_000 + "]" * 200_000)
    with smstore.Store(path) as s, pytest.raises(StoreFormatError, match="corrupt metadata block"):
        _ = s.metadata


# ----------------------------------------------------------------------------- one header parser


def _header_faults(tmp_path: Path, blob: bytes) -> dict[str, Path]:
    """Files whose header (or kind of file) is at fault, one per fault the core words."""
    contents: dict[str, bytes | bytearray] = {
        "bad-magic": b"\x89SMST\r\n\x1b" + blob[8:],
        "empty": b"",
        "short-blob": blob[:100],
        "version": tl.reseal(tl.set_field(blob, "version", 2)),
        "flags": tl.reseal(tl.set_field(blob, "flags", 1)),
        "algo": tl.reseal(tl.set_field(blob, "checksum_algo", 7)),
        "truncated": blob[:-3],
        "longer": blob + b"\0",
        "meta-outside": tl.reseal(tl.set_field(blob, "meta_offset", len(blob) + 8)),
    }
    paths = {}
    for name, content in contents.items():
        paths[name] = tmp_path / f"{name}.smst"
        paths[name].write_bytes(content)
    paths["fifo"] = tmp_path / "fifo.smst"
    os.mkfifo(paths["fifo"])
    paths["directory"] = tmp_path / "dir.smst"
    paths["directory"].mkdir()
    return paths


def _error(call: Any) -> tuple[type[BaseException], str]:
    with pytest.raises(StoreError) as ei:
        call()
    return type(ei.value), str(ei.value)


def test_one_header_parser_one_wording(tmp_path: Path, awkward_blob: Path) -> None:
    """A bad header gives the same class and message through the reader, the core's read_header
    (path and fd), a shard's description for a manifest, and join: one parser, in C++."""
    from smstore import _core
    from smstore.format.manifest import describe_shard

    for name, path in _header_faults(tmp_path, awkward_blob.read_bytes()).items():
        p = os.fspath(path)

        def by_fd(p: str = p) -> None:
            fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
            try:
                _core.read_header_fd(fd, p)
            finally:
                os.close(fd)

        want = _error(lambda p=p: smstore.Store(p))  # type: ignore[misc]
        assert want[1].startswith(f"{p}: "), want
        assert issubclass(want[0], StoreFormatError), (name, want)
        got = {
            "read_header": _error(lambda p=p: _core.read_header(p)),  # type: ignore[misc]
            "read_header_fd": _error(by_fd),
            "describe_shard": _error(lambda p=p: describe_shard(p)),  # type: ignore[misc]
            "join": _error(lambda p=p: smstore.join([p], tmp_path / "m.json")),  # type: ignore[misc]
        }
        assert got == dict.fromkeys(got, want), name
    assert not (tmp_path / "m.json").exists()


def test_read_header_fields(awkward_blob: Path, awkward_records: list[bytes]) -> None:
    """read_header gives the header's fields as docs/format.md lays them out (an independent parse)."""
    from smstore import _core

    blob = awkward_blob.read_bytes()
    want = tl.parse_header(blob)
    h = _core.read_header(os.fspath(awkward_blob))
    assert _core.BLOB_MAGIC == tl.MAGIC
    assert h.version == want["version"] == 1
    assert h.record_count == len(awkward_records)
    assert h.data_size == len(b"".join(awkward_records))
    for field in ("file_size", "data_offset", "index_offset", "index_size", "meta_offset", "meta_size"):
        assert getattr(h, field) == want[field], field
    assert h.checksum == f"{want['checksum']:016x}" == smstore.Store(awkward_blob).checksum
    with pytest.raises(TypeError):
        _core.BlobHeader()


def test_header_from_bytes_one_wording(tmp_path: Path, awkward_blob: Path) -> None:
    """A header read as bytes (a ranged GET of an object) is checked by the same parser, in the same
    words, as the file it came from."""
    from smstore import _core

    for name, path in _header_faults(tmp_path, awkward_blob.read_bytes()).items():
        if not path.is_file():
            continue
        p = os.fspath(path)
        content = path.read_bytes()
        want = _error(lambda p=p: _core.read_header(p))  # type: ignore[misc]
        got = _error(lambda p=p, c=content: _core.parse_header(c[: _core.BLOB_HEADER_SIZE], p, len(c)))  # type: ignore[misc]
        assert got == want, name
    blob = awkward_blob.read_bytes()
    h = _core.parse_header(blob[: _core.BLOB_HEADER_SIZE], "x")  # the size the header records
    assert repr(h) == repr(_core.read_header(os.fspath(awkward_blob)))
    assert _core.parse_header(memoryview(blob)[:200], "x").file_size == len(blob)  # the fields' bytes suffice
    for cut, cls, words in [
        (b"", StoreFormatError, "x: not an smstore blob (empty header)"),
        (blob[:5], StoreFormatError, "x: not an smstore blob (bad magic bytes)"),
        (blob[:50], StoreTruncatedError, "x: truncated: the header could not be read in full"),
    ]:
        with pytest.raises(cls) as ei:
            _core.parse_header(cut, "x")
        assert str(ei.value) == words
    huge = tl.set_field(blob[:4096], "file_size", 2**63)
    with pytest.raises(
        StoreFormatError, match=r"^x: not an smstore blob \(a header claiming 9223372036854775808 bytes\)$"
    ):
        _core.parse_header(huge, "x")
    small = tl.set_field(blob[:4096], "file_size", 100)
    with pytest.raises(
        StoreTruncatedError, match=r"^x: truncated: file is 100 bytes, shorter than the 4096-byte header$"
    ):
        _core.parse_header(small, "x")


def test_header_from_random_bytes_raises_or_parses() -> None:
    """Bounded fuzz: random, mutated and truncated header bytes give a header or a StoreError, never a crash."""
    from smstore import _core

    rng = random.Random(37)
    base = bytearray(4096)
    base[:8] = tl.MAGIC
    for name, value in (
        ("version", 1),
        ("header_size", 4096),
        ("file_size", 8192),
        ("data_offset", 4096),
        ("data_size", 8),
        ("index_offset", 4104),
        ("index_size", 16),
        ("record_count", 1),
        ("meta_offset", 4120),
        ("meta_size", 2),
        ("checksum_algo", 1),
    ):
        base = tl.set_field(base, name, value)
    assert _core.parse_header(base, "base").record_count == 1
    parsed = 0
    faults: list[str] = []
    for _ in range(3000):
        data = bytearray(base)
        for _flip in range(rng.randrange(4)):
            at = rng.randrange(104)
            data[at] = rng.randrange(256)
        if rng.random() < 0.2:
            data = bytearray(rng.randbytes(rng.randrange(200)))
        data = data[: rng.choice([len(data), rng.randrange(len(data) + 1)])]
        size = rng.choice([None, rng.randrange(1 << 14), rng.randrange(1 << 64)])
        try:
            h = _core.parse_header(bytes(data), "fuzz", size)
        except StoreError as e:
            faults.append(str(e))
            continue
        parsed += 1
        assert h.data_offset + h.data_size <= h.file_size
        assert h.index_size == 8 * (h.record_count + 1)
        assert h.file_size == (size if size is not None else h.file_size) < 2**63
    assert parsed  # the fuzz reached past the first checks
    assert faults
    assert all(f.startswith("fuzz: ") for f in faults), faults


def test_read_tail_gives_the_checked_index_and_metadata(awkward_blob: Path) -> None:
    from smstore import _core

    blob = awkward_blob.read_bytes()
    h = _core.parse_header(blob[:4096], "t")
    start, end = h.tail_range
    assert end == len(blob)
    offsets, meta = _core.read_tail(h, blob[start:end], "t")
    store = smstore.Store(awkward_blob)
    assert offsets.dtype.name == "int64"
    assert list(offsets) == list(store.offsets)
    assert meta == store.metadata_bytes
    with pytest.raises(StoreTruncatedError, match=r"^t: its index and metadata are"):
        _core.read_tail(h, blob[start : end - 1], "t")
    bad = bytearray(blob[start:end])
    bad[8:16] = (h.data_size + 1).to_bytes(8, "little")  # record 0 ends past the data
    with pytest.raises(StoreFormatError, match=r"^t: corrupt index"):
        _core.read_tail(h, bytes(bad), "t")


def test_blob_size_is_the_writers_layout(make_blob) -> None:
    from smstore import _core

    for records in ([], [b"a"], [b"abc", b"", b"defgh"], [b"x" * 8]):
        path = make_blob(records, metadata={"k": "v"})
        h = _core.read_header(os.fspath(path))
        assert _core.blob_size(len(records), h.data_size, h.meta_size) == path.stat().st_size == h.file_size


def test_file_hasher_keeps_the_header_for_last(awkward_blob: Path) -> None:
    from smstore import _core

    blob = awkward_blob.read_bytes()
    want = smstore.Store(awkward_blob).checksum
    rng = random.Random(5)
    hasher = _core.FileHasher()
    at = 0
    while at < len(blob):  # pieces that start and end anywhere, some across the header's end
        n = rng.randrange(1, 3000)
        hasher.update(blob[at : at + n])
        at += n
    assert hasher.fed == len(blob)
    assert hasher.finish("f") == (want, want)
    with pytest.raises(smstore.StoreClosedError):
        hasher.finish("f")
    short = _core.FileHasher()
    short.update(blob[:100])
    with pytest.raises(
        StoreTruncatedError, match=r"^f: truncated: 100 bytes, shorter than the 4096-byte header$"
    ):
        short.finish("f")
