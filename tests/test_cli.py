"""The `smstore` command line, run as real subprocesses: exit codes, exact stdout bytes, messages."""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import pty
import re
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path
from typing import Any

import pytest
import smstore_testlib as tl

import smstore
from smstore.format.manifest import read_manifest

LINES = tl.AWKWARD[:-1]  # the records of the awkward corpus, as a text file (last line unterminated)


run = tl.run_cli


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    p = tmp_path / "data.txt"
    p.write_bytes(b"\n".join(LINES))
    return p


@pytest.fixture
def packed(tmp_path: Path, text_file: Path) -> Path:
    out = tmp_path / "data.smst"
    r = run("pack", text_file, "-o", out)
    assert r.returncode == 0, r.stderr
    return out


def test_pack(packed: Path, text_file: Path) -> None:
    with smstore.open(packed, verify=True) as s:
        assert [bytes(v) for v in s] == LINES
        assert s.encoding == "lines"
        assert s.metadata["source"] == [str(text_file)]


def test_pack_output_messages(tmp_path: Path, text_file: Path) -> None:
    out = tmp_path / "o.smst"
    r = run("pack", text_file, "-o", out)
    assert r.returncode == 0
    assert r.stdout == b""  # stdout stays clean for pipelines
    assert f"packed {len(LINES)} records".encode() in r.stderr
    assert b"\r" not in r.stderr.replace(b"\r\n", b"")  # not a terminal: no progress bar redraws
    r = run("pack", text_file, "-o", out, "-q")
    assert r.returncode == 0
    assert r.stdout == b""
    assert r.stderr == b""


def on_terminal(args: list[str], rows: int, columns: int) -> bytes:
    """What `smstore ARGS` writes to stderr on a terminal of the given size (it must succeed)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "smstore", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=slave,
            cwd=tl.SAFE_CWD,
        )
        os.close(slave)
        slave = -1
        out = b""
        while select.select([master], [], [], 60)[0]:  # a hung child fails the test, not the session
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        assert proc.wait(timeout=60) == 0, out
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)
    return out


# A fresh pty (some CI runners too) reports 0 x 0: tqdm drew nothing there.
@pytest.mark.parametrize(("rows", "columns"), [(24, 100), (0, 0), (24, 0)])
@pytest.mark.parametrize("fmt", ["lines", "json-list"])
def test_pack_progress_bar_on_a_terminal(
    tmp_path: Path, text_file: Path, rows: int, columns: int, fmt: str
) -> None:
    source = text_file
    if fmt == "json-list":
        source = tmp_path / "list.json"
        source.write_text(json.dumps([{"i": i, "text": "x" * (i % 50)} for i in range(3000)]))
    out = on_terminal(["pack", "--format", fmt, str(source), "-o", str(tmp_path / "tty.smst")], rows, columns)
    assert re.search(rb"(pack|convert): +0%\|", out), out  # the bar, drawn
    assert re.search(rb"(pack|convert): 100%\|", out), out
    assert b"packed" in out
    # Binary units, as in the summary line ("... MiB/s"): tqdm's own rate was decimal (MB/s).
    assert re.search(rb"\d(B|KiB|MiB|GiB)/s\]", out), out
    assert not re.search(rb"\d ?(kB|MB|GB)/s", out), out


def test_pack_several_inputs_and_meta(tmp_path: Path, text_file: Path) -> None:
    second = tmp_path / "second.txt"
    second.write_bytes(b"tail 1\ntail 2\n")
    out = tmp_path / "two.smst"
    r = run(
        "pack", text_file, second, "-o", out, "--meta", "lang=en", "--meta", "split=a=b", "-q", "--no-fsync"
    )
    assert r.returncode == 0, r.stderr
    with smstore.open(out) as s:
        assert [bytes(v) for v in s] == [*LINES, b"tail 1", b"tail 2"]
        assert s.metadata["user"] == {"lang": "en", "split": "a=b"}


def test_pack_bad_meta(tmp_path: Path, text_file: Path) -> None:
    out = tmp_path / "o.smst"
    r = run("pack", text_file, "-o", out, "--meta", "novalue")
    assert r.returncode == 2
    assert b"KEY=VALUE" in r.stderr
    assert not out.exists()


def test_pack_missing_input(tmp_path: Path) -> None:
    out = tmp_path / "o.smst"
    missing = tmp_path / "missing.txt"
    r = run("pack", missing, "-o", out)
    assert r.returncode == 1
    assert str(missing).encode() in r.stderr
    assert b"Traceback" not in r.stderr
    assert not out.exists()


def test_pack_jsonl(tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_bytes(b'{"a": 1}\n[1, 2]\n"s"\n')
    out = tmp_path / "j.smst"
    r = run("pack", "--format", "jsonl", good, "-o", out, "-q")
    assert r.returncode == 0, r.stderr
    with smstore.open(out) as s:
        assert [json.loads(bytes(v)) for v in s] == [{"a": 1}, [1, 2], "s"]
        assert s.encoding == "jsonl"

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"a": 1}\n{"a": 2}\n{"a": }\n')
    r = run("pack", "--format", "jsonl", bad, "-o", out, "-q")
    assert r.returncode == 1
    assert f"{bad}:3:".encode() in r.stderr
    assert b"Traceback" not in r.stderr
    with smstore.open(out) as s:  # the earlier good output is untouched
        assert len(s) == 3


def test_pack_stdin(tmp_path: Path) -> None:
    out = tmp_path / "stdin.smst"
    r = run("pack", "-", "-o", out, "-q", stdin=b"a\r\n\x00\n\nz")
    assert r.returncode == 0, r.stderr
    with smstore.open(out) as s:
        assert [bytes(v) for v in s] == [b"a\r", b"\x00", b"", b"z"]


def test_info(packed: Path, text_file: Path) -> None:
    r = run("info", packed)
    assert r.returncode == 0, r.stderr
    text = r.stdout.decode()
    with smstore.open(packed) as s:
        checksum, nbytes, created = s.checksum, s.nbytes, s.metadata["created"]
    assert checksum in text
    assert created in text
    assert str(text_file) in text
    fields = dict(line.split(None, 1) for line in text.splitlines())
    assert fields["records"] == str(len(LINES))
    assert fields["data_bytes"].startswith(f"{nbytes} ")
    assert fields["encoding"] == "lines"


def test_info_json(packed: Path, text_file: Path) -> None:
    r = run("info", "--json", packed)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    with smstore.open(packed) as s:
        assert info["records"] == len(s) == len(LINES)
        assert info["data_bytes"] == s.nbytes == sum(map(len, LINES))
        assert info["file_bytes"] == packed.stat().st_size
        assert info["checksum"] == f"xxh64:{s.checksum}"
        assert info["created"] == s.metadata["created"]
    assert info["format_version"] == 1
    assert info["encoding"] == "lines"
    assert info["source"] == [str(text_file)]
    assert info["path"] == str(packed)


def test_info_bad_file(tmp_path: Path) -> None:
    p = tmp_path / "foreign.smst"
    p.write_bytes(b"not a blob at all")
    r = run("info", p)
    assert r.returncode == 1
    assert str(p).encode() in r.stderr
    assert b"Traceback" not in r.stderr
    assert r.stdout == b""


def test_info_of_a_directory_or_a_text_file_says_what_to_give(tmp_path: Path, text_file: Path) -> None:
    folder = tmp_path / "corpus"
    folder.mkdir()
    r = run("info", folder)
    assert r.returncode == 1
    for text in (f"{folder}: a directory, but not a sharded dataset", "no manifest.json", "smstore join"):
        assert text.encode() in r.stderr, r.stderr  # was "not a regular file"
    r = run("info", text_file)
    assert r.returncode == 1
    assert f"smstore pack {text_file} -o {tmp_path / 'data.smst'}".encode() in r.stderr, r.stderr
    assert b"Traceback" not in r.stderr


def test_verify_ok(packed: Path) -> None:
    r = run("verify", packed)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"{packed}: OK".encode())


@pytest.mark.parametrize("where", ["data", "index", "meta", "header_padding", "checksum"])
def test_verify_detects_corruption(packed: Path, where: str) -> None:
    blob = bytearray(packed.read_bytes())
    h = tl.parse_header(blob)
    pos = {
        "data": 4096 + h["data_size"] // 2,
        "index": h["index_offset"] + 8 * (h["record_count"] // 2) + 7,  # high byte: breaks the order too
        "meta": h["meta_offset"] + h["meta_size"] - 2,
        "header_padding": 2000,
        "checksum": tl.CHECKSUM_OFFSET,
    }[where]
    blob[pos] ^= 0x04
    packed.write_bytes(blob)
    r = run("verify", packed)
    assert r.returncode != 0
    err = r.stderr.decode()
    assert f"{packed}: FAILED" in err
    assert "checksum mismatch" in err or "corrupt" in err
    assert "Traceback" not in err
    assert r.stdout == b""


def test_verify_truncated_and_several_stores(tmp_path: Path, packed: Path) -> None:
    cut = tmp_path / "cut.smst"
    cut.write_bytes(packed.read_bytes()[:-10])
    missing = tmp_path / "missing.smst"
    r = run("verify", packed, cut, missing)
    assert r.returncode == 1
    assert r.stdout.decode().startswith(f"{packed}: OK")
    err = r.stderr.decode()
    assert f"{cut}: FAILED" in err
    assert "truncated" in err
    assert f"{missing}: FAILED" in err


def test_get_exact_bytes(packed: Path) -> None:
    for i in (0, 1, 2, 6, 7, 13, 14, -1, -len(LINES)):
        r = run("get", packed, str(i))
        assert r.returncode == 0, r.stderr
        assert r.stdout == LINES[i]


def test_get_several_and_newline(packed: Path) -> None:
    r = run("get", packed, "1", "7", "3")
    assert r.stdout == LINES[1] + LINES[7] + LINES[3]
    r = run("get", "-n", packed, "1", "7", "0")
    assert r.stdout == LINES[1] + b"\n" + LINES[7] + b"\n" + LINES[0] + b"\n"


def test_get_out_of_range(packed: Path) -> None:
    r = run("get", packed, str(len(LINES)))
    assert r.returncode == 1
    assert b"out of range" in r.stderr
    assert b"Traceback" not in r.stderr
    assert r.stdout == b""


def test_get_missing_store(tmp_path: Path) -> None:
    r = run("get", tmp_path / "nope.smst", "0")
    assert r.returncode == 1
    assert b"nope.smst" in r.stderr
    assert b"Traceback" not in r.stderr


def test_version_and_usage() -> None:
    r = run("--version")
    assert r.returncode == 0
    assert r.stdout.decode().strip() == f"smstore {smstore.__version__}"
    r = run()
    assert r.returncode == 2
    assert b"usage" in r.stderr


def test_help_shows_the_formats_and_examples() -> None:
    r = run("--help")
    assert r.returncode == 0
    out = r.stdout.decode()
    for fmt in ("jsonl", "npy-lines", "parquet", "arrow", "hf", "webdataset", "megatron", "json-list"):
        assert fmt in out, fmt  # the converters were hidden behind 'pack --help'
    assert "examples:" in out
    assert "smstore pack --format parquet --column text" in out
    assert "smstore serve" in out
    r = run("pack", "--help")
    assert r.returncode == 0
    assert b"webdataset            sample of WebDataset tar shards" in r.stdout


def test_console_script_entry_point(packed: Path) -> None:
    exe = Path(sys.executable).parent / "smstore"
    if not exe.exists():
        pytest.skip("smstore console script not installed next to this interpreter")
    r = subprocess.run(
        [str(exe), "get", str(packed), "1"], capture_output=True, timeout=60, check=False, cwd=tl.SAFE_CWD
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == LINES[1]


def test_import_and_cli_never_import_torch(packed: Path) -> None:
    code = (
        "import sys, smstore, smstore.cli, io, contextlib\n"
        "assert 'numpy' not in sys.modules, 'numpy was imported: the CLI would start slowly'\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n"
        "    assert smstore.cli.main(['info', sys.argv[1]]) == 0\n"
        "    assert smstore.cli.main(['verify', sys.argv[1]]) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('clean')\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(packed)],
        capture_output=True,
        timeout=60,
        check=False,
        cwd=tl.SAFE_CWD,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == b"clean\n"


def test_pack_max_line_bytes(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'1\n"' + b"x" * 100 + b'"\n')
    out = tmp_path / "o.smst"
    r = run("pack", "--format", "jsonl", "--max-line-bytes", "64", src, "-o", out, "-q")
    assert r.returncode == 1
    assert f"{src}:2: line is longer than the 64-byte limit".encode() in r.stderr
    assert not out.exists()
    assert run("pack", "--format", "jsonl", "--max-line-bytes", "1k", src, "-o", out, "-q").returncode == 0
    r = run("pack", "--max-line-bytes", "lots", src, "-o", out)
    assert r.returncode == 2
    assert b"'lots' is not a size" in r.stderr


# ----------------------------------------------------------------------------- inspecting never unpickles


class Touches:
    """Unpickling it creates `marker`: the record shows whether anything unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def test_inspecting_a_pickle_store_never_unpickles(tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    recs = [pickle.dumps(Touches(marker), protocol=5), pickle.dumps({"plain": 1}, protocol=5)] * 3
    blob = tmp_path / "trap.smst"
    smstore.pack(recs, blob, encoding="pickle")
    ds = tmp_path / "ds"
    with smstore.ShardedWriter(ds, encoding="pickle", shard_records=2, durable=False) as w:
        w.extend(recs)
    joined = tmp_path / "joined.json"
    smstore.join([blob, ds], joined, durable=False)
    every = recs + recs
    for n, target in enumerate((blob, ds, joined)):
        want = recs if target != joined else every
        for args in (
            ("info", target),
            ("info", "--json", target),
            ("verify", target),
            ("join", target, "-o", tmp_path / f"again{n}.json"),
        ):
            r = run(*args)
            assert r.returncode == 0, (args, r.stderr)
        r = run("get", target, "0", "-1")
        assert r.returncode == 0, r.stderr
        assert r.stdout == want[0] + want[-1]  # the raw pickle bytes, as the README promises
        r = run("get", "-n", target, "1")
        assert r.stdout == want[1] + b"\n"
        r = run("get", "--decode", target, "0")
        assert r.returncode == 2
        assert b"--unsafe-unpickle" in r.stderr
        assert r.stdout == b""
        # The Python entry points that only look.
        with smstore.open(target) as s:
            assert s.metadata["encoding"] == "pickle"
            assert repr(s)
            assert len(s) == len(want)
            s.verify()
            assert bytes(s.raw(0)) == want[0]
        assert tl.read_records(target) == want
        if target != blob:
            assert read_manifest(target).encoding == "pickle"
    with smstore.Store(blob) as s:
        assert s.metadata["encoding"] == "pickle"
    smstore.join([ds, blob], tmp_path / "python-join.json", durable=False)
    assert not marker.exists()
    # The trap is armed: the flag that says it runs code does run it.
    r = run("get", "--unsafe-unpickle", blob, "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout == b"None\n"  # what Path.touch returned
    assert marker.exists()


def test_get_decode_opt_in(tmp_path: Path, packed: Path) -> None:
    objs = [{"a": [1, 2]}, "é"]
    blob = tmp_path / "objs.smst"
    smstore.pack_objects(objs, blob, encoding="json")
    r = run("get", "--decode", blob, "0", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout == repr(objs[0]).encode() + b"\n" + repr(objs[1]).encode() + b"\n"
    assert run("get", blob, "0").stdout == b'{"a":[1,2]}'  # without --decode: the bytes
    r = run("get", "--decode", packed, "0")
    assert r.returncode == 2
    assert b"encoded as 'lines', not as objects" in r.stderr
