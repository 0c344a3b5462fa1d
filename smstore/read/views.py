"""Views: subsets, repeats and concatenations of datasets that map indices and copy no record.

A view has ``len`` and ``__getitem__`` and maps each of its indices to one index of its source
(a blob, a sharded dataset, a SharedStoreDataset, a SharedList, a MixtureDataset or another
view), so views compose with each other and are valid :class:`~smstore.Mixture` sources,
and any of our samplers over ``len(view)`` samples a view. A view pickles as its source (which
pickles as a path) and its spec: ranges, an index array, or the path of an index file written
by :func:`select` with the digest of the indices it held (a file selected again since is refused).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import re
import stat
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime, timezone
from fractions import Fraction
from typing import Any

import numpy as np

from smstore import _core
from smstore.errors import (
    IndexFileError,
    IndexStaleError,
    StoreChangedError,
    StoreIOError,
    StoreNotFoundError,
)
from smstore.format.decode import Decoder, make_decoder
from smstore.format.manifest import MANIFEST_NAME
from smstore.write.pack import check_output, publish_file

__all__ = ["Concat", "Repeat", "Subset", "View", "index_path", "open_selection", "read_index", "select"]

Index = np.ndarray[Any, np.dtype[np.int64]]

# ----------------------------------------------------------------------------- sources


def portable_source(source: Any) -> Any:
    """What a view pickles in place of its source: a Store or ShardedStore (which cannot be
    pickled) becomes its path and checksum; anything else pickles as itself (a
    SharedStoreDataset as its path, a SharedList by handing its segment over)."""
    if isinstance(source, (_core.Store, _core.ShardedStore)):
        from smstore.format.objects import DecodedItems

        path, checksum = getattr(source, "path", None), getattr(source, "checksum", None)
        return _StoreRef(str(path), str(checksum), not isinstance(source, DecodedItems))
    return source


class _StoreRef:
    """A Store's path, checksum and kind, reopened (and checked) where a view is unpickled."""

    def __init__(self, path: str, checksum: str, raw: bool) -> None:
        self.path, self.checksum, self.raw = path, checksum, raw

    def open(self) -> Any:
        from smstore.read.store import open as open_path

        store = open_path(self.path, raw=self.raw)
        if store.checksum != self.checksum:
            now = store.checksum
            store.close()
            msg = (
                f"{self.path}: the file changed since this view was created (checksum {self.checksum}, "
                f"now {now}); create the view again to read the new file"
            )
            raise StoreChangedError(msg)
        return store


def restored_source(source: Any) -> Any:
    return source.open() if isinstance(source, _StoreRef) else source


def _fetch(source: Any, indices: Index) -> list[Any]:
    """The records of ``source`` at ``indices``, in one call where the source batches."""
    if hasattr(source, "__getitems__"):  # kept as it is: a SharedStoreDataset's batch names its file
        batch: list[Any] = source.__getitems__(indices.tolist())
        return batch
    if isinstance(source, (_core.Store, _core.ShardedStore)):
        return list(source.get_batch(indices))
    return [source[j] for j in indices.tolist()]


def _positions(indices: Any, n: int, what: str) -> Index:
    """Indices into a view of ``n`` as int64 (negative ones counted from the end), checked."""
    p = np.asarray(indices, dtype=np.int64).ravel()
    if p.size:
        p = np.where(p < 0, p + n, p)
        if int(p.min()) < 0 or int(p.max()) >= n:
            bad = int(np.asarray(indices).ravel()[np.flatnonzero((p < 0) | (p >= n))[0]])
            msg = f"index {bad} out of range for {what} of {n} records"
            raise IndexError(msg)
    return p


class View:
    """What every view shares: ``len``, ``view[i]``, batched reads, iteration and pickling.

    Subclasses map their indices to the source's with :meth:`source_indices` (vectorised);
    ``view[i]`` is ``source[source_index(i)]``, the very object the source hands out (a
    zero-copy memoryview for a blob), so records are never copied.
    """

    source: Any
    _len: int

    def source_indices(self, indices: Any) -> Index:
        """The source's indices behind an array of this view's indices (negative ones count from the end).

        Raises:
            IndexError: An index is out of range.
        """
        return self._map(_positions(indices, self._len, self._what()))

    def _map(self, p: Index) -> Index:
        raise NotImplementedError

    def _what(self) -> str:
        return f"a {type(self).__name__}"

    def source_index(self, index: int) -> int:
        """The source's index behind this view's ``index``."""
        return int(self.source_indices(np.array([int(index)], dtype=np.int64))[0])

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> Any:
        return self.source[self.source_index(index)]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The records at ``indices``, read from the source in one batch (what a DataLoader calls)."""
        return _fetch(self.source, self.source_indices(indices))

    def __iter__(self) -> Iterator[Any]:
        for start in range(0, self._len, 4096):
            yield from self.__getitems__(range(start, min(start + 4096, self._len)))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if "source" in state:
            state["source"] = portable_source(state["source"])
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "source" in state:
            state["source"] = restored_source(state["source"])
        self.__dict__.update(state)


# ----------------------------------------------------------------------------- subsets


def _as_ranges(ranges: Iterable[Any], n: int) -> list[range]:
    out = []
    for k, r in enumerate(ranges):
        if isinstance(r, range):
            rr = r
        else:
            t = tuple(r)
            if not 2 <= len(t) <= 3 or not all(isinstance(x, (int, np.integer)) for x in t):
                msg = f"range {k} is {r!r}: give (start, stop) or (start, stop, step) of integers, or a range"
                raise ValueError(msg)
            if len(t) == 3 and t[2] == 0:
                msg = f"range {k} is {r!r}: its step must not be 0"
                raise ValueError(msg)
            rr = range(*(int(x) for x in t))
        if len(rr) and not (min(rr[0], rr[-1]) >= 0 and max(rr[0], rr[-1]) < n):
            msg = f"range {k} ({rr.start}, {rr.stop}, {rr.step}) reaches outside the source's {n} records"
            raise IndexError(msg)
        if len(rr):
            out.append(rr)
    return out


def _compact(indices: np.ndarray[Any, Any], n: int) -> np.ndarray[Any, Any]:
    """Indices as uint32 when the source has fewer than 2**32 records, else uint64."""
    return indices.astype(np.uint32 if n <= 2**32 else np.uint64, copy=False)


class Subset(View):
    """The records of ``source`` at some of its indices, in the order given (repeats allowed).

    Memory is O(ranges) for ranges (whatever their lengths) and 4 bytes a record (8 past 2**32
    source records) for an index array.

    Args:
        source: Anything with ``len`` and ``__getitem__``.
        ranges: ``(start, stop)``, ``(start, stop, step)`` or ``range`` objects, read in order.
        indices: Or an array of source indices (integers in ``[0, len(source))``).

    Raises:
        ValueError: Both or neither of ``ranges`` and ``indices``, or a malformed range.
        IndexError: A range or index outside the source.
    """

    # (index file, data checksum, data, the indices' digest) when made by select()
    _file: tuple[str, str, str, str] | None = None

    def __init__(self, source: Any, ranges: Iterable[Any] | None = None, *, indices: Any = None) -> None:
        if (ranges is None) == (indices is None):
            msg = "give a Subset either ranges or indices"
            raise ValueError(msg)
        self.source = source
        n = len(source)
        if ranges is not None:
            self._set_ranges(_as_ranges(ranges, n))
        else:
            idx = np.asarray(indices)
            if idx.size and (idx.dtype.kind not in "iu" or idx.ndim != 1):
                msg = f"indices must be a 1-D array of integers, not {idx.dtype} of shape {idx.shape}"
                raise ValueError(msg)
            idx = idx.astype(np.int64) if idx.size else np.zeros(0, np.int64)
            if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
                msg = f"indices reach outside the source's {n} records (min {int(idx.min())}, max {int(idx.max())})"
                raise IndexError(msg)
            self._set_indices(_compact(idx, n))

    def _set_ranges(self, ranges: list[range]) -> None:
        self._indices: np.ndarray[Any, Any] | None = None
        self._starts = np.array([r.start for r in ranges], dtype=np.int64)
        self._steps = np.array([r.step for r in ranges], dtype=np.int64)
        self._offsets = np.array([0, *np.cumsum([len(r) for r in ranges])], dtype=np.int64)
        self._len = int(self._offsets[-1])

    def _set_indices(self, indices: np.ndarray[Any, Any]) -> None:
        self._indices = indices
        self._len = int(indices.size)

    @property
    def ranges(self) -> list[range] | None:
        """The ranges, in order (None for an index array)."""
        if self._indices is not None:
            return None
        lengths = np.diff(self._offsets)
        return [
            range(int(s), int(s + k * t), int(t))
            for s, t, k in zip(self._starts, self._steps, lengths, strict=True)
        ]

    def _map(self, p: Index) -> Index:
        if self._indices is not None:
            out: Index = self._indices[p].astype(np.int64)
            return out
        k = np.searchsorted(self._offsets, p, side="right") - 1
        return self._starts[k] + (p - self._offsets[k]) * self._steps[k]

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        if self._file is not None:  # the path of the index file, never its indices
            for key in ("_indices", "_starts", "_steps", "_offsets"):
                state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if self._file is not None:
            path, checksum, data, digest = self._file
            _load_into(self, path, records=len(self.source), checksum=checksum, data=data, digest=digest)

    def __repr__(self) -> str:
        what = (
            f"index file {self._file[0]!r}"
            if self._file
            else (f"{len(self._starts)} ranges" if self._indices is None else "an index array")
        )
        return f"Subset({self._len} of {len(self.source)} records, {what})"


# ----------------------------------------------------------------------------- repeat


def _repeat_keys(seed: int, n: int) -> list[int]:
    digest = hashlib.blake2b(f"{seed}:{n}".encode(), digest_size=48, person=b"smstore-repeat").digest()
    return [int.from_bytes(digest[8 * i : 8 * i + 8], "little") for i in range(6)]


class Repeat(View):
    """``source`` upsampled (or downsampled) by ``factor``: ``floor(factor * len(source))`` records.

    The first ``floor(factor) * n`` indices are whole passes over the source (index ``i`` is
    ``i mod n``); the rest, ``floor(frac(factor) * n)`` of them, are distinct records chosen by a
    permutation of the source keyed by ``seed`` (the same on every run and in every process). A
    float factor is taken at its shortest decimal (1.5 is 3/2). O(1) memory.

    Raises:
        TypeError: ``factor`` is not a number.
        ValueError: ``factor`` is not finite or is negative.
    """

    def __init__(self, source: Any, factor: float, *, seed: int = 0) -> None:
        if isinstance(factor, bool) or not isinstance(
            factor, (int, float, Fraction, np.integer, np.floating)
        ):
            msg = f"factor={factor!r}: give a number >= 0"
            raise TypeError(msg)
        if not math.isfinite(factor) or factor < 0:
            msg = f"factor={factor!r}: give a finite number >= 0"
            raise ValueError(msg)
        self.source = source
        self.factor = factor
        self.seed = int(seed)
        self._n = len(source)
        exact = (
            Fraction(repr(float(factor))) if isinstance(factor, (float, np.floating)) else Fraction(factor)
        )
        self._len = math.floor(exact * self._n)
        self._whole = (self._len // self._n) * self._n if self._n else 0
        self._keys = _repeat_keys(self.seed, self._n)

    def _map(self, p: Index) -> Index:
        out = p % max(self._n, 1)
        extra = p >= self._whole
        if extra.any():
            rest = (p[extra] - self._whole).astype(np.uint64)
            out[extra] = _core.feistel_permute(rest, self._n, self._keys)
        return out

    def __repr__(self) -> str:
        return f"Repeat({self._len} records: {self.factor} x {self._n}, seed={self.seed})"


# ----------------------------------------------------------------------------- concatenation


class Concat(View):
    """The records of several sources one after the other: index ``i`` is in the source whose
    range (the cumulative lengths) holds it. :meth:`locate` splits an index; O(sources) memory."""

    def __init__(self, sources: Sequence[Any]) -> None:
        self.sources = list(sources)
        self.offsets = [0]
        for s in self.sources:
            self.offsets.append(self.offsets[-1] + len(s))
        self._len = self.offsets[-1]

    def locate(self, index: int) -> tuple[int, int]:
        """``(source, index in source)`` of an index (negative ones count from the end)."""
        i = int(_positions([index], self._len, "a Concat")[0])
        s = bisect.bisect_right(self.offsets, i) - 1
        return s, i - self.offsets[s]

    def __getitem__(self, index: int) -> Any:
        s, j = self.locate(index)
        return self.sources[s][j]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        p = _positions(indices, self._len, "a Concat")
        src = np.searchsorted(np.array(self.offsets), p, side="right") - 1
        out: list[Any] = [None] * p.size
        for s in np.unique(src).tolist():
            at = np.flatnonzero(src == s)
            for k, record in zip(at.tolist(), _fetch(self.sources[s], p[at] - self.offsets[s]), strict=True):
                out[k] = record
        return out

    def _map(self, p: Index) -> Index:  # an index within its own source
        offsets = np.array(self.offsets, dtype=np.int64)
        out: Index = p - offsets[np.searchsorted(offsets, p, side="right") - 1]
        return out

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["sources"] = [portable_source(s) for s in self.sources]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["sources"] = [restored_source(s) for s in state["sources"]]
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"Concat({self._len} records from {len(self.sources)} sources)"


# ----------------------------------------------------------------------------- index files

# docs/training.md, "Views": magic, uint32 version, uint32 header length, a JSON header, zero
# padding to 8 bytes, then the array (little-endian): ``count`` indices of ``dtype``, or ``count``
# (start, stop) pairs of uint64 for kind "ranges".
_MAGIC = b"\x89SMIDX\r\n"
_PREFIX = struct.Struct("<8sII")
_VERSION = 1
_MAX_HEADER = 1 << 16
_DTYPES = {"<u4": 4, "<u8": 8}
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\Z")


def _data_identity(data: Any) -> tuple[str, str, int]:
    """(path, checksum, records) of the data a selection is made over: a blob or sharded dataset
    path, or a Store, ShardedStore or SharedStoreDataset (anything with ``path`` and ``checksum``)."""
    path = getattr(data, "path", None)
    checksum = getattr(data, "checksum", None)
    if isinstance(path, str) and isinstance(checksum, str):
        return path, checksum, len(data)
    msg = (
        f"a selection is stored beside its data, so it needs a blob or a sharded dataset (a path, a Store, "
        f"a ShardedStore or a SharedStoreDataset), not {type(data).__name__}: use Subset(source, indices=...) "
        "for anything else"
    )
    raise TypeError(msg)


def index_path(data: str | os.PathLike[str] | Any, name: str) -> str:
    """Where the selection ``name`` of ``data`` is stored: ``<blob>.<name>.idx`` beside a blob or a
    manifest file, ``<directory>/<name>.idx`` inside a dataset directory (given as the directory or
    its ``manifest.json``).

    Raises:
        ValueError: ``name`` is not a plain file name (letters, digits, ``_ . -``).
    """
    if not isinstance(name, str) or not _NAME.match(name):
        msg = f"name={name!r}: a selection's name is letters, digits, '_', '.' and '-', not starting with '.' or '-'"
        raise ValueError(msg)
    p = os.fspath(data) if isinstance(data, (str, os.PathLike)) else _data_identity(data)[0]
    if os.path.isdir(p):
        return os.path.join(p, f"{name}.idx")
    if os.path.basename(p) == MANIFEST_NAME:  # a dataset directory's manifest: the directory's file
        return os.path.join(os.path.dirname(p), f"{name}.idx")
    return f"{p}.{name}.idx"


def _bad(path: str, what: str) -> IndexFileError:
    return IndexFileError(f"{path}: not a valid smstore index file: {what}")


def write_index(
    path: str,
    selected: np.ndarray[Any, Any],
    *,
    records: int,
    checksum: str,
    info: dict[str, Any],
    durable: bool = True,
) -> None:
    """Write the sorted, distinct ``selected`` indices of data of ``records`` records atomically,
    as ranges when that is smaller."""
    check_output(path)
    sel = np.asarray(selected, dtype=np.int64)
    breaks = np.flatnonzero(np.diff(sel) != 1) + 1
    starts = sel[np.r_[0, breaks]] if sel.size else sel
    stops = sel[np.r_[breaks - 1, sel.size - 1]] + 1 if sel.size else sel
    itemsize = 4 if records <= 2**32 else 8
    if starts.size * 16 < sel.size * itemsize:
        kind, dtype = "ranges", "<u8"
        array = np.stack([starts, stops], axis=1).astype("<u8").ravel()
        count = int(starts.size)
    else:
        kind, dtype = "indices", ("<u4" if itemsize == 4 else "<u8")
        array = sel.astype(dtype)
        count = int(sel.size)
    body = array.tobytes()
    header = {
        "format": "smstore-index",
        "kind": kind,
        "dtype": dtype,
        "count": count,
        "selected": int(sel.size),
        "records": records,
        "checksum": checksum,
        "digest": hashlib.blake2b(body, digest_size=16).hexdigest(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "smstore_version": _core.__version__,
        **info,
    }
    text = json.dumps(header, sort_keys=True).encode()
    text += b"\0" * (-(_PREFIX.size + len(text)) % 8)
    publish_file(
        path, [_PREFIX.pack(_MAGIC, _VERSION, len(text)), text, body], what="the index file", durable=durable
    )


def read_index(
    path: str | os.PathLike[str], *, records: int, checksum: str, data: str = "the data"
) -> tuple[dict[str, Any], np.ndarray[Any, Any]]:
    """Read and check an index file: (header, array). The array is an index array, or an
    ``(r, 2)`` array of (start, stop) ranges for kind ``"ranges"``. Nothing is unpickled, and
    nothing larger than the file is allocated.

    Raises:
        StoreNotFoundError: No such file.
        IndexFileError: Not a well-formed index file (the message names the fault).
        IndexStaleError: It was made for other data than ``data`` (of ``records`` records and
            ``checksum``), which changed since.
    """
    p = os.fspath(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # never wait on a FIFO
    except FileNotFoundError:
        raise StoreNotFoundError(2, f"{p}: no such index file") from None
    except OSError as e:
        raise StoreIOError(e.errno or 5, f"{p}: cannot read the index file: {e.strerror}") from None
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _bad(p, "not a regular file")
        size = st.st_size
        prefix = f.read(_PREFIX.size)
        if len(prefix) < _PREFIX.size:
            raise _bad(p, f"{size} bytes, shorter than its {_PREFIX.size}-byte prefix (truncated?)")
        magic, version, hlen = _PREFIX.unpack(prefix)
        if magic != _MAGIC:
            raise _bad(p, "no magic bytes")
        if version != _VERSION:
            raise _bad(p, f"format version {version}; this smstore reads version {_VERSION}")
        if hlen > _MAX_HEADER or _PREFIX.size + hlen > size:
            raise _bad(p, f"a header of {hlen} bytes in a file of {size} (truncated?)")
        try:
            header = json.loads(f.read(hlen).rstrip(b"\0"))
        except (ValueError, RecursionError) as e:
            raise _bad(p, f"the header is not JSON ({e})") from None
        if not isinstance(header, dict) or header.get("format") != "smstore-index":
            raise _bad(p, 'no "format": "smstore-index" in the header')
        kind, dtype, count = header.get("kind"), header.get("dtype"), header.get("count")
        if kind not in ("indices", "ranges") or dtype not in _DTYPES or (kind == "ranges" and dtype != "<u8"):
            raise _bad(p, f"kind {kind!r} with dtype {dtype!r}")
        if type(count) is not int or not 0 <= count < 2**62:
            raise _bad(p, f"count must be an integer >= 0, not {count!r}")
        for key in ("records", "selected"):
            if type(header.get(key)) is not int or not 0 <= header[key] < 2**63:
                raise _bad(p, f"{key} must be an integer >= 0, not {header.get(key)!r}")
        width = _DTYPES[dtype] * (2 if kind == "ranges" else 1)
        need = _PREFIX.size + hlen + count * width
        if need != size:  # before reading: a huge count in a small file allocates nothing
            raise _bad(p, f"its header says {need} bytes, the file has {size} (truncated or extended?)")
        if header.get("checksum") != checksum or header["records"] != records:
            msg = (
                f"{p}: this selection was made over {data} when it held {header['records']} records with "
                f"checksum {header.get('checksum')}; {data} now holds {records} records with checksum "
                f"{checksum}: the data changed, so the selected indices mean other records. Delete {p} "
                "or select again with rebuild=True"
            )
            raise IndexStaleError(msg)
        body = f.read(count * width)
    if len(body) != count * width:
        raise _bad(p, "shorter than its header says (it changed while being read)")
    if hashlib.blake2b(body, digest_size=16).hexdigest() != header.get("digest"):
        raise _bad(p, "its indices do not match the digest in its header (corrupt)")
    array = np.frombuffer(body, dtype=dtype)
    if kind == "ranges":
        array = array.reshape(-1, 2)
        starts, stops = array[:, 0], array[:, 1]
        ok = bool(np.all(starts < stops)) and bool(np.all(starts[1:] >= stops[:-1]))
        if not ok or (count and int(stops[-1]) > records):
            raise _bad(p, f"ranges not sorted, empty, overlapping or past the data's {records} records")
        total = int((stops - starts).sum()) if count else 0
    else:
        if count and (int(array.max()) >= records or not bool(np.all(np.diff(array.astype(np.int64)) > 0))):
            raise _bad(p, f"indices not strictly increasing or not below the data's {records} records")
        total = count
    if total != header["selected"]:
        raise _bad(p, f"holds {total} indices, its header says {header['selected']}")
    return header, array


def _load_into(
    view: Subset, path: str, *, records: int, checksum: str, data: str, digest: str | None = None
) -> None:
    """Give `view` the selection in the index file `path`; `digest`: the indices it must hold (a
    pickled view's), refused if the file now holds others (selected again under the same name)."""
    header, array = read_index(path, records=records, checksum=checksum, data=data)
    if digest is not None and header["digest"] != digest:
        msg = (
            f"{path}: the index file changed since this view was pickled (indices digest {digest}, now "
            f"{header['digest']}: selected again under the same name?), so its indices mean other "
            f"records of {data}; open the selection again (select or open_selection) and pass the new view"
        )
        raise StoreChangedError(msg)
    if header["kind"] == "ranges":
        view._set_ranges([range(int(a), int(b)) for a, b in array.tolist()])
    else:
        view._set_indices(_compact(array.astype(array.dtype.newbyteorder("="), copy=False), records))
    view._file = (os.path.abspath(path), checksum, data, str(header["digest"]))


def open_selection(source: Any, name: str) -> Subset:
    """The selection ``name`` made by :func:`select` over ``source``, read from its index file.

    Raises:
        StoreNotFoundError: No such selection.
        IndexStaleError: The data changed since the selection was made.
        IndexFileError: The index file is malformed.
    """
    data, checksum, records = _data_identity(source)
    path = index_path(data, name)
    view = Subset.__new__(Subset)
    view.source = source
    _load_into(view, path, records=records, checksum=checksum, data=data)
    return view


def select(
    source: Any,
    predicate: Callable[[Any], object],
    *,
    name: str,
    decode: str | Decoder | None = None,
    rebuild: bool = False,
    durable: bool = True,
) -> Subset:
    """The records of ``source`` for which ``predicate`` is true, evaluated once into an index file.

    The first call runs ``predicate`` over every record and writes the selected indices (as
    ranges where they are contiguous) with the data's checksum to :func:`index_path` (atomically);
    later calls, in any process, read that file instead and refuse it if the data changed.

    Args:
        source: A Store, ShardedStore or SharedStoreDataset (the view reads through it), or the
            path of a blob or sharded dataset (opened with ``smstore.open``).
        predicate: Called with each record; truthy keeps it.
        name: The selection's name: its file is ``<blob>.<name>.idx``.
        decode: What ``predicate`` is given: ``None`` (default) the raw record, a read-only
            memoryview (fast; nothing is decoded or unpickled); or a ``decode=`` of
            SharedStoreDataset (``"auto"``, ``"bytes"``, ``"utf8"``, ``"json"``, ``"numpy"``, a callable).
        rebuild: Evaluate ``predicate`` again and replace the file (after the data changed).
        durable: fsync the index file before publishing it.

    Raises:
        IndexStaleError: The file exists but was made over other data (pass ``rebuild=True``).
        IndexFileError: The file exists but is malformed.
        StoreIOError: The index file's path is a symbolic link, directory or special file.
    """
    if isinstance(source, (str, os.PathLike)):
        from smstore.read.store import open as open_path

        source = open_path(source)
    data, checksum, records = _data_identity(source)
    path = index_path(data, name)
    if not rebuild and os.path.lexists(path):
        return open_selection(source, name)
    from smstore.read.store import open as open_path

    with open_path(data, raw=True) as raw:
        if raw.checksum != checksum:
            msg = f"{data}: the file changed while a selection was being made; select again"
            raise StoreChangedError(msg)
        decoder = make_decoder(decode, raw.encoding, data) if decode is not None else None
        keep: list[np.ndarray[Any, Any]] = []
        step = 65536
        for start in range(0, records, step):
            batch = raw.get_batch(np.arange(start, min(start + step, records), dtype=np.int64))
            flags = [bool(predicate(decoder(r) if decoder is not None else r)) for r in batch]
            keep.append(start + np.flatnonzero(flags))
    selected = np.concatenate(keep) if keep else np.zeros(0, np.int64)
    what = "raw" if decode is None else (decode if isinstance(decode, str) else "callable")
    info = {"name": name, "decode": what, "data": os.path.basename(data)}
    write_index(path, selected, records=records, checksum=checksum, info=info, durable=durable)
    return open_selection(source, name)
