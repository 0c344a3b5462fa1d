"""Readers following what ranks hold: the `held` request, parked until the held shards change, and
the pre-attaching thread that attaches them ahead of the reader. Most tests reproduce a defect of an
older daemon or client."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from daemon_testlib import (
    IS_ROOT,
    STATUS,
    Daemon,
    as_user,
    ask,
    assert_alive_and_clean,
    cli,
    dataset,
    ended,
    exchange,
    frame,
    group_daemon,
    raw,
    read_reply,
    send,
    shard,
    wait_status,
)
from smstore_testlib import sharded

import smstore
from smstore.format.manifest import read_manifest
from smstore.wire.client import daemon_request, open_store

# ---- readers parked on 'held' ----------------------------------------------------------------


def test_held_arguments_are_checked(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon]
) -> None:
    path, _ = blob
    d = start_daemon(path)
    s = raw(d.sock)
    try:
        for body in (
            b'{"op":"held","since":-1}',
            b'{"op":"held","since":"1"}',
            b'{"op":"held","since":1.5}',
            b'{"op":"held","since":true}',
            b'{"op":"held","wait":-1}',
            b'{"op":"held","wait":61}',
            b'{"op":"held","wait":NaN}',
            b'{"op":"held","wait":Infinity}',
            b'{"op":"held","wait":"5"}',
        ):
            reply = exchange(s, body)
            assert reply is not None, body
            assert reply["error"] == "bad_request", (body, reply)
        assert d.status()["counts"]["parked"] == 0
    finally:
        s.close()
    assert_alive_and_clean(d)


def test_parked_held_requests_are_bounded_and_released(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon]
) -> None:
    """At most --max-parked wait for a change; the rest are answered at once. A parked request is
    answered when its client sends more, dropped when it closes, and ends with the daemon."""
    path, _ = blob
    d = start_daemon(path, args=("--max-parked", "4"))
    first = raw(d.sock)
    send(first, {"op": "held"})
    now = read_reply(first)
    assert now is not None
    assert now["ok"] is True
    assert now["shards"] == []
    assert now["not_resident"] == []
    version = now["version"]
    socks = [raw(d.sock) for _ in range(6)]
    try:
        for s in socks:
            send(s, {"op": "held", "since": version, "wait": 60})
        status = wait_status(d, lambda st: st["counts"]["held_requests"] == 7)
        assert status["counts"]["parked"] == 4
        # The two over the limit were answered at once (before status was), with nothing new.
        answered = select.select(socks, [], [], 0)[0]
        assert len(answered) == 2
        for s in answered:
            assert read_reply(s) == now
        parked = [s for s in socks if s not in answered]
        parked[0].close()  # a client that goes takes its parked request with it
        assert wait_status(d, lambda st: st["counts"]["parked"] == 3)["counts"]["parked"] == 3
        parked[1].sendall(STATUS)  # one request at a time: the parked one is answered first
        assert read_reply(parked[1]) == now
        assert (reply := read_reply(parked[1])) is not None
        assert reply["counts"]["parked"] == 2
        # Stopping the daemon ends the two left (a socket timeout of 10 s, a wait of 60 s).
        cli("stop", sock=d.sock)
        for s in parked[2:]:
            assert s.recv(10) == b""
    finally:
        first.close()
        for s in socks:
            s.close()
    d.proc.wait(timeout=30)


def test_pipelined_requests_after_a_parked_held_are_answered_in_order(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon]
) -> None:
    """One request at a time holds for parked ones too: a `held` that parks and a request sent in
    the same write get their replies in order, at once, and a second `held` parks in its turn
    (before the fix the status came first, and of two parked `held` only one was ever answered)."""
    path, _ = blob
    d = start_daemon(path)
    s = raw(d.sock)  # 10 s socket timeout: a reply that does not come fails the test
    try:
        send(s, {"op": "held"})
        now = read_reply(s)
        assert now is not None
        version = now["version"]
        held = frame(json.dumps({"op": "held", "since": version, "wait": 60}).encode())
        s.sendall(held + STATUS)
        assert read_reply(s) == now  # the parked held first, answered because more came
        reply = read_reply(s)
        assert reply is not None
        assert reply["counts"]["held_requests"] == 2
        assert reply["counts"]["parked"] == 0
        s.sendall(held + held)  # the first answered when the second is read; the second parks
        assert read_reply(s) == now
        assert wait_status(d, lambda st: st["counts"]["held_requests"] == 4)["counts"]["parked"] == 1
        s.sendall(STATUS)
        assert read_reply(s) == now  # the second, answered before the status
        reply = read_reply(s)
        assert reply is not None
        assert reply["counts"]["parked"] == 0
    finally:
        s.close()
    assert_alive_and_clean(d)


def test_max_parked_zero_parks_nothing(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon]
) -> None:
    """`--max-parked 0` means no parking (readers poll), not the default of 1024."""
    path, _ = blob
    d = start_daemon(path, args=("--max-parked", "0"))
    s = raw(d.sock)  # 10 s socket timeout: a parked request fails the test
    try:
        send(s, {"op": "held"})
        now = read_reply(s)
        assert now is not None
        send(s, {"op": "held", "since": now["version"], "wait": 60})
        assert read_reply(s) == now
        assert d.status()["counts"]["parked"] == 0
    finally:
        s.close()
    assert_alive_and_clean(d)


def test_a_share_or_a_dropped_shared_blob_wakes_every_parked_reader(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """A blob shared with the contents of a held shard makes it resident, and its drop makes it not
    resident again: both change what readers follow, and every parked reader hears at once (before
    the fix, only the next reader to ask saw the change)."""
    from smstore.wire.client import share_with_daemon

    out = dataset(tmp_path, "ds", shards=2)
    path0, ck0 = shard(out, 0)
    d = start_daemon(loaded=0)
    rank = raw(d.sock)
    readers = [raw(d.sock) for _ in range(2)]  # 10 s socket timeouts: a missed wake fails the test
    sharer: socket.socket | None = None
    try:
        hold = {"op": "hold", "manifest": os.path.abspath(out), "shards": "0"}
        assert (reply := exchange(rank, hold)) is not None
        assert reply["ok"] is True, reply
        wait_status(d, lambda st: len(st["segments"]) == 1 and not st["loading"])
        cli("unload", path0, sock=d.sock)  # held, not loaded again: not resident

        def park_all() -> int:
            before = ask(d.sock, {"op": "held"})
            assert before is not None
            assert before["not_resident"] == ([] if sharer is not None else [ck0])
            parked = d.status()["counts"]["parked"]
            for s in readers:
                send(s, {"op": "held", "since": before["version"], "wait": 60})
            wait_status(d, lambda st: st["counts"]["parked"] == parked + len(readers))
            return int(before["version"])

        version = park_all()
        mfd = os.memfd_create("held", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.write(mfd, Path(path0).read_bytes())
            fcntl.fcntl(mfd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK)
            sharer = share_with_daemon(mfd, "test:" + "cd" * 16, d.sock)[1]
        finally:
            os.close(mfd)
        for s in readers:
            assert (woken := read_reply(s)) is not None
            assert woken["version"] > version
            assert woken["not_resident"] == []
        version = park_all()
        sharer.close()  # the shared blob is dropped: the held shard is not resident again
        sharer = None
        for s in readers:
            assert (woken := read_reply(s)) is not None
            assert woken["version"] > version
            assert woken["not_resident"] == [ck0]
    finally:
        for s in (rank, *readers):
            s.close()
        if sharer is not None:
            sharer.close()


def test_readers_of_a_dataset_hear_its_held_shards_however_many_another_dataset_holds(
    tmp_path: Path, start_daemon: Callable[..., Daemon], caplog: pytest.LogCaptureFixture
) -> None:
    """The `held` reply listed every held shard of every dataset: past 1 MiB (here 1100 shards
    with 1 KB paths) it became a refusal, and every reader silently attached nothing ahead. A
    reader names the dataset it follows and hears only its shards; a list that still does not fit
    is refused with a warning on both sides, never dropped silently."""
    from smstore.wire.client import Preattacher as _Preattacher

    deep = tmp_path
    for level in range(4):
        deep /= f"{level}" + "x" * 240  # long paths: few shards fill a reply
    deep.mkdir(parents=True)
    src = tmp_path / "lines.txt"
    src.write_bytes(b"".join(b"%05d\n" % i for i in range(1100)))
    big = deep / "big"
    smstore.pack_files([src], big, shard_size=6, progress=False, durable=False)
    assert len(read_manifest(big).shards) == 1100
    small = dataset(tmp_path, "small", shards=4)
    # Room for a few tiny shards: the rest of the big dataset's wait, not resident.
    d = start_daemon(args=("--shm-limit", "256K"), loaded=0)
    holders = [raw(d.sock), raw(d.sock)]
    try:
        for s, ds, n in ((holders[0], big, 1100), (holders[1], small, 4)):
            hold = {"op": "hold", "manifest": os.path.abspath(ds), "shards": ",".join(map(str, range(n)))}
            assert (reply := exchange(s, hold)) is not None
            assert reply["ok"] is True, reply
        # Loads finished: what is held, and resident, stays as it is (one version) from here on.
        wait_status(d, lambda st: len(st["segments"]) > 0 and not st["loading"])
        ours = ask(d.sock, {"op": "held", "manifest": os.path.abspath(small)})
        assert ours is not None
        assert ours["ok"] is True, ours
        assert ours["shards"] == [list(shard(small, k)) for k in range(4)]
        assert set(ours["not_resident"]) <= {shard(small, k)[1] for k in range(4)}
        for question in ({"op": "held"}, {"op": "held", "manifest": os.path.abspath(big)}):
            refused = ask(d.sock, question)
            assert refused is not None
            assert refused["ok"] is False
            assert refused["error"] == "reply_failed"
            assert refused["version"] == ours["version"]
        assert "held shard(s) of " + os.path.abspath(big) in d.log.read_text()
        # The big dataset's reader logs why it attaches nothing ahead, and keeps what it has.
        m = read_manifest(big)
        ahead = _Preattacher(
            d.sock, m.path, {s.checksum: k for k, s in enumerate(m.shards)}, lambda k: False, lambda k: None
        )
        try:
            with caplog.at_level("WARNING", logger="smstore"):
                assert ahead._once(None) == ours["version"]
            assert any("cannot attach held shards ahead" in r.getMessage() for r in caplog.records)
            assert ahead.ready == {}
        finally:
            ahead.close()
    finally:
        for s in holders:
            s.close()


# ---- other users -----------------------------------------------------------------------------


@pytest.mark.skipif(not IS_ROOT, reason="needs root to act as a second user")
def test_max_parked_leaves_the_owners_connection_reserve_alone(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon], request: pytest.FixtureRequest
) -> None:
    """The owner's reserve of connections is an eighth of --max-connections whatever --max-parked
    says (--max-parked 16 cut it to 2: other users got 62 of 64 connections instead of 56)."""
    d, group = group_daemon(
        blob, start_daemon, request, "--max-connections", "64", "--max-parked", "16", "--max-per-uid", "100"
    )
    sock = d.sock

    def member() -> str:
        conns = []
        try:
            for _ in range(64):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(10)
                s.connect(os.fspath(sock))
                conns.append(s)
                with contextlib.suppress(BrokenPipeError):  # refused at once: the refusal is still readable
                    s.sendall(STATUS)
                reply = read_reply(s)
                if not (reply and reply["ok"]):
                    return f"{len(conns) - 1} served, then: {(reply or {}).get('message', 'closed')}"
            return "all served"
        finally:
            for s in conns:
                s.close()

    outcome = as_user(member, [group.gr_gid])
    assert outcome == "56 served, then: too many connections (56 for other users)", outcome
    assert_alive_and_clean(d)


@pytest.mark.skipif(not IS_ROOT, reason="needs root to act as a second user")
def test_other_uid_cannot_take_the_owners_parked_requests(
    blob: tuple[Path, list[bytes]], start_daemon: Callable[..., Daemon], request: pytest.FixtureRequest
) -> None:
    """A group member parks at most --max-parked less the owner's reserve; the owner still parks."""
    d, group = group_daemon(blob, start_daemon, request, "--max-parked", "16")  # an eighth, 2, the owner's
    sock = d.sock
    version = daemon_request({"op": "held"}, sock)["version"]
    r, w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.close(r)
            os.close(go_w)
            os.setgroups([group.gr_gid])
            os.setgid(65534)
            os.setuid(65534)
            conns = []
            for _ in range(20):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(10)
                s.connect(os.fspath(sock))
                send(s, {"op": "held", "since": version, "wait": 60})
                conns.append(s)
            wait_status(d, lambda st: st["counts"]["held_requests"] == 21)
            result = str(len(select.select(conns, [], [], 0)[0]))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            result = f"{type(e).__name__}: {e}"
        os.write(w, result.encode() + b"\n")
        os.read(go_r, 1)  # keep the connections until the parent checked
        os._exit(0)
    os.close(w)
    os.close(go_r)
    try:
        with os.fdopen(r, "rb") as f:
            answered_at_once = f.readline().decode().strip()
        assert answered_at_once == "6", answered_at_once  # 14 parked, the other 6 answered
        owner = [raw(sock) for _ in range(2)]
        for s in owner:
            send(s, {"op": "held", "since": version, "wait": 60})
        status = wait_status(d, lambda st: st["counts"]["held_requests"] == 23)
        assert status["counts"]["parked"] == 16
        assert select.select(owner, [], [], 0)[0] == []  # both parked, in the owner's reserve
        for s in owner:
            s.close()
    finally:
        os.close(go_w)
        os.waitpid(pid, 0)
    assert_alive_and_clean(d)


@pytest.mark.skipif(not IS_ROOT, reason="needs root to act as a second user")
def test_another_users_reader_names_only_held_manifests(
    tmp_path: Path, start_daemon: Callable[..., Daemon], request: pytest.FixtureRequest
) -> None:
    """A reader names the dataset it follows in `held`; the daemon reads that manifest for the owner
    only: another user naming a file no hold named (a secret the daemon may read, a FIFO) hears an
    empty list, and the manifest the ranks hold is answered as for the owner."""
    out = sharded(tmp_path, [b"%03d" % i for i in range(40)], shard_size=40)
    os.chmod(tmp_path, 0o755)
    secret = tmp_path / "secret.json"
    secret.write_text('{"not": "a manifest"}')
    secret.chmod(0o600)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    blob = tmp_path / "b.smst"
    smstore.pack([b"x"], blob)
    d, group = group_daemon((blob, []), start_daemon, request)
    manifest = read_manifest(out)
    rank = raw(d.sock)
    try:
        hold = {"op": "hold", "manifest": os.path.abspath(manifest.path), "shards": "1,0"}
        assert (reply := exchange(rank, hold)) is not None
        assert reply["ok"] is True, reply
        sock = d.sock

        def member() -> str:
            answers = []
            for m in (os.fspath(secret), os.fspath(fifo), os.path.abspath(manifest.path)):
                s = raw(sock)
                try:
                    send(s, {"op": "held", "manifest": m})
                    answers.append(read_reply(s))
                finally:
                    s.close()
            return json.dumps(answers)

        secret_reply, fifo_reply, held_reply = json.loads(as_user(member, [group.gr_gid]))
        for empty in (secret_reply, fifo_reply):
            assert empty["ok"] is True, empty
            assert empty["shards"] == []
            assert empty["not_resident"] == []
        assert held_reply["ok"] is True, held_reply
        assert [c for _p, c in held_reply["shards"]] == [
            manifest.shards[1].checksum,
            manifest.shards[0].checksum,
        ]
    finally:
        rank.close()
    assert_alive_and_clean(d)


# ---- the pre-attaching thread ----------------------------------------------------------------


def test_a_preattacher_closed_mid_pass_keeps_no_store(
    tmp_path: Path, start_daemon: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() while the pre-attaching thread is between its attach and keeping the store (here:
    the attach itself ends by closing it, as the dataset's finalizer may at that moment): before
    the fix the thread kept the store in `ready` after close() had emptied it (mapped until the
    process ended); now it closes it, and the daemon hears it detached."""
    from smstore.wire.client import DaemonSession
    from smstore.wire.client import Preattacher as _Preattacher

    out = dataset(tmp_path, "ds", shards=2)
    d = start_daemon(loaded=0)
    rank = raw(d.sock)
    m = read_manifest(out)
    ahead = _Preattacher(
        d.sock, m.path, {s.checksum: k for k, s in enumerate(m.shards)}, lambda k: False, lambda k: None
    )
    attaches: list[str] = []
    session = ahead.session

    def attach_then_close(checksum: str, path: str | None = None) -> tuple[dict[str, Any], int | None]:
        reply = DaemonSession.attach(session, checksum, path)
        attaches.append(checksum)
        ahead.close()
        return reply

    monkeypatch.setattr(session, "attach", attach_then_close)
    try:
        hold = {"op": "hold", "manifest": os.path.abspath(out), "shards": "0,1"}
        assert (reply := exchange(rank, hold)) is not None
        assert reply["ok"] is True, reply
        wait_status(d, lambda st: len(st["segments"]) == 2 and not st["loading"])
        ahead._once(None)
        assert len(attaches) == 1  # the pass ended with the close
        assert ahead.ready == {}
        session.pump()
        st = wait_status(d, lambda st: all(seg["clients"] == [] for seg in st["segments"]))
        assert all(seg["clients"] == [] for seg in st["segments"])
    finally:
        for store in ahead.ready.values():
            store.close()
        rank.close()


def preattach_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "smstore-preattach"]


def test_a_preattaching_thread_of_a_dataset_never_closed_ends_when_its_daemon_is_gone(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """Before the fix the thread asked a stopped daemon again every 0.5 s for as long as the
    process lived; now it ends once the socket is gone."""

    out = dataset(tmp_path, "ds", shards=2)
    before = preattach_threads()
    d = start_daemon(loaded=0)
    store = open_store(out, mode="auto", socket=d.sock)
    assert bytes(store[0]) == smstore.open(out)[0].tobytes()
    threads = [t for t in preattach_threads() if t not in before]
    assert len(threads) == 1
    d.proc.send_signal(signal.SIGTERM)
    d.proc.wait(timeout=30)
    assert not d.sock.exists()
    assert ended(threads)  # the store is still open
    del store


def test_a_preattaching_thread_backs_off_from_a_daemon_that_does_not_answer(tmp_path: Path) -> None:
    """A socket left by a killed daemon: asked less and less often, not every 0.5 s forever."""
    from smstore.wire.client import Preattacher as _Preattacher

    sock = tmp_path / "dead.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(os.fspath(sock))
    listener.close()  # the socket file stays; nobody listens: connection refused
    out = dataset(tmp_path, "ds", shards=2)
    ahead = _Preattacher(sock, os.fspath(out), {}, lambda k: False, lambda k: None)
    waits: list[float] = []

    def wait(timeout: float) -> bool:
        waits.append(timeout)
        if len(waits) == 10:
            ahead._stop.set()
        return ahead._stop.is_set()

    ahead._stop.wait = wait  # type: ignore[method-assign]
    ahead._run()
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0, 30.0]
    ahead.close()
