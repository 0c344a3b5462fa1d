"""TransformLoader: the DataLoader's batches through shared reused slots, resume, errors, shutdown."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transform_testlib as tt
from torch.utils.data import DataLoader

import smstore
from smstore import CollateError, GlobalShuffleSampler, SharedStoreDataset, TransformLoader, WorkerError

N = 300


@pytest.fixture
def numbered(tmp_path: Path) -> Path:
    path = tmp_path / "numbered.smst"
    smstore.pack([tt.numbered_record(i) for i in range(N)], path)
    return path


def detach(batch: Any) -> Any:
    """A copy of a batch that outlives its slot."""
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, dict):
        return {k: v.clone() for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(v.clone() for v in batch))
    return [v.clone() for v in batch]


def assert_same_batches(got: Iterable[Any], want: Iterable[Any]) -> None:
    """Byte-exact: same structure, keys, dtypes, shapes and values, batch by batch."""
    got, want = list(got), list(want)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert type(g) is type(w)
        if isinstance(w, torch.Tensor):
            g, w = {"": g}, {"": w}
        pairs = zip(g.values(), w.values(), strict=True) if isinstance(w, dict) else zip(g, w, strict=True)
        if isinstance(w, dict):
            assert list(g) == list(w)
        for a, b in pairs:
            assert a.dtype == b.dtype
            assert a.shape == b.shape
            assert torch.equal(a, b)


def reference(path: Path, transform: Any, sampler: Any, batch_size: int, **kw: Any) -> list[Any]:
    """What torch's DataLoader yields with the transform in the dataset and the default collate_fn."""
    ds = SharedStoreDataset(path, decode="bytes", transform=transform)
    loader = DataLoader(ds, batch_size=batch_size, sampler=sampler, num_workers=2, **kw)
    return list(loader)


# ------------------------------------------------------------------------------ same batches


# spawn and forkserver workers import torch anew: seconds each
SLOW_STARTS = [
    c if c == "fork" else pytest.param(c, marks=pytest.mark.slow) for c in ("fork", "spawn", "forkserver")
]


@pytest.mark.parametrize("context", SLOW_STARTS)
def test_batches_match_dataloader(numbered: Path, context: str) -> None:
    sampler = GlobalShuffleSampler(N, seed=7)
    want = reference(numbered, tt.features, sampler, 32, multiprocessing_context=context)
    ds = SharedStoreDataset(numbered, decode="bytes")
    with TransformLoader(
        ds, tt.features, batch_size=32, sampler=sampler, num_workers=2, multiprocessing_context=context
    ) as loader:
        got = [detach(b) for b in loader]
        assert len(loader) == len(got) == -(-N // 32)
        pids = {p.pid for p in loader._pool.procs}  # type: ignore[union-attr]
    assert_same_batches(got, want)
    assert os.getpid() not in pids
    assert len(pids) == 2


@pytest.mark.parametrize("transform", [tt.as_pair, tt.as_named, tt.as_array, tt.features])
@pytest.mark.parametrize("drop_last", [False, True])
def test_output_structures_and_options(numbered: Path, transform: Any, drop_last: bool) -> None:
    """Tuples become lists, namedtuples stay, arrays stack, numbers widen as default_collate does;
    the default sampler is sequential; a short last batch is kept or dropped."""
    want = reference(numbered, transform, None, 47, drop_last=drop_last)
    ds = SharedStoreDataset(numbered, decode="bytes")
    with TransformLoader(
        ds, transform, batch_size=47, drop_last=drop_last, num_workers=3, depth=4, copy=True
    ) as loader:
        got = list(loader)  # copy=True: every batch outlives its slot
        assert len(loader) == len(got)
    assert_same_batches(got, want)


def test_transform_in_the_dataset_and_a_declared_spec(numbered: Path) -> None:
    """The dataset's own transform works too, and a declared spec casts within a kind (int32 -> int64)."""
    ds = SharedStoreDataset(numbered, decode="bytes", transform=tt.features)
    spec = {"x": ((16,), torch.float32), "length": ((), "int32"), "sum": ((), np.uint32)}
    with TransformLoader(ds, batch_size=50, spec=spec, num_workers=1) as loader:
        got = [detach(b) for b in loader]
    want = reference(numbered, tt.features, None, 50)
    for w in want:
        w["length"] = w["length"].to(torch.int32)
    assert_same_batches(got, want)


def test_jpeg_decode_matches_dataloader(tmp_path: Path) -> None:
    pytest.importorskip("PIL")  # in the test extra
    path = tmp_path / "jpegs.smst"
    smstore.pack([tt.make_jpeg(i) for i in range(80)], path)
    sampler = GlobalShuffleSampler(80, seed=3)
    want = reference(path, tt.decode_jpeg, sampler, 16)
    with TransformLoader(
        SharedStoreDataset(path, decode="bytes"), tt.decode_jpeg, batch_size=16, sampler=sampler
    ) as loader:
        got = [detach(b) for b in loader]
    assert got[0].shape == (16, 24, 24, 3)
    assert got[0].dtype == torch.uint8
    assert_same_batches(got, want)


def test_views_are_reused_and_copies_are_not(numbered: Path) -> None:
    """Without copy=, a batch views its slot: with depth 2, batch k+2 is written where batch k was."""
    ds = SharedStoreDataset(numbered, decode="bytes")
    with TransformLoader(ds, tt.as_array, batch_size=10, num_workers=1, depth=2) as loader:
        it = iter(loader)
        first = next(it)
        kept = first.clone()
        next(it)
        third = next(it)
        assert third.data_ptr() == first.data_ptr()
        assert not torch.equal(first, kept)  # its slot holds batch 2 now
        assert torch.equal(first, third)
        it.close()


# ------------------------------------------------------------------------------ resume


@pytest.mark.parametrize("stop", [0, 1, 4, 9, 10])
def test_resume_global_sampler_is_exact(numbered: Path, stop: int) -> None:
    """A state saved after `stop` batches resumes at the next one, in a new loader and sampler, even
    though the workers had drawn batches ahead; a state saved at the end starts the next epoch."""
    ds = SharedStoreDataset(numbered, decode="bytes")
    want = reference(numbered, tt.features, GlobalShuffleSampler(N, seed=5), 30)
    assert len(want) == 10
    with TransformLoader(ds, tt.features, batch_size=30, sampler=GlobalShuffleSampler(N, seed=5)) as loader:
        it = iter(loader)
        head = [detach(next(it)) for _ in range(stop)]
        state = loader.state_dict()
        if stop == 10:
            assert next(it, None) is None
            state = loader.state_dict()
    assert_same_batches(head, want[:stop])
    sampler = GlobalShuffleSampler(N, seed=5)
    with TransformLoader(ds, tt.features, batch_size=30, sampler=sampler) as resumed:
        resumed.load_state_dict(state)
        assert resumed.state_dict() == state
        rest = [detach(b) for b in resumed]
    if stop == 10:  # the epoch was over: the next pass is a whole epoch (of the same seed and epoch)
        assert state["sampler"]["consumed"] == N
        assert rest == []
    else:
        assert_same_batches(rest, want[stop:])


def test_sampler_alone_refuses_to_answer_ahead_of_the_loop(numbered: Path) -> None:
    """The workers draw batches ahead, so the sampler's own position is not what the loop received:
    it says so, and the loader's state_dict is the answer."""
    sampler = GlobalShuffleSampler(N, seed=5)
    ds = SharedStoreDataset(numbered, decode="bytes")
    with TransformLoader(ds, tt.features, batch_size=30, sampler=sampler, depth=5) as loader:
        it = iter(loader)
        next(it)
        with pytest.raises(RuntimeError, match="ahead of the training loop"):
            sampler.state_dict()
        assert loader.state_dict()["sampler"]["consumed"] == 30
        it.close()


def test_resume_other_sampler_skips_received_batches(numbered: Path) -> None:
    ds = SharedStoreDataset(numbered, decode="bytes")
    order = list(range(N - 1, -1, -1))
    want = reference(numbered, tt.features, order, 25)
    with TransformLoader(ds, tt.features, batch_size=25, sampler=order) as loader:
        it = iter(loader)
        head = [detach(next(it)) for _ in range(3)]
        state = loader.state_dict()
        it.close()
    assert state["batches"] == 3
    with TransformLoader(ds, tt.features, batch_size=25, sampler=order) as resumed:
        resumed.load_state_dict(state)
        rest = [detach(b) for b in resumed]
        assert resumed.state_dict() == {"version": 1, "batches": 0}  # the pass ended
    assert_same_batches(head + rest, want)


def test_abandoned_pass_then_a_full_one(numbered: Path) -> None:
    """Breaking out of a pass leaves batches under way in the workers; the next pass waits them out."""
    ds = SharedStoreDataset(numbered, decode="bytes")
    want = reference(numbered, tt.features, None, 20)
    with TransformLoader(ds, tt.features, batch_size=20, num_workers=2, depth=5) as loader:
        for k, _ in enumerate(loader):
            if k == 2:
                break
        got = [detach(b) for b in loader]
    assert_same_batches(got, want)


def test_abandoned_batches_are_skipped_not_decoded(numbered: Path, tmp_path: Path) -> None:
    """A new pass abandons the batches the old one left under way: each worker finishes the record
    in hand and skips the rest, instead of decoding batches no one will read."""
    log, gate = tmp_path / "log", tmp_path / "gate"
    recorder = tt.GatedRecorder(str(log), str(gate), gate_from=10)
    ds = SharedStoreDataset(numbered, decode="bytes")
    with TransformLoader(ds, recorder, batch_size=10, num_workers=2, depth=9) as loader:
        log.unlink()  # the parent's call that inferred the layout
        it = iter(loader)
        next(it)  # batch 0; batches 1 and 2 wait at the gate, 3..8 queued behind them
        it.close()
        pool = loader._pool
        assert pool is not None

        def open_gate_once_abandoned() -> None:
            while getattr(pool, "_skip_below", [1])[0] == 0:  # (without one: at once)
                time.sleep(0.005)
            gate.touch()

        opener = threading.Thread(target=open_gate_once_abandoned)
        opener.start()
        second = iter(loader)  # abandons batches 1..8 and waits for their answers
        opener.join()
        first_pass = sorted(int(x) for x in log.read_text().split())
        # Batch 0, then at most the record each worker held at the gate (10 or 20): a worker
        # that had not reached its record yet skips the whole batch.
        assert first_pass[:10] == list(range(10))
        assert set(first_pass[10:]) <= {10, 20}
        assert [int(i) for b in second for i in b["x"][:, 0]] == [
            int(tt.features(tt.numbered_record(i))["x"][0]) for i in range(N)
        ]


def test_closed_mid_pass_then_reopened(numbered: Path) -> None:
    ds = SharedStoreDataset(numbered, decode="bytes")
    loader = TransformLoader(ds, tt.features, batch_size=30)
    it = iter(loader)
    next(it)
    loader.close()
    with pytest.raises(smstore.StoreClosedError, match="closed during this pass"):
        next(it)
    assert len(list(loader)) == 10  # a new pass starts new workers
    loader.close()


# ------------------------------------------------------------------------------ errors


def test_worker_exception_names_record_and_traceback(numbered: Path) -> None:
    ds = SharedStoreDataset(numbered, decode="bytes")
    loader = TransformLoader(ds, tt.fail_at, batch_size=10, num_workers=2)
    with pytest.raises(WorkerError, match=f"record {tt.FAIL_AT} \\(batch 1\\)") as err:
        for _ in loader:
            pass
    text = str(err.value)
    assert "Traceback" in text
    assert "in fail_at" in text
    assert f"ValueError: cannot decode record {tt.FAIL_AT}" in text
    assert isinstance(err.value.__cause__, ValueError)
    assert isinstance(err.value, smstore.StoreError)
    assert loader._pool is None  # the workers were shut down
    # The next pass starts new workers and fails at the same record again.
    with pytest.raises(WorkerError, match=f"record {tt.FAIL_AT}"):
        list(loader)
    loader.close()


def test_sigkilled_worker_raises_instead_of_hanging(numbered: Path) -> None:
    ds = SharedStoreDataset(numbered, decode="bytes")
    loader = TransformLoader(ds, tt.die_at, batch_size=10, num_workers=2)
    it = iter(loader)
    procs = list(loader._pool.procs)  # type: ignore[union-attr]
    pids = [p.pid for p in procs]

    def hung(signum: int, frame: object) -> None:
        pytest.fail("the loader spun on the dead worker's closed pipe")  # not an OSError: nothing swallows it

    # A watchdog, not a timing assertion: the old code polled the dead worker's closed result pipe
    # forever (a closed end polls as readable), so this test hung instead of failing.
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(120)
    try:
        with pytest.raises(WorkerError, match="killed by SIGKILL with batch 1 in hand"):
            for _ in it:
                pass
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert loader._pool is None
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists()  # reaped, not left as zombies


def test_ragged_records_are_refused(numbered: Path) -> None:
    ds = SharedStoreDataset(numbered, decode="bytes")
    with (
        TransformLoader(ds, tt.ragged, batch_size=8, num_workers=1) as loader,
        pytest.raises(
            CollateError, match=r"record 1 \(batch 0\): the output has shape \(3,\), not the layout's \(2,\)"
        ),
    ):
        next(iter(loader))


def test_declared_spec_refuses_mismatches(numbered: Path) -> None:
    ds = SharedStoreDataset(numbered, decode="bytes")
    spec = {"x": ((16,), np.int32), "length": ((), np.int64), "sum": ((), np.uint32)}
    with (
        TransformLoader(ds, tt.features, batch_size=8, spec=spec, num_workers=1) as loader,
        pytest.raises(
            CollateError, match="'x' has dtype float32, which does not cast safely to the layout's int32"
        ),
    ):
        next(iter(loader))
    with (
        TransformLoader(
            ds, tt.features, batch_size=8, spec={"x": ((16,), np.float32)}, num_workers=1
        ) as loader,
        pytest.raises(CollateError, match="fields"),
    ):
        next(iter(loader))
    with pytest.raises(TypeError, match="must be \\(shape, dtype\\)"):
        TransformLoader(ds, tt.features, batch_size=8, spec={"x": "float32"})
    with pytest.raises(CollateError, match="not an array"):
        TransformLoader(ds, str, batch_size=8)


def test_spawn_refuses_a_lambda_clearly(numbered: Path) -> None:
    ds = SharedStoreDataset(numbered, decode="bytes")
    loader = TransformLoader(ds, lambda r: tt.features(r), batch_size=8, multiprocessing_context="spawn")
    with pytest.raises(TypeError, match="define the transform at module level"):
        iter(loader)
    loader.close()


# ------------------------------------------------------------------------------ shutdown


def children() -> set[int]:
    out: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        out.update(int(p) for p in (task / "children").read_text().split())
    return out


def resources() -> tuple[set[str], set[str], list[str]]:
    """This process's open descriptors of the kinds a loader makes (pipes, shared memory: threads
    that earlier tests left reading files open and close others meanwhile), the /dev/shm names
    torch makes (others' come and go on a shared machine), and this process's shared-memory mappings."""
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed since listed
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(("pipe:", "socket:", "anon_inode:", "/memfd:")) or "/dev/shm" in target:
                fds.add(f"{fd} -> {target}")
    shm = {name for name in os.listdir("/dev/shm") if name.startswith("torch_")}
    maps = [
        line
        for line in Path("/proc/self/maps").read_text().splitlines()
        if "/dev/shm" in line or "memfd" in line
    ]
    return fds, shm, maps


@pytest.mark.parametrize("context", SLOW_STARTS[:2])
def test_shutdown_mid_epoch_leaves_nothing(numbered: Path, context: str) -> None:
    ds = SharedStoreDataset(numbered, decode="bytes")
    ds[0]
    # Once first: spawn starts multiprocessing's resource tracker (one process and descriptor for
    # the life of the interpreter) on first use.
    with TransformLoader(
        ds, tt.features, batch_size=10, num_workers=1, multiprocessing_context=context
    ) as warm:
        next(iter(warm))
    gc.collect()
    before_children = children()
    fds, shm, maps = resources()
    loader = TransformLoader(ds, tt.features, batch_size=10, num_workers=2, multiprocessing_context=context)
    it = iter(loader)
    batch = next(it)
    next(it)
    workers = {p.pid for p in loader._pool.procs}  # type: ignore[union-attr]
    assert workers <= children()
    assert resources() != (fds, shm, maps)  # the ring is mapped, its descriptor open
    loader.close()  # mid-epoch, batches under way in the workers
    assert children() == before_children
    for pid in workers:
        assert not Path(f"/proc/{pid}").exists()
    kept = batch["x"].clone()
    assert torch.equal(batch["x"], kept)  # a batch kept after close() is still mapped
    del batch, it, loader
    gc.collect()
    assert resources() == (fds, shm, maps)


def test_its_workers_never_fork_the_process_by_default(tmp_path: Path) -> None:
    """A rank of a process group forks at its peril (gloo's thread inside Python hangs the child):
    by default the workers start by forkserver. Run beside fork_hazard.py's thread, under which any
    fork of the process fails, the default loader reads every record (a forked worker exited 70)."""
    import subprocess
    import sys

    path = tmp_path / "data.smst"
    smstore.pack([b"x" * (i % 7) for i in range(40)], path)
    script = tmp_path / "rank.py"
    script.write_text(
        "import sys\n"
        "import smstore\n"
        "if __name__ == '__main__':\n"
        "    ds = smstore.SharedStoreDataset(sys.argv[1], decode='bytes')\n"
        "    with smstore.TransformLoader(ds, len, batch_size=8, num_workers=2) as loader:\n"
        "        print(sum(int(x) for b in loader for x in b))\n"
    )
    hazard = Path(__file__).parent / "fork_hazard.py"
    out = subprocess.run(
        [sys.executable, os.fspath(hazard), os.fspath(script), os.fspath(path)],
        capture_output=True,
        text=True,
        timeout=300,  # a guard only: a forked worker exits at once under the hazard
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout) == sum(i % 7 for i in range(40))
