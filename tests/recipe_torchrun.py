"""torchrun recipe (docs/recipes.md): DDP with a StatefulDataLoader or a plain DataLoader, a checkpoint, resume on another world size.

Run by tests/test_recipes.py as ``torchrun --nproc-per-node=W recipe_torchrun.py DATA CKPT OUT
{stateful,plain} [--stop-at STEP]``; it resumes from CKPT when that exists, and each rank writes
the indices it trained on, in order, to ``OUT.rank<R>``.
"""

from __future__ import annotations

import argparse
import json
import os

# [recipe]
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from smstore import GlobalShuffleSampler, ResumableLoader, SharedStoreDataset


def make_loader(
    ds: SharedStoreDataset, sampler: GlobalShuffleSampler, stateful: bool
) -> StatefulDataLoader | ResumableLoader:
    # Workers start by forkserver: a fork of a rank whose gloo thread is inside Python can hang.
    workers = {"num_workers": 2, "prefetch_factor": 2, "multiprocessing_context": "forkserver"}
    if stateful:  # torchdata's: its state_dict() snapshots the sampler as each batch is drawn
        return StatefulDataLoader(ds, batch_size=4, sampler=sampler, **workers)
    # A plain DataLoader: ResumableLoader counts the batches the loop received (prefetch aside).
    return ResumableLoader(DataLoader(ds, batch_size=4, sampler=sampler, **workers))


def train(path: str, ckpt: str, stateful: bool, epochs: int = 2, stop_at: int = -1) -> list[int]:
    dist.init_process_group("gloo")
    ds = SharedStoreDataset(path, decode="json")
    sampler = GlobalShuffleSampler(ds, seed=0)  # rank and world size from the process group
    loader = make_loader(ds, sampler, stateful)
    model = DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    first_epoch, step, seen = 0, 0, []
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["data"])  # saved by any number of ranks
        first_epoch, step = state["epoch"], state["step"]
    for epoch in range(first_epoch, epochs):
        sampler.set_epoch(epoch)  # keeps a position loaded for this epoch
        for batch in loader:
            seen += batch["index"].tolist()  # what this rank trained on (the test checks it)
            x, y = batch["x"].float()[:, None], batch["y"].float()[:, None]
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % 5 == 0:
                state = {
                    "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "data": loader.state_dict(),  # rank 0's stands for all ranks
                    "epoch": epoch,
                    "step": step,
                }
                if dist.get_rank() == 0:
                    torch.save(state, ckpt)
                dist.barrier()
            if step == stop_at:
                return seen
    return seen


# [/recipe]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data")
    parser.add_argument("ckpt")
    parser.add_argument("out")
    parser.add_argument("loader", choices=["stateful", "plain"])
    parser.add_argument("--stop-at", type=int, default=-1)  # a crash after this many steps
    args = parser.parse_args()
    seen = train(args.data, args.ckpt, args.loader == "stateful", stop_at=args.stop_at)
    with open(f"{args.out}.rank{dist.get_rank()}", "w") as f:
        json.dump(seen, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
