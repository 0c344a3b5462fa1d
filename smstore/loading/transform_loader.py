"""TransformLoader: Python transforms in worker processes that fill a fixed ring of shared batch slots."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import random
import signal
import struct
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import islice
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
from torch.utils.data import Sampler, SequentialSampler

from smstore.errors import CollateError, StoreClosedError, WorkerError
from smstore.loading.decoded_cache import DecodedCache
from smstore.loading.layout import ALIGN, Layout, Spec
from smstore.loading.stats import LoaderStats
from smstore.sampling.sampler import GlobalShuffleSampler

__all__ = ["TransformLoader"]

_STATE_VERSION = 1
_TASK = struct.Struct("<qqq")  # batch number, slot, records; a negative batch number stops the worker
_DONE = struct.Struct("<qqB")  # batch number, slot, status; a failure appends a pickled payload
_OK, _BAD_RECORD, _RAISED, _SKIPPED = 0, 1, 2, 3
_STOP_ALL = 1 << 62  # the control word when the loader closes: every batch number is below it
_POLL_S = 1.0  # how often a waiting side looks whether the other one is still alive

# -- the worker side ---------------------------------------------------------------------------------


def _worker_main(
    worker_id: int,
    dataset: Any,
    transform: Callable[[Any], Any] | None,
    buffer: torch.Tensor,
    layout: Layout,
    depth: int,
    tasks: Connection,
    results: Connection,
    seed: int,
    close_fds: Sequence[int],
    worker_init_fn: Callable[[int], None] | None,
) -> None:
    """A worker's loop: read a task (batch number, slot, n), fill the slot's rows, answer in a few bytes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops us
    for fd in close_fds:  # fork: the parent's ends and the other workers' (so EOF means what it says)
        with contextlib.suppress(OSError):
            os.close(fd)
    torch.set_num_threads(1)
    random.seed(seed + worker_id)
    torch.manual_seed(seed + worker_id)
    parent = os.getppid()
    if worker_init_fn is not None:
        worker_init_fn(worker_id)
    arr = buffer.numpy()
    slots = [layout.numpy_views(arr, s) for s in range(depth)]
    # The parent's control word: batches numbered below it were abandoned (a pass left early, or
    # close()), so a worker answers them at once instead of decoding records no one will read.
    skip_below = layout.control_view(arr, depth)
    getitems = getattr(dataset, "__getitems__", None)
    while True:
        try:
            while not tasks.poll(_POLL_S):
                if os.getppid() != parent:
                    return  # the parent died without telling us
            seq, slot, n = _TASK.unpack(tasks.recv_bytes())
        except (EOFError, OSError):
            return
        if seq < 0:
            return
        if seq < skip_below[0]:
            if not _answer(results, _DONE.pack(seq, slot, _SKIPPED)):
                return
            continue
        index_view, rows = slots[slot]
        indices = index_view[:n].tolist()
        index = indices[0] if indices else -1
        try:
            samples: list[Any] = []
            if getitems is not None:
                with contextlib.suppress(Exception):  # read again one by one below, to name the record
                    samples = list(getitems(indices))
            if len(samples) != len(indices):
                samples = []
                for index in indices:  # `index` names the failing record in the handlers
                    samples.append(dataset[index])
            status = _OK
            for row, (index, sample) in enumerate(zip(indices, samples, strict=True)):  # noqa: B007
                if seq < skip_below[0]:
                    status = _SKIPPED
                    break
                layout.write(rows, row, sample if transform is None else transform(sample))
            answer = _DONE.pack(seq, slot, status)
        except CollateError as e:
            answer = _DONE.pack(seq, slot, _BAD_RECORD) + pickle.dumps((index, str(e), None))
        except Exception as e:  # noqa: BLE001 - whatever the transform raises goes to the parent
            try:
                exc: bytes | None = pickle.dumps(e)
            except Exception:  # noqa: BLE001 - an exception that does not pickle: its traceback text goes
                exc = None
            answer = _DONE.pack(seq, slot, _RAISED) + pickle.dumps((index, traceback.format_exc(), exc))
        if not _answer(results, answer):
            return


def _answer(results: Connection, message: bytes) -> bool:
    """Send the parent an answer; False when it is gone (closed its end, or died)."""
    try:
        results.send_bytes(message)
    except OSError:
        return False
    return True


# -- the parent side: the pool of workers ------------------------------------------------------------


class _WorkerPool:
    """The worker processes, their pipes and the shared ring of slots; batch k goes to worker k % K."""

    def __init__(
        self,
        dataset: Any,
        transform: Callable[[Any], Any] | None,
        layout: Layout,
        depth: int,
        num_workers: int,
        context: Any,
        worker_init_fn: Callable[[int], None] | None,
    ) -> None:
        self.layout = layout
        self.depth = depth
        # Allocated once, before the workers start: torch's shared memory (memfd-like: unlinked at
        # once, passed to spawn/forkserver children as a descriptor, inherited by fork ones).
        size = depth * layout.slot_bytes + ALIGN  # the slots, then the control word
        self.buffer = torch.zeros(size, dtype=torch.uint8).share_memory_()  # type: ignore[no-untyped-call]
        self._index = [layout.numpy_views(self.buffer.numpy(), s)[0] for s in range(depth)]
        self._skip_below = layout.control_view(self.buffer.numpy(), depth)
        self.views = [layout.tensor_views(self.buffer, s) for s in range(depth)]
        self.inflight: dict[int, int] = {}  # batch number -> worker
        self.done: dict[int, tuple[int, bytes]] = {}  # batch number -> (status, payload)
        self.procs: list[Any] = []
        self._tasks: list[Connection] = []
        self._results: list[Connection] = []
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        pipes = [(context.Pipe(duplex=False), context.Pipe(duplex=False)) for _ in range(num_workers)]
        forked = context.get_start_method() == "fork"
        all_fds = [c.fileno() for pair in pipes for p in pair for c in p]
        try:
            for w, ((task_r, task_w), (res_r, res_w)) in enumerate(pipes):
                keep = {task_r.fileno(), res_w.fileno()}
                close_fds = [fd for fd in all_fds if fd not in keep] if forked else []
                args = (w, dataset, transform, self.buffer, layout, depth, task_r, res_w, seed, close_fds)
                proc = context.Process(
                    target=_worker_main,
                    args=(*args, worker_init_fn),
                    name=f"smstore-transform-{w}",
                    daemon=True,
                )
                try:
                    proc.start()
                except (pickle.PicklingError, AttributeError, TypeError) as e:
                    msg = (
                        f"cannot send the dataset or transform to a {context.get_start_method()} worker ({e}): "
                        "define the transform at module level (not a lambda or a local function), or use "
                        "multiprocessing_context='fork'"
                    )
                    raise TypeError(msg) from e
                self.procs.append(proc)
                self._tasks.append(task_w)
                self._results.append(res_r)
        except BaseException:
            for (_, task_w), (res_r, _) in pipes:  # our ends, of workers started or not
                task_w.close()
                res_r.close()
            self.close()
            raise
        finally:
            for (task_r, _), (_, res_w) in pipes:  # the children's ends: ours must not keep them open
                task_r.close()
                res_w.close()
        self._worker_of = {p.sentinel: w for w, p in enumerate(self.procs)}
        self.closed = False
        self.base = 0  # the batch number where the current pass started (for messages)

    def dispatch(self, seq: int, indices: Sequence[int]) -> None:
        slot = seq % self.depth
        self._index[slot][: len(indices)] = indices
        worker = seq % len(self.procs)
        self.inflight[seq] = worker
        try:
            self._tasks[worker].send_bytes(_TASK.pack(seq, slot, len(indices)))
        except OSError:  # its end is closed: the worker died
            self._check_dead(worker)
            raise

    def wait_for(self, seq: int, timeout: float) -> tuple[int, bytes]:
        """The status of batch ``seq`` once its worker answered; raises if a worker died or time ran out."""
        deadline = time.monotonic() + timeout if timeout > 0 else None
        while seq not in self.done:
            left = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
            if left <= 0:
                w = self.inflight.get(seq, -1)
                msg = f"worker {w} produced no batch in {timeout} s (timeout=): it may be stuck in the transform"
                raise WorkerError(msg)
            ready = wait([*self._results, *self._worker_of], timeout=left)
            for obj in ready:
                if isinstance(obj, Connection) and not self._receive(obj):
                    # Its end is closed: the worker is gone. Say so now rather than poll the
                    # closed end (always readable) until its sentinel fires (with forkserver,
                    # only once the server has reaped it).
                    self._check_dead(self._results.index(obj))
            for obj in ready:
                if not isinstance(obj, Connection):
                    self._check_dead(self._worker_of[obj])
        self.inflight.pop(seq, None)
        return self.done.pop(seq)

    def _receive(self, conn: Connection) -> bool:
        """Take one answer from ``conn``; False once the worker's end is closed (nothing more comes)."""
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            return False  # the worker is gone: its sentinel says so
        seq, _slot, status = _DONE.unpack_from(msg)
        self.done[seq] = (status, msg[_DONE.size :])
        return True

    def _check_dead(self, worker: int) -> None:
        proc = self.procs[worker]
        conn = self._results[worker]
        with contextlib.suppress(EOFError, OSError):
            # What it finished before it died still counts. A closed end polls as readable forever:
            # stop at its end of file.
            while conn.poll() and self._receive(conn):
                pass
        proc.join(5.0)  # its sentinel closes a moment before it can be reaped
        code = proc.exitcode
        lost = sorted(s for s, w in self.inflight.items() if w == worker and s not in self.done)
        how = (
            f"was killed by {signal.Signals(-code).name}"
            if code is not None and code < 0
            else f"exited ({code})"
        )
        work = f"with batch {lost[0] - self.base} in hand" if lost else "while idle"
        msg = (
            f"TransformLoader worker {worker} (pid {proc.pid}) {how} {work}: out of memory (see dmesg), "
            "a crash in native code, or a signal from outside; the loader is shut down"
        )
        raise WorkerError(msg)

    def drain(self, timeout: float) -> None:
        """Abandon the batches under way (their workers skip them, or stop within a record) and
        wait for their answers, so that their slots are free again."""
        if self.inflight:
            self._skip_below[0] = max(self.inflight) + 1
        for seq in sorted(self.inflight):
            if seq not in self.done:
                self.wait_for(seq, timeout)
        self.inflight.clear()
        self.done.clear()

    def close(self) -> None:
        """Stop the workers (asked, then terminated, then killed) and close every pipe."""
        if getattr(self, "closed", False):
            return
        self.closed = True
        if hasattr(self, "_skip_below"):
            self._skip_below[0] = _STOP_ALL  # the workers drop what is queued and reach the stop
        for conn in self._tasks:
            with contextlib.suppress(OSError):
                conn.send_bytes(_TASK.pack(-1, 0, 0))
        deadline = time.monotonic() + 5.0
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
            proc.close()
        for conn in (*self._tasks, *self._results):
            conn.close()
        self.procs, self._tasks, self._results = [], [], []
        self.views, self._index = [], []
        with contextlib.suppress(AttributeError):
            del self.buffer, self._skip_below


# -- the loader ---------------------------------------------------------------------------------------


class _Prepared:
    """``transform(prepare(record))``: the two parts of a transform, uncached (picklable)."""

    def __init__(self, prepare: Callable[[Any], Any], transform: Callable[[Any], Any] | None) -> None:
        self.prepare, self.transform = prepare, transform

    def __call__(self, record: Any) -> Any:
        out = self.prepare(record)
        return out if self.transform is None else self.transform(out)


class TransformLoader:
    """Batches of decoded records, transformed in worker processes, handed over in O(1) per batch.

    Yields exactly what ``DataLoader(dataset, batch_size=..., sampler=..., num_workers=...)`` with
    the default ``collate_fn`` yields when each record goes through ``transform``, in the same
    order. The difference is the hand-over: a DataLoader worker makes a new shared-memory tensor
    for every batch, whose descriptor the parent receives, maps and frees (milliseconds a batch);
    here the workers write their records' outputs in place into a ring of ``depth`` batch slots
    allocated once, and send the parent a 24-byte message. The parent yields tensors that view
    the slot.

    **Layout.** Every record's output must have one structure and shape: an array (numpy, a CPU
    tensor or a number), a dict of them, or a tuple of them (batched as default_collate does: a
    tensor, a dict of tensors, a list of tensors). It is declared by ``spec`` or inferred from the
    output of ``dataset[0]``, which the parent computes once. An output of another shape raises
    :class:`smstore.CollateError` naming the record: pad in the transform to a fixed shape and
    return the length as another field.

    **Lifetime.** A batch's tensors view a slot that is reused once the loop asks for the next
    batch: keep one past that with ``copy=True`` (or ``.clone()``). Moving it to a GPU copies it.
    The tensors keep the shared memory alive, so a batch kept after :meth:`close` is never read
    after unmapping.

    **Resume.** :meth:`state_dict` is the sampler's state at the batches the loop received (a
    :class:`GlobalShuffleSampler` or its subclasses: resumable at any world size), or for any
    other sampler the count of batches received, skipped on resume (the sampler must repeat its
    order). It is torchdata's ``StatefulDataLoader`` protocol.

    **Workers.** ``num_workers`` processes started on the first pass with
    ``multiprocessing_context`` (``"forkserver"`` by default, ``"fork"``, ``"spawn"`` or a context) and kept
    until :meth:`close` (a ``with`` block, or garbage collection). A transform that raises
    raises :class:`smstore.WorkerError` here with the worker's traceback and the record's index
    (chained to the original exception when it pickles); a worker that dies (a SIGKILL, the
    OOM killer) raises it too, within a second. Either shuts the workers down; the next pass starts
    new ones.

    Args:
        dataset: A map-style dataset (``SharedStoreDataset`` pickles as its path and attaches in
            each worker); ``__getitems__`` is used when it has one, as DataLoader does.
        transform: Called on each record in a worker; ``None`` takes the records as they are.
        batch_size: Records a batch.
        sampler: The order (default ``SequentialSampler``): any iterable of indices.
        drop_last: Drop the last batch if it is short.
        num_workers: Worker processes (at least 1).
        depth: Batch slots in the ring (default ``2 * num_workers + 1``: as DataLoader's
            ``prefetch_factor=2`` keeps ``2 * num_workers`` batches under way, and one held by the
            loop). Shared memory is ``depth`` x one batch.
        spec: The layout of one record's output: ``(shape, dtype)``, ``{name: (shape, dtype)}``
            or a sequence of ``(shape, dtype)``; by default inferred from ``dataset[0]``.
        multiprocessing_context: How workers start, as in DataLoader, but by default
            ``"forkserver"``: a process of a torch.distributed group has threads (gloo's, NCCL's)
            that may be inside Python when it forks, and a forked child then hangs for ever
            (docs/recipes.md). ``"fork"`` takes a transform that does not pickle (a lambda), in
            a process with no such threads.
        copy: Yield copies of the slot instead of views.
        timeout: Seconds to wait for one batch before raising (0: no limit; dead workers are
            noticed either way).
        worker_init_fn: Called with the worker id in each worker, before its first record.
        prepare: The deterministic part of the transform (decode, resize, normalise), run before
            ``transform`` (the random part: augmentation) on each record.
        cache: ``"node"``: ``prepare``'s outputs are computed once per node and read from shared
            memory after, by every epoch, rank, worker and job (:class:`smstore.DecodedCache`; needs
            the daemon, and the process must be its owner). Batches are byte-identical to
            uncached ones for the same seeds. docs/cache.md.
        cache_version: Declares a change of ``prepare`` its digest cannot see (a new decoder).
        cache_key: Names the data for ``cache="node"`` when the dataset has no checksum.
        socket: The daemon's socket for ``cache="node"`` (default ``$SMSTORE_SOCKET``, then the
            per-user default).
    """

    def __init__(
        self,
        dataset: Any,
        transform: Callable[[Any], Any] | None = None,
        *,
        batch_size: int,
        sampler: Sampler[int] | Sequence[int] | None = None,
        drop_last: bool = False,
        num_workers: int = 2,
        depth: int | None = None,
        spec: Spec | None = None,
        multiprocessing_context: str | Any | None = "forkserver",
        copy: bool = False,
        timeout: float = 0.0,
        worker_init_fn: Callable[[int], None] | None = None,
        prepare: Callable[[Any], Any] | None = None,
        cache: str | None = None,
        cache_version: str = "",
        cache_key: str | None = None,
        socket: str | os.PathLike[str] | None = None,
    ) -> None:
        if cache not in (None, "node"):
            msg = f"cache must be None or 'node', not {cache!r}"
            raise ValueError(msg)
        if cache == "node":
            if prepare is None:
                msg = "cache='node' caches what prepare= computes: pass the transform's deterministic part as prepare="
                raise ValueError(msg)
            # With no random part the batch's layout is the cache's: `spec` spares learning it from a decode.
            cache_spec = spec if transform is None else None
            dataset = DecodedCache(
                dataset, prepare, version=cache_version, key=cache_key, socket=socket, spec=cache_spec
            )
        elif prepare is not None:
            transform = _Prepared(prepare, transform)
        if batch_size < 1:
            msg = f"batch_size must be >= 1, not {batch_size}"
            raise ValueError(msg)
        if num_workers < 1:
            msg = f"num_workers must be >= 1, not {num_workers} (the transform runs in workers)"
            raise ValueError(msg)
        depth = 2 * num_workers + 1 if depth is None else depth
        if depth < 1:
            msg = f"depth must be >= 1, not {depth}"
            raise ValueError(msg)
        if timeout < 0:
            msg = f"timeout must be >= 0, not {timeout}"
            raise ValueError(msg)
        self.dataset = dataset
        self.transform = transform
        self.batch_size = batch_size
        self.sampler: Any = SequentialSampler(dataset) if sampler is None else sampler
        self.drop_last = drop_last
        self.num_workers = num_workers
        self.depth = depth
        self.copy = copy
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        if multiprocessing_context is None or isinstance(multiprocessing_context, str):
            self._context: Any = multiprocessing.get_context(multiprocessing_context)
        else:
            self._context = multiprocessing_context
        self.layout = self._layout(spec)
        self._pool: _WorkerPool | None = None
        self._seq = 0  # batch numbers, over every pass (a slot is batch number % depth)
        self._pass = 0  # the pass under way; an older iterator stops
        self._stats = LoaderStats()
        self._started = False  # a pass started since the last load_state_dict
        self._received = 0  # batches of the current pass handed to the loop (skipped ones included)
        self._exhausted = False
        self._skip = 0  # batches to skip at the start of the next pass (a resume, other samplers)

    def _layout(self, spec: Spec | None) -> Layout:
        if spec is not None:
            return Layout.from_spec(spec, self.batch_size)
        if len(self.dataset) == 0:
            msg = "the dataset is empty, so no record shows the output's layout: pass spec="
            raise ValueError(msg)
        record = self.dataset[0]
        return Layout.from_sample(
            record if self.transform is None else self.transform(record), self.batch_size
        )

    # -- the DataLoader side ------------------------------------------------------------------------

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Select the sampler's epoch (when it has ``set_epoch``)."""
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        pool = self._pool
        if pool is not None:
            try:
                pool.drain(self.timeout)  # what an abandoned pass left under way
            except BaseException:
                self.close()
                raise
        if pool is None or pool.closed:
            pool = self._pool = _WorkerPool(
                self.dataset,
                self.transform,
                self.layout,
                self.depth,
                self.num_workers,
                self._context,
                self.worker_init_fn,
            )
        self._pass += 1
        skip, self._skip = self._skip, 0
        self._started, self._received, self._exhausted = True, skip, False
        pool.base = self._seq
        return self._stats.wrap(self._run(pool, self._pass, self._batches(skip)))

    def stats(self) -> LoaderStats:
        """How long the loop waited for each batch and the share of its steps that was (every pass)."""
        return self._stats

    def _batches(self, skip: int) -> Iterator[list[int]]:
        it = iter(self.sampler)
        if skip:
            for _ in islice(it, skip * self.batch_size):
                pass
        while batch := list(islice(it, self.batch_size)):
            if len(batch) < self.batch_size and self.drop_last:
                return
            yield batch

    def _run(self, pool: _WorkerPool, token: int, batches: Iterator[list[int]]) -> Iterator[Any]:
        pending: deque[tuple[int, int]] = deque()  # (batch number, records), in the order to yield
        more = True
        while True:
            if token != self._pass:
                msg = "a newer pass of this TransformLoader started (or a state was loaded): only its iterator runs"
                raise RuntimeError(msg)
            if pool.closed:
                msg = "the TransformLoader was closed during this pass: start a new pass with iter(loader)"
                raise StoreClosedError(msg)
            try:
                while (
                    more and len(pending) < self.depth
                ):  # the loop's last batch is done with: its slot is free
                    batch = next(batches, None)
                    if batch is None:
                        more = False
                        break
                    pool.dispatch(self._seq, batch)
                    pending.append((self._seq, len(batch)))
                    self._seq += 1
                if not pending:
                    self._exhausted = True
                    return
                seq, n = pending.popleft()
                status, payload = pool.wait_for(seq, self.timeout)
                if status != _OK:
                    self._raise(seq - pool.base, status, payload)
            except BaseException:
                self.close()
                raise
            tensors = pool.views[seq % self.depth]
            if n < self.batch_size:
                tensors = [t[:n] for t in tensors]
            if self.copy:
                tensors = [t.clone() for t in tensors]
            self._received += 1
            yield self.layout.assemble(tensors)

    def _raise(self, batch: int, status: int, payload: bytes) -> None:
        index, text, exc_bytes = pickle.loads(payload)
        if status == _BAD_RECORD:
            msg = f"record {index} (batch {batch}): {text}"
            raise CollateError(msg)
        cause = None
        if exc_bytes is not None:
            with contextlib.suppress(Exception):
                cause = pickle.loads(exc_bytes)
        msg = f"reading or transforming record {index} (batch {batch}) failed in a worker:\n{text}"
        raise WorkerError(msg) from cause

    # -- state --------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position after the batches the loop received in the current pass."""
        if isinstance(self.sampler, GlobalShuffleSampler):
            if not self._started:
                return {"version": _STATE_VERSION, "sampler": self.sampler.state_dict()}
            local = sys.maxsize if self._exhausted else self._received * self.batch_size
            return {"version": _STATE_VERSION, "sampler": self.sampler.state_dict(local_consumed=local)}
        batches = self._skip if not self._started else 0 if self._exhausted else self._received
        return {"version": _STATE_VERSION, "batches": batches}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume: the next pass starts after the batches a :meth:`state_dict` counted."""
        if "sampler" in state:
            if not isinstance(self.sampler, GlobalShuffleSampler):
                msg = (
                    f"the state holds a GlobalShuffleSampler's position, but the sampler is {self.sampler!r}"
                )
                raise ValueError(msg)
            self.sampler.load_state_dict(state["sampler"])
            self._skip = 0
        elif "batches" in state and int(state["batches"]) >= 0:
            self._skip = int(state["batches"])
        else:
            msg = f"not a TransformLoader state: {dict(state)!r}"
            raise ValueError(msg)
        self._started = False
        self._pass += 1  # an iterator of before the load stops

    # -- shutdown -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the workers and release the slots (batches still held keep their memory alive)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def __enter__(self) -> TransformLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self, _suppress: Any = contextlib.suppress) -> None:
        # Bound at definition: at interpreter exit the module's globals may already be None.
        with _suppress(Exception):
            self.close()

    def __repr__(self) -> str:
        return (
            f"TransformLoader(batch_size={self.batch_size}, num_workers={self.num_workers}, "
            f"depth={self.depth}, layout=[{self.layout.describe()}])"
        )
