"""Packing text files with the C++ streaming packers: pack_files(), into one blob or a sharded dataset.

A sharded output is cut into parts at line ends (:func:`plan_parts`) and packed by threads, the
packers running without the GIL; the records are those of a one-file pack, in order.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import stat
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO

from smstore import _core
from smstore.errors import PackInputError, StoreIOError, StoreNotFoundError
from smstore.format.manifest import MANIFEST_NAME, Manifest, ShardNames, describe_shard, publish_manifest
from smstore.read.shards import dataset_dir
from smstore.write.pack import PackStats, build_metadata, byte_bar, check_output, dataset_output

__all__ = ["PackRun", "Part", "pack_files", "pack_parts", "pack_text_inputs", "plan_parts"]

# run(writer, inputs, progress_callback) -> bytes read: one C++ pack loop over paths or parts.
PackRun = Callable[[_core.Writer, list[Any], Callable[[int], None] | None], int]


def pack_files(
    inputs: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    format: str = "lines",
    metadata: dict[str, Any] | None = None,
    progress: bool | None = None,
    durable: bool = True,
    max_line_bytes: int = _core.DEFAULT_MAX_LINE_BYTES,
    jobs: int = 1,
    shard_size: int | None = None,
) -> PackStats:
    """Pack text files (``-`` for stdin), one record per line, with the C++ streaming packer.

    Args:
        inputs: Files read in order; their records are concatenated.
        output: The ``.smst`` file to write (atomically); with ``jobs`` or ``shard_size``, or
            when it is an existing directory or ends with ``/``, the directory of a sharded
            dataset (``manifest.json``, written last, and its shards).
        format: ``lines`` (any bytes) or ``jsonl`` (each line must be one JSON value).
        metadata: Your own JSON-serializable metadata, stored under ``"user"``.
        progress: Show a progress bar; by default only when stderr is a terminal.
        max_line_bytes: ``jsonl`` only: a longer line raises PackInputError (a JSON line is held
            in memory whole to be checked). Default 1 GiB. Plain lines stream at any length.
        jobs: Shards packed at once (threads: the packer runs without the GIL). More than 1
            writes a sharded dataset; without ``shard_size``, one shard per job.
        shard_size: Input bytes per shard (cut at line ends): writes a sharded dataset whose
            records are, in order, those a one-file pack would hold.
    """

    def run(writer: _core.Writer, names: list[Any], bar: Callable[[int], None] | None) -> int:
        return _core.pack_lines(writer, names, format, bar, max_line_bytes)

    return pack_text_inputs(
        inputs,
        output,
        format,
        run,
        metadata=metadata,
        progress=progress,
        durable=durable,
        jobs=jobs,
        shard_size=shard_size,
    )


def pack_text_inputs(
    inputs: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    encoding: str,
    run: PackRun,
    *,
    metadata: dict[str, Any] | None,
    progress: bool | None,
    durable: bool,
    jobs: int = 1,
    shard_size: int | None = None,
    item_size: int = 1,
) -> PackStats:
    """Run a C++ pack loop over text inputs into a new blob: metadata, progress bar, atomic publish.

    ``run(writer, inputs, progress_callback)`` streams the inputs (paths, or ``(path, start, end)``
    parts) into the writer and returns the bytes it read; on any exception nothing is published.
    With ``jobs > 1``, a ``shard_size``, or an output that :func:`dataset_output` calls a
    directory, writes a sharded dataset (see :func:`pack_parts`).
    """
    names = [os.fspath(p) for p in inputs]
    if not names:
        msg = "packing needs at least one input file"
        raise ValueError(msg)
    if jobs != 1 or shard_size is not None or dataset_output(output):
        with _progress_bar(names, progress) as bar:
            manifest, total, seconds = pack_parts(
                names,
                os.fspath(output),
                encoding,
                run,
                jobs=jobs,
                shard_size=shard_size,
                item_size=item_size,
                metadata=metadata,
                progress=bar,
                durable=durable,
            )
        return PackStats(manifest.records, total, manifest.data_bytes, seconds, len(manifest.shards))
    sources = [os.path.abspath(n) if n != "-" else "-" for n in names]
    meta = build_metadata(encoding, source=sources, user=metadata)
    start = time.perf_counter()
    check_output(output)
    writer = _core.Writer(os.fspath(output), durable)
    with _progress_bar(names, progress) as bar:
        try:
            total = run(writer, names, bar)
            writer.finish(meta)
        finally:
            writer.abort()
    return PackStats(writer.record_count, total, writer.data_size, time.perf_counter() - start)


Part = list[tuple[str, int, int]]


def _open_splittable(name: str) -> tuple[BinaryIO, int]:
    """`name` opened for cutting into parts, and its size; it must be a regular file."""
    if name == "-":
        msg = "stdin cannot be split into parts: give files to pack in parallel or in shards"
        raise PackInputError(msg)
    try:
        # O_NONBLOCK: looking at a FIFO must not wait for a writer.
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise StoreNotFoundError(2, f"{name}: no such file") from None
    except OSError as e:
        raise StoreIOError(e.errno or 5, f"{name}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        raise StoreIOError(e.errno or 5, f"{name}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        msg = (
            f"{name}: not a regular file (a FIFO, device or directory), so it cannot be cut into parts: "
            "pack it with -j 1 and no --shard-size, or copy it to a file first"
        )
        raise PackInputError(msg)
    return os.fdopen(fd, "rb"), st.st_size


def _line_start_at_or_after(f: BinaryIO, pos: int, size: int) -> int:
    """The first position >= pos where a line starts (just after a newline), or `size`."""
    if pos <= 0:
        return 0
    f.seek(pos - 1)
    at = pos - 1
    while at < size:
        block = f.read(1 << 16)
        if not block:
            break
        nl = block.find(b"\n")
        if nl >= 0:
            return at + nl + 1
        at += len(block)
    return size


def plan_parts(inputs: Sequence[str], part_size: int) -> list[Part]:
    """Cut text inputs, in order, into parts of about `part_size` bytes that end at line ends.

    Packing the parts one after another gives the records of packing the inputs whole: each part
    is a list of ``(file, start, end)`` ranges, and a range ends at a newline or at its file's end.
    """
    parts: list[Part] = []
    current: Part = []
    filled = 0
    for name in inputs:
        f, size = _open_splittable(name)
        with f:
            pos = 0
            while pos < size:
                cut = (
                    size
                    if size - pos <= part_size - filled
                    else _line_start_at_or_after(f, pos + part_size - filled, size)
                )
                current.append((name, pos, cut))
                filled += cut - pos
                pos = cut
                if filled >= part_size:
                    parts.append(current)
                    current, filled = [], 0
    if current or not parts:
        parts.append(current)
    return parts


def pack_parts(
    inputs: Sequence[str],
    output: str,
    encoding: str,
    run: PackRun,
    *,
    jobs: int,
    shard_size: int | None,
    item_size: int,
    metadata: dict[str, Any] | None,
    progress: Callable[[int], None] | None,
    durable: bool,
) -> tuple[Manifest, int, float]:
    """Pack text inputs into a sharded dataset, `jobs` shards at a time; (manifest, bytes read, seconds).

    The packers run in C++ without the GIL, so threads pack in parallel. Shard ``k`` holds part ``k``
    of :func:`plan_parts`: the dataset's records are those of a one-process pack, in order. One job
    and no `shard_size` make one shard of the inputs whole, so stdin and FIFOs can be packed too.
    """
    if jobs < 1:
        msg = f"jobs must be at least 1, not {jobs}"
        raise ValueError(msg)
    start = time.perf_counter()
    parts: list[list[Any]]
    if jobs == 1 and shard_size is None:
        parts = [list(inputs)]
    else:
        if shard_size is None:
            total = 0
            for name in inputs:
                f, size = _open_splittable(name)
                f.close()
                total += size
            shard_size = max(1, -(-total // jobs))
        parts = [list(part) for part in plan_parts(inputs, shard_size)]
    directory = dataset_dir(output)
    names = ShardNames(directory)
    sources = [n if n == "-" else os.path.abspath(n) for n in inputs]
    meta = build_metadata(encoding, source=sources, user=metadata)
    paths = [names.name(k) for k in range(len(parts))]
    published = [False] * len(parts)  # what this run wrote, and so may remove
    done_bytes = [0] * len(parts)

    def pack_one(k: int) -> int:
        writer = _core.Writer(paths[k], durable, item_size)

        def bar(n: int) -> None:
            done_bytes[k] = n
            if progress is not None:
                progress(sum(done_bytes))

        try:
            read = run(writer, list(parts[k]), bar if progress is not None else None)
            writer.finish(meta)
            published[k] = True
        finally:
            writer.abort()
        return read

    read = 0
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(pack_one, k) for k in range(len(parts))]
            try:
                for fut in futures:
                    read += fut.result()
            except BaseException:
                for fut in futures:
                    fut.cancel()
                raise
        shards = [describe_shard(p, stored_path=os.path.basename(p))[0] for p in paths]
        manifest = publish_manifest(
            os.path.join(directory, MANIFEST_NAME),
            encoding,
            shards,
            source=sources,
            user=metadata,
            durable=durable,
        )
    except BaseException:
        for k, p in enumerate(paths):
            if published[k]:
                with contextlib.suppress(OSError):
                    os.unlink(p)
        raise
    return manifest, read, time.perf_counter() - start


class _progress_bar:
    """A tqdm byte counter on a terminal; None (no callback) otherwise."""

    def __init__(self, names: Sequence[str], enabled: bool | None) -> None:
        if enabled is None:
            enabled = sys.stderr.isatty()
        self._bar: Any = None
        if enabled:
            sizes = [os.path.getsize(n) for n in names if n != "-" and os.path.isfile(n)]
            total = sum(sizes) if len(sizes) == len(names) else None
            self._bar = byte_bar(total, "pack")

    def _update(self, done: int) -> None:
        self._bar.update(done - self._bar.n)

    def __enter__(self) -> Callable[[int], None] | None:
        return self._update if self._bar is not None else None

    def __exit__(self, *_: object) -> None:
        if self._bar is not None:
            self._bar.close()
