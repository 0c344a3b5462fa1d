"""The one write path of every converter: a blob or a sharded dataset, with a progress bar."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from smstore.errors import PackInputError
from smstore.read.shards import ShardedWriter
from smstore.write.pack import PackStats, Writer, byte_bar, dataset_output

__all__ = ["Spans", "write_records"]


class Progress:
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
    """Many records at once: ``data[offsets[i]:offsets[i+1]]`` (an Arrow binary or string array).

    `where` names the input they came from (``"in.parquet: record batch 3"``): a fault the writer
    finds in them (offsets out of order or beyond the data) is reported there, not at the output.
    """

    __slots__ = ("data", "offsets", "where")

    def __init__(self, data: Any, offsets: Any, where: str = "") -> None:
        self.data = data
        self.offsets = offsets
        self.where = where


def _without_output(message: str) -> str:
    """The writer's ``"<output>: offsets[i:j] ..."`` without the output's name."""
    at = message.rfind(": offsets[")
    return message[at + 2 :] if at >= 0 else message


def _write(w: Writer | ShardedWriter, records: Iterable[Any]) -> None:
    """Runs of records in one ``extend`` call each, Spans in one ``extend_offsets`` call each.

    A run is handed over lazily, not gathered in a list here: 1,024 large samples in a list could
    exhaust memory, and ``ShardedWriter.extend`` bounds what it holds at once by bytes.
    """
    it = iter(records)
    met: list[Spans] = []

    def run(first: Any) -> Iterator[Any]:
        """`first` and the records after it, up to the next Spans (left in `met`)."""
        yield first
        for r in it:
            if isinstance(r, Spans):
                met.append(r)
                return
            yield r

    for r in it:
        if not isinstance(r, Spans):
            w.extend(run(r))
            if not met:
                continue  # `it` is exhausted
            r = met.pop()
        try:
            w.extend_offsets(r.data, r.offsets)
        except PackInputError as e:
            if not r.where:
                raise
            # The writer names its output; the fault lies in the input.
            raise PackInputError(f"{r.where}: {_without_output(str(e))}") from None


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
    bar: Progress,
) -> PackStats:
    """Stream `records` into `output` (a blob; a dataset directory with `shard_size` or as
    :func:`smstore.write.pack.dataset_output` says); atomic either way.

    `bar` is the progress bar the records generator updates; it is closed here, however this ends.
    """
    try:
        start = time.perf_counter()
        sources = [os.path.abspath(s) for s in source]
        if shard_size is not None or dataset_output(output):
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
