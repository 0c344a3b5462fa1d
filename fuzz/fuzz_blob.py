"""Fuzz target: arbitrary bytes as a blob file, opened, verified and read, checked against docs/format.md."""

from __future__ import annotations

import itertools
import os
import struct

import atheris
import xxhash
from _common import Finding, main

with atheris.instrument_imports():
    import numpy as np

    import smstore
    from smstore import _core

HEADER_SIZE = 4096
MAGIC = b"\x89SMST\r\n\x1a"
# docs/format.md, "Header": magic, version, header_size, flags, file_size, record_count, data_offset,
# data_size, index_offset, index_size, meta_offset, meta_size, checksum_algo, reserved0, checksum.
HEADER = struct.Struct("<8sIIQQQQQQQQQIIQ")
CHECKSUM_FIELD = slice(96, 104)

# Input byte 0 holds these flags; the blob is the rest.
EXPAND_HEADER = 1  # the input holds only the 104-byte header struct: pad it with zeros to 4096
FIX_CHECKSUM = 2  # store the right checksum, so that verify() must pass when the structure does
FAST_INDEX = 4  # open as the daemon opens its own verified segments (index ends checked only)


def open_blob(fd: int, label: str, full_index: bool) -> smstore.Store:
    """The one call into smstore._core: a Store over an open file descriptor."""
    return _core.Store._from_fd(fd, label, full_index)


def reference_checksum(blob: bytes) -> int:
    header = bytearray(blob[:HEADER_SIZE])
    header[CHECKSUM_FIELD] = bytes(8)
    return xxhash.xxh64(blob[HEADER_SIZE:] + bytes(header)).intdigest()


def header_fault(blob: bytes) -> str | None:
    """Why the header is refused per docs/format.md ("What opening checks"), or None."""
    if len(blob) < HEADER_SIZE:
        return "shorter than the header"
    (magic, version, hsize, flags, fsize, n, doff, dsize, ioff, isize, moff, msize, algo, _, _) = (
        HEADER.unpack_from(blob)
    )
    checks = [
        (magic == MAGIC, "magic"),
        (version == 1, "version"),
        (hsize == HEADER_SIZE, "header size"),
        (flags == 0, "flags"),
        (algo == 1, "checksum algorithm"),
        (fsize == len(blob), "file size"),
        (doff == HEADER_SIZE, "data offset"),
        (doff + dsize <= len(blob), "data section outside the file"),
        (ioff + isize <= len(blob), "index section outside the file"),
        (moff + msize <= len(blob), "metadata section outside the file"),
        (isize == (n + 1) * 8, "index size"),
        (ioff % 8 == 0, "index alignment"),
        (ioff >= doff + dsize, "index before the end of the data"),
        (moff >= ioff + isize, "metadata before the end of the index"),
    ]
    return next((why for ok, why in checks if not ok), None)


def index_of(blob: bytes) -> list[int]:
    """The offsets of a blob whose header passed `header_fault`."""
    n, ioff = HEADER.unpack_from(blob)[5], HEADER.unpack_from(blob)[8]
    return list(struct.unpack_from(f"<{n + 1}Q", blob, ioff))


def index_fault(offsets: list[int], data_size: int, full_index: bool) -> str | None:
    if offsets[0] != 0:
        return "first offset not 0"
    if offsets[-1] != data_size:
        return "last offset is not the data size"
    if full_index and any(b < a for a, b in itertools.pairwise(offsets)):
        return "offsets decrease"
    return None


def check_store(store: smstore.Store, blob: bytes, full_index: bool) -> None:
    """Every record the store hands out is the slice of the data section the index names."""
    offsets, dsize = index_of(blob), HEADER.unpack_from(blob)[7]
    n = len(offsets) - 1
    data = blob[HEADER_SIZE : HEADER_SIZE + dsize]
    if len(store) != n or store.offsets.tolist() != offsets:
        raise Finding(f"store has {len(store)} records and offsets {store.offsets.tolist()[:8]}...")
    good = []
    for i in range(n):
        begin, end = offsets[i], offsets[i + 1]
        try:
            record = bytes(store[i])
        except smstore.StoreFormatError:
            if full_index or begin <= end <= dsize:
                raise
            continue  # a bad offset the fast open did not look at: refused, as it must be
        if not begin <= end <= dsize or record != data[begin:end]:
            raise Finding(f"record {i} = {record[:32]!r}..., index says [{begin}, {end}) of {dsize}")
        good.append(i)
    for bad in (n, -n - 1):
        try:
            store[bad]
        except IndexError:
            pass
        else:
            raise Finding(f"index {bad} of {n} records did not raise IndexError")
    picks = good[::-1] + good[: len(good) // 2]
    expected = [data[offsets[i] : offsets[i + 1]] for i in picks]
    if [bytes(r) for r in store.get_batch(picks)] != expected:
        raise Finding(f"get_batch({picks[:8]}...) disagrees with the records")
    flat, ends = store.gather(np.array(picks, dtype=np.int64))
    if flat.tobytes() != b"".join(expected) or ends.tolist() != [0, *np.cumsum([len(e) for e in expected])]:
        raise Finding(f"gather({picks[:8]}...) disagrees with the records")


def test_one_input(data: bytes) -> None:
    if not data:
        return
    flags, blob = data[0], data[1:]
    if flags & EXPAND_HEADER:
        blob = blob[: HEADER.size].ljust(HEADER_SIZE, b"\0") + blob[HEADER.size :]
    if flags & FIX_CHECKSUM and len(blob) >= HEADER_SIZE:
        blob = blob[:96] + struct.pack("<Q", reference_checksum(blob)) + blob[104:]
    full_index = not flags & FAST_INDEX
    fault = header_fault(blob)
    if fault is None:
        fault = index_fault(index_of(blob), HEADER.unpack_from(blob)[7], full_index)
    fd = os.memfd_create("smstore-fuzz-blob", os.MFD_CLOEXEC)
    try:
        os.write(fd, blob)
        try:
            store = open_blob(fd, "fuzz.smst", full_index)
        except smstore.StoreError as e:
            if fault is None:
                raise Finding(f"a valid blob was refused: {e}") from e
            if "fuzz.smst" not in str(e):
                raise Finding(f"the error does not name the file: {e}") from e
            return
        if fault is not None:
            raise Finding(f"a blob with a bad {fault} was opened")
        with store:
            check_store(store, blob, full_index)
            stored = int.from_bytes(blob[CHECKSUM_FIELD], "little")
            actual = reference_checksum(blob)
            if store.checksum != f"{stored:016x}" or store.compute_checksum() != f"{actual:016x}":
                raise Finding(f"checksum {store.checksum}/{store.compute_checksum()}, expected {actual:016x}")
            try:
                store.verify()
            except smstore.ChecksumMismatchError:
                if actual == stored:
                    raise
            else:
                if actual != stored:
                    raise Finding("verify() passed a blob whose checksum does not match")
            moff, msize = HEADER.unpack_from(blob)[10:12]
            meta = blob[moff : moff + msize]
            if store.metadata_bytes != meta:
                raise Finding("metadata_bytes is not the metadata section")
            try:
                if not isinstance(store.metadata, dict):
                    raise Finding("metadata is not a dict")
                store.encoding  # noqa: B018 - reading it parses the metadata
            except smstore.StoreFormatError:
                pass
    finally:
        os.close(fd)


if __name__ == "__main__":
    main(test_one_input)
