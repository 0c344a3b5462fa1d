"""WebDataset tars -> wds records: each record what wds.WebDataset yields for the sample, byte for byte.

The reference is webdataset itself: tars written by its TarWriter (and by tarfile, for names
TarWriter would not write), read back with ``wds.WebDataset(urls, shardshuffle=False)``. Hostile
tars are built here byte by byte (GNU sparse headers, sizes past the end, header chains), and
the ones that could exhaust memory are converted in a child process with its address space capped.
"""

from __future__ import annotations

import bz2
import gc
import io
import json
import lzma
import os
import subprocess
import sys
import tarfile
import tracemalloc
import warnings
import zlib
from pathlib import Path
from typing import Any

import pytest
import smstore_testlib as tl

import smstore
from smstore import PackInputError
from smstore.convert import convert_webdataset
from smstore.convert.webdataset import iter_samples
from smstore.format.samples import encode_sample

wds = pytest.importorskip("webdataset")

GNU, PAX = tarfile.GNU_FORMAT, tarfile.PAX_FORMAT


def theirs(tars: list[Path]) -> list[dict[str, bytes]]:
    """What wds.WebDataset yields, as smstore stores it: ``__key__`` as the name's bytes, no ``__url__``."""
    out = []
    error = None
    with warnings.catch_warnings():
        # webdataset leaves its shards open for gc to close: here, not in some later test.
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            for s in wds.WebDataset([os.fspath(t) for t in tars], shardshuffle=False):
                d = {k: v for k, v in s.items() if k not in ("__url__", "__local_path__")}
                d["__key__"] = d["__key__"].encode("utf-8", "surrogateescape")
                out.append(d)
        except ValueError as e:
            error = str(e)  # raised below, once its traceback (holding the open shard) is gone
        gc.collect()
    if error is not None:
        raise ValueError(error)
    return out


def assert_same_as_webdataset(tars: list[Path], out: Path) -> list[dict[str, bytes]]:
    """Convert `tars` and compare every record with webdataset's sample, raw bytes included."""
    want = theirs(tars)
    stats = convert_webdataset(tars, out, durable=False, progress=False)
    assert stats.records == len(want)
    with smstore.Store(out) as s:
        raw = [bytes(r) for r in s]
    with smstore.open(out) as s:
        assert s.encoding == "wds"
        got = list(s)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"sample {i}"
        # The record itself: __key__ first, then the members in the tar's order.
        assert raw[i] == encode_sample(w), f"record {i}"
    return want


def member(name: str, data: bytes = b"", fmt: int = GNU, type: bytes = tarfile.REGTYPE, **kw: Any) -> bytes:
    """One member's header(s) and data, as tarfile writes them (names may hold surrogate escapes)."""
    info = tarfile.TarInfo(name)
    info.type = type
    info.size = len(data) if type in (tarfile.REGTYPE, tarfile.CONTTYPE, b"Z") else 0
    for k, v in kw.items():
        setattr(info, k, v)
    pad = b"\0" * (-len(data) % 512)
    return info.tobuf(fmt, "utf-8", "surrogateescape") + (data + pad if info.size else b"")


END = b"\0" * 1024  # the end-of-archive marker


def write_tar(path: Path, *members: bytes, end: bool = True) -> Path:
    path.write_bytes(b"".join(members) + (END if end else b""))
    return path


def header_checksum(block: bytearray) -> None:
    """Set a 512-byte header's checksum (the sum of its bytes, the checksum field read as spaces)."""
    block[148:156] = b" " * 8
    block[148:155] = b"%06o\0" % sum(block[:512])


# ----------------------------------------------------------------------------- fidelity


def test_tarwriter_shards_read_as_webdataset_reads_them(tmp_path: Path) -> None:
    tars = []
    n = 0
    for shard in range(3):
        path = tmp_path / f"train-{shard:04d}.tar"
        with wds.TarWriter(os.fspath(path), encoder=False) as sink:
            if shard:
                # The shard before ended with this key: still two samples, one per shard.
                sink.write({"__key__": "same", "txt": b"start of shard %d" % shard})
            for _ in range(150):
                s: dict[str, Any] = {
                    "__key__": f"s{n:06d}",
                    "jpg": os.urandom(n * 37 % 3000),
                    "cls": b"%d" % n,
                }
                if n % 3 == 0:
                    s["seg.png"] = os.urandom(n % 700)  # extensions with dots
                if n % 5 == 0:
                    s["JSON"] = b'{"n": %d}' % n  # upper case: WebDataset lower-cases it
                if n % 7 == 0:
                    s["txt"] = b""  # an empty member
                if n % 11 == 0:
                    s["__key__"] = f"dir {n}/ünï cödé {n}"  # spaces, a folder, non-ASCII
                n += 1
                sink.write(s)
            sink.write({"__key__": "same", "bin": b"end of shard %d" % shard})
            sink.write({"__key__": "same", "cls": b"again"})  # one key in two writes: one sample
        tars.append(path)
    for compression in ("gz", "bz2", "xz"):  # TarWriter compresses by the name's suffix
        path = tmp_path / f"train-{compression}.tar.{compression}"
        with wds.TarWriter(os.fspath(path), encoder=False) as sink:
            for i in range(40):
                sink.write({"__key__": f"{compression}{i}", "bin": os.urandom(i * 100), "Cls": b"%d" % i})
        tars.append(path)
    want = assert_same_as_webdataset(tars, tmp_path / "w.smst")
    assert len(want) == 3 * 150 + 5 + 3 * 40
    assert want[-1] == {"__key__": b"xz39", "bin": want[-1]["bin"], "cls": b"39"}
    assert want[5]["json"] == b'{"n": 5}'
    assert "seg.png" in want[9]
    assert want[11]["__key__"] == "dir 11/ünï cödé 11".encode()
    assert want[150:152] == [
        {"__key__": b"same", "bin": b"end of shard 0", "cls": b"again"},
        {"__key__": b"same", "txt": b"start of shard 1"},
    ]


# Odd names, with what webdataset makes of them (the test checks the list against webdataset too).
ODD = [
    ("a.jpg", "a", "jpg"),
    ("a.CLS", "a", "cls"),  # lower-cased
    ("README", None, None),  # no extension: skipped, and `a` goes on
    ("a.Seg.PNG", "a", "seg.png"),  # everything after the first dot of the file name
    ("dir.x/b", None, None),  # the dot is in the folder's name: skipped
    ("dir.x/b.txt", "dir.x/b", "txt"),
    (".hidden.txt", None, None),  # a name that starts with a dot: no key, skipped
    ("d/.h.txt", "d/", "h.txt"),  # ... but in a folder the key is the folder
    ("__meta__/z.txt", None, None),  # metadata, skipped
    ("__x__", None, None),
    ("___", None, None),
    ("__abc__.txt", "__abc__", "txt"),  # not metadata: the name does not end in __
    ("e.", "e", ""),  # an empty extension
    ("e.tar.gz", "e", "tar.gz"),
    ("sp ace/ü ñ.Txt", "sp ace/ü ñ", "txt"),
    ("./f.cls", "./f", "cls"),
    ("/abs/g.bin", "/abs/g", "bin"),
    ("nl\n.txt", "nl\n", "txt"),  # newlines: base_plus_ext's `.` does not match them
    ("h.t\nxt", "h", "t\nxt"),
    ("i.__foo__", "i", "__foo__"),  # an extension in dunder form is an ordinary member
    ("j" * 300 + ".long", "j" * 300, "long"),  # a GNU long name or a pax path
    ("q" * 60_000 + ".bin", "q" * 60_000, "bin"),  # a 60 KB key
]


@pytest.mark.parametrize("fmt", [GNU, PAX], ids=["gnu", "pax"])
def test_odd_names_group_as_webdataset_groups_them(tmp_path: Path, fmt: int) -> None:
    members = []
    for i, (name, _, _) in enumerate(ODD):
        members.append(member(name, b"%d:" % i + name.encode(), fmt))
    # Members WebDataset skips, with data or not, between two members of one sample.
    members += [
        member("k.txt", b"k", fmt),
        member("k.dir", fmt=fmt, type=tarfile.DIRTYPE),
        member("k.sym", fmt=fmt, type=tarfile.SYMTYPE, linkname="k.txt"),
        member("k.hard", fmt=fmt, type=tarfile.LNKTYPE, linkname="k.txt"),
        member("k.chr", fmt=fmt, type=tarfile.CHRTYPE, devmajor=1, devminor=3),
        member("k.fifo", fmt=fmt, type=tarfile.FIFOTYPE),
        member("k.weird", b"a type tarfile does not know" * 50, fmt, type=b"Z"),
        member("k.cont", b"contiguous: a regular file", fmt, type=tarfile.CONTTYPE),
        member("k.cls", b"7", fmt),
    ]
    src = write_tar(tmp_path / "odd.tar", *members)
    want = assert_same_as_webdataset([src], tmp_path / "odd.smst")
    # The reference read these names as the table says (so the test exercised what it claims).
    expected: dict[str, list[str]] = {}
    for _, key, ext in ODD:
        if key is not None and ext is not None:
            expected.setdefault(key, []).append(ext)
    expected["k"] = ["txt", "cont", "cls"]
    assert [(w["__key__"].decode(), [e for e in w if e != "__key__"]) for w in want] == list(expected.items())


def test_names_that_are_not_utf8(tmp_path: Path) -> None:
    # tarfile reads such names with surrogate escapes (webdataset's __key__ holds them so); the key is
    # stored as the name's own bytes. An extension must be UTF-8 to name a member of a wds record.
    src = write_tar(
        tmp_path / "latin1.tar",
        member("caf\udce9.jpg", b"latin-1 key"),  # b"caf\xe9.jpg": "café" in latin-1
        member("caf\udce9.cls", b"1"),
        member("ok.txt", b"2"),
    )
    want = assert_same_as_webdataset([src], tmp_path / "l.smst")
    assert want[0]["__key__"] == b"caf\xe9"
    bad = write_tar(tmp_path / "bad.tar", member("ok.txt", b"2"), member("k.caf\udce9", b"latin-1 extension"))
    assert theirs([bad])[1] == {"__key__": b"k", "caf\udce9": b"latin-1 extension"}  # webdataset reads it
    with pytest.raises(
        PackInputError, match=r"bad\.tar: member 'k\.caf\\udce9': its extension 'caf\\udce9' is not UTF-8"
    ):
        convert_webdataset([bad], tmp_path / "o.smst", progress=False)
    assert not (tmp_path / "o.smst").exists()


def test_duplicate_and_reserved_extensions_are_refused(tmp_path: Path) -> None:
    dup = write_tar(tmp_path / "dup.tar", member("a.jpg", b"1"), member("a.JPG", b"2"))
    with pytest.raises(ValueError, match="duplicate"):
        theirs([dup])  # webdataset refuses it too
    with pytest.raises(
        PackInputError,
        match=r"dup\.tar: member 'a\.JPG': sample 'a' already has a member with extension 'jpg'",
    ):
        convert_webdataset([dup], tmp_path / "o.smst", progress=False)
    # Names webdataset sets itself: __key__ and __url__ collide there; __local_path__ is overwritten.
    for ext in ("__key__", "__URL__", "__local_path__"):
        src = write_tar(tmp_path / "r.tar", member("a.jpg", b"1"), member(f"a.{ext}", b"2"))
        with pytest.raises(
            PackInputError,
            match=rf"r\.tar: member 'a\.{ext}': extension '{ext.lower()}' is a name WebDataset gives",
        ):
            convert_webdataset([src], tmp_path / "o.smst", progress=False)


# ----------------------------------------------------------------------------- memory and time

# Converts each tar in a child whose address space is capped at 1 GiB (a MemoryError or a kill
# shows as such, not as the test runner's death); one JSON line per tar.
CAPPED = r"""
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from smstore import PackInputError
from smstore.convert import convert_webdataset

for path in sys.argv[1:]:
    try:
        stats = convert_webdataset([path], path + ".smst", durable=False, progress=False)
        result = {"records": stats.records}
    except PackInputError as e:
        result = {"refused": str(e)}
    except BaseException as e:
        result = {"raw": f"{type(e).__name__}: {e}"}
    print(json.dumps(result), flush=True)
"""


def capped(*tars: Path) -> list[dict[str, Any]]:
    # The timeout only keeps a hang (a regression) from stalling the suite; each tar takes milliseconds.
    r = subprocess.run(
        [sys.executable, "-c", CAPPED, *map(os.fspath, tars)],
        cwd=tl.SAFE_CWD,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


def gnu_sparse(name: str, realsize: int, chunks: list[tuple[int, bytes]]) -> bytes:
    """A GNU sparse member (type S, as `tar --sparse` writes it): a map of data chunks, then their bytes."""
    data = b"".join(d for _, d in chunks)
    info = tarfile.TarInfo(name)
    info.type = tarfile.GNUTYPE_SPARSE
    info.size = len(data)  # the bytes the tar holds; the file's size is `realsize`
    block = bytearray(info.tobuf(GNU))
    assert len(block) == 512
    for i, (offset, d) in enumerate(chunks):
        block[386 + 24 * i : 386 + 24 * (i + 1)] = tarfile.itn(offset, 12, GNU) + tarfile.itn(len(d), 12, GNU)
    block[483:495] = tarfile.itn(realsize, 12, GNU)
    header_checksum(block)
    return bytes(block) + data + b"\0" * (-len(data) % 512)


def pax_sparse(name: str, realsize: int, chunks: list[tuple[int, bytes]]) -> bytes:
    """A GNU sparse member in pax form 1.0 (`tar --sparse --format=posix`): the map leads the data."""
    smap = b"%d\n" % len(chunks) + b"".join(b"%d\n%d\n" % (o, len(d)) for o, d in chunks)
    data = smap + b"\0" * (-len(smap) % 512) + b"".join(d for _, d in chunks)
    info = tarfile.TarInfo(f"./GNUSparseFile.0/{name}")
    info.size = len(data)
    info.pax_headers = {
        "GNU.sparse.major": "1",
        "GNU.sparse.minor": "0",
        "GNU.sparse.name": name,
        "GNU.sparse.realsize": str(realsize),
    }
    return info.tobuf(PAX) + data + b"\0" * (-len(data) % 512)


@pytest.mark.parametrize("form", [gnu_sparse, pax_sparse], ids=["gnu", "pax"])
def test_sparse_member_is_refused_not_expanded(tmp_path: Path, form: Any) -> None:
    # 2 KB of data declaring 64 GiB: expanded in memory, it gave a MemoryError (2 GiB: 4 GB of RSS).
    chunks = [(0, b"head" * 256), ((64 << 30) - 1024, b"tail" * 256)]
    src = write_tar(tmp_path / "sparse.tar", member("s0.jpg", b"ok"), form("s0.bin", 64 << 30, chunks))
    assert src.stat().st_size < 8192
    with tarfile.open(src) as t:  # tarfile reads it as a 64 GiB sparse file: the test built it right
        sparse = t.getmembers()[1]
        assert (sparse.issparse(), sparse.size, sparse.name) == (True, 64 << 30, "s0.bin")
    (result,) = capped(src)
    assert result == {
        "refused": f"{src}: member 's0.bin': a sparse file (GNU tar --sparse): most of its bytes are holes "
        "the tar does not hold, so a few KB can declare any size; smstore does not expand them. "
        "Re-create the tar without --sparse"
    }
    assert not Path(f"{src}.smst").exists()


def gz_bomb(path: Path, size: int) -> Path:
    """A .tar.gz of one member of `size` zero bytes, a thousandth of that on disk.

    Deflate with full flushes resets its state, so every MiB of zeros compresses to the same
    bytes: written once, repeated.
    """
    c = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    head = member("big.bin", fmt=GNU)[:512]
    head = bytearray(head)
    head[124:136] = tarfile.itn(size, 12, GNU)
    header_checksum(head)
    body = [c.compress(bytes(head)) + c.flush(zlib.Z_FULL_FLUSH)]
    mib = c.compress(bytes(1 << 20)) + c.flush(zlib.Z_FULL_FLUSH)
    assert c.compress(bytes(1 << 20)) + c.flush(zlib.Z_FULL_FLUSH) == mib
    body += [mib] * (size >> 20)
    body.append(c.compress(END) + c.flush())
    gzip_header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff"
    path.write_bytes(gzip_header + b"".join(body) + bytes(8))  # tarfile checks neither CRC nor length
    return path


def test_memory_is_bounded_by_what_the_tar_holds(tmp_path: Path) -> None:
    tiny = member("s0.jpg", b"ok")
    # A member that declares 2**80 bytes (base-256) that are not there: skipped members were sought
    # past one 10 KB read at a time, forever; read members end at the end of the file.
    huge_skipped = bytearray(member("s1.weird", b"x" * 10, type=b"Z"))  # a type webdataset skips
    huge_skipped[124:136] = tarfile.itn(1 << 80, 12, GNU)
    header_checksum(huge_skipped)
    huge_read = bytearray(member("s1.bin", b"x" * 10))
    huge_read[124:136] = tarfile.itn(1 << 80, 12, GNU)
    header_checksum(huge_read)
    cases = {
        "skipped.tar": write_tar(tmp_path / "skipped.tar", tiny, bytes(huge_skipped)),
        "read.tar": write_tar(tmp_path / "read.tar", tiny, bytes(huge_read)),
        "bomb.tar.gz": gz_bomb(tmp_path / "bomb.tar.gz", 2 << 30),
    }
    assert cases["bomb.tar.gz"].stat().st_size < 4 << 20
    results = dict(zip(cases, capped(*cases.values()), strict=True))
    assert results["skipped.tar"] == {
        "refused": f"{cases['skipped.tar']}: corrupt or truncated tar after member 's0.jpg': reading member "
        f"'s1.weird': it runs {(1 << 80) - 512 - 1024:,} bytes past the end of the file"
    }
    assert results["read.tar"] == {
        "refused": f"{cases['read.tar']}: corrupt or truncated tar after member 's0.jpg': reading member "
        f"'s1.bin': unexpected end of data (1,536 of {1 << 80:,} bytes)"
    }
    # 2 GiB of zeros are a real member, but not one this process can hold.
    assert results["bomb.tar.gz"] == {
        "refused": f"{cases['bomb.tar.gz']}: member 'big.bin': its 2,147,483,648 bytes do not fit in memory"
    }


def test_members_are_not_kept_once_read(tmp_path: Path) -> None:
    # TarFile keeps every member it has read: 10,000 of them took 4.5 MB, growing with the shard.
    src = tmp_path / "many.tar"
    with tarfile.open(src, "w") as t:
        for i in range(10_000):
            info = tarfile.TarInfo(f"s{i:06d}.cls")
            info.size = 1
            t.addfile(info, io.BytesIO(b"x"))
    tracemalloc.start()
    try:
        n = sum(1 for _ in iter_samples(os.fspath(src)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert n == 10_000
    assert peak < 1 << 20


# ----------------------------------------------------------------------------- hostile headers


def test_names_longer_than_a_record_can_hold(tmp_path: Path) -> None:
    # A name's extension names a member of the record: at most 65,535 bytes (once lower-cased:
    # "İ" is 2 bytes of UTF-8, its lower case 3). Names and extended headers past 64 KiB are refused
    # before they are read whole, and named by their first bytes.
    lower = write_tar(tmp_path / "lower.tar", member("k." + "İ" * 30_000, b"1", PAX))
    with pytest.raises(
        PackInputError,
        match=r"lower\.tar: member 'k\.İİ.*'\.\.\.: its extension is 90,000 bytes, more than the 65,535",
    ):
        convert_webdataset([lower], tmp_path / "o.smst", progress=False)
    for fmt, kind in ((GNU, "GNU long-name"), (PAX, "pax")):
        long = write_tar(
            tmp_path / f"long-{kind}.tar", member("a.jpg", b"1"), member("k." + "x" * 70_000, b"2", fmt)
        )
        with pytest.raises(
            PackInputError,
            match=rf"long-{kind}\.tar: member 'k\.xxxx+'\.\.\.: its {kind} header holds 70,0\d\d bytes; smstore reads names and extended headers of at most 65,536 bytes",
        ):
            convert_webdataset([long], tmp_path / "o.smst", progress=False)
    # A pax header that names nothing (a 70 KB comment) is named by the member before it.
    info = tarfile.TarInfo("b.jpg")
    info.pax_headers = {"comment": "c" * 70_000}
    big = write_tar(tmp_path / "comment.tar", member("a.jpg", b"1"), info.tobuf(PAX))
    with pytest.raises(
        PackInputError, match=r"comment\.tar: after member 'a\.jpg': its pax header holds 70,0\d\d bytes"
    ):
        convert_webdataset([big], tmp_path / "o.smst", progress=False)
    # Global pax records are copied into every member: a few hundred is the most any tar needs.
    many = tmp_path / "global.tar"
    with tarfile.open(many, "w", format=PAX, pax_headers={f"k{i}": "v" for i in range(300)}) as t:
        t.addfile(tarfile.TarInfo("a.jpg"), io.BytesIO())
    with pytest.raises(
        PackInputError, match=r"global\.tar: member 'a\.jpg': its global pax headers hold over 256 records"
    ):
        convert_webdataset([many], tmp_path / "o.smst", progress=False)


def tar_of(n: int, random: bool = False) -> bytes:
    """`n` members of 3,000 bytes (random ones, where a compressor must not shrink them)."""
    return b"".join(
        member(f"s{i:03d}.bin", os.urandom(3000) if random else bytes([i]) * 3000) for i in range(n)
    )


def raw_pax(records: bytes) -> bytes:
    """A pax header holding `records` as they are, well-formed or not."""
    info = tarfile.TarInfo("././@PaxHeader")
    info.type = tarfile.XHDTYPE
    info.size = len(records)
    return info.tobuf(tarfile.USTAR_FORMAT) + records + b"\0" * (-len(records) % 512)


def bad_checksum(block: bytes) -> bytes:
    return block[:1] + b"X" + block[2:]


@pytest.mark.parametrize(
    ("name", "build", "message"),
    [
        # Cut at a member boundary: tarfile (and webdataset) read it as a shorter shard, silently.
        (
            "boundary",
            lambda: tar_of(6),
            r"after member 's005\.bin': the file ends without the tar end-of-archive marker \(truncated\?\)",
        ),
        (
            "header",
            lambda: tar_of(6) + member("s006.bin", b"x")[:300],
            r"after member 's005\.bin': the file ends inside a member header \(truncated\?\)",
        ),
        (
            "data",
            lambda: tar_of(6)[:-1000],
            r"corrupt or truncated tar after member 's004\.bin': reading member 's005\.bin': unexpected end of data \(2,072 of 3,000 bytes\)",
        ),
        # A corrupt header ended the archive, silently, as if it were the end-of-archive marker.
        (
            "checksum",
            lambda: tar_of(3) + bad_checksum(tar_of(1)) + END,
            r"after member 's002\.bin': a corrupt member header at byte 10,752 \(bad checksum\)",
        ),
        ("not-a-tar", lambda: b"this is not a tar file " * 100, r"not a tar archive \(invalid header\)"),
        ("empty", lambda: b"", r"no tar header: the file is empty, or compressed data that ends too soon"),
        (
            "gz-cut",
            lambda: zlib.compress(tar_of(6, True) + END, wbits=31)[:-3000],
            r"corrupt or truncated tar after member 's00\d\.bin': reading member 's00\d\.bin': unexpected end of data",
        ),
        (
            "gz-corrupt",
            lambda: zlib.compress(tar_of(6, True) + END, wbits=31)[:10] + b"\xff" * 300,
            r"corrupt or truncated tar: invalid compressed data",
        ),
        (
            "bz2-cut",
            lambda: bz2.compress(tar_of(6, True) + END)[:-3000],
            r"no tar header: the file is empty, or compressed data",
        ),
        (
            "xz-cut",
            lambda: lzma.compress(tar_of(6, True) + END)[:-3000],
            r"corrupt or truncated tar after member 's00\d\.bin': reading member 's00\d\.bin': unexpected end",
        ),
        # Pax headers tarfile (before Python 3.11.10) takes quadratic time to parse: 13 s for one
        # 64 KiB header. A run of digits in a name, and records whose lengths point past their "=".
        (
            "pax-digits",
            lambda: tar_of(1) + member("1" * 300 + ".txt", b"x", PAX),
            r"member '1{100}'\.\.\.: its pax header holds a run of 256 or more digits",
        ),
        (
            "pax-records",
            lambda: tar_of(1) + raw_pax(b"5 aa\n" * 1000 + b"6 a=b\n") + member("s.bin", b"x"),
            r"after member 's000\.bin': its pax header has a malformed record at byte 0",
        ),
        # A base-256 size can be negative: tarfile would seek backwards.
        (
            "negative",
            lambda: tar_of(2) + member("s9.bin", size=-1024),
            r"member 's9\.bin': its header declares a negative size \(-1024\)",
        ),
        # Every extended header makes tarfile recurse once: thousands in a row ran out of stack.
        (
            "chain",
            lambda: member("x" * 200 + ".bin", b"1")[:1024] * 3000 + member("s.bin", b"1"),
            r"corrupt or truncated tar: a chain of extended headers too long to follow",
        ),
    ],
)
def test_bad_tar_is_named(tmp_path: Path, name: str, build: Any, message: str) -> None:
    src = tmp_path / f"{name}.tar"
    src.write_bytes(build())
    out = tmp_path / "out.smst"
    out.write_bytes(b"previous")
    with pytest.raises(PackInputError, match=rf"{name}\.tar: {message}"):
        convert_webdataset([src], out, progress=False)
    assert out.read_bytes() == b"previous"


def test_a_pax_record_running_past_its_header_is_read_as_this_tarfile_reads_it(tmp_path: Path) -> None:
    # "20 comment=abc\n" in a header of 15 bytes: tarfile before Python 3.11.10 reads it (the value
    # cut at the header's end, the records ending there) and WebDataset yields the sample; later
    # ones refuse the archive. The converter refused it on every Python (a fuzz finding).
    check_as_this_tarfile_reads(tmp_path, b"20 comment=abc\n")


def test_a_pax_record_without_its_newline_is_read_as_this_tarfile_reads_it(tmp_path: Path) -> None:
    # "14 comment=abc" + "\n": the length stops short of the newline (a fuzz finding, as above).
    check_as_this_tarfile_reads(tmp_path, b"14 comment=abc\n")


def check_as_this_tarfile_reads(tmp_path: Path, records: bytes) -> None:
    src = tmp_path / "odd.tar"
    src.write_bytes(tar_of(1) + raw_pax(records) + member("s.bin", b"x") + END)
    try:
        theirs([src])
    except ValueError:
        with pytest.raises(PackInputError, match="its pax header has a malformed record at byte 0"):
            convert_webdataset([src], tmp_path / "out.smst", progress=False)
        return
    assert len(assert_same_as_webdataset([src], tmp_path / "out.smst")) == 2
