"""`LoaderStats`: how long a training loop waits for each batch, and the share of its step time that is."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

__all__ = ["LoaderStats"]

T = TypeVar("T")


class LoaderStats:
    """Batch wait time per step and the share of step time spent waiting for data, for a log line.

    A step runs from the loop asking for its batch to the loop asking for the next one: its wait is
    the time inside ``next()`` (the loader's fault), the rest is the loop's own work. Wrap any batch
    iterable (a ``torch.utils.data.DataLoader``, `smstore.Loader`, `smstore.TransformLoader`, a
    list) — the batches are the same objects, the loop body unchanged::

        stats = smstore.LoaderStats()
        for step, batch in enumerate(stats.wrap(loader)):
            ...
            bar.set_postfix(stats.postfix())          # wait=0.4ms data=1.2%

    `smstore.Loader` and `smstore.TransformLoader` time themselves: ``loader.stats()`` is one of
    these, filled by every pass, so a loop that iterates the loader as it is needs no change.

    Args:
        window: The recent steps that `wait_share` and `mean_wait` average over.
        clock: Seconds as a float (default ``time.perf_counter``); a test may pass its own.
    """

    def __init__(self, window: int = 100, clock: Callable[[], float] = time.perf_counter) -> None:
        if window < 1:
            msg = f"LoaderStats(window={window}): the window must hold at least one step"
            raise ValueError(msg)
        self.window = window
        self._clock = clock
        self.reset()

    def reset(self) -> None:
        """Forget every step counted so far."""
        self.steps = 0  # batches handed to the loop
        self.last_wait = 0.0  # seconds the latest batch kept the loop waiting
        self.total_wait = 0.0  # seconds waited, all steps
        self.total_time = 0.0  # seconds of the steps finished (their wait and the loop's work)
        self._finished_wait = 0.0  # seconds waited by the steps finished
        self._recent: deque[tuple[float, float]] = deque(maxlen=self.window)  # (wait, step) finished
        self._asked: float | None = None  # when the latest batch was asked for
        self._wait = 0.0

    def wrap(self, batches: Iterable[T]) -> Iterator[T]:
        """The batches of `batches`, each timed: how long ``next()`` took, and the step around it."""
        it = iter(batches)
        clock = self._clock
        try:
            while True:
                asked = clock()
                self._finish_step(asked)
                try:
                    batch = next(it)
                except StopIteration:
                    return
                got = clock()
                self._asked, self._wait = asked, got - asked
                self.steps += 1
                self.last_wait = self._wait
                self.total_wait += self._wait
                yield batch
        finally:
            self._asked = None  # a step ended by the end of the loop is not counted whole
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def _finish_step(self, now: float) -> None:
        if self._asked is not None:
            step = now - self._asked
            self.total_time += step
            self._finished_wait += self._wait
            self._recent.append((self._wait, step))
            self._asked = None

    @property
    def mean_wait(self) -> float:
        """Seconds waited per step, over the last `window` finished steps."""
        return sum(w for w, _ in self._recent) / len(self._recent) if self._recent else 0.0

    @property
    def wait_share(self) -> float:
        """The share (0 to 1) of the last `window` finished steps' time spent waiting for data."""
        total = sum(s for _, s in self._recent)
        return sum(w for w, _ in self._recent) / total if total > 0 else 0.0

    @property
    def total_wait_share(self) -> float:
        """The share of every finished step's time spent waiting for data."""
        return self._finished_wait / self.total_time if self.total_time > 0 else 0.0

    def summary(self) -> dict[str, float]:
        """The figures for a logger: ``steps``, ``wait_ms`` (last step), ``mean_wait_ms``, ``wait_share``
        (recent) and ``total_wait_share``."""
        return {
            "steps": self.steps,
            "wait_ms": self.last_wait * 1e3,
            "mean_wait_ms": self.mean_wait * 1e3,
            "wait_share": self.wait_share,
            "total_wait_share": self.total_wait_share,
        }

    def postfix(self) -> dict[str, str]:
        """Short strings for ``tqdm``'s ``set_postfix``: the recent mean wait and the share waiting."""
        return {"wait": f"{self.mean_wait * 1e3:.1f}ms", "data": f"{self.wait_share:.1%}"}

    def __repr__(self) -> str:
        return (
            f"LoaderStats(steps={self.steps}, mean_wait={self.mean_wait * 1e3:.2f} ms, "
            f"wait_share={self.wait_share:.1%})"
        )
