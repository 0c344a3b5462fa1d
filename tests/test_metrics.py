"""The daemon's metrics: status's section, the Prometheus endpoint and textfile, `status --watch`."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import select
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import smstore
from smstore.daemon.metrics import MAX_SCRAPES, METRICS, Exporter, render
from smstore.format.manifest import read_manifest

from . import daemon_testlib as tl
from .daemon_testlib import Daemon
from .smstore_testlib import child_process, sharded

parser = pytest.importorskip("prometheus_client.parser", reason="the 'test' extra installs prometheus_client")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
UID = str(os.getuid())
# Values that move on their own: the free room of /dev/shm (other processes use it), the connections
# open (a status request counts its own).
MOVING = {"shm_available_bytes", "connections"}


def expected_samples(values: dict[str, Any], skip: set[str] = MOVING) -> Samples:
    """Status's ``metrics`` section as the samples its Prometheus text must hold."""
    out: Samples = {}
    for key, (name, kind, label, _help) in METRICS.items():
        if key in skip:
            continue
        sample = f"{name}_total" if kind == "counter" else name
        if label is None:
            out[(sample, ())] = float(values[key])
        else:
            for lv, v in values[key].items():
                out[(sample, ((label, lv),))] = float(v)
    return out


def parse(text: str, skip: set[str] = MOVING) -> Samples:
    """Prometheus text parsed by prometheus_client's own parser."""
    names = {METRICS[k][0] for k in skip}
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in parser.text_string_to_metric_families(text)
        if family.name not in names
        for s in family.samples
    }


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return str(r.read().decode())


def until(fetch: Callable[[], Any], predicate: Callable[[Any], bool], timeout: float = 30) -> Any:
    """`fetch()` once `predicate` holds for it, or its last value after `timeout` seconds (not a timing goal)."""
    deadline = time.monotonic() + timeout
    while not predicate(value := fetch()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def test_loads_failures_and_refusals_are_counted_in_status_the_endpoint_and_the_textfile(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    blobs = []
    for k, n in enumerate((300, 1200)):
        path = tmp_path / f"b{k}.smst"
        smstore.pack(tl.make_records(n, seed=k), path, durable=False)
        blobs.append(path)
    prom_dir = tmp_path / "textfile"
    prom_dir.mkdir()
    prom = prom_dir / "smstore.prom"
    d = start_daemon(*blobs, args=("--metrics", "127.0.0.1:0", "--metrics-file", str(prom)))
    sizes = [p.stat().st_size for p in blobs]

    # A load of a file that is not there, and one refused request of each kind the owner can provoke.
    res = tl.cli("load", str(tmp_path / "missing.smst"), sock=d.sock, check=False)
    assert res.returncode != 0
    assert tl.ask(d.sock, b'{"op": "frobnicate"}')["error"] == "bad_request"
    assert tl.ask(d.sock, b'{"op": "attach", "checksum": "0123456789abcdef"}')["error"] == "not_served"
    s = tl.raw(d.sock)
    try:
        s.sendall((1 << 30).to_bytes(4, "big"))
        assert tl.read_reply(s)["error"] == "too_large"  # type: ignore[index]
    finally:
        s.close()

    expected = {
        "segments": 2,
        "resident_bytes": sum(sizes),
        "loading": 0,
        "loads": {"loaded": 2, "failed": 1},
        "load_bytes": sum(sizes),
        "load_failures": {"StoreNotFoundError": 1},
        "attach_waits": 0,
        "attach_wait_seconds": 0.0,
        "held_wanted": 0,
        "held_resident": 0,
        "shm_limit_bytes": 0,
        "refusals": {"StoreNotFoundError": 1, "bad_request": 1, "not_served": 1, "too_large": 1},
    }
    status = tl.wait_status(d, lambda st: st["metrics"]["connections"] == {UID: 1})
    m = status["metrics"]
    assert {k: m[k] for k in expected} == expected
    assert m["connections"] == {UID: 1}  # the status request's own
    page = os.sysconf("SC_PAGESIZE")
    assert m["shm_used_bytes"] == sum(-(-n // page) * page for n in sizes)
    assert m["load_seconds"] > 0
    assert m["shm_available_bytes"] == status["shm"]["available"]

    # The endpoint serves the same numbers (published within a second: scraped until it has them).
    want = expected_samples(m)
    text = until(lambda: scrape(status["metrics_url"]), lambda t: parse(t) == want)
    assert parse(text) == want

    # The textfile too, written whole by a rename: nothing else is left in its directory.
    text = until(lambda: prom.read_text() if prom.exists() else "", lambda t: parse(t) == want)
    assert parse(text) == want
    assert os.listdir(prom_dir) == ["smstore.prom"]
    assert stat.S_IMODE(prom.stat().st_mode) == 0o644
    inode = prom.stat().st_ino
    tl.cli("unload", str(blobs[0]), sock=d.sock)
    text = until(lambda: prom.read_text(), lambda t: parse(t)[("smstore_segments", ())] == 1)
    assert parse(text)[("smstore_resident_bytes", ())] == sizes[1]
    assert prom.stat().st_ino != inode  # replaced, never rewritten in place
    assert os.listdir(prom_dir) == ["smstore.prom"]


def test_held_shards_the_budget_and_a_reader_that_waited_for_a_load(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    out = sharded(tmp_path, [b"%05d " % i + b"x" * 200 for i in range(600)], shard_size=40_000)
    m = read_manifest(out)
    assert len(m.shards) >= 3
    page = os.sysconf("SC_PAGESIZE")
    pages = [-(-s.file_size // page) * page for s in m.shards]
    limit = sum(pages) + page
    # Reads throttled to 100 KB/s: the reader's attach of shard 1 arrives while it is loading.
    d = start_daemon(args=("--max-read-rate", "100K", "--shm-limit", str(limit)), loaded=0)
    rank = tl.raw(d.sock)
    reader = tl.raw(d.sock)
    reader.settimeout(30)
    try:
        hold = {"op": "hold", "manifest": os.fspath(out), "shards": "0,1"}
        assert tl.exchange(rank, hold) == {"ok": True, "resident": 0, "held": 2, "limit": limit}
        attach = {"op": "attach", "checksum": m.shards[1].checksum, "path": m.shard_path(1)}
        reply = tl.exchange(reader, attach)
        assert reply is not None
        assert reply["ok"] is True, reply
        assert reply["checksum"] == m.shards[1].checksum
        status = tl.wait_status(d, lambda st: st["metrics"]["held_resident"] == 2)
        got = status["metrics"]
        assert got["held_wanted"] == 2
        assert got["held_resident"] == 2
        assert got["attach_waits"] == 1
        assert got["attach_wait_seconds"] > 0
        assert got["shm_limit_bytes"] == limit
        assert got["shm_used_bytes"] == pages[0] + pages[1] == status["shm"]["used"]
        assert got["loads"] == {"loaded": 2}
        assert got["load_bytes"] == m.shards[0].file_size + m.shards[1].file_size
        assert got["connections"] == {UID: 3}  # the rank, the reader, this status request
        assert got["refusals"] == {}
    finally:
        rank.close()
        reader.close()


def test_busy_refusals_are_counted_and_connections_seen_by_the_endpoint(
    start_daemon: Callable[..., Daemon],
) -> None:
    d = start_daemon(args=("--max-connections", "2", "--metrics", "127.0.0.1:0"), loaded=0)
    url = d.status()["metrics_url"]
    socks = [tl.raw(d.sock), tl.raw(d.sock)]
    try:
        key = ("smstore_connections", (("uid", UID),))
        text = until(lambda: scrape(url), lambda t: parse(t, set()).get(key) == 2)
        assert parse(text, set())[key] == 2
        third = tl.raw(d.sock)
        socks.append(third)
        refused = tl.read_reply(third)
        assert refused is not None
        assert refused["error"] == "busy"
    finally:
        for s in socks:
            s.close()
    # Every connection closed (the endpoint needs none), then the one refusal is counted.
    text = until(lambda: scrape(url), lambda t: key not in parse(t, set()))
    assert parse(text)[("smstore_refusals_total", (("reason", "busy"),))] == 1
    assert d.status()["metrics"]["refusals"] == {"busy": 1}


def test_no_room_and_permission_denied_refusals_are_counted(
    request: pytest.FixtureRequest, tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """A shared blob larger than --shm-limit, and (as root) a connection from another uid."""
    blob = tmp_path / "b.smst"
    smstore.pack(tl.make_records(500), blob, durable=False)
    sock = tl.public_rundir(request) / "smstore.sock"
    d = start_daemon(args=("--shm-limit", "64K"), loaded=0, at=sock)
    fd = os.memfd_create("blob", os.MFD_ALLOW_SEALING)
    try:
        os.write(fd, blob.read_bytes())
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK)
        s = tl.raw(d.sock)
        try:
            body = json.dumps({"op": "share", "key": "xxh64:" + "ab" * 8}).encode()
            socket.send_fds(s, [tl.frame(body)], [fd])
            assert tl.read_reply(s)["error"] == "no_room"  # type: ignore[index]
        finally:
            s.close()
    finally:
        os.close(fd)
    want = {"no_room": 1}
    if tl.IS_ROOT:
        d.sock.parent.chmod(0o711)
        d.sock.chmod(0o666)

        def outsider() -> str:
            with tl.raw(d.sock) as s:
                return str(tl.read_reply(s))

        assert "'permission_denied'" in tl.as_user(outsider, [])
        want["permission_denied"] = 1
    status = tl.wait_status(d, lambda st: st["metrics"]["refusals"] == want)
    assert status["metrics"]["refusals"] == want


def watch_command(sock: Path) -> list[str]:
    """`smstore status --watch` on `sock`, redrawn every 0.1 s."""
    return [
        sys.executable,
        "-m",
        "smstore",
        "status",
        "--watch",
        "--interval",
        "0.1",
        "--socket",
        os.fspath(sock),
    ]


def test_status_prints_the_metrics_and_watch_redraws_until_ctrl_c(
    tmp_path: Path, start_daemon: Callable[..., Daemon], ctrl_c: None
) -> None:
    path = tmp_path / "b.smst"
    smstore.pack(tl.make_records(100), path, durable=False)
    d = start_daemon(path)
    out = tl.cli("status", sock=d.sock).stdout
    assert "metrics:" in out
    assert "loads: 1 (loaded 1)" in out
    assert f"connections by uid: {UID} 1" in out
    with child_process(
        watch_command(d.sock),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(10)]  # two views (not a tty: plain lines)
        assert sum("loads: 1 (loaded 1)" in line for line in lines) == 2
        assert all(line[:2].isdigit() and line[2] == ":" for line in lines)  # each line time-stamped
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0
    assert "Traceback" not in err


def test_watch_on_a_terminal_redraws_in_place(
    tmp_path: Path, start_daemon: Callable[..., Daemon], ctrl_c: None
) -> None:
    d = start_daemon(loaded=0)
    master, slave = pty.openpty()
    try:
        with child_process(
            watch_command(d.sock),
            stdout=slave,
            stderr=subprocess.PIPE,
            text=True,
        ) as proc:
            os.close(slave)
            slave = -1
            out = b""
            while out.count(b"\x1b[H\x1b[2J") < 2:  # two screens drawn (bounded by the read's select)
                assert select.select([master], [], [], 20)[0], out
                out += os.read(master, 4096)
            proc.send_signal(signal.SIGINT)
            _out, err = proc.communicate(timeout=20)
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)
    assert b"Ctrl-C to quit" in out
    assert b"loads: 0" in out
    assert proc.returncode == 0
    assert "Traceback" not in err


def test_a_bad_metrics_address_is_refused_before_serving(tmp_path: Path) -> None:
    res = tl.cli("serve", "--metrics", "localhost:http", sock=tmp_path / "s.sock", check=False)
    assert res.returncode == 2
    assert "--metrics 'localhost:http': expected HOST:PORT" in res.stderr
    assert not (tmp_path / "s.sock").exists()


def test_an_address_in_use_or_a_missing_textfile_directory_stops_serve_with_the_reason(
    tmp_path: Path,
) -> None:
    busy = socket.socket()
    try:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        res = tl.cli("serve", "--metrics", f"127.0.0.1:{port}", sock=tmp_path / "s.sock", check=False)
    finally:
        busy.close()
    assert res.returncode == 1
    assert f"--metrics 127.0.0.1:{port}: cannot listen there" in res.stderr
    missing = tmp_path / "no" / "smstore.prom"
    res = tl.cli("serve", "--metrics-file", str(missing), sock=tmp_path / "s.sock", check=False)
    assert res.returncode == 1
    assert f"--metrics-file {missing}: its directory does not exist" in res.stderr
    assert not (tmp_path / "s.sock").exists()


def test_a_second_daemon_with_metrics_refused_on_a_live_socket_exits(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """Its exporter was made but never started: stopping it must not wait for a serving thread."""
    d = start_daemon(loaded=0)
    res = tl.cli("serve", "--metrics", "127.0.0.1:0", sock=d.sock, check=False, timeout=60)
    assert res.returncode == 1
    assert "another smstore daemon is already listening" in res.stderr
    assert d.proc.poll() is None
    assert d.status()["ok"] is True


def test_label_values_are_escaped() -> None:
    text = render({"load_failures": {'a"b\\c\nd': 2}})
    ((name, labels), value) = next(iter(parse(text, set()).items()))
    assert (name, labels, value) == ("smstore_load_failures_total", (("kind", 'a"b\\c\nd'),), 2.0)


def read_to_end(s: socket.socket) -> bytes:
    """What the server sends until it closes the connection (a reset counts as a close)."""
    data = b""
    while True:
        try:
            chunk = s.recv(4096)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def test_trickling_clients_of_the_endpoint_are_bounded_in_count_and_time(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """Anyone who reaches the port could hold a thread and a descriptor of the daemon per connection,
    each for as long as it sent a byte every few seconds: the owner's requests then failed."""
    blob = tmp_path / "b.smst"
    smstore.pack(tl.make_records(100), blob, durable=False)
    d = start_daemon(args=("--metrics", "127.0.0.1:0"), loaded=0)
    url = d.status()["metrics_url"]
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    threads = len(os.listdir(f"/proc/{d.pid}/task"))
    held: list[socket.socket] = []
    turned: list[socket.socket] = []
    try:
        # Every slot is taken by a client that sends its request a byte at a time.
        for _ in range(MAX_SCRAPES):
            held.append(socket.create_connection(("127.0.0.1", port), timeout=30))
            held[-1].sendall(b"G")
        # Then more are answered 503 at once (accepted in order: every slot is taken by then).
        for _ in range(3 * MAX_SCRAPES):
            turned.append(socket.create_connection(("127.0.0.1", port), timeout=30))
            assert read_to_end(turned[-1]).startswith(b"HTTP/1.0 503 "), "not turned away"
        assert len(os.listdir(f"/proc/{d.pid}/task")) <= threads + MAX_SCRAPES
        # The owner is served meanwhile.
        tl.cli("load", str(blob), sock=d.sock)
        assert d.status()["segments"][0]["paths"] == [str(blob)]
        # The trickling clients are cut off at their request's deadline, however often they send
        # (bounded: the old server's timeout was per read, and never came).
        open_ = list(held)
        for _ in range(600):
            if not open_:
                break
            for s in open_:
                with contextlib.suppress(OSError):  # the server may have closed it: the read says
                    s.sendall(b"E")
            ready, _w, _x = select.select(open_, [], [], 0.05)
            for s in ready:
                assert read_to_end(s) == b""  # closed without a reply: no request came
                open_.remove(s)
        assert not open_, f"{len(open_)} trickling connection(s) still open"
    finally:
        for s in held + turned:
            s.close()
    # Their slots are free again: the endpoint serves.
    assert "smstore_segments 1.0" in scrape(url)


def test_the_textfile_mode_is_set_through_its_descriptor_never_a_link_at_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A symbolic link put at the temporary file's name (its directory writable by another user) made
    the file it points to, any file of the daemon's user, world-readable (os.chmod by path)."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"private")
    secret.chmod(0o600)
    textfile_dir = tmp_path / "textfile"
    textfile_dir.mkdir()
    mkstemp = tempfile.mkstemp

    def swapped(*args: Any, **kwargs: Any) -> tuple[int, str]:
        fd, tmp = mkstemp(*args, **kwargs)
        os.unlink(tmp)
        os.symlink(secret, tmp)  # what the other user does between the creation and the chmod
        return fd, tmp

    monkeypatch.setattr(tempfile, "mkstemp", swapped)
    exporter = Exporter(None, textfile_dir / "smstore.prom")
    exporter.start()
    exporter.publish({"segments": 1})
    exporter.stop()  # writes the last figures once more
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert secret.read_bytes() == b"private"
