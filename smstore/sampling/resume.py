"""ResumableLoader: a DataLoader whose saved position is what the training loop received."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar

from smstore.sampling.sampler import GlobalShuffleSampler

__all__ = ["ResumableLoader"]

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
