"""DecodedCache: the deterministic part of a transform computed once per node, shared by every rank, worker and job.

``DecodedCache(dataset, prepare)`` is a map-style dataset whose record ``i`` is ``prepare(dataset[i])``
(decode, resize, normalise: what gives the same output every time). The output is written once per
node into shared memory the daemon owns, and every later read of it, in any epoch, rank, worker or
job on the node, is a view of those bytes. The random part of a transform (augmentation) runs
after it, every time, as before (``TransformLoader(..., prepare=, cache="node")``).

**Layout.** A cache holds fixed-shape outputs (an array, or a dict or tuple of them, as
:class:`smstore.TransformLoader` batches them), in chunks of ``rows`` records: a chunk is one
:class:`~smstore.loading.layout.Layout` slot of ``rows`` rows, whose int64 index words are the
records' claims (csrc/claims.hpp).

**Once per node.** The first process to read a record claims it (a compare-and-swap on its word),
decodes it, writes its row and publishes it; a process that wants it meanwhile waits for it.
A process killed while writing leaves its claim, which the daemon resets when its connection
closes: a row is visible only once written in full.

**Identity.** A cache is found by (the data's checksum, a digest of ``prepare``: its code, its
constants, defaults, closure, attributes and the globals it names, plus the ``version`` the user
declares, and the layout): another transform is another cache, never a stale hit. ``version``
declares what the digest cannot see (an upgraded decoding library).

**Budget.** Chunks count against the daemon's ``--shm-limit`` like its shards: a chunk that does
not fit beside what the ranks hold is not cached, and its records are decoded at each read
("uncached"). A cache no process uses any more stays while room allows.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import mmap
import os
import pickle
import select
import socket as socket_module
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from smstore import _core
from smstore.errors import CollateError, DaemonError
from smstore.loading.layout import Layout, Spec
from smstore.wire.client.session import DaemonSession, session_for
from smstore.wire.ipc import socket_path
from smstore.wire.protocol import MAX_CACHE_ROWS

__all__ = ["DecodedCache", "transform_identity"]

log = logging.getLogger("smstore")

_HITS, _FILLS, _WAITS, _UNCACHED = range(4)  # the meta page's counters (smstore/daemon/segments.py)
_COUNTS = ("hits", "fills", "waits", "uncached")
_META = -1
_RETRY_S = 1.0  # how long after "no room" a process reads uncached before it asks for a new chunk again
MAX_CHUNKS = 4096  # past it a cache's chunks grow instead (each is two mappings in every process)
# The meta page (smstore/daemon/segments.py: the counters first): the layout a process learns, as
# JSON behind a claim word (written once, by whichever process maps the page first), then from
# _CHUNK_BITS a bit a chunk, set by the daemon while it serves the chunk.
_LAYOUT_WORD, _LAYOUT_LENGTH, _LAYOUT_AT, _CHUNK_BITS = 64, 72, 128, 3584
_ALIVE_S = 0.25  # how often a process waiting for another's record looks whether the daemon is still there


# -- identity -----------------------------------------------------------------------------------------


def transform_identity(fn: Any, version: str = "") -> str:
    """A digest of what `fn` computes, as far as Python shows it: its code (nested code included),
    constants, defaults, closure, the globals it names, its attributes (an object's, a partial's
    arguments), and `version`. 64 hex digits."""
    h = hashlib.blake2b(digest_size=32)
    h.update(b"smstore-transform-v1\0" + version.encode() + b"\0")
    _describe(fn, h, set(), 0)
    return h.hexdigest()


def _describe(obj: Any, h: Any, seen: set[int], depth: int) -> None:
    def tag(kind: str, text: str | bytes = b"") -> None:
        data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
        h.update(f"{kind}:{len(data)}:".encode() + data)

    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
        tag(type(obj).__name__, repr(obj))
        return
    if depth > 24:
        tag("deep", type(obj).__qualname__)
        return
    if id(obj) in seen:
        tag("cycle", type(obj).__qualname__)
        return
    seen.add(id(obj))
    try:
        _describe_object(obj, h, seen, depth + 1, tag)
    finally:
        seen.discard(id(obj))


def _describe_object(obj: Any, h: Any, seen: set[int], depth: int, tag: Callable[..., None]) -> None:
    def each(*values: Any) -> None:
        for value in values:
            _describe(value, h, seen, depth)

    if isinstance(obj, (tuple, list)):
        tag(type(obj).__name__, str(len(obj)))
        each(*obj)
    elif isinstance(obj, (set, frozenset)):
        parts = []
        for value in obj:
            inner = hashlib.blake2b(digest_size=16)
            _describe(value, inner, seen, depth)
            parts.append(inner.digest())
        tag("set", b"".join(sorted(parts)))
    elif isinstance(obj, dict):
        tag("dict", str(len(obj)))
        for key in sorted(obj, key=repr):
            each(key, obj[key])
    elif isinstance(obj, (np.ndarray, np.generic)):
        arr = np.ascontiguousarray(obj)
        tag("ndarray", f"{arr.dtype.str}{arr.shape}")
        tag("data", arr.tobytes() if not arr.dtype.hasobject else pickle.dumps(arr))
    elif type(obj).__module__ == "torch" and type(obj).__name__ in ("Tensor", "Parameter"):
        each(obj.detach().cpu().numpy())
    elif isinstance(obj, types.ModuleType):
        tag("module", f"{obj.__name__} {getattr(obj, '__version__', '')}")
    elif isinstance(obj, types.CodeType):
        tag("code", obj.co_code)
        tag("names", " ".join(obj.co_names))
        each(*obj.co_consts)
    elif isinstance(obj, types.FunctionType):
        tag("function", f"{obj.__module__}.{obj.__qualname__}")
        each(obj.__code__, obj.__defaults__, obj.__kwdefaults__)
        each(*(cell.cell_contents for cell in obj.__closure__ or () if _cell_filled(cell)))
        for name in sorted(_global_names(obj.__code__)):
            if name in obj.__globals__:
                tag("global", name)
                each(obj.__globals__[name])  # a list or dict too, by what it holds now
    elif isinstance(obj, types.MethodType):
        tag("method")
        each(obj.__func__, obj.__self__)
    elif isinstance(obj, functools.partial):
        tag("partial")
        each(obj.func, obj.args, obj.keywords)
    elif isinstance(obj, (types.BuiltinFunctionType, types.BuiltinMethodType)):
        tag("builtin", f"{getattr(obj, '__module__', '')}.{obj.__qualname__}")
    elif isinstance(obj, type):
        tag("class", f"{obj.__module__}.{obj.__qualname__}")
        if obj.__module__ not in ("builtins", "numpy", "torch") and not obj.__module__.startswith(
            ("numpy.", "torch.", "PIL.")
        ):
            each(
                {
                    k: v
                    for k, v in vars(obj).items()
                    if isinstance(v, (types.FunctionType, staticmethod, classmethod, property))
                }
            )
    elif isinstance(obj, (staticmethod, classmethod)):
        each(obj.__func__)
    elif isinstance(obj, property):
        each(obj.fget, obj.fset)
    else:
        each(type(obj))  # an object: its class's methods, then its attributes
        state = getattr(obj, "__dict__", None)
        slots = [n for cls in type(obj).__mro__ for n in getattr(cls, "__slots__", ()) if hasattr(obj, n)]
        if state is not None or slots:
            each(dict(state or {}), {n: getattr(obj, n) for n in slots})
        else:
            try:
                tag("pickle", pickle.dumps(obj, protocol=4))
            except Exception:  # noqa: BLE001 - what neither shows nor pickles is known by its type only
                tag("opaque", type(obj).__qualname__)


def _cell_filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _data_identity(dataset: Any) -> str:
    hook = getattr(dataset, "cache_identity", None)
    if callable(hook):
        return str(hook())
    checksum = getattr(dataset, "checksum", None)
    if not isinstance(checksum, str):
        msg = (
            f"a {type(dataset).__name__} has no checksum to know its contents by: pass key= (a string "
            "that changes whenever the records do) to DecodedCache"
        )
        raise TypeError(msg)
    decode = getattr(dataset, "decode", "")
    how = decode if isinstance(decode, str) else transform_identity(decode)  # a callable: by what it does
    own = getattr(dataset, "transform", None)  # what the dataset does to a record before prepare sees it
    return f"{type(dataset).__qualname__} {checksum} {how} {'' if own is None else transform_identity(own)}"


# -- the cache in one process -------------------------------------------------------------------------


@dataclass
class _Chunk:
    mem: mmap.mmap
    words: np.ndarray[Any, Any]  # int64 claim words, one a record
    fields: list[np.ndarray[Any, Any]]  # the rows, writable (the claimant writes its row)
    read_only: list[np.ndarray[Any, Any]]  # the same rows as handed out: a transform cannot write the cache


class DecodedCache:
    """``prepare(dataset[i])``, computed once per node and read from shared memory after (see the module docstring).

    Args:
        dataset: A map-style dataset with a ``checksum`` (SharedStoreDataset, ShardedDataset), or any
            map-style dataset with ``key=``.
        prepare: The deterministic part of the transform: one record in, a fixed-shape output out
            (a numpy array, CPU tensor or number, or a dict or tuple of them).
        version: Declares a change of ``prepare`` its digest cannot see (a new library version).
        socket: The daemon's socket (default ``$SMSTORE_SOCKET``, then the per-user default). The
            process must run as the daemon's owner: its caches are writable by whoever holds them.
        spec: The output's layout, as :class:`smstore.TransformLoader` takes it (default: inferred
            from ``prepare(dataset[0])``, which then becomes record 0's cached row).
        key: Names the data when the dataset has no checksum (it must change when the records do).
        chunk_bytes: About how many bytes a chunk holds (the unit the budget admits or evicts).
        wait_timeout: Seconds to wait for a record another process is writing before decoding it
            here (uncached): a process stopped mid-write (SIGSTOP, a debugger) never stalls others
            for longer. A process that dies mid-write is noticed at once.
        transform: The random part, applied to each output after the cache (for a DataLoader;
            TransformLoader takes its own ``transform``).

    Raises:
        ValueError: An empty dataset.
        TypeError: A dataset with no checksum, and no ``key``.
    """

    def __init__(
        self,
        dataset: Any,
        prepare: Callable[[Any], Any],
        *,
        transform: Callable[[Any], Any] | None = None,
        version: str = "",
        socket: str | os.PathLike[str] | None = None,
        spec: Spec | None = None,
        key: str | None = None,
        chunk_bytes: int = 4 << 20,
        wait_timeout: float = 60.0,
    ) -> None:
        n = len(dataset)
        if n == 0:
            msg = "the dataset is empty: there is nothing to cache"
            raise ValueError(msg)
        if chunk_bytes < 1:
            msg = f"chunk_bytes must be >= 1, not {chunk_bytes}"
            raise ValueError(msg)
        self.dataset = dataset
        self.prepare = prepare
        self.transform = transform
        self.version = version
        self.wait_timeout = wait_timeout
        # Decided here, once: a worker started later (a forkserver's, with the environment of when
        # its server started) asks the same daemon.
        self.socket = socket_path(socket)
        self._records = n
        self._counted = [0, 0, 0, 0]  # this process's hits, fills, waits, uncached
        # Without spec the layout is what prepare gives, so (data, prepare) name the cache; a
        # process that finds it learns the layout from it (its meta page) rather than a decode.
        named = [
            _data_identity(dataset) if key is None else f"key {key}",
            transform_identity(prepare, version),
        ]
        one = None if spec is None else Layout.from_spec(spec, 1)
        named += ["learned"] if one is None else ["spec", one.kind, one.describe()]
        h = hashlib.blake2b(digest_size=32)
        for part in (*named, str(chunk_bytes)):
            h.update(part.encode("utf-8", "surrogatepass") + b"\0")
        self.identity = h.hexdigest()
        self._start()
        self._first = None  # record 0's output when decoded to learn the layout: its first fill
        if one is None:
            one = self._learn()
        if one is None:
            self._first = prepare(dataset[0])
            one = Layout.from_sample(self._first, 1)
        row_bytes = 8 + sum(f.row_bytes for f in one.fields)
        rows = max(1, min(n, chunk_bytes // row_bytes, MAX_CACHE_ROWS))
        if -(-n // rows) > MAX_CHUNKS:  # a huge cache: larger chunks, not more of them
            rows = min(MAX_CACHE_ROWS, -(-n // MAX_CHUNKS))
        self.rows = rows
        fields = [(f.key, f.shape, f.dtype) for f in one.fields]
        self.layout = Layout(one.kind, fields, rows, one.seq_type)
        self._last = Layout(one.kind, fields, n - (self.chunks - 1) * rows, one.seq_type)
        self._tell_layout()  # the cache was found before its layout was told (its teller died)

    @property
    def chunks(self) -> int:
        return -(-self._records // self.rows)

    def _start(self) -> None:
        """This process's view of the cache: nothing mapped yet (a new process, or a forked child)."""
        self._pid = os.getpid()
        self._session: DaemonSession | None = None
        self._token = 0
        self._meta: np.ndarray[Any, Any] | None = None
        self._meta_mem: mmap.mmap | None = None
        self._chunks: dict[int, _Chunk] = {}  # the chunks this process maps
        self._pending = [0, 0, 0, 0]  # counts not yet added to the meta page
        self._off: str | None = None  # why this process reads uncached (the daemon refused or left)
        self._claims = True  # False once the daemon is gone: no one would reset a claim of ours
        self._conn: object | None = None  # the connection its token belongs to
        self._no_room_until = 0.0  # no part asked for before then: the daemon had no room

    def __getstate__(self) -> dict[str, Any]:
        keep = ("_records", "_last")
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_") or k in keep}
        state["_counted"] = [0, 0, 0, 0]
        state["_first"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._start()

    def __len__(self) -> int:
        return self._records

    def __repr__(self) -> str:
        return (
            f"DecodedCache({self._records} records of [{self.layout.describe()}], {self.rows} a chunk, "
            f"cache {self.identity[:12]})"
        )

    def counts(self) -> dict[str, int]:
        """This process's reads so far: ``hits`` (from the cache), ``fills`` (decoded and written),
        ``waits`` (another process was writing the record), ``uncached`` (decoded, not cached).
        Record 0, when the constructor decoded it to learn the layout, is filled at the first use,
        so the read that follows is a hit."""
        return dict(zip(_COUNTS, self._counted, strict=True))

    # -- reading -------------------------------------------------------------------------------

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        if os.getpid() != self._pid:
            self._start()  # a forked child: its own connection, token and mappings
            self._counted = [0, 0, 0, 0]
        elif self._conn is not None and (self._session is None or self._session.conn is not self._conn):
            # The session's connection was replaced (a failed exchange, or a new daemon): the daemon
            # reset the old one's claims, so its token must not claim again. Start over on the new one.
            self._start()
        out: list[Any] = [None] * len(indices)
        waiting: list[tuple[int, int, _Chunk, int]] = []
        try:
            for j, index in enumerate(indices):
                i = self._index(index)
                k, r = divmod(i, self.rows)
                chunk = self._chunk(k)
                if chunk is None:
                    out[j] = self._uncached(i)
                    continue
                state = self._look(chunk, r)
                if state == _core.CLAIM_READY:
                    out[j] = self._row(chunk, r)
                    self._count(_HITS)
                elif state == _core.CLAIM_EMPTY and self._claims:
                    out[j] = self._fill(chunk, i, r)
                elif self._claims:
                    waiting.append((j, i, chunk, r))  # another process writes it: read the others first
                else:
                    out[j] = self._uncached(i)
            for j, i, chunk, r in waiting:
                out[j] = self._wait(chunk, i, r)
        finally:
            self._flush()
        if self.transform is not None:
            return [self.transform(sample) for sample in out]
        return out

    def _index(self, index: Any) -> int:
        i = int(index)
        if i < 0:
            i += self._records
        if not 0 <= i < self._records:
            msg = f"record {index} of {self._records}"
            raise IndexError(msg)
        return i

    def _row(self, chunk: _Chunk, r: int) -> Any:
        return self.layout.sample([f[r, ...] for f in chunk.read_only])

    def _look(self, chunk: _Chunk, r: int) -> int:
        """Record `r`'s word: claimed for this process if it was empty (while this process may claim)."""
        return _core.claim(chunk.words, r, self._token) if self._claims else _core.claim_state(chunk.words, r)

    def _decode(self, i: int) -> Any:
        if i == 0 and self._first is not None:
            first, self._first = self._first, None
            return first
        return self.prepare(self.dataset[i])

    def _uncached(self, i: int) -> Any:
        self._count(_UNCACHED)
        return self._as_cached(self._decode(i))

    def _as_cached(self, out: Any) -> Any:
        """What the cache would have given for `out`: the layout's shapes and dtypes, read-only."""
        rows = [np.empty((1, *f.shape), f.dtype) for f in self.layout.fields]
        self.layout.write(rows, 0, out)
        for row in rows:
            row.flags.writeable = False  # as a hit's: a transform that writes its input fails alike
        return self.layout.sample([row[0, ...] for row in rows])

    def _fill(self, chunk: _Chunk, i: int, r: int) -> Any:
        """Decode record `i`, claimed by this process, into row `r`, and publish it."""
        try:
            value = self._decode(i)
            self.layout.write(chunk.fields, r, value)
        except BaseException:
            _core.claim_abandon(chunk.words, r, self._token)  # another process may decode it
            raise
        if not _core.claim_publish(chunk.words, r, self._token):
            # The daemon reset our claim (it took this process's connection for closed): another
            # process may be writing the row now, so this one's is not published, nor read back.
            self._count(_UNCACHED)
            return self._as_cached(value)
        self._count(_FILLS)
        return self._row(chunk, r)

    def _wait(self, chunk: _Chunk, i: int, r: int) -> Any:
        """Record `i` is being written by another process: its row once published (or decoded here,
        if that process died and the daemon gave the record back)."""
        self._count(_WAITS)
        start = time.monotonic()
        delay, check = 20e-6, start + _ALIVE_S
        while True:
            state = self._look(chunk, r)
            if state == _core.CLAIM_READY:
                self._count(_HITS)
                return self._row(chunk, r)
            if state == _core.CLAIM_EMPTY and self._claims:
                return self._fill(chunk, i, r)  # its claimant died: this process decodes it
            if time.monotonic() >= check:
                if self._daemon_gone():
                    return self._uncached(i)  # no one will reset a dead claimant's claim now
                if time.monotonic() - start > self.wait_timeout:
                    log.warning(
                        "DecodedCache %s: record %d has been written by another process (token %d) for "
                        "%.0f s: decoded here, not cached (is that process stopped?)",
                        self.identity[:12],
                        i,
                        state,
                        self.wait_timeout,
                    )
                    return self._uncached(i)
                check = time.monotonic() + _ALIVE_S
            time.sleep(delay)
            delay = min(2 * delay, 2e-3)

    def _count(self, what: int) -> None:
        self._counted[what] += 1
        self._pending[what] += 1

    def _flush(self) -> None:
        if self._meta is None:
            return
        for what, n in enumerate(self._pending):
            if n:
                _core.counter_add(self._meta, what, n)
                self._pending[what] = 0

    # -- the daemon ------------------------------------------------------------------------------

    def _chunk(self, k: int) -> _Chunk | None:
        got = self._chunks.get(k)
        if got is not None:
            return got
        if self._off is not None:
            return None
        if time.monotonic() < self._no_room_until and not self._served(k):
            return None  # the daemon had no room a moment ago: only chunks others made are asked for
        if self._meta is None:
            meta = self._ask({"chunk": _META, **self._geometry()})
            if meta is None:
                return None
            self._use_meta(meta[0])
            if self._first is not None and k != 0:
                self._chunk(0)  # record 0, decoded to learn the layout, is its first fill
        part = self._ask({"chunk": k, **self._geometry()}, read_only=True)
        if part is None:
            return None
        mem, view = part
        assert view is not None
        layout = self._last if k == self.chunks - 1 else self.layout
        words, fields = layout.numpy_views(np.frombuffer(mem, np.uint8), 0)
        # What readers get views of: a second mapping, read-only, so that a transform that writes
        # into its input (through torch.from_numpy, say) faults instead of changing the node's copy.
        _words, read_only = layout.numpy_views(np.frombuffer(view, np.uint8), 0)
        chunk = self._chunks[k] = _Chunk(mem, words, fields, read_only)
        if k == 0 and self._first is not None:
            if _core.claim(words, 0, self._token) == _core.CLAIM_EMPTY:
                self._fill(chunk, 0, 0)
            self._first = None
        return chunk

    def _served(self, k: int) -> bool:
        """Whether the daemon serves chunk `k` already (its bit in the meta page)."""
        mem = self._meta_mem
        at = _CHUNK_BITS + k // 8
        return mem is not None and at < len(mem) and bool(mem[at] & (1 << (k % 8)))

    def _geometry(self) -> dict[str, int]:
        return {
            "records": self._records,
            "rows": self.rows,
            "slot_bytes": self.layout.slot_bytes,
            "last_bytes": self._last.slot_bytes,
        }

    def _use_meta(self, mem: mmap.mmap) -> None:
        """This process maps the cache's meta page: its counters, and the layout it tells others."""
        self._meta_mem = mem
        self._meta = np.frombuffer(mem, np.uint64, len(_COUNTS))
        if hasattr(self, "layout"):  # not while the constructor learns it
            self._tell_layout()

    def _tell_layout(self) -> None:
        """Write the layout into the meta page once, for the processes that learn it there."""
        mem = self._meta_mem
        if mem is None or self.layout.seq_type is not None or any(f.dtype.fields for f in self.layout.fields):
            return  # a namedtuple's class, a structured dtype's fields are not told: they decode record 0
        word = np.frombuffer(mem, np.int64, 1, _LAYOUT_WORD)
        text = _layout_json(self.layout)
        if len(text) > _CHUNK_BITS - _LAYOUT_AT or _core.claim(word, 0, self._token) != _core.CLAIM_EMPTY:
            return
        mem[_LAYOUT_AT : _LAYOUT_AT + len(text)] = text
        np.frombuffer(mem, np.uint64, 1, _LAYOUT_LENGTH)[0] = len(text)
        _core.claim_publish(word, 0, self._token)

    def _learn(self) -> Layout | None:
        """The layout of the cache if it exists already (told by its meta page, mapped here for good),
        or None: then this process decodes record 0 to learn it."""
        got = self._ask({"chunk": _META, "lookup": True})
        if got is None:
            return None
        mem = got[0]
        self._use_meta(mem)
        word = np.frombuffer(mem, np.int64, 1, _LAYOUT_WORD)
        ready = _core.claim_state(word, 0) == _core.CLAIM_READY  # acquire: then the length and text
        length = int(np.frombuffer(mem, np.uint64, 1, _LAYOUT_LENGTH)[0])
        if not ready or not 0 < length <= _CHUNK_BITS - _LAYOUT_AT:
            return None  # being written this moment, or never told (a namedtuple)
        try:
            return _layout_from_json(bytes(mem[_LAYOUT_AT : _LAYOUT_AT + length]))
        except (ValueError, TypeError, CollateError) as e:
            log.warning(
                "DecodedCache %s: its meta page tells no layout (%s): decoding record 0",
                self.identity[:12],
                e,
            )
            return None

    def _ask(
        self, fields: dict[str, Any], *, read_only: bool = False
    ) -> tuple[mmap.mmap, mmap.mmap | None] | None:
        """A part of the cache mapped writable (the meta page for chunk -1), and with `read_only`
        mapped read-only too; or None: no room for it (asked again a second later), not found (a
        lookup), or no daemon serving it (this process then reads uncached)."""
        message = {"op": "cache", "cache": self.identity, **fields}
        try:
            if self._session is None:
                self._session = session_for(self.socket)
            reply, fd = self._session.ask(message, 30.0)
        except DaemonError as e:
            self._turn_off(f"no daemon serves it ({e})")
            return None
        conn = self._session.conn
        if fd is None:
            if not reply.get("ok"):
                self._turn_off(f"the daemon refused it: {reply.get('message', reply.get('error'))}")
            elif reply.get("room") is False:
                self._no_room_until = time.monotonic() + _RETRY_S  # for every part: one question a second
            return None
        try:
            if self._conn is not None and conn is not self._conn:
                # The session reconnected meanwhile (a failed exchange, or a new daemon): the old
                # connection's claims were reset; the next read starts over on this one.
                self._start()
                return None
            size = os.fstat(fd).st_size
            if size != reply.get("size"):
                self._turn_off(f"the daemon sent a part of {size} bytes, not {reply.get('size')}")
                return None
            mem = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            view = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) if read_only else None
        except OSError as e:  # out of mappings (vm.max_map_count) or memory
            self._turn_off(f"cannot map a part of it: {e}")
            return None
        finally:
            os.close(fd)
        self._token, self._conn = int(reply["token"]), conn
        return mem, view

    def _turn_off(self, why: str) -> None:
        self._claims = False  # whatever the cause, no one may be there to reset a claim of ours
        if self._off is None:
            log.warning(
                "DecodedCache %s: reading uncached in pid %d: %s", self.identity[:12], os.getpid(), why
            )
        self._off = why

    def _daemon_gone(self) -> bool:
        """Whether the daemon closed this process's connection (it died): then no one resets a dead
        claimant's claim, and this process stops claiming (it reads what is ready, decodes the rest)."""
        session = self._session
        conn = None if session is None else session.conn
        gone = conn is None
        if conn is not None:
            with contextlib.suppress(OSError):
                ready, _, _ = select.select([conn], [], [], 0)
                gone = (
                    bool(ready) and conn.recv(1, socket_module.MSG_PEEK | socket_module.MSG_DONTWAIT) == b""
                )
        if gone:
            self._claims = False
            self._turn_off("the daemon is gone")
        return gone


# -- the layout a meta page tells ------------------------------------------------------------------------


def _layout_json(layout: Layout) -> bytes:
    fields = [[f.key, list(f.shape), f.dtype.str] for f in layout.fields]
    return json.dumps({"kind": layout.kind, "fields": fields}, separators=(",", ":")).encode()


def _layout_from_json(text: bytes) -> Layout:
    """A one-row Layout from `_layout_json`'s text, every part checked (another process wrote it).

    Raises:
        ValueError, TypeError: Anything but a layout `_layout_json` writes.
    """
    doc = json.loads(text)
    if not isinstance(doc, dict):
        msg = "not a layout"
        raise TypeError(msg)
    kind, fields = doc.get("kind"), doc.get("fields")
    if kind not in ("single", "dict", "seq") or not isinstance(fields, list) or not 0 < len(fields) <= 1024:
        msg = "not a layout"
        raise ValueError(msg)
    out: list[tuple[str | int | None, tuple[int, ...], np.dtype[Any]]] = []
    for n, field in enumerate(fields):
        key, shape, dtype = field
        want = {"single": key is None and len(fields) == 1, "dict": isinstance(key, str), "seq": key == n}
        if not want[kind] or not isinstance(shape, list) or len(shape) > 32:
            msg = f"field {n}: not a field of a {kind} layout"
            raise ValueError(msg)
        if not all(type(d) is int and 0 <= d < 1 << 31 for d in shape) or not isinstance(dtype, str):
            msg = f"field {n}: a bad shape or dtype"
            raise ValueError(msg)
        out.append((key, tuple(shape), np.dtype(dtype)))
    return Layout(kind, out, 1)
