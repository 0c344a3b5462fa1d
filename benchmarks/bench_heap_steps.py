"""Each rank's anonymous PSS at each step of building a SharedList, in a 2-rank job (gloo initialized, as torchrun).

Run: python benchmarks/bench_heap_steps.py > benchmarks/results/heap_steps.md
Pss_Anon from /proc/self/smaps_rollup, MiB, per process: the heap a forked DataLoader worker inherits.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import uuid

from contenders import make_dicts

N = 200_000


def anon_mib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss_Anon:"):
                return int(line.split()[1]) // 1024
    return 0


def rank(form: str, port: str, source: str) -> None:
    import torch.distributed as dist

    import smstore

    steps = [("start (torch, gloo)", 0)]
    dist.init_process_group(
        "gloo", rank=int(os.environ["LOCAL_RANK"]), world_size=2, init_method=f"tcp://127.0.0.1:{port}"
    )
    steps = [("torch + gloo initialized", anon_mib())]
    if form == "list":
        dicts = make_dicts(N)
        steps.append(("dicts built", anon_mib()))
        lst = smstore.SharedList(dicts, mode="mmap")
        steps.append(("SharedList(dicts) returned", anon_mib()))
        del dicts
        gc.collect()
        steps.append(("dicts freed, gc", anon_mib()))
    else:
        lst = smstore.SharedList.from_file(source, "json", mode="mmap")
        steps.append(("SharedList.from_file returned", anon_mib()))
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    steps.append(("after malloc_trim(0)", anon_mib()))
    print(json.dumps({"role": lst.role, "steps": steps}), flush=True)
    dist.barrier()


def main() -> None:
    if len(sys.argv) > 1:
        rank(*sys.argv[1:])
        return
    tmp = tempfile.mkdtemp()
    source = os.path.join(tmp, "ann.json")
    with open(source, "w") as f:
        json.dump(make_dicts(N), f)
    print(
        f"# Anonymous PSS (MiB) per rank while building a SharedList of {N} COCO-like dicts, 2 ranks, gloo\n"
    )
    for form in ("list", "loader"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        env = {**os.environ, "LOCAL_WORLD_SIZE": "2", "SMSTORE_JOB_ID": f"heap-{uuid.uuid4().hex}"}
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, form, port, source],
                env={**env, "LOCAL_RANK": str(r)},
                stdout=subprocess.PIPE,
                text=True,
            )
            for r in (0, 1)
        ]
        outs = [json.loads(p.communicate(timeout=600)[0]) for p in procs]
        print(f"## {'SharedList(list)' if form == 'list' else 'SharedList.from_file (loader form)'}\n")
        print("| step | " + " | ".join(o["role"] for o in outs) + " |")
        print("|---|---|---|")
        for i, (step, _) in enumerate(outs[0]["steps"]):
            print(f"| {step} | " + " | ".join(str(o["steps"][i][1]) for o in outs) + " |")
        print()
    os.unlink(source)
    os.rmdir(tmp)


if __name__ == "__main__":
    main()
