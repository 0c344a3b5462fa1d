"""The node daemon (`smstore serve`) and its segment bookkeeping (`smstore gc`): never imported by a reader.

The package stays light: importing ``smstore.daemon.segments`` (for `list_segments` and
`collect_garbage`) runs no server code; `serve`, `Daemon` and `Limits` load on first use.

- `server`: lifecycle, the segment table, the dispatch of requests, `status`, `serve`
- `serving`: what is done with the segments for clients (loads, attach, detach, share, unload, holds)
- `planner`: residency (holds of pieces: whole shards and record ranges alike, releases, unclaimed
  segments, the one failures table) and the one --shm-limit budget
- `sources`: where a shard's bytes come from (a local file or an object), decided once
- `loader`: the loader thread and its one queue (loads pieces into segments, frees released ones)
- `connections`: accepting, framing, backpressure and timeouts of client connections
- `segments`: segment names, listing, lock, the segment table, adoption, `gc`
- `state`: the state file a successor adopts segments from
- `metrics`: the metrics' table, their Prometheus text and the exporter (HTTP, textfile)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from smstore.daemon.connections import Limits
    from smstore.daemon.metrics import parse_address
    from smstore.daemon.server import Daemon, serve

__all__ = ["Daemon", "Limits", "parse_address", "serve"]

_LAZY = {
    "Daemon": "smstore.daemon.server",
    "Limits": "smstore.daemon.connections",
    "parse_address": "smstore.daemon.metrics",
    "serve": "smstore.daemon.server",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    msg = f"module 'smstore.daemon' has no attribute {name!r}"
    raise AttributeError(msg)
