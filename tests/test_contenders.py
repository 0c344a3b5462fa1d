"""The benchmark contenders (benchmarks/contenders.py) return the same bytes for the same indices.

Each contender installed here builds its store from the same records and must give every record
back, byte for byte, through ``get`` and ``get_batch``; one that is not installed is skipped with
its reason (the test extra holds mmengine and datasets; LMDB, litdata, Mosaic streaming and
megatron-core come with the bench extra). The harness of ``python -m benchmarks`` runs end to end
on a few contenders, in real rank and worker processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # last: smstore comes from the installed package, benchmarks from here

from benchmarks import contenders as C

RECORDS = [
    b"plain",
    b"with\x00nul",
    b"\r\rcarriage returns\r",
    b"\xff\xfe not utf-8 \x80",
    b" ",
    b"x" * 100_000,
    "unicod\u00e9 \u2603".encode(),
    *(f"line {i} ".encode() * (i % 7 + 1) for i in range(500)),
]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, C.Context]]:
    """Every installed bytes contender's store, built from RECORDS, and the daemon serving the blob."""
    root = tmp_path_factory.mktemp("contenders")
    src = root / "records.txt"
    src.write_bytes(b"\n".join(RECORDS) + b"\n")
    for c in C.CONTENDERS:
        out = C.store_dir(root, c)
        if c.kind == "bytes" and c.build is not None and not out.exists() and c.missing() is None:
            out.mkdir()
            c.build(src, out)
    sock = root / "daemon.sock"
    with C.daemon(sock, C.store_dir(root, C.BY_KEY["smstore-mmap"]) / "data.smst"):
        yield root, C.Context(src, len(RECORDS), sock)


def open_reader(contender: C.Contender, root: Path, ctx: C.Context) -> C.Reader:
    why = contender.missing()
    if why:
        pytest.skip(why)
    return contender.open(C.store_dir(root, contender), ctx)


@pytest.mark.parametrize("key", [c.key for c in C.CONTENDERS if c.kind == "bytes"])
def test_contender_returns_every_record_byte_exact(built: tuple[Path, C.Context], key: str) -> None:
    root, ctx = built
    reader = open_reader(C.BY_KEY[key], root, ctx)
    try:
        indices = list(range(len(RECORDS)))[::-1]
        C.verify({key: reader}, RECORDS, indices)
        assert [C.as_bytes(r) for r in reader.get_batch([6, 0, 6, 5])] == [
            RECORDS[6],
            RECORDS[0],
            RECORDS[6],
            RECORDS[5],
        ]
    finally:
        reader.close()


@pytest.mark.parametrize("key", [c.key for c in C.CONTENDERS if c.kind == "objects"])
def test_objects_contender_returns_every_dict(
    key: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SMSTORE_SOCKET", os.fspath(tmp_path / "no-daemon.sock"))  # SharedList: a local copy
    ctx = C.Context(tmp_path / "unused", 0, None, objects=300)
    reader = open_reader(C.BY_KEY[key], tmp_path, ctx)
    try:
        C.verify({key: reader}, C.make_dicts(300), list(range(300)))
    finally:
        reader.close()


class Wrong(C.Reader):
    """A reader that returns one wrong byte in one record: the check must catch it."""

    def __len__(self) -> int:
        return len(RECORDS)

    def get(self, i: int) -> Any:
        return RECORDS[i] if i != 3 else RECORDS[i][:-1] + b"?"


def test_verify_catches_a_wrong_byte() -> None:
    with pytest.raises(AssertionError, match=r"wrong\.get\(3\)"):
        C.verify({"wrong": Wrong()}, RECORDS, list(range(len(RECORDS))))


def test_a_contender_that_is_not_installed_says_why() -> None:
    c = C.Contender("x", "x", "bytes", ("no_such_module_smstore_test",), "-", None, lambda out, ctx: Wrong())
    assert "no_such_module_smstore_test" in (c.missing() or "")


def test_harness_runs_ranks_and_workers_and_reports_every_contender(tmp_path: Path) -> None:
    """python -m benchmarks, memory and objects sections, real ranks (LOCAL_RANK) with forked workers."""
    pytest.importorskip("torch")
    out = tmp_path / "results"
    keys = ["smstore-daemon", "smstore-mmap", "list", "sqlite", "pread", "lmdb", "obj-sharedlist", "obj-list"]
    cmd = [
        sys.executable,
        "-m",
        "benchmarks",
        "--records",
        "600",
        "--lines-per-record",
        "3",
        "--objects",
        "400",
    ]
    cmd += [
        "--grid",
        "2x2",
        "--object-grid",
        "2x1",
        "--only",
        "memory",
        "--only",
        "objects",
        "--out",
        str(out),
    ]
    cmd += [a for k in keys for a in ("--contender", k)]
    cmd += ["--tmpdir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (raw,) = out.glob("contenders-*.json")
    results = json.loads(raw.read_text())
    assert set(results["contenders"]) == set(keys)
    ran = {r["contender"] for r in results["memory"] + results["objects"]}
    assert ran | set(results["skipped"]) == set(keys)  # each one measured or reported as skipped
    assert {"smstore-daemon", "smstore-mmap", "list", "sqlite", "pread", "obj-sharedlist", "obj-list"} <= ran
    for row in results["memory"]:
        assert (row["ranks"], row["workers"], row["processes"]) == (2, 2, 2 * (1 + 2) + 1)  # and the daemon
    counts = {r["contender"]: r["records_s"] * r["epoch_s"] for r in results["memory"]}
    assert all(round(v) == 600 for v in counts.values())
    assert "| smstore (mmap) |" in (out / "contenders.md").read_text()
    assert [
        p for p in tmp_path.iterdir() if p.name.startswith("smstore-bench-")
    ] == []  # its stores are removed
