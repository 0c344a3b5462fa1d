"""Shared fixtures: small corpora with awkward bytes and helpers to pack them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import settings

if TYPE_CHECKING:
    from remote_testlib import S3, FaultProxy

# Make the helper module importable by name, here and in spawn/forkserver children (they inherit sys.path).
sys.path.insert(0, str(Path(__file__).parent))

from daemon_testlib import Daemon, make_records
from smstore_testlib import AWKWARD

import smstore
from smstore import _core
from smstore.daemon.segments import list_segments

# No example database: the suite leaves nothing behind in the source tree.
settings.register_profile("smstore", database=None)
settings.load_profile("smstore")


@pytest.fixture(autouse=True, scope="session")
def _run_outside_the_source_tree() -> Iterator[None]:
    """Run the suite (and every subprocess it starts) from tests/, not the repository root.

    From the root, `python -m smstore` or `python -c "import smstore"` would import the source
    tree's smstore/ (which has no compiled module) instead of the installed package.
    """
    before = Path.cwd()
    os.chdir(Path(__file__).parent)
    try:
        yield
    finally:
        os.chdir(before)


@pytest.fixture
def ctrl_c() -> Iterator[None]:
    """Ctrl-C as an interactive shell gives it, whatever this run inherited: a suite started in the
    background (`cmd &` in a script) has SIGINT ignored, and children inherit the ignoring."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.fixture
def awkward_records() -> list[bytes]:
    return list(AWKWARD)


@pytest.fixture
def make_blob(tmp_path: Path) -> Callable[..., Path]:
    """Pack records (with smstore.pack) into a fresh file under tmp_path and return its path."""
    counter = iter(range(10**9))

    def _make(records: list[bytes] | list[str], name: str | None = None, **kw: object) -> Path:
        path = tmp_path / (name or f"blob{next(counter)}.smst")
        kw.setdefault("durable", False)
        smstore.pack(records, path, **kw)  # type: ignore[arg-type]
        return path

    return _make


@pytest.fixture
def awkward_blob(make_blob: Callable[..., Path]) -> Path:
    return make_blob(AWKWARD, name="awkward.smst")


# ---- the node daemon -----------------------------------------------------------------------


@pytest.fixture
def blob(tmp_path: Path) -> tuple[Path, list[bytes]]:
    recs = make_records(2000)
    path = tmp_path / "data.smst"
    smstore.pack(recs, path)
    return path, recs


@pytest.fixture
def second_blob(tmp_path: Path) -> tuple[Path, list[bytes]]:
    recs = make_records(500, seed=7)
    path = tmp_path / "other.smst"
    smstore.pack(recs, path)
    return path, recs


@pytest.fixture
def start_daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Daemon]]:
    """Starts `smstore serve` on a socket unique to the test; stops it and checks /dev/shm after."""
    sockdir = tmp_path / "run"
    sockdir.mkdir(mode=0o700)
    sock = sockdir / "smstore.sock"
    monkeypatch.setenv("SMSTORE_SOCKET", os.fspath(sock))
    started: list[Daemon] = []

    def start(
        *files: Path,
        args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        loaded: int = -1,
        at: Path | None = None,
        launcher: tuple[str, ...] = ("-m", "smstore"),
    ) -> Daemon:
        log = tmp_path / f"daemon{len(started)}.log"
        with open(log, "wb") as err:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    *launcher,  # an instrumented `smstore serve` for some tests (budget_daemon.py)
                    "serve",
                    "--socket",
                    os.fspath(at or sock),
                    *map(str, files),
                    *args,
                ],
                stderr=err,
                env={**os.environ, **(env or {})},
            )
        d = Daemon(proc, at or sock, log)
        started.append(d)
        d.wait_loaded(len(files) if loaded < 0 else loaded)
        return d

    yield start
    leftovers: list[str] = []
    for d in started:
        if d.proc.poll() is None:
            d.proc.send_signal(signal.SIGTERM)
            try:
                d.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                d.proc.kill()
                d.proc.wait()
        for name in list_segments(d.pid, locks=True):
            leftovers.append(name)
            _core.shm_unlink("/" + name)
    assert not leftovers, f"segments left in /dev/shm: {leftovers}"
    assert not any(d.sock.exists() for d in started), "socket left behind"


# --- a real S3 server (moto) behind a fault proxy, for the remote tests ----------------------------


@pytest.fixture(scope="module")
def s3() -> Iterator[S3]:
    """moto's S3 server behind a fault proxy, with the AWS environment pointing smstore at the proxy."""
    from remote_testlib import BUCKET, S3, SECRET, FaultProxy, MotoS3

    moto = MotoS3()
    proxy = FaultProxy(moto.port)
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": proxy.endpoint,  # every call of smstore.remote goes through the proxy
        "AWS_ALLOW_HTTP": "true",
    }
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
            mp.delenv(k, raising=False)
        s = S3(moto, proxy)
        s.client.create_bucket(Bucket=BUCKET)
        try:
            yield s
        finally:
            proxy.stop()
            moto.stop()


@pytest.fixture
def proxy(s3: S3) -> Iterator[FaultProxy]:
    """The fault proxy in front of moto, cleared of faults and history for each test."""
    every = lambda method, path, headers: True
    s3.proxy.inject(matches=every)  # no faults or hooks left over from another test
    s3.proxy.seen.clear()
    s3.proxy.answered.clear()
    s3.proxy.stalled.clear()
    s3.proxy.hold_stalls()  # a test's stalls last until it releases them, or it ends
    yield s3.proxy
    s3.proxy.inject(matches=every)
    s3.proxy.release()
