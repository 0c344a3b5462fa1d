"""The one write path of every converter: a blob or a sharded dataset, with a progress bar."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

from smstore._pack import PackStats, Writer, byte_bar
from smstore._shards import ShardedWriter

__all__ = ["Spans", "write_records"]


class _Progress:
    """A tqdm bar over source bytes on a terminal (``update`` takes bytes consumed so far)."""

    def __init__(self, total: int | None, enabled: bool | None, desc: str) -> None:
        if enabled is None:
            enabled = sys.stderr.isatty()
        self.bar: Any = None
        if enabled:
            self.bar = byte_bar(total, desc)

    def update(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(done - self.bar.n)

    def finish(self) -> None:
        """Show the whole source read (a reader that reports progress in steps may stop short of its end)."""
        if self.bar is not None and self.bar.total is not None:
            self.update(self.bar.total)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Spans:
    """Many records at once: ``data[offsets[i]:offsets[i+1]]`` (an Arrow binary or string array)."""

    __slots__ = ("data", "offsets")

    def __init__(self, data: Any, offsets: Any) -> None:
        self.data = data
        self.offsets = offsets


def _write(w: Writer | ShardedWriter, records: Iterable[Any]) -> None:
    """Records one by one, and Spans in one call each."""
    pending: list[Any] = []
    for r in records:
        if isinstance(r, Spans):
            if pending:
                w.extend(pending)
                pending = []
            w.extend_offsets(r.data, r.offsets)
        else:
            pending.append(r)
            if len(pending) >= 1024:
                w.extend(pending)
                pending = []
    if pending:
        w.extend(pending)


def write_records(
    records: Iterable[Any],
    output: str | os.PathLike[str],
    *,
    encoding: str,
    source: Sequence[str],
    metadata: dict[str, Any] | None,
    durable: bool,
    shard_size: int | None,
    input_bytes: int,
    bar: _Progress,
) -> PackStats:
    """Stream `records` into `output` (a blob; with `shard_size`, a dataset directory); atomic either way.

    `bar` is the progress bar the records generator updates; it is closed here, however this ends.
    """
    try:
        start = time.perf_counter()
        sources = [os.path.abspath(s) for s in source]
        if shard_size is not None:
            with ShardedWriter(
                output,
                encoding=encoding,
                metadata=metadata,
                source=sources,
                shard_size=shard_size,
                durable=durable,
            ) as sw:
                _write(sw, records)
            m = sw.close()
            bar.finish()
            return PackStats(m.records, input_bytes, m.data_bytes, time.perf_counter() - start, len(m.shards))
        with Writer(output, encoding=encoding, metadata=metadata, source=sources, durable=durable) as w:
            _write(w, records)
            n, size = w.record_count, w.data_size
        bar.finish()
        return PackStats(n, input_bytes, size, time.perf_counter() - start)
    finally:
        bar.close()
