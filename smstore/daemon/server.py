"""The daemon's server: its lifecycle, its segment table, and the dispatch of requests (`smstore serve`)."""

from __future__ import annotations

import contextlib
import grp
import itertools
import json
import logging
import os
import resource
import selectors
import signal
import socket
import time
from pathlib import Path
from typing import Any

from smstore import _core
from smstore.daemon.caches import cache_request, cache_totals, describe_caches
from smstore.daemon.connections import Conn, Limits, Server
from smstore.daemon.loader import ManifestRead
from smstore.daemon.metrics import Exporter
from smstore.daemon.planner import FETCH_BACKOFF, MANAGED, UNCLAIMED, check_url
from smstore.daemon.segments import (
    METRIC_COUNTERS,
    SHM_DIR,
    DaemonLock,
    SegmentTable,
    adopt_previous,
    list_segments,
    new_segment_name,
    unlink_quietly,
)
from smstore.daemon.serving import Serving, describe
from smstore.daemon.sources import Source
from smstore.daemon.state import StateFile, state_path
from smstore.errors import DaemonError
from smstore.format.manifest import manifest_file
from smstore.wire.ipc import ensure_private_dir, process_start_time, socket_path
from smstore.wire.protocol import (
    BAD_REQUEST,
    PERMISSION_DENIED,
    STATUS_PAGE,
    Location,
    Piece,
    ProtocolError,
    cache_arg,
    checksum_arg,
    checksums_arg,
    dataset_arg,
    held_arg,
    hold_arg,
    is_utf8,
    load_path_arg,
    page_arg,
    refusal,
)

__all__ = ["Daemon", "Limits", "serve", "set_background_scheduling"]

log = logging.getLogger("smstore.daemon")

# A status reply lists at most STATUS_PAGE segments, in at most STATUS_BYTES of JSON, and at most
# STATUS_LIST entries of each other list.
STATUS_BYTES = 256 << 10
STATUS_LIST = 20


def _peer_groups(pid: int) -> set[int]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Groups:"):
                return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()


def set_background_scheduling() -> bool:
    """Put the calling thread (and the threads it starts from now on) under ``SCHED_BATCH``.

    A batch thread gets its fair share of the CPU but never preempts the thread running when it
    wakes up. On a node whose cores all train, a daemon woken by a rank's request would otherwise
    take that rank's core at once, and the rank's batch would wait for the daemon's bookkeeping.
    Returns False where the system does not offer it.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError) as e:
        log.info("SCHED_BATCH is not available (%s): the daemon runs under the default policy", e)
        return False
    return True


def claim_socket(sock_path: Path) -> None:
    """Remove a dead daemon's socket at `sock_path`; refuse if a live one listens there."""
    if not os.path.lexists(sock_path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(2.0)
        probe.connect(os.fspath(sock_path))
    except (ConnectionRefusedError, FileNotFoundError):
        log.info("removing stale socket %s", sock_path)
        sock_path.unlink(missing_ok=True)
        return
    except OSError as e:
        msg = f"{sock_path}: exists and cannot be probed ({e}); remove it if no daemon uses it"
        raise DaemonError(msg) from None
    finally:
        probe.close()
    msg = f"another smstore daemon is already listening on {sock_path}; 'smstore stop' it first"
    raise DaemonError(msg)


class Daemon(Server):
    """The daemon: its lifecycle, its segment table, its requests' dispatch and its event loop. See docs/daemon.md.

    What is done with the segments for clients is `Serving`'s (residency and the budget its
    planner's, loads its loader thread's); the state file is written by `StateFile`; connections
    are the `Server`'s.

    Args:
        sock_path: Where to listen.
        group: Share segments and the socket with this group (read-only), or None for this user only.
        shm_limit: Pretend /dev/shm holds at most this many bytes for our segments (0: no limit).
        shm_limit_from: Where ``shm_limit`` came from, for the messages that it refuses a load.
        read_rate: Read files at most this many bytes a second (0: no limit), to spare a shared
            file system.
        cache_dir: The node cache of shards named by URL (``--cache-dir``), or None: fetched into segments.
        cache_limit: The node cache's limit in bytes (``--cache-limit``).
        fetch_backoff: Seconds before a shard whose fetch failed is fetched again for a hold
            (``--fetch-backoff``; doubled at each failure in a row, up to ten minutes).
        limits: What clients are allowed (connections, request size, timeouts).
        exporter: Where the metrics go (HTTP, textfile), published at most once a second; or None.
    """

    def __init__(
        self,
        sock_path: Path,
        *,
        group: str | None = None,
        shm_limit: int = 0,
        shm_limit_from: str = "--shm-limit",
        read_rate: int = 0,
        cache_dir: str | None = None,
        cache_limit: int = 0,
        fetch_backoff: float = FETCH_BACKOFF,
        limits: Limits | None = None,
        exporter: Exporter | None = None,
    ) -> None:
        super().__init__(os.getuid(), limits or Limits())
        self.sock_path = sock_path
        self.pid = os.getpid()
        start = process_start_time(self.pid)
        if start is None:
            msg = "cannot read this process's start time from /proc"
            raise DaemonError(msg)
        self.start_time = start
        self.gid: int | None = grp.getgrnam(group).gr_gid if group else None
        self.segments = SegmentTable()
        self.state = StateFile(state_path(sock_path), self._state)
        self.serving = Serving(
            self,
            self.segments,
            self.state,
            shm_limit=shm_limit,
            shm_limit_from=shm_limit_from,
            segment_name=self._segment_name,
            gid=self.gid,
            read_rate=read_rate,
            cache_dir=cache_dir,
            cache_limit=cache_limit,
            fetch_backoff=fetch_backoff,
        )
        self._refetched: dict[str, Any] | None = (
            None  # a request served again after its manifest was fetched again
        )
        self.stopping = False
        self.served_held = 0  # 'held' requests served: what readers following the holds cost
        self.lock: DaemonLock | None = None
        self.exporter = exporter
        self._next_publish = 0.0
        # shutdown() removes only what start() made: a second daemon refused on a live socket
        # must leave the socket and state file of the first alone.
        self._owns_socket = False
        self._owns_state = False

    # ---- setup and teardown -------------------------------------------------------------------

    def start(self, files: list[str], checksums: dict[str, str] | None = None) -> None:
        """Claim the socket, adopt a dead predecessor's segments, listen, and queue `files` (paths,
        or objects' URLs: `checksums` gives the one each of those must hold, as its manifest says)."""
        with contextlib.suppress(ValueError, OSError):
            _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        parent = self.sock_path.parent
        ensure_private_dir(parent, create=not parent.exists(), group_gid=self.gid)
        claim_socket(self.sock_path)
        # Held for our whole life: `smstore gc` in another PID namespace, where our pid means
        # nothing, sees that our segments are alive.
        self.lock = DaemonLock.acquire(self.uid, self.pid, self.start_time)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177 if self.gid is None else 0o117)
        try:
            listener.bind(os.fspath(self.sock_path))
        except OSError as e:
            listener.close()
            msg = f"{self.sock_path}: cannot listen there ({e.strerror}); is another daemon starting?"
            raise DaemonError(msg) from None
        finally:
            os.umask(old_umask)
        self._owns_socket = True
        self.listener = listener
        if self.gid is not None:
            os.chown(self.sock_path, -1, self.gid)
        self._adopt_previous()
        listener.listen(128)
        listener.setblocking(False)
        self.sel.register(listener, selectors.EVENT_READ, "listen")
        self.sel.register(self.serving.loader.wake_r, selectors.EVENT_READ, "wake")
        self._owns_state = True
        self.state.save()
        self.serving.loader.start()
        if self.exporter is not None:
            self.exporter.start()
        log.info("listening on %s (pid %d)", self.sock_path, self.pid)
        for f in files:
            self.serving.queue_load(Source.named(f, checksums), Piece(0), None)

    def _adopt_previous(self) -> None:
        """Take over the segments of a dead daemon of this socket; unlink what cannot be adopted."""
        for seg, held in adopt_previous(self.state.path, self.uid, self._segment_name):
            self.segments[seg.checksum] = seg
            if held:
                self.serving.planner.adopted(seg.checksum)

    def _segment_name(self, checksum: str) -> str:
        return new_segment_name(self.uid, self.pid, self.start_time, checksum)

    def _state(self) -> tuple[dict[str, Any], int]:
        """What the state file records: our segments (a memfd cannot be adopted), for a successor.

        Record ranges are left out: a successor removes them as leftovers, and the ranks' next
        holds load them again (a piece is a few MiB read once; adopting it would mean trusting a
        segment whose blob checksum no manifest records).
        """
        entries = [
            s.state_entry(held=self.serving.planner.is_held(s.checksum))
            for s in self.segments.values()
            if not s.shared and s.cache is None and not any("#records=" in p for p in s.paths)
        ]
        state = {
            "pid": self.pid,
            "start_time": self.start_time,
            "socket": os.fspath(self.sock_path),
            "segments": entries,
        }
        return state, len(entries)

    def shutdown(self) -> None:
        """Unlink every segment, and the socket and state file if we made them. Clients keep their mappings."""
        self.stopping = True
        try:
            try:
                for seg in list(self.segments.values()):
                    self.serving.drop(seg)
                self.close_all()
            finally:
                # Whatever failed above, no client finds a socket with no daemon behind it, and no
                # successor a state file naming segments unlinked below.
                if self.listener is not None:
                    self.listener.close()
                if self._owns_socket:
                    self.sock_path.unlink(missing_ok=True)
                if self._owns_state:
                    self.state.path.unlink(missing_ok=True)
            self.serving.loader.stop()
            if self.exporter is not None:
                self.exporter.publish(metric_values(self))
                self.exporter.stop()
        finally:
            # Whatever failed above (a descriptor short for listing /dev/shm), the segments and the
            # lock still go: a successor or `smstore gc` would otherwise find them.
            if self.lock is not None:
                try:
                    for name in list_segments(self.pid, self.start_time):
                        unlink_quietly(name)
                except OSError as e:
                    log.error("cannot list /dev/shm to remove our segments: %s", e)
                self.lock.release()
                self.lock = None
        log.info("stopped")

    def allowed(self, conn: Conn) -> str | None:
        if conn.owner:
            return None
        if self.gid is not None and (conn.gid == self.gid or self.gid in _peer_groups(conn.pid)):
            return None
        served = f"uid {self.uid}" if self.gid is None else f"uid {self.uid} and group {self.gid}"
        return f"uid {conn.uid} may not use this smstore daemon (it serves {served} only)"

    def handle(self, cid: int, conn: Conn, req: dict[str, Any]) -> None:
        op = req.get("op")
        if op == "attach":
            self.serving.attach_request(cid, conn, req)
        elif op == "held":
            # What the ranks hold, so that readers attach it before they read it: with "since" and
            # "wait", parked until it changes.
            self.served_held += 1
            self.serving.held(cid, conn, *held_arg(req))
        elif op == "detach":
            self.serving.detach(cid, conn, checksum_arg(req), reply=req.get("noreply") is not True)
        elif op == "stale_blocks":
            stale = self.serving.planner.stale(checksums_arg(req))
            self.reply(cid, {"ok": True, "stale": stale})
        elif op == "status":
            self.reply(cid, status(self, *page_arg(req)))
        elif op in ("load", "unload", "stop", "share", "hold", "cache") and not conn.owner:
            # Loading reads files with the daemon's rights and stopping affects everyone: owner only.
            # A decoded cache is writable by whoever holds its parts: the owner's processes only.
            raise ProtocolError(PERMISSION_DENIED, f"only uid {self.uid} may {op}")
        elif op == "load":
            named = load_path_arg(req, required=True)
            assert named is not None
            source = Source(named.name, remote=named.remote)
            if source.remote:
                # An object, pinned like a file until 'unload': the allow-list first (the owner's
                # word, but never a scheme we do not fetch); the checksum its manifest records, if given.
                check_url(source.location)
                source.checksum = checksum_arg(req)
            self.serving.queue_load(source, Piece(0), cid)
        elif op == "unload":
            named = load_path_arg(req, required=False)
            self.serving.unload(cid, checksum_arg(req), None if named is None else named.name)
        elif op == "share":
            self.serving.share(cid, conn, req)
        elif op == "hold":
            manifest, pieces, reader, holder = hold_arg(req)
            if self._manifest_ready(cid, conn, req, manifest):  # else served again once it is fetched
                self.serving.hold(
                    cid, manifest, pieces, reply=req.get("noreply") is not True, reader=reader, holder=holder
                )
        elif op == "cache":
            cache_request(self, self.serving.planner, cid, conn, cache_arg(req))
        elif op == "stop":
            self.reply(cid, {"ok": True, "pid": self.pid})
            self.stopping = True
        else:
            raise ProtocolError(BAD_REQUEST, f"unknown op {str(op)[:100]!r}")

    def _manifest_ready(self, cid: int, conn: Conn, req: dict[str, Any], manifest: Location) -> bool:
        """Whether the manifest a hold names is here to plan with; if not (a dataset in object
        storage not fetched yet, or the reader's `dataset` is not the manifest kept for its URL),
        its fetch is started and the request waits for it (its connection busy meanwhile).

        Raises:
            ProtocolError: A URL off the allow-list, or a manifest fetched again for this very
                request that is still not the dataset the reader read (replaced in the bucket).
        """
        if not manifest.remote:
            return True
        url = manifest.name
        dataset = dataset_arg(req)
        kept = self.serving.planner.remote_manifest(url)
        if kept is not None and (dataset is None or kept.checksum == dataset):
            return True
        if kept is not None and req is self._refetched:
            msg = (
                f"{url}: the manifest there is dataset {kept.checksum}, but this reader read dataset {dataset}: "
                "the manifest was replaced in the bucket since; open the dataset again"
            )
            raise ProtocolError(BAD_REQUEST, msg)
        check_url(manifest_file(url))  # the allow-list, before any thread starts
        if kept is not None:
            # Another dataset than the reader's under this URL: the bucket's manifest may have been
            # replaced since it was fetched. Fetched again (the shards' checksums guard the bytes either way).
            log.info(
                "%s: a hold names dataset %s, not the %s kept: fetching the manifest again",
                url,
                dataset,
                kept.checksum,
            )
            self.serving.planner.forget(url)
        if not any(c.waits_manifest is not None and c.waits_manifest[0] == url for c in self.conns.values()):
            self.serving.loader.fetch_manifest(url)  # the first request waiting for it
        conn.waits_manifest = (url, req)
        self.set_busy(cid, True)
        return False

    def finish_manifests(self, read: list[ManifestRead]) -> None:
        """Keep the manifests `read`, and serve the requests that waited for them."""
        for url, result in ((m.url, m.result) for m in read):
            waiting: list[tuple[int, Conn, dict[str, Any]]] = []
            for cid, conn in self.conns.items():
                if conn.waits_manifest is not None and conn.waits_manifest[0] == url:
                    waiting.append((cid, conn, conn.waits_manifest[1]))
                    conn.waits_manifest = None
            if isinstance(result, Exception):
                log.error("cannot read the manifest %s: %s", url, result)
            else:
                self.serving.planner.add_remote(url, result)
                log.info(
                    "read the manifest %s: %d shards (dataset %s)", url, len(result.shards), result.checksum
                )
            for cid, conn, req in waiting:
                if cid not in self.conns:  # closed by a reply sent above
                    continue
                self.set_busy(cid, False)
                if isinstance(result, Exception):
                    self.reply(cid, refusal(type(result).__name__, str(result)[:1000]))
                else:
                    self._refetched = req
                    try:
                        self.serve_request(cid, conn, req)
                    finally:
                        self._refetched = None
                self.parse(cid)

    def on_close(self, cid: int, conn: Conn) -> None:
        if self.stopping:
            # Every segment goes with the daemon: nothing to plan for the holds that end with their
            # connections (a plan would queue loads, and trust a table that whatever stopped the
            # loop may have left half-updated).
            return
        self.serving.closed(cid, conn)

    def refused(self, code: str) -> None:
        self.serving.counters.add("refusals", label=code)

    def wake(self, cid: int) -> None:
        self.serving.wake(cid)  # the only requests parked: 'held' ones

    # ---- the loop ---------------------------------------------------------------------------

    def run_once(self, timeout: float) -> None:
        """Wait up to `timeout` seconds and serve what is ready."""
        for key, events in self.sel.select(timeout=timeout):
            if key.data == "listen":
                try:
                    self.accept_all()
                except OSError as e:
                    log.error("accept failed: %s", e)
            elif key.data == "wake":
                self.finish_manifests(self.serving.finish_loads())
            else:
                self.dispatch(key, events)
        self.expire()
        self.state.flush()
        if self.exporter is not None and (now := time.monotonic()) >= self._next_publish:
            self._next_publish = now + 1.0
            self.exporter.publish(metric_values(self))

    def require(self, files: list[str]) -> None:
        """Serve until every one of `files` (given at start) has loaded or failed; raise if any failed.

        Raises:
            DaemonError: Naming each file that failed to load and why.
        """
        paths = [Source.named(f).location for f in files]
        while not self.stopping and any(p in self.serving.loading for p in paths):
            self.run_once(0.5)
        whys = [(p, why) for p in paths if (why := self.serving.planner.last_failure(p)) is not None]
        failed = [why if why.startswith(p) else f"{p}: {why}" for p, why in whys]
        if failed:
            msg = f"--require: {len(failed)} file(s) given at start failed to load: " + "; ".join(failed)
            raise DaemonError(msg)

    def run(self) -> None:
        """Serve until `stop`, SIGTERM or SIGINT."""
        while not self.stopping:
            self.run_once(min(1.0, self.limits.io_timeout / 2))


def status(daemon: Daemon, offset: int, limit: int) -> dict[str, Any]:
    """A summary, and a page of `limit` segments from `offset` (in load order) with every list capped.

    Every reply fits a message, whatever the daemon holds (100,000 segments, paths of 4 KiB):
    ``next_offset`` is where the next page starts (None after the last), and the lists other
    than ``segments`` hold their first entries (their lengths are in ``counts``).
    """
    available, total = _core.shm_space(os.fspath(SHM_DIR))
    page: list[dict[str, Any]] = []
    size = 0
    next_offset: int | None = None
    for k, seg in enumerate(itertools.islice(daemon.segments.values(), offset, None)):
        if len(page) == limit or size > STATUS_BYTES:
            next_offset = offset + k
            break
        entry = describe(seg)
        size += len(json.dumps(entry))
        page.append(entry)
    failed = [
        {"path": p, "checksum": ck, "message": why}
        for p, ck, why in daemon.serving.planner.failures.held_failures()
    ]
    return {
        "ok": True,
        "pid": daemon.pid,
        "uid": daemon.uid,
        "socket": os.fspath(daemon.sock_path),
        "version": _core.__version__,
        "shm": {
            "available": available,
            "total": total,
            "limit": daemon.serving.planner.shm_limit,
            "limit_from": daemon.serving.planner.shm_limit_from,
            "used": daemon.serving.planner.used(),
        },
        "counts": {
            "segments": len(daemon.segments),
            "loading": len(daemon.serving.loading),
            "held": len(daemon.serving.planner.marked(MANAGED)),
            "unclaimed": len(daemon.serving.planner.marked(UNCLAIMED)),
            "released": len(daemon.serving.planner.mapped_released()),
            "failed": len(failed),
            "held_requests": daemon.served_held,
            "parked": daemon.parked,
        },
        "segments": page,
        "offset": offset,
        "next_offset": next_offset,
        "loading": sorted(daemon.serving.loading)[:STATUS_LIST],
        "held": sorted(daemon.serving.planner.marked(MANAGED))[
            :STATUS_PAGE
        ],  # checksums loaded because a rank holds them
        "unclaimed": sorted(daemon.serving.planner.marked(UNCLAIMED))[
            :STATUS_PAGE
        ],  # adopted, held by a dead predecessor, not since
        "released": daemon.serving.planner.mapped_released()[
            :STATUS_PAGE
        ],  # released held segments readers still map
        # Held shards whose load failed, not tried again until their file changes.
        "failed": failed[:STATUS_LIST],
        "decoded_caches": describe_caches(daemon.segments, STATUS_LIST),
        "loads": daemon.serving.loads,
        "connections": len(daemon.conns),
        "metrics": metric_values(daemon, (available, total)),
        "metrics_url": daemon.exporter.url if daemon.exporter is not None else None,
    }


def metric_values(daemon: Daemon, shm: tuple[int, int] | None = None) -> dict[str, Any]:
    """Every metric's value now (keys of `smstore.daemon.metrics.METRICS`): status's ``metrics`` section."""
    available, _total = shm if shm is not None else _core.shm_space(os.fspath(SHM_DIR))
    planner = daemon.serving.planner
    wanted = planner.wanted(readers=False, whole=True)  # the ranks' shards (a reader's own hold is no window)
    remote = daemon.serving.loader.remote_values()
    counted = daemon.serving.counters.values()
    decoded = cache_totals(daemon.segments)  # the caches served now; those evicted are counted
    for name in METRIC_COUNTERS:
        counted[f"decoded_{name}"] += decoded[name]
    return {
        "segments": len(daemon.segments),
        "resident_bytes": sum(s.size for s in daemon.segments.values()),
        "shm_limit_bytes": planner.shm_limit,
        "shm_used_bytes": planner.used(),
        "shm_available_bytes": available,
        "loading": len(daemon.serving.loading),
        **counted,
        "decoded_bytes": decoded["bytes"],
        **remote,
        "held_wanted": len(wanted),
        "held_resident": sum(ck in daemon.segments for ck in wanted),
        "connections": {str(uid): n for uid, n in sorted(daemon.per_uid().items())},
    }


def serve(
    files: list[str],
    *,
    checksums: dict[str, str] | None = None,
    sock: str | os.PathLike[str] | None = None,
    group: str | None = None,
    shm_limit: int = 0,
    shm_limit_from: str = "--shm-limit",
    read_rate: int = 0,
    cache_dir: str | None = None,
    cache_limit: int = 0,
    fetch_backoff: float = FETCH_BACKOFF,
    limits: Limits | None = None,
    background: bool = True,
    require: bool = False,
    metrics: tuple[str, int] | None = None,
    metrics_file: str | os.PathLike[str] | None = None,
) -> int:
    """Run the daemon in the foreground until stopped. Returns the exit status.

    `files` are blobs' paths or objects' URLs (a URL's `checksums` entry, if any, is the checksum
    its manifest records: a blob holding another is refused). With `require`, a file of `files`
    that fails to load stops the daemon: `DaemonError` names
    the file and the fault (a launcher sees the exit status instead of a daemon serving less).

    With `background` (the default), the daemon's threads run under ``SCHED_BATCH``: a request
    that wakes the daemon (a rank's fire-and-forget ``hold`` at a window switch) never preempts
    the process that sent it, whose training loop goes on while the daemon waits for a free core.

    With `metrics` (host, port) and/or `metrics_file`, the metrics are served over HTTP and/or
    written to a textfile for node_exporter (see docs/operations.md, "Metrics").
    """
    for f in files:
        if not is_utf8(f):
            # The daemon names what it serves in its replies, state file and log (in UTF-8).
            msg = f"{f!r}: the file name is not valid UTF-8; rename it (smstore names files in UTF-8 only)"
            raise DaemonError(msg)
    # The calling thread's policy, given back on return (a caller running the daemon in-process).
    policy = (os.sched_getscheduler(0), os.sched_getparam(0)) if background else None
    if background:
        # Before any thread starts: each thread of the daemon inherits it.
        set_background_scheduling()
    try:
        return _serve(
            files,
            checksums=checksums,
            sock=sock,
            group=group,
            shm_limit=shm_limit,
            shm_limit_from=shm_limit_from,
            read_rate=read_rate,
            cache_dir=cache_dir,
            cache_limit=cache_limit,
            fetch_backoff=fetch_backoff,
            limits=limits,
            require=require,
            metrics=metrics,
            metrics_file=metrics_file,
        )
    finally:
        if policy is not None:
            try:
                os.sched_setscheduler(0, *policy)
            except OSError as e:  # a real-time policy set back needs a privilege SCHED_BATCH may not keep
                log.warning("cannot restore the calling thread's scheduling policy: %s", e)


def _serve(
    files: list[str],
    *,
    checksums: dict[str, str] | None,
    sock: str | os.PathLike[str] | None,
    group: str | None,
    shm_limit: int,
    shm_limit_from: str,
    read_rate: int,
    cache_dir: str | None,
    cache_limit: int,
    fetch_backoff: float,
    limits: Limits | None,
    require: bool,
    metrics: tuple[str, int] | None,
    metrics_file: str | os.PathLike[str] | None,
) -> int:
    daemon = Daemon(
        socket_path(sock),
        group=group,
        shm_limit=shm_limit,
        shm_limit_from=shm_limit_from,
        read_rate=read_rate,
        cache_dir=cache_dir,
        cache_limit=cache_limit,
        fetch_backoff=fetch_backoff,
        limits=limits,
        exporter=(
            Exporter(metrics, Path(metrics_file) if metrics_file is not None else None)
            if metrics is not None or metrics_file is not None
            else None
        ),
    )

    def on_signal(signum: int, _frame: object) -> None:
        log.info("%s received: stopping", signal.Signals(signum).name)
        daemon.stopping = True

    # A caller running the daemon in-process gets its own handlers and wakeup fd back on return
    # (None: a handler not set from Python, which Python cannot set back).
    old_handlers = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    # Wakes select() when a signal arrives, so stopping never waits for the timeout.
    old_wakeup = signal.set_wakeup_fd(daemon.serving.loader.wake_w.fileno(), warn_on_full_buffer=False)
    try:
        daemon.start(files, checksums)
        if require:
            daemon.require(files)
        daemon.run()
    finally:
        try:
            daemon.shutdown()
        finally:
            signal.set_wakeup_fd(old_wakeup)
            for sig, handler in old_handlers.items():
                if handler is not None:
                    signal.signal(sig, handler)
    return 0
