"""The mmengine drop-in: a real BaseDataset subclass under 2 local ranks x 2 DataLoader workers."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from smstore_testlib import SAFE_CWD, child_process

RANK_SCRIPT = str(Path(__file__).with_name("mmengine_rank.py"))


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_shared_data_list_matches_mmengine_serialize_data(method: str) -> None:
    env = {**os.environ, "LOCAL_WORLD_SIZE": "2", "SMSTORE_JOB_ID": f"mm-{uuid.uuid4().hex}"}
    with contextlib.ExitStack() as stack:
        ranks = [
            stack.enter_context(
                child_process(
                    [sys.executable, RANK_SCRIPT, method],
                    env={**env, "LOCAL_RANK": str(r)},
                    cwd=SAFE_CWD,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
            for r in (0, 1)
        ]
        outs = [json.loads(p.communicate(timeout=300)[0]) for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0]
    assert [o["role"] for o in outs] == ["builder", "waiter"]
    # load_data_list ran once per node, in neither rank (local rank 0's loading child); what it set
    # on the dataset reached both ranks.
    assert outs[0]["loaded_by"] == outs[1]["loaded_by"]
    assert outs[0]["loaded_by"] not in (outs[0]["pid"], outs[1]["pid"])
    assert [o["ref_loaded_by"] for o in outs] == [o["pid"] for o in outs]
    for out in outs:
        assert out["len"] == out["ref_len"] == 360  # mmengine's filter_data ran before sharing
        assert out["indices"] == list(range(360))
        assert out["mismatches"] == []  # byte-for-byte the same get_data_info(i) in the workers
        assert out["in_rank_mismatches"] == []
        assert out["worker_roles"] == (["attached"] if method == "spawn" else [out["role"]])
        assert "sample_idx" in out["item"]
