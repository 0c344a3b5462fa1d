"""The `smstore` command line: pack, info, verify, get; the daemon's serve/status/load/unload/stop/gc; doctor, wait."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import smstore
from smstore.cli.data import EPILOG, add_data_commands
from smstore.cli.node import add_node_commands
from smstore.errors import StoreError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="smstore",
        description="A shared-memory sample store for PyTorch training.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"smstore {smstore.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_data_commands(sub)
    add_node_commands(sub)
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
