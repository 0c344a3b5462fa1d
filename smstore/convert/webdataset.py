"""WebDataset tar shards -> one ``wds`` record per sample ({extension: bytes}), streamed member by member.

As WebDataset groups them: consecutive members whose paths share the part before the first dot
of the file name form one sample; the rest of the name is the member's extension. The sample's
key is kept as the member ``__key__``, as WebDataset's samples carry it.
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Iterator, Sequence
from typing import Any

from smstore._pack import PackStats
from smstore._samples import encode_sample
from smstore.convert._common import _Progress, write_records
from smstore.errors import PackInputError

__all__ = ["convert_webdataset", "iter_samples"]


def _split(name: str) -> tuple[str, str]:
    directory, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    key = f"{directory}/{stem}" if directory else stem
    return key, ext if dot else ""


def iter_samples(path: str, done: Any = None) -> Iterator[dict[str, bytes]]:
    """The samples of one tar shard, in order, each ``{"__key__": key, ext: bytes, ...}``.

    Raises:
        PackInputError: A truncated or corrupt tar, naming the file and the last member read.
    """
    last = "(none)"
    key: str | None = None
    sample: dict[str, bytes] = {}
    try:
        with tarfile.open(path, mode="r|*") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                k, ext = _split(member.name)
                if k != key and sample:
                    yield sample
                    sample = {}
                key = k
                if not sample:
                    sample["__key__"] = k.encode()
                f = tar.extractfile(member)
                assert f is not None  # a regular file
                if ext in sample:
                    raise PackInputError(f"{path}: sample {k!r} has two members with extension {ext!r}")
                sample[ext] = f.read()
                last = member.name
                if done is not None:
                    done(tar.fileobj.tell() if hasattr(tar.fileobj, "tell") else 0)
    except (tarfile.TarError, EOFError, OSError) as e:
        raise PackInputError(f"{path}: corrupt or truncated tar after member {last!r}: {e}") from None
    if sample:
        yield sample


def convert_webdataset(
    sources: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    metadata: dict[str, Any] | None = None,
    shard_size: int | None = None,
    durable: bool = True,
    progress: bool | None = None,
) -> PackStats:
    """Convert WebDataset tar shards (read in order) into a blob of ``wds`` records.

    ``smstore.open()`` and ``SharedStoreDataset`` decode each record to ``{ext: bytes}`` (with
    ``__key__``); ``Store(path)[i]`` is the raw record (format: smstore/_samples.py).
    """
    paths = [os.fspath(p) for p in sources]
    if not paths:
        raise PackInputError("convert_webdataset needs at least one tar shard")
    for p in paths:
        if not os.path.isfile(p):
            raise PackInputError(f"{p}: no such file")
    sizes = [os.path.getsize(p) for p in paths]
    bar = _Progress(sum(sizes), progress, "convert")

    def records() -> Iterator[bytes]:
        before = 0
        for p, size in zip(paths, sizes, strict=True):
            for sample in iter_samples(p, lambda n, b=before: bar.update(b + n)):
                yield encode_sample(sample)
            before += size

    return write_records(
        records(),
        output,
        encoding="wds",
        source=paths,
        metadata=metadata,
        durable=durable,
        shard_size=shard_size,
        input_bytes=sum(sizes),
        bar=bar,
    )
