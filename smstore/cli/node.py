"""The `smstore` commands on the node: its daemon (serve, status, load, unload, stop, gc), doctor, wait."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from smstore.cli.common import argument_source, human, parse_size
from smstore.errors import StoreError

__all__ = ["add_node_commands"]


def _seconds(text: str) -> float:
    """A timeout in seconds, in (0, 3600]; ArgumentTypeError otherwise."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 3600:  # also refuses nan
        msg = f"{text!r} is not a number of seconds between 0 and 3600"
        raise argparse.ArgumentTypeError(msg)
    return value


def _backoff(text: str) -> float:
    """Seconds from 0 to 600; ArgumentTypeError otherwise."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= 600:  # also refuses nan and inf
        msg = f"{text!r} is not a number of seconds from 0 to 600"
        raise argparse.ArgumentTypeError(msg)
    return value


def _from_env(name: str, parse: Callable[[str], Any]) -> Any:
    """An environment variable parsed like the option it stands for; None if unset."""
    text = os.environ.get(name)
    if not text:
        return None
    try:
        return parse(text)
    except argparse.ArgumentTypeError as e:
        msg = f"${name}: {e}"
        raise StoreError(msg) from None


def cmd_serve(args: argparse.Namespace) -> int:
    from smstore.daemon import Limits, serve

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="smstore serve[%(process)d] %(asctime)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    shm_limit = args.shm_limit if args.shm_limit is not None else _from_env("SMSTORE_SHM_LIMIT", parse_size)
    shm_limit_from = "--shm-limit" if args.shm_limit is not None else "$SMSTORE_SHM_LIMIT"
    timeout = args.io_timeout if args.io_timeout is not None else _from_env("SMSTORE_IO_TIMEOUT", _seconds)
    defaults = Limits()
    max_connections = args.max_connections or defaults.max_connections
    # --max-parked 0 parks nothing: readers ask again every 100 ms.
    max_parked = args.max_parked if args.max_parked is not None else defaults.max_parked
    try:
        limits = Limits(
            max_connections=max_connections,
            max_per_uid=args.max_per_uid or defaults.max_per_uid,
            # Each reserve an eighth of its own limit (at most 64): a small --max-parked leaves the
            # owner's connections alone.
            owner_reserve=min(defaults.owner_reserve, max(1, max_connections // 8)),
            io_timeout=timeout or defaults.io_timeout,
            max_parked=max_parked,
            parked_reserve=min(defaults.parked_reserve, max(0, max_parked) // 8),
        )
    except ValueError as e:
        print(f"smstore serve: {e}", file=sys.stderr)
        return 2
    if args.cache_limit is not None and args.cache_dir is None:
        print("smstore serve: --cache-limit needs --cache-dir", file=sys.stderr)
        return 2
    if args.cache_dir is not None and not args.cache_limit:
        print("smstore serve: --cache-dir needs --cache-limit SIZE (e.g. 100G)", file=sys.stderr)
        return 2
    try:
        # A dataset in object storage: its manifest read here, before the daemon starts (no fork
        # follows: this process is the daemon), so that its shards load with the checksums it records.
        blobs = [blob for f in args.files for blob in _blob_files(f)]
    except StoreError as e:
        print(f"smstore serve: {e}", file=sys.stderr)
        return 1
    files = [path for path, _checksum in blobs]
    checksums = {path: checksum for path, checksum in blobs if checksum is not None}
    metrics = None
    if args.metrics is not None:
        from smstore.daemon import parse_address

        try:
            metrics = parse_address(args.metrics)
        except ValueError as e:
            print(f"smstore serve: {e}", file=sys.stderr)
            return 2
    return serve(
        files,
        checksums=checksums,
        sock=args.socket,
        group=args.group,
        shm_limit=shm_limit or 0,
        shm_limit_from=shm_limit_from,
        read_rate=args.max_read_rate or 0,
        cache_dir=args.cache_dir,
        cache_limit=args.cache_limit or 0,
        fetch_backoff=args.fetch_backoff,
        limits=limits,
        background=args.background,
        require=args.require,
        metrics=metrics,
        metrics_file=args.metrics_file,
    )


def _client_pids(pids: list[int]) -> str:
    return ", ".join(str(p) for p in pids) if pids else "-"


# Segments `smstore status` describes without --detail (the summary gives the rest).
STATUS_SHOWN = 20


def _metrics_lines(reply: dict[str, Any]) -> list[str]:
    """The ``metrics`` section of a status reply, a few lines (the figures `--metrics` exports)."""
    m = reply.get("metrics") or {}
    loads = m.get("loads", {})
    waits = m.get("attach_waits", 0)

    def by(key: str) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(m.get(key, {}).items())) or "none"

    limit = m.get("shm_limit_bytes", 0)
    budget = f"{human(m.get('shm_used_bytes', 0))} of {human(limit)}" if limit else "no limit"
    return [
        (
            f"resident: {m.get('segments', 0)} segment(s), {human(m.get('resident_bytes', 0))}; "
            f"budget {budget}; /dev/shm free {human(m.get('shm_available_bytes', 0))}"
        ),
        (
            f"loads: {sum(loads.values())} ({by('loads')}), {human(m.get('load_bytes', 0))} in "
            f"{m.get('load_seconds', 0.0):.2f} s; {m.get('loading', 0)} loading; failures: {by('load_failures')}"
        ),
        (
            f"held shards: {m.get('held_resident', 0)} loaded of {m.get('held_wanted', 0)} wanted; "
            f"readers waited for a load {waits} time(s), {m.get('attach_wait_seconds', 0.0):.3f} s"
        ),
        f"connections by uid: {by('connections')}; refusals: {by('refusals')}",
    ]


def _watch(args: argparse.Namespace) -> int:
    """`status --watch`: the metrics redrawn every `args.interval` seconds until Ctrl-C."""
    from smstore.wire.client import daemon_request

    tty = sys.stdout.isatty()
    try:
        while True:
            try:
                reply = daemon_request({"op": "status", "limit": 0}, args.socket)
                lines = [f"smstore daemon pid {reply['pid']} on {reply['socket']}", *_metrics_lines(reply)]
            except StoreError as e:
                lines = [f"no daemon answers: {e}"]
            stamp = time.strftime("%H:%M:%S")
            if tty:  # redraw in place, like top
                sys.stdout.write("\x1b[H\x1b[2J" + f"{stamp}  every {args.interval:g} s, Ctrl-C to quit\n")
                sys.stdout.write("\n".join(lines) + "\n")
            else:  # plain lines for a log or a pipe
                sys.stdout.write("".join(f"{stamp} {line}\n" for line in lines))
            sys.stdout.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


def cmd_status(args: argparse.Namespace) -> int:
    from smstore.wire.client import daemon_request

    if args.watch:
        return _watch(args)
    reply = daemon_request({"op": "status", "limit": STATUS_SHOWN}, args.socket)
    segments = reply["segments"]
    if args.detail:  # every segment, a page at a time: any number fits
        segments = []
        offset: int | None = 0
        while offset is not None:
            page = daemon_request({"op": "status", "offset": offset}, args.socket)
            segments += page["segments"]
            offset = page.get("next_offset")
        reply["segments"], reply["next_offset"] = segments, None
    if args.json:
        print(json.dumps(reply, indent=2))
        return 0
    shm = reply["shm"]
    counts = reply.get("counts", {})
    print(
        f"daemon pid {reply['pid']} on {reply['socket']}; /dev/shm: {human(shm['available'])} free "
        f"of {human(shm['total'])}"
    )
    total = counts.get("segments", len(segments))
    print(
        f"{total} segment(s), {human(shm.get('used', 0))}; {counts.get('loading', 0)} loading, "
        f"{counts.get('held', 0)} held for ranks, {counts.get('released', 0)} released but still mapped"
    )
    if shm.get("limit"):
        print(
            f"limit {human(shm['limit'])} ({shm.get('limit_from', '--shm-limit')}): "
            f"{human(shm.get('used', 0))} used by its segments"
        )
    for failed in reply.get("failed", []):
        print(f"{failed['path']}\n  held, not loaded: {failed['message']}")
    for cache in reply.get("decoded_caches", []):
        print(
            f"decoded cache {cache['id'][:12]}: {cache['ready']} of {cache['records']} records ready, "
            f"{cache['held']} of {cache['chunks']} chunks held ({human(cache['bytes'])})\n"
            f"  hits {cache['hits']}  fills {cache['fills']}  waits {cache['waits']}  uncached "
            f"{cache['uncached']}  evicted {cache['evictions']}  reset {cache['resets']}\n"
            f"  clients {len(cache['clients'])}: {_client_pids(cache['clients'])}"
        )
    for seg in segments:
        if seg["segment"].startswith("memfd:smstore-cache-"):
            continue  # a decoded cache's part: its cache says it above
        loaded = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seg["loaded_at"]))
        how = "adopted" if seg["adopted"] else f"in {seg['load_seconds']:.2f} s"
        print(f"{', '.join(seg['paths']) or '(unlinked file)'}")
        print(f"  checksum xxh64:{seg['checksum']}  size {human(seg['size'])}  records {seg['records']}")
        print(f"  segment {seg['segment']}  loaded {loaded} ({how})")
        print(f"  clients {len(seg['clients'])}: {_client_pids(seg['clients'])}")
    if len(segments) < total:
        print(f"... and {total - len(segments)} more segment(s): 'smstore status --detail' lists them all")
    for path in reply["loading"]:
        print(f"{path}\n  loading...")
    if not total and not reply["loading"]:
        print("no blobs loaded")
    print("metrics" + (f" (served at {reply['metrics_url']})" if reply.get("metrics_url") else "") + ":")
    for line in _metrics_lines(reply):
        print(f"  {line}")
    return 0


def _blob_files(path: str) -> list[tuple[str, str | None]]:
    """The blobs behind `path` (itself, or the shards of a sharded dataset, in order) as the
    daemon is told of them: absolute paths, or objects' URLs; with the checksum its manifest
    records for a shard in object storage (the daemon refuses an object holding another)."""
    from smstore.format.manifest import absolute, is_manifest, read_manifest

    if not is_manifest(path):
        return [(absolute(path), None)]
    return [(src.location, src.checksum if src.remote else None) for src in read_manifest(path).sources]


def cmd_load(args: argparse.Namespace) -> int:
    from smstore.wire.client import daemon_request

    status = 0
    for path in args.files:
        try:
            shards = _blob_files(path)
            total = 0
            for blob, checksum in shards:
                message = {"op": "load", "path": blob}
                if checksum is not None:
                    message["checksum"] = checksum
                reply = daemon_request(message, args.socket, timeout=None)
                total += reply["size"]
                if len(shards) == 1:
                    print(
                        f"{path}: loaded as {reply['segment']} ({human(reply['size'])}, xxh64:{reply['checksum']})"
                    )
        except StoreError as e:
            print(f"smstore load: {path}: {e}", file=sys.stderr)
            status = 1
            continue
        if len(shards) > 1:
            print(f"{path}: loaded {len(shards)} shards ({human(total)})")
    return status


def cmd_unload(args: argparse.Namespace) -> int:
    from smstore.format.manifest import is_manifest
    from smstore.read.store import read_checksum
    from smstore.wire.client import daemon_request
    from smstore.wire.protocol import checksum_in

    status = 0
    targets: list[tuple[str, str | None]] = []
    for target in args.targets:
        if not is_manifest(target):  # a blob's path or URL, or a checksum: as given
            targets.append((target, None))
            continue
        try:
            targets += _blob_files(target)
        except StoreError as e:
            print(f"smstore unload: {target}: {e}", file=sys.stderr)
            status = 1
    for target, known in targets:
        source = argument_source(target)
        msg: dict[str, Any] = {"op": "unload", "path": source.location}
        checksum = known
        if checksum is None and not source.remote:
            try:
                checksum = read_checksum(target)
            except OSError:
                checksum = checksum_in(target)
        if checksum:
            msg["checksum"] = checksum
        try:
            reply = daemon_request(msg, args.socket)
        except StoreError as e:
            print(f"smstore unload: {target}: {e}", file=sys.stderr)
            status = 1
            continue
        still = reply["clients"]
        note = f"; freed when its {len(still)} client(s) detach" if still else ""
        print(f"{target}: unloaded {reply['segment']}{note}")
    return status


def cmd_stop(args: argparse.Namespace) -> int:
    from smstore.wire.client import daemon_request
    from smstore.wire.ipc import process_start_time

    reply = daemon_request({"op": "stop"}, args.socket)
    pid = int(reply["pid"])
    deadline = time.monotonic() + args.timeout
    while process_start_time(pid) is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    print(f"stopped the smstore daemon (pid {pid})")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from smstore.daemon.segments import collect_garbage

    removed = collect_garbage(args.socket)
    for path in removed:
        print(f"removed {path}")
    if not removed:
        print("nothing to remove")
    return 0


def _positive_seconds(text: str) -> float:
    """A positive, finite number of seconds; ArgumentTypeError otherwise."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):  # also refuses nan
        msg = f"{text!r} is not a positive number of seconds"
        raise argparse.ArgumentTypeError(msg)
    return value


def cmd_doctor(args: argparse.Namespace) -> int:
    from smstore.cli.health import DOCTOR_TIMEOUT, doctor

    if args.max_connections is not None and args.max_connections < 1:
        print("smstore doctor: --max-connections must be at least 1", file=sys.stderr)
        return 2
    checks = doctor(
        args.datasets,
        args.socket,
        max_connections=args.max_connections,
        timeout=args.timeout or DOCTOR_TIMEOUT,
    )
    for check in checks:
        print(check.line())
    failed = sum(c.status == "fail" for c in checks)
    warned = sum(c.status == "warn" for c in checks)
    print(f"{failed} failed, {warned} warning(s), {len(checks) - failed - warned} ok")
    return 1 if failed else 0


def cmd_wait(args: argparse.Namespace) -> int:
    from smstore.cli.health import wait_served
    from smstore.wire.ipc import socket_path

    start = time.monotonic()
    blobs = wait_served(args.datasets, socket_path(args.socket), args.timeout)
    print(
        f"{', '.join(args.datasets)}: served ({len(blobs)} blob(s), {human(sum(b.size for b in blobs))}) "
        f"after {time.monotonic() - start:.1f} s"
    )
    return 0


def add_node_commands(sub: Any) -> None:
    """The node commands' parsers, added to the `smstore` command's subparsers."""

    def with_socket(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--socket", help="the daemon's socket (default: $SMSTORE_SOCKET or a per-user path)")
        return p

    p = with_socket(sub.add_parser("serve", help="run the node daemon in the foreground (logs to stderr)"))
    p.add_argument(
        "files",
        nargs="*",
        help="blobs or datasets to load at start (paths, or URLs: s3://bucket/ds/ loads every shard)",
    )
    p.add_argument("--group", help="share the socket and segments (read-only) with this group")
    p.add_argument(
        "--shm-limit",
        metavar="SIZE",
        type=parse_size,
        help="use at most SIZE bytes of /dev/shm (e.g. 64M; default $SMSTORE_SHM_LIMIT or no limit)",
    )
    p.add_argument(
        "--io-timeout",
        metavar="SECONDS",
        type=_seconds,
        help="drop a client that takes longer to send a request or read a reply (default $SMSTORE_IO_TIMEOUT or 5)",
    )
    p.add_argument(
        "--max-read-rate",
        metavar="SIZE",
        type=parse_size,
        help="read blobs at most SIZE bytes a second (e.g. 200M): spare a shared file system",
    )
    p.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="keep shards fetched from object storage in DIR (the node cache; survives restarts); "
        "without it a shard named by URL is fetched straight into shared memory",
    )
    p.add_argument(
        "--cache-limit",
        metavar="SIZE",
        type=parse_size,
        help="the most the node cache may hold (e.g. 100G); least recently used shards go first",
    )
    p.add_argument(
        "--fetch-backoff",
        metavar="SECONDS",
        type=_backoff,
        default=30.0,
        help="a shard whose fetch from object storage failed is fetched again by a hold this many seconds "
        "later (doubled at each failure in a row, up to 600; default 30; 0: at the next hold)",
    )
    p.add_argument(
        "--no-background",
        dest="background",
        action="store_false",
        help="run under the default scheduling policy (default: SCHED_BATCH, so that a request never "
        "preempts the training process that sent it)",
    )
    p.add_argument("--max-connections", type=int, metavar="N", help="connections in all (default 4096)")
    p.add_argument(
        "--max-per-uid",
        type=int,
        metavar="N",
        help="connections per uid other than the owner's (default 256)",
    )
    p.add_argument(
        "--require",
        action="store_true",
        help="exit non-zero, naming the file and the fault, if a file given here fails to load "
        "(default: log the failure and go on serving)",
    )
    p.add_argument(
        "--max-parked",
        type=int,
        metavar="N",
        help="readers' 'held' requests waiting for a change at a time (default 1024, an eighth of them "
        "up to 64 kept for the owner; beyond it a reader asks again every 100 ms; 0: none parked)",
    )
    p.add_argument(
        "--metrics",
        metavar="HOST:PORT",
        help="serve the metrics in the Prometheus text format at http://HOST:PORT/metrics "
        "(host default 127.0.0.1; port 0: any free port, shown by 'smstore status')",
    )
    p.add_argument(
        "--metrics-file",
        metavar="PATH",
        help="write the metrics to PATH (a *.prom file for node_exporter's textfile collector), "
        "replaced whole at most every 5 s",
    )
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=cmd_serve)

    p = with_socket(sub.add_parser("status", help="the daemon's segments, their clients and load times"))
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--detail",
        action="store_true",
        help=f"describe every segment (default: a summary and the first {STATUS_SHOWN})",
    )
    p.add_argument("--watch", action="store_true", help="a live view of the metrics, redrawn until Ctrl-C")
    p.add_argument(
        "--interval",
        type=_positive_seconds,
        default=2.0,
        metavar="SECONDS",
        help="--watch's period (default 2)",
    )
    p.set_defaults(func=cmd_status)

    p = with_socket(
        sub.add_parser("load", help="ask the running daemon to load blobs or datasets (kept until unload)")
    )
    p.add_argument(
        "files", nargs="+", help="blobs or datasets: paths, or URLs (s3://bucket/ds/, s3://bucket/x.smst)"
    )
    p.set_defaults(func=cmd_load)

    p = with_socket(
        sub.add_parser("unload", help="unload blobs (by file or xxh64 checksum); clients keep theirs")
    )
    p.add_argument("targets", nargs="+", metavar="FILE")
    p.set_defaults(func=cmd_unload)

    p = with_socket(sub.add_parser("stop", help="stop the daemon; it removes its segments and socket"))
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for it to exit")
    p.set_defaults(func=cmd_stop)

    p = with_socket(sub.add_parser("gc", help="remove segments and sockets left by daemons that died"))
    p.set_defaults(func=cmd_gc)

    p = with_socket(
        sub.add_parser(
            "doctor",
            help="check this node (/dev/shm, memory limit, open files, socket directory, daemon) and say "
            "how to fix what fails; exit 1 on a failure",
        )
    )
    p.add_argument("datasets", nargs="*", help="blobs or sharded datasets to check the room for")
    p.add_argument(
        "--max-connections",
        type=int,
        metavar="N",
        help="the daemon's --max-connections, for the open-files check (default 4096)",
    )
    p.add_argument(
        "--timeout",
        type=_positive_seconds,
        metavar="SECONDS",
        help="for reading the datasets (object storage included) and asking the daemon, all together "
        "(default 30)",
    )
    p.set_defaults(func=cmd_doctor)

    p = with_socket(
        sub.add_parser(
            "wait",
            help="block until the daemon serves every blob of the datasets (exit 0), or time out (exit 1)",
        )
    )
    p.add_argument("datasets", nargs="+", help="blobs or sharded datasets (every shard must be loaded)")
    p.add_argument("--timeout", type=_positive_seconds, default=300.0, metavar="SECONDS", help="default 300")
    p.set_defaults(func=cmd_wait)
