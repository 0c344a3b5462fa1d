"""One rule for mode="auto" | "daemon" | "mmap" across the dataset, the collator, the residency and SharedList; one store handle."""

from __future__ import annotations

import logging
import os
import pickle
import re
import socket as socket_module
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import smstore_testlib as tl
from daemon_testlib import Daemon, make_records

import smstore
from smstore.daemon.segments import list_segments
from smstore.read import modes as _modes
from smstore.wire.client import DaemonStore, open_store
from smstore.wire.residency import Residency

OBJECTS = [f"object {i}" for i in range(50)]


@pytest.fixture
def data(tmp_path: Path) -> tuple[Path, Path, list[bytes]]:
    """A blob and a sharded dataset (its manifest) of the same records."""
    recs = make_records(300)
    blob = tmp_path / "data.smst"
    smstore.pack(recs, blob, durable=False)
    src = tmp_path / "lines.txt"
    src.write_bytes(b"".join(b"line %d\n" % i for i in range(400)))
    smstore.pack_files([src], tmp_path / "ds", shard_size=1000, progress=False, durable=False)
    return blob, tmp_path / "ds" / "manifest.json", recs


def expected(user: str, recs: list[bytes]) -> Any:
    if user in ("dataset", "collator"):
        return recs
    if user == "residency":
        return ("page cache", (1, 0))
    return OBJECTS


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[Path, socket_module.socket]]:
    """A socket that listens and never answers: whoever connects is left in its backlog, to be seen."""
    path = tmp_path / "listening.sock"
    sock = socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM)
    sock.bind(os.fspath(path))
    sock.listen(16)
    sock.setblocking(False)
    yield path, sock
    sock.close()
    path.unlink()


@pytest.fixture
def full_listener(tmp_path: Path) -> Iterator[Path]:
    """A socket that listens with backlog 0, never accepts, and whose queue is full: a connect gets EAGAIN."""
    path = tmp_path / "full.sock"
    sock = socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM)
    sock.bind(os.fspath(path))
    sock.listen(0)
    fillers: list[socket_module.socket] = []
    try:
        for _ in range(64):
            filler = socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM)
            filler.setblocking(False)
            fillers.append(filler)
            try:
                filler.connect(os.fspath(path))
            except BlockingIOError:
                break
        else:
            pytest.fail("the listen queue never filled")
        yield path
    finally:
        for filler in fillers:
            filler.close()
        sock.close()
        path.unlink()


@pytest.fixture
def too_long(tmp_path: Path) -> Path:
    """A socket path under tmp_path longer than the 107 bytes a Unix socket takes."""
    path = tmp_path / ("d" * 120) / "smstore.sock"
    assert len(os.fsencode(path)) > 107
    return path


# ---- the mode itself -----------------------------------------------------------------------------------


def test_a_bad_mode_is_the_same_value_error_from_every_user(data: tuple[Path, Path, list[bytes]]) -> None:
    blob, manifest, _recs = data
    makers: list[Callable[[], object]] = [
        lambda: smstore.SharedStoreDataset(blob, mode="bogus"),  # type: ignore[arg-type]
        lambda: smstore.TokenCollator(blob, mode="bogus"),  # type: ignore[arg-type]
        lambda: Residency(manifest, mode="bogus"),  # type: ignore[arg-type]
        lambda: smstore.SharedList(OBJECTS, mode="bogus"),  # type: ignore[arg-type]
        lambda: open_store(blob, "bogus"),  # type: ignore[arg-type]
    ]
    for make in makers:
        with pytest.raises(ValueError, match=r"^mode must be one of 'auto', 'daemon', 'mmap', not 'bogus'$"):
            make()


def test_a_bad_mode_is_refused_also_when_the_collator_reads_a_dataset(
    data: tuple[Path, Path, list[bytes]],
) -> None:
    blob, _manifest, recs = data
    ds = smstore.SharedStoreDataset(blob, mode="mmap")
    with pytest.raises(ValueError, match=r"^mode must be one of 'auto', 'daemon', 'mmap', not 'bogus'$"):
        smstore.TokenCollator(ds, mode="bogus")  # type: ignore[arg-type]
    collate = smstore.TokenCollator(ds, layout="pack", mode="daemon")  # a good one: the dataset reads
    assert collate([3])["tokens"].numpy().tobytes() == recs[3]


@pytest.mark.parametrize(
    "bad", [np.array(["auto", "mmap"]), np.array("auto"), ["auto"], b"auto", None, 0, ("mmap",)]
)
def test_check_mode_refuses_a_non_str_with_our_value_error(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^mode must be one of 'auto', 'daemon', 'mmap', not "):
        _modes.check_mode(bad)


@pytest.mark.parametrize("user", tl.MODE_USERS)
def test_daemon_mode_without_a_daemon_raises_naming_the_socket(
    data: tuple[Path, Path, list[bytes]], tmp_path: Path, user: str
) -> None:
    blob, manifest, _recs = data
    sock = tmp_path / "none.sock"
    with pytest.raises(smstore.DaemonError) as ei:
        tl.use_in_mode(user, "daemon", os.fspath(blob), os.fspath(manifest), os.fspath(sock))
    message = str(ei.value)
    assert f"cannot reach an smstore daemon on {sock}" in message
    assert "start one with 'smstore serve" in message


@pytest.mark.parametrize("user", tl.MODE_USERS)
def test_a_full_listen_queue_is_a_daemon_error_and_auto_falls_back(
    data: tuple[Path, Path, list[bytes]], full_listener: Path, user: str
) -> None:
    blob, manifest, recs = data
    with pytest.raises(smstore.DaemonError) as ei:
        tl.use_in_mode(user, "daemon", os.fspath(blob), os.fspath(manifest), os.fspath(full_listener))
    assert f"the smstore daemon on {full_listener} is busy (" in str(ei.value)
    assert "listen queue is full" in str(ei.value)
    got = tl.use_in_mode(user, "auto", os.fspath(blob), os.fspath(manifest), os.fspath(full_listener))
    assert got == expected(user, recs)


@pytest.mark.parametrize("user", tl.MODE_USERS)
def test_a_socket_path_too_long_is_a_daemon_error_and_auto_falls_back(
    data: tuple[Path, Path, list[bytes]], too_long: Path, user: str
) -> None:
    blob, manifest, recs = data
    with pytest.raises(smstore.DaemonError) as ei:
        tl.use_in_mode(user, "daemon", os.fspath(blob), os.fspath(manifest), os.fspath(too_long))
    assert f"socket path {too_long} is {len(os.fsencode(too_long))} bytes, longer than the 107" in str(
        ei.value
    )
    got = tl.use_in_mode(user, "auto", os.fspath(blob), os.fspath(manifest), os.fspath(too_long))
    assert got == expected(user, recs)


def test_connect_maps_every_os_error_to_a_daemon_error_naming_the_socket(
    full_listener: Path, tmp_path: Path
) -> None:
    from smstore.wire.ipc import connect

    with pytest.raises(smstore.DaemonError, match="busy"):
        connect(full_listener)
    not_a_socket = tmp_path / "plain-file"  # connect() to a regular file: ECONNREFUSED
    not_a_socket.write_bytes(b"")
    with pytest.raises(smstore.DaemonError, match=re.escape(os.fspath(not_a_socket))):
        connect(not_a_socket)
    a_dir = tmp_path / "a-dir" / "x.sock"  # ENOTDIR: a path component is a file
    (tmp_path / "a-dir").write_bytes(b"")
    with pytest.raises(smstore.DaemonError, match=re.escape(os.fspath(a_dir)) + r" \(Not a directory\)"):
        connect(a_dir)


@pytest.mark.parametrize("user", tl.MODE_USERS)
def test_mmap_mode_never_contacts_a_daemon(
    data: tuple[Path, Path, list[bytes]],
    listener: tuple[Path, socket_module.socket],
    user: str,
) -> None:
    blob, manifest, recs = data
    path, sock = listener
    got = tl.use_in_mode(user, "mmap", os.fspath(blob), os.fspath(manifest), os.fspath(path))
    assert got == expected(user, recs)
    with pytest.raises(BlockingIOError):
        sock.accept()  # nobody connected


@pytest.mark.parametrize("first", tl.MODE_USERS)
def test_auto_without_a_daemon_warns_once_per_process_in_one_wording(
    data: tuple[Path, Path, list[bytes]], tmp_path: Path, first: str
) -> None:
    """In a fresh process, whichever user falls back first warns (the same words for all four);
    the others then log at INFO; all read the right bytes."""
    blob, manifest, recs = data
    sock = tmp_path / "none.sock"
    order = [first, *(u for u in tl.MODE_USERS if u != first)]
    read, logged = tl.run_child(
        tl.fallbacks_in_a_fresh_process, order, os.fspath(blob), os.fspath(manifest), os.fspath(sock)
    )
    for user in tl.MODE_USERS:
        assert read[user] == expected(user, recs), user
    warned = [m for level, m in logged if level >= 30]
    assert len(warned) == 1, logged
    wording = re.compile(
        r"(?P<subject>.+): (?P<instead>.+) instead of using the smstore daemon: cannot reach an smstore "
        rf"daemon on {re.escape(os.fspath(sock))} \(No such file or directory\); start one with "
        r"'smstore serve FILE'\. Without it, .+ \(pass mode='mmap' to skip the daemon without this "
        r"warning; later fallbacks in this process are logged at INFO\)"
    )
    match = wording.fullmatch(warned[0])
    assert match is not None, warned[0]
    subject = {
        "dataset": os.fspath(blob),
        "collator": os.fspath(blob),
        "residency": os.fspath(manifest),
        "shared_list": "SharedList 'modes-",
    }[first]
    assert match["subject"].startswith(subject), (first, warned[0])
    # Every later fallback of the process is at INFO, once per subject (the dataset and the
    # collator read one file), in the same words: subject, what instead, why.
    infos = [m for level, m in logged if level == 20 and f"cannot reach an smstore daemon on {sock}" in m]
    assert len(infos) == 2, logged
    for m in infos:
        assert re.fullmatch(r".+: .+ \(cannot reach an smstore daemon on .+\)", m), m


@pytest.mark.parametrize("user", tl.MODE_USERS)
def test_auto_with_no_daemon_at_the_default_socket_only_logs_at_info(
    data: tuple[Path, Path, list[bytes]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    user: str,
) -> None:
    """The normal case without a daemon is no warning, from any of the four."""
    blob, manifest, recs = data
    monkeypatch.setattr(_modes, "_warned_fallback", False)  # as in a fresh process
    monkeypatch.setattr(_modes, "_logged", set())
    monkeypatch.delenv("SMSTORE_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", os.fspath(tmp_path / "runtime"))
    caplog.set_level(logging.INFO, logger="smstore")
    assert tl.use_in_mode(user, "auto", os.fspath(blob), os.fspath(manifest), None) == expected(user, recs)
    said = [
        (r.levelno, r.getMessage())
        for r in caplog.records
        if "instead" in r.getMessage() or "cannot reach" in r.getMessage()
    ]
    assert len(said) == 1, said
    assert said[0][0] == logging.INFO
    assert "cannot reach an smstore daemon on " + os.fspath(tmp_path / "runtime") in said[0][1]


# ---- SharedList's old name for mmap --------------------------------------------------------------


def test_shared_list_local_is_a_deprecated_alias_of_mmap(
    listener: tuple[Path, socket_module.socket], tmp_path: Path
) -> None:
    path, sock = listener
    source = tmp_path / "objects.jsonl"
    source.write_text("".join(f'"{o}"\n' for o in OBJECTS))
    makers: list[Callable[[], smstore.SharedList]] = [
        lambda: smstore.SharedList(OBJECTS, name="local-a", mode="local", socket=path),
        lambda: smstore.SharedList.from_loader(
            lambda: OBJECTS, key="k", name="local-b", mode="local", socket=path
        ),
        lambda: smstore.SharedList.from_file(source, "jsonl", name="local-c", mode="local", socket=path),
    ]
    for make in makers:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lst = make()
        assert [type(w.message) for w in caught] == [DeprecationWarning]
        assert "mode='local' is deprecated; pass mode='mmap'" in str(caught[0].message)
        assert caught[0].filename == __file__  # pointed at the caller
        assert list(lst) == OBJECTS
        assert lst.via_daemon is None
        lst.close()
    with pytest.raises(BlockingIOError):
        sock.accept()  # as "mmap": the daemon was never asked


# ---- one handle: pickles as path and options, attaches per process with the checksum pinned ------


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_dataset_and_collator_handed_to_a_child_attach_to_the_daemons_segment(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon], method: str
) -> None:
    path, recs = blob
    d = start_daemon(path)
    ds = smstore.SharedStoreDataset(path, decode="bytes", mode="daemon", socket=d.sock)
    collate = smstore.TokenCollator(path, layout="pack", mode="daemon", socket=d.sock)
    assert len(pickle.dumps(ds)) < 2000
    assert len(pickle.dumps(collate)) < 2000
    segment = ds.store.segment  # type: ignore[union-attr]
    assert type(ds.store) is DaemonStore
    assert segment.lstrip("/") in list_segments(d.pid)
    records, gathered, where = tl.run_child(tl.read_through_handles, ds, collate, method=method)
    assert records == recs
    assert gathered == recs
    assert where == [("DaemonStore", segment), ("DaemonStore", segment)]


def test_a_relative_path_reads_the_same_file_in_a_child_with_another_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handle pickles its absolute path: a spawned child started in another directory, which
    holds another file of the same name, reads the file its parent named."""
    recs = make_records(40)
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    smstore.pack(recs, here / "d.smst", durable=False)
    smstore.pack([b"other"] * 40, elsewhere / "d.smst", durable=False)
    monkeypatch.chdir(here)
    ds = smstore.SharedStoreDataset("d.smst", decode="bytes", mode="mmap")
    collate = smstore.TokenCollator("d.smst", layout="pack", mode="mmap")
    monkeypatch.chdir(elsewhere)  # a spawned child starts in its parent's working directory
    records, gathered, _where = tl.run_child(tl.read_through_handles, ds, collate)
    assert records == recs
    assert gathered == recs
    assert ds.store.path == os.fspath(here / "d.smst")


@pytest.mark.parametrize("mode", ["mmap", "auto"])
def test_a_file_repacked_after_pickling_is_the_same_error_from_dataset_and_collator(
    tmp_path: Path, mode: str
) -> None:
    path = tmp_path / "d.smst"
    smstore.pack([b"ab", b"cd"], path, durable=False)
    ds = smstore.SharedStoreDataset(path, mode=mode, socket=tmp_path / "none.sock")  # type: ignore[arg-type]
    collate = smstore.TokenCollator(path, mode=mode, socket=tmp_path / "none.sock")  # type: ignore[arg-type]
    before = ds.checksum
    assert collate.checksum == before
    states = pickle.dumps(ds), pickle.dumps(collate)  # what a spawn or forkserver child receives
    smstore.pack([b"xy", b"z"], path, durable=False)
    with smstore.open(path) as now_store:
        now = now_store.checksum
    errors = []
    ds_clone, collate_clone = (pickle.loads(s) for s in states)
    for use in (lambda: ds_clone[0], lambda: collate_clone([0])):
        with pytest.raises(smstore.StoreChangedError) as ei:
            use()
        errors.append(ei.value)
    assert type(errors[0]) is type(errors[1])
    assert str(errors[0]) == str(errors[1])
    for text in (os.fspath(path), before, now):
        assert text in str(errors[0])
    assert bytes(ds[0]) == b"ab"  # the originals still map the file they were created on
    assert collate([0])["tokens"].numpy().tobytes() == b"ab"
