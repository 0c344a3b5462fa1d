"""The `smstore` command line: pack, info, verify, get; the daemon's serve/status/load/unload/stop/gc; doctor, wait."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import smstore
from smstore.errors import RemoteURLError, StoreError

__all__ = ["main"]


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _user_meta(items: list[str] | None, command: str) -> dict[str, Any] | None:
    """--meta KEY=VALUE items as a dict (None if none); exits with a usage error on a bad one."""
    if not items:
        return None
    user: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"smstore {command}: --meta expects KEY=VALUE, got {item!r}", file=sys.stderr)
            raise SystemExit(2)
        user[key] = value
    return user


CONVERTERS = ("parquet", "arrow", "hf", "webdataset", "megatron", "json-list")


def _convert(
    args: argparse.Namespace, user: dict[str, Any] | None, progress: bool | None
) -> smstore.PackStats:
    """`pack --format` of one of CONVERTERS: smstore.convert, imported only here."""
    from smstore import convert

    common: dict[str, Any] = {
        "metadata": user,
        "shard_size": args.shard_size,
        "durable": not args.no_fsync,
        "progress": progress,
    }
    one = args.inputs[0]
    if args.format != "webdataset" and len(args.inputs) != 1:
        raise smstore.PackInputError(f"--format {args.format} converts one source; got {len(args.inputs)}")
    if args.format in ("parquet", "arrow", "hf"):
        return convert.convert_arrow(one, args.output, column=args.column, encoding=args.objects, **common)
    if args.format == "webdataset":
        return convert.convert_webdataset(args.inputs, args.output, **common)
    if args.format == "megatron":
        return convert.convert_megatron(one, args.output, **common)
    return convert.convert_json_list(
        one, args.output, key=args.key, encoding=args.objects or "pickle", **common
    )


def _check_upload_url(url: Any) -> None:
    if url.scheme != "s3":
        raise RemoteURLError(
            f"{url}: pack and join upload to s3:// only (gs://, az:// and https:// are read-only)"
        )


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt while uploading, so a multipart upload is aborted, not left behind."""

    def interrupt(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _pack_then_upload(args: argparse.Namespace) -> int:
    """`pack -o s3://...`: pack into a private temp directory (under $TMPDIR), then upload, manifest last.

    The temp directory needs room for the whole packed output; it is removed however the command ends.
    """
    from smstore.remote import parse_url, publish_remote_dataset, upload

    url = args.output
    sharded = url.endswith("/") or args.jobs > 1 or args.shard_size is not None
    _check_upload_url(parse_url(url, prefix=sharded))  # a bad URL fails before anything is packed
    with _terminate_as_interrupt(), tempfile.TemporaryDirectory(prefix="smstore-pack-") as tmp:
        args.output = os.path.join(tmp, "ds") + "/" if sharded else os.path.join(tmp, "blob.smst")
        status = cmd_pack(args)
        if status != 0:
            return status
        if sharded:
            where = publish_remote_dataset(args.output, url)
        else:
            upload(args.output, url)
            where = url
    if not args.quiet:
        print(f"uploaded to {where}", file=sys.stderr)
    return 0


def cmd_pack(args: argparse.Namespace) -> int:
    if _remote(args.output):
        return _pack_then_upload(args)
    user = _user_meta(args.meta, "pack")
    if args.jobs < 1:
        print(f"smstore pack: --jobs must be at least 1, not {args.jobs}", file=sys.stderr)
        return 2
    if args.shard_size == 0:
        print("smstore pack: --shard-size must be positive", file=sys.stderr)
        return 2
    progress = None if not args.quiet else False
    if args.format in CONVERTERS:
        if args.jobs != 1:
            print(
                f"smstore pack: --format {args.format} packs with one job (use --shard-size for shards)",
                file=sys.stderr,
            )
            return 2
        stats = _convert(args, user, progress)
    elif args.column or args.key or args.objects:
        print("smstore pack: --column, --key and --objects apply to converted formats only", file=sys.stderr)
        return 2
    elif args.format == "npy-lines":
        stats = smstore.pack_npy_lines(
            args.inputs,
            args.output,
            dtype=args.dtype or "uint16",
            metadata=user,
            max_line_bytes=args.max_line_bytes,
            progress=progress,
            durable=not args.no_fsync,
            jobs=args.jobs,
            shard_size=args.shard_size,
        )
    elif args.dtype is not None:
        print("smstore pack: --dtype applies to --format npy-lines only", file=sys.stderr)
        return 2
    else:
        stats = smstore.pack_files(
            args.inputs,
            args.output,
            format=args.format,
            metadata=user,
            max_line_bytes=args.max_line_bytes,
            progress=progress,
            durable=not args.no_fsync,
            jobs=args.jobs,
            shard_size=args.shard_size,
        )
    if not args.quiet:
        rate = stats.input_bytes / stats.seconds / 2**20 if stats.seconds > 0 else float("inf")
        into = f"{args.output} ({stats.shards} shards)" if stats.shards > 1 else args.output
        print(
            f"packed {stats.records} records ({_human(stats.data_bytes)}) into {into} "
            f"in {stats.seconds:.2f} s ({rate:.0f} MiB/s)",
            file=sys.stderr,
        )
    return 0


def _manifest_info(m: Any) -> dict[str, Any]:
    """What info says of a sharded dataset: its manifest's summary."""
    return {
        "path": m.path,
        "records": m.records,
        "shards": len(m.shards),
        "data_bytes": m.data_bytes,
        "file_bytes": sum(s.file_size for s in m.shards),
        "checksum": f"manifest:{m.checksum}",
        "encoding": m.encoding,
        "created": m.meta.get("created"),
        "source": m.meta.get("source"),
        "user": m.meta.get("user", {}),
    }


def _info(store: Any) -> dict[str, Any]:
    if isinstance(store, smstore.ShardedStore):
        return _manifest_info(store.manifest)
    meta = store.metadata
    return {
        "path": store.path,
        "format_version": store.format_version,
        "records": len(store),
        "data_bytes": store.nbytes,
        "file_bytes": store.file_size,
        "checksum": f"xxh64:{store.checksum}",
        "encoding": meta.get("encoding"),
        "created": meta.get("created"),
        "source": meta.get("source"),
        "user": meta.get("user", {}),
    }


def _remote_info(url: str) -> dict[str, Any]:
    """info of a dataset in object storage (its manifest), or of one blob there (its header only)."""
    from smstore._manifest import RemoteObject, is_manifest, read_manifest

    if is_manifest(url):
        return _manifest_info(read_manifest(url))
    header = RemoteObject(url).header()
    return {
        "path": url,
        "format_version": header.version,
        "records": header.record_count,
        "data_bytes": header.data_size,
        "file_bytes": header.file_size,
        "checksum": f"xxh64:{header.checksum}",
    }


def _inspect(path: str) -> Any:
    """`path` opened to look at, never to decode: what info, verify and get read (nothing unpickled)."""
    return smstore.open(path, raw=True)


def _remote(path: str) -> bool:
    """Whether the command's argument names object storage: decided here, once, as it enters."""
    from smstore._manifest import source_of

    return source_of(path).remote


def cmd_info(args: argparse.Namespace) -> int:
    if _remote(args.store):
        info = _remote_info(args.store)
    else:
        with _inspect(args.store) as store:
            info = _info(store)
    if args.json:
        print(json.dumps(info, indent=2, ensure_ascii=False))
        return 0
    width = max(len(k) for k in info)
    for key, value in info.items():
        if key in ("data_bytes", "file_bytes"):
            value = f"{value} ({_human(value)})"
        elif key == "source":
            value = ", ".join(value or []) or "-"
        elif key == "user":
            if not value:
                continue
            value = json.dumps(value, ensure_ascii=False)
        print(f"{key:<{width}}  {value}")
    return 0


def _verify_remote(url: str) -> int:
    """Stream every shard of the dataset at `url` (or the one blob there) through its checksum,
    keeping none of it; each bad one is named. The exit status: 1 if any is bad."""
    from smstore._manifest import RemoteObject, is_manifest, read_manifest
    from smstore.remote.fetch import verify_object

    if not is_manifest(url):
        header = RemoteObject(url).header()
        verify_object(url, size=header.file_size, checksum=header.checksum)
        print(f"{url}: OK ({header.record_count} records, xxh64:{header.checksum})")
        return 0
    m = read_manifest(url)
    bad = 0
    for k, shard in enumerate(m.shards):
        try:
            verify_object(m.shard_path(k), size=shard.file_size, checksum=shard.checksum)
        except StoreError as e:
            print(f"{url}: shard {k} FAILED: {e}", file=sys.stderr)
            bad += 1
    if bad:
        print(f"{url}: FAILED: {bad} of {len(m.shards)} shards do not match the manifest", file=sys.stderr)
        return 1
    print(f"{url}: OK ({m.records} records in {len(m.shards)} shards, all checksums match)")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    status = 0
    for path in args.stores:
        try:
            if _remote(path):
                status = max(status, _verify_remote(path))
                continue
            with _inspect(path) as store:
                store.verify()
                if isinstance(store, smstore.ShardedStore):
                    print(
                        f"{path}: OK ({len(store)} records in {store.shard_count} shards, all checksums match)"
                    )
                else:
                    print(f"{path}: OK ({len(store)} records, xxh64:{store.checksum})")
        except StoreError as e:
            print(f"{path}: FAILED: {e}", file=sys.stderr)
            status = 1
    return status


def _join_then_upload(args: argparse.Namespace, user: dict[str, Any] | None) -> int:
    """`join -o s3://prefix/`: upload every shard under the prefix, then a manifest naming them there.

    The shards are linked (not copied) into a temp directory, so the manifest names them beside it.
    """
    from smstore._shards import shard_files
    from smstore.remote import parse_url, publish_remote_dataset

    prefix = parse_url(args.output, prefix=True)  # a bad URL fails before anything is read
    _check_upload_url(prefix)
    with _terminate_as_interrupt(), tempfile.TemporaryDirectory(prefix="smstore-join-") as tmp:
        links: list[str] = []
        for item in args.inputs:
            for path in shard_files(item):
                link = os.path.join(tmp, f"{len(links):05d}-{os.path.basename(path)}")
                os.symlink(os.path.abspath(path), link)
                links.append(link)
        manifest = smstore.join(links, tmp + "/", metadata=user, verify=args.verify)
        where = publish_remote_dataset(tmp, prefix)
    print(
        f"joined {len(manifest.shards)} shards ({manifest.records} records, {_human(manifest.data_bytes)}) "
        f"into {where}",
        file=sys.stderr,
    )
    return 0


def cmd_join(args: argparse.Namespace) -> int:
    user = _user_meta(args.meta, "join")
    if _remote(args.output):
        return _join_then_upload(args, user)
    manifest = smstore.join(args.inputs, args.output, metadata=user, verify=args.verify)
    print(
        f"joined {len(manifest.shards)} shards ({manifest.records} records, {_human(manifest.data_bytes)}) "
        f"into {manifest.path}",
        file=sys.stderr,
    )
    return 0


def _decoder(encoding: str, unpickle: bool) -> Callable[[memoryview], bytes] | str:
    """`get --decode`'s record -> output line, or why it refuses the encoding."""
    from smstore._objects import OBJECT_ENCODINGS, object_decoder

    decode = object_decoder(encoding)
    if decode is None:
        kinds = ", ".join(OBJECT_ENCODINGS)
        return f"records are encoded as {encoding!r}, not as objects ({kinds}); drop --decode for their bytes"
    if encoding == "pickle" and not unpickle:
        return (
            "records are pickled, and unpickling runs code from the file: give --unsafe-unpickle "
            "only for a file you trust, or drop --decode for their bytes"
        )
    return lambda view: repr(decode(view)).encode("utf-8", "backslashreplace") + b"\n"


def cmd_get(args: argparse.Namespace) -> int:
    out = sys.stdout.buffer
    with _inspect(args.store) as store:
        decode: Callable[[memoryview], bytes] | None = None  # None: the raw bytes, not copied
        if args.decode or args.unsafe_unpickle:
            chosen = _decoder(store.encoding, args.unsafe_unpickle)
            if isinstance(chosen, str):
                print(f"smstore get: {args.store}: {chosen}", file=sys.stderr)
                return 2
            decode = chosen
        for index in args.indices:
            if decode is None:
                out.write(store[index])
                if args.newline:
                    out.write(b"\n")
            else:
                out.write(decode(store[index]))  # a line already
    out.flush()
    return 0


_EPILOG = """\
formats of 'smstore pack --format' (one record per...):
  lines                 line of a text file (the default; every byte but the final newline)
  jsonl                 line, each checked to be JSON
  npy-lines             line of integers, stored as one array of --dtype (token ids)
  parquet, arrow, hf    value of --column (or row, as an object) of a Parquet or Arrow file,
                        a directory of them, or a Hugging Face save_to_disk folder
  webdataset            sample of WebDataset tar shards
  megatron              document of a Megatron-LM indexed dataset (PREFIX of .bin/.idx)
  json-list             object of a JSON list (--key K: the list under key K, e.g. of a COCO file)

examples:
  smstore pack corpus.txt -o corpus.smst
  smstore pack big/*.txt -o corpus/ -j 8 --shard-size 1G      a sharded dataset, 8 shards at once
  smstore pack --format parquet --column text data.parquet -o data.smst
  smstore pack --format json-list --key images instances_train2017.json -o images.smst
  smstore info corpus.smst ; smstore verify corpus/ ; smstore get corpus.smst 17
  smstore serve corpus.smst &  smstore status ; smstore stop  the node daemon
  smstore doctor corpus/ ; smstore wait corpus/ --timeout 600   check a node; wait until served

'smstore COMMAND --help' tells more; so do README.md and docs/ (convert.md, packing.md,
daemon.md, operations.md) of the smstore sources.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="smstore",
        description="A shared-memory sample store for PyTorch training.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"smstore {smstore.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "pack",
        help="pack text, JSON lines, token arrays or a converted format (below) into a blob",
        epilog=_EPILOG[: _EPILOG.index("examples:")],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("inputs", nargs="+", help="input files, read in order ('-' for stdin)")
    p.add_argument(
        "-o",
        "--output",
        required=True,
        help="the .smst file to write (atomically); a dataset directory (manifest.json and shards) "
        "with -j or --shard-size, or when it is an existing directory or ends with '/'; an s3:// URL packs "
        "into a temp directory under $TMPDIR (room for the whole output), then uploads, manifest last",
    )
    p.add_argument(
        "-j",
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="pack N shards at once (writes a sharded dataset)",
    )
    p.add_argument(
        "--shard-size",
        type=_size,
        metavar="SIZE",
        help="split the input into shards of about SIZE bytes, cut at line ends (e.g. 256M, 1G)",
    )
    p.add_argument(
        "--format",
        choices=["lines", "jsonl", "npy-lines", *CONVERTERS],
        default="lines",
        help="jsonl validates every line; npy-lines packs each line of integers as one array of --dtype; "
        "parquet/arrow/hf (a file, folder or save_to_disk folder), webdataset (tar shards), megatron "
        "(PREFIX of .bin/.idx) and json-list (a JSON list of objects) convert (docs/convert.md)",
    )
    p.add_argument(
        "--column", help="parquet/arrow/hf: the column whose values are the records (default: whole rows)"
    )
    p.add_argument("--key", help="json-list: the top-level key holding the list (e.g. images in a COCO file)")
    p.add_argument(
        "--objects", choices=["pickle", "json"], help="how rows and JSON objects are stored (default pickle)"
    )
    p.add_argument("--dtype", help="npy-lines: the integer dtype of the records (default uint16)")
    p.add_argument(
        "--max-line-bytes",
        type=_size,
        default=smstore._core.DEFAULT_MAX_LINE_BYTES,
        metavar="SIZE",
        help="jsonl and npy-lines parse each line whole: refuse a longer one (default 1G)",
    )
    p.add_argument("--meta", action="append", metavar="KEY=VALUE", help="user metadata (repeatable)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no summary")
    p.add_argument("--no-fsync", action="store_true", help="skip fsync before publishing the file")
    p.set_defaults(func=cmd_pack)

    p = sub.add_parser(
        "info",
        help="show a blob's (or a sharded dataset's) header and metadata; a URL (s3://bucket/ds/): its "
        "manifest, or a blob's header (one ranged GET)",
    )
    p.add_argument("store")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser(
        "verify",
        help="check the checksum over every byte; exit 1 if any store is corrupt (a URL: every shard "
        "streamed through its checksum, none kept)",
    )
    p.add_argument("stores", nargs="+")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("join", help="write a manifest over existing shards (copies no record)")
    p.add_argument(
        "inputs", nargs="+", help="shards (.smst blobs), manifests or dataset directories, in order"
    )
    p.add_argument(
        "-o",
        "--output",
        required=True,
        help="the manifest to write: a file, or a directory (existing, or ending with '/') for its "
        "manifest.json; join never removes a file; an s3:// prefix uploads the shards, then the manifest",
    )
    p.add_argument("--verify", action="store_true", help="check every shard's checksum over every byte first")
    p.add_argument("--meta", action="append", metavar="KEY=VALUE", help="user metadata (repeatable)")
    p.set_defaults(func=cmd_join)

    p = sub.add_parser("get", help="write the raw bytes of records to stdout (never decoded by default)")
    p.add_argument("store")
    p.add_argument("indices", nargs="+", type=int, help="record indices (negative counts from the end)")
    p.add_argument("-n", "--newline", action="store_true", help="write a newline after each record")
    p.add_argument(
        "--decode",
        action="store_true",
        help="write each object record (json, wds) as one line: the repr() of the object it holds; "
        "refuses pickle records (see --unsafe-unpickle)",
    )
    p.add_argument(
        "--unsafe-unpickle",
        action="store_true",
        help="--decode pickle records too. UNPICKLING RUNS ANY CODE THE FILE HOLDS: only for files you trust",
    )
    p.set_defaults(func=cmd_get)
    _add_daemon_commands(sub)
    return parser


# ---- the node daemon (docs/daemon.md) --------------------------------------------------------


def _size(text: str) -> int:
    """A byte count such as 4096, 64M, 1.5GiB; ArgumentTypeError (a usage error) otherwise."""
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    value = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = 1
    if value and value[-1] in units:
        value, scale = value[:-1], units[value[-1]]
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not (0 <= number * scale < 2**63):  # also refuses nan and inf
        msg = f"{text!r} is not a size (bytes, or with a unit: 64M, 2G)"
        raise argparse.ArgumentTypeError(msg)
    return int(number * scale)


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
    shm_limit = args.shm_limit if args.shm_limit is not None else _from_env("SMSTORE_SHM_LIMIT", _size)
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
    budget = f"{_human(m.get('shm_used_bytes', 0))} of {_human(limit)}" if limit else "no limit"
    return [
        (
            f"resident: {m.get('segments', 0)} segment(s), {_human(m.get('resident_bytes', 0))}; "
            f"budget {budget}; /dev/shm free {_human(m.get('shm_available_bytes', 0))}"
        ),
        (
            f"loads: {sum(loads.values())} ({by('loads')}), {_human(m.get('load_bytes', 0))} in "
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
    from smstore.client import daemon_request

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
    from smstore.client import daemon_request

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
        f"daemon pid {reply['pid']} on {reply['socket']}; /dev/shm: {_human(shm['available'])} free "
        f"of {_human(shm['total'])}"
    )
    total = counts.get("segments", len(segments))
    print(
        f"{total} segment(s), {_human(shm.get('used', 0))}; {counts.get('loading', 0)} loading, "
        f"{counts.get('held', 0)} held for ranks, {counts.get('released', 0)} released but still mapped"
    )
    if shm.get("limit"):
        print(
            f"limit {_human(shm['limit'])} ({shm.get('limit_from', '--shm-limit')}): "
            f"{_human(shm.get('used', 0))} used by its segments"
        )
    for failed in reply.get("failed", []):
        print(f"{failed['path']}\n  held, not loaded: {failed['message']}")
    for seg in segments:
        loaded = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seg["loaded_at"]))
        how = "adopted" if seg["adopted"] else f"in {seg['load_seconds']:.2f} s"
        print(f"{', '.join(seg['paths']) or '(unlinked file)'}")
        print(f"  checksum xxh64:{seg['checksum']}  size {_human(seg['size'])}  records {seg['records']}")
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
    from smstore._manifest import absolute, is_manifest, read_manifest

    if not is_manifest(path):
        return [(absolute(path), None)]
    return [(src.location, src.checksum if src.remote else None) for src in read_manifest(path).sources]


def cmd_load(args: argparse.Namespace) -> int:
    from smstore.client import daemon_request

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
                        f"{path}: loaded as {reply['segment']} ({_human(reply['size'])}, xxh64:{reply['checksum']})"
                    )
        except StoreError as e:
            print(f"smstore load: {path}: {e}", file=sys.stderr)
            status = 1
            continue
        if len(shards) > 1:
            print(f"{path}: loaded {len(shards)} shards ({_human(total)})")
    return status


def cmd_unload(args: argparse.Namespace) -> int:
    from smstore._manifest import is_manifest, source_of
    from smstore._protocol import checksum_in
    from smstore._store import read_checksum
    from smstore.client import daemon_request

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
        source = source_of(target)
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
    from smstore._ipc import process_start_time
    from smstore.client import daemon_request

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
    from smstore._health import DOCTOR_TIMEOUT, doctor

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
    from smstore._health import wait_served
    from smstore._ipc import socket_path

    start = time.monotonic()
    blobs = wait_served(args.datasets, socket_path(args.socket), args.timeout)
    print(
        f"{', '.join(args.datasets)}: served ({len(blobs)} blob(s), {_human(sum(b.size for b in blobs))}) "
        f"after {time.monotonic() - start:.1f} s"
    )
    return 0


def _add_daemon_commands(sub: Any) -> None:
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
        type=_size,
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
        type=_size,
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
        type=_size,
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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except StoreError as e:
        print(f"smstore {args.command}: error: {e}", file=sys.stderr)
        return 1
    except IndexError as e:
        print(f"smstore {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"smstore {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
