"""SharedList: one copy per node, handed to local ranks and workers, never left behind."""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch.utils.data
from smstore_testlib import SAFE_CWD, ItemsDataset, annotation, identity_collate, report_shared_list
from squatter import Squatter, python_for_nobody

import smstore
import smstore.read.localjob
from smstore import SharedList

RANK_SCRIPT = str(Path(__file__).with_name("shared_list_rank.py"))
N = 2000


@pytest.fixture(autouse=True)
def _no_job_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # The tests choose the topology; a LOCAL_RANK from an outer launcher must not leak in.
    for var in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "SMSTORE_JOB_ID"):
        monkeypatch.delenv(var, raising=False)


def memfds_named(name: str) -> list[str]:
    """Processes (of anyone we can see) holding a descriptor of our memfd: 'pid:fd'."""
    held = []
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            for fd in (pid_dir / "fd").iterdir():
                if f"smstore-list:{name}" in os.readlink(fd):
                    held.append(f"{pid_dir.name}:{fd.name}")
        except OSError:
            continue
    return held


def shm_entries(name: str) -> set[str]:
    """What a SharedList could have left in /dev/shm (it never names anything there; this checks it)."""
    return {p.name for p in Path("/dev/shm").iterdir() if name in p.name or "smstore-list" in p.name}


def _pump(stream: Any, lines: queue.Queue[str | None]) -> None:
    with contextlib.suppress(ValueError, OSError):  # the job's teardown closes the pipe under us
        for line in stream:
            lines.put(line)
    lines.put(None)


class Job:
    """Local ranks of a simulated job: subprocesses with LOCAL_RANK set, each in its own process group."""

    def __init__(self, world: int = 2, **env: str) -> None:
        self.env = {
            **os.environ,
            "LOCAL_WORLD_SIZE": str(world),
            "SMSTORE_JOB_ID": f"test-{uuid.uuid4().hex}",
            **env,
        }
        self.procs: list[subprocess.Popen[str]] = []
        self._lines: dict[int, queue.Queue[str | None]] = {}

    def start(self, rank: int, mode: str, n: int = N, **env: str) -> subprocess.Popen[str]:
        p = subprocess.Popen(
            [sys.executable, RANK_SCRIPT, mode, str(n)],
            env={**self.env, "LOCAL_RANK": str(rank), **env},
            cwd=SAFE_CWD,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its DataLoader workers share its process group: one kill ends all
        )
        self.procs.append(p)
        return p

    def read(self, p: subprocess.Popen[str], timeout: float = 60) -> dict[str, Any]:
        """The next JSON line of a rank (bounded).

        A thread reads each rank's stdout into a queue: select() on a buffered pipe misses a line that
        arrived in the same read as the one before it (and then waits for output that never comes).
        """
        lines = self._lines.get(p.pid)
        if lines is None:
            assert p.stdout is not None
            lines = self._lines[p.pid] = queue.Queue()
            threading.Thread(target=_pump, args=(p.stdout, lines), daemon=True).start()
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("no output from a rank in time") from None
        if line is None:
            raise AssertionError(f"rank exited with {p.wait(timeout=10)} and no output")
        return dict(json.loads(line))

    def finish(self, p: subprocess.Popen[str]) -> dict[str, Any]:
        out = self.read(p)
        while out.get("event") == "start":
            out = self.read(p)
        p.wait(timeout=60)
        return out

    def kill_all(self) -> None:
        for p in self.procs:
            # The group we created: this rank and its workers (which may outlive the rank).
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
            if p.stdout is not None:
                p.stdout.close()


@pytest.fixture
def job() -> Iterator[type[Job]]:
    made: list[Job] = []

    class TrackedJob(Job):
        def __init__(self, *a: Any, **kw: str) -> None:
            super().__init__(*a, **kw)
            made.append(self)

    yield TrackedJob
    for j in made:
        j.kill_all()


# ---- one process ----


def test_sequence_behaviour() -> None:
    objs = [annotation(i) for i in range(100)]
    lst = SharedList(objs)
    assert isinstance(lst, Sequence)
    assert len(lst) == 100
    assert lst[0] == objs[0]
    assert lst[-1] == objs[-1]
    assert lst[10:20] == objs[10:20]
    assert lst[::-7] == objs[::-7]
    assert lst[95:200] == objs[95:200]
    assert list(lst) == objs
    assert objs[42] in lst
    assert lst.index(objs[42]) == 42
    with pytest.raises(IndexError):
        lst[100]
    lst[3]["boxes"].append("changed")  # a fresh object each time
    assert lst[3] == objs[3]
    assert lst.role == "single"
    lst.close()


def test_pickles_as_a_small_handle() -> None:
    lst = SharedList([annotation(i) for i in range(5000)])
    data = pickle.dumps(lst)
    assert len(data) < 400 < lst.nbytes
    again = pickle.loads(data)
    assert again.role == "attached"
    assert list(again) == list(lst)
    assert os.fstat(again._fd).st_ino == os.fstat(lst._fd).st_ino  # the same shared copy


def test_unpicklable_names_index_and_type_and_leaks_nothing() -> None:
    fds_before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(smstore.PackInputError, match=r"object 2 \(function\)"):
        SharedList([1, 2, lambda: 3], name="bad-input")
    assert set(os.listdir("/proc/self/fd")) <= fds_before
    assert memfds_named("bad-input") == []


def test_too_little_memory_gives_size_and_fixes() -> None:
    objs = [annotation(i) for i in range(20_000)]
    with pytest.raises(smstore.SharedMemoryError, match=r"needs about .*MiB") as info:
        SharedList(objs, name="no-room", room_limit=1 << 20)
    message = str(info.value)
    assert "docker run --memory=" in message
    assert "not against /dev/shm" in message
    assert memfds_named("no-room") == []
    SharedList(objs, room_limit=1 << 30).close()  # enough room


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_multiprocessing_children_attach(method: str) -> None:
    objs = [annotation(i) for i in range(500)]
    lst = SharedList(objs)
    ctx = mp.get_context(method)
    q = ctx.Queue()
    p = ctx.Process(target=report_shared_list, args=(lst, q))
    p.start()
    role, item, n, ino = q.get(timeout=60)
    p.join(timeout=60)
    assert p.exitcode == 0
    assert (item, n, ino) == (objs[7], 500, os.fstat(lst._fd).st_ino)
    assert role == ("single" if method == "fork" else "attached")


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_dataloader_workers_read_the_shared_copy(method: str) -> None:
    objs = [annotation(i) for i in range(300)]
    lst = SharedList(objs)
    loader = torch.utils.data.DataLoader(
        ItemsDataset(lst),
        batch_size=16,
        num_workers=2,
        collate_fn=identity_collate,
        multiprocessing_context=method,
        shuffle=True,
    )
    got = [row for batch in loader for row in batch]
    assert sorted(i for i, *_ in got) == list(range(300))
    assert all(item == objs[i] for i, _pid, _role, item in got)
    assert {pid for _i, pid, _r, _x in got} - {os.getpid()}  # read in workers
    assert {role for _i, _p, role, _x in got} == {"single" if method == "fork" else "attached"}


# ---- a job of local ranks ----


def test_two_ranks_share_one_copy(job: type[Job]) -> None:
    j = job()
    r1 = j.start(1, "ok")
    r0 = j.start(0, "ok")
    out0, out1 = j.finish(r0), j.finish(r1)
    assert out0["role"] == "builder"
    assert out1["role"] == "waiter"
    assert out0["equal"]
    assert out1["equal"]
    assert out0["len"] == out1["len"] == N
    assert out0["ino"] == out1["ino"]  # the same memfd


def test_different_lists_are_an_error(job: type[Job]) -> None:
    j = job()
    r0, r1 = j.start(0, "diff"), j.start(1, "diff")
    assert j.finish(r0)["role"] == "builder"
    out = j.finish(r1)
    assert out["error"] == "SharedListMismatchError"
    assert "object 7" in out["message"]
    assert "something else" in out["message"]
    assert r1.returncode == 3


def test_different_lengths_are_an_error(job: type[Job]) -> None:
    j = job()
    r0, r1 = j.start(0, "shorter"), j.start(1, "shorter")
    j.finish(r0)
    out = j.finish(r1)
    assert out["error"] == "SharedListMismatchError"
    assert f"has {N - 1} objects" in out["message"]


def test_equal_objects_that_pickle_differently_are_not_an_error(job: type[Job]) -> None:
    # A set of strings iterates in a per-process order: the pickles differ, the lists do not.
    j = job()
    r0 = j.start(0, "sets", PYTHONHASHSEED="1")
    r1 = j.start(1, "sets", PYTHONHASHSEED="2")
    assert j.finish(r0)["equal"]
    out = j.finish(r1)
    assert out["role"] == "waiter"
    assert out["equal"]


def connected_waiters(address: bytes) -> int:
    """Accepted connections on the builder's abstract socket (/proc/net/unix shows them with its name)."""
    want = "@" + address[1:].decode()
    lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    return sum(1 for line in lines if line.split()[-1] == want and line.split()[5] == "03")


def test_builder_killed_mid_build_makes_waiters_raise(
    job: type[Job], monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"killed-{uuid.uuid4().hex[:8]}"
    j = job(SL_NAME=name)
    monkeypatch.setenv("SMSTORE_JOB_ID", j.env["SMSTORE_JOB_ID"])
    address = smstore.read.localjob.address_for(name)
    r0 = j.start(0, "slow", n=100_000)  # about 1000 s at 10 ms per object
    r1 = j.start(1, "slow", n=100_000)
    deadline = time.monotonic() + 60
    while not (memfds_named(name) and connected_waiters(address)):  # building, and rank 1 waits on it
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(r0.pid, signal.SIGKILL)
    killed = time.monotonic()
    out = j.finish(r1)
    assert time.monotonic() - killed < 20
    assert out["error"] == "SharedListError"
    assert "exited" in out["message"]
    assert memfds_named(name) == []


def test_no_builder_times_out(job: type[Job]) -> None:
    j = job(SL_TIMEOUT="1")
    start = time.monotonic()
    out = j.finish(j.start(1, "ok", n=10))
    assert time.monotonic() - start < 30
    assert out["error"] == "SharedListError"
    assert "no local rank 0" in out["message"]


# ---- another user on the node ----


@pytest.mark.skipif(
    os.getuid() != 0 or python_for_nobody() is None, reason="needs root and a Python uid 65534 can run"
)
@pytest.mark.parametrize("how", ["accepts", "listens", "binds"])
def test_another_user_cannot_make_a_job_fail_or_wait(
    job: type[Job], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, how: str
) -> None:
    """uid 65534 takes every name the job's processes could meet at; the job completes all the same.

    The names: the list's abstract socket (derived from the uid, the job key and the list name: all
    guessable, torchrun's defaults being none/127.0.0.1/29500), private names it might guess, and
    the per-user daemon directory (here under $XDG_RUNTIME_DIR, standing in for /tmp/smstore-<uid>).
    A waiter that found no builder would wait for the ranks' timeout (600 s), past the harness's.
    """
    name = f"squat-{uuid.uuid4().hex[:8]}"
    j = job(SL_NAME=name, SL_TIMEOUT="600")
    monkeypatch.setenv("SMSTORE_JOB_ID", j.env["SMSTORE_JOB_ID"])
    address = smstore.read.localjob.address_for(name)
    guesses = [address + b"-" + (f"{k:x}" * 32)[:32].encode() for k in range(16)]
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    runtime.chmod(0o1777)  # sticky and open to all, like /tmp
    j.env["XDG_RUNTIME_DIR"] = os.fspath(runtime)
    j.env.pop("SMSTORE_SOCKET", None)
    squatter = Squatter(
        listen=guesses + ([address] if how != "binds" else []),
        bind_only=[address] if how == "binds" else [],
        accept=how == "accepts",
        socket_dir=runtime,
    )
    try:
        r1 = j.start(1, "ok")
        r0 = j.start(0, "ok")
        out0, out1 = j.finish(r0), j.finish(r1)
    finally:
        accepted = squatter.stop()
    assert out0.get("role") == "builder", out0
    assert out1.get("role") == "waiter", out1
    assert out0["equal"]
    assert out1["equal"]
    assert out0["ino"] == out1["ino"]  # one copy: the waiter found the builder
    # The daemon directory is another user's: nobody connected to the socket in it.
    assert "daemon socket" not in accepted


@pytest.mark.skipif(
    os.getuid() != 0 or python_for_nobody() is None, reason="needs root and a Python uid 65534 can run"
)
def test_a_process_of_this_user_is_found_on_either_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the election of ranks without LOCAL_RANK relies on: a second server of the user is refused."""
    monkeypatch.setenv("SMSTORE_JOB_ID", f"test-{uuid.uuid4().hex}")
    lj = smstore.read.localjob
    address = lj.address_for("elect")
    squatter = Squatter(listen=[address], accept=True)
    try:
        first = lj.bind_listener(address, "elect")  # another uid holds the name: a private one
        try:
            name = first.getsockname()
            assert name.startswith(address + b"-")
            with pytest.raises(OSError, match="already serves it"):
                lj.bind_listener(address, "elect")
            peer = lj.connect(address, "elect", time.monotonic() + 30)
            try:
                assert peer.pid == os.getpid()
            finally:
                peer.close()
        finally:
            first.close()
    finally:
        squatter.stop()


def write_jsonl(path: Path, n: int) -> None:
    path.write_text("".join(json.dumps(annotation(i)) + "\n" for i in range(n)))


# ---- the loader form: one process per node loads ----


def test_loader_form_loads_in_one_child_and_every_rank_attaches(job: type[Job], tmp_path: Path) -> None:
    source = tmp_path / "ann.jsonl"
    write_jsonl(source, N)
    j = job(SL_FILE=os.fspath(source))
    r1, r0 = j.start(1, "ok"), j.start(0, "ok")
    out0, out1 = j.finish(r0), j.finish(r1)
    assert (out0["role"], out1["role"]) == ("builder", "waiter")
    assert out0["equal"]
    assert out1["equal"]
    assert out0["ino"] == out1["ino"]
    # Parsed once, by a process that is neither rank (local rank 0's short-lived child).
    assert len(out0["loaded_by"]) == 1
    assert out0["loaded_by"] == out1["loaded_by"]
    assert out0["loaded_by"][0] not in (out0["pid"], out1["pid"])


def test_a_changed_source_file_is_a_new_key(job: type[Job], tmp_path: Path) -> None:
    # Rank 1 sees the file after it changed (same size, new mtime): it must not attach rank 0's copy.
    source, gate = tmp_path / "ann.jsonl", tmp_path / "gate"
    write_jsonl(source, N)
    os.mkfifo(gate)
    j = job(SL_FILE=os.fspath(source), SL_GATE=os.fspath(gate))
    r0 = j.start(0, "file-block")
    assert j.read(r0)["event"] == "start"
    assert j.read(r0)["event"] == "loading"  # its key is taken; its child waits at the gate
    st = source.stat()
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    r1 = j.start(1, "ok")
    out1 = j.finish(r1)
    assert out1["error"] == "SharedListMismatchError", out1
    assert "changed" in out1["message"]
    assert "mtime_ns" in out1["message"]
    with open(gate, "w"):
        pass  # let rank 0 finish
    out0 = j.finish(r0)
    assert out0["role"] == "builder"
    assert out0["equal"]


def test_daemon_serves_the_loader_form_by_key_and_a_changed_file_is_loaded_anew(
    start_daemon: Callable[..., Any], tmp_path: Path
) -> None:
    d = start_daemon()
    source = tmp_path / "ann.jsonl"
    write_jsonl(source, 300)
    first = SharedList.from_file(source, "jsonl", name="a", socket=d.sock)
    assert first.via_daemon == "shared"
    again = SharedList.from_file(source, "jsonl", name="b", socket=d.sock)
    assert again.via_daemon == "attached"  # same file, same key: the daemon's copy, nothing loaded
    assert os.fstat(again._fd).st_ino == os.fstat(first._fd).st_ino
    source.write_text(source.read_text().replace('"img_id": 7,', '"img_id": 70,'))
    changed = SharedList.from_file(source, "jsonl", name="c", socket=d.sock)
    assert changed.via_daemon == "shared"  # a new key: loaded anew, never the stale copy
    assert os.fstat(changed._fd).st_ino != os.fstat(first._fd).st_ino
    assert changed[7]["img_id"] == 70
    assert first[7]["img_id"] == 7
    for lst in (first, again, changed):
        lst.close()


def test_loader_errors_reach_local_rank_0_as_raised_and_leak_nothing() -> None:
    fds_before = set(os.listdir("/proc/self/fd"))

    def broken() -> list[int]:
        raise KeyError("no such field")

    with pytest.raises(KeyError, match="no such field"):
        SharedList.from_loader(broken, key="broken", name="broken", mode="mmap")
    with pytest.raises(smstore.PackInputError, match=r"object 1 \(function\)"):
        SharedList.from_loader(lambda: [1, lambda: 2, 3], key="bad", name="bad-loader", mode="mmap")
    with pytest.raises(smstore.SharedListError, match="killed by signal 9"):
        SharedList.from_loader(
            lambda: os.kill(os.getpid(), signal.SIGKILL), key="dies", name="dies", mode="mmap"
        )
    assert set(os.listdir("/proc/self/fd")) <= fds_before
    assert memfds_named("broken") == memfds_named("bad-loader") == memfds_named("dies") == []
    lst = SharedList.from_loader(lambda: iter(range(5)), key="ok", state=lambda: {"n": 5}, mode="mmap")
    assert (list(lst), lst.loader_state) == ([0, 1, 2, 3, 4], {"n": 5})
    lst.close()


def test_rank_0_killed_while_loading_makes_waiters_raise(
    job: type[Job], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    name = f"loadkill-{uuid.uuid4().hex[:8]}"
    gate = tmp_path / "gate"
    os.mkfifo(gate)  # never opened for writing: the loading child waits there until killed
    j = job(SL_NAME=name, SL_GATE=os.fspath(gate))
    monkeypatch.setenv("SMSTORE_JOB_ID", j.env["SMSTORE_JOB_ID"])
    address = smstore.read.localjob.address_for(name)
    r0 = j.start(0, "loader-block", n=100)
    r1 = j.start(1, "loader-block", n=100)
    assert j.read(r0)["event"] == "start"
    loading = j.read(r0)  # printed by the loading child, which now waits at the gate
    assert loading["event"] == "loading"
    assert loading["pid"] != r0.pid
    deadline = time.monotonic() + 60
    while not connected_waiters(address):  # rank 1 waits on rank 0
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(r0.pid, signal.SIGKILL)  # the rank only: its loading child must die with it
    out = j.finish(r1)
    assert out["error"] == "SharedListError"
    assert "exited" in out["message"]
    deadline = time.monotonic() + 30
    while memfds_named(name) or Path(f"/proc/{loading['pid']}").exists():
        assert time.monotonic() < deadline, "the loading child outlived its rank"
        time.sleep(0.05)


@pytest.mark.parametrize("form", ["list", "loader"])
def test_sigkill_of_the_whole_job_leaves_nothing(job: type[Job], tmp_path: Path, form: str) -> None:
    name = f"job-{uuid.uuid4().hex[:8]}"
    shm_before = shm_entries(name)
    extra = {}
    if form == "loader":
        write_jsonl(tmp_path / "ann.jsonl", N)
        extra["SL_FILE"] = os.fspath(tmp_path / "ann.jsonl")
    j = job(SL_NAME=name, **extra)
    r0, r1 = j.start(0, "workers"), j.start(1, "workers")
    for r in (r0, r1):
        out = j.read(r)
        while out.get("event") == "start":
            out = j.read(r)
        assert out["event"] == "reading", out
    assert len(memfds_named(name)) >= 2  # the ranks and their workers hold it
    j.kill_all()
    deadline = time.monotonic() + 30
    while memfds_named(name):  # orphaned workers may take a moment to die
        assert time.monotonic() < deadline, memfds_named(name)
        time.sleep(0.1)
    assert shm_entries(name) <= shm_before


# ---- through the daemon ----


def test_daemon_holds_the_copy_and_a_second_job_attaches(start_daemon: Callable[..., Any]) -> None:
    d = start_daemon()
    objects = [annotation(i) for i in range(500)]
    first = smstore.SharedList(objects, name="a", socket=d.sock)
    assert first.via_daemon == "shared"
    (seg,) = d.status()["segments"]
    assert seg["key"].startswith("blake2b-128:")
    assert seg["segment"] == f"memfd:{seg['key']}"
    assert seg["clients"] == [os.getpid()]
    assert seg["records"] == 500
    # Another job (here: another name) with the same contents builds nothing: it maps the same memfd.
    second = smstore.SharedList(objects, name="b", socket=d.sock)
    assert second.via_daemon == "attached"
    assert os.fstat(second._fd).st_ino == os.fstat(first._fd).st_ino
    assert list(second) == objects
    first.close()
    assert len(d.status()["segments"]) == 1  # second is still attached through the daemon
    assert list(second) == objects
    second.close()
    assert d.status()["segments"] == []  # the daemon let go when no client was left
    # Other contents are built anew; an iterator (read once) is built directly and then shared.
    third = smstore.SharedList(iter(objects[:10]), name="c", socket=d.sock)
    assert third.via_daemon == "shared"
    assert list(third) == objects[:10]
    third.close()
    assert d.status()["segments"] == []


def test_daemon_mode_without_a_daemon_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(smstore.DaemonError, match="cannot reach an smstore daemon"):
        smstore.SharedList([1, 2, 3], mode="daemon", socket=tmp_path / "none.sock")
    lst = smstore.SharedList([1, 2, 3], socket=tmp_path / "none.sock")  # auto: local
    assert lst.via_daemon is None
    assert list(lst) == [1, 2, 3]
    lst.close()


def test_a_shared_list_alive_at_interpreter_exit_closes_quietly() -> None:
    """A SharedList kept in a module global is closed by __del__ during interpreter shutdown, after
    the modules' globals may be cleared: it must not print "Exception ignored in __del__" (it did,
    with torch imported: 'NoneType' object has no attribute 'close')."""
    code = "import torch, smstore; KEPT = smstore.SharedList([{'a': 1}, {'b': 2}]); print(len(KEPT))"
    r = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120, cwd=SAFE_CWD
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "2"
    assert "Exception ignored" not in r.stderr, r.stderr
