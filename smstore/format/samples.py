"""The ``wds`` record encoding: one sample of named members (WebDataset's ``{ext: bytes}``).

A record is a small header then the members' names and bytes, back to back::

    u32 n | n x (u16 name_len, u64 size) | names | data

all little-endian. Decoding reads the header and slices the record: no copy until ``bytes()``.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

from smstore.errors import StoreFormatError

__all__ = ["decode_sample", "encode_sample"]

_COUNT = struct.Struct("<I")
_ENTRY = struct.Struct("<HQ")


def encode_sample(members: Mapping[str, bytes | bytearray | memoryview]) -> bytes:
    """One ``wds`` record of `members` (name -> bytes), in their order."""
    names = [name.encode() for name in members]
    if any(len(n) > 0xFFFF for n in names):
        msg = "a member name is longer than 65535 bytes"
        raise ValueError(msg)
    datas = list(members.values())
    head = _COUNT.pack(len(names)) + b"".join(
        _ENTRY.pack(len(n), memoryview(d).nbytes) for n, d in zip(names, datas, strict=True)
    )
    return b"".join([head, *names, *(bytes(d) if not isinstance(d, bytes) else d for d in datas)])


def decode_sample(view: memoryview | bytes) -> dict[str, bytes]:
    """The members of a ``wds`` record: ``{name: bytes}``.

    Raises:
        StoreFormatError: The record is not a well-formed sample.
    """
    mv = memoryview(view)
    try:
        (n,) = _COUNT.unpack_from(mv, 0)
        if _COUNT.size + n * _ENTRY.size > mv.nbytes:
            raise struct.error("header beyond the record")
        entries = [_ENTRY.unpack_from(mv, _COUNT.size + k * _ENTRY.size) for k in range(n)]
    except struct.error:
        msg = f"a wds record of {mv.nbytes} bytes has a malformed header"
        raise StoreFormatError(msg) from None
    pos = _COUNT.size + n * _ENTRY.size
    names = []
    for name_len, _ in entries:
        names.append(bytes(mv[pos : pos + name_len]).decode("utf-8", "surrogateescape"))
        pos += name_len
    out = {}
    for name, (_, size) in zip(names, entries, strict=True):
        out[name] = bytes(mv[pos : pos + size])
        pos += size
    if pos != mv.nbytes:
        msg = f"a wds record of {mv.nbytes} bytes holds {pos} bytes of members"
        raise StoreFormatError(msg)
    return out
