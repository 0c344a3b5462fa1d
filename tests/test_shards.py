"""Sharded datasets: parallel packing byte-exact with a one-process pack, one global index, the
manifest and its errors, join, the daemon serving shards, DataLoader workers reading them."""

from __future__ import annotations

import itertools
import json
import os
import pickle
import random
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import smstore_testlib as tl
from daemon_testlib import Daemon, cli
from torch.utils.data import DataLoader

import smstore
from smstore import (
    PackInputError,
    SharedStoreDataset,
    StoreChangedError,
    StoreFormatError,
    StoreNotFoundError,
    StoreTruncatedError,
    StoreVersionError,
)
from smstore.format.manifest import MANIFEST_NAME, describe_shard, read_manifest, write_manifest
from smstore.write.packfiles import plan_parts


def write_lines(path: Path, n: int, seed: int = 0, *, trailing_newline: bool = True) -> bytes:
    """Lines of awkward bytes (CR, NUL, invalid UTF-8, empty lines, a few long ones)."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        kind = rng.random()
        if kind < 0.05:
            line = b""
        elif kind < 0.07:
            line = bytes(rng.randrange(256) for _ in range(rng.randrange(5000, 20000))).replace(b"\n", b"N")
        else:
            line = f"{seed}:{i}:".encode() + b"\r\x00\xff" * rng.randrange(4) + b"x" * rng.randrange(80)
        lines.append(line)
    data = b"\n".join(lines) + (b"\n" if trailing_newline else b"")
    path.write_bytes(data)
    return data


def one_blob(tmp_path: Path, inputs: list[Path], fmt: str = "lines") -> list[bytes]:
    out = tmp_path / "one.smst"
    smstore.pack_files(inputs, out, format=fmt, progress=False, durable=False)
    with smstore.open(out) as s:
        return tl.read_records(s)


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[list[Path], list[bytes]]:
    a, b, c = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "c.txt"
    write_lines(a, 3000, seed=1)
    write_lines(b, 10, seed=2, trailing_newline=False)  # its last line ends at its file's end
    write_lines(c, 2000, seed=3)
    inputs = [a, b, c]
    return inputs, one_blob(tmp_path, inputs)


# ----------------------------------------------------------------------------- packing in parts


@pytest.mark.parametrize(("jobs", "shard_size"), [(2, None), (1, 4096), (2, 50_000), (3, 1), (2, 1 << 30)])
def test_parallel_pack_is_byte_exact_with_one_process(
    tmp_path: Path, corpus: tuple[list[Path], list[bytes]], jobs: int, shard_size: int | None
) -> None:
    inputs, expected = corpus
    out = tmp_path / "ds"
    stats = smstore.pack_files(inputs, out, jobs=jobs, shard_size=shard_size, progress=False, durable=False)
    with smstore.open(out, verify=True) as s:
        assert isinstance(s, smstore.ShardedStore)
        assert tl.read_records(s) == expected
        assert stats.records == len(expected) == len(s)
        assert stats.shards == s.shard_count == len(s.shard_sizes)
        assert sum(s.shard_sizes) == len(s)
        if shard_size == 1:
            assert all(n == 1 for n in s.shard_sizes[:-1])  # every cut lands on the next line end
    assert sorted(os.listdir(out)) == sorted([MANIFEST_NAME, *(Path(p).name for p in s.shard_paths)])


def test_parts_end_at_line_ends_and_cover_the_inputs(
    tmp_path: Path, corpus: tuple[list[Path], list[bytes]]
) -> None:
    inputs, _ = corpus
    names = [os.fspath(p) for p in inputs]
    for size in (1, 777, 10_000, 1 << 40):
        parts = plan_parts(names, size)
        ranges = [r for part in parts for r in part]
        for name in names:
            mine = [(a, b) for n, a, b in ranges if n == name]
            data = Path(name).read_bytes()
            assert mine[0][0] == 0
            assert mine[-1][1] == len(data)
            assert all(b1 == a2 for (_, b1), (a2, _) in itertools.pairwise(mine))
            assert all(data[b - 1 : b] == b"\n" for _, b in mine[:-1])


@pytest.mark.parametrize("fmt", ["jsonl", "npy-lines"])
def test_parallel_pack_jsonl_and_token_lines(tmp_path: Path, fmt: str) -> None:
    src = tmp_path / "in.txt"
    rng = random.Random(5)
    if fmt == "jsonl":
        src.write_text(
            "".join(json.dumps({"i": i, "t": "é" * rng.randrange(30)}) + "\n" for i in range(4000))
        )
    else:
        src.write_text(
            "".join(
                " ".join(str(rng.randrange(65536)) for _ in range(rng.randrange(40))) + "\n"
                for _ in range(4000)
            )
        )
    one, out = tmp_path / "one.smst", tmp_path / "ds"
    if fmt == "jsonl":
        smstore.pack_files([src], one, format="jsonl", progress=False, durable=False)
        smstore.pack_files(
            [src], out, format="jsonl", jobs=2, shard_size=20_000, progress=False, durable=False
        )
    else:
        smstore.pack_npy_lines([src], one, progress=False, durable=False)
        smstore.pack_npy_lines([src], out, jobs=2, shard_size=20_000, progress=False, durable=False)
    with smstore.open(one) as a, smstore.open(out) as b:
        assert b.shard_count > 2
        assert b.encoding == a.encoding
        assert tl.read_records(a) == tl.read_records(b)


def test_a_bad_line_names_its_file_and_part(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text("".join(f'{{"i": {i}}}\n' for i in range(3000)) + "{bad\n")
    with pytest.raises(PackInputError, match=r"in\.jsonl \(part from byte \d+\):\d+: invalid JSON"):
        smstore.pack_files([src], tmp_path / "ds", format="jsonl", jobs=2, shard_size=8000, progress=False)
    assert not (tmp_path / "ds" / MANIFEST_NAME).exists()
    assert list((tmp_path / "ds").iterdir()) == []  # the shards already written were removed


def test_stdin_cannot_be_split(tmp_path: Path) -> None:
    with pytest.raises(PackInputError, match="stdin"):
        smstore.pack_files(["-"], tmp_path / "ds", jobs=2, progress=False)


def test_input_parts_in_the_core(tmp_path: Path) -> None:
    src = tmp_path / "in.txt"
    src.write_bytes(b"a\nbb\nccc\ndddd")
    w = smstore._core.Writer(os.fspath(tmp_path / "p.smst"), False)
    smstore._core.pack_lines(w, [(os.fspath(src), 2, 9), (os.fspath(src), 9, 13), os.fspath(src)])
    w.finish('{"encoding": "lines"}')
    with smstore.open(tmp_path / "p.smst") as s:
        assert tl.read_records(s) == [b"bb", b"ccc", b"dddd", b"a", b"bb", b"ccc", b"dddd"]
    w = smstore._core.Writer(os.fspath(tmp_path / "q.smst"), False)
    with pytest.raises(PackInputError, match="end before it starts"):
        smstore._core.pack_lines(w, [(os.fspath(src), 5, 2)])
    with pytest.raises(PackInputError, match="part of stdin"):
        smstore._core.pack_lines(w, [("-", 1, 2)])
    with pytest.raises(TypeError, match="list of paths"):
        smstore._core.pack_lines(w, os.fspath(src))
    w.abort()


# ----------------------------------------------------------------------------- reading


def test_global_index_reads_like_one_blob(tmp_path: Path, corpus: tuple[list[Path], list[bytes]]) -> None:
    inputs, expected = corpus
    out = tmp_path / "ds"
    smstore.pack_files(inputs, out, shard_size=20_000, progress=False, durable=False)
    with smstore.open(out / MANIFEST_NAME) as s, smstore.open(tmp_path / "one.smst") as one:
        n = len(s)
        assert s[-1].tobytes() == expected[-1]
        assert s[-n].tobytes() == expected[0]
        with pytest.raises(IndexError):
            s[n]
        with pytest.raises(IndexError):
            s[-n - 1]
        rng = np.random.default_rng(0)
        idx = rng.integers(0, n, 3000)
        assert [bytes(r) for r in s.get_batch(idx)] == [expected[i] for i in idx]
        assert [bytes(r) for r in s.get_batch(list(-idx - 1))] == [expected[i] for i in n - idx - 1]
        data, offs = s.gather(idx)
        d1, o1 = one.gather(idx)
        assert np.array_equal(data, d1)
        assert np.array_equal(offs, o1)
        starts = s.starts
        for i in (0, starts[1] - 1, starts[1], n - 1):
            k, j = s.locate(i)
            assert starts[k] <= i < starts[k + 1]
            assert j == i - starts[k]
        assert s.is_shard_open(0)
        assert s.metadata["shards"] == s.shard_count
        assert s.nbytes == one.nbytes
        assert s.encoding == "lines"
        view = s[0]
    assert view.tobytes() == expected[0]  # a record outlives close(), as with one blob
    with pytest.raises(smstore.StoreClosedError):
        s[0]


@pytest.mark.parametrize(
    "sizes",
    [
        [7] * 9,  # shards of one size: locate() divides
        [7] * 8 + [3],  # ... and a shorter last one
        [50],  # one shard
        [7] * 8 + [9],  # a longer last shard: the table
        [7, 0, 7, 7],  # an empty shard
        [0, 5, 5],  # an empty first shard
        [1, 30, 2, 2, 2, 40, 1],  # lopsided
    ],
)
def test_locate_finds_every_record_in_its_shard(sizes: list[int]) -> None:
    import bisect

    starts = [0, *itertools.accumulate(sizes)]
    s = smstore._core.ShardedStore(starts, lambda k: None, "test")
    for i in range(starts[-1]):
        k = bisect.bisect_right(starts, i) - 1
        assert s.locate(i) == (k, i - starts[k]), i


@pytest.mark.parametrize("per", [1, 2, 3, 7, 1000, 2**32 - 1, 2**32 + 1, 2**40 + 3, 3 * 2**59 + 1])
def test_locate_by_reciprocal_is_exact_at_every_scale(per: int) -> None:
    # Shards of `per` records but a shorter last one, up to the largest index a Python int
    # addresses: locate() multiplies by a reciprocal that may undershoot, and corrects by one.
    count = min(1000, (2**63 - 1) // per)
    starts = [k * per for k in range(count)] + [(count - 1) * per + max(1, per // 2)]
    s = smstore._core.ShardedStore(starts, lambda k: None, "test")
    rng = random.Random(per)
    near = [k * per + d for k in (1, 2, count // 2, count - 2, count - 1) for d in (-1, 0, 1)]
    for i in [0, starts[-1] - 1, *near, *(rng.randrange(starts[-1]) for _ in range(2000))]:
        if 0 <= i < starts[-1]:
            assert s.locate(i) == divmod(i, per), i


def test_shard_index_fuzz_target_replays_its_seeds(tmp_path: Path) -> None:
    """The core's ShardIndex alone (no Python, no pybind11): fuzz/fuzz_shard_index.cpp, built with
    the plain compiler and ASan/UBSan where it has them, checks locate() against a binary search
    over the prefix sums on every seed (the fuzz run proper needs clang's libFuzzer)."""
    root = Path(__file__).resolve().parent.parent
    compiler = shutil.which("c++") or pytest.fail("no C++ compiler")
    sources = [
        root / "fuzz" / "fuzz_shard_index.cpp",
        root / "fuzz" / "standalone_main.cpp",
        root / "csrc" / "shard_index.cpp",
    ]
    binary = tmp_path / "fuzz_shard_index"
    flags = ["-std=c++17", "-O1", "-g", "-Wall", "-Wextra", "-Werror", f"-I{root / 'csrc'}"]
    sanitize = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
    built = subprocess.run(
        [compiler, *flags, *sanitize, *sources, "-o", binary], check=False, capture_output=True, text=True
    )
    if built.returncode != 0:  # a toolchain without the sanitizer runtimes
        built = subprocess.run(
            [compiler, *flags, *sources, "-o", binary], check=False, capture_output=True, text=True
        )
    assert built.returncode == 0, built.stderr
    seeds = sorted((root / "fuzz" / "corpus" / "shard_index").iterdir())
    assert len(seeds) >= 10
    r = subprocess.run([binary, *seeds], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{len(seeds)} inputs ran\n"


def test_shards_open_lazily(tmp_path: Path, corpus: tuple[list[Path], list[bytes]]) -> None:
    inputs, expected = corpus
    smstore.pack_files(inputs, tmp_path / "ds", shard_size=10_000, progress=False, durable=False)
    with smstore.open(tmp_path / "ds") as s:
        assert not any(s.is_shard_open(k) for k in range(s.shard_count))
        k, _ = s.locate(len(s) // 2)
        assert bytes(s[len(s) // 2]) == expected[len(s) // 2]
        assert [s.is_shard_open(j) for j in range(s.shard_count)].count(True) == 1
        assert s.is_shard_open(k)


def test_objects_in_shards(tmp_path: Path) -> None:
    objs = [tl.annotation(i) for i in range(3000)]
    with smstore.ShardedWriter(tmp_path / "ds", encoding="pickle", shard_records=700, durable=False) as w:
        assert w.extend(pickle.dumps(o, protocol=5) for o in objs) == 3000
    with smstore.open(tmp_path / "ds") as s:
        assert isinstance(s, smstore.ShardedObjectStore)
        assert s.shard_sizes == [700, 700, 700, 700, 200]
        assert s[1234] == objs[1234]
        assert s.get_batch([5, 2999]) == [objs[5], objs[2999]]
        assert list(s) == objs
        assert pickle.loads(s.raw(7)) == objs[7]
    ds = SharedStoreDataset(tmp_path / "ds")  # decode="auto": objects
    assert ds[2500] == objs[2500]


def test_sharded_writer_sizes_and_abort(tmp_path: Path) -> None:
    out = tmp_path / "ds"
    with smstore.ShardedWriter(out, shard_size=1000, durable=False, check_every=1) as w:
        for i in range(500):
            w.append(b"%05d" % i * 10)  # 50 bytes a record: 20 a shard
    with smstore.open(out) as s:
        assert s.shard_sizes == [20] * 25
        assert bytes(s[499]) == b"00499" * 10
        first = tl.read_records(s)

    # An exception inside the block removes the new shards and keeps the previous dataset whole.
    def fail_midway() -> None:
        with smstore.ShardedWriter(out, shard_records=7, durable=False) as w:
            w.extend(b"new" for _ in range(100))
            raise RuntimeError

    with pytest.raises(RuntimeError):
        fail_midway()
    with smstore.open(out, verify=True) as s:
        assert tl.read_records(s) == first
    assert len(list(out.iterdir())) == 26


def test_repacking_replaces_the_dataset_and_its_shards(
    tmp_path: Path, corpus: tuple[list[Path], list[bytes]]
) -> None:
    inputs, expected = corpus
    out = tmp_path / "ds"
    smstore.pack_files(inputs, out, shard_size=20_000, progress=False, durable=False)
    old = read_manifest(out)
    held = smstore.open(out)
    held_views = [held[0], held[len(held) - 1]]
    smstore.pack_files(inputs[:1], out, jobs=2, progress=False, durable=False)
    new = read_manifest(out)
    assert {s.path for s in old.shards}.isdisjoint(s.path for s in new.shards)
    assert sorted(os.listdir(out)) == sorted([MANIFEST_NAME, *(s.path for s in new.shards)])
    assert [v.tobytes() for v in held_views] == [expected[0], expected[-1]]  # mapped shards live on
    held.close()


# Run in a child: `smstore pack -j 2` with the packer of its third part held until the test has
# signalled it. Parts 0 and 1 start at once on the two threads; part 2 starts only once one of them
# has published its shard, so "held" means shards are being written, whatever the machine's load.
# The hold is in this test only: the child sets it up before it runs the command line.
_HELD_PACK = """
import signal, sys, threading
from smstore import _core, cli

signalled = threading.Event()

def on_sigint(signum, frame):
    signalled.set()  # lets the held part go on, as a part still running when ^C comes would
    signal.default_int_handler(signum, frame)  # KeyboardInterrupt in the main thread

signal.signal(signal.SIGINT, on_sigint)
real, calls, lock = _core.pack_lines, [], threading.Lock()

def pack_lines(*args):
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # the main thread takes the signal
    with lock:
        calls.append(None)
        k = len(calls) - 1
    if k == 2:
        print("held", flush=True)
        signalled.wait()
    return real(*args)

_core.pack_lines = pack_lines
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGINT])
def test_interrupted_parallel_pack_keeps_the_previous_dataset(tmp_path: Path, signum: int) -> None:
    src = tmp_path / "big.txt"
    src.write_bytes(b"".join(b"%d:%s\n" % (i, b"x" * (i % 97)) for i in range(20_000)))
    out = tmp_path / "ds"
    smstore.pack_files([src], out, shard_size=100_000, progress=False, durable=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    args = ["pack", os.fspath(src), os.fspath(src), "-o", os.fspath(out), "-j", "2", "--shard-size", "100K"]
    with subprocess.Popen(
        [sys.executable, "-c", _HELD_PACK, *args, "-q", "--no-fsync"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tl.SAFE_CWD,
    ) as proc:
        assert proc.stdout is not None
        assert proc.stderr is not None
        held = proc.stdout.readline()  # no deadline: the child either holds part 2 or exits
        assert held == b"held\n", proc.stderr.read().decode()
        new = [p.name for p in out.iterdir() if p.name not in before]
        assert any(n.startswith("part-") for n in new), new  # a shard of this run is in place
        proc.send_signal(signum)
        proc.wait(timeout=300)  # not a race: only a hang guard
        err = proc.stderr.read().decode()
    if signum == signal.SIGINT:
        assert proc.returncode == 130, err
        assert "smstore pack: interrupted" in err
        assert sorted(os.listdir(out)) == sorted(before)  # every shard of the run removed
    else:
        assert proc.returncode == -signal.SIGKILL
    with smstore.open(out, verify=True) as s:
        assert {k: (out / k).read_bytes() for k in before} == before
        assert len(s) == 20_000


# ----------------------------------------------------------------------------- errors


@pytest.fixture
def dataset(tmp_path: Path, corpus: tuple[list[Path], list[bytes]]) -> Path:
    inputs, _ = corpus
    out = tmp_path / "ds"
    smstore.pack_files(inputs, out, shard_size=20_000, progress=False, durable=False)
    return out


def test_missing_shard_is_named(dataset: Path) -> None:
    victim = sorted(p for p in dataset.iterdir() if p.suffix == ".smst")[2]
    victim.unlink()
    with pytest.raises(StoreNotFoundError, match=rf"manifest\.json: shard 2 \(.*{victim.name}\) is missing"):
        smstore.open(dataset)
    # Without the up-front check it is found on first use of that shard, and named the same way.
    s = smstore.ShardedStore(dataset, check_files=False)
    s[0]
    with pytest.raises(StoreNotFoundError, match=rf"shard 2 \(.*{victim.name}\) is missing"):
        s[s.starts[2]]


def test_open_stats_each_shard_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A manifest naming one file as many shards (a Repeat at the size of a dataset) stats it once
    at open; a missing or resized file is still named at open, as its first shard."""
    shard = tmp_path / "ds" / "shard.smst"
    shard.parent.mkdir()
    smstore.pack([b"abc", b"de"], shard, durable=False)
    info, encoding = describe_shard(shard, stored_path="shard.smst")
    write_manifest(shard.parent / MANIFEST_NAME, encoding, [info] * 50, durable=False)
    stats: list[str] = []
    real_stat = os.stat

    def counting_stat(path: str | os.PathLike[str], *args: object, **kwargs: object) -> os.stat_result:
        stats.append(os.fspath(path))
        return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "stat", counting_stat)
    with smstore.open(shard.parent) as s:
        assert len(s) == 100
        assert bytes(s[99]) == b"de"
    assert stats.count(os.fspath(shard)) == 1, stats
    monkeypatch.undo()
    shard.write_bytes(shard.read_bytes() + b"\0")
    with pytest.raises(
        StoreChangedError, match=r"shard 0 \(.*shard\.smst\) is \d+ bytes, the manifest records"
    ):
        smstore.open(shard.parent)
    shard.unlink()
    with pytest.raises(StoreNotFoundError, match=r"manifest\.json: shard 0 \(.*shard\.smst\) is missing"):
        smstore.open(shard.parent)


def test_shard_of_another_dataset_is_refused(tmp_path: Path, dataset: Path) -> None:
    """A shard swapped for another of the same size (another dataset's): caught by its checksum."""
    shards = sorted(p for p in dataset.iterdir() if p.suffix == ".smst")
    m = read_manifest(dataset)
    victim = shards[1]
    blob = bytearray(victim.read_bytes())
    blob[4096] ^= 0x01  # other records, same size, a valid blob with its own checksum
    victim.write_bytes(tl.reseal(blob))
    with smstore.open(dataset) as s:  # sizes agree: the stat check cannot tell
        with pytest.raises(
            StoreChangedError,
            match=rf"shard 1 .* holds checksum [0-9a-f]{{16}}, the manifest records {m.shards[1].checksum}",
        ):
            s[s.starts[1]]
        assert bytes(s[0])  # other shards still read
    smaller = tmp_path / "other.smst"
    smstore.pack([b"x"], smaller)
    shutil.copyfile(smaller, shards[3])
    with pytest.raises(StoreChangedError, match=r"shard 3 .* is \d+ bytes, the manifest records \d+"):
        smstore.open(dataset)
    verify = subprocess.run(
        [sys.executable, "-m", "smstore", "verify", os.fspath(dataset)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert verify.returncode == 1
    assert "shard 3" in verify.stderr


def _add(doc: dict, key: str, extra: int, *shards: int) -> None:
    """Add `extra` to `key` of the given shards, and to the dataset's total (so only the size is wrong)."""
    for k in shards:
        doc["shards"][k][key] += extra
    if key in doc:
        doc[key] += extra * len(shards)


# Integers a 64-bit reader cannot hold (they once raised OverflowError or TypeError), alone or summed.
HUGE_INTEGERS = [
    (lambda d: _add(d, "records", 2**63, 1), r"shards\[1\]\.records must be an integer >= 0 and < 2\*\*63"),
    (lambda d: _add(d, "records", 2**64, 0), r"shards\[0\]\.records must be an integer"),
    (lambda d: _add(d, "data_bytes", 2**64, 2), r"shards\[2\]\.data_bytes must be an integer"),
    (lambda d: _add(d, "file_size", 2**63, 0), r"shards\[0\]\.file_size must be an integer >= 4096 and < 2"),
    (
        lambda d: d.update(records=2**63),
        r"records must be an integer >= 0 and < 2\*\*63, not 9223372036854775808",
    ),
    (lambda d: d.update(data_bytes=-1), r"data_bytes must be an integer >= 0"),
    (lambda d: _add(d, "records", 2**62, 0, 1), r"the shards' records add up to \d+, more than 2\*\*63 - 1"),
    (lambda d: _add(d, "data_bytes", 2**62, 0, 1), r"the shards' data_bytes add up to \d+, more than"),
    (lambda d: _add(d, "file_size", 2**62, 1, 2), r"the shards' file_size add up to \d+, more than"),
]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(format="nope"), 'no "format"'),
        (lambda d: d.update(version=99), "manifest version 99 is newer"),
        (lambda d: d["shards"][1].update(records=-1), r"shards\[1\]\.records must be an integer >= 0"),
        (lambda d: d["shards"][0].update(checksum="XYZ"), r"shards\[0\]\.checksum must be 16"),
        (lambda d: d["shards"][1].update(records=True), r"shards\[1\]\.records must be an integer >= 0"),
        (lambda d: d["shards"][1].pop("file_size"), r"shards\[1\]\.file_size must be an integer >= 4096"),
        (lambda d: d["shards"].__setitem__(2, []), r"shards\[2\] must be an object"),
        (lambda d: d["shards"][2].update(path="a\0b"), r"shards\[2\]\.path must be a non-empty path"),
        (lambda d: d["shards"][2].update(path=""), r"shards\[2\]\.path"),
        (lambda d: d.update(records=d["records"] + 1), "records is .* its shards add up to"),
        (lambda d: d.update(shards={}), "shards must be a list"),
        (lambda d: d["shards"][0].update(records=d["shards"][0]["records"] + 1), "add up to"),
        *HUGE_INTEGERS,
    ],
)
def test_malformed_manifest_names_the_field(
    dataset: Path, edit: Callable[[dict], None], message: str
) -> None:
    path = dataset / MANIFEST_NAME
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises((StoreFormatError, StoreVersionError), match=message) as err:
        smstore.open(dataset)
    assert "manifest.json" in str(err.value)


@pytest.mark.parametrize(("edit", "message"), HUGE_INTEGERS)
def test_huge_manifest_integers_are_named_by_info_and_verify(
    dataset: Path, edit: Callable[[dict], None], message: str
) -> None:
    """Counts past what 64-bit code holds: a StoreFormatError naming the field, never a traceback."""
    path = dataset / MANIFEST_NAME
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    for command in ("info", "verify"):
        r = subprocess.run(
            [sys.executable, "-m", "smstore", command, os.fspath(dataset)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=tl.SAFE_CWD,
        )
        assert r.returncode == 1, r.stderr
        assert "Traceback" not in r.stderr
        assert re.search(message, r.stderr), r.stderr
        assert "manifest.json: not a valid smstore manifest" in r.stderr


def test_manifest_count_disagreeing_with_its_shard(dataset: Path) -> None:
    path = dataset / MANIFEST_NAME
    doc = json.loads(path.read_text())
    doc["shards"][0]["records"] += 1
    doc["shards"][1]["records"] -= 1
    path.write_text(json.dumps(doc))
    with (
        smstore.open(dataset) as s,
        pytest.raises(StoreFormatError, match=r"shard 0 has \d+ records, the manifest says"),
    ):
        s[0]


def test_truncated_or_garbage_manifest(dataset: Path) -> None:
    path = dataset / MANIFEST_NAME
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(StoreFormatError, match="invalid JSON"):
        smstore.open(dataset)


# ----------------------------------------------------------------------------- join


def test_join_shards_written_anywhere(tmp_path: Path, corpus: tuple[list[Path], list[bytes]]) -> None:
    inputs, expected = corpus
    parts = plan_parts([os.fspath(p) for p in inputs], 30_000)
    places = []
    for k, part in enumerate(parts):  # as separate machines would: each its own directory
        where = tmp_path / f"node{k % 3}" / f"shard{k}.smst"
        where.parent.mkdir(exist_ok=True)
        w = smstore._core.Writer(os.fspath(where), False)
        smstore._core.pack_lines(w, part)
        w.finish('{"encoding": "lines"}')
        places.append(where)
    inodes = {p.stat().st_ino for p in places}
    out = tmp_path / "node0" / "joined.json"
    manifest = smstore.join(places, out, metadata={"run": "7"}, verify=True)
    assert manifest.records == len(expected)
    assert {p.stat().st_ino for p in places} == inodes  # no record copied
    stored = [s.path for s in manifest.shards]
    assert stored[0] == "shard0.smst"
    assert os.path.isabs(stored[1])
    with smstore.open(out) as s:
        assert tl.read_records(s) == expected
        assert s.metadata["user"] == {"run": "7"}
    # A join of joins (and of blobs) flattens in order.
    again = smstore.join([out, places[0]], tmp_path / "again.json")
    assert again.records == len(expected) + manifest.shards[0].records
    with smstore.open(tmp_path / "again.json") as s:
        assert tl.read_records(s)[len(expected) :] == expected[: manifest.shards[0].records]


def test_join_refuses_mixed_encodings_and_non_blobs(tmp_path: Path) -> None:
    a, b = tmp_path / "a.smst", tmp_path / "b.smst"
    smstore.pack([b"1"], a, encoding="bytes")
    smstore.pack_objects([{"x": 1}], b)
    with pytest.raises(
        PackInputError, match=r"b\.smst: records are encoded as 'pickle', but .*a\.smst holds 'bytes'"
    ):
        smstore.join([a, b], tmp_path / "m.json")
    junk = tmp_path / "junk.smst"
    junk.write_bytes(b"not a blob" * 1000)
    with pytest.raises(StoreFormatError, match=r"junk\.smst: not an smstore blob"):
        smstore.join([a, junk], tmp_path / "m.json")
    truncated = tmp_path / "cut.smst"
    truncated.write_bytes(a.read_bytes()[:-3])
    with pytest.raises(
        StoreTruncatedError, match=r"cut\.smst: truncated: file is \d+ bytes, header says \d+"
    ):
        smstore.join([truncated], tmp_path / "m.json")
    assert not (tmp_path / "m.json").exists()
    with pytest.raises(PackInputError, match="at least one"):
        smstore.join([], tmp_path / "m.json")


# ----------------------------------------------------------------------------- torch and the daemon


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_dataloader_workers_read_every_record(
    tmp_path: Path, corpus: tuple[list[Path], list[bytes]], start_method: str
) -> None:
    inputs, expected = corpus
    smstore.pack_files(inputs, tmp_path / "ds", jobs=2, shard_size=20_000, progress=False, durable=False)
    ds = SharedStoreDataset(tmp_path / "ds", decode="bytes")
    assert ds.shard_sizes == smstore.open(tmp_path / "ds").shard_sizes
    assert sum(ds.shard_sizes) == len(ds)
    sampler = smstore.GlobalShuffleSampler(len(ds), seed=3, rank=0, world_size=1)
    loader = DataLoader(
        ds,
        batch_size=64,
        sampler=sampler,
        num_workers=2,
        collate_fn=tl.identity_collate,
        multiprocessing_context=start_method,
    )
    got = {}
    order = list(sampler)
    for batch in loader:
        for rec in batch:
            got[len(got)] = rec
    assert [got[k] for k in range(len(order))] == [expected[i] for i in order]


def test_token_collator_over_shards(tmp_path: Path) -> None:
    src = tmp_path / "tok.txt"
    rng = random.Random(1)
    lines = [[rng.randrange(1000) for _ in range(rng.randrange(1, 30))] for _ in range(2000)]
    src.write_text("".join(" ".join(map(str, x)) + "\n" for x in lines))
    smstore.pack_npy_lines([src], tmp_path / "ds", jobs=2, shard_size=5000, progress=False)
    collate = smstore.TokenCollator(tmp_path / "ds", pad_value=-1)
    out = collate([0, 1999, 1000])
    ids = out["tokens"]
    for row, i in zip(ids.tolist(), [0, 1999, 1000], strict=True):
        assert row[: len(lines[i])] == lines[i]


def test_daemon_serves_every_shard_through_one_connection(
    tmp_path: Path, corpus: tuple[list[Path], list[bytes]], start_daemon: Callable[..., Daemon]
) -> None:
    inputs, expected = corpus
    out = tmp_path / "ds"
    smstore.pack_files(inputs, out, shard_size=20_000, progress=False, durable=False)
    m = read_manifest(out)
    d = start_daemon(out, loaded=len(m.shards))
    assert {s["checksum"] for s in d.status()["segments"]} == {s.checksum for s in m.shards}
    # The worker's view: every shard attached from the daemon, by the manifest's checksums.
    code = (
        "import sys, pickle, smstore\n"
        "ds = pickle.loads(pickle.dumps(smstore.SharedStoreDataset(sys.argv[1], mode='daemon', decode='bytes')))\n"
        "recs = [ds[i] for i in range(len(ds))]\n"
        "store = ds.store\n"
        "kinds = {type(store.shard(k)).__name__ for k in range(store.shard_count)}\n"
        "print(*kinds, len(recs), flush=True)\n"
        "sys.stdin.readline()\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", code, os.fspath(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=tl.SAFE_CWD,
    ) as proc:
        assert proc.stdout is not None
        assert proc.stdin is not None
        try:
            line = proc.stdout.readline()
            assert line.split() == ["DaemonStore", str(len(expected))]
            segs = d.status()["segments"]
            assert all(s["clients"] == [proc.pid] for s in segs)
            fds = os.listdir(f"/proc/{proc.pid}/fd")
            sockets = [f for f in fds if os.readlink(f"/proc/{proc.pid}/fd/{f}").startswith("socket:")]
            # One connection attaches every shard for the reads (and may wait for a load); the
            # pre-attaching thread's attaches and every detach go through a second that never waits,
            # and the thread's question (`held`, parked by the daemon until the holds change) has a
            # third: a parked question must not delay a detach. Per process and dataset, not per shard.
            assert len(sockets) <= 3
            proc.stdin.write("\n")
            proc.stdin.flush()
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    # In this process: byte-exact through the daemon.
    with smstore.open_store(out, mode="daemon") as s:
        assert tl.read_records(s) == expected
    res = cli("unload", os.fspath(out), sock=d.sock)
    assert res.returncode == 0
    assert d.status()["segments"] == []


def test_cli_pack_info_verify_get_join(tmp_path: Path, corpus: tuple[list[Path], list[bytes]]) -> None:
    inputs, expected = corpus

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "smstore", *args],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tl.SAFE_CWD,
        )

    out = tmp_path / "ds"
    r = run(
        "pack", *map(os.fspath, inputs), "-o", os.fspath(out), "-j", "2", "--shard-size", "20K", "--no-fsync"
    )
    assert r.returncode == 0, r.stderr
    assert "shards)" in r.stderr
    info = json.loads(run("info", "--json", os.fspath(out)).stdout)
    assert info["records"] == len(expected)
    assert info["shards"] > 2
    assert info["checksum"].startswith("manifest:")
    assert run("verify", os.fspath(out)).returncode == 0
    got = subprocess.run(
        [sys.executable, "-m", "smstore", "get", os.fspath(out), "0", "-1", "-n"],
        capture_output=True,
        check=True,
    ).stdout
    assert got == expected[0] + b"\n" + expected[-1] + b"\n"
    shards = sorted(p for p in out.iterdir() if p.suffix == ".smst")
    r = run("join", *map(os.fspath, shards[::-1]), "-o", os.fspath(tmp_path / "rev.json"), "--meta", "k=v")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "rev.json").read_text())["user"] == {"k": "v"}
    assert run("pack", os.fspath(inputs[0]), "-o", os.fspath(tmp_path / "x"), "-j", "0").returncode == 2


def test_fifos_never_block(tmp_path: Path) -> None:
    """Looking at a path to tell a manifest from a blob, or joining it, must not open a FIFO for a writer."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(smstore.StoreError):
        smstore.open(fifo)
    with pytest.raises(smstore.StoreFormatError, match="fifo: not a regular file"):  # as smstore.Store says
        smstore.join([fifo], tmp_path / "m.json")


def test_record_views_keep_their_shard_mapped(tmp_path: Path, corpus: tuple[list[Path], list[bytes]]) -> None:
    """Record views of many shards outlive the store, the shard objects and the files themselves."""
    import gc

    inputs, expected = corpus
    out = tmp_path / "ds"
    smstore.pack_files(inputs, out, shard_size=10_000, progress=False, durable=False)
    s = smstore.open(out)
    picks = [0, s.starts[1], s.starts[2] + 1, len(s) - 1]
    views = [s[i] for i in picks]  # made under different arenas as shards open one by one
    s.shard(1).close()  # closing a shard's own Store object does not pull the memory away
    assert bytes(s[picks[1]]) == expected[picks[1]]
    s.close()
    shutil.rmtree(out)
    gc.collect()
    assert [v.tobytes() for v in views] == [expected[i] for i in picks]
    with pytest.raises(smstore.StoreClosedError):
        s[0]


# --- where each shard's bytes are: decided once, when the manifest is read --------------------------


def test_a_manifest_gives_each_shard_its_source(tmp_path: Path) -> None:
    """Local shards are LocalFiles knowing their size, checksum, header and ranges; a shard named by
    URL is a RemoteObject (nothing fetched to say so), and reading it without the daemon raises the
    one error."""
    from smstore.format.manifest import LocalFile, RemoteObject, source_of

    src = tmp_path / "in.txt"
    write_lines(src, 3000)
    out = tmp_path / "ds"
    smstore.pack_files([src], out, shard_size=src.stat().st_size // 3 + 1, progress=False, durable=False)
    m = read_manifest(out)
    assert not m.remote
    assert len(m.sources) == len(m.shards) > 1
    for k, (shard, source) in enumerate(zip(m.shards, m.sources, strict=True)):
        assert isinstance(source, LocalFile)
        assert not source.remote
        assert source.location == m.shard_path(k) == os.path.join(out, shard.path)
        assert (source.size, source.checksum) == (shard.file_size, shard.checksum)
        header = source.header()
        assert (header.file_size, header.checksum) == (shard.file_size, shard.checksum)
        assert source.read_range(100, 200) == Path(source.location).read_bytes()[100:200]
        source.require_daemon("a shard")  # a local file needs none
    # The same shards named by URL: objects, decided from the manifest alone.
    doc = json.loads((out / MANIFEST_NAME).read_text())
    for entry in doc["shards"]:
        entry["path"] = f"s3://a-bucket/ds/{entry['path']}"
    (out / MANIFEST_NAME).write_text(json.dumps(doc))
    m = read_manifest(out)
    assert all(isinstance(s, RemoteObject) and s.remote for s in m.sources)
    assert m.sources[0].location == doc["shards"][0]["path"]
    with pytest.raises(
        smstore.RemoteNeedsDaemonError, match=r"s3://a-bucket/ds/.*: a shard in object storage"
    ):
        m.sources[0].require_daemon("a shard")
    # A user's string: a URL as it is, a path made absolute.
    assert source_of("s3://a-bucket/x.smst") == RemoteObject("s3://a-bucket/x.smst")
    assert source_of(os.path.relpath(src)) == LocalFile(os.fspath(src))
