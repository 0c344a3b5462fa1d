"""Writing blobs: smstore.pack(), smstore.Writer and the file packer behind `smstore pack`."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from smstore import _core
from smstore.errors import PackInputError, StoreFormatError, StoreIOError

if TYPE_CHECKING:
    import numpy as np
    from typing_extensions import Self

__all__ = [
    "PackStats",
    "Writer",
    "build_metadata",
    "byte_bar",
    "check_output",
    "dataset_output",
    "fsync_dir",
    "human_bytes",
    "item_size",
    "numpy_dtype",
    "pack",
    "publish_file",
]

Record = bytes | bytearray | memoryview | str


def _what(mode: int) -> str:
    """What kind of file a mode is, for messages."""
    kinds = (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "a special file")


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StoreIOError(e.errno or errno.EIO, f"{path}: cannot look at the output: {e.strerror}") from None


def dataset_output(output: str | os.PathLike[str]) -> bool:
    """Whether `output` names a dataset directory: an existing directory, or a path ending with '/'.

    Every writer that takes either a blob or a dataset decides by this (docs/format.md, "Outputs").
    """
    p = os.fspath(output)
    return p.endswith(os.sep) or os.path.isdir(p)


def check_output(path: str | os.PathLike[str], *, directory: bool = False) -> None:
    """Refuse an output smstore must not write to: the one rule for blobs, manifests and datasets.

    A file (a blob or a manifest) is published by renaming a new file over `path`, so `path` must
    be missing or a regular file: a rename would replace a symbolic link itself (not its target),
    and swap a FIFO, device or socket for a regular file. A dataset directory must be missing (it is
    created) or a directory, also through a symbolic link, since nothing replaces it: shards and
    manifest are written inside. docs/format.md, "Outputs", states the rule; ``csrc/writer.cpp``
    checks a blob's output again just before its rename (it refuses special files and
    directories, but follows a symbolic link there: this check is what refuses one).

    Args:
        path: The output.
        directory: `path` is a dataset directory rather than a file.

    Raises:
        StoreIOError: `path` is none of these; the message names it and what it is.
    """
    p = os.fspath(path)
    if directory:
        name = p.rstrip(os.sep) or p  # "link/" would resolve the link: look at the link itself
        st = _lstat(name)
        if st is None or stat.S_ISDIR(st.st_mode):
            return
        what = _what(st.st_mode)
        if stat.S_ISLNK(st.st_mode):
            try:
                target = os.stat(name).st_mode
            except OSError:
                what = "a symbolic link to nothing"
            else:
                if stat.S_ISDIR(target):
                    return
                what = f"a symbolic link to {_what(target)}"
        msg = f"{p}: is {what}; a sharded dataset is a directory (of shards and manifest.json)"
        raise StoreIOError(errno.ENOTDIR, msg)
    if p.endswith(os.sep):
        msg = f"{p}: names a directory (it ends with '/'); give a file name for the output"
        raise StoreIOError(errno.EISDIR, msg)
    st = _lstat(p)
    if st is None or stat.S_ISREG(st.st_mode):
        return
    if stat.S_ISDIR(st.st_mode):
        raise StoreIOError(errno.EISDIR, f"{p}: is a directory; give a file name for the output")
    if stat.S_ISLNK(st.st_mode):
        msg = (
            f"{p}: is a symbolic link; smstore renames a new file over its output, which would replace "
            "the link itself: give the link's target or another output path"
        )
        raise StoreIOError(errno.EEXIST, msg)
    # The words of csrc/writer.cpp's own check, which tests match.
    msg = (
        f"{p}: is not a regular file but {_what(st.st_mode)}; smstore only replaces regular files: "
        "give another output path"
    )
    raise StoreIOError(errno.EEXIST, msg)


def fsync_dir(directory: str) -> None:
    """Make a rename in `directory` durable (best effort: the rename itself already happened)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_file(path: str, chunks: Sequence[bytes], *, what: str, durable: bool) -> None:
    """Write a small file atomically: a temporary file beside `path`, renamed over it.

    The one way smstore publishes the small files it writes whole (manifests, index files): the
    output is checked by :func:`check_output` before and again just before the rename (it may have
    changed meanwhile), a replaced file's permission bits are kept, and nothing is left behind on
    any error.

    Args:
        path: The file to publish.
        chunks: Its bytes, written in order.
        what: What the file is, for messages ("the manifest").
        durable: fsync the file and its directory.

    Raises:
        StoreIOError: `path` is not a file smstore may replace, or writing failed.
    """
    check_output(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(
        directory, f".{os.path.basename(path)}.smstore-tmp-{os.getpid()}-{secrets.token_hex(5)}"
    )
    try:
        # Created here, never a link; its mode set and its identity checked through the descriptor,
        # kept open to the rename: another user who may write the directory can swap a link in
        # at the temporary name, which a chmod by name would follow and the rename would publish.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        with open(fd, "wb") as f:
            f.writelines(chunks)
            f.flush()
            if durable:
                os.fsync(f.fileno())
            check_output(path)  # again: the path may have changed since we looked
            if os.path.exists(path):
                os.fchmod(f.fileno(), os.stat(path).st_mode & 0o777)
            ours, there = os.fstat(f.fileno()), os.lstat(tmp)
            if (ours.st_dev, ours.st_ino) != (there.st_dev, there.st_ino):
                tmp = ""  # not ours to remove
                msg = f"{path}: cannot write {what}: its temporary file was replaced while it was written"
                raise StoreIOError(errno.EEXIST, msg)
            os.rename(tmp, path)
    except OSError as e:
        if tmp:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(e, StoreIOError):
            raise
        raise StoreIOError(e.errno or errno.EIO, f"{path}: cannot write {what}: {e.strerror}") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(directory)


def source_names(source: Sequence[str]) -> list[str]:
    """Input names as metadata records them: one not UTF-8 (surrogate escapes from the file
    system, which JSON cannot carry as UTF-8) is kept readable, its odd bytes shown as ``\\xe9``."""
    return [os.fsencode(s).decode("utf-8", "backslashreplace") for s in source]


def build_metadata(
    encoding: str, *, source: Sequence[str] = (), user: dict[str, Any] | None = None, **extra: Any
) -> str:
    """The JSON metadata block stored in every blob (see docs/format.md)."""
    meta: dict[str, Any] = {
        "encoding": encoding,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "source": source_names(source),
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


def item_size(encoding: str, path: str) -> int:
    """The byte size of one item of an ``npy:<dtype>`` encoding; 1 for every other encoding."""
    if not encoding.startswith("npy:"):
        return 1
    try:
        return max(1, numpy_dtype(encoding, path).itemsize)
    except StoreFormatError as e:
        raise PackInputError(str(e)) from None


def numpy_dtype(encoding: str, path: str) -> np.dtype[Any]:
    """The dtype of an ``npy:<dtype>`` encoding (numpy imported here, for array encodings only)."""
    import numpy as np

    if not encoding.startswith("npy:"):
        msg = f"{path}: records are encoded as {encoding!r}, not npy:<dtype>; decode='numpy' needs arrays"
        raise StoreFormatError(msg)
    try:
        return np.dtype(encoding[4:])
    except TypeError:
        msg = f"{path}: unknown dtype in encoding {encoding!r}"
        raise StoreFormatError(msg) from None


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
        check_output(path)
        self._writer = _core.Writer(os.fspath(path), durable, item_size(encoding, os.fspath(path)))
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
