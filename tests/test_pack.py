"""Packing: line semantics byte for byte, jsonl validation, the Python API, and atomic publication."""

from __future__ import annotations

import json
import os
import random
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import smstore_testlib as tl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import smstore
from smstore import PackInputError, StoreError, StoreIOError, StoreNotFoundError

MiB = 1 << 20
BUF = 4 * MiB  # the packer's read buffer (csrc/writer.cpp kBufferSize)


def pack_bytes(tmp_path: Path, *datas: bytes, fmt: str = "lines") -> list[bytes]:
    inputs = []
    for k, d in enumerate(datas):
        p = tmp_path / f"in{k}.txt"
        p.write_bytes(d)
        inputs.append(p)
    out = tmp_path / "out.smst"
    stats = smstore.pack_files(inputs, out, format=fmt, progress=False, durable=False)
    recs = tl.read_records(out, verify=True)
    assert stats.records == len(recs)
    assert stats.input_bytes == sum(map(len, datas))
    assert stats.data_bytes == sum(map(len, recs))
    return recs


# ----------------------------------------------------------------------------- line semantics


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"", []),
        (b"\n", [b""]),
        (b"\n\n", [b"", b""]),
        (b"a", [b"a"]),
        (b"a\n", [b"a"]),
        (b"a\nb", [b"a", b"b"]),
        (b"a\r\nb\r\n", [b"a\r", b"b\r"]),
        (b"\r", [b"\r"]),
        (b"\r\n\r", [b"\r", b"\r"]),
        (b"x\x00y\n\x00\n", [b"x\x00y", b"\x00"]),
        (b"\xff\xfe\n\xc3\x28\n\xed\xa0\x80", [b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80"]),
        (b"\n\nlast\n\n", [b"", b"", b"last", b""]),
        (b"  \t \n", [b"  \t "]),
    ],
)
def test_line_semantics(tmp_path: Path, data: bytes, expected: list[bytes]) -> None:
    assert tl.lines_oracle(data) == expected  # the oracle used below agrees with the hand-written cases
    assert pack_bytes(tmp_path, data) == expected


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    datas=st.lists(
        st.lists(st.sampled_from([b"a", b"\n", b"\r", b"\x00", b"\xff", b"\xc3", b"\xa9", b"xyz"])).map(
            b"".join
        ),
        min_size=1,
        max_size=4,
    )
)
def test_lines_property(tmp_path: Path, datas: list[bytes]) -> None:
    assert pack_bytes(tmp_path, *datas) == tl.lines_oracle_files(datas)


def test_long_lines_spanning_the_read_buffer(tmp_path: Path) -> None:
    rng = random.Random(5)
    big = rng.randbytes(9 * MiB).replace(b"\n", b"\r")
    data = (
        b"first\n"
        + big
        + b"\n"
        + b"y" * (BUF - 3 - len(b"first\n") - len(big) % BUF)  # ends just before a buffer boundary
        + b"\nstraddle\n"
        + b"z" * (BUF - 1)
        + b"\n"
        + b"tail-without-newline"
    )
    recs = pack_bytes(tmp_path, data)
    assert recs == tl.lines_oracle(data)
    assert recs[1] == big
    assert recs[-1] == b"tail-without-newline"


@pytest.mark.parametrize("nl_at", [BUF - 1, BUF, BUF + 1, 2 * BUF - 1])
def test_newline_at_buffer_edges(tmp_path: Path, nl_at: int) -> None:
    data = b"q" * nl_at + b"\n" + b"r" * 10 + b"\n\n"
    assert pack_bytes(tmp_path, data) == [b"q" * nl_at, b"r" * 10, b""]


def test_many_inputs_concatenate_in_order(tmp_path: Path) -> None:
    datas = [b"a\nb", b"", b"\n", b"c\nd\n", b"e", b"\r\n\x00", b"f" * (BUF + 7), b"g\n"]
    recs = pack_bytes(tmp_path, *datas)
    # Each file's unterminated last line is its own record: "b" and "c" never merge.
    assert recs == [b"a", b"b", b"", b"c", b"d", b"e", b"\r", b"\x00", b"f" * (BUF + 7), b"g"]


def test_stdin_input(tmp_path: Path) -> None:
    data = b"one\r\n\x00two\n\nthree"
    before = tmp_path / "before.txt"
    before.write_bytes(b"zero\n")
    out = tmp_path / "stdin.smst"
    r = subprocess.run(
        [sys.executable, "-m", "smstore", "pack", str(before), "-", "-o", str(out), "-q"],
        input=data,
        capture_output=True,
        timeout=60,
        check=False,
        cwd=tl.SAFE_CWD,
    )
    assert r.returncode == 0, r.stderr
    assert tl.read_records(out, verify=True) == [b"zero", b"one\r", b"\x00two", b"", b"three"]
    with smstore.open(out) as s:
        assert s.metadata["source"] == [str(before), "-"]
        assert s.encoding == "lines"


def test_pack_files_metadata(tmp_path: Path) -> None:
    src = tmp_path / "x.txt"
    src.write_bytes(b"a\nb\n")
    out = tmp_path / "x.smst"
    smstore.pack_files([src], out, metadata={"lang": "en"}, progress=False, durable=False)
    with smstore.open(out) as s:
        assert s.metadata["user"] == {"lang": "en"}
        assert s.metadata["source"] == [str(src.resolve())]
        assert s.encoding == "lines"


def test_missing_input_leaves_no_output(tmp_path: Path) -> None:
    good = tmp_path / "good.txt"
    good.write_bytes(b"a\n")
    out = tmp_path / "out.smst"
    with pytest.raises(StoreNotFoundError) as ei:
        smstore.pack_files([good, tmp_path / "nope.txt"], out, progress=False)
    assert "nope.txt" in str(ei.value)
    assert not out.exists()
    assert tl.stray_temps(tmp_path) == []


def test_directory_input_and_output_are_refused(tmp_path: Path) -> None:
    src = tmp_path / "x.txt"
    src.write_bytes(b"a\n")
    with pytest.raises(StoreIOError, match="directory"):
        smstore.pack_files([tmp_path], tmp_path / "o.smst", progress=False)
    with pytest.raises(StoreIOError, match="directory"):
        smstore.pack([b"a"], tmp_path)  # a blob writer; pack_files makes a dataset of a directory
    with pytest.raises(StoreIOError):
        smstore.pack_files([src], tmp_path / "no" / "such" / "dir.smst", progress=False)
    assert not (tmp_path / "o.smst").exists()
    assert tl.stray_temps(tmp_path) == []


# ----------------------------------------------------------------------------- jsonl

VALID_JSON_LINES = [
    b'{"a": 1, "b": [true, false, null], "c": {"d": "e"}}',
    b"[]",
    b"{}",
    b"0",
    b"-1.5e+10",
    b'"caf\\u00e9 \\n \\" \\\\ \\/"',
    '"h\u00e9llo \u6f22\u5b57 \U0001f600"'.encode(),
    b'  {"spaced" : [ 1 , 2 ] }  ',
    b'{"trailing cr": 1}\r',
    b"true",
    b"null",
]


def test_jsonl_valid_lines(tmp_path: Path) -> None:
    data = b"\n".join(VALID_JSON_LINES) + b"\n"
    recs = pack_bytes(tmp_path, data, fmt="jsonl")
    assert recs == VALID_JSON_LINES
    for r in recs:
        json.loads(r)
    with smstore.open(tmp_path / "out.smst") as s:
        assert s.encoding == "jsonl"


def test_jsonl_unterminated_last_line_is_validated(tmp_path: Path) -> None:
    assert pack_bytes(tmp_path, b'{"a": 1}\n[2]', fmt="jsonl") == [b'{"a": 1}', b"[2]"]
    with pytest.raises(PackInputError, match=r"in0\.txt:2\b"):
        pack_bytes(tmp_path, b'{"a": 1}\n[2', fmt="jsonl")


@pytest.mark.parametrize(
    ("lines", "bad_line"),
    [
        ([b"{}", b"{}", b"{bad}", b"{}"], 3),
        ([b"{bad"], 1),
        ([b"{}", b""], 2),  # an empty line is not a JSON value
        ([b"{}", b"[1, 2"], 2),
        ([b"{}", b"1 2"], 2),
        ([b"{}", b'"\xff"'], 2),  # invalid UTF-8 inside a string
        ([b"{}", b"{}", b"{}", b"nulL"], 4),
    ],
)
def test_jsonl_bad_line_reported_with_file_and_line(
    tmp_path: Path, lines: list[bytes], bad_line: int
) -> None:
    src = tmp_path / "data.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "out.smst"
    out.write_bytes(b"previous")
    with pytest.raises(PackInputError) as ei:
        smstore.pack_files([src], out, format="jsonl", progress=False)
    assert f"{src}:{bad_line}:" in str(ei.value)
    assert out.read_bytes() == b"previous"
    assert tl.stray_temps(tmp_path) == []


def test_jsonl_line_numbers_restart_per_file(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_bytes(b"1\n2\n3\n")
    b.write_bytes(b"4\nnope\n")
    with pytest.raises(PackInputError, match=rf"{b}:2:"):
        smstore.pack_files([a, b], tmp_path / "o.smst", format="jsonl", progress=False)


def test_jsonl_lines_spanning_read_buffers(tmp_path: Path) -> None:
    big = json.dumps({"k": "v" * (BUF + 100), "arr": list(range(1000))}).encode()
    huge = json.dumps(["w" * 1000] * (2 * BUF // 1000)).encode()  # spans three reads
    lines = [b"{}", big, b"[1]", huge, b'"end"']
    assert pack_bytes(tmp_path, b"\n".join(lines), fmt="jsonl") == lines
    # The fault sits after the first buffer boundary of the line.
    bad = big[:-1] + b"," + b"}"
    with pytest.raises(PackInputError, match=r"in0\.txt:2:"):
        pack_bytes(tmp_path, b"\n".join([b"{}", bad, b"[1]"]), fmt="jsonl")
    with pytest.raises(PackInputError, match=r"in0\.txt:3:"):
        pack_bytes(tmp_path, b"\n".join([b"{}", big, huge[:-1]]), fmt="jsonl")


def test_unknown_format(tmp_path: Path) -> None:
    src = tmp_path / "x.txt"
    src.write_bytes(b"a\n")
    with pytest.raises(ValueError, match="format"):
        smstore.pack_files([src], tmp_path / "o.smst", format="csv", progress=False)
    assert not (tmp_path / "o.smst").exists()


# ----------------------------------------------------------------------------- Python API


def test_pack_accepts_bytes_str_buffers_and_arrays(tmp_path: Path) -> None:
    arr = np.arange(10, dtype="<i4")
    f64 = np.linspace(0, 1, 7)
    records = [
        b"bytes\x00\r",
        "str \u00e9\u6f22 \U0001f600",
        "",
        bytearray(b"\xffbytearray"),
        memoryview(b"0123456789")[2:5],
        arr,
        f64,
        np.zeros((3, 4), dtype=np.uint8),
        memoryview(arr).cast("B"),
    ]
    out = tmp_path / "api.smst"
    assert smstore.pack(records, out, durable=False) == len(records)
    assert tl.read_records(out, verify=True) == [
        b"bytes\x00\r",
        "str \u00e9\u6f22 \U0001f600".encode(),
        b"",
        b"\xffbytearray",
        b"234",
        arr.tobytes(),
        f64.tobytes(),
        bytes(12),
        arr.tobytes(),
    ]


def test_pack_generator_and_records_with_newlines(tmp_path: Path) -> None:
    recs = [b"has\nnewline", b"\n", b"\n\n"] + [str(i).encode() for i in range(1000)]
    out = tmp_path / "gen.smst"
    smstore.pack((r for r in recs), out, durable=False)
    assert tl.read_records(out, verify=True) == recs


def test_writer_append_extend(tmp_path: Path) -> None:
    out = tmp_path / "w.smst"
    with smstore.Writer(out, encoding="jsonl", metadata={"m": 1}, durable=False) as w:
        w.append(b"1")
        assert w.extend(["2", b"[3]"]) == 2
        w.append(memoryview(b"{}"))
        assert w.record_count == 4
        assert not out.exists()  # nothing is visible before the block ends
    assert tl.read_records(out, verify=True) == [b"1", b"2", b"[3]", b"{}"]
    with smstore.open(out) as s:
        assert s.encoding == "jsonl"
        assert s.metadata["user"] == {"m": 1}


def test_exception_inside_with_leaves_previous_file(tmp_path: Path) -> None:
    out = tmp_path / "keep.smst"
    smstore.pack([b"old"], out, durable=False)
    old = out.read_bytes()

    def fail_midway(target: Path) -> None:
        with smstore.Writer(target, durable=False) as w:
            w.extend([b"new"] * 1000)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail_midway(out)
    assert out.read_bytes() == old
    assert tl.stray_temps(tmp_path) == []

    fresh = tmp_path / "fresh.smst"
    with pytest.raises(RuntimeError, match="boom"):
        fail_midway(fresh)
    assert not fresh.exists()
    assert tl.stray_temps(tmp_path) == []


@pytest.mark.parametrize(
    "bad",
    [123, None, 1.5, np.arange(10)[::2], ["nested"], "lone surrogate \ud800"],
    ids=["int", "none", "float", "strided", "list", "surrogate"],
)
def test_bad_record_aborts_pack(tmp_path: Path, bad: object) -> None:
    out = tmp_path / "bad.smst"
    smstore.pack([b"old"], out, durable=False)
    old = out.read_bytes()
    with pytest.raises((TypeError, ValueError)):
        smstore.pack([b"a", b"b", bad], out)  # type: ignore[list-item]
    assert out.read_bytes() == old
    assert tl.stray_temps(tmp_path) == []


def test_writer_close_is_idempotent_and_abort_after_close_keeps_file(tmp_path: Path) -> None:
    out = tmp_path / "c.smst"
    w = smstore.Writer(out, durable=False)
    w.append(b"x")
    w.close()
    w.close()
    w.abort()
    assert tl.read_records(out, verify=True) == [b"x"]
    with pytest.raises(smstore.StoreClosedError, match="closed"):
        w.append(b"y")


def test_writer_abort_discards(tmp_path: Path) -> None:
    out = tmp_path / "a.smst"
    w = smstore.Writer(out, durable=False)
    w.append(b"x")
    w.abort()
    w.close()  # nothing to publish after abort
    assert not out.exists()
    assert tl.stray_temps(tmp_path) == []


def test_pack_overwrites_completed(tmp_path: Path) -> None:
    out = tmp_path / "o.smst"
    smstore.pack([b"old"], out)
    smstore.pack([b"new", b"er"], out)
    assert tl.read_records(out, verify=True) == [b"new", b"er"]
    assert tl.stray_temps(tmp_path) == []


def test_relative_output_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    smstore.pack([b"rel"], "rel.smst")
    assert tl.read_records(tmp_path / "rel.smst", verify=True) == [b"rel"]
    assert tl.stray_temps(tmp_path) == []


# ----------------------------------------------------------------------------- atomicity

_PACK_SCRIPT = """
import sys, time, smstore
print("ready", flush=True)
t0 = time.monotonic()
smstore.pack_files(sys.argv[1:-1], sys.argv[-1], progress=False)
print(time.monotonic() - t0, flush=True)
"""


@pytest.fixture(scope="module")
def big_input(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    d = tmp_path_factory.mktemp("big")
    p = d / "big.txt"
    line = b"some line of text with \r and \x00 bytes and more text to make it longer\n"
    chunk = line * (MiB // len(line))
    with open(p, "wb") as f:
        f.writelines(chunk for _ in range(48))
    return p, 48 * (MiB // len(line))


def _check_after_kill(out: Path, old: bytes, n_new: int) -> str:
    if not out.exists():
        return "absent"
    content = out.read_bytes()
    if content == old:
        return "old"
    # Only a complete, verified new blob may have replaced the old one.
    with smstore.open(out, verify=True) as s:
        assert len(s) == n_new
    return "new"


def test_sigkill_at_random_moments_never_publishes_a_partial_file(
    tmp_path: Path, big_input: tuple[Path, int]
) -> None:
    src, n = big_input
    out = tmp_path / "out.smst"
    smstore.pack([b"previous"], out)
    old = out.read_bytes()

    timing = subprocess.run(
        [sys.executable, "-c", _PACK_SCRIPT, str(src), str(tmp_path / "timing.smst")],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        cwd=tl.SAFE_CWD,
    )
    pack_seconds = float(timing.stdout.split()[1])
    (tmp_path / "timing.smst").unlink()

    rng = random.Random(11)
    # Spread over the whole pack (reading, writing, fsync, rename), plus random moments.
    fractions = [0.02, 0.3, 0.7, 0.95, 1.5] + [rng.uniform(0, 1.2) for _ in range(3)]
    outcomes = []
    for frac in fractions:
        proc = subprocess.Popen(
            [sys.executable, "-c", _PACK_SCRIPT, str(src), str(out)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=tl.SAFE_CWD,
        )
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline() == "ready\n"
            time.sleep(frac * pack_seconds)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc.stdout.close()  # type: ignore[union-attr]
        outcome = _check_after_kill(out, old, n)
        assert outcome != "absent"
        outcomes.append(outcome)
        if outcome == "new":  # put the old one back for the next round
            smstore.pack([b"previous"], out)
            old = out.read_bytes()
    assert "old" in outcomes  # at least one kill landed before publication


@pytest.mark.parametrize("fed", [0, MiB, BUF + MiB // 2])
def test_sigkill_mid_stream_keeps_previous_output(tmp_path: Path, fed: int) -> None:
    out = tmp_path / "out.smst"
    smstore.pack([b"previous"], out)
    old = out.read_bytes()
    fresh = tmp_path / "fresh.smst"
    for target in (out, fresh):
        proc = subprocess.Popen(
            [sys.executable, "-c", _PACK_SCRIPT, "-", str(target)],
            stdin=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=tl.SAFE_CWD,
        )
        try:
            assert proc.stdin is not None
            proc.stdin.write(b"line\n" * (fed // 5))
            proc.stdin.flush()
            time.sleep(0.5)
            assert proc.poll() is None  # still waiting for more input
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc.stdin.close()  # type: ignore[union-attr]
            proc.stderr.close()  # type: ignore[union-attr]
    assert out.read_bytes() == old
    assert not fresh.exists()
    # O_TMPFILE: a killed writer leaves nothing behind, not even a hidden temporary.
    assert tl.stray_temps(tmp_path) == []


_FSIZE_SCRIPT = """
import resource, signal, sys, smstore
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    if sys.argv[2] == "files":
        smstore.pack_files([sys.argv[3]], sys.argv[4], progress=False)
    else:
        smstore.pack((b"r%07d" % i for i in range(int(sys.argv[3]))), sys.argv[4])
except smstore.StoreIOError as e:
    print("StoreIOError", e.errno, e, sep="|")
except BaseException as e:
    print("OTHER", type(e).__name__, e, sep="|")
else:
    print("OK")
"""


@pytest.mark.parametrize("where", ["zero", "header", "data", "index", "last_byte"])
@pytest.mark.parametrize("mode", ["files", "api"])
def test_out_of_disk_is_a_clean_error(tmp_path: Path, where: str, mode: str) -> None:
    n = 200_000
    src = tmp_path / "src.txt"
    src.write_bytes(b"".join(b"r%07d\n" % i for i in range(n)))
    data_size = 8 * n
    full_size = 4096 + data_size + 8 * (n + 1) + 400  # metadata is a few hundred bytes
    limit = {
        "zero": 0,
        "header": 4096,
        "data": 4096 + data_size // 2,
        "index": 4096 + data_size + 8 * n // 2,
        "last_byte": None,
    }[where]
    if limit is None:  # exactly one byte short of the real size
        ref = tmp_path / "ref.smst"
        if mode == "files":
            smstore.pack_files([src], ref, progress=False)
        else:  # same records, same metadata size as the child's smstore.pack()
            smstore.pack((b"r%07d" % i for i in range(n)), ref)
        limit = ref.stat().st_size - 1
        ref.unlink()
    assert limit < full_size
    out = tmp_path / "out.smst"
    smstore.pack([b"previous"], out)
    old = out.read_bytes()

    def run_with_fsize_limit(target: Path) -> subprocess.CompletedProcess[str]:
        source = str(src) if mode == "files" else str(n)
        return subprocess.run(
            [sys.executable, "-c", _FSIZE_SCRIPT, str(limit), mode, source, str(target)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=tl.SAFE_CWD,
        )

    r = run_with_fsize_limit(out)
    assert r.returncode == 0, r.stderr
    kind, *rest = r.stdout.strip().split("|")
    assert kind == "StoreIOError", r.stdout
    assert int(rest[0]) == 27  # EFBIG
    assert str(out) in rest[1]
    assert out.read_bytes() == old
    assert tl.stray_temps(tmp_path) == []

    fresh = tmp_path / "fresh.smst"
    r = run_with_fsize_limit(fresh)
    assert r.stdout.startswith("StoreIOError|"), r.stdout + r.stderr
    assert not fresh.exists()
    assert tl.stray_temps(tmp_path) == []


def test_store_error_hierarchy() -> None:
    assert issubclass(PackInputError, StoreError)
    assert issubclass(PackInputError, ValueError)
    assert issubclass(StoreIOError, OSError)
    assert issubclass(StoreNotFoundError, FileNotFoundError)
    for name in smstore.errors.__all__:
        assert issubclass(getattr(smstore, name), StoreError)


# Packs argv[1] into argv[2] and prints how far its peak resident memory rose above the start (KiB).
# One process and no shared pages, so the kernel's high-water mark (VmHWM) is the right measure.
PACK_PEAK_GROWTH = (
    "import sys, smstore\n"
    "def kib(key):\n"
    "    for line in open('/proc/self/status'):\n"
    "        if line.startswith(key):\n"
    "            return int(line.split()[1])\n"
    "before = kib('VmRSS:')\n"
    "smstore.pack_files([sys.argv[1]], sys.argv[2], progress=False, durable=False)\n"
    "print(kib('VmHWM:') - before)\n"
)


def test_memory_does_not_hold_input(tmp_path: Path, big_input: tuple[Path, int]) -> None:
    """The packer streams: its peak resident memory grows by far less than the 48 MiB input.

    One process and no shared pages, so the kernel's high-water mark (VmHWM) is the right measure.
    """
    src, _ = big_input
    r = subprocess.run(
        [sys.executable, "-c", PACK_PEAK_GROWTH, str(src), str(tmp_path / "m.smst")],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        cwd=tl.SAFE_CWD,
    )
    grown_kib = int(r.stdout)
    # Offsets index: 8 bytes per line (~5 MiB here, twice that while the vector grows) plus two
    # 4 MiB buffers; a packer that held the 48 MiB input would exceed this.
    assert grown_kib < 32 * 1024, grown_kib
    (tmp_path / "m.smst").unlink()


# ----------------------------------------------------------------------------- jsonl differential


def _python_accepts(line: bytes) -> bool:
    """Python's json module as the RFC 8259 oracle (minus its NaN/Infinity extension)."""

    def reject_constant(name: str) -> object:
        raise ValueError(name)

    try:
        json.loads(line.decode("utf-8"), parse_constant=reject_constant)
    except (ValueError, RecursionError):
        return False
    return True


_JSON_TOKENS = [
    "{", "}", "[", "]", ",", ":", " ", "\t", "\r", '"', '"a"', '"k":', "\\", "\\u00e9", "\\ud800", "\\x",
    "0", "1", "-", "+", ".", "e", "E", "05", "1.5e3", "true", "tru", "null", "false", "\u00e9", "\x01", "\x7f",
]  # fmt: skip
_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    line=st.one_of(
        st.lists(st.sampled_from(_JSON_TOKENS), max_size=12).map(lambda t: "".join(t).encode()),
        _JSON_VALUES.map(lambda v: json.dumps(v, ensure_ascii=False).encode()),
        st.binary(max_size=12).filter(lambda b: b"\n" not in b),
        st.sampled_from(
            [
                b'"\xc3\xa9"',
                b'"\xed\xa0\x80"',
                b'"\xc0\xaf"',
                b'"\xf4\x90\x80\x80"',
                b'"\xe2\x82"',
                b"[" * 600,
            ]
        ),
    )
)
def test_jsonl_validation_agrees_with_python(tmp_path: Path, line: bytes) -> None:
    src = tmp_path / "one.jsonl"
    src.write_bytes(line + b"\n")
    out = tmp_path / "one.smst"
    message = ""
    try:
        smstore.pack_files([src], out, format="jsonl", progress=False, durable=False)
    except PackInputError as e:
        message = str(e)
    accepted = not message
    assert accepted == _python_accepts(line), (line, message)
    if message:
        assert f"{src}:1:" in message
    if accepted:
        assert tl.read_records(out, verify=True) == [line]


def test_writer_refuses_a_second_thread_while_packing(tmp_path: Path) -> None:
    # pack_lines runs without the GIL; an abort() from another thread then would close the file
    # descriptor under it. Block the pack on a FIFO and try.
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    out = tmp_path / "out.smst"
    w = smstore._core.Writer(str(out), False)
    result: list[object] = []
    packer = threading.Thread(target=lambda: result.append(smstore._core.pack_lines(w, [str(fifo)])))
    packer.start()
    # Opening a FIFO for writing returns once the reader has opened it: the packer is then inside
    # pack_lines (marked busy before it released the GIL), blocked on its input.
    with open(fifo, "wb") as feed:
        feed.write(b"one\n")
        feed.flush()
        for call in (w.abort, lambda: w.append(b"x"), lambda: w.finish("{}")):
            with pytest.raises(ValueError, match="in use by another thread"):
                call()
        feed.write(b"two")
    packer.join(timeout=10)
    assert result == [7]
    w.finish("{}")
    assert [bytes(r) for r in smstore.open(out)] == [b"one", b"two"]


# -- issue 12: outputs that are not regular files, and the mode of a replaced file ------------------


@pytest.mark.parametrize("how", ["pack", "pack_files", "cli"])
def test_output_that_is_not_a_regular_file_is_refused(tmp_path: Path, how: str) -> None:
    # rename() would swap the FIFO (or a device, or a socket) for a regular file.
    src = tmp_path / "in.txt"
    src.write_bytes(b"a\nb\n")
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    if how == "cli":
        from smstore import cli

        assert cli.main(["pack", str(src), "-o", str(fifo), "-q", "--no-fsync"]) == 1
    else:
        calls = {
            "pack": lambda: smstore.pack([b"a"], fifo, durable=False),
            "pack_files": lambda: smstore.pack_files([src], fifo, progress=False, durable=False),
        }
        with pytest.raises(StoreIOError, match=f"{fifo}: is not a regular file"):
            calls[how]()
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert tl.stray_temps(tmp_path) == []


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o444])
@pytest.mark.parametrize("how", ["pack", "pack_files"])
def test_repack_keeps_the_mode_of_the_file_it_replaces(tmp_path: Path, mode: int, how: str) -> None:
    src = tmp_path / "in.txt"
    src.write_bytes(b"new\n")
    out = tmp_path / "out.smst"
    smstore.pack([b"old"], out, durable=False)
    os.chmod(out, mode)
    if how == "pack":
        smstore.pack([b"new"], out, durable=False)
    else:
        smstore.pack_files([src], out, progress=False, durable=False)
    assert tl.read_records(out, verify=True) == [b"new"]
    assert stat.S_IMODE(os.stat(out).st_mode) == mode


def test_new_output_follows_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        smstore.pack([b"x"], tmp_path / "new.smst", durable=False)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "new.smst").st_mode) == 0o640


# -- issue 12: a line that must be parsed whole is bounded ---------------------------------------


@pytest.mark.parametrize("limit", [1, 10, 300_000])
def test_jsonl_line_longer_than_the_limit(tmp_path: Path, limit: int) -> None:
    # 300_000 > the 256 KiB read: the line is joined from several reads before the limit hits.
    long_value = b'"' + b"x" * limit + b'"'
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"1\n" + long_value + b"\n2\n")
    out = tmp_path / "out.smst"
    with pytest.raises(PackInputError, match=f"{src}:2: line is longer than the {limit}-byte limit"):
        smstore.pack_files([src], out, format="jsonl", progress=False, max_line_bytes=limit)
    assert not out.exists()
    smstore.pack_files([src], out, format="jsonl", progress=False, max_line_bytes=limit + 2)
    assert tl.read_records(out, verify=True) == [b"1", long_value, b"2"]


def test_lines_format_has_no_line_limit(tmp_path: Path) -> None:
    src = tmp_path / "in.txt"
    src.write_bytes(b"x" * 1000 + b"\n")
    smstore.pack_files([src], tmp_path / "o.smst", progress=False, max_line_bytes=10)
    assert tl.read_records(tmp_path / "o.smst", verify=True) == [b"x" * 1000]


_ENDLESS_LINE_SCRIPT = """
import resource, sys, threading, smstore

def vm_size():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024

fifo, out, fmt = sys.argv[1:4]

def feed():
    chunk = (b"1 " if fmt == "npy-lines" else b"1") * (1 << 19)
    try:
        with open(fifo, "wb") as f:
            while True:
                f.write(chunk)
    except BrokenPipeError:
        pass

threading.Thread(target=feed, daemon=True).start()
# Room for the default 1 GiB line and little more: enough to hold the line, not to double it.
limit = vm_size() + (2 << 30) + (512 << 20)
resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
try:
    if fmt == "npy-lines":
        smstore.pack_npy_lines([fifo], out, progress=False, durable=False)
    else:
        smstore.pack_files([fifo], out, format="jsonl", progress=False, durable=False)
except BaseException as e:
    print(type(e).__name__, e, sep="|")
"""


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["npy-lines", "jsonl"])
def test_endless_line_is_a_pack_error_not_exhausted_memory(tmp_path: Path, fmt: str) -> None:
    # A line without end (packing /dev/zero, say) once grew one buffer until std::bad_alloc.
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    r = subprocess.run(
        [sys.executable, "-c", _ENDLESS_LINE_SCRIPT, str(fifo), str(tmp_path / "o.smst"), fmt],
        cwd=tl.SAFE_CWD,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    kind, message = r.stdout.strip().split("|", 1)
    assert kind == "PackInputError", r.stdout
    assert f"{fifo}:1: line is longer than the {1 << 30}-byte limit" in message
    assert smstore._core.DEFAULT_MAX_LINE_BYTES == 1 << 30


# -- issue 12: array records must hold whole items ---------------------------------------------


def test_writer_refuses_a_record_that_is_not_whole_items(tmp_path: Path) -> None:
    out = tmp_path / "u2.smst"
    with smstore.Writer(out, encoding="npy:<u2", durable=False) as w:
        w.append(b"\x01\x00\x02\x00")
        with pytest.raises(
            PackInputError, match=r"u2\.smst: record 1 is 3 bytes, not a whole number of 2-byte"
        ):
            w.append(b"abc")
        w.append(b"\x03\x00")  # the refused record left nothing behind
    assert tl.read_records(out, verify=True) == [b"\x01\x00\x02\x00", b"\x03\x00"]
    with pytest.raises(PackInputError, match="record 0 is 6 bytes"):
        smstore.pack([b"abcdef"], tmp_path / "f8.smst", encoding="npy:<f8", durable=False)
    assert not (tmp_path / "f8.smst").exists()
    with pytest.raises(PackInputError, match="npy:nonsense"):
        smstore.Writer(tmp_path / "bad.smst", encoding="npy:nonsense")


# ----------------------------------------------------------------------------- offsets index on disk

INDEX_CHUNK = 1 << 17  # offsets the writer holds in RAM before spilling (csrc/writer.hpp kIndexChunk)


@pytest.mark.parametrize("n", [INDEX_CHUNK - 1, INDEX_CHUNK, INDEX_CHUNK + 1, 3 * INDEX_CHUNK + 7])
def test_offsets_index_spilled_to_disk_is_exact(tmp_path: Path, n: int) -> None:
    """Records around and across the writer's index chunks come back byte-exact, with their offsets."""
    rng = random.Random(n)
    lens = [rng.randrange(0, 9) for _ in range(n)]
    out = tmp_path / "spill.smst"
    with smstore.Writer(out, durable=False) as w:
        w.extend(bytes([k % 251]) * ln for k, ln in enumerate(lens))
    with smstore.open(out, verify=True) as s:
        assert len(s) == n
        assert np.array_equal(s.offsets, np.concatenate([[0], np.cumsum(lens)]).astype(np.uint64))
        for k in (0, INDEX_CHUNK - 1, INDEX_CHUNK, n - 1, *rng.sample(range(n), 200)):
            if k < n:
                assert bytes(s[k]) == bytes([k % 251]) * lens[k]
    assert tl.stray_temps(tmp_path) == []


def test_offsets_index_spill_in_a_memfd_writer() -> None:
    """SharedList's writer (into a memfd, no directory) spills its index into a memfd."""
    n = 2 * INDEX_CHUNK + 3
    fd = os.memfd_create("smstore-test")
    w = smstore._core.Writer.to_fd(fd, "<memfd>")
    for k in range(n):
        w.append(str(k))
    done = w.finish_fd('{"encoding": "utf8"}')
    try:
        with smstore.Store._from_fd(done, "<memfd>") as s:
            s.verify()
            assert len(s) == n
            assert [bytes(s[k]) for k in (0, INDEX_CHUNK, n - 1)] == [
                b"0",
                str(INDEX_CHUNK).encode(),
                str(n - 1).encode(),
            ]
    finally:
        os.close(done)


def test_pack_memory_does_not_grow_with_the_record_count(tmp_path: Path) -> None:
    """8M one-byte lines: the old in-RAM index alone took 64 MiB (128 MiB while the vector grew).

    With the index spilled a chunk at a time, the packer's peak resident growth stays near its buffers.
    """
    src = tmp_path / "many.txt"
    src.write_bytes(b"x\n" * (8 << 20))
    out = tmp_path / "many.smst"
    r = subprocess.run(
        [sys.executable, "-c", PACK_PEAK_GROWTH, str(src), str(out)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        cwd=tl.SAFE_CWD,
    )
    assert int(r.stdout) < 16 * 1024, r.stdout
    with smstore.open(out) as s:
        assert len(s) == 8 << 20
        assert bytes(s[-1]) == b"x"


def test_extend_offsets_takes_arrow_layout(tmp_path: Path) -> None:
    data = b"abcdefghij"
    with smstore.Writer(tmp_path / "o.smst", durable=False) as w:
        assert w.extend_offsets(data, np.array([0, 3, 3, 10], np.int32)) == 3
        assert w.extend_offsets(memoryview(data), np.array([2, 4], np.int64)) == 1
        w.append(b"z")
    assert tl.read_records(tmp_path / "o.smst", verify=True) == [b"abc", b"", b"defghij", b"cd", b"z"]
    w = smstore.Writer(tmp_path / "b.smst", durable=False)
    for bad in ([0, 11], [3, 2], [-1, 2]):
        with pytest.raises(PackInputError, match="offsets"):
            w.extend_offsets(data, np.array(bad, np.int64))
    with pytest.raises(TypeError, match="integer"):
        w.extend_offsets(data, np.array([0.0, 1.0]))
    w.abort()
    assert not (tmp_path / "b.smst").exists()
