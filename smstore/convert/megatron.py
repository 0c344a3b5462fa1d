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

import mmap
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from smstore._pack import PackStats
from smstore.convert._common import _Progress, write_records
from smstore.errors import PackInputError

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
    ends = pointers + lengths.astype(np.int64) * dtype.itemsize
    if nseq and (int(pointers.min()) < 0 or int(ends.max()) > bin_size):
        bad = int(np.argmax((pointers < 0) | (ends > bin_size)))
        raise PackInputError(
            f"{idx_path}: sequence {bad} lies at bytes {int(pointers[bad])}..{int(ends[bad])} of {bin_path}, "
            f"which has {bin_size}: the index does not belong to this .bin"
        )
    gaps = np.flatnonzero(pointers[1:] != ends[:-1])  # sequences that do not follow the one before
    bar = _Progress(bin_size, progress, "convert")

    def records() -> Iterator[memoryview]:
        if bin_size == 0:
            for _ in range(len(docs) - 1):
                yield memoryview(b"")
            return
        with open(bin_path, "rb") as f:
            # Not closed explicitly: the writer may still hold the last record when this ends; the
            # mapping goes when the last view of it does.
            view = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        gap_set = set(gaps.tolist())
        for d in range(len(docs) - 1):
            first, last = int(docs[d]), int(docs[d + 1])
            if first == last:
                yield view[0:0]
                continue
            if gap_set and any(s in gap_set for s in range(first, last - 1)):
                raise PackInputError(
                    f"{idx_path}: document {d}: its sequences are not contiguous in {bin_path}"
                )
            start, end = int(pointers[first]), int(ends[last - 1])
            yield view[start:end]
            if d % 4096 == 0:
                bar.update(end)

    try:
        return write_records(
            records(),
            output,
            encoding=f"npy:{dtype.str}",
            source=[idx_path, bin_path],
            metadata=metadata,
            durable=durable,
            shard_size=shard_size,
            input_bytes=bin_size,
        )
    finally:
        bar.close()
