"""Pack a sharded dataset on a Ray cluster: one shard per write task, then a manifest.

Ray Data is the engine most teams that prepare training data at scale already run (it reads
Parquet, JSON and images from any file system, and NeMo Curator and Data-Juicer run on it), and
its ``Datasink`` hook hands each write task its blocks: each task writes one smstore shard with
the C++ writer, and the driver joins them into a manifest when every task has finished::

    import ray, smstore
    from smstore.integrations.ray import SmstoreDatasink

    ray.data.DataContext.get_current().execution_options.preserve_order = True  # records in order
    ds = ray.data.read_parquet("s3://bucket/corpus/").filter(lambda r: len(r["text"]) > 10)
    ds.write_datasink(SmstoreDatasink("/nfs/corpus-smst", column="text"))
    smstore.open("/nfs/corpus-smst")  # one global index over the shards

The output directory must be reachable from every node that runs a write task (a shared file
system), as for Ray's own ``write_parquet``. Without ``preserve_order``, the dataset holds the same
records in the order the tasks were numbered.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import Any

from ray.data import Datasink
from ray.data.block import Block, BlockAccessor

from smstore.format.manifest import MANIFEST_NAME, ShardNames, describe_shard, publish_manifest
from smstore.format.objects import encode_objects
from smstore.read.shards import dataset_dir
from smstore.write.pack import Writer

__all__ = ["SmstoreDatasink"]


class SmstoreDatasink(Datasink[tuple[int, str]]):
    """Writes a Ray Dataset as a sharded smstore dataset: one shard per write task.

    Args:
        output: The dataset directory (``manifest.json`` and the shards), on a file system every
            worker node can write.
        column: Records are this column's values (bytes, or str stored as UTF-8, with encoding
            ``bytes``/``lines``); without it, each row (a dict) is one object record.
        encoding: The records' encoding. Default ``lines`` for a str column, ``bytes`` for a
            binary one; ``pickle`` (or ``json``) for rows as objects.
        metadata: Your own JSON-serializable metadata, stored in the manifest under ``"user"``.
        durable: fsync every shard and the manifest.
    """

    def __init__(
        self,
        output: str | os.PathLike[str],
        *,
        column: str | None = None,
        encoding: str | None = None,
        metadata: dict[str, Any] | None = None,
        durable: bool = True,
    ) -> None:
        self.output = os.path.abspath(os.fspath(output))
        self.column = column
        self.encoding = encoding
        self.metadata = metadata
        self.durable = durable
        self._names: ShardNames | None = None
        self._written: list[str] = []

    def on_write_start(self, schema: Any = None) -> None:
        self._names = ShardNames(dataset_dir(self.output))  # one run id for every task's shard
        if self.encoding is None:
            if self.column is None:
                self.encoding = "pickle"
            else:
                import pyarrow as pa

                kind = schema.field(self.column).type if schema is not None else None
                self.encoding = (
                    "lines"
                    if kind is not None and (pa.types.is_string(kind) or pa.types.is_large_string(kind))
                    else "bytes"
                )

    def _records(self, blocks: Iterable[Block]) -> Iterator[Any]:
        for block in blocks:
            acc = BlockAccessor.for_block(block)
            if self.column is not None:
                yield from acc.to_arrow().column(self.column).to_pylist()
            else:
                assert self.encoding is not None
                yield from encode_objects(acc.iter_rows(public_row_format=True), self.encoding)

    def write(self, blocks: Iterable[Block], ctx: Any) -> tuple[int, str]:
        assert self._names is not None
        assert self.encoding is not None
        path = self._names.name(ctx.task_idx)
        with Writer(path, encoding=self.encoding, durable=self.durable) as w:
            for record in self._records(blocks):
                if record is None:
                    msg = f"{path}: row {w.record_count} of task {ctx.task_idx} has no {self.column!r} value"
                    raise ValueError(msg)
                w.append(record)
        return ctx.task_idx, path

    def on_write_complete(self, write_result: Any) -> None:
        done = sorted(write_result.write_returns)
        self._written = [p for _, p in done]
        shards = [describe_shard(p, stored_path=os.path.basename(p))[0] for p in self._written]
        assert self.encoding is not None
        publish_manifest(
            os.path.join(self.output, MANIFEST_NAME),
            self.encoding,
            shards,
            source=[],
            user=self.metadata,
            durable=self.durable,
        )

    def on_write_failed(self, error: Exception) -> None:  # noqa: ARG002 - Ray's signature
        """Remove the shards of this run (the directory's previous dataset stays whole)."""
        if self._names is None:
            return
        prefix = os.path.basename(self._names.name(0)).rsplit("-", 1)[0] + "-"
        for name in os.listdir(self.output):
            if name.startswith(prefix) and name.endswith(".smst"):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.output, name))

    def get_name(self) -> str:
        return "smstore"
