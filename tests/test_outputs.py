"""Outputs: what every writer may write over (one rule: regular files only, datasets in
directories), what publishing a manifest may remove (only shards a dataset writer provably wrote),
and when an output is a dataset directory (an existing directory, or a path ending with '/')."""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import smstore_testlib as tl

import smstore
from smstore.format.manifest import MANIFEST_NAME, ShardInfo, describe_shard, read_manifest, write_manifest

LINES = [b"first", b"", b"third \xff", b"fourth"]


run = tl.run_cli


@pytest.fixture
def text(tmp_path: Path) -> Path:
    p = tmp_path / "in.txt"
    p.write_bytes(b"\n".join(LINES) + b"\n")
    return p


# ----------------------------------------------------------------------------- what an output may be

ELSEWHERE_BYTES = b"a file the user owns, elsewhere\n"


def make_output(tmp_path: Path, kind: str) -> Path:
    """An output path of `kind`, pointing (if a link) into a directory of files the test owns."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "target").write_bytes(ELSEWHERE_BYTES)
    os.mkfifo(elsewhere / "fifo")
    out = tmp_path / "out"
    out.mkdir()
    x = out / "X"
    if kind == "fifo":
        os.mkfifo(x)
    elif kind == "symlink to a file":
        x.symlink_to(elsewhere / "target")
    elif kind == "symlink to a fifo":
        x.symlink_to(elsewhere / "fifo")
    else:
        assert kind == "dangling symlink"
        x.symlink_to(elsewhere / "nothing")
    return x


def snapshot(tmp_path: Path) -> dict[str, Any]:
    """Every path under tmp_path/out and tmp_path/elsewhere: its type, link target and bytes."""
    seen: dict[str, Any] = {}
    for top in ("out", "elsewhere"):
        for p in sorted((tmp_path / top).iterdir()):
            st = p.lstat()
            kind = stat.S_IFMT(st.st_mode)
            content = p.read_bytes() if stat.S_ISREG(st.st_mode) else None
            seen[os.fspath(p)] = (kind, os.readlink(p) if p.is_symlink() else None, content)
    return seen


KINDS = ["fifo", "symlink to a file", "symlink to a fifo", "dangling symlink"]

CLI_WRITERS: dict[str, Callable[[Path, Path, Path], list[str | Path]]] = {
    "pack -o": lambda x, src, _: ["pack", src, "-o", x, "-q"],
    "pack -j 2 -o": lambda x, src, _: ["pack", src, "-o", x, "-j", "2", "-q"],
    "pack --shard-size -o": lambda x, src, _: ["pack", src, "-o", x, "--shard-size", "4", "-q"],
    "join -o": lambda x, _, blob: ["join", blob, "-o", x],
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("writer", CLI_WRITERS)
def test_cli_refuses_an_output_that_is_not_a_regular_file(
    tmp_path: Path, text: Path, kind: str, writer: str
) -> None:
    blob = tmp_path / "a.smst"
    smstore.pack(LINES, blob, encoding="lines")
    x = make_output(tmp_path, kind)
    before = snapshot(tmp_path)
    r = run(*CLI_WRITERS[writer](x, text, blob))
    err = r.stderr.decode()
    assert r.returncode == 1, err
    assert f"smstore {writer.split()[0]}: error: " in err
    assert re.search(f"{re.escape(str(x))}: is (not a regular file but )?a (FIFO|symbolic link)", err)
    assert "Traceback" not in err
    assert snapshot(tmp_path) == before  # the output, its target, and nothing new beside them


PY_WRITERS: dict[str, Callable[[Path, Path, Path], Any]] = {
    "Writer": lambda x, _, __: smstore.Writer(x),
    "pack": lambda x, _, __: smstore.pack([b"r"], x),
    "pack_objects": lambda x, _, __: smstore.pack_objects([{}], x),
    "pack_files": lambda x, src, _: smstore.pack_files([src], x, progress=False),
    "pack_files jobs=2": lambda x, src, _: smstore.pack_files([src], x, jobs=2, progress=False),
    "ShardedWriter": lambda x, _, __: smstore.ShardedWriter(x),
    "join": lambda x, _, blob: smstore.join([blob], x),
    "write_manifest": lambda x, _, blob: write_manifest(x, "lines", [describe_shard(blob)[0]]),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("writer", PY_WRITERS)
def test_python_writers_refuse_an_output_that_is_not_a_regular_file(
    tmp_path: Path, text: Path, kind: str, writer: str
) -> None:
    blob = tmp_path / "a.smst"
    smstore.pack(LINES, blob, encoding="lines")
    x = make_output(tmp_path, kind)
    before = snapshot(tmp_path)
    with pytest.raises(
        smstore.StoreIOError,
        match=f"{re.escape(str(x))}: is (not a regular file but )?a (FIFO|symbolic link)",
    ):
        PY_WRITERS[writer](x, text, blob)
    assert snapshot(tmp_path) == before


def test_a_symlink_to_a_directory_holds_a_dataset(tmp_path: Path, text: Path) -> None:
    """A dataset directory is written into, never replaced: a link to a directory serves as one."""
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    r = run("pack", text, "-o", link, "-j", "2", "-q")
    assert r.returncode == 0, r.stderr
    assert link.is_symlink()
    assert (real / MANIFEST_NAME).is_file()
    assert tl.read_records(link) == LINES


def test_replacing_a_regular_file_keeps_working(tmp_path: Path, text: Path) -> None:
    out = tmp_path / "o.smst"
    out.write_bytes(b"old")
    assert run("pack", text, "-o", out, "-q").returncode == 0
    assert tl.read_records(out) == LINES
    m = tmp_path / "m.json"
    m.write_text("{}")
    assert run("join", out, "-o", m).returncode == 0
    assert tl.read_records(m) == LINES


# ----------------------------------------------------------------------------- what publishing removes


def test_join_never_removes_a_shard_it_no_longer_lists(tmp_path: Path) -> None:
    a, c = tmp_path / "a.smst", tmp_path / "c.smst"
    smstore.pack([b"a"], a)
    smstore.pack([b"c1", b"c2"], c)
    kept = c.read_bytes()
    all_json = tmp_path / "all.json"
    assert run("join", a, c, "-o", all_json).returncode == 0
    assert tl.read_records(all_json) == [b"a", b"c1", b"c2"]
    r = run("join", a, "-o", all_json)
    assert r.returncode == 0, r.stderr
    assert tl.read_records(all_json) == [b"a"]
    assert c.read_bytes() == kept
    # The same inside a dataset directory: join writes its manifest.json and removes nothing.
    ds = tmp_path / "ds"
    ds.mkdir()
    for name in ("part-0000aaaa-00000.smst", "part-0000aaaa-00001.smst"):
        smstore.pack([name.encode()], ds / name)
    assert run("join", *sorted(ds.iterdir()), "-o", f"{ds}/").returncode == 0
    assert run("join", ds / "part-0000aaaa-00000.smst", "-o", ds).returncode == 0
    assert tl.read_records(ds) == [b"part-0000aaaa-00000.smst"]
    assert (ds / "part-0000aaaa-00001.smst").is_file()


def repack(ds: Path, text: Path, how: str) -> None:
    if how == "cli":
        r = run("pack", text, "-o", f"{ds}/", "-j", "2", "-q")
        assert r.returncode == 0, r.stderr
    else:
        with smstore.ShardedWriter(ds, encoding="lines", shard_records=3, durable=False) as w:
            w.extend(LINES)


@pytest.mark.parametrize("how", ["cli", "ShardedWriter"])
def test_a_stale_manifest_listing_the_manifest_itself(tmp_path: Path, text: Path, how: str) -> None:
    ds = tmp_path / "ds"
    ds.mkdir()
    blob = tmp_path / "b.smst"
    smstore.pack([b"x"], blob, encoding="lines")
    info = describe_shard(blob)[0]
    write_manifest(ds / MANIFEST_NAME, "lines", [ShardInfo(MANIFEST_NAME, *_sizes(info))], durable=False)
    repack(ds, text, how)
    assert tl.read_records(ds) == LINES
    assert read_manifest(ds).records == len(LINES)


def _sizes(info: ShardInfo) -> tuple[int, int, int, str]:
    return info.records, info.data_bytes, info.file_size, info.checksum


@pytest.mark.parametrize("how", ["cli", "ShardedWriter"])
def test_a_hostile_manifest_cannot_make_a_repack_remove_other_files(
    tmp_path: Path, text: Path, how: str
) -> None:
    """Only shards named as smstore names them, lying in the directory as regular files with the
    checksum the old manifest records, are removed; everything else it lists is left alone."""
    ds = tmp_path / "ds"
    ds.mkdir()

    def blob(path: Path, payload: bytes) -> ShardInfo:
        smstore.pack([payload], path, encoding="lines")
        return describe_shard(path)[0]

    outside = blob(tmp_path / "outside.smst", b"outside")
    far = blob(tmp_path / "far.smst", b"far, by absolute path")
    notes = blob(ds / "notes.smst", b"a file of the user's, in the directory")
    (ds / "part-0123abcd-00000.smst").symlink_to(tmp_path / "outside.smst")  # our name, a link
    mismatched = blob(ds / "part-89abcdef-00001.smst", b"our name, another checksum")
    ours = blob(ds / "part-aaaaaaaa-00000.smst", b"a shard of the previous pack")
    listed = [
        ShardInfo("../outside.smst", *_sizes(outside)),
        ShardInfo(os.fspath(tmp_path / "far.smst"), *_sizes(far)),
        ShardInfo("notes.smst", *_sizes(notes)),
        ShardInfo("part-0123abcd-00000.smst", *_sizes(outside)),  # its target's true checksum
        ShardInfo("part-89abcdef-00001.smst", *_sizes(mismatched)[:3], "0123456789abcdef"),
        ShardInfo(MANIFEST_NAME, *_sizes(ours)),
        ShardInfo("./part-aaaaaaaa-00000.smst", *_sizes(ours)),  # not as smstore writes names
        ShardInfo("part-aaaaaaaa-00000.smst", *_sizes(ours)),
    ]
    assert mismatched.checksum != "0123456789abcdef"
    write_manifest(ds / MANIFEST_NAME, "lines", listed, durable=False)
    before = snapshot_files(tmp_path)
    repack(ds, text, how)
    assert tl.read_records(ds) == LINES
    after = snapshot_files(tmp_path)
    gone = sorted(set(before) - set(after))
    assert gone == [os.fspath(ds / "part-aaaaaaaa-00000.smst")]  # only the previous pack's own shard
    assert all(after[p] == before[p] for p in after if p in before and not p.endswith(MANIFEST_NAME))


def snapshot_files(tmp_path: Path) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for p in sorted(tmp_path.rglob("*")):
        if p.is_symlink():
            seen[os.fspath(p)] = ("link", os.readlink(p))
        elif p.is_file():
            seen[os.fspath(p)] = p.read_bytes()
    return seen


# ----------------------------------------------------------------------------- when an output is a dataset


def _input(tmp_path: Path, fmt: str) -> tuple[Path, list[bytes]]:
    src = tmp_path / f"in.{fmt}"
    if fmt == "jsonl":
        lines = [json.dumps({"i": i}).encode() for i in range(50)]
    elif fmt == "npy-lines":
        lines = [" ".join(str(i + k) for k in range(i % 5 + 1)).encode() for i in range(50)]
    else:
        lines = [b"line %d \xff" % i for i in range(50)]
    src.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / f"one.{fmt}.smst"
    r = run("pack", "--format", fmt, src, "-o", out, "-q")
    assert r.returncode == 0, r.stderr
    return src, tl.read_records(out)


@pytest.mark.parametrize("jobs", ["1", "2"])
@pytest.mark.parametrize("where", ["new/", "existing"])
@pytest.mark.parametrize("fmt", ["lines", "jsonl", "npy-lines"])
def test_a_directory_output_is_a_dataset_for_every_format_and_jobs(
    tmp_path: Path, fmt: str, where: str, jobs: str
) -> None:
    src, expected = _input(tmp_path, fmt)
    if where == "existing":
        out = tmp_path / "existing"
        out.mkdir()
        target = os.fspath(out)
    else:
        out = tmp_path / "new"
        target = f"{out}/"
    r = run("pack", "--format", fmt, src, "-o", target, "-j", jobs, "-q")
    assert r.returncode == 0, r.stderr
    assert (out / MANIFEST_NAME).is_file()
    assert tl.read_records(out) == expected
    assert len(read_manifest(out).shards) == int(jobs)


def test_stdin_into_a_dataset_directory(tmp_path: Path) -> None:
    out = tmp_path / "ds"
    r = run("pack", "-", "-o", f"{out}/", "-q", stdin=b"a\nb\r\n\nz")
    assert r.returncode == 0, r.stderr
    assert tl.read_records(out) == [b"a", b"b\r", b"", b"z"]
    assert read_manifest(out).meta["source"] == ["-"]
    r = run("pack", "-", "-o", out, "-j", "2", stdin=b"a\n")
    assert r.returncode == 1
    assert b"stdin cannot be split into parts" in r.stderr


def test_a_fifo_input_cannot_be_cut_into_parts(tmp_path: Path, text: Path) -> None:
    """Cutting needs a size; a FIFO has none (it was read as empty). Looking at it never blocks."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    r = run("pack", text, fifo, "-o", tmp_path / "ds", "-j", "2")
    assert r.returncode == 1
    assert f"{fifo}: not a regular file".encode() in r.stderr
    assert b"Traceback" not in r.stderr
    assert not (tmp_path / "ds").exists()


def test_a_file_output_stays_a_blob(tmp_path: Path, text: Path) -> None:
    out = tmp_path / "o.smst"
    assert run("pack", text, "-o", out, "-q").returncode == 0
    assert out.is_file()
    assert tl.read_records(out) == LINES
    with pytest.raises(smstore.StoreIOError, match=re.escape(f"{tmp_path}/x/: names a directory")):
        smstore.Writer(f"{tmp_path}/x/")
    assert not (tmp_path / "x").exists()


def test_a_directory_output_is_a_dataset_for_converters(tmp_path: Path) -> None:
    src = tmp_path / "list.json"
    src.write_text(json.dumps([{"i": i} for i in range(10)]))
    out = tmp_path / "ds"
    r = run("pack", "--format", "json-list", "--objects", "json", src, "-o", f"{out}/", "-q")
    assert r.returncode == 0, r.stderr
    assert len(tl.read_records(out)) == 10


def test_the_core_writer_refuses_a_link_swapped_in_before_its_rename(tmp_path: Path) -> None:
    """The Python rule runs before a writer starts; a symbolic link put at the output while it writes
    must not be replaced by the rename either (csrc/writer.cpp checks again with lstat)."""
    from smstore import _core

    target = tmp_path / "elsewhere.txt"
    target.write_bytes(b"the user's file")
    out = tmp_path / "out.smst"
    with pytest.raises(smstore.StoreIOError, match="symbolic link"):
        _core.Writer(str(_symlink(tmp_path / "link.smst", target)), False)
    w = _core.Writer(str(out), False)
    w.append(b"record")
    _symlink(out, target)  # swapped in after the constructor looked
    with pytest.raises(smstore.StoreIOError, match="symbolic link"):
        w.finish(smstore.write.pack.build_metadata("bytes"))
    assert out.is_symlink()
    assert target.read_bytes() == b"the user's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere.txt", "link.smst", "out.smst"]


def _symlink(link: Path, target: Path) -> Path:
    link.symlink_to(target)
    return link


def test_a_link_swapped_in_at_a_manifests_temporary_name_is_neither_chmodded_nor_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest (and an index file) is written to a temporary name beside it, then given the
    replaced file's mode and renamed. A link put at that name (the directory writable by another
    user) had the mode set on whatever it pointed to (os.chmod by name), and was then published."""
    from smstore.write import pack as _pack

    secret = tmp_path / "secret"
    secret.write_bytes(b"private")
    secret.chmod(0o600)
    dataset = tmp_path / "ds"
    dataset.mkdir()
    manifest = dataset / MANIFEST_NAME
    manifest.write_text("{}")
    manifest.chmod(0o644)
    checks = []
    check_output = _pack.check_output

    def swapping(path: Any, **kwargs: Any) -> None:
        check_output(path, **kwargs)
        checks.append(path)
        if len(checks) == 2:  # the file is written; what the other user does before its mode is set
            (tmp,) = [p for p in dataset.iterdir() if ".smstore-tmp-" in p.name]
            tmp.unlink()
            _symlink(tmp, secret)

    monkeypatch.setattr(_pack, "check_output", swapping)
    with pytest.raises(smstore.StoreIOError, match="temporary file was replaced"):
        write_manifest(manifest, "bytes", [], durable=False)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert secret.read_bytes() == b"private"
    assert not manifest.is_symlink()
    assert manifest.read_text() == "{}"
