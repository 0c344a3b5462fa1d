"""Every kind of order pinned: the same seed, epoch and parameters give the same records and holds
as before orders became data (issue 37, step 4), and a state saved in the old format resumes them."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import smstore

from .daemon_testlib import Daemon
from .smstore_testlib import sharded

SHARDS = [30, 25, 0, 40, 35, 20, 30]  # 180 records, one shard empty
LENGTHS, WEIGHTS = [180, 120], [0.6, 0.4]


def samplers(seed: int, world: int, rank: int) -> dict[str, smstore.GlobalShuffleSampler]:
    one: dict[str, Any] = {"seed": seed, "rank": rank, "world_size": world}
    mix = smstore.Mixture(LENGTHS, WEIGHTS)
    return {
        "global": smstore.GlobalShuffleSampler(sum(SHARDS), **one),
        "windowed": smstore.WindowedShuffleSampler(SHARDS, window=2, residency=False, **one),
        "blocks": smstore.BlockWindowSampler(SHARDS, block=10, spread=2, residency=False, **one),
        "mixture": smstore.MixtureSampler(mix, **one),
        "windowed mixture": smstore.WindowedMixtureSampler(
            mix, window=2, shard_sizes=[SHARDS, None], residency=False, **one
        ),
    }


# Every 9th sample of rank 1 of 3, seed 7, epoch 3: computed before the change.
PINNED = {
    "global": [164, 28, 27, 129, 85, 169, 40],
    "windowed": [39, 122, 115, 108, 75, 134, 171],
    "blocks": [77, 58, 122, 164, 100, 85, 116],
    "mixture": [230, 281, 76, 8, 75, 265, 208, 88, 98, 149, 189, 282],
    "windowed mixture": [244, 277, 158, 26, 40, 203, 219, 111, 113, 67, 276, 215],
}


@pytest.mark.parametrize("kind", list(PINNED))
def test_every_kind_of_order_yields_what_it_yielded_before(kind: str) -> None:
    sampler = samplers(7, 3, 1)[kind]
    sampler.set_epoch(3)
    assert list(sampler)[::9] == PINNED[kind]


# States as the samplers saved them before orders became data (format version 1: seed 7, epoch 3,
# 100 positions consumed at world size 1), and the first 10 samples rank 1 of 2 yields after them.
_V1 = {"version": 1, "seed": 7, "epoch": 3, "consumed": 100, "world_size": 1, "drop_last": False}
OLD_STATES: dict[str, tuple[dict[str, Any], list[int]]] = {
    "global": (
        {**_V1, "num_records": 180, "order": "global"},
        [132, 124, 126, 125, 85, 123, 38, 140, 14, 127],
    ),
    "windowed": (
        {
            **_V1,
            "num_records": 180,
            "order": "windowed",
            "window": 2,
            "shard_sizes_digest": "6d598792a72fd4b0",
        },
        [137, 77, 90, 135, 75, 147, 68, 74, 69, 61],
    ),
    "blocks": (
        {**_V1, "num_records": 180, "order": "blocks", "blocks": [10, 2, "6d598792a72fd4b0", 3]},
        [169, 97, 103, 101, 100, 98, 159, 65, 74, 70],
    ),
    "mixture": (
        {**_V1, "num_records": 300, "order": "mixture", "mixture": "14f7100ead7cd58a", "sources": 2},
        [207, 236, 112, 68, 75, 232, 210, 34, 58, 9],
    ),
    "windowed mixture": (
        {
            **_V1,
            "num_records": 300,
            "order": "windowed-mixture",
            "mixture": "14f7100ead7cd58a",
            "sources": 2,
            "windows": "52621b4c1188be1d",
        },
        [202, 282, 142, 42, 40, 266, 192, 131, 41, 149],
    ),
}


@pytest.mark.parametrize("kind", list(OLD_STATES))
def test_a_state_saved_in_the_old_format_resumes_the_same_order_at_another_world_size(kind: str) -> None:
    state, expected = OLD_STATES[kind]
    sampler = samplers(0, 2, 1)[kind]
    sampler.load_state_dict(json.loads(json.dumps(state)))
    assert list(sampler)[:10] == expected
    # And what it saves now resumes the same order too.
    sampler = samplers(0, 2, 1)[kind]
    sampler.load_state_dict(state)
    again = samplers(1, 1, 0)[kind]
    again.load_state_dict(json.loads(json.dumps(sampler.state_dict())))
    assert list(again)[1:20:2] == expected


@pytest.mark.parametrize("kind", ["windowed", "blocks", "mixture", "windowed mixture"])
def test_an_old_state_of_other_parameters_is_refused(kind: str) -> None:
    state, _ = OLD_STATES[kind]
    state = dict(state)
    entry = {"windowed": "window", "blocks": "blocks", "mixture": "mixture", "windowed mixture": "windows"}[
        kind
    ]
    state[entry] = (
        [11, 2, "6d598792a72fd4b0", 3] if kind == "blocks" else 3 if kind == "windowed" else "0" * 16
    )
    sampler = samplers(0, 2, 1)[kind]
    with pytest.raises(ValueError, match="another order cannot be resumed"):
        sampler.load_state_dict(state)


class Recorder:
    """A residency that records the holds a sampler sends."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def hold(self, held: Any, *, wait: bool = False) -> None:
        self.calls.append([[list(x) if isinstance(x, tuple) else x for x in held], wait])

    def close(self) -> None:
        pass


# sha256 (first 16 hex digits) of the JSON of (the samples, the holds sent) of seed 7, epoch 2.
PINNED_HOLDS = {
    ("windowed", 1, 0): "945df874661b9712",
    ("windowed", 3, 2): "f30096e678e424e0",
    ("blocks", 1, 0): "473b0cf06e3c167b",
    ("blocks", 3, 2): "a2e621c9abf08f7b",
    ("windowed mixture", 1, 0): "db8afaca050b5bd6",
    ("windowed mixture", 3, 2): "666c8b60567f31b4",
}


@pytest.mark.parametrize(("kind", "world", "rank"), list(PINNED_HOLDS))
def test_every_order_holds_what_it_held_before(kind: str, world: int, rank: int) -> None:
    one: dict[str, Any] = {"seed": 7, "rank": rank, "world_size": world, "lag": 4}
    residencies = [Recorder(), Recorder()] if kind == "windowed mixture" else [Recorder()]
    sampler: smstore.GlobalShuffleSampler
    if kind == "windowed":
        sampler = smstore.WindowedShuffleSampler(SHARDS, window=2, residency=residencies[0], **one)
    elif kind == "blocks":
        sampler = smstore.BlockWindowSampler(SHARDS, block=10, spread=2, residency=residencies[0], **one)
    else:
        mix = smstore.Mixture(LENGTHS, WEIGHTS)
        sampler = smstore.WindowedMixtureSampler(
            mix, window=2, shard_sizes=[SHARDS, [60, 60]], residency=residencies, **one
        )
    sampler.set_epoch(2)
    got = list(sampler)
    record = json.dumps([got, [r.calls for r in residencies]]).encode()
    assert hashlib.sha256(record).hexdigest()[:16] == PINNED_HOLDS[(kind, world, rank)]


# ---- a dataset's socket reaches every residency its sampler builds ----


@pytest.mark.parametrize("kind", ["windowed", "windowed mixture", "blocks"])
def test_a_custom_socket_reaches_every_residency(
    kind: str, tmp_path: Path, start_daemon: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Datasets opened with socket= on a daemon that is not the default one: every sampler holds
    through that daemon (mode="daemon": a hold sent anywhere else finds no daemon and raises)."""
    out = sharded(tmp_path, [b"%05d" % i * 8 for i in range(200)], shard_records=40)
    custom = tmp_path / "run" / "custom.sock"
    d = start_daemon(at=custom, loaded=0)
    monkeypatch.setenv("SMSTORE_SOCKET", os.fspath(tmp_path / "run" / "nobody.sock"))
    ds = smstore.SharedStoreDataset(os.fspath(out), mode="daemon", socket=os.fspath(custom))
    one: dict[str, Any] = {"seed": 1, "rank": 0, "world_size": 1, "lag": 4}
    sampler: smstore.GlobalShuffleSampler
    if kind == "windowed":
        sampler = smstore.WindowedShuffleSampler(ds, window=2, **one)
    elif kind == "blocks":
        sampler = smstore.BlockWindowSampler(ds, block=10, spread=2, **one)
    else:
        other = smstore.SharedStoreDataset(os.fspath(out), mode="daemon", socket=os.fspath(custom))
        sampler = smstore.WindowedMixtureSampler(
            smstore.MixtureDataset([ds, other], [0.5, 0.5]), window=2, **one
        )
    try:
        first = next(iter(sampler))  # the pass's first hold is waited for: a daemon answered it
        assert 0 <= first < sampler.num_records
        counts = d.status()["counts"]  # what the sampler holds, loading or loaded, in this daemon
        assert counts["loading"] + counts["segments"] > 0, counts
    finally:
        sampler.close()
