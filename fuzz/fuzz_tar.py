"""Fuzz target: a tar file (plain or gzip) for convert_webdataset, differential against webdataset itself."""

from __future__ import annotations

import gzip
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import atheris
from _common import Finding, check_refusal, difference, feature, main, scratch_dir

# tarfile is instrumented too: both sides parse with it, and its branches are the tar format's.
with atheris.instrument_imports(include=["tarfile", "smstore"]):
    import tarfile

    import smstore
    from smstore.convert.webdataset import convert_webdataset

import webdataset as wds

# Byte 0, bit 0: the rest of the input is a tar file to gzip (deterministically) before converting.
GZIP_FLAG = 1
# Keys webdataset's samples carry besides members: not members, so not compared.
WDS_META = ("__url__", "__local_path__")
# Names webdataset's tar_file_iterator skips without reading (webdataset 1.0.2, tariterators.py).
WDS_SKIP = re.compile(r"__[^/]*__($|/)")
WORK = Path(scratch_dir("tar"))
SOURCE, OUTPUT = WORK / "in.tar", WORK / "out.smst"
DIGITS = re.compile(r"\d+")


def convert(source: Path, output: Path) -> None:
    """The one call into smstore: one tar shard to a blob of wds records."""
    convert_webdataset([source], output, progress=False, durable=False)


def skipped_by_wds(name: str) -> bool:
    return ("/" not in name and name.startswith("__") and name.endswith("__")) or bool(WDS_SKIP.match(name))


@dataclass
class Members:
    """What the headers say, read without expanding or skipping past the data."""

    sparse: bool = False  # some regular member is sparse
    # Refused whatever webdataset does: a sparse member it would read whose holes expand it past
    # the input, or a member declaring more bytes than the data holds (skipping one, tarfile reads
    # on past the end a block at a time: a declared 2**80 bytes never ends).
    refuse: str = ""
    local_path: bool = False  # some member's extension is "__local_path__", which webdataset overwrites
    # tarfile's last header was an end-of-archive block (two of zeros, as every writer ends). It
    # also stops silently at a corrupt or cut header after the first: refusing that tar is allowed.
    ends_cleanly: bool = False
    unusual_pax: bool = False  # a global pax header, or a run of 256 digits in a header


def scan(path: Path, tar: bytes, compression: str) -> Members:
    """The members of the file at `path`, whose uncompressed bytes are `tar` if its `compression` is
    as expected (the fuzzer may write other compressed data, which tarfile opens too)."""
    found = Members(unusual_pax=re.search(rb"[0-9]{256}", tar) is not None)
    known = compression
    bound = len(tar)
    try:
        with tarfile.open(path, mode="r|*") as reader:
            if reader.fileobj.comptype != compression:
                known, bound = "", 1 << 30  # the data of a few KB of other compressed data
            for m in reader:
                found.local_path |= m.name.lower().endswith(".__local_path__")
                if m.isreg() and m.sparse is not None:
                    found.sparse = True
                    if m.size > bound and not skipped_by_wds(m.name):
                        found.refuse = f"a sparse member expands past the input: {m.name!r} ({m.size} bytes)"
                        break
                if reader.offset > bound:  # where tarfile reads the next header
                    found.refuse = f"member {m.name!r} declares bytes past the end of the data"
                    break
            else:
                end = reader.offset
                found.ends_cleanly = bool(known) and tar[end : end + 1024] == bytes(1024)
            found.unusual_pax |= bool(reader.pax_headers)
    except Exception:  # noqa: BLE001, S110 - webdataset stops at the same fault: nothing further is read
        pass
    return found


def wds_samples(path: Path) -> tuple[list[dict[str, Any]] | str, bool]:
    """webdataset's samples, undecoded, as the converter's records decode (the key as bytes), or its
    error; and whether every key and extension is UTF-8 (tarfile keeps other bytes as surrogates).
    """
    try:
        samples = list(wds.WebDataset([os.fspath(path)], shardshuffle=False, empty_check=False))
    except Exception as e:  # noqa: BLE001 - webdataset refuses the tar
        return f"{type(e).__name__}: {e}", True
    out = []
    for s in samples:
        sample = {k: v for k, v in s.items() if k not in WDS_META}
        sample["__key__"] = s["__key__"].encode("utf-8", "surrogateescape")
        out.append(sample)
    names = [n for s in samples for n in (s["__key__"], *s)]
    return out, all(utf8(n) for n in names)


def utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def test_one_input(data: bytes) -> None:
    if not data:
        return
    tar = data[1:]
    file = gzip.compress(tar, mtime=0) if data[0] & GZIP_FLAG else tar
    SOURCE.write_bytes(file)
    OUTPUT.unlink(missing_ok=True)  # left by an earlier input that raised a finding, where fuzzing goes on
    members = scan(SOURCE, tar, "gz" if data[0] & GZIP_FLAG else "tar")
    if members.refuse:  # webdataset would expand a member or spin: not run
        expected: list[dict[str, Any]] | str = members.refuse
        names_utf8 = True
    else:
        expected, names_utf8 = wds_samples(SOURCE)
    feature(DIGITS.sub("", expected)[:70] if isinstance(expected, str) else f"{len(expected) > 1} samples")
    # Refusing is allowed for a tar that does not end cleanly, for sparse members (expanding them is
    # not required), for names that are not UTF-8 (a key is stored as bytes), for an extension
    # webdataset's own __local_path__ overwrites, and for pax headers beyond what writers make.
    must_convert = (
        not isinstance(expected, str)
        and members.ends_cleanly
        and names_utf8
        and not members.sparse
        and not members.local_path
        and not members.unusual_pax
    )
    try:
        convert(SOURCE, OUTPUT)
    except smstore.PackInputError as e:
        check_refusal(
            e, SOURCE, OUTPUT, must_convert=must_convert, instead=f"webdataset yields {len(expected)} samples"
        )
        return
    if isinstance(expected, str):
        raise Finding(f"converted, but: {expected[:300]}")
    with smstore.open(OUTPUT, verify=True) as store:
        records = [{k: v for k, v in r.items() if k != "__local_path__"} for r in store]
    os.unlink(OUTPUT)
    if records != expected:
        raise Finding(f"the samples differ from webdataset's: {difference(records, expected)}")


if __name__ == "__main__":
    main(test_one_input)
