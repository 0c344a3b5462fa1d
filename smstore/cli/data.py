"""The `smstore` commands on data: pack, info, verify, join, get (of files, datasets and URLs)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import smstore
from smstore.cli.common import argument_source, human, parse_size
from smstore.errors import RemoteURLError, StoreError

__all__ = ["EPILOG", "add_data_commands"]


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
            f"packed {stats.records} records ({human(stats.data_bytes)}) into {into} "
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
    from smstore.format.manifest import RemoteObject, is_manifest, read_manifest

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
    return argument_source(path).remote


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
            value = f"{value} ({human(value)})"
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
    from smstore.format.manifest import RemoteObject, is_manifest, read_manifest
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
    from smstore.read.shards import shard_files
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
        f"joined {len(manifest.shards)} shards ({manifest.records} records, {human(manifest.data_bytes)}) "
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
        f"joined {len(manifest.shards)} shards ({manifest.records} records, {human(manifest.data_bytes)}) "
        f"into {manifest.path}",
        file=sys.stderr,
    )
    return 0


def _decoder(encoding: str, unpickle: bool) -> Callable[[memoryview], bytes] | str:
    """`get --decode`'s record -> output line, or why it refuses the encoding."""
    from smstore.format.objects import OBJECT_ENCODINGS, object_decoder

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


EPILOG = """\
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


def add_data_commands(sub: Any) -> None:
    """The data commands' parsers, added to the `smstore` command's subparsers."""
    p = sub.add_parser(
        "pack",
        help="pack text, JSON lines, token arrays or a converted format (below) into a blob",
        epilog=EPILOG[: EPILOG.index("examples:")],
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
        type=parse_size,
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
        type=parse_size,
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
