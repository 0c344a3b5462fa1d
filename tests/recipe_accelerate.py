"""Accelerate recipe (docs/recipes.md): a prepared DataLoader, a checkpoint of its position, resume on another number of processes.

Run by tests/test_recipes.py under torchrun (or alone, for one process) as
``recipe_accelerate.py DATA CKPT OUT [--stop-at STEP]``; it resumes from CKPT when that exists,
and each rank writes the indices it trained on, in order, to ``OUT.rank<R>``.
"""

from __future__ import annotations

import argparse
import json
import os

# [recipe]
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from smstore import GlobalShuffleSampler, ResumableLoader, SharedStoreDataset


def train(path: str, ckpt: str, epochs: int = 2, stop_at: int = -1) -> list[int]:
    accelerator = Accelerator(cpu=True)
    ds = SharedStoreDataset(path, decode="json")
    sampler = GlobalShuffleSampler(ds, seed=0)  # rank and world size from the process group
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # Workers start by forkserver: a fork of a rank whose gloo thread is inside Python can hang (docs/recipes.md).
    loader = DataLoader(
        ds, batch_size=4, sampler=sampler, num_workers=2, multiprocessing_context="forkserver"
    )
    # prepare() wraps the sampler to split it across processes; the sampler turns that second split off.
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    loader = ResumableLoader(loader)  # its state_dict() is what the loop received, prefetch or not
    first_epoch, step, seen = 0, 0, []
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        accelerator.unwrap_model(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["data"])  # any number of processes
        first_epoch, step = state["data"]["epoch"], state["step"]
    for epoch in range(first_epoch, epochs):
        loader.set_epoch(epoch)  # through the prepared loader: accelerate counts its passes from it
        for batch in loader:
            seen += batch["index"].tolist()  # what this rank trained on (the test checks it)
            x, y = batch["x"].float()[:, None], batch["y"].float()[:, None]
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % 5 == 0:
                state = {
                    "model": accelerator.unwrap_model(model).state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "data": loader.state_dict(),  # rank 0's stands for all ranks
                    "step": step,
                }
                if accelerator.is_main_process:
                    torch.save(state, ckpt)
                accelerator.wait_for_everyone()
            if step == stop_at:
                return seen
    return seen


# [/recipe]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data")
    parser.add_argument("ckpt")
    parser.add_argument("out")
    parser.add_argument("--stop-at", type=int, default=-1)  # a crash after this many steps
    args = parser.parse_args()
    seen = train(args.data, args.ckpt, stop_at=args.stop_at)
    with open(f"{args.out}.rank{os.environ.get('RANK', '0')}", "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    main()
