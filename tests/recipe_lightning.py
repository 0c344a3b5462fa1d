"""Lightning recipe (docs/recipes.md): DDP on 2 CPU processes, a mid-epoch checkpoint, resume on another number of devices.

Run by tests/test_recipes.py as ``python recipe_lightning.py DATA OUT DEVICES [--stop-at STEP | --resume CKPT]``;
each rank writes the indices it trained on, in order, to ``OUT.rank<R>``.
"""

from __future__ import annotations

import argparse
import json

# [recipe]
import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torchdata.stateful_dataloader import StatefulDataLoader

from smstore import GlobalShuffleSampler, SharedStoreDataset


class Data(pl.LightningDataModule):
    def __init__(self, path: str, batch_size: int) -> None:
        super().__init__()
        self.path, self.batch_size = path, batch_size

    def train_dataloader(self) -> StatefulDataLoader:
        ds = SharedStoreDataset(self.path, decode="json")
        # A DistributedSampler: Lightning leaves it as it is (its rank comes from the process group).
        sampler = GlobalShuffleSampler(ds, seed=0)
        # A StatefulDataLoader: Lightning saves its position in a mid-epoch checkpoint.
        # Workers start by forkserver: a fork of a rank whose gloo thread is inside Python can hang.
        return StatefulDataLoader(
            ds,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=2,
            multiprocessing_context="forkserver",
        )


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(1, 1)
        self.seen: list[int] = []  # what this rank trained on (the test checks it)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen += batch["index"].tolist()
        x, y = batch["x"].float()[:, None], batch["y"].float()[:, None]
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def train(path: str, ckpt_dir: str, devices: int, resume: str | None, max_steps: int) -> Model:
    checkpoints = ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=5, save_top_k=-1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        max_epochs=2,
        max_steps=max_steps,
        callbacks=[checkpoints],
        logger=False,
        enable_progress_bar=False,
    )
    model = Model()
    trainer.fit(model, Data(path, batch_size=4), ckpt_path=resume)
    return model


# [/recipe]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data")
    parser.add_argument("out")
    parser.add_argument("devices", type=int)
    parser.add_argument("--stop-at", type=int, default=-1)  # a crash after this many steps
    parser.add_argument("--resume")
    args = parser.parse_args()
    model = train(args.data, f"{args.out}.ckpt", args.devices, args.resume, args.stop_at)
    with open(f"{args.out}.rank{model.global_rank}", "w") as f:
        json.dump(model.seen, f)


if __name__ == "__main__":
    main()
