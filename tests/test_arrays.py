"""Array records: pack_arrays, `smstore pack --format npy-lines`, and zero-copy numpy/torch decoding."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import smstore
from smstore import PackInputError, StoreFormatError
from smstore.write.pack import build_metadata

SMSTORE = [sys.executable, "-m", "smstore"]


def record_address(store: smstore.Store, i: int) -> int:
    """Where record i lives in the mapping (read through numpy, no copy)."""
    return (
        int(np.frombuffer(store[i], dtype=np.uint8).ctypes.data)
        if store.offsets[i + 1] > store.offsets[i]
        else -1
    )


def mapping_range(store: smstore.Store) -> tuple[int, int]:
    first = next(i for i in range(len(store)) if store.offsets[i + 1] > store.offsets[i])
    base = record_address(store, first) - int(store.offsets[first])
    return base, base + store.nbytes


@pytest.mark.parametrize("dtype", ["uint16", "int32", "int64", "float32", "uint8"])
def test_pack_arrays_round_trip(tmp_path: Path, dtype: str) -> None:
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 100, size=n).astype(dtype) for n in (5, 0, 1, 300, 7)]
    path = tmp_path / "a.smst"
    assert smstore.pack_arrays(arrays, path) == len(arrays)
    with smstore.open(path) as store:
        assert store.encoding == "npy:" + np.dtype(dtype).str
        for i, a in enumerate(arrays):
            assert bytes(store[i]) == a.tobytes()


def test_pack_arrays_casts_when_values_fit(tmp_path: Path) -> None:
    path = tmp_path / "a.smst"
    smstore.pack_arrays([np.array([0, 65535], dtype=np.int64), [1, 2, 3], range(4)], path, dtype=np.uint16)
    ds = smstore.SharedStoreDataset(path, decode="numpy")
    assert [ds[i].tolist() for i in range(3)] == [[0, 65535], [1, 2, 3], [0, 1, 2, 3]]
    assert ds[0].dtype == np.uint16


@pytest.mark.parametrize(
    ("arrays", "dtype", "match"),
    [
        (
            [[1, 2], np.array([70000])],
            "uint16",
            r"record 1: value 70000 at position 0 does not fit in uint16",
        ),
        ([[1, 2], [-1]], "uint16", r"record 1: value -1"),
        ([np.zeros((2, 2))], "float64", r"record 0: expected a 1-D array, got shape \(2, 2\)"),
        ([np.int64(3)], "int64", r"record 0: expected a 1-D array, got shape \(\)"),
        ([[1.5]], "int32", r"record 0: cannot store float64 values as int32"),
        ([["a", "b"]], "int32", r"cannot store <U1 values"),
        ([[1]], "object", r"plain fixed-size numeric dtype"),
        ([], None, r"needs dtype="),
    ],
)
def test_pack_arrays_rejects_bad_input(
    tmp_path: Path, arrays: list[object], dtype: str | None, match: str
) -> None:
    path = tmp_path / "a.smst"
    path.write_bytes(b"previous")
    with pytest.raises(PackInputError, match=match):
        smstore.pack_arrays(arrays, path, dtype=dtype)  # type: ignore[arg-type]
    assert path.read_bytes() == b"previous"  # atomic: nothing replaced on failure


@pytest.mark.parametrize(
    ("dtype", "values"),
    [
        ("uint8", [0, 255]),
        ("int8", [-128, 127, -0, +5]),
        ("uint16", [0, 65535, 17]),
        ("int16", [-32768, 32767]),
        ("uint32", [0, 2**32 - 1]),
        ("int32", [-(2**31), 2**31 - 1]),
        ("uint64", [0, 2**64 - 1]),
        ("int64", [-(2**63), 2**63 - 1]),
    ],
)
def test_npy_lines_dtype_bounds(tmp_path: Path, dtype: str, values: list[int]) -> None:
    src = tmp_path / "t.txt"
    src.write_text(" ".join(f"+{v}" if v == 5 else str(v) for v in values) + "\n")
    out = tmp_path / "t.smst"
    stats = smstore.pack_npy_lines([src], out, dtype=dtype)
    assert stats.records == 1
    with smstore.open(out) as store:
        assert store.encoding == "npy:" + np.dtype(dtype).str
        assert np.frombuffer(store[0], dtype=dtype).tolist() == values


def test_npy_lines_layout(tmp_path: Path) -> None:
    a = tmp_path / "a.txt"
    b = tmp_path / "b.txt"
    a.write_bytes(b"1 2 3\n\n \t 65535\t0 \r\n")
    b.write_bytes(b"  4   5\n7")  # no final newline: still a record
    out = tmp_path / "t.smst"
    stats = smstore.pack_npy_lines([a, b], out)
    assert stats.records == 5
    assert stats.input_bytes == a.stat().st_size + b.stat().st_size
    ds = smstore.SharedStoreDataset(out, decode="numpy")
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 3], [], [65535, 0], [4, 5], [7]]
    assert all(ds[i].dtype == np.uint16 for i in range(len(ds)))


def test_npy_lines_line_longer_than_the_read_buffer(tmp_path: Path) -> None:
    values = np.arange(1_200_000, dtype=np.int64) * 7  # ~9 MiB of text on one line
    src = tmp_path / "long.txt"
    src.write_text("5\n" + " ".join(map(str, values.tolist())) + "\n6 7\n")
    out = tmp_path / "long.smst"
    smstore.pack_npy_lines([src], out, dtype="int64")
    with smstore.open(out) as store:
        assert len(store) == 3
        assert np.array_equal(np.frombuffer(store[1], dtype=np.int64), values)
        assert np.frombuffer(store[2], dtype=np.int64).tolist() == [6, 7]


@pytest.mark.parametrize(
    ("text", "dtype", "match"),
    [
        (b"1 2\n3 x4 5\n", "uint16", r"t\.txt:2: column 3: bad token 'x4': not an integer"),
        (
            b"1 2\n3 65536\n",
            "uint16",
            r"t\.txt:2: column 3: value 65536 out of range for uint16 \[0, 65535\]",
        ),
        (b"-1\n", "uint8", r"t\.txt:1: column 1: value -1 out of range for uint8"),
        (b"128\n", "int8", r"value 128 out of range for int8 \[-128, 127\]"),
        (b"99999999999999999999999\n", "int64", r"out of range for int64"),
        (b"1\n2\n1.5\n", "int32", r"t\.txt:3: column 1: bad token '1\.5'"),
        (b"- 3\n", "int32", r"t\.txt:1: column 1: bad token '-'"),
        (b"1,2\n", "int32", r"bad token '1,2'"),
        (b"3\x00\n", "int32", r"bad token '3\?'"),
    ],
)
def test_npy_lines_reports_file_line_and_column(tmp_path: Path, text: bytes, dtype: str, match: str) -> None:
    src = tmp_path / "t.txt"
    src.write_bytes(text)
    out = tmp_path / "t.smst"
    with pytest.raises(PackInputError, match=match):
        smstore.pack_npy_lines([src], out, dtype=dtype)
    assert not out.exists()


@pytest.mark.parametrize("dtype", ["float32", "U4", "bool"])
def test_npy_lines_needs_an_integer_dtype(tmp_path: Path, dtype: str) -> None:
    src = tmp_path / "t.txt"
    src.write_text("1\n")
    with pytest.raises(PackInputError, match=r"integers: dtype must be int8"):
        smstore.pack_npy_lines([src], tmp_path / "t.smst", dtype=dtype)


def test_npy_lines_missing_input(tmp_path: Path) -> None:
    with pytest.raises(smstore.StoreNotFoundError, match=r"nope\.txt"):
        smstore.pack_npy_lines([tmp_path / "nope.txt"], tmp_path / "t.smst")


def test_cli_pack_npy_lines(tmp_path: Path) -> None:
    out = tmp_path / "t.smst"
    r = subprocess.run(
        [*SMSTORE, "pack", "--format", "npy-lines", "--dtype", "int32", "-", "-o", str(out), "-q"],
        input=b"10 -20\n30\n",
        capture_output=True,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    with smstore.open(out) as store:
        assert store.encoding == "npy:<i4"
        assert np.frombuffer(store[0], dtype=np.int32).tolist() == [10, -20]
    r = subprocess.run(
        [*SMSTORE, "pack", "--format", "npy-lines", "-", "-o", str(tmp_path / "bad.smst")],
        input=b"1\n2 y\n",
        capture_output=True,
        check=False,
    )
    assert r.returncode == 1
    assert b"<stdin>:2: column 3: bad token 'y'" in r.stderr
    assert not (tmp_path / "bad.smst").exists()
    r = subprocess.run(
        [*SMSTORE, "pack", "--dtype", "int32", "-", "-o", str(tmp_path / "x.smst")],
        input=b"1\n",
        capture_output=True,
        check=False,
    )
    assert r.returncode == 2
    assert b"--dtype applies to --format npy-lines only" in r.stderr


@pytest.fixture
def tokens(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.smst"
    smstore.pack_arrays([np.arange(n, dtype=np.uint16) + n for n in (3, 0, 10, 1)], path)
    return path


def test_decode_numpy_is_zero_copy_and_read_only(tokens: Path) -> None:
    ds = smstore.SharedStoreDataset(tokens, decode="numpy")
    store = ds.store
    lo, hi = mapping_range(store)
    for i in (0, 2, 3):
        a = ds[i]
        assert a.tolist() == (np.arange(len(a)) + len(a)).tolist()
        assert np.shares_memory(a, np.frombuffer(store[i], dtype=np.uint8))
        assert lo <= a.ctypes.data < hi
        assert not a.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            a[0] = 1
    assert ds[1].size == 0


def test_decode_torch_is_zero_copy(tokens: Path) -> None:
    torch = pytest.importorskip("torch")
    ds = smstore.SharedStoreDataset(tokens, decode="torch")
    store = ds.store
    lo, hi = mapping_range(store)
    for i in (0, 2, 3):
        t = ds[i]
        assert isinstance(t, torch.Tensor)
        assert t.dtype == torch.uint16
        assert t.tolist() == (np.arange(t.numel()) + t.numel()).tolist()
        assert t.data_ptr() == record_address(store, i)
        assert lo <= t.data_ptr() < hi
    empty = ds[1]
    assert empty.numel() == 0
    assert empty.dtype == torch.uint16
    batch = ds.__getitems__([3, 0])
    assert [t.tolist() for t in batch] == [[1], [3, 4, 5]]


@pytest.mark.parametrize(
    ("dtype", "torch_name"), [("int32", "int32"), ("float32", "float32"), ("int64", "int64")]
)
def test_decode_torch_dtypes(tmp_path: Path, dtype: str, torch_name: str) -> None:
    torch = pytest.importorskip("torch")
    path = tmp_path / "a.smst"
    smstore.pack_arrays([np.arange(4, dtype=dtype)], path)
    t = smstore.SharedStoreDataset(path, decode="torch")[0]
    assert t.dtype == getattr(torch, torch_name)
    assert t.tolist() == [0, 1, 2, 3]


def test_decode_torch_needs_array_records(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    path = tmp_path / "lines.smst"
    smstore.pack([b"a"], path)
    with pytest.raises(StoreFormatError, match="not npy:<dtype>"):
        smstore.SharedStoreDataset(path, decode="torch")


def test_writing_through_a_torch_record_is_a_segfault(tokens: Path) -> None:
    """The mapping is PROT_READ: a write through the tensor cannot corrupt the data; it kills the writer."""
    pytest.importorskip("torch")
    code = textwrap.dedent(
        f"""
        import smstore
        ds = smstore.SharedStoreDataset({os.fspath(tokens)!r}, decode="torch")
        t = ds[0]
        print("read", t.tolist(), flush=True)
        t[0] = 7
        print("wrote", flush=True)
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        check=False,
        timeout=120,
        cwd=tokens.parent,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)),  # no core file
    )
    assert r.stdout.startswith(b"read [3, 4, 5]")
    assert b"wrote" not in r.stdout
    assert r.returncode == -signal.SIGSEGV
    with smstore.open(tokens) as store:
        assert np.frombuffer(store[0], dtype=np.uint16).tolist() == [3, 4, 5]


@pytest.fixture
def ragged_u2(tmp_path: Path) -> Path:
    """An npy:<u2 blob whose records are 3 bytes: what the writer refuses today, written the old way."""
    path = tmp_path / "ragged.smst"
    w = smstore._core.Writer(str(path), False)
    w.extend([b"\x01\x00\x02", b"\x03\x00\x04"])
    w.finish(build_metadata("npy:<u2"))
    return path


@pytest.mark.parametrize("decode", ["numpy", "torch"])
def test_decoding_a_record_of_partial_items_is_a_format_error(ragged_u2: Path, decode: str) -> None:
    if decode == "torch":
        pytest.importorskip("torch")
    ds = smstore.SharedStoreDataset(ragged_u2, decode=decode)
    with pytest.raises(
        StoreFormatError, match=r"ragged\.smst: a record of 3 bytes is not a whole number of <u2"
    ):
        ds[0]


def test_npy_lines_empty_first_line(tmp_path: Path) -> None:
    # Found by fuzz/fuzz_npy_lines.py under UBSan: an empty line flushed a null vector into memcpy.
    src = tmp_path / "in.txt"
    src.write_bytes(b"\n1 2\n\n3\n")
    out = tmp_path / "o.smst"
    smstore.pack_npy_lines([src], out, dtype="int32")
    with smstore.open(out) as s:
        assert [np.frombuffer(s[i], dtype="<i4").tolist() for i in range(len(s))] == [[], [1, 2], [], [3]]
