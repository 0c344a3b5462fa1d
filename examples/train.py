"""Train a byte-level language model from an smstore blob with torchrun, DDP and a resumable global shuffle.

    smstore pack examples/data/corpus.txt -o corpus.smst
    smstore serve corpus.smst &          # optional: one shared-memory copy per node
    torchrun --nproc-per-node=2 examples/train.py --data corpus.smst --steps 30 --mode daemon
    torchrun --nproc-per-node=2 examples/train.py --data corpus.smst --steps 60 --resume

Every rank reads the one shared copy of the blob (its DataLoader workers too); each batch is one
``Store.gather`` in a worker (``TokenCollator``); the order is ``GlobalShuffleSampler``'s, and the
checkpoint holds the model, the optimizer and the sampler's global position, so ``--resume`` goes
on exactly where the last run stopped, with any number of ranks. Runs on CPU (gloo).

``--mode`` picks where records come from (``auto``: the ``smstore serve`` daemon's copy when it
serves the blob, else a mapping of the file; ``daemon``: require the daemon; ``mmap``: never use
it) and ``--socket`` which daemon to ask (default ``$SMSTORE_SOCKET``, else the per-user default):
with several simulated nodes on one machine each node has its own. Every rank logs what it got.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from smstore import (
    DaemonError,
    DaemonStore,
    GlobalShuffleSampler,
    SharedStoreDataset,
    TokenCollator,
    daemon_request,
)

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
                fields = line.split(maxsplit=5)
                # The path may end in " (deleted)": a segment unloaded or stopped while mapped.
                inside = len(fields) == 6 and fields[5].rstrip("\n").removesuffix(" (deleted)") == name
            elif inside and line.startswith("Pss:"):
                total += int(line.split()[1])
    return total


def process_tree(root: int) -> tuple[list[int], list[int]]:
    """`root` and all its descendants (here: this rank, its DataLoader workers and their start
    helpers), and `root`'s own children among them."""
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
    return tree, children.get(root, [])


def is_start_helper(pid: int) -> bool:
    """Whether `pid` is one of multiprocessing's own processes: the forkserver, the resource tracker."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return b"multiprocessing.forkserver" in cmdline or b"multiprocessing.resource_tracker" in cmdline


def memory_report(mapped: str, daemon_pid: int | None) -> tuple[int, int, int, int, int]:
    """(processes, start helpers, daemons, PSS of all of them, PSS of the blob's mappings), in KiB.

    The processes are this rank's tree: the rank and its DataLoader workers, and apart from them
    multiprocessing's helpers (the forkserver the workers start from, its resource tracker; a
    forkserver's workers are its children, and their cmdline is its own, so only the rank's direct
    children are told apart), plus the daemon when `daemon_pid` is given (one rank per node passes
    it, so each daemon is counted once). `mapped` is what the blob's pages are mapped as: the
    file, or the daemon's segment.
    """
    procs = helpers = daemons = total = blob = 0
    me = os.getpid()
    pids, direct = process_tree(me)
    if daemon_pid is not None:
        pids.append(daemon_pid)
    for pid in pids:
        try:
            total += pss_kib(pid)
            blob += mapping_pss_kib(pid, mapped)
        except OSError:
            continue
        if pid == daemon_pid:
            daemons += 1
        elif pid in direct and is_start_helper(pid):
            helpers += 1
        else:
            procs += 1
    return procs, helpers, daemons, total, blob


def describe_source(store: Any, sock: str | None) -> dict[str, Any]:
    """Where this rank's records come from; for the daemon, its pid and whether it lists us.

    The daemon's pid comes from its ``status`` reply (the same as ``smstore status --json``),
    which also lists, per segment, the pids of the processes attached to it.
    """
    info: dict[str, Any] = {
        "rank": int(os.environ.get("RANK", "0")),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "node": int(os.environ.get("GROUP_RANK", "0")),
        "pid": os.getpid(),
    }
    if not isinstance(store, DaemonStore):
        return {**info, "source": "mmap", "mapped": os.path.realpath(store.path)}
    status = daemon_request({"op": "status"}, sock)
    clients: list[int] = next((s["clients"] for s in status["segments"] if s["segment"] == store.segment), [])
    return {
        **info,
        "source": "daemon",
        "segment": store.segment,
        "mapped": "/dev/shm" + store.segment,
        "socket": status["socket"],
        "daemon_pid": int(status["pid"]),
        "listed": os.getpid() in clients,
    }


def batch_digest(tokens: torch.Tensor, lengths: torch.Tensor) -> str:
    """BLAKE2b of the batch's records as the loop received them: each one's length, then its bytes."""
    h = hashlib.blake2b(digest_size=16)
    rows = tokens.to(torch.uint8).numpy()
    for row, n in zip(rows, lengths.tolist(), strict=True):
        h.update(int(n).to_bytes(8, "little"))
        h.update(row[:n].tobytes())
    return h.hexdigest()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="the packed corpus (.smst), one text line per record")
    p.add_argument(
        "--steps", type=int, default=30, help="train until this global step (counting resumed ones)"
    )
    p.add_argument("--batch-size", type=int, default=32, help="records per rank per step")
    p.add_argument("--max-length", type=int, default=96, help="bytes kept of each record")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    p.add_argument(
        "--mode",
        choices=["auto", "daemon", "mmap"],
        default="auto",
        help="auto: the smstore daemon's shared-memory copy if it serves the blob, else map the file; "
        "daemon: require the daemon; mmap: never use it",
    )
    p.add_argument("--socket", help="the daemon's socket (default: $SMSTORE_SOCKET, else the per-user one)")
    p.add_argument(
        "--in-order",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="DataLoader in_order (--no-in-order: batches in completion order; breaks exact resume)",
    )
    p.add_argument("--pin-memory", action="store_true", help="DataLoader pin_memory (needs an accelerator)")
    p.add_argument(
        "--persistent-workers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep the DataLoader workers across epochs (with --workers > 0)",
    )
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0, help="seeds the model and the global shuffle")
    p.add_argument("--checkpoint", default="checkpoint.pt", help="where to save (and --resume from)")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument(
        "--trace",
        help="append to TRACE.rank<R> (JSON lines) where the rank's records come from, then each "
        "batch's indices and a digest of its bytes",
    )
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

    sock = os.path.abspath(args.socket) if args.socket else None
    # The one line that chooses where records come from. The dataset pickles with its socket, so
    # DataLoader workers that attach themselves (spawn, forkserver) ask the same daemon as their rank.
    try:
        dataset = SharedStoreDataset(args.data, mode=args.mode, socket=sock)
    except DaemonError as e:
        raise SystemExit(f"rank {rank}: {e}") from None
    source = describe_source(dataset.store, sock)
    where = (
        f"the daemon's copy {source['segment']} (daemon pid {source['daemon_pid']} on {source['socket']})"
        if source["source"] == "daemon"
        else f"a mapping of {source['mapped']}"
    )
    print(
        f"rank {rank}/{world} (node {source['node']}, pid {os.getpid()}): --mode {args.mode}: {where}",
        flush=True,
    )
    collate = TokenCollator(dataset, max_length=args.max_length, pad_value=PAD, dtype=torch.long)
    sampler = GlobalShuffleSampler(len(dataset), seed=args.seed)  # rank and world size from torch.distributed
    loader = DataLoader(
        range(len(dataset)),  # indices: each worker gathers a whole batch in one call
        batch_size=args.batch_size,
        sampler=sampler,
        collate_fn=collate,
        num_workers=args.workers,
        # Not fork: a rank's gloo thread may be inside Python at that moment, and the child hangs (docs/recipes.md).
        multiprocessing_context="forkserver" if args.workers > 0 else None,
        persistent_workers=args.persistent_workers and args.workers > 0,
        pin_memory=args.pin_memory,
        in_order=args.in_order,
    )
    if not args.in_order:
        log("note: --no-in-order: the checkpoint's position is approximate (batches arrive out of order)")
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
    if trace:
        trace.write(json.dumps({"source": source, "mode": args.mode, "records": len(dataset)}) + "\n")
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
                record = {
                    "step": step,
                    "epoch": epoch,
                    "indices": batch["indices"].tolist(),
                    "digest": batch_digest(batch["tokens"], batch["lengths"]),
                }
                trace.write(json.dumps(record) + "\n")
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

    # Memory while the workers are still alive: every process of every rank, PSS summed, and the
    # daemon that serves the blob (counted by local rank 0 only: once per node).
    daemon_pid = source.get("daemon_pid") if source["local_rank"] == 0 else None
    procs, helpers, daemons, total, blob = memory_report(source["mapped"], daemon_pid)
    if distributed:
        counts = torch.tensor([procs, helpers, daemons, total, blob], dtype=torch.int64)
        dist.all_reduce(counts)
        procs, helpers, daemons, total, blob = (int(x) for x in counts)
    blob_kib = Path(args.data).stat().st_size / 1024
    # Blob pages are shared (page cache, or the daemon's segment): summed PSS stays within one copy
    # per node (per daemon, when several simulated nodes each run their own).
    with_daemons = f" + {helpers} start helper{'s' if helpers != 1 else ''}" if helpers else ""
    with_daemons += f" + {daemons} daemon{'s' if daemons != 1 else ''}" if daemons else ""
    log(
        f"memory: {procs} processes (ranks + workers){with_daemons}, PSS {total / 1024:.1f} MiB summed; "
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
