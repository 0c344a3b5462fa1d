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


def wait_at_gate() -> None:
    """Says it is loading (from the loading child), then waits until the test opens the FIFO $SL_GATE."""
    print(json.dumps({"event": "loading", "pid": os.getpid()}), flush=True)
    with open(os.environ["SL_GATE"]) as gate:
        gate.read()


def blocking_loader(n: int) -> Any:
    wait_at_gate()
    return [annotation(i) for i in range(n)]


def blocking_parser(path: str) -> Any:
    wait_at_gate()
    return loaded_by(path)


def loaded_by(path: str) -> Any:
    """Parses a JSON-lines file, recording which process did."""
    with open(path) as f:
        return [{**json.loads(line), "loaded_by": os.getpid()} for line in f]


def main() -> None:
    mode, n = sys.argv[1], int(sys.argv[2])
    rank = int(os.environ["LOCAL_RANK"])
    name = os.environ.get("SL_NAME")
    timeout = float(os.environ.get("SL_TIMEOUT", "60"))
    source = os.environ.get("SL_FILE")
    objects: Any = None if source else slowly(n) if mode == "slow" else [annotation(i) for i in range(n)]
    if mode == "diff" and rank == 1:
        objects[7]["caption"] = "something else"
    if mode == "shorter" and rank == 1:
        objects = objects[:-1]
    if mode == "sets":  # equal objects whose pickles differ with PYTHONHASHSEED
        objects = [{"tags": {f"tag{j}" for j in range(i % 9)}} for i in range(n)]
    print(json.dumps({"event": "start", "pid": os.getpid()}), flush=True)
    try:
        if mode == "loader-block":
            lst = smstore.SharedList.from_loader(
                lambda: blocking_loader(n), key="k", name=name, timeout=timeout
            )
        elif source:  # the loader form: only a child of local rank 0 parses the file
            parser = blocking_parser if mode == "file-block" else loaded_by
            lst = smstore.SharedList.from_file(source, parser, name=name, timeout=timeout)
        else:
            lst = smstore.SharedList(objects, name=name, timeout=timeout)
    except smstore.StoreError as e:
        print(json.dumps({"error": type(e).__name__, "message": str(e)}), flush=True)
        sys.exit(3)
    out: dict[str, Any] = {
        "role": lst.role,
        "len": len(lst),
        "ino": os.fstat(lst._fd).st_ino,
        "pid": os.getpid(),
    }
    if source:
        items = list(lst)
        out["loaded_by"] = sorted({d.pop("loaded_by") for d in items})
        out["equal"] = items == [json.loads(json.dumps(annotation(i))) for i in range(n)]
    elif mode == "sets":
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
