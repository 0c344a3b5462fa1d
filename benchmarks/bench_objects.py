"""Memory and time of sharing a list of dicts across R local ranks x K DataLoader workers: SharedList vs mmengine vs a list.

Each configuration runs as a job of R rank processes (LOCAL_RANK set, as torchrun would), each
building the same N COCO-like dicts as a real training script does, wrapping them in a dataset,
and reading one shuffled epoch with K forked workers that touch every field and allocate per
sample as a pipeline does (the annotation, a string, a tensor of boxes, kept until the batch is
collated). With the workers still alive, the PSS of every process of the job
(/proc/PID/smaps_rollup) is summed.

What the data costs is the job minus the same job with no dataset: the same script, modules,
ranks and workers, the same N samples read with the same per-sample work, each unpickled from one
of 64 template pickles instead of read from a dataset (a rank that builds its dicts in the real
job builds them there too, and frees them). The difference is given as a multiple of one
serialized copy (the pickles of the N dicts): the shared copy, whatever the ranks keep because
they hold a dataset, and whatever pages of the rank's heap the workers copy. It is taken over
anonymous and shared memory (Pss_Anon + Pss_Shmem), where every dataset here lives: the PSS of
the libraries' file pages also depends on how many other processes of the machine map them.
The table also gives the job minus an idle job (one empty dict: workers that read next to
nothing), which charges the pipeline's own working set to the data too, and each worker's
private memory.

sharedlist-loader-unfrozen is sharedlist-loader with each worker's inherited heap unfrozen as it
starts: the garbage collector as it was before smstore froze the heap around a fork
(smstore/wire/fork.py), measured against the no-dataset job of sharedlist-loader. (A rank that built
a large list itself, as the sharedlist row's does, leaves its collector's count of old objects so
high that no worker runs a full collection; a rank that did not, as the loader form's, does.)

    python benchmarks/bench_objects.py > benchmarks/results/objects.md
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone
from typing import Any

from contenders import make_dicts
from procs import descendants, rollup

MODES = ("sharedlist-loader", "sharedlist-loader-unfrozen", "sharedlist", "mmengine", "list")


def touch(d: dict[str, Any]) -> int:
    """Read every field, as a pipeline would."""
    total = len(d.get("img_path", "")) + len(d.get("caption", "")) + d.get("height", 0) + d.get("width", 0)
    for inst in d.get("instances", ()):
        total += int(sum(inst["bbox"])) + inst["bbox_label"] + int(inst["area"]) + inst["ignore_flag"]
    return total


class Templates:
    """N samples with no dataset behind them: each unpickled from one of 64 template pickles."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pickles = [pickle.dumps(d, protocol=5) for d in make_dicts(64, seed=1)]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return pickle.loads(self.pickles[i % len(self.pickles)])


def rank_main(mode: str, n: int, workers: int, empty: bool, templates: bool) -> None:
    import torch
    from torch.utils.data import DataLoader, Dataset

    def work(d: dict[str, Any]) -> dict[str, Any]:
        # What a real pipeline makes of a sample, kept until its batch is collated: the annotation
        # itself, a path string, a tensor of boxes (padded to 16) and the labels.
        path = f"{d.get('img_path', '')}|{d.get('caption', '')}".upper()
        instances = d.get("instances", ())[:16]
        boxes = torch.zeros(16, 4)
        if instances:
            boxes[: len(instances)] = torch.tensor([inst["bbox"] for inst in instances])
        labels = [inst["bbox_label"] for inst in instances]
        return {"ann": d, "path": path, "boxes": boxes, "labels": labels, "total": touch(d) + len(path)}

    def collate(samples: list[dict[str, Any]]) -> int:
        boxes = torch.stack([s["boxes"] for s in samples])
        return int(boxes.sum()) + sum(s["total"] + len(s["labels"]) for s in samples)

    class Items(Dataset[dict[str, Any]]):
        def __init__(self, items: Any) -> None:
            self.items = items

        def __len__(self) -> int:
            return len(self.items)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return work(self.items[i])

    class MMItems(Items):
        def __getitem__(self, i: int) -> dict[str, Any]:
            return work(self.items.get_data_info(i))

    seconds = 0.0
    role = ""
    dataset: Any
    # The modules each form imports, and the collector as it runs, are the same with no dataset.
    if mode.startswith("sharedlist"):
        import smstore
    elif mode == "mmengine":
        from mmengine.dataset import BaseDataset
    if mode == "sharedlist-loader-unfrozen":
        import gc

        os.register_at_fork(after_in_child=gc.unfreeze)  # runs after smstore's: undoes its freeze
    if templates:
        if not mode.startswith("sharedlist-loader"):
            make_dicts(n)  # what the script builds before it has a dataset, freed at once
        dataset = Items(Templates(n))
    elif mode.startswith("sharedlist-loader"):
        # Only a child of local rank 0 parses the file; the other rank attaches.
        source = os.environ["BENCH_SOURCE_EMPTY" if empty else "BENCH_SOURCE"]
        lst = smstore.SharedList.from_file(source, "json")
        role = lst.role
        seconds = lst.seconds
        dataset = Items(lst)
    elif mode.startswith("sharedlist"):
        lst = smstore.SharedList(make_dicts(n, empty=empty))  # the per-rank dicts are freed on return
        role = lst.role
        seconds = lst.seconds  # SharedList alone: the dicts were made before its clock started
        dataset = Items(lst)
    elif mode == "mmengine":
        dicts = make_dicts(n, empty=empty)

        class Annotations(BaseDataset):  # type: ignore[misc]
            def load_data_list(self) -> list[dict[str, Any]]:
                return dicts

        start = time.perf_counter()
        ds = Annotations(serialize_data=True)  # pickles data_list into one numpy array per rank
        seconds = time.perf_counter() - start
        del dicts
        dataset = MMItems(ds)
    else:
        dataset = Items(make_dicts(n, empty=empty))
    loader = DataLoader(
        dataset, batch_size=64, shuffle=True, num_workers=workers, persistent_workers=True, collate_fn=collate
    )
    torch.manual_seed(int(os.environ["LOCAL_RANK"]))
    start = time.perf_counter()
    total = sum(loader)
    epoch = time.perf_counter() - start
    print(
        json.dumps({"ready": True, "build_s": seconds, "role": role, "epoch_s": epoch, "sum": total}),
        flush=True,
    )
    sys.stdin.readline()  # the harness measures PSS now, with the workers alive


def run_job(
    mode: str, n: int, ranks: int, workers: int, empty: bool = False, templates: bool = False
) -> dict[str, Any]:
    env = {**os.environ, "LOCAL_WORLD_SIZE": str(ranks), "SMSTORE_JOB_ID": f"bench-{uuid.uuid4().hex}"}
    env.pop("SMSTORE_SOCKET", None)
    cmd = [sys.executable, __file__, "--rank", mode, "--n", str(n), "--workers", str(workers)]
    if empty:
        cmd.append("--empty")
    if templates:
        cmd.append("--templates")
    procs = [
        subprocess.Popen(
            cmd, env={**env, "LOCAL_RANK": str(r)}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for r in range(ranks)
    ]
    try:
        outs = [json.loads(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]
        time.sleep(1.0)  # let the allocators settle
        pids = descendants([p.pid for p in procs])
        rolls = {pid: rollup(pid) for pid in pids}
        pss = sum(r.get("Pss", 0) for r in rolls.values())
        shmem = sum(r.get("Pss_Shmem", 0) for r in rolls.values())
        memory = sum(r.get("Pss_Anon", 0) + r.get("Pss_Shmem", 0) for r in rolls.values())
        ranks_pids = {p.pid for p in procs}
        private = sorted(
            r.get("Private_Dirty", 0) + r.get("Private_Clean", 0)
            for pid, r in rolls.items()
            if pid not in ranks_pids
        )
        for p in procs:
            p.stdin.write("\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        for p in procs:
            p.wait(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    worker = private[len(private) // 2] if private else 0
    return {
        "pss": pss,
        "memory": memory,
        "shmem": shmem,
        "worker": worker,
        "processes": len(pids),
        "outs": outs,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", choices=MODES)
    ap.add_argument("--n", type=int, default=300_000)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--empty", action="store_true", help="an idle job: N empty dicts (run with N=1)")
    ap.add_argument(
        "--templates", action="store_true", help="no dataset: N samples unpickled from 64 templates"
    )
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="the rows to run")
    args = ap.parse_args()
    if args.rank:
        rank_main(args.rank, args.n, args.workers, args.empty, args.templates)
        return

    load = os.getloadavg()[0]
    import tempfile

    tmp = tempfile.mkdtemp(prefix="bench-objects-")
    os.environ["BENCH_SOURCE"] = os.path.join(tmp, "ann.json")
    os.environ["BENCH_SOURCE_EMPTY"] = os.path.join(tmp, "none.json")
    dicts = make_dicts(args.n)
    copy = sum(len(pickle.dumps(d, protocol=5)) for d in dicts)
    with open(os.environ["BENCH_SOURCE"], "w") as f:
        json.dump(dicts, f)
    with open(os.environ["BENCH_SOURCE_EMPTY"], "w") as f:
        json.dump([{}], f)
    del dicts
    # What the loader form's builder is compared with: one json.load of the file and one pickle per object.
    start = time.perf_counter()
    with open(os.environ["BENCH_SOURCE"], "rb") as f:
        loaded = json.load(f)
    _ = [pickle.dumps(d, protocol=5) for d in loaded]
    reference = time.perf_counter() - start
    del loaded, _
    import torch

    import smstore

    git = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    from bench_core import command_line

    cmd = command_line("python benchmarks/bench_objects.py")
    print(f"- command: `{cmd} > benchmarks/results/objects.md`")
    print(
        f"- date: {datetime.now(timezone.utc).isoformat(timespec='seconds')}; git {git}; load average before: {load:.2f}"
    )
    print()
    print(
        f"# bench_objects: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, smstore {smstore.__version__}"
    )
    print()
    print(
        f"R={args.ranks} ranks x K={args.workers} workers (fork), N={args.n} COCO-like dicts, one shuffled epoch "
        f"reading every field and allocating per sample (a string, a small tensor). One serialized copy "
        f"(pickles of the N dicts) = {copy / 2**20:.1f} MiB. json.load of the {os.path.getsize(os.environ['BENCH_SOURCE']) / 2**20:.0f} MiB "
        f"JSON file + one pickle per object: {reference:.2f} s."
    )
    print()
    print(
        "| dataset | summed PSS | same job, no dataset | difference (anon + shmem) | x one copy | idle job | x one copy vs idle "
        "| shared memory | worker private (median) | processes | build s (rank 0) | rank 1 s | epoch s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    loader_ratio = "-"
    mib = 2**20
    for mode in args.modes:
        full = run_job(mode, args.n, args.ranks, args.workers)
        # The unfrozen row is measured against smstore as it is: its no-dataset job freezes.
        same = mode.replace("-unfrozen", "")
        base = run_job(same, args.n, args.ranks, args.workers, templates=True)
        idle = run_job(same, 1, args.ranks, args.workers, empty=True)  # mmengine refuses 0
        diff = full["memory"] - base["memory"]
        o = full["outs"]
        if mode == "sharedlist-loader":
            loader_ratio = f"{o[0]['build_s']:.2f} s / {reference:.2f} s = {o[0]['build_s'] / reference:.2f}x"
        build = f"{o[0]['build_s']:.2f}" if mode != "list" else "-"
        other = f"{o[1]['build_s']:.2f}" if mode != "list" and len(o) > 1 else "-"
        epoch = max(x["epoch_s"] for x in o)
        print(
            f"| {mode} | {full['pss'] / mib:.0f} MiB | {base['pss'] / mib:.0f} MiB | {diff / mib:.0f} MiB | "
            f"{diff / copy:.2f}x | {idle['pss'] / mib:.0f} MiB | {(full['memory'] - idle['memory']) / copy:.2f}x | "
            f"{full['shmem'] / mib:.0f} MiB | {full['worker'] / mib:.1f} MiB (no dataset {base['worker'] / mib:.1f}) | "
            f"{full['processes']} | {build} | {other} | {epoch:.1f} |",
            flush=True,
        )
    # Attaching from a pickled handle (what a spawn/forkserver worker does): O(1) in the list's size.
    lst = smstore.SharedList(make_dicts(args.n))
    handle = pickle.dumps(lst)
    start = time.perf_counter()
    for _ in range(100):
        pickle.loads(handle).close()
    attach = (time.perf_counter() - start) / 100
    print()
    print("| what | figure |")
    print("|---|---|")
    print(f"| pickled SharedList handle | {len(handle)} bytes |")
    print(
        f"| attaching from the handle (open /proc/PID/fd/N, map, O(1) header check) | {attach * 1e6:.0f} us |"
    )
    print(f"| shared copy (blob: header, records, index, metadata) | {lst.nbytes / 2**20:.1f} MiB |")
    print()
    for path in (os.environ["BENCH_SOURCE"], os.environ["BENCH_SOURCE_EMPTY"]):
        os.unlink(path)
    os.rmdir(tmp)
    print(
        "sharedlist-loader: SharedList.from_file(json) (rank 0: parse, encode and write in a child; time to "
        f"ready / reference = {loader_ratio}). "
        "build s: rank 0's SharedList (encode, hash, write the memfd, seal) vs mmengine's BaseDataset full_init "
        "with serialize_data=True (pickle protocol 4 and numpy concatenate), per rank. rank 1 s: the other rank's "
        "SharedList (connect, hash its own list to compare, receive the descriptor, map) or its own mmengine "
        "serialization. The dicts themselves are made before the clock starts."
    )


if __name__ == "__main__":
    main()
