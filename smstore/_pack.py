"""Writing blobs: smstore.pack(), smstore.Writer and the file packer behind `smstore pack`."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from smstore import _core
from smstore.errors import PackInputError, StoreFormatError

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["PackStats", "Writer", "build_metadata", "byte_bar", "human_bytes", "pack", "pack_files"]

Record = bytes | bytearray | memoryview | str


def build_metadata(
    encoding: str, *, source: Sequence[str] = (), user: dict[str, Any] | None = None, **extra: Any
) -> str:
    """The JSON metadata block stored in every blob (see docs/format.md)."""
    meta: dict[str, Any] = {
        "encoding": encoding,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "source": list(source),
        "smstore_version": _core.__version__,
        **extra,
    }
    if user:
        meta["user"] = user
    try:
        return json.dumps(meta, ensure_ascii=False, sort_keys=True)
    except (TypeError, ValueError) as e:
        msg = f"metadata must be JSON-serializable: {e}"
        raise TypeError(msg) from None


def _item_size(encoding: str, path: str) -> int:
    """The byte size of one item of an ``npy:<dtype>`` encoding; 1 for every other encoding."""
    if not encoding.startswith("npy:"):
        return 1
    from smstore._decode import numpy_dtype  # numpy only for array encodings

    try:
        return max(1, numpy_dtype(encoding, path).itemsize)
    except StoreFormatError as e:
        raise PackInputError(str(e)) from None


class Transaction:
    """A writer used as a ``with`` block: ``close()`` (publish) on success, ``abort()`` on an exception."""

    def close(self) -> Any:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class Writer(Transaction):
    """Streams records into a new blob, published atomically when the ``with`` block ends.

    Records are appended in order; record ``i`` is the ``i``-th ``append``. On an exception inside
    the block nothing is written at ``path`` and a previous file there is left untouched.

    Args:
        path: The output ``.smst`` file.
        encoding: Recorded in the metadata; tells readers how to decode (``bytes``, ``lines``,
            ``jsonl``, ``npy:<dtype>``). With ``npy:<dtype>`` a record that is not a whole number
            of the dtype's items raises PackInputError.
        metadata: Your own JSON-serializable metadata, stored under ``"user"``.
        durable: fsync the file and its directory before publishing it.

    Example:
        >>> with smstore.Writer("out.smst") as w:
        ...     w.append(b"first record")
        ...     w.extend(["second", "third"])
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        encoding: str = "bytes",
        metadata: dict[str, Any] | None = None,
        source: Sequence[str] = (),
        durable: bool = True,
    ) -> None:
        self._meta = build_metadata(encoding, source=source, user=metadata)
        self._writer = _core.Writer(os.fspath(path), durable, _item_size(encoding, os.fspath(path)))
        self.append: Callable[[Record], None] = self._writer.append
        self.extend: Callable[[Iterable[Record]], int] = self._writer.extend
        # Records data[offsets[i]:offsets[i+1]], in one call (Arrow's binary and string layout).
        self.extend_offsets: Callable[[Any, Any], int] = self._writer.extend_offsets

    @property
    def record_count(self) -> int:
        return self._writer.record_count

    @property
    def data_size(self) -> int:
        """Bytes of records written so far."""
        return self._writer.data_size

    @property
    def path(self) -> str:
        return self._writer.path

    def close(self) -> None:
        """Finish the blob and move it into place (idempotent)."""
        if self._writer.is_open:
            self._writer.finish(self._meta)

    def abort(self) -> None:
        """Discard everything written; ``path`` is left as it was."""
        self._writer.abort()


def pack(
    records: Iterable[Record],
    path: str | os.PathLike[str],
    *,
    encoding: str = "bytes",
    metadata: dict[str, Any] | None = None,
    durable: bool = True,
) -> int:
    """Pack an iterable of records (bytes, str as UTF-8, or buffers) into a blob.

    Returns:
        The number of records written.
    """
    with Writer(path, encoding=encoding, metadata=metadata, durable=durable) as w:
        w.extend(records)
        return w.record_count


@dataclass(frozen=True)
class PackStats:
    """What one pack_files() call did."""

    records: int
    input_bytes: int
    data_bytes: int
    seconds: float
    shards: int = 1  # more than one: the output is a sharded dataset (a directory)


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
        output: The ``.smst`` file to write (atomically); with ``jobs`` or ``shard_size``, the
            directory of a sharded dataset (``manifest.json`` and its shards, written last).
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


PackLoop = Callable[[_core.Writer, list[Any], Callable[[int], None] | None], int]


def pack_text_inputs(
    inputs: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    encoding: str,
    run: PackLoop,
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
    With ``jobs > 1`` or a ``shard_size``, writes a sharded dataset (see :mod:`smstore._shards`).
    """
    names = [os.fspath(p) for p in inputs]
    if not names:
        msg = "packing needs at least one input file"
        raise ValueError(msg)
    if jobs != 1 or shard_size is not None:
        from smstore._shards import pack_parts

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
    writer = _core.Writer(os.fspath(output), durable)
    with _progress_bar(names, progress) as bar:
        try:
            total = run(writer, names, bar)
            writer.finish(meta)
        finally:
            writer.abort()
    return PackStats(writer.record_count, total, writer.data_size, time.perf_counter() - start)


def human_bytes(n: float, sep: str = " ") -> str:
    """A byte count in binary units: ``512 B``, ``1.5 MiB`` (``sep`` between number and unit)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f}{sep}B" if unit == "B" else f"{n:.1f}{sep}{unit}"
        n /= 1024
    return f"{n:.1f}{sep}TiB"


def byte_bar(total: int | None, desc: str) -> Any:
    """A tqdm bar of bytes on stderr in binary units (KiB, MiB/s: those of the summary line).

    tqdm's own byte units are decimal for the rate (``MB/s``) whatever its divisor, and a terminal
    that reports 0 columns (a fresh pty, some CI runners) left its bar blank: such a terminal
    gets 80 x 24.
    """
    from tqdm import tqdm

    class ByteBar(tqdm):  # type: ignore[misc]
        @property
        def format_dict(self) -> dict[str, Any]:
            d: dict[str, Any] = super().format_dict
            rate = d.get("rate")
            if rate is None and d.get("elapsed"):
                rate = (d["n"] - d.get("initial", 0)) / d["elapsed"]
            d["done"] = human_bytes(d["n"], "")
            d["size"] = human_bytes(d["total"], "") if d.get("total") is not None else "?"
            d["speed"] = f"{human_bytes(rate, '')}/s" if rate else "?B/s"
            return d

    try:
        columns, rows = os.get_terminal_size(sys.stderr.fileno())
    except (OSError, ValueError):
        columns, rows = 0, 0
    fmt = (
        "{desc}: {percentage:3.0f}%|{bar}| {done}/{size} [{elapsed}<{remaining}, {speed}]"
        if total is not None
        else "{desc}: {done} [{elapsed}, {speed}]"
    )
    return ByteBar(total=total, desc=desc, ncols=columns or 80, nrows=rows or 24, bar_format=fmt)


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
