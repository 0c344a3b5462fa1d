"""The recipes of docs/recipes.md, run for real on CPU: what each rank trained on, an epoch and a resume.

Every recipe trains on a SharedStoreDataset of N records with GlobalShuffleSampler(seed=0), one
full epoch and part of the next on 2 processes, then resumes the second epoch from a checkpoint
(on another number of processes where the framework allows it). Each rank records the indices it
trained on, in order; the test compares them with the sampler's definition computed here from the
global order alone: rank r of W, from global position k, reads positions k + r, k + r + W, ... (mod
N). A framework that splits the sampler again, drops an epoch or resumes at another position
fails the comparison. The docs' code blocks are regions of the scripts run here (checked last).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from smstore_testlib import SAFE_CWD, child_process

import smstore
from smstore import GlobalShuffleSampler

pytest.importorskip("torch")

TESTS = Path(__file__).resolve().parent
DOCS = TESTS.parent / "docs" / "recipes.md"
N, B = 90, 4  # each of 2 ranks: 45 samples an epoch, in 11 full batches and one of 1
PER_RANK = -(-N // 2)


def pack(tmp_path: Path) -> Path:
    path = tmp_path / "data.smst"
    records = (json.dumps({"index": i, "x": i / N, "y": 2 * i / N}) for i in range(N))
    smstore.pack(records, path)
    return path


def order(epoch: int) -> list[int]:
    sampler = GlobalShuffleSampler(N, seed=0, rank=0, world_size=1)
    sampler.set_epoch(epoch)
    return sampler.global_order().tolist()


def share(epoch: int, rank: int, world: int, start: int = 0) -> list[int]:
    """What rank `rank` of `world` reads of `epoch` from global position `start` (padding wraps)."""
    o = order(epoch)
    return [o[(start + rank + i * world) % N] for i in range(-(-(N - start) // world))]


def run(*args: str | Path, torchrun: int = 0, timeout: float = 300) -> None:
    """Run a recipe script (under torchrun with `torchrun` processes); kill its process group on failure.

    Each rank runs it under fork_hazard.py, beside a thread that makes a forked child fail: a
    recipe whose DataLoader forks its workers from the rank (which may hang beside gloo's thread)
    fails here every time instead of now and then under load.
    """
    cmd = [sys.executable, str(TESTS / "fork_hazard.py"), *[str(a) for a in args]]
    if torchrun:
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={torchrun}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    # Its own session: launchers start ranks of their own, all killed with the group if it hangs.
    with child_process(
        cmd, group=True, cwd=SAFE_CWD, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    ) as p:
        out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, out.decode(errors="replace")[-6000:]


def seen(out: Path, rank: int) -> list[int]:
    indices: list[int] = json.loads(Path(f"{out}.rank{rank}").read_text())
    return indices


def check_epoch(runs: list[list[int]], epoch: int) -> None:
    """The ranks' shares of one epoch together hold every record once."""
    assert Counter(x for r in runs for x in r) == Counter(range(N)), f"epoch {epoch}"


@pytest.mark.slow
def test_lightning_ddp_and_a_mid_epoch_resume_on_one_device(tmp_path: Path) -> None:
    data = pack(tmp_path)
    first, second = tmp_path / "first", tmp_path / "second"
    # 2 DDP processes (Lightning launches the second): epoch 0, then 5 steps of epoch 1 and a
    # "crash"; checkpoints every 5 steps, so the last is at step 15, 3 batches into epoch 1.
    run(TESTS / "recipe_lightning.py", data, first, "2", "--stop-at", "17")
    ranks = [seen(first, r) for r in range(2)]
    for r in range(2):
        assert ranks[r] == share(0, r, 2) + share(1, r, 2)[: 5 * B]
    check_epoch([ranks[r][:PER_RANK] for r in range(2)], 0)

    run(TESTS / "recipe_lightning.py", data, second, "1", "--resume", f"{first}.ckpt/step=15.ckpt")
    resumed = seen(second, 0)
    assert resumed == share(1, 0, 1, start=2 * 3 * B)
    check_epoch([ranks[r][PER_RANK : PER_RANK + 3 * B] for r in range(2)] + [resumed], 1)


@pytest.mark.slow
def test_accelerate_prepared_loader_and_a_resume_on_one_process(tmp_path: Path) -> None:
    data, ckpt = pack(tmp_path), tmp_path / "ckpt.pt"
    first, second = tmp_path / "first", tmp_path / "second"
    run(TESTS / "recipe_accelerate.py", data, ckpt, first, "--stop-at", "17", torchrun=2)
    ranks = [seen(first, r) for r in range(2)]
    for r in range(2):
        assert ranks[r] == share(0, r, 2) + share(1, r, 2)[: 5 * B]
    check_epoch([ranks[r][:PER_RANK] for r in range(2)], 0)

    run(TESTS / "recipe_accelerate.py", data, ckpt, second)  # one process, from the step-15 checkpoint
    resumed = seen(second, 0)
    assert resumed == share(1, 0, 1, start=2 * 3 * B)
    check_epoch([ranks[r][PER_RANK : PER_RANK + 3 * B] for r in range(2)] + [resumed], 1)


@pytest.mark.slow
def test_hf_trainer_and_resume_from_checkpoint(tmp_path: Path) -> None:
    data, output_dir = pack(tmp_path), tmp_path / "trainer"
    first, second = tmp_path / "first", tmp_path / "second"
    run(TESTS / "recipe_transformers.py", data, output_dir, first, "--stop-at", "17", torchrun=2)
    ranks = [seen(first, r) for r in range(2)]
    for r in range(2):
        assert ranks[r] == share(0, r, 2) + share(1, r, 2)[: 5 * B]
    check_epoch([ranks[r][:PER_RANK] for r in range(2)], 0)

    # The Trainer resumes from its latest checkpoint by skipping the batches each rank trained on.
    latest = max(int(p.name.split("-")[1]) for p in output_dir.glob("checkpoint-*"))
    assert latest == 17  # it saves at max_steps too
    run(TESTS / "recipe_transformers.py", data, output_dir, second, torchrun=2)
    resumed = [seen(second, r) for r in range(2)]
    for r in range(2):
        assert resumed[r] == share(1, r, 2, start=2 * 5 * B)
    check_epoch([ranks[r][PER_RANK:] + resumed[r] for r in range(2)], 1)


@pytest.mark.slow
@pytest.mark.parametrize(("loader", "resume_world"), [("stateful", 3), ("plain", 1)])
def test_torchrun_and_a_resume_on_another_world_size(tmp_path: Path, loader: str, resume_world: int) -> None:
    data, ckpt = pack(tmp_path), tmp_path / "ckpt.pt"
    first, second = tmp_path / "first", tmp_path / "second"
    run(TESTS / "recipe_torchrun.py", data, ckpt, first, loader, "--stop-at", "17", torchrun=2)
    ranks = [seen(first, r) for r in range(2)]
    for r in range(2):
        assert ranks[r] == share(0, r, 2) + share(1, r, 2)[: 5 * B]
    check_epoch([ranks[r][:PER_RANK] for r in range(2)], 0)

    # From the step-15 checkpoint (3 batches into epoch 1 on each of 2 ranks: global position 24);
    # workers had drawn batches beyond it, which the position does not count.
    run(TESTS / "recipe_torchrun.py", data, ckpt, second, loader, torchrun=resume_world)
    resumed = [seen(second, r) for r in range(resume_world)]
    for r in range(resume_world):
        assert resumed[r] == share(1, r, resume_world, start=2 * 3 * B)
    check_epoch([ranks[r][PER_RANK : PER_RANK + 3 * B] for r in range(2)] + resumed, 1)


def region(script: Path) -> str:
    """The code of `script` between its `# [recipe]` markers."""
    found = re.search(r"^# \[recipe\]\n(.*?)^# \[/recipe\]\n", script.read_text(), re.DOTALL | re.MULTILINE)
    assert found, f"{script.name} has no # [recipe] ... # [/recipe] region"
    return found.group(1).strip("\n")


def test_the_docs_show_the_code_that_ran() -> None:
    blocks = re.findall(r"<!-- recipe: tests/(\S+) -->\n```python\n(.*?)\n```", DOCS.read_text(), re.DOTALL)
    assert sorted(name for name, _ in blocks) == sorted(p.name for p in TESTS.glob("recipe_*.py"))
    for name, code in blocks:
        assert code == region(TESTS / name), (
            f"docs/recipes.md: the block of {name} is not the script's region"
        )
