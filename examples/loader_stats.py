"""Log how long a training loop waits for its data: the batch wait per step and the share of step time.

    smstore pack examples/data/corpus.txt -o corpus.smst
    python examples/loader_stats.py --data corpus.smst --steps 200
    python examples/loader_stats.py --data corpus.smst --steps 200 --dataloader   # any DataLoader

The loop is the usual one: ``smstore.Loader`` times itself (``loader.stats()``), and any other
batch iterable is wrapped once (``stats.wrap(loader)``), the loop body unchanged. With tqdm
installed the figures are the progress bar's postfix; without it, a log line every ``--every`` steps.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import smstore

log = logging.getLogger("loader_stats")


def batches(
    args: argparse.Namespace,
) -> tuple[Callable[[], Iterable[dict[str, Any]]], smstore.LoaderStats, Any]:
    """An epoch's batches, the LoaderStats that times them, and what to close after."""
    sampler = smstore.GlobalShuffleSampler(len(smstore.open(args.data)), seed=0)
    if args.dataloader:
        collate = smstore.TokenCollator(args.data, max_length=args.length, dtype=torch.long)
        dl = DataLoader(range(len(collate)), sampler=sampler, batch_size=args.batch, collate_fn=collate)
        stats = smstore.LoaderStats()
        return lambda: stats.wrap(dl), stats, None
    loader = smstore.Loader(
        args.data, sampler=sampler, batch_size=args.batch, max_length=args.length, dtype=torch.long
    )
    return lambda: loader, loader.stats(), loader


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="a blob of text lines (smstore pack)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--length", type=int, default=128, help="tokens per sample at most")
    p.add_argument("--every", type=int, default=50, help="log every this many steps (without tqdm)")
    p.add_argument("--dataloader", action="store_true", help="a torch DataLoader wrapped, not smstore.Loader")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    model = nn.Sequential(nn.Embedding(256, 64), nn.Linear(64, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    epoch, stats, owner = batches(args)
    try:
        from tqdm import tqdm

        bar: Any = tqdm(total=args.steps)
    except ImportError:
        bar = None
    step = 0
    while step < args.steps:
        for batch in epoch():
            tokens = batch["tokens"] % 256
            loss = F.cross_entropy(model(tokens[:, :-1]).transpose(1, 2), tokens[:, 1:])
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if bar is not None:
                bar.update()
                bar.set_postfix(loss=f"{loss.item():.3f}", **stats.postfix())
            elif step % args.every == 0:
                s = stats.summary()
                log.info(
                    "step %d loss %.3f  batch wait %.2f ms (mean %.2f ms)  waiting for data %.1f%% of the step time",
                    step,
                    loss.item(),
                    s["wait_ms"],
                    s["mean_wait_ms"],
                    100 * s["wait_share"],
                )
            if step == args.steps:
                break
    if owner is not None:
        owner.close()
    log.info("%s; %.1f%% of all step time waited for data", stats, 100 * stats.total_wait_share)


if __name__ == "__main__":
    main()
