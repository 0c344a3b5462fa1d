"""What the command groups of the `smstore` command share: what an argument names, sizes read and shown."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from smstore.format.manifest import Source

__all__ = ["argument_source", "human", "parse_size"]


def argument_source(path: str) -> Source:
    """What a command's argument names: an object in object storage (a URL, as it is) or a local
    file (made absolute). Decided here, once, as the argument enters: the commands ask the source."""
    from smstore.format.manifest import source_of  # not at import: `smstore --help` stays light

    return source_of(path)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def parse_size(text: str) -> int:
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
