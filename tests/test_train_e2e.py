"""examples/train.py under torchrun: trains, checkpoints, and resumes the global order exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import smstore
from smstore import GlobalShuffleSampler

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "train.py"
CORPUS = ROOT / "examples" / "data" / "corpus.txt"


def torchrun(nproc: int, *args: str, cwd: Path) -> str:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(TRAIN),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [*cmd, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def read_trace(path: Path) -> list[list[int]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [x["indices"] for x in lines if "indices" in x]


@pytest.mark.slow
def test_torchrun_trains_and_resumes_with_another_world_size(tmp_path: Path) -> None:
    data = tmp_path / "corpus.smst"
    smstore.pack_files([CORPUS], data, progress=False)
    n = len(smstore.open(data))
    ckpt, trace = tmp_path / "ckpt.pt", tmp_path / "trace"
    common = ["--data", str(data), "--checkpoint", str(ckpt), "--trace", str(trace), "--batch-size", "8"]
    common += ["--max-length", "48", "--workers", "1", "--sample", "0", "--log-every", "2"]

    out = torchrun(2, *common, "--steps", "4", cwd=tmp_path)
    assert "step     4" in out
    assert f"saved {ckpt}: step 4, epoch 0, consumed 64/{n}" in out
    assert "memory: 4 processes (ranks + workers)" in out  # 2 ranks, 1 worker each
    first = [read_trace(Path(f"{trace}.rank{r}")) for r in range(2)]
    for r in range(2):
        Path(f"{trace}.rank{r}").unlink()

    out = torchrun(1, *common, "--steps", "7", "--resume", cwd=tmp_path)
    assert f"resumed {ckpt}: step 4, epoch 0, consumed 64/{n} (saved by 2 ranks, now 1)" in out
    assert f"consumed {64 + 3 * 8}/{n}" in out
    second = read_trace(Path(f"{trace}.rank0"))

    # Rank r's j-th sample sits at global position r + 2j; the resumed run continues at 64.
    stream0 = [x for b in first[0] for x in b]
    stream1 = [x for b in first[1] for x in b]
    before = [x for pair in zip(stream0, stream1, strict=True) for x in pair]
    after = [x for b in second for x in b]
    order = GlobalShuffleSampler(n, seed=0, rank=0, world_size=1).global_order(0, 88).tolist()
    assert before + after == order

    import torch

    state = torch.load(ckpt, weights_only=True)["sampler"]
    assert (state["epoch"], state["consumed"], state["num_records"]) == (0, 88, n)
