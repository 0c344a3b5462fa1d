"""Transforms for the node cache tests, importable by name so forkserver and spawn workers unpickle them.

The records are ``b"<index>:<payload>"`` (transform_testlib.numbered_record). ``decode`` logs each
call's record index to the file named by $SMSTORE_TEST_DECODES (one O_APPEND write a call, so the
lines of every process on the node interleave whole): a test counts the decodes of each record.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import numpy as np
from transform_testlib import index_of

SIDE = 8
SCALE = 3  # a constant decode reads: changing it changes the transform's identity


def _log(i: int) -> None:
    path = os.environ.get("SMSTORE_TEST_DECODES")
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, b"%d\n" % i)
        finally:
            os.close(fd)


def decode(record: bytes) -> dict[str, Any]:
    """A deterministic 'decode': an image of SIDE x SIDE x 3 bytes and a float label from the record."""
    i = index_of(record)
    _log(i)
    data = np.frombuffer(bytes(record), dtype=np.uint8)
    image = ((np.arange(SIDE * SIDE * 3, dtype=np.int64) * (i + 1) * SCALE + data.sum()) % 251).astype(
        np.uint8
    )
    return {"image": image.reshape(SIDE, SIDE, 3), "label": np.float32(i) / 7}


def slow_decode(record: bytes) -> dict[str, Any]:
    """decode, a millisecond slower: racing workers meet on the same records."""
    time.sleep(0.001)
    return decode(record)


def augment(sample: dict[str, Any]) -> dict[str, Any]:
    """The random part: a flip and a shift drawn from Python's random (seeded per worker)."""
    image = sample["image"]
    if random.random() < 0.5:
        image = image[:, ::-1]
    image = np.roll(image, random.randrange(SIDE), axis=0)
    return {"image": np.ascontiguousarray(image), "label": sample["label"] + random.random()}


def decoded_counts(path: str) -> dict[int, int]:
    """How many times each record was decoded (the lines of the log)."""
    counts: dict[int, int] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                counts[int(line)] = counts.get(int(line), 0) + 1
    return counts
