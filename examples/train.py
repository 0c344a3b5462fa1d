"""Train a byte-level language model from an smstore blob with torchrun, DDP and a resumable global shuffle.

    smstore pack examples/data/corpus.txt -o corpus.smst
    torchrun --nproc-per-node=2 examples/train.py --data corpus.smst --steps 30
    torchrun --nproc-per-node=2 examples/train.py --data corpus.smst --steps 60 --resume

Every rank reads the one shared copy of the blob (its DataLoader workers too); each batch is one
``Store.gather`` in a worker (``TokenCollator``); the order is ``GlobalShuffleSampler``'s, and the
checkpoint holds the model, the optimizer and the sampler's global position, so ``--resume`` goes
on exactly where the last run stopped, with any number of ranks. Runs on CPU (gloo).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from smstore import GlobalShuffleSampler, SharedStoreDataset, TokenCollator

PAD = 0  # NUL never occurs in text lines; padding positions are masked out of the loss anyway


class ByteGRU(nn.Module):
    """A small recurrent byte-level language model: 256 byte tokens in, next-byte logits out."""

    def __init__(self, embed: int = 64, hidden: int = 192) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, embed)
        self.rnn = nn.GRU(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(tokens))
        return self.head(out)


def lm_loss(model: nn.Module, tokens: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Mean next-byte cross-entropy over real (unpadded) positions; also the number of them."""
    logits = model(tokens[:, :-1])
    targets = tokens[:, 1:]
    mask = torch.arange(targets.shape[1]) < (lengths[:, None] - 1)
    count = int(mask.sum())
    loss = F.cross_entropy(logits[mask], targets[mask], reduction="sum") / max(count, 1)
    return loss, count


def pss_kib(pid: int) -> int:
    """Proportional set size of one process, in KiB (shared pages split between their users)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return 0


def mapping_pss_kib(pid: int, name: str) -> int:
    """PSS of the mappings of `name` (the blob file, or the daemon's segment) in one process."""
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                inside = line.rstrip("\n").endswith(name)
            elif inside and line.startswith("Pss:"):
                total += int(line.split()[1])
    return total


def process_tree(root: int) -> list[int]:
    """`root` and all its descendants (here: this rank and its DataLoader workers)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def memory_report(blob_path: str) -> tuple[int, int, int]:
    """(processes, PSS of all of them, PSS of the blob mappings), in KiB, for this rank's tree."""
    name = os.path.realpath(blob_path)
    procs = total = blob = 0
    for pid in process_tree(os.getpid()):
        try:
            total += pss_kib(pid)
            blob += mapping_pss_kib(pid, name)
            procs += 1
        except OSError:
            continue
    return procs, total, blob


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="the packed corpus (.smst), one text line per record")
    p.add_argument(
        "--steps", type=int, default=30, help="train until this global step (counting resumed ones)"
    )
    p.add_argument("--batch-size", type=int, default=32, help="records per rank per step")
    p.add_argument("--max-length", type=int, default=96, help="bytes kept of each record")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0, help="seeds the model and the global shuffle")
    p.add_argument("--checkpoint", default="checkpoint.pt", help="where to save (and --resume from)")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--trace", help="append each rank's batch indices to TRACE.rank<R> (JSON lines)")
    p.add_argument("--sample", type=int, default=60, help="bytes to generate at the end (0: none)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    torch.set_num_threads(1)  # ranks x workers already fill the cores
    torch.manual_seed(args.seed)

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    # The one line that chooses where records come from (mode="daemon"/"auto" once the daemon lands).
    dataset = SharedStoreDataset(args.data)
    collate = TokenCollator(dataset, max_length=args.max_length, pad_value=PAD, dtype=torch.long)
    sampler = GlobalShuffleSampler(len(dataset), seed=args.seed)  # rank and world size from torch.distributed
    loader = DataLoader(
        range(len(dataset)),  # indices: each worker gathers a whole batch in one call
        batch_size=args.batch_size,
        sampler=sampler,
        collate_fn=collate,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
    )
    model: nn.Module = ByteGRU()
    if distributed:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    step = 0
    if args.resume:
        ckpt = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        sampler.load_state_dict(ckpt["sampler"])
        step = int(ckpt["step"])
        s = ckpt["sampler"]
        log(
            f"resumed {args.checkpoint}: step {step}, epoch {s['epoch']}, consumed {s['consumed']}/{len(dataset)} "
            f"(saved by {ckpt['world_size']} ranks, now {world})"
        )
    log(
        f"{len(dataset)} records, {dataset.store.nbytes / 2**20:.1f} MiB; {world} ranks x {args.workers} workers; "
        f"batch {args.batch_size} x {args.max_length} bytes per rank"
    )

    trace = open(f"{args.trace}.rank{rank}", "a") if args.trace else None  # noqa: SIM115
    start = time.perf_counter()
    tokens_seen = 0
    loss_value = float("nan")
    epoch = sampler.epoch
    local_consumed = 0  # samples of the current pass this rank trained on: the resumable position
    while step < args.steps:
        sampler.set_epoch(epoch)  # keeps a loaded position when it is the loaded epoch
        local_consumed = 0
        for batch in loader:
            loss, count = lm_loss(model, batch["tokens"], batch["lengths"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            local_consumed += len(batch["indices"])
            tokens_seen += count
            loss_value = loss.item()
            if trace:
                trace.write(
                    json.dumps({"step": step, "epoch": epoch, "indices": batch["indices"].tolist()}) + "\n"
                )
            if step % args.log_every == 0 or step == args.steps:
                rate = tokens_seen * world / (time.perf_counter() - start)
                log(f"step {step:5d}  epoch {epoch}  loss {loss_value:.3f}  {rate:,.0f} tokens/s")
            if step >= args.steps:
                break
        else:
            epoch += 1
            continue
        break

    # The sampler ran ahead of the loop (workers prefetch); the position is what the loop consumed.
    state = sampler.state_dict(local_consumed=local_consumed)
    if rank == 0:
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "sampler": state,
                "step": step,
                "world_size": world,
            },
            args.checkpoint,
        )
        print(
            f"saved {args.checkpoint}: step {step}, epoch {state['epoch']}, consumed {state['consumed']}/{len(dataset)}",
            flush=True,
        )
    if trace:
        trace.close()

    # Memory while the workers are still alive: every process of every rank, PSS summed.
    procs, total, blob = memory_report(dataset.store.path)
    if distributed:
        counts = torch.tensor([procs, total, blob], dtype=torch.int64)
        dist.all_reduce(counts)
        procs, total, blob = (int(x) for x in counts)
    blob_kib = Path(args.data).stat().st_size / 1024
    # Blob pages are shared (page cache, or the daemon's segment): summed PSS stays within one copy.
    log(
        f"memory: {procs} processes (ranks + workers), PSS {total / 1024:.1f} MiB summed; "
        f"the blob's mapped pages {blob / 1024:.2f} MiB summed, for a {blob_kib / 1024:.2f} MiB blob "
        f"({blob / blob_kib:.2f}x)"
    )

    if rank == 0 and args.sample:
        net = model.module if distributed else model
        text = list(b"The ")
        with torch.no_grad():
            for _ in range(args.sample):
                logits = net(torch.tensor([text]))[0, -1]
                text.append(int(logits.argmax()))
        print("sample:", bytes(text).decode("ascii", "replace").replace("\n", " "), flush=True)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
