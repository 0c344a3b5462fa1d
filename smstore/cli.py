"""The `smstore` command line: pack, info, verify, get."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

import smstore
from smstore.errors import StoreError

__all__ = ["main"]


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def cmd_pack(args: argparse.Namespace) -> int:
    user = None
    if args.meta:
        user = {}
        for item in args.meta:
            key, sep, value = item.partition("=")
            if not sep:
                print(f"smstore pack: --meta expects KEY=VALUE, got {item!r}", file=sys.stderr)
                return 2
            user[key] = value
    progress = None if not args.quiet else False
    if args.format == "npy-lines":
        stats = smstore.pack_npy_lines(
            args.inputs,
            args.output,
            dtype=args.dtype or "uint16",
            metadata=user,
            progress=progress,
            durable=not args.no_fsync,
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
            progress=progress,
            durable=not args.no_fsync,
        )
    if not args.quiet:
        rate = stats.input_bytes / stats.seconds / 2**20 if stats.seconds > 0 else float("inf")
        print(
            f"packed {stats.records} records ({_human(stats.data_bytes)}) into {args.output} "
            f"in {stats.seconds:.2f} s ({rate:.0f} MiB/s)",
            file=sys.stderr,
        )
    return 0


def _info(store: smstore.Store) -> dict[str, Any]:
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


def cmd_info(args: argparse.Namespace) -> int:
    with smstore.open(args.store) as store:
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


def cmd_verify(args: argparse.Namespace) -> int:
    status = 0
    for path in args.stores:
        try:
            with smstore.open(path) as store:
                store.verify()
                print(f"{path}: OK ({len(store)} records, xxh64:{store.checksum})")
        except StoreError as e:
            print(f"{path}: FAILED: {e}", file=sys.stderr)
            status = 1
    return status


def cmd_get(args: argparse.Namespace) -> int:
    out = sys.stdout.buffer
    with smstore.open(args.store) as store:
        for index in args.indices:
            out.write(store[index])
            if args.newline:
                out.write(b"\n")
    out.flush()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="smstore", description="A shared-memory sample store for PyTorch training."
    )
    parser.add_argument("--version", action="version", version=f"smstore {smstore.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("pack", help="pack text files into a blob, one record per line")
    p.add_argument("inputs", nargs="+", help="input files, read in order ('-' for stdin)")
    p.add_argument("-o", "--output", required=True, help="the .smst file to write (atomically)")
    p.add_argument(
        "--format",
        choices=["lines", "jsonl", "npy-lines"],
        default="lines",
        help="jsonl validates every line; npy-lines packs each line of integers as one array of --dtype",
    )
    p.add_argument("--dtype", help="npy-lines: the integer dtype of the records (default uint16)")
    p.add_argument("--meta", action="append", metavar="KEY=VALUE", help="user metadata (repeatable)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no summary")
    p.add_argument("--no-fsync", action="store_true", help="skip fsync before publishing the file")
    p.set_defaults(func=cmd_pack)

    p = sub.add_parser("info", help="show a blob's header and metadata")
    p.add_argument("store")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("verify", help="check the checksum over every byte; exit 1 if any store is corrupt")
    p.add_argument("stores", nargs="+")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("get", help="write the raw bytes of records to stdout")
    p.add_argument("store")
    p.add_argument("indices", nargs="+", type=int, help="record indices (negative counts from the end)")
    p.add_argument("-n", "--newline", action="store_true", help="write a newline after each record")
    p.set_defaults(func=cmd_get)
    return parser


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
