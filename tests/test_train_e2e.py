"""examples/train.py under torchrun: exact resume, byte-exact reads through the daemon, two simulated nodes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import smstore
from smstore import GlobalShuffleSampler, _core
from smstore.daemon.segments import list_segments
from smstore.errors import DaemonError
from smstore.wire.client import daemon_request

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "train.py"
CORPUS = ROOT / "examples" / "data" / "corpus.txt"


def torchrun(nproc: int, *args: str, cwd: Path) -> str:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(TRAIN),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [*cmd, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def read_trace(path: Path) -> list[list[int]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [x["indices"] for x in lines if "indices" in x]


@pytest.mark.slow
def test_torchrun_trains_and_resumes_with_another_world_size(tmp_path: Path) -> None:
    data = tmp_path / "corpus.smst"
    smstore.pack_files([CORPUS], data, progress=False)
    n = len(smstore.open(data))
    ckpt, trace = tmp_path / "ckpt.pt", tmp_path / "trace"
    common = ["--data", str(data), "--checkpoint", str(ckpt), "--trace", str(trace), "--batch-size", "8"]
    common += ["--max-length", "48", "--workers", "1", "--sample", "0", "--log-every", "2"]

    out = torchrun(2, *common, "--steps", "4", cwd=tmp_path)
    assert "step     4" in out
    assert f"saved {ckpt}: step 4, epoch 0, consumed 64/{n}" in out
    # 2 ranks, 1 worker each; the workers' forkservers (and resource trackers) counted apart
    assert re.search(r"memory: 4 processes \(ranks \+ workers\) \+ \d+ start helpers,", out), out[-3000:]
    first = [read_trace(Path(f"{trace}.rank{r}")) for r in range(2)]
    for r in range(2):
        Path(f"{trace}.rank{r}").unlink()

    out = torchrun(1, *common, "--steps", "7", "--resume", cwd=tmp_path)
    assert f"resumed {ckpt}: step 4, epoch 0, consumed 64/{n} (saved by 2 ranks, now 1)" in out
    assert f"consumed {64 + 3 * 8}/{n}" in out
    second = read_trace(Path(f"{trace}.rank0"))

    # Rank r's j-th sample sits at global position r + 2j; the resumed run continues at 64.
    stream0 = [x for b in first[0] for x in b]
    stream1 = [x for b in first[1] for x in b]
    before = [x for pair in zip(stream0, stream1, strict=True) for x in pair]
    after = [x for b in second for x in b]
    order = GlobalShuffleSampler(n, seed=0, rank=0, world_size=1).global_order(0, 88).tolist()
    assert before + after == order

    import torch

    state = torch.load(ckpt, weights_only=True)["sampler"]
    assert (state["epoch"], state["consumed"], state["num_records"]) == (0, 88, n)


# ---- the daemon and simulated nodes -----------------------------------------------------------

MULTINODE = ROOT / "examples" / "multinode_sim.py"


def is_our_daemon(pid: int, sock: str) -> bool:
    """Whether `pid` still runs `smstore serve` on `sock` (never signal a reused pid)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"serve" in cmd and sock.encode() in cmd


def reap_daemons(daemons: list[tuple[int, str]]) -> list[str]:
    """SIGKILL (by pid) those of `daemons` still running; unlink and return what they left."""
    left: list[str] = []
    for pid, sock in daemons:
        if is_our_daemon(pid, sock):
            os.kill(pid, signal.SIGKILL)
            for _ in range(500):
                if not is_our_daemon(pid, sock):
                    break
                time.sleep(0.01)
        for name in list_segments(pid):
            left.append(name)
            _core.shm_unlink("/" + name)
    return left


def first_lines(n: int) -> list[bytes]:
    return CORPUS.read_bytes().split(b"\n")[:n]


@pytest.fixture
def multinode(tmp_path: Path) -> Iterator[Callable[[int], tuple[subprocess.CompletedProcess[str], Path]]]:
    """Runs examples/multinode_sim.py on the first N corpus lines; always reaps its daemons."""
    workdirs: list[Path] = []

    def run(n: int) -> tuple[subprocess.CompletedProcess[str], Path]:
        data = tmp_path / f"corpus{n}.smst"
        smstore.pack(first_lines(n), data, durable=False)
        work = tmp_path / f"work{n}"
        workdirs.append(work)
        cmd = [sys.executable, str(MULTINODE), "--data", str(data), "--workdir", str(work)]
        cmd += ["--batch-size", "8", "--workers", "1", "--", "--max-length", "4096"]
        r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
        return r, work

    yield run
    daemons: list[tuple[int, str]] = []
    for work in workdirs:
        with contextlib.suppress(FileNotFoundError):
            summary = json.loads((work / "summary.json").read_text())
            daemons += [(d["pid"], d["socket"]) for d in summary["daemons"].values()]
    left = reap_daemons(daemons)
    assert not left, f"segments left in /dev/shm: {left}"
    assert not any(Path(sock).exists() for _, sock in daemons), "a daemon's socket was left behind"


@pytest.mark.slow
@pytest.mark.parametrize("n", [96, 97])
def test_two_simulated_nodes_cover_the_epoch_exactly(
    multinode: Callable[[int], tuple[subprocess.CompletedProcess[str], Path]], n: int
) -> None:
    r, work = multinode(n)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((work / "summary.json").read_text())
    daemons = {int(k): v for k, v in summary["daemons"].items()}
    assert len(daemons) == 2
    assert daemons[0]["pid"] != daemons[1]["pid"]
    assert daemons[0]["socket"] != daemons[1]["socket"]
    assert daemons[0]["segment"] != daemons[1]["segment"]  # one copy per node, as on real nodes

    world, order = 4, GlobalShuffleSampler(n, seed=0, rank=0, world_size=1).global_order().tolist()
    per_rank = -(-n // world)
    seen: Counter[int] = Counter()
    for rank in range(world):
        lines = [json.loads(x) for x in Path(f"{work}/trace.rank{rank}").read_text().splitlines()]
        source = lines[0]["source"]
        node = rank // 2
        d = daemons[node]
        # torchrun's layout: node k holds global ranks 2k, 2k+1; each attached to its node's daemon.
        assert (source["node"], source["local_rank"], source["rank"]) == (node, rank % 2, rank)
        assert source["source"] == "daemon"
        assert source["daemon_pid"] == d["pid"]
        assert source["socket"] == d["socket"]
        assert source["segment"] == d["segment"]
        assert source["segment"].startswith(f"/smstore-{os.getuid()}-{d['pid']}-")
        assert source["listed"], "the daemon did not list the rank's pid among the segment's clients"
        stream = [i for x in lines[1:] for i in x["indices"]]
        assert stream == [order[(rank + j * world) % n] for j in range(per_rank)]
        seen.update(stream)
    if n % world == 0:
        assert seen == Counter(range(n))  # every index of the epoch exactly once across the 4 ranks
    else:
        # DistributedSampler's padding: ceil(N/W)*W - N positions wrap to the start of the order.
        pad = per_rank * world - n
        assert pad == 3
        assert seen == Counter(range(n)) + Counter(order[:pad])
    for d in daemons.values():
        assert not list_segments(d["pid"])
        assert not Path(d["socket"]).exists()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Callable[[Path], Path]]:
    """Starts `smstore serve FILE` on a socket unique to the test; returns the socket."""
    started: list[tuple[subprocess.Popen[bytes], str]] = []

    def start(data: Path) -> Path:
        sock = tmp_path / f"run{len(started)}" / "smstore.sock"
        with open(tmp_path / f"daemon{len(started)}.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "smstore", "serve", "--socket", str(sock), str(data)], stderr=log
            )
        started.append((proc, str(sock)))
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"the daemon exited ({proc.returncode})"
            with contextlib.suppress(DaemonError):
                st = daemon_request({"op": "status"}, sock)
                if st["segments"] and not st["loading"]:
                    return sock
            assert time.monotonic() < deadline, "the daemon did not get ready"
            time.sleep(0.02)

    yield start
    for proc, _ in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    left = reap_daemons([(p.pid, s) for p, s in started])
    assert not left, f"segments left in /dev/shm: {left}"


def digest(records: list[bytes]) -> str:
    """What train.py's batch_digest computes, from records read straight from the blob."""
    h = hashlib.blake2b(digest_size=16)
    for rec in records:
        h.update(len(rec).to_bytes(8, "little"))
        h.update(rec)
    return h.hexdigest()


def awkward_corpus(n: int) -> list[bytes]:
    recs = first_lines(n)
    recs[3] = b"\x00\xff\r\x00 binary \x80\x00"  # NULs (the pad value) and non-UTF-8 bytes
    recs[5] = b"x" * 300  # truncated to --max-length
    recs[7] = b"a"
    return recs


def train_through_daemon(tmp_path: Path, sock: Path, data: Path, *extra: str) -> list[list[dict[str, Any]]]:
    trace = tmp_path / "trace"
    args = ["--data", str(data), "--mode", "daemon", "--socket", str(sock), "--trace", str(trace)]
    args += ["--checkpoint", str(tmp_path / "ckpt.pt"), "--batch-size", "8", "--max-length", "64"]
    args += ["--workers", "2", "--sample", "0", "--log-every", "1", *extra]
    out = torchrun(2, *args, cwd=tmp_path)
    assert out.count("--mode daemon: the daemon's copy") == 2
    assert re.search(r"memory: 6 processes \(ranks \+ workers\) \+ \d+ start helpers \+ 1 daemon,", out), out[
        -3000:
    ]
    return [[json.loads(x) for x in Path(f"{trace}.rank{r}").read_text().splitlines()] for r in range(2)]


@pytest.mark.slow
def test_daemon_mode_reads_byte_exact_out_of_order_with_persistent_workers(
    tmp_path: Path, daemon: Callable[[Path], Path]
) -> None:
    recs = awkward_corpus(40)
    data = tmp_path / "awkward.smst"
    smstore.pack(recs, data, durable=False)
    sock = daemon(data)
    # 20 samples per rank per epoch (batches of 8, 8, 4): 6 steps are two epochs, the second on
    # the same persistent workers; in_order=False hands batches over as they complete.
    traces = train_through_daemon(
        tmp_path, sock, data, "--steps", "6", "--no-in-order", "--persistent-workers"
    )
    direct = smstore.open(data, verify=True)  # a plain mapping of the file, not the daemon's copy
    for rank, lines in enumerate(traces):
        assert lines[0]["source"]["source"] == "daemon"
        assert lines[0]["source"]["listed"]
        batches = lines[1:]
        assert [b["epoch"] for b in batches] == [0, 0, 0, 1, 1, 1]
        for b in batches:
            assert b["digest"] == digest([bytes(direct[i])[:64] for i in b["indices"]]), b
        for epoch in (0, 1):
            sampler = GlobalShuffleSampler(len(recs), seed=0, rank=rank, world_size=2)
            sampler.set_epoch(epoch)
            got = sorted(i for b in batches if b["epoch"] == epoch for i in b["indices"])
            assert got == sorted(sampler)


@pytest.mark.slow
def test_daemon_mode_pin_memory(tmp_path: Path, daemon: Callable[[Path], Path]) -> None:
    # Without an accelerator the DataLoader warns and does not pin; the bytes must be right either way.
    recs = awkward_corpus(40)
    data = tmp_path / "awkward.smst"
    smstore.pack(recs, data, durable=False)
    sock = daemon(data)
    traces = train_through_daemon(tmp_path, sock, data, "--steps", "3", "--pin-memory")
    direct = smstore.open(data)
    order = GlobalShuffleSampler(len(recs), seed=0, rank=0, world_size=1).global_order().tolist()
    for rank, lines in enumerate(traces):
        stream = [i for b in lines[1:] for i in b["indices"]]
        assert stream == order[rank::2]
        for b in lines[1:]:
            assert b["digest"] == digest([bytes(direct[i])[:64] for i in b["indices"]])
