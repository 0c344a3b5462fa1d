"""The one sampler: rank slicing, epochs, resume and holds, for every order smstore draws.

:class:`GlobalShuffleSampler` is that sampler; the other public samplers are constructors of it
that build another order's spec (:mod:`smstore.sampling.orders`) and residency. A state names its
order by the spec (one format for every kind) and is resumed only by a sampler of the same order.
"""

from __future__ import annotations

import heapq
import os
import sys
from collections.abc import Iterator, Mapping, Sequence, Sized
from operator import length_hint
from typing import TYPE_CHECKING, Any

import numpy as np

from smstore.integrations import frameworks
from smstore.sampling.orders import GlobalSpec, Order, OrderSpec

if TYPE_CHECKING:
    from torch.utils.data.distributed import DistributedSampler

    _SamplerBase = DistributedSampler[int]
else:
    try:
        # Frameworks that split a sampler across ranks (Lightning, Fabric) leave a DistributedSampler
        # alone: being one is how the sampler says it is split already.
        from torch.utils.data.distributed import DistributedSampler as _SamplerBase
    except ImportError:  # pragma: no cover - torch is optional: the sampler serves any loop without it
        _SamplerBase = object

__all__ = ["STATE_VERSION", "GlobalShuffleSampler", "check_spec", "residency_of"]

# 2: the state names its order by its spec ({"kind", "params", "data"}); 1 named the kind and
# wrote each kind's entries beside it (translated by check_spec).
STATE_VERSION = 2

# The kind of order a state of format 1 saved before it named its kind, told by the entry only
# that kind saved; a state with none of them is a global shuffle's.
_KIND_BY_ENTRY = (
    ("blocks", "blocks"),
    ("windows", "windowed-mixture"),
    ("mixture", "mixture"),
    ("window", "windowed"),
)


def _check_world(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        msg = f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}"
        raise ValueError(msg)


def _world_from_env() -> tuple[int, int]:
    """(rank, world size) from an initialized torch.distributed, else torchrun's env, else (0, 1)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return 0, 1


class GlobalShuffleSampler(_SamplerBase):
    """An exact global shuffle of every record, split across ranks, that resumes in O(1).

    **The order.** Epoch ``e`` visits the records in the order ``O = [P(0), P(1), ..., P(N-1)]``
    where ``P`` is a keyed bijection of ``range(N)`` (:class:`FeistelPermutation`) whose key is
    derived from ``(seed, e, N)`` only: the global order does not depend on the world size, and a
    different seed or epoch gives a different permutation. Rank ``r`` of ``W`` yields
    ``O[r], O[r + W], O[r + 2W], ...`` (DistributedSampler's convention), so interleaving the
    ranks' streams gives back the world-size-1 order.

    **Padding.** When ``W`` does not divide ``N``, every rank still yields the same number of
    samples, ``ceil(N / W)``: positions ``p >= N`` wrap around to ``O[p - N]`` (``O[p mod N]``), so
    the first ``ceil(N / W) * W - N`` samples of the epoch are seen twice, exactly like
    ``DistributedSampler``'s padding. With ``drop_last=True`` each rank yields ``floor(N / W)`` and
    the last ``N mod W`` positions of the order are skipped in that epoch. After a resume at ``k``
    the same rule applies to the remaining ``N - k`` positions with the new world size.

    **Resume.** :meth:`state_dict` is ``{"seed", "epoch", "consumed", "num_records", ...}`` where
    ``consumed`` counts the *global* positions of the epoch already handed out. After
    :meth:`load_state_dict`, rank ``r`` of any world size ``W'`` yields ``O[k + r], O[k + r + W'],
    ...`` with ``k = consumed``: exactly where the global order left off, computed in O(1)
    without iterating the skipped part. All ranks consume in lockstep (as in DDP), so the state of
    any one rank (rank 0's, by convention) describes them all.

    **Which position to save.** A ``DataLoader`` with workers draws indices from the sampler ahead
    of the training loop (``prefetch_factor * num_workers`` batches; accelerate and Lightning draw
    one more), so what the sampler has handed out is not what the loop has trained on. Save the
    loader's position, not the sampler's:

    * torchdata's ``StatefulDataLoader``: save ``loader.state_dict()``. It snapshots the sampler
      state at the batch the loop last received, and ``loader.load_state_dict()`` hands it back.
    * A plain ``DataLoader`` (or one a framework prepared): iterate :class:`ResumableLoader`
      ``(loader)`` and save its ``state_dict()``: it counts the batches the loop received.

    ``sampler.state_dict()`` without an argument is the position the sampler's current iterator
    has reached: exact when iterating the sampler directly or with a single-process ``DataLoader``.
    While a loader that draws ahead (workers, accelerate, Lightning) runs a pass, it raises
    ``RuntimeError`` instead of answering ahead of the loop; ``local_consumed=`` (the samples this
    rank's loop received in the pass) answers exactly.

    **Training frameworks.** The sampler is a ``torch.utils.data.DistributedSampler``, so Lightning
    and Fabric use it as it is (they split any other sampler across ranks again). Accelerate's
    ``prepare`` (and so the HF Trainer) wraps it in a ``BatchSamplerShard``, whose second split the
    sampler turns off when it first sees it (``len()`` or the first batch); a wrapper it cannot
    undo raises ``ValueError`` naming the fix. docs/recipes.md has a tested recipe for each.

    **Every order.** This is the one sampler: WindowedShuffleSampler, BlockWindowSampler,
    MixtureSampler and WindowedMixtureSampler are this class over another order's spec
    (``self.spec``: :mod:`smstore.sampling.orders`), so all of the above holds for each; an order
    that holds data while it is read (windows, blocks) drives ``self.residencies`` through
    ``order.holds``, and :meth:`close` gives up what they hold.

    **Memory.** O(1) in the number of records: the permutation is computed, never stored (a
    stored permutation of 1e9 records is 8 GB per rank). The iterator holds one chunk of at most
    65536 indices (a list of ~2.5 MiB, computed in one call into C++) and the sampler a handful
    of integers.

    Args:
        dataset_or_len: The dataset (anything with ``len``) or the number of records.
        seed: Any integer; the same on every rank.
        rank: This rank; by default from ``torch.distributed`` when it is initialized, else the
            ``RANK`` environment variable (torchrun), else 0. Looked up again when a pass starts
            (so a sampler made before ``init_process_group``, or before Lightning launched its
            processes, takes its rank from the process group once there is one).
        world_size: The number of ranks; found like ``rank``.
        drop_last: Drop the tail that does not divide evenly instead of padding.
    """

    shuffle = True  # read by frameworks that inspect a DistributedSampler (Lightning's eval warning)

    def __init__(
        self,
        dataset_or_len: Sized | int,
        *,
        seed: int,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
    ) -> None:
        n = dataset_or_len if isinstance(dataset_or_len, int) else len(dataset_or_len)
        if n < 0:
            msg = f"the number of records must be >= 0, not {n}"
            raise ValueError(msg)
        self._configure(GlobalSpec(int(n)), seed=seed, rank=rank, world_size=world_size, drop_last=drop_last)

    def _configure(
        self,
        spec: OrderSpec,
        *,
        seed: int,
        rank: int | None,
        world_size: int | None,
        drop_last: bool,
        residencies: Sequence[Any] = (),
        lag: int = 0,
    ) -> None:
        """Set the sampler up for the order ``spec`` describes (what every constructor ends with).

        Args:
            residencies: One per lane of the order (``None`` for a lane nobody holds).
            lag: Samples of this rank whose data stays held after the sampler moved past them.
        """
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
            msg = f"seed must be an integer, not {seed!r}"
            raise TypeError(msg)
        if lag < 0:
            msg = f"lag must be >= 0, not {lag}"
            raise ValueError(msg)
        self._auto_rank, self._auto_world = rank is None, world_size is None
        if rank is None or world_size is None:
            env_rank, env_world = _world_from_env()
            rank = env_rank if rank is None else rank
            world_size = env_world if world_size is None else world_size
        _check_world(rank, world_size)
        self.spec = spec
        self.num_records = spec.num_records
        self.seed = int(seed)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.lag = int(lag)
        self.residencies: list[Any] = [r or None for r in residencies]
        # Indices computed at a time: the DataLoader draws them inside next(loader), so a chunk's
        # cost (about 100 ns an index) is a wait of the training loop once per chunk; where the
        # order holds, a window switch also holds the next data: each draw is kept shorter.
        self._max_chunk = 4096 if any(r is not None for r in self.residencies) else 65536
        self._consumed = 0  # global positions handed out in this epoch
        self._resume = False  # the next __iter__ starts at _consumed instead of 0
        self._iter_token = 0
        self._order_cache: tuple[tuple[int, int], Order] | None = None
        # The pass under way (the latest __iter__): where it started and how far it has come.
        self._in_pass = False
        self._pass_start = 0
        self._pass_done = 0  # local samples of the chunks before the current one
        self._pass_chunk: Iterator[int] | None = None
        self._pass_chunk_len = 0
        self._pass_finished = False
        self._pass_ahead = False  # drawn by a loader that runs ahead of the training loop
        # The holds sent in this pass, per lane, and the lanes by the position where theirs may change.
        self._last_holds: list[Any] = [None] * len(self.residencies)
        self._plans: list[tuple[int, int]] = []
        self._planned_at: int | None = None  # the position the plans were made at
        self._room_checked: list[Any] = []  # the daemons' limits the windows were checked against

    @property
    def residency(self) -> Any:
        """The residency of an order with one lane (a windowed or block order), else None."""
        return self.residencies[0] if len(self.residencies) == 1 else None

    @property
    def num_replicas(self) -> int:
        """``world_size``, under DistributedSampler's name."""
        return self.world_size

    @num_replicas.setter
    def num_replicas(self, value: int) -> None:
        _check_world(self.rank, value)
        self.world_size = int(value)

    def _sync_world(self) -> None:
        """Take the rank and world size not given explicitly from torch.distributed, once it is
        initialized (between passes only: a pass keeps the split it started with)."""
        if not (self._auto_rank or self._auto_world) or (self._in_pass and not self._pass_finished):
            return
        dist = sys.modules.get("torch.distributed")
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return
        rank = int(dist.get_rank()) if self._auto_rank else self.rank
        world = int(dist.get_world_size()) if self._auto_world else self.world_size
        _check_world(rank, world)
        self.rank, self.world_size = rank, world

    # -- the order --------------------------------------------------------------------------

    def permutation(self, epoch: int | None = None) -> Any:
        """The order of ``epoch`` (default: the current one): ``O[p] = order(p)``."""
        epoch = self.epoch if epoch is None else int(epoch)
        cache_key = (self.seed, epoch)
        if self._order_cache is None or self._order_cache[0] != cache_key:
            self._order_cache = (cache_key, self.spec.order(self.seed, epoch))
        return self._order_cache[1]

    def global_order(self, start: int = 0, stop: int | None = None) -> np.ndarray[Any, np.dtype[np.int64]]:
        """``O[start:stop]`` of the current epoch as an int64 array (for tests and tools)."""
        stop = self.num_records if stop is None else min(stop, self.num_records)
        if stop <= start:
            return np.empty(0, dtype=np.int64)
        order: Order = self.permutation()
        return order(np.arange(start, stop, dtype=np.uint64))

    def _local_count(self, start: int) -> int:
        remaining = max(0, self.num_records - start)
        if self.drop_last:
            return remaining // self.world_size
        return -(-remaining // self.world_size)

    def _local_indices(self, perm: Order, start: int, i0: int, i1: int) -> list[int]:
        """The record indices this rank yields at local steps ``[i0, i1)`` of a pass from ``start``.

        One call into C++ (no numpy): the DataLoader draws them inside ``next(loader)``, on a rank
        whose caches the workers and the training step keep cold, where a dozen array operations
        cost a fifth of a millisecond before the first index.
        """
        if i1 <= i0:
            return []
        first = start + self.rank + i0 * self.world_size
        return perm.strided(first, self.world_size, i1 - i0, self.num_records)  # the padding wraps

    def _local_array(self, perm: Order, start: int, i0: int, i1: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        """:meth:`_local_indices` as an int64 array (what :class:`~smstore.Loader` draws)."""
        first = start + self.rank + i0 * self.world_size
        return perm.strided_array(first, self.world_size, max(0, i1 - i0), self.num_records)

    # -- the Sampler protocol ---------------------------------------------------------------

    def __len__(self) -> int:
        """Samples this rank yields in the next pass (the rest of the epoch after a resume)."""
        self._sync_world()
        frameworks.adopt_wrappers(self, sys._getframe(1))
        return self._local_count(self._consumed if self._resume else 0)

    def __iter__(self) -> Iterator[int]:
        return self._start_pass(sys._getframe(1), arrays=False)

    def _chunks(self) -> Iterator[np.ndarray[Any, np.dtype[np.int64]]]:
        """A pass like ``iter(sampler)``, yielding each chunk of indices as one int64 array instead
        of its indices one by one (for :class:`~smstore.Loader`, which reads them in bulk).

        The same generator makes both, so the indices, their order and the pass's bookkeeping
        (the hooks at window starts, :meth:`state_dict`) are the same; a chunk counts as handed
        out once it is yielded.
        """
        return self._start_pass(sys._getframe(1), arrays=True)

    def _start_pass(self, frame: Any, *, arrays: bool) -> Iterator[Any]:
        # The first hold of a pass is applied before it yields (its errors up front).
        self._last_holds = [None] * len(self.residencies)
        self._planned_at = None
        self._sync_world()
        seen = frameworks.inspect_pass(self, frame)
        if seen.epoch is not None:
            self.set_epoch(seen.epoch)
        start = self._consumed if self._resume else 0
        self._resume = False
        self._consumed = start
        self._iter_token += 1
        self._in_pass, self._pass_finished = True, False
        self._pass_start, self._pass_done, self._pass_chunk, self._pass_chunk_len = start, 0, None, 0
        self._pass_ahead = seen.ahead
        return self._generate(self._iter_token, self.permutation(), start, self._local_count(start), arrays)

    def _generate(self, token: int, perm: Order, start: int, count: int, arrays: bool) -> Iterator[Any]:
        """The pass's indices one by one, or (``arrays``) its chunks as int64 arrays."""
        done = 0
        chunk = 256  # small first chunks: the first batch after a resume arrives at once
        point = 0  # the next step at which _reached() acts (a window start, say)
        while done < count:
            if done == point:
                # A pass that a newer one replaced acts no more: it only yields its own order.
                point = self._reached(start, done) if token == self._iter_token else count
                # The step that acted (sent a hold, say) draws a small chunk: its cost and a large
                # draw's would add up in one wait of the training loop.
                chunk = 256
            m = min(chunk, count - done, point - done)
            if arrays:
                block = self._local_array(perm, start, done, done + m)
                if token == self._iter_token:  # handed out whole
                    self._pass_done, self._pass_chunk, self._pass_chunk_len = done + m, None, 0
                yield block
            else:
                values = iter(self._local_indices(perm, start, done, done + m))
                if token == self._iter_token:
                    self._pass_done, self._pass_chunk, self._pass_chunk_len = done, values, m
                yield from values
            done += m
            chunk = min(chunk * 4, self._max_chunk)
        if token == self._iter_token:
            self._pass_done, self._pass_chunk, self._pass_chunk_len = count, None, 0
            self._pass_finished = True
            self._consumed = self.num_records  # the epoch is complete (drop_last's tail included)

    def _reached(self, start: int, done: int) -> int:
        """Hold what the pass needs at local step ``done``; the step the next chunk may not pass
        (where some lane's holds may change next)."""
        n = self.num_records
        if n == 0 or all(r is None for r in self.residencies):
            return sys.maxsize
        order = self.permutation()
        g = start + self.rank + done * self.world_size
        at = g % n  # the padding wraps to the start of the order
        plans = self._plans  # (position where a lane's holds may change, lane): a heap
        if self._planned_at is None or at < self._planned_at:  # a new pass, or the padding wrapped
            plans.clear()
            due = [lane for lane, r in enumerate(self.residencies) if r is not None]
        else:
            due = []
            while plans and plans[0][0] <= at:
                due.append(heapq.heappop(plans)[1])
        for lane in due:  # only the lanes whose holds may have moved
            held, change = order.holds(lane, at, self.lag * self.world_size)
            heapq.heappush(plans, (change, lane))
            if held != self._last_holds[lane]:
                self.residencies[lane].hold(held, wait=self._last_holds[lane] is None)
                self._last_holds[lane] = held
        self._planned_at = at
        if due:
            self._check_room()
        nxt = min(n, plans[0][0])
        nxt += g - at  # back in the pass's (possibly wrapped) positions
        return done + max(1, -(-(nxt - g) // self.world_size))

    def _check_room(self) -> None:
        """Refuse windows that two at a time cannot fit the daemon's ``--shm-limit`` (known once
        a hold's reply said it): the epoch would stop at the first window switch, not fail."""
        windows = self.spec.lane_windows()
        if windows is None:
            return
        lanes: dict[str, list[tuple[Any, int]]] = {}  # by daemon: each has its own limit
        for r, w in zip(self.residencies, windows, strict=True):
            if (
                r is not None
                and getattr(r, "kind", None) == "daemon"
                and getattr(r, "limit", None) is not None
            ):
                lanes.setdefault(r.socket, []).append((r, w))
        limits = sorted((sock, group[0][0].limit) for sock, group in lanes.items())
        if limits == self._room_checked:
            return
        from smstore.sampling.plan import check_room

        for group in lanes.values():
            check_room([(r.manifest, w) for r, w in group], group[0][0].limit, type(self).__name__)
        self._room_checked = limits

    def _live_local(self) -> int:
        """Local samples the current pass has handed out."""
        chunk = self._pass_chunk
        if chunk is None:
            return self._pass_done
        return self._pass_done + self._pass_chunk_len - length_hint(chunk)

    # -- epochs and state -------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the next pass. A state loaded for this same epoch is kept."""
        epoch = int(epoch)
        if epoch != self.epoch:
            if self._resume:
                frameworks.check_set_epoch(self, epoch, self.epoch, sys._getframe(1))
            self.epoch = epoch
            self._consumed = 0
            self._resume = False
            self._in_pass = False
            self._iter_token += 1  # a pass of the old epoch no longer updates the state

    def _global_after(self, start: int, local: int) -> int:
        """The global position after ``local`` samples of a pass from ``start``."""
        if local >= self._local_count(start):
            return self.num_records  # the pass is over, and with it the epoch (drop_last's tail too)
        return start + local * self.world_size

    def state_dict(self, local_consumed: int | None = None) -> dict[str, Any]:
        """The resumable position: ``{"seed", "epoch", "consumed", "num_records", ...}``.

        Args:
            local_consumed: How many samples of the current pass (the latest ``iter()``) this
                rank's training loop has received. By default, the position the sampler's
                iterator has reached (see :class:`ResumableLoader` to have it counted for you).

        Raises:
            RuntimeError: No ``local_consumed`` while a loader that draws ahead of the training
                loop (DataLoader workers, accelerate, Lightning) runs a pass: the sampler's own
                position would be ahead of what the loop trained on.
        """
        if self._resume or not self._in_pass:
            consumed = self._consumed  # no pass under way: the pending (or initial) position
        elif (
            local_consumed is None
            and self._pass_ahead
            and not frameworks.called_by_stateful_loader(sys._getframe(1))
        ):
            msg = (
                "sampler.state_dict() is ahead of the training loop: this pass is drawn by a loader that "
                "prefetches (DataLoader workers, accelerate, Lightning), so the sampler has handed out "
                "batches the loop has not received. Save the loader's position instead: iterate "
                "smstore.ResumableLoader(loader) and save its state_dict(), or use torchdata's "
                "StatefulDataLoader and save loader.state_dict(); or pass local_consumed= (the samples "
                "this rank's loop received in this pass)."
            )
            raise RuntimeError(msg)
        elif local_consumed is not None:
            if local_consumed < 0:
                msg = f"local_consumed must be >= 0, not {local_consumed}"
                raise ValueError(msg)
            consumed = self._global_after(self._pass_start, local_consumed)
        elif self._pass_finished:
            consumed = self.num_records
        else:
            consumed = self._global_after(self._pass_start, self._live_local())
        return {
            "version": STATE_VERSION,
            "seed": self.seed,
            "epoch": self.epoch,
            "consumed": consumed,
            "num_records": self.num_records,
            "world_size": self.world_size,  # informational: resuming with another one is fine
            "drop_last": self.drop_last,
            "order": self.spec.describe(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next pass starts at ``state["consumed"]`` of ``state["epoch"]``, in O(1).

        Raises:
            ValueError: The state belongs to a dataset of another size, was saved by a sampler of
                another order (another kind, or other parameters: see :func:`check_spec`), or is
                malformed.
        """
        try:
            seed, epoch, consumed = int(state["seed"]), int(state["epoch"]), int(state["consumed"])
        except (KeyError, TypeError, ValueError) as e:
            msg = f"not a {type(self).__name__} state: {e!r}"
            raise ValueError(msg) from None
        check_spec(self.spec, state, type(self).__name__)
        n = state.get("num_records", self.num_records)
        if n != self.num_records:
            msg = (
                f"the state was saved for {n} records but this sampler has {self.num_records}: "
                "the order of another dataset cannot be resumed"
            )
            raise ValueError(msg)
        if not 0 <= consumed <= self.num_records:
            msg = f"consumed={consumed} is outside [0, {self.num_records}]"
            raise ValueError(msg)
        self.seed = seed
        self.epoch = epoch
        self._consumed = consumed
        self._resume = True
        self._in_pass = False
        self._iter_token += 1

    def close(self) -> None:
        """Give up what this rank holds (also done when the process exits)."""
        for residency in self.residencies:
            if residency is not None:
                residency.close()

    def __repr__(self) -> str:
        fields = self.spec.fields()
        return (
            f"{type(self).__name__}(num_records={self.num_records}, {fields + ', ' if fields else ''}seed={self.seed}, "
            f"epoch={self.epoch}, rank={self.rank}, world_size={self.world_size}, drop_last={self.drop_last})"
        )


def check_spec(spec: OrderSpec, state: Mapping[str, Any], name: str) -> None:
    """Refuse a state that another order saved: resumed, its position would repeat some records
    and skip others. Every sampler's load_state_dict asks this one rule.

    A state of format 2 describes its order (``spec.describe()``); one of format 1 named the
    kind (or not even that: told by the entries) and wrote the kind's entries beside it
    (``spec.legacy()``), which are compared instead: a state of the same order loads.

    Raises:
        ValueError: (``spec.error``) Another kind of order, or other parameters or data.
    """
    saved = state.get("order")
    if isinstance(saved, Mapping):
        kind = saved.get("kind")
        theirs = {**_plain_dict(saved.get("params")), **_plain_dict(saved.get("data"))}
        mine = {**spec.params(), **spec.data()}
    else:
        kind = (
            saved
            if saved is not None
            else next((k for entry, k in _KIND_BY_ENTRY if entry in state), "global")
        )
        mine = spec.legacy()
        theirs = {key: state.get(key) for key in mine}
    if kind != spec.kind:
        msg = (
            f"the state was saved by a sampler of another kind of order ({kind!r}); this {name} draws a "
            f"{spec.kind!r} order over the same positions: another order cannot be resumed (it "
            "would repeat some records and skip others)"
        )
        raise spec.error(msg)
    differ = [key for key, value in mine.items() if _plain(theirs.get(key)) != _plain(value)]
    if differ:
        given = ", ".join(f"{key}={theirs.get(key)!r}" for key in differ)
        ours = ", ".join(f"{key}={mine[key]!r}" for key in differ)
        msg = (
            f"the state was saved with {given}; this {name} has {ours} (other windows, blocks or shards, or "
            "another mixture: sources, lengths, weights or stopping rule): another order cannot be resumed"
        )
        raise spec.error(msg)


def _plain_dict(value: Any) -> dict[str, Any]:
    return dict(value) if isinstance(value, Mapping) else {}


def _plain(value: Any) -> Any:
    """A state's entry as saved and read back (a tuple comes back from JSON as a list)."""
    return list(value) if isinstance(value, tuple) else value


def residency_of(dataset: Any) -> Any:
    """The :class:`~smstore.wire.residency.Residency` an order drives (the pieces it holds: whole
    shards or record ranges of them) for a SharedStoreDataset of a sharded dataset, with its
    daemon's socket, its mode and its parsed manifest (a dataset URL's: not fetched again); None
    if it is not sharded."""
    from smstore.sampling.plan import manifest_of
    from smstore.wire.residency import Residency

    path = manifest_of(dataset)
    if path is None:
        return None
    return Residency(
        path,
        mode=getattr(dataset, "mode", "auto"),
        socket=getattr(dataset, "socket", None),
        manifest=getattr(dataset, "manifest", None),
    )
