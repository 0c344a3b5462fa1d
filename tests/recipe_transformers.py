"""HF Trainer recipe (docs/recipes.md): a tiny model on 2 CPU processes, a checkpoint mid-epoch, resume_from_checkpoint.

Run by tests/test_recipes.py under torchrun as ``recipe_transformers.py DATA OUTPUT_DIR OUT [--stop-at STEP]``
(``--stop-at`` absent: resume from the latest checkpoint in OUTPUT_DIR); each rank writes the indices
it trained on, in order, to ``OUT.rank<R>``. Nothing is downloaded: the model is a plain nn.Module.
"""

from __future__ import annotations

import argparse
import json

# [recipe]
import torch
from transformers import Trainer, TrainingArguments

from smstore import GlobalShuffleSampler, SharedStoreDataset


class SmstoreTrainer(Trainer):
    def _get_train_sampler(self, train_dataset: SharedStoreDataset | None = None) -> GlobalShuffleSampler:
        # The Trainer hands it to accelerate, whose second split the sampler turns off.
        return GlobalShuffleSampler(train_dataset or self.train_dataset, seed=self.args.seed)


class Model(torch.nn.Module):  # any module whose forward returns {"loss": ...}
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(1, 1)
        self.seen: list[int] = []  # what this rank trained on (the test checks it)

    def forward(self, x: torch.Tensor, y: torch.Tensor, index: torch.Tensor) -> dict[str, torch.Tensor]:
        self.seen += index.tolist()
        pred = self.net(x.float()[:, None])
        return {"loss": torch.nn.functional.mse_loss(pred, y.float()[:, None])}


def train(path: str, output_dir: str, max_steps: int = -1) -> Model:
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        num_train_epochs=2,
        seed=0,
        max_steps=max_steps,
        save_steps=5,  # resume_from_checkpoint continues from the latest: same number of processes
        dataloader_num_workers=2,
        dataloader_multiprocessing_context="forkserver",  # a fork of a rank can hang (docs/recipes.md)
        use_cpu=True,
        ddp_backend="gloo",
        ddp_find_unused_parameters=False,
        report_to="none",
        logging_strategy="no",
        disable_tqdm=True,
    )
    model = Model()
    trainer = SmstoreTrainer(model=model, args=args, train_dataset=SharedStoreDataset(path, decode="json"))
    trainer.train(resume_from_checkpoint=max_steps < 0)
    return model


# [/recipe]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data")
    parser.add_argument("output_dir")
    parser.add_argument("out")
    parser.add_argument("--stop-at", type=int, default=-1)  # a crash after this many steps
    args = parser.parse_args()
    model = train(args.data, args.output_dir, args.stop_at)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    with open(f"{args.out}.rank{rank}", "w") as f:
        json.dump(model.seen, f)
    if torch.distributed.is_initialized():
        # As recipe_torchrun does: a gloo group left to the interpreter's exit aborted a rank now
        # and then ("terminate called without an active exception", exit -6) after training ended.
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
