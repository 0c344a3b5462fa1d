"""GlobalShuffleSampler: an exact global shuffle whose order survives a change of world size and resumes in O(1)."""

from __future__ import annotations

import bisect
import hashlib
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from operator import length_hint
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import numpy as np

from smstore import _core
from smstore.integrations import frameworks

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

__all__ = [
    "BlockWindowOrder",
    "BlockWindowSampler",
    "FeistelPermutation",
    "GlobalShuffleSampler",
    "ResumableLoader",
    "WindowedOrder",
    "WindowedShuffleSampler",
]

_STATE_VERSION = 1

# The kind of order a state saved before states named it (the "order" entry) was saved by, told by
# the entry only that kind saved; a state with none of them is a global shuffle's.
_KIND_BY_ENTRY = (
    ("blocks", "blocks"),
    ("windows", "windowed-mixture"),
    ("mixture", "mixture"),
    ("window", "windowed"),
)


class FeistelPermutation:
    """A keyed bijection of ``range(n)`` that needs O(1) memory.

    An alternating (unbalanced) Feistel network permutes the ``b``-bit integers, ``2**b`` being
    the smallest power of two ``>= n`` (so at most ``2n``); values that land outside ``[0, n)``
    are sent through the network again (cycle-walking) until they land inside, which keeps the map
    a bijection of ``[0, n)``. The expected number of passes is ``2**b / n < 2``. Each round splits
    the value into a high part ``A`` and a low part ``B`` and maps ``(A, B)`` to
    ``(B, A xor F_k(B))``; the parts trade widths every round, which is why any bit width works.
    ``F_k`` is splitmix64's finalizer applied to ``B + k``, with one 64-bit key per round.

    The permutation is a pure function of ``key`` and ``n``; it holds ``rounds`` 64-bit keys and
    nothing else. It is a shuffle, not cryptography.

    Args:
        n: The size of the domain.
        key: Any bytes; the round keys are derived from it with BLAKE2b.
        rounds: Feistel rounds (6 by default: well past the 4 that make a good pseudorandom
            permutation from good round functions).
    """

    def __init__(self, n: int, key: bytes, *, rounds: int = 6) -> None:
        if n < 0:
            msg = f"n must be >= 0, not {n}"
            raise ValueError(msg)
        if n > 2**63:
            msg = f"n must be <= 2**63, not {n}"
            raise ValueError(msg)
        self.n = n
        self._keys = round_keys(key, rounds)

    def __call__(self, positions: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The images of an array of positions in ``[0, n)``, as int64 (computed in C++, a few ns each).

        Raises:
            IndexError: A position is outside ``[0, n)``.
        """
        return map_positions(
            positions,
            lambda flat: _core.feistel_permute(flat, self.n, self._keys),
            f"a permutation of {self.n}",
        )

    def strided(self, first: int, step: int, count: int, wrap: int) -> list[int]:
        """The images of positions ``(first + i * step) % wrap`` for ``i < count`` (a rank's share
        of a pass, its padding wrapped), as a list: one call into C++, whatever ``count`` is."""
        return _core.feistel_strided(self.n, self._keys, first, step, count, wrap)

    def strided_array(
        self, first: int, step: int, count: int, wrap: int
    ) -> np.ndarray[Any, np.dtype[np.int64]]:
        """:meth:`strided`'s images as an int64 array (no Python int per index)."""
        return _core.feistel_strided_array(self.n, self._keys, first, step, count, wrap)

    def __getitem__(self, position: int) -> int:
        if not 0 <= position < self.n:
            msg = f"position {position} out of range for a permutation of {self.n}"
            raise IndexError(msg)
        return int(self(np.array([position], dtype=np.uint64))[0])

    def __len__(self) -> int:
        return self.n


class Order(Protocol):
    """The order of an epoch: ``order(positions)`` are the records at those positions."""

    def __call__(self, positions: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.int64]]: ...

    def strided(self, first: int, step: int, count: int, wrap: int) -> list[int]:
        """The records at positions ``(first + i * step) % wrap`` for ``i < count``."""
        ...

    def strided_array(
        self, first: int, step: int, count: int, wrap: int
    ) -> np.ndarray[Any, np.dtype[np.int64]]:
        """:meth:`strided`'s records as an int64 array."""
        ...


def map_positions(
    positions: np.ndarray[Any, Any],
    images: Callable[[np.ndarray[Any, Any]], np.ndarray[Any, np.dtype[np.int64]]],
    what: str,
) -> np.ndarray[Any, np.dtype[np.int64]]:
    """``images`` (a C++ call over flat uint64 positions) of an array of any shape; a negative
    position is an IndexError (as uint64 it would wrap to a huge one, which C++ refuses by value)."""
    x = np.asarray(positions)
    if x.size and x.dtype.kind == "i" and int(x.min()) < 0:
        msg = f"position {int(x.min())} out of range for {what}"
        raise IndexError(msg)
    return images(x.astype(np.uint64, copy=False).ravel()).reshape(x.shape)


def round_keys(key: bytes, rounds: int = 6) -> list[int]:
    """A Feistel permutation's round keys: 64 bits each, from BLAKE2b of ``key``."""
    digest = hashlib.blake2b(key, digest_size=8 * rounds, person=b"smstore-feistel").digest()
    return [int.from_bytes(digest[8 * i : 8 * i + 8], "little") for i in range(rounds)]


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
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
            msg = f"seed must be an integer, not {seed!r}"
            raise TypeError(msg)
        self._auto_rank, self._auto_world = rank is None, world_size is None
        if rank is None or world_size is None:
            env_rank, env_world = _world_from_env()
            rank = env_rank if rank is None else rank
            world_size = env_world if world_size is None else world_size
        _check_world(rank, world_size)
        self.num_records = int(n)
        self.seed = int(seed)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self._consumed = 0  # global positions handed out in this epoch
        self._resume = False  # the next __iter__ starts at _consumed instead of 0
        self._iter_token = 0
        self._perm_cache: tuple[tuple[int, int], FeistelPermutation] | None = None
        # The pass under way (the latest __iter__): where it started and how far it has come.
        self._in_pass = False
        self._pass_start = 0
        self._pass_done = 0  # local samples of the chunks before the current one
        self._pass_chunk: Iterator[int] | None = None
        self._pass_chunk_len = 0
        self._pass_finished = False
        self._pass_ahead = False  # drawn by a loader that runs ahead of the training loop

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

    def permutation(self, epoch: int | None = None) -> Order:
        """The bijection ``P`` with ``O[p] = P(p)`` for ``epoch`` (default: the current one)."""
        epoch = self.epoch if epoch is None else int(epoch)
        cache_key = (self.seed, epoch)
        if self._perm_cache is None or self._perm_cache[0] != cache_key:
            key = f"smstore-global-shuffle-v1:{self.seed}:{epoch}:{self.num_records}".encode()
            self._perm_cache = (cache_key, FeistelPermutation(self.num_records, key))
        return self._perm_cache[1]

    def global_order(self, start: int = 0, stop: int | None = None) -> np.ndarray[Any, np.dtype[np.int64]]:
        """``O[start:stop]`` of the current epoch as an int64 array (for tests and tools)."""
        stop = self.num_records if stop is None else min(stop, self.num_records)
        if stop <= start:
            return np.empty(0, dtype=np.int64)
        return self.permutation()(np.arange(start, stop, dtype=np.uint64))

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

    def _new_pass(self) -> None:
        """Hook: a pass starts (a subclass resets what it tracks per pass)."""

    def _start_pass(self, frame: Any, *, arrays: bool) -> Iterator[Any]:
        self._new_pass()
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

    # Indices computed at a time: the DataLoader draws them inside next(loader), so a chunk's cost
    # (about 100 ns an index) is a wait of the training loop once per chunk.
    _max_chunk = 65536

    def _reached(self, start: int, done: int) -> int:  # noqa: ARG002 - a hook for subclasses
        """Hook: the pass from `start` is at local step `done`; returns the step the next chunk may
        not pass (a subclass acts at points of its order: see WindowedShuffleSampler)."""
        return sys.maxsize

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
            "version": _STATE_VERSION,
            "seed": self.seed,
            "epoch": self.epoch,
            "consumed": consumed,
            "num_records": self.num_records,
            "world_size": self.world_size,  # informational: resuming with another one is fine
            "drop_last": self.drop_last,
            "order": self._order_kind,
            **self._order_params(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next pass starts at ``state["consumed"]`` of ``state["epoch"]``, in O(1).

        Raises:
            ValueError: The state belongs to a dataset of another size, was saved by a sampler of
                another order (another kind, or other parameters: see :func:`check_order`), or is
                malformed.
        """
        try:
            seed, epoch, consumed = int(state["seed"]), int(state["epoch"]), int(state["consumed"])
        except (KeyError, TypeError, ValueError) as e:
            msg = f"not a GlobalShuffleSampler state: {e!r}"
            raise ValueError(msg) from None
        check_order(self, state)
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

    # What a state names its order by: the kind, and the entries that tell apart orders of that
    # kind over the same records (a subclass adds its own). See check_order.
    _order_kind = "global"
    _state_error: type[ValueError] = ValueError  # what refuses a state of another order

    def _order_params(self) -> dict[str, Any]:
        """The state's entries that identify this sampler's order beside its kind, seed and records."""
        return {}

    def __repr__(self) -> str:
        return (
            f"GlobalShuffleSampler(num_records={self.num_records}, seed={self.seed}, epoch={self.epoch}, "
            f"rank={self.rank}, world_size={self.world_size}, drop_last={self.drop_last})"
        )


class WindowedOrder:
    """The order of one epoch of :class:`WindowedShuffleSampler`: shards shuffled, then records within windows.

    The shards are put in a keyed random order; windows are runs of ``window`` consecutive shards
    of it; the records of window ``j`` come at positions ``[G_j, G_{j+1})``, permuted by a keyed
    bijection of that range (:class:`FeistelPermutation`). ``order(p)`` for any positions costs a
    binary search over the windows and one Feistel evaluation each: no epoch-sized table exists.

    Args:
        shard_sizes: Records in each shard, in manifest order.
        window: Shards per window.
        key: Derives every permutation of the epoch (the seed and epoch are in it).
    """

    def __init__(self, shard_sizes: Sequence[int] | np.ndarray[Any, Any], window: int, key: str) -> None:
        sizes = np.asarray(shard_sizes, dtype=np.int64)
        self.window = window
        self.n = int(sizes.sum())
        # Shard order, and where each shard starts in the dataset and in the shard-ordered sequence.
        self.shard_order = FeistelPermutation(len(sizes), f"{key}:shards".encode())(
            np.arange(len(sizes), dtype=np.uint64)
        )
        self._starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._seq_starts = np.concatenate([[0], np.cumsum(sizes[self.shard_order])]).astype(np.int64)
        # G_j: the first position of window j (len: windows + 1).
        self.window_starts = self._seq_starts[::window].copy()
        if self.window_starts[-1] != self.n:
            self.window_starts = np.append(self.window_starts, self.n)
        # The same tables in C++, which evaluates the order (each window's round keys derived the
        # first time it is read: the callable holds the key, not this object, so no cycle forms).
        prefix = f"{key}:window:"
        self._core = _core.WindowedOrder(
            self.window_starts.tolist(),
            self._seq_starts.tolist(),
            self._starts[self.shard_order].tolist(),
            window,
            lambda j: round_keys(f"{prefix}{j}".encode()),
        )
        self._window_starts: list[int] = self.window_starts.tolist()  # read at every window (plain ints)
        self._shard_list: list[int] = self.shard_order.tolist()

    @property
    def kernel(self) -> _core.WindowedOrder:
        """The order's tables in C++ (what a windowed mixture's order evaluates each source with)."""
        return self._core

    @property
    def window_count(self) -> int:
        return len(self.window_starts) - 1

    def window_of(self, position: int) -> int:
        """The window holding global position ``position`` (0 <= position < n)."""
        return bisect.bisect_right(self._window_starts, position) - 1

    def window_start(self, j: int) -> int:
        """The first position of window ``j`` (``n`` for ``j == window_count``)."""
        return self._window_starts[j]

    def window_shards(self, j: int) -> list[int]:
        """Shard indices (of the manifest) of window ``j``, in shard order."""
        return self._shard_list[j * self.window : (j + 1) * self.window]

    def __call__(self, positions: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The records at an array of positions: the window's permutation of the position, then
        back from shard order to the record's index (computed in C++).

        Raises:
            IndexError: A position is outside ``[0, n)``.
        """
        return map_positions(positions, self._core, f"an order of {self.n}")

    def strided(self, first: int, step: int, count: int, wrap: int) -> list[int]:
        """The records at positions ``(first + i * step) % wrap`` for ``i < count``, as a list."""
        return self._core.strided(first, step, count, wrap)

    def strided_array(
        self, first: int, step: int, count: int, wrap: int
    ) -> np.ndarray[Any, np.dtype[np.int64]]:
        """:meth:`strided`'s records as an int64 array."""
        return self._core.strided_array(first, step, count, wrap)

    def __len__(self) -> int:
        return self.n


class BlockWindowOrder:
    """An epoch's order drawn from blocks: record ranges read in one go, from many shards at once.

    The design of docs/training.md, "Block windows", as a pure order (BlockWindowSampler yields it
    with groups of one block). Each shard is cut into **blocks** of at least ``block``
    consecutive records, as many as fit and as even as whole records allow (a shard of fewer is
    one block): a block never crosses a shard's end, so each is one sequential read of at least
    ``block`` records (:func:`block_bounds`). A keyed permutation puts the blocks in one random
    order, the **sequence**; **groups** are runs of ``G = group * block`` consecutive records of
    it (the last shorter), so a block's records fall in one group or two. The records of group
    ``j`` are dealt to ``spread`` parts: record ``r`` of it (in sequence order) to part
    ``r * stride % spread``, a step near ``0.38 spread`` (``_deal_stride``), so the parts are as
    even as whole records allow and source neighbours fall far apart. Part ``t`` goes to
    **window** ``j + t``; the records of each window (parts of groups ``j - spread + 1 .. j``) are
    permuted by a keyed bijection of the window's positions, and the windows follow each other.

    So every record comes exactly once; the order is a pure function of ``key`` (the seed and
    epoch go in it), the same for any world size; ``order(p)`` for any positions costs a few
    binary searches and one Feistel evaluation each (O(1) resume), with tables of one entry a
    block, a window and a part (never groups x parts). While window ``w`` is read, groups
    ``w - spread + 1 .. w`` are needed and group ``w + 1`` is loading: a sliding run of
    ``(spread + 1) * G`` records of the sequence, in the blocks that cover it (at most one more
    block at each end), each block read once, sequentially. ``spread=1`` is plain windows of
    blocks (the one read and the next); a larger ``spread`` spreads each block's records over
    ``spread`` windows, so source neighbours share a batch less often (docs/training.md states
    the bound).

    Args:
        shard_sizes: Records in each shard, in manifest order.
        block: Records per block, at least (at least 1).
        group: Blocks per group (at least 1): a group is ``group * block`` records.
        spread: Windows over which a group's records are spread (at least 1).
        key: Derives every permutation of the epoch.

    Raises:
        ValueError: A shard size is negative, or ``block``, ``group`` or ``spread`` is below 1.
    """

    def __init__(
        self,
        shard_sizes: Sequence[int] | np.ndarray[Any, Any],
        *,
        block: int,
        group: int,
        spread: int,
        key: str,
    ) -> None:
        sizes = np.asarray(shard_sizes, dtype=np.int64)
        if sizes.size and int(sizes.min()) < 0:
            msg = "shard sizes must be >= 0"
            raise ValueError(msg)
        for name, value in (("block", block), ("group", group), ("spread", spread)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                msg = f"{name} must be a positive integer, not {value!r}"
                raise ValueError(msg)
        self.block, self.group, self.spread, self._key = block, group, spread, key
        self._permutations: dict[tuple[str, int], FeistelPermutation] = {}
        self.n = n = int(sizes.sum())
        # Blocks: records [block_first, block_first + block_length) of shard block_shard.
        self.block_first, self.block_length, self.block_shard = block_bounds(sizes, block)
        nb = len(self.block_first)
        # The sequence: the blocks in a keyed order, and where each starts in it.
        self.block_order = FeistelPermutation(nb, f"{key}:blocks".encode())(
            np.arange(nb, dtype=np.uint64)
        ).astype(np.int64)
        self._seq_starts = np.concatenate([[0], np.cumsum(self.block_length[self.block_order])]).astype(
            np.int64
        )
        # Groups: sequence positions [j G, (j + 1) G); all of G records but the last.
        size = self.group_records = group * block
        groups = -(-n // size)
        self.group_starts = np.minimum(np.arange(groups + 1, dtype=np.int64) * size, n)
        self._last = n - (groups - 1) * size if groups else 0
        # Records are dealt to parts: record r of a group (in sequence order) goes to part
        # r * stride % spread, so part t holds records deal[t], deal[t] + spread, ... and source
        # neighbours (r, r + 1) land `stride` windows apart (about 0.38 spread: golden-ratio steps).
        self.stride = _deal_stride(spread, size)
        inverse = pow(self.stride, -1, spread) if spread > 1 else 0
        self._deal = np.arange(spread, dtype=np.int64) * inverse % spread  # part t's first record
        # cut[t]: a full group's records in its parts before part t (cut[spread] = G); the last group's.
        self._cut = _cuts(size, self._deal)
        self._last_cut = _cuts(self._last, self._deal)
        self._cut_sums = np.concatenate([[0], np.cumsum(self._cut)]).astype(np.int64)  # sum of cut[:d]
        windows = groups + spread - 1 if groups else 0
        self.window_starts = np.append(self._before(np.arange(windows, dtype=np.int64)), n).astype(np.int64)

    def _cut_of(
        self, j: np.ndarray[Any, Any], t: np.ndarray[Any, Any]
    ) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Records of group ``j`` in its parts before part ``t`` (0 <= t <= spread)."""
        groups = len(self.group_starts) - 1
        out: np.ndarray[Any, np.dtype[np.int64]] = np.where(j == groups - 1, self._last_cut[t], self._cut[t])
        return out

    def _before(self, w: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Positions before window ``w``: whole groups ``<= w - spread``, and the parts before
        ``w`` of groups ``w - spread + 1 .. w``."""
        groups, s = len(self.group_starts) - 1, self.spread
        whole = np.clip(w - s + 1, 0, groups)
        lo = whole  # the first group with parts in or after window w
        hi = np.minimum(w, groups - 1)  # the last group with parts in or before it
        full_hi = np.minimum(hi, groups - 2)  # the groups of G records among them
        # Sum over j in [lo, full_hi] of cut[w - j] = sum of cut[d] for d in [w - full_hi, w - lo].
        some = full_hi >= lo
        d_lo, d_hi = np.where(some, w - full_hi, 0), np.where(some, w - lo + 1, 0)
        partial = self._cut_sums[np.clip(d_hi, 0, s + 1)] - self._cut_sums[np.clip(d_lo, 0, s + 1)]
        last_in = (lo <= groups - 1) & (groups - 1 <= hi)
        partial = partial + np.where(last_in, self._last_cut[np.clip(w - groups + 1, 0, s)], 0)
        total: np.ndarray[Any, np.dtype[np.int64]] = self.group_starts[whole] + partial
        return total

    @property
    def window_count(self) -> int:
        return len(self.window_starts) - 1

    def window_groups(self, w: int) -> range:
        """The groups window ``w`` draws from (those resident while it is read)."""
        groups = len(self.group_starts) - 1
        return range(max(0, w - self.spread + 1), min(w, groups - 1) + 1)

    def group_blocks(self, j: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Block indices (see ``block_first``) holding records of group ``j``, in sequence order."""
        lo, hi = int(self.group_starts[j]), int(self.group_starts[j + 1])
        first = int(np.searchsorted(self._seq_starts, lo, side="right")) - 1
        last = int(np.searchsorted(self._seq_starts, hi - 1, side="right")) - 1
        return self.block_order[first : last + 1]

    def __call__(self, positions: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The records at an array of positions in ``[0, n)``.

        Raises:
            IndexError: A position is outside ``[0, n)``.
        """
        shape: tuple[int, ...] = np.shape(positions)
        p = np.asarray(positions).astype(np.int64).ravel()
        if p.size and (int(p.min()) < 0 or int(p.max()) >= self.n):
            bad = int(p.min()) if int(p.min()) < 0 else int(p.max())
            msg = f"position {bad} out of range for an order of {self.n}"
            raise IndexError(msg)
        groups, s = len(self.group_starts) - 1, self.spread
        # The window's permutation of the position: its place q among the window's parts.
        w = np.searchsorted(self.window_starts, p, side="right") - 1
        q = np.empty_like(p)
        for win, at in _runs(w):
            begin, end = int(self.window_starts[win]), int(self.window_starts[win + 1])
            q[at] = self._permutation("window", win, end - begin)(p[at] - begin)
        # The window holds part w - j of groups j = lo .. hi, in that order; every part but the
        # last group's has cut[w - j + 1] - cut[w - j] records, so part j starts at
        # cut[w - lo + 1] - cut[w - j + 1]: the last part starting at or before q is the one.
        lo = np.maximum(0, w - s + 1)
        hi = np.minimum(w, groups - 1)
        top = self._cut[w - lo + 1]
        u = np.maximum(np.searchsorted(self._cut, top - q, side="left"), w - hi + 1)
        j = w - u + 1
        t = w - j
        offset = top - self._cut[u]
        # The record dealt to that place of part t of group j, then the record in its block.
        seq = self.group_starts[j] + self._deal[t] + (q - offset) * s
        k = np.searchsorted(self._seq_starts, seq, side="right") - 1
        out: np.ndarray[Any, np.dtype[np.int64]] = (
            self.block_first[self.block_order[k]] + seq - self._seq_starts[k]
        )
        return out.reshape(shape)

    def strided(self, first: int, step: int, count: int, wrap: int) -> list[int]:
        """The records at positions ``(first + i * step) % wrap`` for ``i < count``."""
        return self.strided_array(first, step, count, wrap).tolist()  # type: ignore[no-any-return]

    def strided_array(
        self, first: int, step: int, count: int, wrap: int
    ) -> np.ndarray[Any, np.dtype[np.int64]]:
        """:meth:`strided`'s records as an int64 array."""
        positions = (first + np.arange(count, dtype=np.int64) * step) % max(1, wrap)
        return self(positions)

    def window_of(self, position: int) -> int:
        """The window holding ``position``."""
        return int(np.searchsorted(self.window_starts, position, side="right")) - 1

    def window_start(self, w: int) -> int:
        """The first position of window ``w`` (``n`` past the last)."""
        return int(self.window_starts[min(w, len(self.window_starts) - 1)])

    def _permutation(self, kind: str, index: int, size: int) -> FeistelPermutation:
        """The keyed permutation of window or group ``index``, kept: a sampler draws a few hundred
        positions at a time from the same few dozen groups, and making one costs its round keys."""
        cached = self._permutations.get((kind, index))
        if cached is None:
            if len(self._permutations) >= 4096:
                self._permutations.clear()
            cached = FeistelPermutation(size, f"{self._key}:{kind}:{index}".encode())
            self._permutations[(kind, index)] = cached
        return cached

    def __len__(self) -> int:
        return self.n


def _deal_stride(spread: int, records: int) -> int:
    """The step between the parts of consecutive records of a group of ``records``: coprime with ``spread``.

    Records ``k`` apart land ``k * stride % spread`` parts (windows) apart. Source neighbours come
    first: in a group they land ``stride`` or ``spread - stride`` windows apart, and a group's last
    record and the next group's first (a block runs on across groups) ``|(records - 1) * stride %
    spread - 1|``; the step keeps all three at least ``spread // 5`` apart wherever a step can
    (:func:`_neighbour_gap`; the planner picks only spreads where one can). Among those, the one
    whose distance from 0 (circularly), times ``k``, is largest at its smallest over ``k = 1 ..
    K`` (``K = min(records, spread, 64) - 1``): the golden ratio's property (``k ||k phi||`` stays
    above ``1 / sqrt(5)``) on the integers, so records a few apart land not much closer than
    neighbours; the closest to ``0.382 spread`` among equals.
    """
    if spread <= 2:
        return 1
    k = np.arange(1, max(2, min(records, spread, 64)), dtype=np.int64)
    golden = spread * (3 - 5**0.5) / 2
    # Steps a and spread - a deal records k apart as far (both ways round), but not a group's end.
    a = np.arange(1, spread, dtype=np.int64)
    if len(a) > 16384:  # very wide spreads: the steps near the golden one, both ways round
        near = np.arange(max(1, int(golden) - 4096), int(golden) + 4096, dtype=np.int64)
        a = np.concatenate([near, spread - near[::-1]])
    a = a[np.gcd(a, spread) == 1]
    steps = k[None, :] * a[:, None] % spread
    nearest = (np.minimum(steps, spread - steps) * k[None, :]).min(axis=1)
    edge = _edge_gap(spread, records, a)
    # The neighbour bound is a floor, not a preference: a step that crossed it for records k
    # apart would break the promise of docs/training.md for a pair in every group.
    gap = np.minimum(np.minimum(a, spread - a), edge)
    allowed = gap >= min(max(1, spread // 5), int(gap.max()))
    # (Past a fifth of the spread the edge is far enough: one pair a group.)
    nearest = np.where(allowed, np.minimum(nearest, np.maximum(edge, spread // 5)), -1)
    best = a[nearest == nearest.max()]
    # The closest to the golden step, the one below half the spread first.
    return int(best[np.lexsort((best > spread // 2, np.abs(np.minimum(best, spread - best) - golden)))[0]])


def plan_blocks(
    shard_records: Sequence[int], data_bytes: int, budget: int, block_bytes: int
) -> tuple[int, int]:
    """:meth:`BlockWindowSampler.plan` for a dataset of ``shard_records`` and ``data_bytes`` in all."""
    records = sum(shard_records)
    per_record = max(1.0, data_bytes / max(1, records))
    # 5 % over the average: a block of thousands of records strays far less from its mean.
    block = max(1, int(np.ceil(1.05 * block_bytes / per_record)))
    longest = max((-(-x // max(1, x // block)) for x in shard_records), default=block)
    piece = 4096 + 8 * longest  # a piece's header and index, and its last page
    held = int((budget - 2 * (longest * per_record + piece)) // (block * per_record + piece))
    if held < 4:
        msg = (
            f"a budget of {budget} bytes holds {max(0, held)} groups of {block} records ({block_bytes} bytes) "
            f"beside two blocks of up to {longest} records; at least 4 are needed (the window's, the next, "
            "the previous and room for one released): raise the budget"
        )
        raise ValueError(msg)
    return block, _neighbour_spread(held - 3, block)


def _neighbour_spread(most: int, records: int) -> int:
    """The widest spread up to ``most`` whose step keeps source neighbours ``spread // 5`` windows
    apart, across a group's end too: where ``spread`` divides ``records - 1`` (or nearly), a
    group's last record and the next one's first land in adjacent windows for every step."""
    spread = most
    while spread > 1 and _neighbour_gap(spread, records) < spread // 5:
        spread -= 1
    return spread


def _edge_gap(spread: int, records: int, stride: Any) -> Any:
    """Windows between a group's last record (part ``(records - 1) * stride % spread`` of window
    ``j``) and the next group's first (part 0 of window ``j + 1``); ``spread`` for groups of one
    record, whose blocks (of one record too) hold no neighbours."""
    if records < 2:
        return np.full(np.shape(stride), spread, dtype=np.int64)
    return np.abs((records - 1) % spread * np.asarray(stride, dtype=np.int64) % spread - 1)


def _neighbour_gap(spread: int, records: int) -> int:
    """The fewest windows between two records adjacent in a block, in groups of ``records`` dealt
    over ``spread`` windows (0: one window; docs/training.md, "The bound")."""
    stride = _deal_stride(spread, records)
    return int(min(stride, spread - stride, int(_edge_gap(spread, records, stride))))


def block_bounds(
    shard_sizes: Sequence[int] | np.ndarray[Any, Any], block: int
) -> tuple[
    np.ndarray[Any, np.dtype[np.int64]],
    np.ndarray[Any, np.dtype[np.int64]],
    np.ndarray[Any, np.dtype[np.int64]],
]:
    """The blocks of a dataset: ``(first, length, shard)`` arrays, blocks in manifest order.

    Shard ``k`` of ``n`` records is cut into ``m = max(1, n // block)`` blocks (none if empty),
    block ``t`` of it holding its records ``[t n // m, (t + 1) n // m)``: every block lies in one
    shard and holds at least ``block`` records (fewer only where the whole shard does), at most
    ``2 block - 1``. ``smstore._blocks.shard_block`` finds a record's block the same way.
    """
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    m = np.where(sizes > 0, np.maximum(1, sizes // block), 0)
    shard = np.repeat(np.arange(len(sizes), dtype=np.int64), m)
    t = np.arange(int(m.sum()), dtype=np.int64) - np.repeat(np.cumsum(m) - m, m)
    n, mk = sizes[shard], m[shard]
    lo, hi = t * n // mk, (t + 1) * n // mk
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return (starts[shard] + lo).astype(np.int64), (hi - lo).astype(np.int64), shard


def _cuts(size: int, deal: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Records of a group of ``size`` in its parts before each part: part t holds the records
    ``r < size`` with ``r % spread == deal[t]``."""
    spread = len(deal)
    counts = np.maximum(0, size - deal + spread - 1) // spread
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def _runs(
    values: np.ndarray[Any, np.dtype[np.int64]],
) -> Iterator[tuple[int, np.ndarray[Any, np.dtype[np.intp]]]]:
    """Each distinct value and the indices holding it (one sort, not a scan per value)."""
    by_value = np.argsort(values, kind="stable")
    sorted_values = values[by_value]
    cuts = np.flatnonzero(np.diff(sorted_values)) + 1
    for chunk in np.split(by_value, cuts):
        if chunk.size:
            yield int(values[chunk[0]]), chunk


class WindowedShuffleSampler(GlobalShuffleSampler):
    """A shuffle over a sharded dataset that reads only a window of shards at a time.

    **The order.** For epoch ``e``, the shards are put in a random order keyed by ``(seed, e)``;
    windows are runs of ``window`` consecutive shards of that order; the records of each window
    are shuffled among themselves, and the windows follow each other (:class:`WindowedOrder`).
    As with :class:`GlobalShuffleSampler`, the global order does not depend on the world size,
    rank ``r`` of ``W`` yields positions ``r, r + W, ...`` of it (so every rank reads the same
    window at the same time), padding and ``drop_last`` work the same, and ``state_dict`` /
    ``load_state_dict`` resume in O(1) with any world size. ``window`` equal to the number of
    shards is an exact global shuffle of the records (by another permutation than
    GlobalShuffleSampler's). docs/training.md measures how close other windows come.

    **Residency.** Over a :class:`~smstore.SharedStoreDataset` of a sharded dataset, the sampler
    tells the node which shards it needs as its order reaches them (:class:`ShardResidency`):
    the window it reads, the next one (loaded in the background while this one is read) and, for
    the first ``lag`` samples of a window, the previous one (DataLoader workers are still reading
    it: they run up to ``prefetch_factor * num_workers`` batches behind the sampler). With a
    daemon, it loads held shards into shared memory within ``--shm-limit`` and drops them when no
    rank holds them; without one, the files are read ahead into the page cache. Readers release
    a shard they stopped reading on their own (``ShardedStore.auto_release``), so memory stays
    near two windows.

    Args:
        dataset: A dataset with ``shard_sizes`` (``SharedStoreDataset``), or the shard sizes.
        window: Shards per window (see :meth:`window_for` to fit a memory budget).
        seed: Any integer; the same on every rank.
        rank: This rank (default: from torch.distributed or ``RANK``).
        world_size: The number of ranks (default: found like ``rank``).
        drop_last: Drop the tail that does not divide evenly instead of padding.
        residency: ``None`` (default): manage residency when ``dataset`` is a sharded
            SharedStoreDataset; ``False``: never; or a :class:`ShardResidency` to use.
        lag: Samples of this rank during which the previous window stays held; at least
            ``prefetch_factor * num_workers * batch_size`` (a shard released too early is read
            from its file, correctly but more slowly).
    """

    def __init__(
        self,
        dataset: Any,
        *,
        window: int,
        seed: int,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        residency: Any = None,
        lag: int = 8192,
    ) -> None:
        sizes = list(dataset) if isinstance(dataset, (list, tuple)) else list(dataset.shard_sizes)
        if any(int(s) < 0 for s in sizes):
            msg = "shard sizes must be >= 0"
            raise ValueError(msg)
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            msg = f"window must be a positive number of shards, not {window!r}"
            raise ValueError(msg)
        if lag < 0:
            msg = f"lag must be >= 0, not {lag}"
            raise ValueError(msg)
        super().__init__(sum(sizes), seed=seed, rank=rank, world_size=world_size, drop_last=drop_last)
        self.shard_sizes = [int(s) for s in sizes]
        self.window = min(window, max(1, len(sizes)))
        self.lag = int(lag)
        self._order_cache: tuple[tuple[int, int], WindowedOrder] | None = None
        if residency is None:
            residency = residency_for(dataset)
        self.residency = residency or None
        self._last_hold: tuple[int, ...] | None = None
        windows = -(-len(sizes) // self.window)
        average = self.num_records // max(1, windows)
        if self.residency is not None and windows > 1 and 2 * self.lag * self.world_size > average:
            warnings.warn(
                f"WindowedShuffleSampler: lag={self.lag} samples a rank ({self.lag * self.world_size} in all) "
                f"is more than half of an average window ({average} samples): the previous window stays "
                "held through most of the next, and the window after it starts loading late (under a "
                "budget of two windows, at its own start). Pass a lag of at least prefetch_factor * "
                f"num_workers * batch_size and below {average // (2 * self.world_size)}, or larger windows.",
                stacklevel=2,
            )

    @staticmethod
    def window_for(dataset: Any, budget: int) -> int:
        """The most shards a window can have so that two windows (the one read and the next)
        fit in `budget` bytes of shared memory, however the shards fall: the budget of
        ``smstore serve --shm-limit``, counted as the daemon counts it (each shard in whole pages).

        Raises:
            ValueError: The budget cannot hold two of the largest shards.
        """
        from smstore._manifest import read_manifest

        manifest = getattr(dataset, "manifest", None) or read_manifest(getattr(dataset, "path", dataset))
        # Two windows, not fewer: at a switch the window just left stays held for the lag while the
        # one now read must be resident already; with less room it waits for that lag, which the
        # loop waiting on it never ends.
        largest = max((_core.shm_footprint(s.file_size) for s in manifest.shards), default=0)
        if largest == 0 or budget < 2 * largest:
            msg = (
                f"a budget of {budget} bytes cannot hold two shards of up to {largest} bytes of shared memory "
                "(in whole pages, as the daemon counts them; the window being read and the next): raise it, "
                "or pack smaller shards (smstore pack --shard-size)"
            )
            raise ValueError(msg)
        return max(1, budget // (2 * largest))

    _max_chunk = 4096  # a window switch also holds the next shards: keep each draw short

    def permutation(self, epoch: int | None = None) -> WindowedOrder:
        """The order of ``epoch`` (default: the current one)."""
        epoch = self.epoch if epoch is None else int(epoch)
        cache_key = (self.seed, epoch)
        if self._order_cache is None or self._order_cache[0] != cache_key:
            key = f"smstore-windowed-shuffle-v1:{self.seed}:{epoch}:{self.window}:{self.shard_sizes}"
            self._order_cache = (cache_key, WindowedOrder(self.shard_sizes, self.window, key))
        return self._order_cache[1]

    def _reached(self, start: int, done: int) -> int:
        """Hold what the pass needs at local step `done`; the next step where that changes."""
        if self.num_records == 0:
            return sys.maxsize
        order = self.permutation()
        g = start + self.rank + done * self.world_size
        at = g % self.num_records  # the padding wraps to the start of the order
        j = order.window_of(at)
        begin = order.window_start(j)
        draining = j > 0 and at - begin < self.lag * self.world_size
        if self.residency is not None:
            shards = order.window_shards(j)
            if draining:
                shards += order.window_shards(j - 1)
            if j + 1 < order.window_count:
                shards += order.window_shards(j + 1)
            held = tuple(shards)
            if held != self._last_hold:
                first = self._last_hold is None
                self.residency.hold(held, wait=first)
                self._last_hold = held
        # The next point: the end of the previous window's lag, or the next window's start.
        nxt = order.window_start(j + 1)
        if draining:
            nxt = min(nxt, begin + self.lag * self.world_size)
        nxt += g - at  # back in the pass's (possibly wrapped) positions
        return done + max(1, -(-(nxt - g) // self.world_size))

    def _new_pass(self) -> None:
        self._last_hold = None  # the first hold of a pass is applied before it yields (errors up front)

    _order_kind = "windowed"

    def _order_params(self) -> dict[str, Any]:
        digest = hashlib.blake2b(str(self.shard_sizes).encode(), digest_size=8).hexdigest()
        return {"window": self.window, "shard_sizes_digest": digest}

    def close(self) -> None:
        """Give up the shards this rank holds (also done when the process exits)."""
        if self.residency is not None:
            self.residency.close()

    def __repr__(self) -> str:
        return (
            f"WindowedShuffleSampler(num_records={self.num_records}, shards={len(self.shard_sizes)}, "
            f"window={self.window}, seed={self.seed}, epoch={self.epoch}, rank={self.rank}, "
            f"world_size={self.world_size}, drop_last={self.drop_last})"
        )


# Bumped when BlockWindowOrder yields another order for the same key: a saved state says which.
_BLOCK_ORDER_VERSION = 3


class BlockWindowSampler(GlobalShuffleSampler):
    """A shuffle over a sharded dataset larger than memory that holds **blocks** (record ranges), not shards.

    **The order** is :class:`BlockWindowOrder` keyed by ``(seed, epoch)`` with groups of
    ``block`` records: each shard is cut into blocks of at least ``block`` records (never across a
    shard's end), the blocks put in a keyed order, each group's records dealt evenly over the
    ``spread`` windows from its own (source neighbours far apart), and each window shuffled
    exactly (docs/training.md, "Block windows"). As with
    :class:`GlobalShuffleSampler`, the order does not depend on the world size, rank ``r`` of
    ``W`` yields positions ``r, r + W, ...``, and ``state_dict`` / ``load_state_dict`` resume in
    O(1) at any world size.

    **Residency.** While window ``w`` is read, the blocks of groups ``w - spread + 1 .. w`` are
    needed and group ``w + 1``'s are loading (while the memory fills, the first ``spread``
    windows, the groups up to ``spread + 1`` are held from the start); the blocks of every window
    among this rank's last ``lag`` samples stay held too (the previous window's, for the first
    ``lag`` samples of a window; more where windows are shorter, as at the epoch's end).
    The sampler holds those blocks (each a :class:`smstore._blocks.Piece` of one shard, with
    :class:`smstore._blocks.BlockResidency`), so a daemon loads each one once an epoch, in one
    sequential read, within its ``--shm-limit``, and drops it when no rank holds it. Readers read
    records through :class:`smstore._blocks.BlockReader` (``keep=sampler.keep``).

    Args:
        dataset: A SharedStoreDataset of a sharded dataset (or anything with ``shard_sizes`` and
            the manifest's ``path``), or the shard sizes (no residency then).
        block: Records per block, at least, and per group (see :meth:`plan` for blocks of at
            least 4 MiB within a budget).
        spread: Windows each block's records are spread over (at least 1).
        seed: Any integer; the same on every rank.
        rank: This rank (default: from torch.distributed or ``RANK``).
        world_size: The number of ranks (default: found like ``rank``).
        drop_last: Drop the tail that does not divide evenly instead of padding.
        residency: ``None`` (default): a :class:`~smstore._blocks.BlockResidency` when
            ``dataset`` names a manifest; ``False``: none; or one to use.
        lag: Samples of this rank whose blocks stay held after the sampler moved past them: at
            least ``prefetch_factor * num_workers * batch_size``, the most a DataLoader's workers
            read behind it (a block released under a worker still to read it is fetched again).
    """

    def __init__(
        self,
        dataset: Any,
        *,
        block: int,
        spread: int,
        seed: int,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        residency: Any = None,
        lag: int = 1024,
    ) -> None:
        sizes = list(dataset) if isinstance(dataset, (list, tuple)) else list(dataset.shard_sizes)
        if any(int(x) < 0 for x in sizes):
            msg = "shard sizes must be >= 0"
            raise ValueError(msg)
        for name, value in (("block", block), ("spread", spread)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                msg = f"{name} must be a positive integer, not {value!r}"
                raise ValueError(msg)
        if lag < 0:
            msg = f"lag must be >= 0, not {lag}"
            raise ValueError(msg)
        super().__init__(sum(sizes), seed=seed, rank=rank, world_size=world_size, drop_last=drop_last)
        self.shard_sizes = [int(x) for x in sizes]
        self.block, self.spread, self.lag = block, spread, int(lag)
        self.starts = [0, *np.cumsum(self.shard_sizes, dtype=np.int64).tolist()]
        first, length, shard = block_bounds(self.shard_sizes, block)
        self._blocks = (first.tolist(), length.tolist(), shard.tolist())
        self._digest = hashlib.blake2b(str(self.shard_sizes).encode(), digest_size=8).hexdigest()
        self._order_cache: tuple[tuple[int, int], BlockWindowOrder] | None = None
        if residency is None:
            path = manifest_of(dataset)
            if path is not None:
                from smstore._blocks import BlockResidency

                # The dataset's daemon, mode and parsed manifest, as residency_for gives a window's.
                residency = BlockResidency(
                    path,
                    mode=getattr(dataset, "mode", "auto"),
                    socket=getattr(dataset, "socket", None),
                    manifest=getattr(dataset, "manifest", None),
                )
        self.residency = residency or None
        self._last_hold: tuple[Any, ...] | None = None
        # Pieces a reader keeps mapped: the blocks held (spread + 2 groups, and a block at each
        # end that a group shares with the next), one piece each, twice over for the windows in flight.
        self.keep = 2 * (spread + 4)

    @staticmethod
    def plan(dataset: Any, budget: int, *, block_bytes: int = 4 << 20) -> tuple[int, int]:
        """``(block, spread)`` for blocks of at least `block_bytes` (5 % over, on average) within `budget` bytes.

        What is held at once (``spread + 2`` groups of ``block`` records: the window's, the next
        and one in the lag; and the rest of a block at each end, which a group shares with the
        next, at most the longest block) and one group's room more fill the budget, with each
        piece's header, index and page rounding. The room is for the block the lag released:
        its pages count until every reader has unmapped it (at its next new block), and the next
        block's load should not wait for that. The spread, and with it the shards a batch draws
        from, grows with the budget over the block size (docs/training.md, "Block windows"); it is
        the widest that fits whose deal keeps source neighbours ``spread // 5`` windows apart
        (1 to 3 narrower in about 1 % of cases), so they never share a batch of
        ``(spread // 5 - 1) * block + 1`` positions past the fill.

        Raises:
            ValueError: The budget holds fewer than four groups and the blocks at the ends.
        """
        from smstore._manifest import read_manifest

        manifest = read_manifest(getattr(dataset, "path", dataset))
        return plan_blocks(
            [x.records for x in manifest.shards],
            sum(x.data_bytes for x in manifest.shards),
            budget,
            block_bytes,
        )

    _max_chunk = 4096  # a window switch also holds the next block: keep each draw short

    def permutation(self, epoch: int | None = None) -> BlockWindowOrder:
        """The order of ``epoch`` (default: the current one)."""
        epoch = self.epoch if epoch is None else int(epoch)
        cache_key = (self.seed, epoch)
        if self._order_cache is None or self._order_cache[0] != cache_key:
            key = f"smstore-block-shuffle-v2:{self.seed}:{epoch}:{self.block}:{self.spread}:{self._digest}"
            order = BlockWindowOrder(self.shard_sizes, block=self.block, group=1, spread=self.spread, key=key)
            self._order_cache = (cache_key, order)
        return self._order_cache[1]

    def held_blocks(self, position: int) -> list[int]:
        """The blocks held while ``position`` of the epoch's order is read (lag not counted), in load order.

        Window ``w``'s groups and the next; while the memory fills (the first ``spread`` windows,
        which draw from fewer groups) the groups up to ``spread + 1`` too, so the daemon loads
        ahead as far as the budget allows from the first batch on instead of one block a window.
        """
        order = self.permutation()
        w = order.window_of(position)
        groups = len(order.group_starts) - 1
        first = order.window_groups(w).start
        last = min(max(w + 1, self.spread + 1), groups - 1)
        blocks: list[int] = []
        for j in range(first, last + 1):
            blocks += [int(b) for b in order.group_blocks(j) if not blocks or b != blocks[-1]]
        return blocks

    def _reached(self, start: int, done: int) -> int:
        """Hold what the pass needs at local step `done`; the next step where that changes."""
        if self.num_records == 0:
            return sys.maxsize
        order = self.permutation()
        g = start + self.rank + done * self.world_size
        at = g % self.num_records  # the padding wraps to the start of the order
        w = order.window_of(at)
        # The windows of the last `lag` samples, which workers may still read: every one of them,
        # not only the previous (a window shorter than the lag, as at the epoch's end, would let
        # a worker behind read a released block, which the daemon then fetched again).
        lagged = order.window_of(max(0, at - self.lag * self.world_size))
        if self.residency is not None:
            blocks = self.held_blocks(at)
            for v in range(lagged, w):
                for j in order.window_groups(v):
                    blocks += [int(b) for b in order.group_blocks(j) if b not in blocks]
            held = tuple(self.piece(b) for b in blocks)
            if held != self._last_hold:
                self.residency.hold(held, wait=self._last_hold is None)
                self._last_hold = held
        nxt = order.window_start(w + 1)
        if lagged < w:
            nxt = min(nxt, order.window_start(lagged + 1) + self.lag * self.world_size)
        nxt += g - at
        return done + max(1, -(-(nxt - g) // self.world_size))

    def piece(self, b: int) -> Any:
        """Block ``b`` as the daemon holds it: a :class:`smstore._blocks.Piece` of its shard."""
        from smstore._blocks import Piece

        first, length, shard = (self._blocks[0][b], self._blocks[1][b], self._blocks[2][b])
        lo = first - self.starts[shard]
        return Piece(shard, lo, lo + length)

    def _new_pass(self) -> None:
        self._last_hold = None

    _order_kind = "blocks"

    def _order_params(self) -> dict[str, Any]:
        # (block, spread, shards, order version)
        return {"blocks": [self.block, self.spread, self._digest, _BLOCK_ORDER_VERSION]}

    def close(self) -> None:
        """Give up the blocks this rank holds (also done when the process exits)."""
        if self.residency is not None:
            self.residency.close()

    def __repr__(self) -> str:
        return (
            f"BlockWindowSampler(num_records={self.num_records}, shards={len(self.shard_sizes)}, "
            f"block={self.block}, spread={self.spread}, seed={self.seed}, epoch={self.epoch}, "
            f"rank={self.rank}, world_size={self.world_size}, drop_last={self.drop_last})"
        )


def check_order(sampler: GlobalShuffleSampler, state: Mapping[str, Any]) -> None:
    """Refuse a state that another order saved: resumed, its position would repeat some records
    and skip others. Every sampler's load_state_dict asks this one rule.

    A state names its order's kind (``"order"``: ``sampler._order_kind``) beside the entries that
    identify an order of that kind (``sampler._order_params()``: a window, blocks, a mixture's
    digest); a state saved before it named the kind is told by those entries.

    Raises:
        ValueError: (``sampler._state_error``) Another kind of order, or other parameters.
    """
    kind = state.get("order")
    if kind is None:
        kind = next((k for entry, k in _KIND_BY_ENTRY if entry in state), "global")
    name = type(sampler).__name__
    if kind != sampler._order_kind:
        msg = (
            f"the state was saved by a sampler of another kind of order ({kind!r}); this {name} draws a "
            f"{sampler._order_kind!r} order over the same positions: another order cannot be resumed (it "
            "would repeat some records and skip others)"
        )
        raise sampler._state_error(msg)
    mine = sampler._order_params()
    differ = [key for key, value in mine.items() if _plain(state.get(key)) != _plain(value)]
    if differ:
        theirs = ", ".join(f"{key}={state.get(key)!r}" for key in differ)
        ours = ", ".join(f"{key}={mine[key]!r}" for key in differ)
        msg = (
            f"the state was saved with {theirs}; this {name} has {ours} (other windows, blocks or shards, or "
            "another mixture: sources, lengths, weights or stopping rule): another order cannot be resumed"
        )
        raise sampler._state_error(msg)


def _plain(value: Any) -> Any:
    """A state's entry as saved and read back (a tuple comes back from JSON as a list)."""
    return list(value) if isinstance(value, tuple) else value


def manifest_of(dataset: Any) -> str | None:
    """The manifest's path of a SharedStoreDataset of a sharded dataset, else None."""
    path = getattr(dataset, "path", None)
    if not isinstance(path, str) or getattr(dataset, "shard_sizes", None) is None:
        return None
    from smstore._manifest import is_manifest

    return path if is_manifest(path) else None


def residency_for(dataset: Any) -> Any:
    """A ShardResidency for a SharedStoreDataset of a sharded dataset, else None."""
    path = manifest_of(dataset)
    if path is None:
        return None
    from smstore.residency import ShardResidency

    return ShardResidency(
        path,
        mode=getattr(dataset, "mode", "auto"),
        socket=getattr(dataset, "socket", None),
        manifest=getattr(dataset, "manifest", None),  # a dataset URL's, not fetched again
    )


T = TypeVar("T")


class ResumableLoader(Generic[T]):
    """A DataLoader whose saved position is what the training loop received, prefetch or not.

    A ``DataLoader`` with workers (and accelerate's or Lightning's loaders) draws indices from the
    sampler batches ahead of the loop. This wrapper counts the batches it hands to the loop in the
    current pass, so its :meth:`state_dict` is the sampler's state at exactly that point: a batch
    counts as consumed once the loop has received it. The state is the sampler's own (the same
    ``{"seed", "epoch", "consumed", ...}``), so it resumes with any world size::

        loader = ResumableLoader(DataLoader(ds, batch_size=32, sampler=sampler, num_workers=4))
        loader.load_state_dict(checkpoint["data"])  # when resuming
        for epoch in range(checkpoint["data"]["epoch"], epochs):
            loader.set_epoch(epoch)
            for batch in loader:
                ...
                checkpoint = {"data": loader.state_dict(), ...}

    Batches must be ``batch_size`` samples each (the last of a pass may be short, or dropped) and
    arrive in order: a DataLoader with a ``batch_size``, or one prepared by accelerate. For batches
    of varying size (a custom ``batch_sampler``), use torchdata's ``StatefulDataLoader``, which
    snapshots the sampler as it draws each batch.

    Args:
        loader: The DataLoader (anything iterable with a ``batch_size``, and a ``sampler`` or
            ``batch_sampler`` that leads to a :class:`GlobalShuffleSampler`).
        sampler: The sampler, when it cannot be found through ``loader``'s attributes.

    Raises:
        TypeError: No sampler or no fixed batch size could be found.
        ValueError: The loader delivers batches out of order (``in_order=False``).
    """

    def __init__(self, loader: Iterable[T], *, sampler: GlobalShuffleSampler | None = None) -> None:
        chain = _sampler_chain(loader)
        found = (
            sampler
            if sampler is not None
            else next((s for s in chain if isinstance(s, GlobalShuffleSampler)), None)
        )
        if found is None:
            msg = (
                f"no GlobalShuffleSampler found in {type(loader).__name__}'s sampler or batch_sampler: "
                "pass ResumableLoader(loader, sampler=...)"
            )
            raise TypeError(msg)
        batch_size = next((b for s in chain if isinstance(b := getattr(s, "batch_size", None), int)), None)
        if batch_size is None:
            msg = (
                f"{type(loader).__name__} has no fixed batch_size (a custom batch_sampler?), so the samples "
                "of the batches received are not known: use torchdata's StatefulDataLoader, which "
                "snapshots the sampler as it draws each batch"
            )
            raise TypeError(msg)
        if getattr(loader, "in_order", True) is False:
            msg = (
                "in_order=False delivers batches as workers finish them, so the batches received are not "
                "a prefix of the order and no position resumes them exactly: use in_order=True"
            )
            raise ValueError(msg)
        self.loader = loader
        self.sampler = found
        self.batch_size = batch_size
        self._received = 0  # batches of the current pass handed to the loop
        self._exhausted = False  # the loop received the whole pass

    def __iter__(self) -> Iterator[T]:
        self._received, self._exhausted = 0, False
        for batch in self.loader:
            self._received += 1
            yield batch
        self._exhausted = True  # not reached when the loop stops early: then the count stands

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch: through the loader when it has ``set_epoch`` (accelerate's counts its
        passes as epochs), else on the sampler."""
        set_epoch = getattr(self.loader, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        else:
            self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state after the samples the loop received in the current pass."""
        local = sys.maxsize if self._exhausted else self._received * self.batch_size
        return self.sampler.state_dict(local_consumed=local)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a state of :meth:`state_dict` (or of ``GlobalShuffleSampler.state_dict``)."""
        self.sampler.load_state_dict(state)


def _sampler_chain(loader: object) -> list[object]:
    """The samplers and batch samplers reachable from ``loader`` (accelerate nests them two deep)."""
    found: list[object] = [loader]
    for obj in found:
        if len(found) > 16:
            break
        for name in ("sampler", "batch_sampler"):
            child = getattr(obj, name, None)
            if child is not None and all(child is not f for f in found):
                found.append(child)
    return found
