"""smstore.Loader: TokenCollator's batches made by C++ threads into reused buffers, with no worker processes."""

from __future__ import annotations

import itertools
import operator
import os
import sys
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from smstore import _core
from smstore.errors import RecordIndexError, StoreChangedError, StoreClosedError
from smstore.loading.collate import TokenCollator
from smstore.loading.stats import LoaderStats
from smstore.wire import fork as _fork

__all__ = ["Loader"]

# Loaders of this process, so that a fork can tell each that its threads stayed behind.
_LIVE: weakref.WeakSet[Loader] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for loader in list(_LIVE):
        loader._forked()


_fork.in_child(_after_fork_in_child)


class Loader:
    """Batches exactly as ``DataLoader(range(n), sampler=S, batch_size=B, collate_fn=TokenCollator(...))``
    yields them, made by C++ threads instead of worker processes.

    The threads (and the loop's thread, when it would otherwise wait) gather each batch's records
    straight from the store's mapping and pad or pack them (TokenCollator's options, widening
    included) into a ring of ``depth + 2`` reused buffers, at most ``depth`` batches ahead of the
    loop, with the GIL released. The indices come from the
    sampler in chunks, so any sampler works (``GlobalShuffleSampler``, ``WindowedShuffleSampler``,
    ``MixtureSampler``, a list): ours hand over each chunk as an int64 array (no Python int per
    index; the same pass, state and hooks as ``iter(sampler)``), any other iterable is drawn index
    by index; each ``iter(loader)`` is a new pass of it, as with a DataLoader::

        loader = smstore.Loader("tokens.smst", sampler=GlobalShuffleSampler(n, seed=0),
                                batch_size=256, dtype=torch.long, max_length=2048)
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            for batch in loader:   # {"tokens", "lengths", "indices"}, as TokenCollator gives
                ...

    **Buffer lifetime.** A batch's ``tokens`` are a view of a ring buffer, not a copy (its
    ``lengths``, ``cu_seqlens`` and ``indices`` are small copies: keeping them holds no buffer).
    The buffer is refilled only once nothing refers to it any more: while the tokens of a batch
    (or a view of them) are alive, its buffer is left alone and the ring takes a new one in its
    place. So a yielded batch is valid for as long as you hold it, and when the loop drops each
    batch before it takes the next but one (as ``for batch in loader`` does), the memory stays
    ``depth + 2`` buffers. One exception: a copy to a GPU with ``non_blocking=True`` reads the buffer after
    Python has let go of it; keep the batch referenced until that copy is done (a loop that reads
    ``loss.item()`` each step has synchronized long before the buffer comes round again,
    ``depth`` batches later).

    **Resume.** :meth:`state_dict` is the sampler's state at the batches the loop has *received*
    (not those prefetched) plus the store's checksum; :meth:`load_state_dict` hands it to the
    sampler, so the next pass starts there, at any world size (torchdata's ``StatefulDataLoader``
    protocol). It needs a sampler with ``state_dict(local_consumed=)`` (ours).

    **Processes.** ``close()`` (or ``with``, a new pass, or dropping the loader) stops and joins
    the threads and frees the ring; the Loader makes no shared-memory segment or descriptor. After ``os.fork()`` the child has no copy of the threads: a pass the parent
    had started raises ``StoreClosedError`` in the child, and a new ``iter(loader)`` there starts
    fresh threads.

    Args:
        source: What ``TokenCollator`` takes: a ``.smst`` path or a sharded dataset's manifest, a
            ``SharedStoreDataset`` or an open ``Store`` or ``ShardedStore``; or a ``TokenWindows``,
            a ``PackedBins``, a ``MixtureDataset`` or a ``BlockReader`` (below). Leave it out when passing ``collate``.
        sampler: An iterable of record indices (by default ``range(len(store))``).
        batch_size: Records per batch; the last batch of a pass is shorter unless ``drop_last``.
        collate: A ``TokenCollator`` whose options (and store) to use; otherwise ``collate_options``
            make one (``layout``, ``pad_value``, ``max_length``, ``truncation``, ``padding_side``,
            ``pad_to_multiple_of``, ``fixed_length``, ``dtype``, ``return_indices``, ``mode``,
            ``socket``).
        drop_last: Drop the last, short batch of a pass.
        depth: Batches prepared ahead of the loop.
        threads: C++ threads preparing them, besides the loop's own thread, which makes the next
            batch no thread has started while the one it asks for is not ready. The threads work
            ahead while the loop spends longer between batches than twice a batch takes to make
            (a training step), or a batch takes 50 us or more; a loop that only asks for small
            batches makes them itself, as fast as with 0. One (the default) keeps up with a
            training loop for short records on a small machine; give more for long records or many
            cores. With 0, each batch is made on the loop's thread when asked for.
        pin_memory: Page-locked buffers, when ``torch.cuda.is_available()`` (ignored otherwise).

    **Token windows.** ``Loader(windows, sampler=S, batch_size=B)`` over a
    :class:`~smstore.TokenWindows` yields ``{"tokens": [B, length + 1], "indices": [B]}``: the
    tokens byte for byte what ``DataLoader(windows, sampler=S, batch_size=B)``'s default collate
    stacks (the windows' dtype), each window located by the threads from the offsets indexes (the
    rule of ``TokenWindows.locate``) and gathered as segments of documents with the eod token
    between them. No collate options: a window is given as it is. Windows over documents shuffled
    per epoch (``seed=``) are located by the threads in the same order as ``TokenWindows.locate``
    (the same groups and keys); each pass reads the windows' epoch when it starts, and
    :meth:`set_epoch` sets it.

    **Packed bins.** ``Loader(bins, sampler=S, batch_size=B)`` over a padded
    :class:`~smstore.PackedBins` yields ``PackedBins.collate``'s batch byte for byte as tensors
    (``tokens``, ``position_ids``, ``cu_seqlens``, ``segments``) plus ``indices``: each batch's
    segments from ``bins.batch_segments`` on the loop's thread, the tokens gathered by the threads.

    **Mixtures.** ``Loader(mixture, sampler=MixtureSampler(mixture, ...), batch_size=B, **options)``
    over a :class:`~smstore.sampling.MixtureDataset` whose sources are blobs or sharded datasets
    (stores or ``SharedStoreDataset``) of one record dtype: the batches of the DataLoader
    over the ``MixtureDataset`` with ``TokenCollator(**options)`` collating its records (plus
    ``indices``, the mixture's), the sources read as one run of records.

    **Block windows.** Under a ``BlockWindowSampler``, pass the ``BlockReader`` a DataLoader
    worker would read through (``smstore.wire.blocks``) as the source: each block a batch reads
    is the daemon's piece, else a run of its shard's file, handed over by the reader on the
    loop's thread before the batch is queued.

    **Sharded datasets.** A manifest (or a ``SharedStoreDataset`` of one) is read the same way:
    before a chunk of batches is queued, the shards its records lie in are opened on the loop's
    thread through the dataset's own opener (the daemon's copy, waited for as a DataLoader worker
    would wait, or the file; each checked against the manifest), and every queued batch keeps the
    shards it reads mapped until it is made, even if the dataset releases them meanwhile (its
    ``auto_release`` counts the Loader's reads as its own).

    Raises:
        ValueError: Options the C++ batcher cannot do (bfloat16 tokens, float records to integer
            tokens: use a DataLoader with ``TokenCollator`` for those); a mixture's sources of
            different record dtypes; packed bins not padded (``pad=None``).
        TypeError: ``collate=`` with windows, bins or a mixture, or collate options with windows or bins.
        StoreFormatError: (while iterating) windows made over other data than their store holds,
            or a document that is not a whole number of tokens.
        RecordIndexError: (while iterating) the sampler gave an index outside the dataset (or bins).
        StoreChangedError: (while iterating) a shard differs from the manifest's record of it.
        StoreError: (while iterating) a shard could not be opened (missing, or the daemon cannot
            serve it): what ``TokenCollator`` in a DataLoader worker raises.
    """

    def __init__(
        self,
        source: Any = None,
        *,
        sampler: Iterable[int] | None = None,
        batch_size: int = 1,
        collate: TokenCollator | None = None,
        drop_last: bool = False,
        depth: int = 4,
        threads: int = 1,
        pin_memory: bool = False,
        **collate_options: Any,
    ) -> None:
        for name, value, least in (
            ("batch_size", batch_size, 1),
            ("depth", depth, 1),
            ("threads", threads, 0),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                msg = f"{name} must be an integer >= {least}, not {value!r}"
                raise ValueError(msg)
        windows = source if _is_instance(source, "smstore.read.tokens", "TokenWindows") else None
        bins = source if _is_instance(source, "smstore.read.packing", "PackedBins") else None
        mixture = source if _is_instance(source, "smstore.sampling.mixture", "MixtureDataset") else None
        blocks = source if _is_instance(source, "smstore.wire.blocks", "BlockReader") else None
        given = windows if windows is not None else bins  # samples given as they are, no collate options
        if (given is not None or mixture is not None or blocks is not None) and collate is not None:
            msg = f"pass {source!r} alone (with TokenCollator's options for a mixture), not with collate="
            raise TypeError(msg)
        store: Any
        if given is not None:
            if collate_options:
                msg = f"{given!r} gives its samples as they are: pass no TokenCollator options"
                raise TypeError(msg)
            spec, store, count = given.batch_spec(), given.store, len(given)
            if spec is None:
                why = (
                    "bins not padded do not stack: make PackedBins with a pad token"
                    if bins is not None and bins.pad is None
                    else "tokens not in native byte order: use a DataLoader"
                )
                msg = f"smstore.Loader cannot batch {given!r} ({why})"
                raise ValueError(msg)
        else:
            if mixture is not None:
                # One collator per source: the same options, and the same record dtype, or refused.
                collators = [TokenCollator(s, **collate_options) for s in mixture.sources]
                collate, store, count = collators[0], [c.store for c in collators], len(mixture)
                dtypes = {c.record_dtype for c in collators}
                if len(dtypes) > 1:
                    msg = f"{mixture!r}: its sources hold records of {sorted(map(str, dtypes))}; one dtype is needed"
                    raise ValueError(msg)
            elif blocks is not None:
                # The manifest's encoding and checksum (no shard opened: shards in object storage
                # are opened through the daemon); the records are read through the reader.
                mode = "daemon" if any(blocks.remote) else "mmap"
                collate = TokenCollator(
                    blocks.path, **{"mode": mode, "socket": blocks.socket, **collate_options}
                )
                store, count = collate.store, len(blocks)
            elif collate is None:
                if source is None:
                    msg = "Loader needs a source (a path, dataset or Store) or a collate=TokenCollator(...)"
                    raise TypeError(msg)
                collate = TokenCollator(source, **collate_options)
                store, count = collate.store, len(collate)
            elif source is not None or collate_options:
                msg = "pass either collate= or a source with TokenCollator's options, not both"
                raise TypeError(msg)
            else:
                store, count = collate.store, len(collate)
            spec = collate.batch_spec()
            if spec is None or (mixture is not None and not all(c.batch_spec() for c in collators)):
                msg = (
                    f"smstore.Loader cannot batch {collate!r} (records {collate.record_dtype}, tokens "
                    f"{collate.dtype}, store {type(collate.store).__name__}): it reads integer or float records "
                    "into integer or float tokens; use DataLoader(collate_fn=TokenCollator(...))"
                )
                raise ValueError(msg)
        self.collate = collate
        self.windows = windows
        self.bins = bins
        self.mixture = mixture
        self.store = store  # the data: a Store, a ShardedStore, or a mixture's list of them
        self._reads: Any = blocks if blocks is not None else store  # what the C++ batcher reads
        self.sampler: Iterable[int] = sampler if sampler is not None else range(count)
        self.batch_size = batch_size
        self.drop_last = bool(drop_last)
        self.depth = depth
        self.threads = threads
        self._spec = spec
        self._pinned = bool(pin_memory) and _cuda_available() and _core.pinned_blocks_available()
        self._copy_to_pinned = bool(pin_memory) and _cuda_available() and not self._pinned
        self._batcher: _core.Batcher | None = None
        self._pass = 0  # passes started; a generator of an older pass stops
        self._stats = LoaderStats()
        self._received = 0  # batches of the current pass handed to the loop
        self._exhausted = False
        self._pid = os.getpid()
        _LIVE.add(self)

    # -- iteration --------------------------------------------------------------------------

    def __len__(self) -> int:
        """Batches in the next pass (``len(sampler)`` must be known)."""
        n = len(self.sampler)  # type: ignore[arg-type]
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._stop_threads()
        self._pass += 1
        self._received, self._exhausted = 0, False
        self._pid = os.getpid()
        if self.windows is not None and self.windows.seed is not None:
            # The document order of the windows' epoch now (set_epoch, here or on the windows).
            self._spec = self.windows.batch_spec()
        batcher = _core.Batcher(self._reads, self._spec, self.threads, self.depth, self._pinned)
        self._batcher = batcher
        ours = sys.modules.get("smstore.sampling.sampler")  # not loaded: the sampler is not one of ours
        if self.bins is not None:
            # Bins' segments come from the packer in Python, a batch at a time; C++ gathers them.
            segments: deque[np.ndarray[Any, np.dtype[np.int64]]] = deque()
            feed = _bins_feed(batcher, self.bins, iter(self.sampler), segments)
            run = self._run(self._pass, batcher, feed, segments)
        elif ours is not None and isinstance(self.sampler, ours.GlobalShuffleSampler):
            # Our samplers hand their chunks over as int64 arrays: no Python int per index.
            run = self._run(self._pass, batcher, _array_feed(batcher, self.sampler._chunks()))
        else:
            run = self._run(self._pass, batcher, _iterator_feed(batcher, iter(self.sampler)))
        return self._stats.wrap(run)

    def stats(self) -> LoaderStats:
        """How long the loop waited for each batch and the share of its steps that was (every pass)."""
        return self._stats

    def _run(
        self,
        token: int,
        batcher: _core.Batcher,
        feed: _Feed,
        segments: deque[np.ndarray[Any, np.dtype[np.int64]]] | None = None,
    ) -> Iterator[dict[str, Any]]:
        import torch

        # The per-batch work on the loop's thread is kept to a few operations: batches are queued
        # in chunks (the index count kept here, not asked of C++ per batch), and each is turned
        # into tensors inline (what batch_tensors does).
        from_numpy = torch.from_numpy
        pack = self.collate is not None and self.collate.layout == "pack"
        windows = self.windows is not None  # {"tokens", "indices"}: the windows' default collate
        pid, chunk, depth, size = self._pid, max(self.depth, 8), self.depth, self.batch_size
        drop_last, copy_to_pinned = self.drop_last, self._copy_to_pinned
        take = batcher.next
        exhausted, pending = False, 0  # pending: batches queued and not yet received
        try:
            while True:
                if token != self._pass or os.getpid() != pid:
                    self._check_usable(pid)
                    return  # a newer pass replaced this one
                if not exhausted and pending <= depth:
                    queued, exhausted = feed(size, chunk, drop_last)
                    pending += queued
                if not pending:
                    break
                tokens, lengths, cu_seqlens, ids = take()
                pending -= 1
                batch = {"tokens": from_numpy(tokens)}
                if segments is not None:  # packed bins: PackedBins.collate's keys, then indices
                    batch["position_ids"] = from_numpy(lengths)
                    batch["cu_seqlens"] = from_numpy(cu_seqlens)
                    batch["segments"] = from_numpy(segments.popleft())
                elif pack:
                    batch["cu_seqlens"] = from_numpy(cu_seqlens)
                if not windows and segments is None:
                    batch["lengths"] = from_numpy(lengths)
                if ids is not None:
                    batch["indices"] = from_numpy(ids)
                if copy_to_pinned:
                    batch = {k: v.pin_memory() for k, v in batch.items()}
                self._received += 1
                yield batch
            self._exhausted = True
        finally:
            if token == self._pass and os.getpid() == pid:
                self._stop_threads()

    def _check_usable(self, pid: int) -> None:
        if os.getpid() != pid:
            msg = (
                f"this pass of the Loader began in process {pid}, before a fork(): its threads do not exist "
                "in this child. Start a new pass (iter(loader)) here, or make the Loader after forking"
            )
            raise StoreClosedError(msg)

    def set_epoch(self, epoch: int) -> None:
        """``sampler.set_epoch(epoch)``, for samplers that have it, and ``windows.set_epoch(epoch)``
        for token windows with documents shuffled per epoch: the next pass reads that epoch's order."""
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        if self.windows is not None and self.windows.seed is not None:
            self.windows.set_epoch(epoch)

    # -- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state after the batches the loop received in this pass, and the store's checksum.

        Raises:
            TypeError: The sampler has no ``state_dict(local_consumed=)``.
        """
        state_of = getattr(self.sampler, "state_dict", None)
        if not callable(state_of):
            msg = f"{type(self.sampler).__name__} has no state_dict(): use a GlobalShuffleSampler (or a subclass)"
            raise TypeError(msg)
        local = sys.maxsize if self._exhausted else self._received * self.batch_size
        state = dict(state_of(local_consumed=local))
        state["store_checksum"] = _checksum(self.store)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next pass starts where ``state`` (from :meth:`state_dict`) left off.

        Raises:
            StoreChangedError: The state was saved over other data.
            ValueError: The sampler refuses the state (another dataset size, malformed).
        """
        checksum, ours = state.get("store_checksum"), _checksum(self.store)
        if checksum is not None and checksum != ours:
            paths = (
                ", ".join(str(s.path) for s in self.store)
                if isinstance(self.store, list)
                else self.store.path
            )
            msg = (
                f"{paths}: the loader state was saved over data with checksum {checksum}, "
                f"this data has {ours}: its positions would name other records"
            )
            raise StoreChangedError(msg)
        load = getattr(self.sampler, "load_state_dict", None)
        if not callable(load):
            msg = f"{type(self.sampler).__name__} has no load_state_dict()"
            raise TypeError(msg)
        self._stop_threads()
        self._pass += 1  # a pass under way ends here
        load({k: v for k, v in state.items() if k != "store_checksum"})

    # -- shutdown ---------------------------------------------------------------------------

    def _stop_threads(self) -> None:
        batcher, self._batcher = self._batcher, None
        if batcher is not None:
            batcher.close()

    def _forked(self) -> None:
        """In a forked child: the threads stayed in the parent; forget them (C++ leaks their state)."""
        self._batcher = None

    def close(self) -> None:
        """Stop and join the threads and free the ring (batches already yielded stay valid)."""
        self._pass += 1
        self._stop_threads()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        batcher = getattr(self, "_batcher", None)
        if batcher is not None:
            batcher.close()

    def __repr__(self) -> str:
        return (
            f"Loader({self.windows or self.bins or self.mixture or self.collate!r}, batch_size={self.batch_size}, depth={self.depth}, "
            f"threads={self.threads}, pinned={self._pinned})"
        )


# Queues up to max_batches batches of batch_size indices from the sampler: (batches queued, whether
# the sampler is exhausted). The last, short batch is queued unless drop_last.
_Feed = Callable[[int, int, bool], tuple[int, bool]]


def _iterator_feed(batcher: _core.Batcher, indices: Iterator[int]) -> _Feed:
    """Any sampler: C++ draws its indices one by one (a list behind ``yield from`` in bulk)."""
    submit_from = batcher.submit_from

    def feed(size: int, max_batches: int, drop_last: bool) -> tuple[int, bool]:
        return submit_from(indices, size, max_batches, drop_last)

    return feed


def _bins_feed(
    batcher: _core.Batcher,
    bins: Any,
    indices: Iterator[int],
    queued_segments: deque[np.ndarray[Any, np.dtype[np.int64]]],
) -> _Feed:
    """Packed bins: each batch's bins drawn from the sampler, their segments packed in Python
    (PackedBins.batch_segments) as PackedBins.collate lists them, ``(row, document, first,
    count)``, and queued with the batch (kept in ``queued_segments`` for the loop, in order)."""
    submit_bins, count = batcher.submit_bins, len(bins)

    def feed(size: int, max_batches: int, drop_last: bool) -> tuple[int, bool]:
        for queued in range(max_batches):
            ids = [operator.index(k) for k in itertools.islice(indices, size)]
            if not ids or (drop_last and len(ids) < size):
                return queued, True
            bad = [k for k in ids if not 0 <= k < count]
            if bad:
                msg = (
                    f"{bins.path}: the sampler gave bin index {bad[0]}, out of range for {count} packed "
                    "bins (is it a sampler of another dataset?)"
                )
                raise RecordIndexError(msg)
            chosen = np.asarray(ids, dtype=np.int64)
            rows = bins.batch_segments(chosen)
            submit_bins(chosen, rows)
            queued_segments.append(rows)
            if len(ids) < size:
                return queued + 1, True
        return max_batches, False

    return feed


def _array_feed(batcher: _core.Batcher, chunks: Iterator[np.ndarray[Any, np.dtype[np.int64]]]) -> _Feed:
    """Our samplers' chunks (int64 arrays), drawn only as far as the batches asked for need: the
    same draws as :func:`_iterator_feed` makes of ``iter(sampler)``, so the sampler's hooks run at
    the same batches."""
    submit_array = batcher.submit_array
    rest = np.empty(0, dtype=np.int64)  # the part of the chunks drawn and not yet queued

    def feed(size: int, max_batches: int, drop_last: bool) -> tuple[int, bool]:
        nonlocal rest
        want = size * max_batches
        parts, have, exhausted = [rest] if len(rest) else [], len(rest), False
        while have < want:
            block = next(chunks, None)
            if block is None:
                exhausted = True
                break
            parts.append(block)
            have += len(block)
        if not parts:
            return 0, exhausted
        indices = parts[0] if len(parts) == 1 else np.concatenate(parts)
        if exhausted:
            rest = indices[:0]
        else:  # want is whole batches: the rest waits for the next call
            indices, rest = indices[:want], indices[want:]
        return submit_array(indices, size, drop_last), exhausted

    return feed


def _is_instance(value: Any, module: str, name: str) -> bool:
    """isinstance(value, module.name), without importing the module (not loaded: it is not one)."""
    loaded = sys.modules.get(module)
    return loaded is not None and isinstance(value, getattr(loaded, name))


def _checksum(store: Any) -> Any:
    """What a state records of the data: the store's checksum, or a mixture's sources' in order."""
    return [s.checksum for s in store] if isinstance(store, list) else store.checksum


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())
