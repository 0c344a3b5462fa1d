"""Megatron-LM ``.bin``/``.idx`` token files (the ``MMIDIDX`` format) -> one array record per document.

The layout, from ``megatron/core/datasets/indexed_dataset.py`` (``_IndexWriter``/``_IndexReader``),
little-endian::

    .idx: b"MMIDIDX\\x00\\x00" | u64 version (1) | u8 dtype code | u64 sequence_count
          | u64 document_count | i32 sequence_lengths[sequence_count]
          | i64 sequence_pointers[sequence_count] (byte offsets into .bin)
          | i64 document_indices[document_count] (document d = sequences [idx[d], idx[d+1]))
    .bin: the tokens of every sequence, back to back

Tokens are copied once, from a mapping of the ``.bin`` into the blob; nothing is re-tokenized.
"""

from __future__ import annotations

import itertools
import mmap
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from smstore.convert._common import Progress, Spans, write_records
from smstore.errors import PackInputError
from smstore.write.pack import PackStats

__all__ = ["DTYPES", "convert_megatron", "read_index"]

MAGIC = b"MMIDIDX\x00\x00"
# Megatron's DType enum: code -> numpy dtype.
DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}


def _prefix(path: str) -> str:
    for ext in (".bin", ".idx"):
        if path.endswith(ext):
            return path[: -len(ext)]
    return path


def read_index(
    idx_path: str,
) -> tuple[np.dtype[Any], np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """(dtype, sequence lengths, sequence byte pointers, document indices) of an ``.idx`` file.

    Raises:
        PackInputError: Not an MMIDIDX index, or its arrays do not fit the file.
    """
    try:
        size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            head = f.read(9 + 8 + 1 + 8 + 8)
    except OSError as e:
        raise PackInputError(f"{idx_path}: cannot read the index: {e.strerror}") from None
    if len(head) < 34 or head[:9] != MAGIC:
        raise PackInputError(f"{idx_path}: not a Megatron MMIDIDX index (no magic bytes)")
    version = int.from_bytes(head[9:17], "little")
    if version != 1:
        raise PackInputError(f"{idx_path}: MMIDIDX version {version}; smstore reads version 1")
    code = head[17]
    if code not in DTYPES:
        raise PackInputError(f"{idx_path}: unknown dtype code {code}")
    nseq = int.from_bytes(head[18:26], "little")
    ndoc = int.from_bytes(head[26:34], "little")
    need = 34 + nseq * 4 + nseq * 8 + ndoc * 8
    if need > size:
        raise PackInputError(
            f"{idx_path}: {nseq} sequences and {ndoc} document indices need {need} bytes, the file has {size}"
        )
    lengths = np.memmap(idx_path, np.int32, "r", 34, (nseq,))
    pointers = np.memmap(idx_path, np.int64, "r", 34 + nseq * 4, (nseq,))
    docs = np.memmap(idx_path, np.int64, "r", 34 + nseq * 12, (ndoc,))
    return np.dtype(DTYPES[code]), lengths, pointers, docs


def convert_megatron(
    prefix: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    metadata: dict[str, Any] | None = None,
    shard_size: int | None = None,
    durable: bool = True,
    progress: bool | None = None,
) -> PackStats:
    """Convert ``PREFIX.bin``/``PREFIX.idx`` into a blob of one ``npy:<dtype>`` record per document.

    Args:
        prefix: The path without extension (``PREFIX.bin`` or ``PREFIX.idx`` also work).

    Raises:
        PackInputError: The index disagrees with its ``.bin`` (a pointer or length beyond it,
            sequences of a document that are not contiguous, document indices out of order),
            naming the file and the document or sequence.
    """
    base = _prefix(os.fspath(prefix))
    idx_path, bin_path = base + ".idx", base + ".bin"
    dtype, lengths, pointers, docs = read_index(idx_path)
    try:
        bin_size = os.path.getsize(bin_path)
    except OSError as e:
        raise PackInputError(f"{bin_path}: cannot read the token file: {e.strerror}") from None
    nseq = len(lengths)
    if len(docs) == 0 or int(docs[0]) != 0 or int(docs[-1]) != nseq or bool(np.any(np.diff(docs) < 0)):
        raise PackInputError(
            f"{idx_path}: document indices must run from 0 to the {nseq} sequences without decreasing"
        )
    if bool(np.any(lengths < 0)):
        raise PackInputError(f"{idx_path}: sequence {int(np.argmax(lengths < 0))} has a negative length")
    nbytes = lengths.astype(np.int64) * dtype.itemsize
    # Compared so that nothing overflows: a pointer near 2**63 plus its length would wrap around.
    outside = (pointers < 0) | (pointers > bin_size) | (nbytes > bin_size - pointers)
    if bool(outside.any()):
        bad = int(np.argmax(outside))
        raise PackInputError(
            f"{idx_path}: sequence {bad} lies at bytes {int(pointers[bad])}..{int(pointers[bad]) + int(nbytes[bad])} "
            f"of {bin_path}, which has {bin_size}: the index does not belong to this .bin"
        )
    ends = pointers + nbytes
    # Sequences that do not follow the one before are fine between documents, not inside one.
    gaps = np.flatnonzero(pointers[1:] != ends[:-1]) + 1  # sequence g starts away from g - 1's end
    inside = gaps[~np.isin(gaps, docs)]
    if inside.size:
        d = int(np.searchsorted(docs, inside[0], "right")) - 1
        raise PackInputError(f"{idx_path}: document {d}: its sequences are not contiguous in {bin_path}")
    # Each document's byte range; an empty one sits where the one before ended.
    first, last = docs[:-1], docs[1:]
    nonempty = last > first
    begin = np.zeros(len(first), np.int64)
    end = np.zeros(len(first), np.int64)
    begin[nonempty] = pointers[first[nonempty]]
    end[nonempty] = ends[last[nonempty] - 1]
    if not nonempty.all():
        filled = np.maximum.accumulate(np.where(nonempty, np.arange(len(first)), -1))
        prev_end = np.where(filled >= 0, end[np.maximum(filled, 0)], 0)
        begin[~nonempty] = end[~nonempty] = prev_end[~nonempty]
    # Runs of documents that follow each other in the .bin go to the writer in one call each.
    breaks = np.flatnonzero(begin[1:] != end[:-1]) + 1
    bar = Progress(bin_size, progress, "convert")

    def records() -> Iterator[Spans]:
        if bin_size == 0:
            yield Spans(b"", np.zeros(len(first) + 1, np.int64), f"{bin_path}: documents 0..{len(first) - 1}")
            return
        with open(bin_path, "rb") as f:
            # Not closed explicitly: the writer may still hold a view when this ends; the mapping
            # goes when the last view of it does.
            view = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        bounds = [0, *breaks.tolist(), len(first)]
        # Documents a call: bounded memory for the offsets, progress as it goes. The writer
        # splits a call where a shard fills.
        step = 65536
        for lo, hi in itertools.pairwise(bounds):
            for a in range(lo, hi, step):
                b = min(a + step, hi)
                where = f"{bin_path}: documents {a}..{b - 1}"
                yield Spans(view, np.concatenate([begin[a : a + 1], end[a:b]]), where)
                bar.update(int(end[b - 1]))

    return write_records(
        records(),
        output,
        encoding=f"npy:{dtype.str}",
        source=[idx_path, bin_path],
        metadata=metadata,
        durable=durable,
        shard_size=shard_size,
        input_bytes=bin_size,
        bar=bar,
    )
