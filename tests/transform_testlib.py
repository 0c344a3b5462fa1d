"""Transforms for the TransformLoader tests, importable by name so spawn/forkserver workers can unpickle them.

The records are ``b"<index>:<payload>"`` (see ``numbered_record``), so a transform knows which
record it holds and can fail, or die, on one of them.
"""

from __future__ import annotations

import io
import os
import signal
import time
from typing import Any, NamedTuple

import numpy as np

FAIL_AT = 13  # the record on which the failing transforms fail


def numbered_record(i: int) -> bytes:
    """Record i: its index, a colon, and 0-40 bytes that depend on i (every byte value occurs)."""
    return b"%d:" % i + bytes((i * 7 + k) % 256 for k in range(i % 41))


def index_of(record: bytes) -> int:
    return int(bytes(record).split(b":", 1)[0])


def features(record: bytes) -> dict[str, Any]:
    """A cheap deterministic decode: the first 16 bytes as float32 (zero-padded), the length, the sum."""
    data = np.frombuffer(bytes(record), dtype=np.uint8)
    x = np.zeros(16, dtype=np.float32)
    x[: min(16, data.size)] = data[:16]
    return {"x": x, "length": int(data.size), "sum": np.uint32(data.sum())}


def as_pair(record: bytes) -> tuple[np.ndarray[Any, Any], float]:
    """A tuple output: default_collate makes it a list of two tensors."""
    f = features(record)
    return f["x"].astype(np.int16), float(f["length"]) / 3


class Pair(NamedTuple):
    x: np.ndarray[Any, Any]
    length: int


def as_named(record: bytes) -> Pair:
    f = features(record)
    return Pair(f["x"], f["length"])


def as_array(record: bytes) -> np.ndarray[Any, Any]:
    """A single array output: default_collate stacks it into one tensor."""
    return np.outer(features(record)["x"][:4], np.arange(3, dtype=np.float64))


def ragged(record: bytes) -> np.ndarray[Any, Any]:
    """An output whose shape depends on the record: refused by the loader, which has fixed slots."""
    return np.frombuffer(bytes(record), dtype=np.uint8).copy()


def fail_at(record: bytes) -> dict[str, Any]:
    if index_of(record) == FAIL_AT:
        msg = f"cannot decode record {FAIL_AT}"
        raise ValueError(msg)
    return features(record)


def die_at(record: bytes) -> dict[str, Any]:
    """SIGKILL the worker itself on one record: as the OOM killer would."""
    if index_of(record) == FAIL_AT:
        os.kill(os.getpid(), signal.SIGKILL)
    return features(record)


def decode_jpeg(record: bytes) -> np.ndarray[Any, Any]:
    """Pillow: decode a JPEG, resize to 24x24 RGB, as an HWC uint8 array."""
    from PIL import Image

    with Image.open(io.BytesIO(bytes(record))) as im:
        return np.array(im.convert("RGB").resize((24, 24), Image.Resampling.BILINEAR))  # writable


def make_jpeg(i: int, size: int = 48) -> bytes:
    """A small deterministic JPEG: gradients and a few stripes that depend on i."""
    from PIL import Image

    y, x = np.mgrid[0:size, 0:size]
    rgb = np.stack([(x * 5 + i) % 256, (y * 3 + 2 * i) % 256, ((x + y) * (i % 7 + 1)) % 256], axis=-1)
    buf = io.BytesIO()
    Image.fromarray(rgb.astype(np.uint8)).save(buf, format="JPEG", quality=85)
    return buf.getvalue()


class GatedRecorder:
    """Logs each record it transforms to ``log``; records from ``gate_from`` on wait for ``gate`` to exist."""

    def __init__(self, log: str, gate: str, gate_from: int) -> None:
        self.log, self.gate, self.gate_from = log, gate, gate_from

    def __call__(self, record: bytes) -> dict[str, Any]:
        i = index_of(record)
        while i >= self.gate_from and not os.path.exists(self.gate):
            time.sleep(0.005)
        with open(self.log, "a") as f:
            f.write(f"{i}\n")
        return features(record)
