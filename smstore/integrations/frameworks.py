"""What training frameworks do to a sampler that is already split across ranks, seen from its callers.

Lightning, Accelerate (and through it the HF Trainer) split a DataLoader's sampler across ranks
themselves, and none of them has a way to say "this sampler is split already". Lightning leaves a
``DistributedSampler`` alone, which :class:`~smstore.GlobalShuffleSampler` is. Accelerate wraps every
batch sampler in a ``BatchSamplerShard`` that keeps every W-th batch, so a rank would see 1/W of its
share. The sampler looks at the objects up its call stack when a pass starts and when its length is
asked (the only moments a framework's wrapper is there to be seen): it turns a ``BatchSamplerShard``'s
second split off (what transformers' Trainer does for its own rank-aware ``BatchRebalanceSampler``),
refuses the wrappers it cannot undo with an error that names the fix, and notes loaders that draw
indices ahead of the training loop (so that ``state_dict()`` without a count can refuse to guess).

No framework is imported here: only classes of modules already loaded are compared, so a process
that never imported accelerate pays nothing for it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any, NamedTuple, Protocol

__all__ = ["adopt_wrappers", "called_by_stateful_loader", "check_set_epoch", "inspect_pass"]

# Objects that draw a pass ahead of the training loop: worker prefetch, accelerate's one-batch
# look-ahead, Lightning's prefetching fetcher. (A single-process torch DataLoader draws a batch
# when the loop asks for it, so it is not here.)
_SHARD_LOADER = ("accelerate.data_loader", "DataLoaderShard")  # what prepare() returns
_AHEAD = (
    ("torch.utils.data.dataloader", "_MultiProcessingDataLoaderIter"),
    ("torchdata.stateful_dataloader.stateful_dataloader", "_StatefulMultiProcessingDataLoaderIter"),
    _SHARD_LOADER,
    ("lightning.pytorch.loops.fetchers", "_DataFetcher"),
    ("pytorch_lightning.loops.fetchers", "_DataFetcher"),
    ("smstore.loading.loader", "Loader"),  # prefetches depth batches; its state_dict() counts those received
    ("smstore.loading.transform_loader", "TransformLoader"),  # its workers fill slots ahead of the loop
)
# Lightning's replacement for a sampler that is not a DistributedSampler: it lists the sampler's
# whole pass and splits it again. GlobalShuffleSampler never gets there with Lightning's defaults;
# a user's own sampler that wraps one does.
_LIGHTNING_WRAPPERS = (
    ("lightning.fabric.utilities.distributed", "_DatasetSamplerWrapper"),
    ("lightning_fabric.utilities.distributed", "_DatasetSamplerWrapper"),
)
_SHARD = ("accelerate.data_loader", "BatchSamplerShard")  # the second split
_DISPATCHER = ("accelerate.data_loader", "DataLoaderDispatcher")  # process 0 reads for all
_DEPTH = 64  # frames looked at; a Lightning fetcher sits about 15 frames above the sampler


class Split(Protocol):
    """What is read of the sampler: its place among the ranks."""

    rank: int
    world_size: int


def _loaded(*names: tuple[str, str]) -> tuple[type[Any], ...]:
    """The classes among ``names`` whose modules are loaded."""
    found: list[type[Any]] = []
    for module, name in names:
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)


def _callers(frame: FrameType | None) -> Iterator[tuple[Any, str]]:
    """``self`` and the function's name of each method's frame from ``frame`` up."""
    for _ in range(_DEPTH):
        if frame is None:
            return
        if frame.f_code.co_varnames[:1] == ("self",):  # a method (skip f_locals for the rest)
            obj = frame.f_locals.get("self")
            if obj is not None:
                yield obj, frame.f_code.co_name
        frame = frame.f_back


def _name(sampler: Split) -> str:
    return type(sampler).__name__


def _resplit_error(sampler: Split) -> ValueError:
    return ValueError(
        f"{_name(sampler)} is already split across ranks (rank {sampler.rank} of {sampler.world_size}), and "
        "Lightning's DistributedSamplerWrapper is splitting it again: each rank would train on "
        f"1/{sampler.world_size} of its share. Give the DataLoader the {_name(sampler)} itself (Lightning "
        "leaves a DistributedSampler alone), or pass use_distributed_sampler=False to the Trainer "
        "(Fabric: setup_dataloaders(..., use_distributed_sampler=False))."
    )


def _adopt_shard(shard: Any, sampler: Split) -> None:
    """Turn accelerate's second split off, or raise where that would not give this rank its share."""
    if shard.num_processes == 1 or sampler.world_size == 1:
        return  # nothing split twice (a world-size-1 sampler is accelerate's to split, by batches)
    if shard.split_batches:
        msg = (
            f"{_name(sampler)} is already split across ranks, and accelerate's split_batches=True cuts each of "
            f"this rank's batches into {shard.num_processes} pieces, keeping one. Use split_batches=False, or "
            f"build the sampler with rank=0, world_size=1 so that accelerate splits the global order instead."
        )
        raise ValueError(msg)
    if (shard.num_processes, shard.process_index) != (sampler.world_size, sampler.rank):
        msg = (
            f"{_name(sampler)} is rank {sampler.rank} of {sampler.world_size}, but accelerate's data loader is "
            f"process {shard.process_index} of {shard.num_processes} (a device mesh with tensor or context "
            "parallel ranks reading the same data?). Pass rank= and world_size= of the data-parallel group to "
            "the sampler, or rank=0, world_size=1 so that accelerate splits the global order by batches."
        )
        raise ValueError(msg)
    # Every batch of this rank's own order, the last one as it is: the sampler already gives every
    # rank the same number of samples, so accelerate's even_batches padding would only repeat some.
    shard.num_processes, shard.process_index, shard.even_batches = 1, 0, False


def adopt_wrappers(sampler: Split, frame: FrameType | None) -> None:
    """At ``len(sampler)``: undo accelerate's second split before a framework counts the steps of an epoch.

    Raises:
        ValueError: A framework splits the sampler again in a way that cannot be undone.
    """
    shard = _loaded(_SHARD)
    lightning = _loaded(*_LIGHTNING_WRAPPERS)
    if not shard and not lightning:
        return
    for obj, _ in _callers(frame):
        if shard and isinstance(obj, shard):
            _adopt_shard(obj, sampler)
        elif lightning and isinstance(obj, lightning) and sampler.world_size > 1:
            raise _resplit_error(sampler)


class Pass(NamedTuple):
    """What the callers say about a pass that starts."""

    ahead: bool  # drawn ahead of the training loop
    epoch: int | None  # the epoch accelerate's loader gives this pass (None: not under accelerate)


def inspect_pass(sampler: Split, frame: FrameType | None) -> Pass:
    """At the start of a pass: adopt or refuse the framework's wrappers, say whether the pass is
    drawn ahead of the training loop, and which epoch accelerate means it to be.

    accelerate's loader sets its count of passes as the sampler's epoch as each pass starts, but
    cannot reach a sampler nested one level deeper than usual, as in the loader that
    ``skip_first_batches`` builds (what the HF Trainer resumes with): the sampler would start the
    resumed epoch in the order of epoch 0. Reading the count here gives the epoch accelerate meant.

    Raises:
        ValueError: A framework splits the sampler again in a way that cannot be undone, or has
            one rank read for all.
    """
    shard = _loaded(_SHARD)
    dispatcher = _loaded(_DISPATCHER)
    lightning = _loaded(*_LIGHTNING_WRAPPERS)
    ahead = _loaded(*_AHEAD)
    shard_loader = _loaded(_SHARD_LOADER)
    drawn_ahead, epoch = False, None
    for obj, function in _callers(frame):
        if shard_loader and epoch is None and function == "__iter__" and isinstance(obj, shard_loader):
            epoch = int(obj.iteration)
        if shard and isinstance(obj, shard):
            _adopt_shard(obj, sampler)
        elif dispatcher and isinstance(obj, dispatcher) and sampler.world_size > 1:
            msg = (
                f"accelerate's dispatch_batches=True has process 0 read the batches of every rank, but "
                f"{_name(sampler)} yields rank 0's share only. Use dispatch_batches=False (the default for a "
                "map-style dataset), or build the sampler with rank=0, world_size=1."
            )
            raise ValueError(msg)
        elif lightning and isinstance(obj, lightning) and sampler.world_size > 1:
            raise _resplit_error(sampler)
        if ahead and isinstance(obj, ahead):
            drawn_ahead = True
    return Pass(drawn_ahead, epoch)


def check_set_epoch(sampler: Split, epoch: int, pending: int, frame: FrameType | None) -> None:
    """A resume position is pending for epoch ``pending``, and ``set_epoch(epoch)`` would drop it:
    refuse when accelerate's loader does that on its own as a pass starts (it sets its count of
    passes as the epoch), not when someone asks for another epoch.

    Raises:
        ValueError: accelerate's DataLoaderShard is about to start the pass at another epoch.
    """
    shard_loader = _loaded(_SHARD_LOADER)
    if not shard_loader:
        return
    for obj, function in _callers(frame):
        if function == "__iter__" and isinstance(obj, shard_loader):
            msg = (
                f"{_name(sampler)} was loaded to resume epoch {pending}, but accelerate's prepared DataLoader "
                f"starts its pass {epoch} with set_epoch({epoch}), which would restart another epoch from its "
                f"beginning. Call set_epoch({pending}) on the prepared DataLoader (it passes the epoch on to "
                "the sampler and counts its passes from there) before iterating it."
            )
            raise ValueError(msg)


def called_by_stateful_loader(frame: FrameType | None) -> bool:
    """Whether torchdata's StatefulDataLoader is asking (it snapshots the sampler as it draws each batch)."""
    for _ in range(4):
        if frame is None:
            return False
        module = frame.f_globals.get("__name__", "")
        if module.startswith("torchdata."):
            return True
        if not module.startswith("smstore.sampling."):  # the sampler classes live there
            return False
        frame = frame.f_back
    return False
