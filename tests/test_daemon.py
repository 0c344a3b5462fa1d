"""The node daemon: real `smstore serve` processes on real sockets, real /dev/shm, real fork/spawn/forkserver."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import smstore_testlib as tl
from daemon_testlib import (
    IS_ROOT,
    SHM,
    Daemon,
    check_all,
    cli,
    make_records,
)

import smstore
from smstore import _core
from smstore.daemon.segments import list_segments
from smstore.errors import ChecksumMismatchError, DaemonError, SharedMemoryError, StoreFormatError
from smstore.read import modes as _modes
from smstore.wire.client import DaemonStore, open_store

# ---- basics -----------------------------------------------------------------------------------


def test_serve_attach_status_stop(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon]
) -> None:
    path, recs = blob
    d = start_daemon(path)
    store = open_store(path, mode="daemon")
    assert isinstance(store, DaemonStore)
    check_all(store, recs)
    assert store.metadata["encoding"] == "bytes"
    assert store.path == os.fspath(path)
    (name,) = list_segments(d.pid)
    st = (SHM / name).stat()
    assert st.st_mode & 0o777 == 0o400, "segments are read-only and private"
    assert st.st_size == path.stat().st_size
    seg = d.segment(store.checksum)
    assert seg["paths"] == [os.fspath(path)]
    assert seg["clients"] == [os.getpid()]
    assert seg["size"] == path.stat().st_size
    out = cli("status", sock=d.sock).stdout
    assert os.fspath(path) in out
    assert store.checksum in out
    assert str(os.getpid()) in out
    # Stopping unlinks the segment; this process's mapping stays valid.
    cli("stop", sock=d.sock)
    assert d.proc.wait(timeout=10) == 0
    assert list_segments(d.pid) == []
    assert not d.sock.exists()
    check_all(store, recs)
    store.close()
    assert "Traceback" not in d.log.read_text()


def test_auto_falling_back_from_a_daemon_warns_once_per_process(
    blob: tuple[Path, list[bytes]],
    start_daemon: Callable[..., Daemon],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_modes, "_warned_fallback", False)  # a fresh process
    monkeypatch.setattr(_modes, "_logged", set())
    caplog.set_level(logging.INFO, logger="smstore")
    path, recs = blob
    other = tmp_path / "other.smst"
    smstore.pack([b"x", b"y"], other)
    d = start_daemon()  # serves neither file
    check_all(open_store(path), recs)
    assert type(open_store(other)) is smstore.Store
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned  # once per process, at the first fallback
    for text in (str(path), "does not serve this file", f"smstore load {path}", str(d.sock), "mode='mmap'"):
        assert text in warned[0], text
    assert any(r.levelno == logging.INFO and str(other) in r.getMessage() for r in caplog.records)


def test_auto_without_any_daemon_stays_quiet(
    blob: tuple[Path, list[bytes]],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No daemon at the per-user default socket is the normal case without one: no warning.
    monkeypatch.setattr(_modes, "_warned_fallback", False)
    monkeypatch.setattr(_modes, "_logged", set())
    monkeypatch.delenv("SMSTORE_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", os.fspath(tmp_path))
    caplog.set_level(logging.INFO, logger="smstore")
    assert type(open_store(blob[0])) is smstore.Store
    assert [r.levelno for r in caplog.records if "mapping the file" in r.getMessage()] == [logging.INFO]


def test_modes(
    blob: tuple[Path, list[bytes]],
    start_daemon: Callable[..., Daemon],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    path, recs = blob
    caplog.set_level(logging.INFO, logger="smstore")
    # No daemon yet: auto maps the file and says so once; daemon mode is a clear error.
    s = open_store(path)
    assert type(s) is smstore.Store
    check_all(s, recs)
    assert any("mapping the file" in r.getMessage() for r in caplog.records)
    with pytest.raises(DaemonError, match="cannot reach an smstore daemon"):
        open_store(path, mode="daemon")
    other = tmp_path / "other.smst"
    smstore.pack([b"x", b"y"], other)
    start_daemon(path)
    assert isinstance(open_store(path), DaemonStore)
    assert sum("shared-memory copy" in r.getMessage() for r in caplog.records) == 1
    assert isinstance(open_store(path), DaemonStore)
    assert sum("shared-memory copy" in r.getMessage() for r in caplog.records) == 1, "logs once"
    assert type(open_store(path, mode="mmap")) is smstore.Store
    # A file the daemon does not serve.
    assert type(open_store(other)) is smstore.Store
    with pytest.raises(DaemonError, match="does not serve"):
        open_store(other, mode="daemon")
    with pytest.raises(ValueError, match="mode"):
        open_store(path, mode="shm")  # type: ignore[arg-type]
    with pytest.raises(smstore.StoreNotFoundError):
        open_store(tmp_path / "missing.smst", mode="daemon")


def test_collator_reads_through_the_daemon(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon]
) -> None:
    from smstore.loading.collate import TokenCollator

    path, recs = blob
    with pytest.raises(DaemonError, match="cannot reach an smstore daemon"):
        TokenCollator(path, mode="daemon")
    start_daemon(path)
    collate = TokenCollator(path, layout="pack", mode="daemon")
    assert isinstance(collate.store, DaemonStore)
    assert type(TokenCollator(path, mode="mmap").store) is smstore.Store
    batch = collate([3, 0, 7])
    expected = recs[3] + recs[0] + recs[7]
    assert bytes(batch["tokens"].numpy().astype("uint8")) == expected


def test_dataset_socket_argument_reaches_workers(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch
) -> None:
    from smstore import SharedStoreDataset

    path, recs = blob
    d = start_daemon(path)
    monkeypatch.delenv("SMSTORE_SOCKET", raising=False)  # only the argument points at the daemon
    ds = SharedStoreDataset(path, mode="daemon", socket=d.sock, decode="bytes")
    assert isinstance(ds.store, DaemonStore)
    clone = pickle.loads(pickle.dumps(ds))  # what a spawn worker receives
    assert [clone[i] for i in range(len(recs))] == recs
    assert isinstance(clone.store, DaemonStore)
    with pytest.raises(DaemonError):
        SharedStoreDataset(path, mode="daemon", socket=d.sock.parent / "nobody.sock")


def test_readers_do_not_import_the_daemon(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon]
) -> None:
    """What a DataLoader worker imports and runs (attach through the daemon, read, collate) never
    loads the daemon's event loop, segment bookkeeping or the CLI."""
    path, recs = blob
    d = start_daemon(path)
    code = (
        "import sys, pickle, smstore\n"
        "from smstore import SharedStoreDataset, TokenCollator, GlobalShuffleSampler, open_store\n"
        f"ds = pickle.loads(pickle.dumps(SharedStoreDataset({os.fspath(path)!r}, mode='daemon', socket={os.fspath(d.sock)!r})))\n"
        "assert type(ds.store).__name__ == 'DaemonStore', ds.store\n"
        "first = bytes(ds[0])\n"
        f"c = pickle.loads(pickle.dumps(TokenCollator({os.fspath(path)!r}, mode='daemon', socket={os.fspath(d.sock)!r})))\n"
        "c([0, 1]); list(GlobalShuffleSampler(len(ds), seed=0, rank=0, world_size=1))\n"
        "print(first.hex(), sorted(m for m in sys.modules if m in ('smstore.daemon', 'smstore.daemon.segments', 'smstore.cli')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == [recs[0].hex(), "[]"]


def test_daemon_does_not_import_torch() -> None:
    code = (
        "import sys, smstore.cli, smstore.daemon, smstore.wire.client\n"
        "smstore.daemon.serve  # the server, loaded on first use\n"
        "print('smstore.daemon.server' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False"]


def test_listing_segments_does_not_load_the_server() -> None:
    """`smstore.list_segments` and `collect_garbage` (what `smstore gc` runs) load the daemon package's
    segment bookkeeping only: its __init__ stays light."""
    code = (
        "import sys, smstore\n"
        "smstore.list_segments(); smstore.collect_garbage\n"
        "print(sorted(m for m in sys.modules if m.startswith('smstore.daemon')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['smstore.daemon', 'smstore.daemon.segments', 'smstore.daemon.state']"


def test_matched_by_content_and_new_generation(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    path, recs = blob
    d = start_daemon(path)
    # A copy elsewhere has the same checksum: it is served by the same segment.
    copy = tmp_path / "copy.smst"
    shutil.copyfile(path, copy)
    old = open_store(copy, mode="daemon")
    assert isinstance(old, DaemonStore)
    (first,) = list_segments(d.pid)
    # Rewrite the file: a new generation; `load` replaces the old one, whose readers keep their bytes.
    new_recs = make_records(500, seed=1)
    smstore.pack(new_recs, path)
    cli("load", os.fspath(path), sock=d.sock)
    (second,) = list_segments(d.pid)
    assert second != first
    new = open_store(path, mode="daemon")
    check_all(new, new_recs)
    check_all(old, recs)
    # Loading the same contents again is a no-op.
    cli("load", os.fspath(path), sock=d.sock)
    assert list_segments(d.pid) == [second]


def test_corrupt_blob_refused(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    path, _ = blob
    bad = tmp_path / "bad.smst"
    data = bytearray(path.read_bytes())
    data[5000] ^= 0x10
    bad.write_bytes(bytes(data))
    d = start_daemon()
    res = cli("load", os.fspath(bad), sock=d.sock, check=False)
    assert res.returncode == 1
    assert "checksum mismatch" in res.stderr
    assert os.fspath(bad) in res.stderr
    foreign = tmp_path / "foreign.smst"
    foreign.write_bytes(b"hello" * 2000)
    res = cli("load", os.fspath(foreign), sock=d.sock, check=False)
    assert res.returncode == 1
    assert "not an smstore blob" in res.stderr
    # Text given for a blob, short or long: the daemon says how to pack it.
    for text in (b"one line\n", b"many lines\n" * 1000):
        notes = tmp_path / "notes.txt"
        notes.write_bytes(text)
        res = cli("load", os.fspath(notes), sock=d.sock, check=False)
        assert res.returncode == 1
        assert f"smstore pack {notes} -o {tmp_path / 'notes.smst'}" in res.stderr
    assert list_segments(d.pid) == []
    assert d.status()["segments"] == []
    # The daemon serves on.
    cli("load", os.fspath(path), sock=d.sock)
    assert len(list_segments(d.pid)) == 1


def _corrupt_indexes(path: Path) -> dict[str, bytearray]:
    """Blobs whose index alone is wrong (checksum recomputed): first offset, a step back, the end."""
    raw = bytearray(path.read_bytes())
    header = tl.parse_header(bytes(raw))
    at, count = header["index_offset"], header["record_count"]

    def offset(i: int, value: int) -> bytearray:
        out = bytearray(raw)
        out[at + 8 * i : at + 8 * i + 8] = value.to_bytes(8, "little")
        return tl.reseal(out)

    return {
        "first": offset(0, 3),
        "back": offset(count // 2, 0),
        "end": offset(count, header["data_size"] - 1),
    }


@pytest.mark.parametrize("hash_thread", [True, False], ids=["hash-thread", "one-thread"])
def test_load_checks_the_index_as_it_copies(
    blob: tuple[Path, list[bytes]], tmp_path: Path, hash_thread: bool
) -> None:
    path, _recs = blob
    name = f"/smstore-test-{os.getpid()}-index"
    for fault, data in _corrupt_indexes(path).items():
        bad = tmp_path / f"{fault}.smst"
        bad.write_bytes(bytes(data))
        with pytest.raises(StoreFormatError) as opened:
            smstore.open(bad)
        with pytest.raises(StoreFormatError) as loaded:
            _core.shm_load(os.fspath(bad), name, hash_thread=hash_thread)
        assert str(loaded.value) == str(opened.value), fault  # the same fault, in the same words
        assert "corrupt index" in str(loaded.value)
        assert not (SHM / name[1:]).exists()


@pytest.mark.parametrize("chunk", [1, 3, 7, 8, 13, 4096, 1 << 20])
def test_index_check_holds_across_any_chunking(
    blob: tuple[Path, list[bytes]], tmp_path: Path, chunk: int
) -> None:
    # A read may end inside an offset: the check must carry the split entry over.
    path, _recs = blob
    _core._check_index_stream(path.read_bytes(), chunk, os.fspath(path))  # a sound index passes
    for fault, data in _corrupt_indexes(path).items():
        bad = tmp_path / f"{fault}.smst"
        bad.write_bytes(bytes(data))
        with pytest.raises(StoreFormatError) as streamed:
            _core._check_index_stream(bytes(data), chunk, os.fspath(bad))
        with pytest.raises(StoreFormatError) as whole:
            smstore.open(bad)
        assert str(streamed.value) == str(whole.value), (fault, chunk)


@pytest.mark.parametrize("hash_thread", [True, False], ids=["hash-thread", "one-thread"])
def test_core_load_leaves_nothing_behind(
    blob: tuple[Path, list[bytes]], tmp_path: Path, hash_thread: bool
) -> None:
    path, recs = blob
    name = f"/smstore-test-{os.getpid()}-core"
    bad = tmp_path / "bad.smst"
    data = bytearray(path.read_bytes())
    for at in (-3, len(data) // 2):  # in the metadata (hashed last), and in the records
        data[at] ^= 1
        bad.write_bytes(bytes(data))
        with pytest.raises(ChecksumMismatchError):
            _core.shm_load(os.fspath(bad), name, hash_thread=hash_thread)
        data[at] ^= 1
        assert not (SHM / name[1:]).exists()
    fd, size, checksum, count = _core.shm_load(os.fspath(path), name, hash_thread=hash_thread)
    try:
        assert (size, count) == (path.stat().st_size, len(recs))
        assert os.fstat(fd).st_mode & 0o777 == 0o400
        assert os.get_blocking(fd)
        assert (os.O_ACCMODE & __import__("fcntl").fcntl(fd, __import__("fcntl").F_GETFL)) == os.O_RDONLY
        with pytest.raises(smstore.StoreIOError):  # O_EXCL: never overwrite an existing segment
            _core.shm_load(os.fspath(path), name)
        store = _core.Store._from_fd(fd, "seg", False)
        assert checksum == store.checksum
        store.verify()
    finally:
        os.close(fd)
        assert _core.shm_unlink(name)
    assert not _core.shm_unlink(name)


def test_core_creates_and_seals_a_segment() -> None:
    """shm_create/shm_seal, what shm_load does around its copy: O_EXCL, the owner's alone while
    written, then read-only with a read-only descriptor (the daemon's pieces and fetched shards)."""
    name = f"/smstore-test-{os.getpid()}-create"
    old_umask = os.umask(0o077)  # the core sets the mode itself, whatever the umask
    try:
        fd = _core.shm_create(name)
    finally:
        os.umask(old_umask)
    try:
        assert os.fstat(fd).st_mode & 0o777 == 0o600
        with pytest.raises(smstore.StoreIOError, match="File exists"):  # never an existing segment
            _core.shm_create(name)
        os.write(fd, b"written")
        ro = _core.shm_seal(fd, name)
        try:
            assert os.fstat(ro).st_mode & 0o777 == 0o400
            assert (os.O_ACCMODE & __import__("fcntl").fcntl(ro, __import__("fcntl").F_GETFL)) == os.O_RDONLY
            assert os.pread(ro, 7, 0) == b"written"
        finally:
            os.close(ro)
        ro = _core.shm_seal(fd, name, 0o440, os.getegid())
        os.close(ro)
        assert (SHM / name[1:]).stat().st_mode & 0o777 == 0o440
    finally:
        os.close(fd)
        assert _core.shm_unlink(name)


def test_core_creates_and_seals_a_memfd_and_tells_a_sealed_one(tmp_path: Path) -> None:
    """memfd_create/memfd_seal/memfd_sealed: SharedList's segments and the daemon's check of a shared
    blob, one rule for "its bytes never change" (write, grow and shrink sealed)."""
    fd = _core.memfd_create("smstore-test-memfd")
    try:
        assert os.readlink(f"/proc/self/fd/{fd}") == "/memfd:smstore-test-memfd (deleted)"
        os.write(fd, b"written")
        assert not _core.memfd_sealed(fd)  # writable yet
        ro = _core.memfd_seal(fd, "smstore-test-memfd")
        try:
            assert _core.memfd_sealed(fd)
            assert _core.memfd_sealed(ro)
            with pytest.raises(PermissionError):  # sealed: not even the creator's descriptor writes
                os.write(fd, b"again")
            with pytest.raises(OSError, match="Bad file descriptor"):
                os.write(ro, b"again")  # and the readers' descriptor is read-only
            assert os.pread(ro, 7, 0) == b"written"
        finally:
            os.close(ro)
    finally:
        os.close(fd)
    plain = tmp_path / "plain"
    plain.write_bytes(b"x")
    r, w = os.pipe()
    with plain.open("rb") as f:
        try:
            assert not _core.memfd_sealed(f.fileno())  # a file, a pipe, a closed descriptor: never sealed
            assert not _core.memfd_sealed(r)
        finally:
            os.close(r)
            os.close(w)
    assert not _core.memfd_sealed(r)


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="a load pins its thread only with two CPUs or more"
)
def test_a_load_gives_the_calling_thread_its_cpus_back(tmp_path: Path) -> None:
    # The copying thread is kept on its CPU for the load, its helper off it (so a busy neighbour's
    # CPU, not the copier's, is shared with the hashing); whether the load ends loaded or refused,
    # the caller's thread may run where it could before. Allowed one CPU, it loads with no helper.
    path = tmp_path / "big.smst"
    recs = _big_blob(path, 3)  # several rings of chunks, so the helper takes part
    name = f"/smstore-test-{os.getpid()}-cpus"
    before = os.sched_getaffinity(0)
    bad = tmp_path / "bad.smst"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    bad.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError):
        _core.shm_load(os.fspath(bad), name)
    assert os.sched_getaffinity(0) == before
    assert not (SHM / name[1:]).exists()
    for allowed in (before, {min(before)}):
        os.sched_setaffinity(0, allowed)
        try:
            fd, _size, checksum, _count = _core.shm_load(os.fspath(path), name)
            assert os.sched_getaffinity(0) == allowed
        finally:
            os.sched_setaffinity(0, before)
        try:
            store = _core.Store._from_fd(fd, "seg", False)
            assert checksum == store.checksum
            assert [bytes(store[i]) for i in range(len(store))] == recs
            store.close()
        finally:
            os.close(fd)
            assert _core.shm_unlink(name)


def _big_blob(path: Path, mib: int) -> list[bytes]:
    recs = [bytes([65 + i % 26]) * (4000 + i % 97) + i.to_bytes(4, "little") for i in range(mib * 256)]
    smstore.pack(recs, path)
    return recs


@pytest.mark.parametrize("hash_thread", [True, False], ids=["hash-thread", "one-thread"])
def test_core_load_copies_every_byte_at_most_at_max_rate(tmp_path: Path, hash_thread: bool) -> None:
    path = tmp_path / "big.smst"
    recs = _big_blob(path, 3)  # several copy chunks of either path
    name = f"/smstore-test-{os.getpid()}-rate"
    size = path.stat().st_size
    rate = 8 << 20
    start = time.monotonic()
    fd, _, checksum, count = _core.shm_load(os.fspath(path), name, max_rate=rate, hash_thread=hash_thread)
    elapsed = time.monotonic() - start
    try:
        assert count == len(recs)
        assert elapsed >= 0.9 * (size - 4096) / rate  # paced: the limit holds (a floor, not a timing goal)
        store = _core.Store._from_fd(fd, "seg", False)
        assert store.checksum == checksum == _core.Store(os.fspath(path)).checksum
        assert [bytes(store[i]) for i in (0, 1, len(recs) // 2, len(recs) - 1)] == [
            recs[0],
            recs[1],
            recs[len(recs) // 2],
            recs[-1],
        ]
        store.verify()
    finally:
        os.close(fd)
        _core.shm_unlink(name)


def test_core_load_can_copy_and_hash_on_its_own_thread_alone(tmp_path: Path) -> None:
    # A load must not need a spare core: with hash_thread=False no thread but the caller's works
    # on it (the old load always started a hashing thread). Sampled all through a paced load.
    path = tmp_path / "big.smst"
    recs = _big_blob(path, 2)
    name = f"/smstore-test-{os.getpid()}-alone"
    result: list[tuple[int, int, str, int]] = []
    loader = threading.Thread(
        target=lambda: result.append(
            _core.shm_load(os.fspath(path), name, max_rate=8 << 20, hash_thread=False)
        )
    )
    before = len(os.listdir("/proc/self/task"))
    loader.start()
    most = 0
    while loader.is_alive():
        most = max(most, len(os.listdir("/proc/self/task")))
        time.sleep(0.01)
    loader.join()
    try:
        assert most <= before + 1  # the loader thread itself, nothing more
        fd, _, checksum, count = result[0]
        assert count == len(recs)
        store = _core.Store._from_fd(fd, "seg", False)
        assert store.checksum == checksum == _core.Store(os.fspath(path)).checksum
        store.verify()
        os.close(fd)
    finally:
        _core.shm_unlink(name)


@pytest.mark.parametrize("hash_thread", [True, False], ids=["hash-thread", "one-thread"])
def test_core_load_of_a_file_cut_short_meanwhile_fails_cleanly(tmp_path: Path, hash_thread: bool) -> None:
    path = tmp_path / "big.smst"
    _big_blob(path, 2)
    name = f"/smstore-test-{os.getpid()}-cut"
    # Paced at 4 MiB/s the load takes half a second; the file is cut to a third after 0.15 s.
    cutter = threading.Timer(0.15, lambda: os.truncate(path, path.stat().st_size // 3))
    cutter.start()
    try:
        with pytest.raises(smstore.StoreError, match="shrank while it was being loaded"):
            _core.shm_load(os.fspath(path), name, max_rate=4 << 20, hash_thread=hash_thread)
    finally:
        cutter.join()
    assert not (SHM / name[1:]).exists()


# ---- /dev/shm too small ---------------------------------------------------------------------


@pytest.mark.parametrize("source", ["--shm-limit", "$SMSTORE_SHM_LIMIT"])
def test_shm_too_small_limit(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon], source: str
) -> None:
    # The limit, not /dev/shm, is what refuses: the message says so, and how to raise it.
    path, _ = blob
    if source == "--shm-limit":
        d = start_daemon(args=("--shm-limit", "64K"))
    else:
        d = start_daemon(env={"SMSTORE_SHM_LIMIT": "64K"})
    res = cli("load", os.fspath(path), sock=d.sock, check=False)
    assert res.returncode == 1
    for text in (
        "not enough shared memory",
        "needs",
        f"{source} is 64.0 KiB (65536 bytes)",
        "smstore unload",
    ):
        assert text in res.stderr, text
    for blames_dev_shm in ("--shm-size", "emptyDir", "/dev/shm"):
        assert blames_dev_shm not in res.stderr, blames_dev_shm
    assert list_segments(d.pid) == []
    status = cli("status", sock=d.sock)
    assert f"limit 64.0 KiB ({source}): 0 B used by its segments" in status.stdout
    assert d.status()["shm"]["limit"] == 65536
    with pytest.raises(SharedMemoryError, match="--shm-size"):
        _core.shm_load(os.fspath(path), f"/smstore-test-{os.getpid()}-small", 0o400, -1, 4096)
    assert not (SHM / f"smstore-test-{os.getpid()}-small").exists()


@pytest.mark.skipif(
    not IS_ROOT or shutil.which("unshare") is None, reason="needs root and unshare to mount a tmpfs"
)
def test_shm_too_small_real_tmpfs(blob: tuple[Path, list[bytes]]) -> None:
    path, _ = blob
    # A private mount namespace with a 128 KiB tmpfs on /dev/shm, as a container would have.
    code = (
        "import smstore, smstore._core as c\n"
        "try:\n"
        f"    c.shm_load({os.fspath(path)!r}, '/smstore-small-test')\n"
        "except smstore.SharedMemoryError as e:\n"
        "    print('REFUSED', e)\n"
        "else:\n"
        "    print('LOADED')\n"
    )
    script = f'mount -t tmpfs -o size=128k tmpfs /dev/shm && exec {sys.executable} -c "$0"'
    res = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, code], capture_output=True, text=True, check=False
    )
    if "mount" in res.stderr and res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    assert res.stdout.startswith("REFUSED"), res.stdout + res.stderr
    assert "needs" in res.stdout
    assert "--shm-size" in res.stdout


# ---- unloading, and one segment for two jobs -------------------------------------------------


def test_unload_by_checksum_as_given(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """'smstore unload xxh64:...' names no file: the checksum is sent as given (it was once made
    into a path under the working directory, and nothing was unloaded)."""
    path, _recs = blob
    d = start_daemon(path)
    checksum = d.status()["segments"][0]["checksum"]
    res = subprocess.run(
        [sys.executable, "-m", "smstore", "unload", "--socket", os.fspath(d.sock), f"xxh64:{checksum}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    assert f"xxh64:{checksum}: unloaded" in res.stdout
    assert d.status()["segments"] == []


def test_unload_while_mapped(blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon]) -> None:
    path, recs = blob
    d = start_daemon(path)
    store = open_store(path, mode="daemon")
    assert isinstance(store, DaemonStore)
    view = store[len(recs) // 2]
    res = cli("unload", os.fspath(path), sock=d.sock)
    assert "freed when its 1 client(s) detach" in res.stdout
    # The name is gone (nothing new can attach), the pages are not: we still read correct bytes.
    assert list_segments(d.pid) == []
    assert d.status()["segments"] == []
    with pytest.raises(DaemonError, match="does not serve"):
        open_store(path, mode="daemon")
    check_all(store, recs)
    maps = Path("/proc/self/maps").read_text()
    assert f"/dev/shm{store.segment} (deleted)" in maps
    store.close()
    assert bytes(view) == recs[len(recs) // 2], "a view keeps its mapping alive"
    assert f"/dev/shm{store.segment} (deleted)" in Path("/proc/self/maps").read_text()
    del view
    assert f"/dev/shm{store.segment}" not in Path("/proc/self/maps").read_text(), (
        "freed with the last mapping"
    )


HOLDER = """
import sys, os
from smstore.wire.client import open_store
s = open_store(sys.argv[1], mode="daemon")
print(s.segment, flush=True)
sys.stdin.read()
assert bytes(s[3]) == bytes.fromhex(sys.argv[2])
"""


def test_two_jobs_share_one_segment(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon]
) -> None:
    path, recs = blob
    d = start_daemon(path)
    with contextlib.ExitStack() as stack:
        jobs = [
            stack.enter_context(
                tl.child_process(
                    [sys.executable, "-c", HOLDER, os.fspath(path), recs[3].hex()],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
            for _ in range(2)
        ]
        try:
            segs = {j.stdout.readline().strip() for j in jobs}  # type: ignore[union-attr]
            assert len(segs) == 1
            assert len(list_segments(d.pid)) == 1
            checksum = smstore.open(path).checksum
            assert d.segment(checksum)["clients"] == sorted(j.pid for j in jobs)
            out = cli("status", sock=d.sock).stdout
            assert all(str(j.pid) in out for j in jobs)
        finally:
            for j in jobs:
                j.communicate("", timeout=30)
    assert [j.returncode for j in jobs] == [0, 0]
    # Clients that exited are no longer listed.
    assert d.segment(checksum)["clients"] == []


# ---- DataLoader workers ------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_dataloader_workers_through_daemon(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon], method: str
) -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    path, recs = blob
    d = start_daemon(path)
    # socket= travels with the pickle: a forkserver started by an earlier test has another environment.
    ds = smstore.SharedStoreDataset(path, decode="bytes", mode="daemon", socket=d.sock)
    assert isinstance(ds.store, DaemonStore)
    loader = DataLoader(
        ds,
        batch_size=64,
        num_workers=2,
        multiprocessing_context=method,
        collate_fn=list,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
    )
    seen = [r for batch in loader for r in batch]
    assert sorted(seen) == sorted(recs)


# ---- the daemon's state ----------------------------------------------------------------------


def _collections_of(root: object, leave_out: tuple[object, ...] = ()) -> dict[str, object]:
    """The mutable collections (dict, set, list, deque, Queue) held as attributes by `root` and by
    every object of smstore.daemon reachable from it through attributes (but those of `leave_out`),
    each once (by identity), named by the first attribute path that reaches it. A collection's
    contents are not walked: a connection's or a segment's own fields live as long as it does,
    not as the daemon."""
    import collections
    import queue

    kinds = (dict, set, list, collections.deque, queue.Queue)
    found: dict[int, tuple[str, object]] = {}
    seen: set[int] = {id(obj) for obj in leave_out}
    todo: list[tuple[str, object]] = [("daemon", root)]
    while todo:
        where, obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        names = list(vars(obj)) if hasattr(obj, "__dict__") else []
        for cls in type(obj).__mro__:
            names += [n for n in getattr(cls, "__slots__", ()) if hasattr(obj, n)]
        for name in names:
            value = getattr(obj, name)
            if isinstance(value, kinds):
                found.setdefault(id(value), (f"{where}.{name}", value))
            if type(value).__module__.startswith("smstore.daemon"):
                todo.append((f"{where}.{name}", value))
    return dict(found.values())


def test_the_daemons_state_is_at_most_12_collections(tmp_path: Path) -> None:
    """Issue 37: the daemon's mutable state is at most 12 collections, counted in a live daemon's
    attribute graph. Everything held is a piece, so residency (holds, failures with their backoff
    and the owner's unloads, loads in flight, released segments, manifests and their sources, the
    loader's queues, the segment table) is one set of tables; each segment carries its mark and each
    connection its own state (a parked request, the manifest or the load its request waits for); the
    metrics' tallies are one table; connections by uid are counted from the connections. Two
    residency systems kept 24, and the whole daemon 20 before its state was folded."""
    from smstore.daemon.server import Daemon

    sock = tmp_path / "run" / "d.sock"
    daemon = Daemon(sock)
    daemon.start([])
    try:
        everything = _collections_of(daemon)
    finally:
        daemon.shutdown()
        daemon.serving.loader.wake_r.close()  # the daemon's process ends here, and closes them so
        daemon.serving.loader.wake_w.close()
        daemon.sel.close()
    assert "daemon.serving.loader.planner.holds" in everything  # the walk reaches the planner's tables
    assert "daemon.serving.counters.table" in everything  # and the metrics' tallies
    assert len(everything) <= 12, sorted(everything)


# ---- one connection per process per daemon, and forks ----------------------------------------

ONE_CONNECTION = r"""
import os, sys
import smstore
from smstore.wire.blocks import BlockReader

out = sys.argv[1]


def read_all() -> None:
    ds = smstore.SharedStoreDataset(out, mode="daemon", decode="bytes")
    windowed = smstore.WindowedShuffleSampler(ds, window=2, seed=1, rank=0, world_size=1, lag=8)
    for i in windowed:
        assert ds[i] is not None
    blocks = smstore.BlockWindowSampler(ds, block=50, spread=2, seed=1, rank=0, world_size=1, lag=8)
    reader = BlockReader(out, block=50)
    for i in blocks:
        assert reader[i] is not None
    keep.extend((ds, windowed, blocks, reader))  # all of it alive while counted


keep: list[object] = []
read_all()
print("counted", os.getpid(), flush=True)
os.read(0, 1)  # unbuffered: the child reads the same pipe
pid = os.fork()
if pid == 0:
    keep.clear()
    read_all()
    print("child", os.getpid(), flush=True)
    os.read(0, 1)
    os._exit(0)
os.read(0, 1)
os.waitpid(pid, 0)
"""


def _daemon_peers(sock: Path) -> set[int]:
    """The socket inodes of the daemon's clients: the peers of the connections it accepted on `sock`."""
    rows = subprocess.run(["ss", "-xH"], capture_output=True, text=True, check=True).stdout.splitlines()
    return {int(row.split()[-1]) for row in rows if f" {sock} " in row}


def _sockets_of(pid: int) -> set[int]:
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                found.add(int(link[8:-1]))
    return found


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to match sockets to peers")
def test_a_process_holds_one_connection_to_the_daemon_and_a_forked_child_its_own(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """A process that reads a sharded dataset through the daemon with a windowed sampler (its
    residency holding shards), then a block sampler with a BlockReader, speaks to the daemon on
    one connection; a child forked from it (a DataLoader worker) on one of its own. Before, each
    of the dataset's attaches, its pre-attacher, each residency and each block reader had one (and
    a forked child kept some of its parent's)."""
    out = tl.sharded(tmp_path, [b"%06d " % i + b"x" * 100 for i in range(2000)], shard_size=40_000)
    d = start_daemon(loaded=0)
    proc = subprocess.Popen(
        [sys.executable, "-c", ONE_CONNECTION, str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdin is not None
        assert proc.stdout is not None
        word, pid = proc.stdout.readline().split()
        assert word == "counted"
        assert len(_sockets_of(int(pid)) & _daemon_peers(d.sock)) == 1
        proc.stdin.write("x")
        proc.stdin.flush()
        word, child = proc.stdout.readline().split()
        assert word == "child"
        assert len(_sockets_of(int(child)) & _daemon_peers(d.sock)) == 1
        assert not _sockets_of(int(child)) & _sockets_of(int(pid))  # none of its parent's
        assert len(_sockets_of(int(pid)) & _daemon_peers(d.sock)) == 1
        proc.stdin.write("xx")
        proc.stdin.flush()
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def test_a_fork_while_another_thread_holds_a_session_lock_leaves_the_child_able_to_attach(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """The pre-attaching thread holds `DaemonSession.lock` during its attaches: a process forked
    meanwhile (a DataLoader worker) got a lock no thread of its would ever release, and its first
    attach blocked forever (here: killed by its own alarm)."""
    from smstore.wire.client import DaemonSession

    path = tmp_path / "b.smst"
    smstore.pack([b"a", b"bc"], path)
    checksum = smstore.open(path).checksum
    d = start_daemon(path)
    session = DaemonSession(d.sock)
    held, done = threading.Event(), threading.Event()

    def hold_the_lock() -> None:
        with session.lock:
            held.set()
            done.wait(30)

    thread = threading.Thread(target=hold_the_lock)
    thread.start()
    try:
        assert held.wait(10)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            code = 3
            try:
                signal.alarm(20)
                reply, fd = session.attach(checksum)
                code = 0 if reply["ok"] and fd is not None else 4
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    finally:
        done.set()
        thread.join()
        session.close()
    assert not os.WIFSIGNALED(status), "the child's attach blocked on its parent's lock"
    assert os.WEXITSTATUS(status) == 0
