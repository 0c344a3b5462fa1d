"""Transforms and jobs for the node cache tests, importable by name so forkserver and spawn workers unpickle them.

The records are ``b"<index>:<payload>"`` (transform_testlib.numbered_record). A ``Decode`` logs each
call's record index to its log file (one O_APPEND write a call, so the lines of every process on
the node interleave whole): a test counts the decodes of each record, across processes.

Run as a script, it is a job of its own: ``read SOCKET DATA LOG [SCALE]`` reads every record
through a DecodedCache and prints its counts as JSON; ``claim SOCKET DATA LOG INDEX`` claims that
record, scribbles half its row, prints ``claimed TOKEN`` and waits to be killed.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Any

import numpy as np
from transform_testlib import index_of

SIDE = 8


class Decode:
    """A deterministic 'decode': an image of SIDE x SIDE x 3 bytes and a float label from the record.

    `scale` is part of what it computes (another scale: another transform); `slow` seconds a call
    make racing workers meet on the same records."""

    def __init__(self, log: str | os.PathLike[str] | None = None, scale: int = 3, slow: float = 0.0) -> None:
        self.log = None if log is None else os.fspath(log)
        self.scale = scale
        self.slow = slow

    def __call__(self, record: bytes) -> dict[str, Any]:
        i = index_of(record)
        if self.log is not None:
            fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, b"%d\n" % i)
            finally:
                os.close(fd)
        if self.slow:
            time.sleep(self.slow)
        data = np.frombuffer(bytes(record), dtype=np.uint8)
        flat = (np.arange(SIDE * SIDE * 3, dtype=np.int64) * (i + 1) * self.scale + int(data.sum())) % 251
        return {"image": flat.astype(np.uint8).reshape(SIDE, SIDE, 3), "label": np.float32(i) / 7}


def augment(sample: dict[str, Any]) -> dict[str, Any]:
    """The random part: a flip and a shift drawn from Python's random (seeded per worker)."""
    image = sample["image"]
    if random.random() < 0.5:
        image = image[:, ::-1]
    image = np.roll(image, random.randrange(SIDE), axis=0)
    return {"image": np.ascontiguousarray(image), "label": sample["label"] + random.random()}


class Uncached:
    """A map-style dataset of ``augment(Decode()(record))``: what a DecodedCache with that transform gives."""

    def __init__(self, ds: Any) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> Any:
        return augment(Decode()(self.ds[i]))


def decoded_counts(path: str | os.PathLike[str]) -> dict[int, int]:
    """How many times each record was decoded (the lines of the log)."""
    counts: dict[int, int] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                counts[int(line)] = counts.get(int(line), 0) + 1
    return counts


def _main(argv: list[str]) -> None:
    # The module's own classes, not __main__'s: a transform's identity names its module.
    from cache_testlib import Decode

    import smstore
    from smstore import _core

    mode, sock, data, log = argv[:4]
    ds = smstore.SharedStoreDataset(data, decode="bytes", mode="mmap")
    if mode == "read":
        scale = int(argv[4]) if len(argv) > 4 else 3
        cache = smstore.DecodedCache(ds, Decode(log, scale), socket=sock, chunk_bytes=4096)
        for i in range(len(ds)):
            want = Decode(None, scale)(ds[i])
            got = cache[i]
            if not (np.array_equal(got["image"], want["image"]) and got["label"] == want["label"]):
                raise SystemExit(f"record {i}: wrong bytes")
        print(json.dumps(cache.counts()), flush=True)
    elif mode == "claim":
        index = int(argv[4])
        cache = smstore.DecodedCache(ds, Decode(log), socket=sock, chunk_bytes=4096)
        k, r = divmod(index, cache.rows)
        chunk = cache._chunk(k)
        assert chunk is not None
        if _core.claim(chunk.words, r, cache._token) != _core.CLAIM_EMPTY:
            raise SystemExit("the record was not empty")
        chunk.fields[0][r, : SIDE // 2] = 255  # half a row written, then killed
        print(f"claimed {cache._token}", flush=True)
        time.sleep(600)
    elif mode == "scribble":  # write into a record read from the cache, through torch
        import torch

        cache = smstore.DecodedCache(ds, Decode(log), socket=sock, chunk_bytes=4096)
        image = cache[int(argv[4])]["image"]
        print("read", flush=True)
        torch.from_numpy(image).add_(1)  # the view is of a read-only mapping: this faults
        print("wrote", flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])


class FailingDecode(Decode):
    """Decode, but record `fail_at` raises."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at

    def __call__(self, record: bytes) -> dict[str, Any]:
        if index_of(record) == self.fail_at:
            raise ValueError(f"record {self.fail_at} is bad")
        return super().__call__(record)


SHIFT = [0, 0, 0]  # a global list `shifted` reads: what it holds is part of the transform


def shifted(record: bytes) -> np.ndarray[Any, Any]:
    return np.asarray(SHIFT, dtype=np.int64) + index_of(record)
