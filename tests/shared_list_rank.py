"""One local rank of a simulated job for tests/test_shared_list.py: run with LOCAL_RANK set; prints one JSON line."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from smstore_testlib import ItemsDataset, annotation, identity_collate

import smstore


def slowly(n: int) -> Any:
    for i in range(n):
        time.sleep(0.01)
        yield annotation(i)


def main() -> None:
    mode, n = sys.argv[1], int(sys.argv[2])
    rank = int(os.environ["LOCAL_RANK"])
    name = os.environ.get("SL_NAME")
    timeout = float(os.environ.get("SL_TIMEOUT", "60"))
    objects: Any = slowly(n) if mode == "slow" else [annotation(i) for i in range(n)]
    if mode == "diff" and rank == 1:
        objects[7]["caption"] = "something else"
    if mode == "shorter" and rank == 1:
        objects = objects[:-1]
    if mode == "sets":  # equal objects whose pickles differ with PYTHONHASHSEED
        objects = [{"tags": {f"tag{j}" for j in range(i % 9)}} for i in range(n)]
    print(json.dumps({"event": "start", "pid": os.getpid()}), flush=True)
    try:
        lst = smstore.SharedList(objects, name=name, timeout=timeout)
    except smstore.StoreError as e:
        print(json.dumps({"error": type(e).__name__, "message": str(e)}), flush=True)
        sys.exit(3)
    out: dict[str, Any] = {"role": lst.role, "len": len(lst), "ino": os.fstat(lst._fd).st_ino}
    if mode == "sets":
        out["equal"] = all(lst[i] == o for i, o in enumerate(objects))
    else:
        out["equal"] = list(lst) == [annotation(i) for i in range(n)]
    if mode == "workers":
        import torch.utils.data

        loader = torch.utils.data.DataLoader(
            ItemsDataset(lst),
            batch_size=4,
            num_workers=2,
            collate_fn=identity_collate,
            persistent_workers=True,
        )
        next(iter(loader))
        print(json.dumps({**out, "event": "reading"}), flush=True)
        # Until killed: the rank and its persistent workers hold the copy, idle. (Reading on in a
        # loop starved the other rank of CPU on a 2-core machine, so it missed the test's deadline.)
        while True:
            time.sleep(60)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
