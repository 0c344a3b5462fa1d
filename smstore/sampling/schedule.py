"""Mixture schedules: weights that change at given positions, each phase an exact mixture, no index.

A schedule is a list of phases over the same sources: phase ``i`` covers the positions
``[b_i, b_{i+1})`` of the epoch and draws them by its own :class:`~smstore.Mixture` (the same
closed form and exact-prefix bound, counted from the phase's first position). Every source has one
stream of draws for the whole epoch, as in a plain mixture: a switch changes only how often each
source is drawn, never where its stream is, so no record is repeated early or skipped by a switch.
:class:`MixtureSampler` splits, resumes and pads a schedule's order exactly as a mixture's.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence, Sized
from typing import Any, ClassVar

import numpy as np

from smstore import _core
from smstore.errors import MixtureError
from smstore.sampling.mixture import Mixture, MixtureDataset, parse_megatron_blend
from smstore.sampling.orders import OrderSpec, map_positions, round_keys

__all__ = [
    "MixtureSchedule",
    "ScheduleOrder",
    "ScheduleSpec",
    "ScheduledMixtureDataset",
    "from_megatron_schedule",
    "parse_schedule",
]

Phases = list[tuple[int, list[float]]]


def _int_at_least(value: object, low: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        msg = f"{what} is {value!r}: it must be an integer >= {low}"
        raise MixtureError(msg)
    return int(value)


class MixtureSchedule:
    """Which source each position of an epoch draws from, and its draw number, under phases of weights.

    **Phases.** ``phases`` is ``[(b_0, w_0), (b_1, w_1), ...]`` with ``b_0 = 0 < b_1 < ... <
    total``: positions ``[b_i, b_{i+1})`` (the last phase up to ``total``) draw by the mixture of
    weights ``w_i`` (one per source; a weight 0 leaves the source out of that phase, at least one
    is positive). Inside phase ``i`` position ``b_i + m`` draws from the source the phase's
    :class:`~smstore.Mixture` gives to its position ``m``, so the counts of the phase's first
    ``m`` positions keep that mixture's bound ``|c_s - m w_s| <= E_s`` (``phase(i).deviation_bounds()``).

    **A source's position at a switch.** Every source has one stream of draws per epoch: its
    ``k``-th draw is record ``P_{s,e}(k mod n_s)`` of its own keyed permutation for pass ``e = k
    // n_s`` (exactly :class:`~smstore.MixtureOrder`'s). At the switch to phase ``i`` source ``s``
    has drawn ``D_i[s] = sum_{j < i} c_{s,j}`` times (``c_{s,j}`` its draws in phase ``j``, which
    the closed form gives in O(depth)), and its next draw is its draw ``D_i[s]``: the record after
    the last one it gave, in the same pass. A one-phase schedule is the mixture's order itself.

    **Cost.** Locating a position is a binary search over the phase starts and one descent of the
    phase's tree: O(log phases + depth), no table; the ``D_i`` are ``phases x sources`` integers.

    Args:
        sources: One per source: its number of records, or anything with ``len``.
        phases: ``(start position, weights)`` per phase, in order, the first at 0.
        total: The positions of an epoch (``steps x global batch`` for a run of that many steps).

    Raises:
        MixtureError: Phases that do not start at 0, do not rise strictly or start at or past
            ``total``; weights of the wrong count, negative, not finite or all 0; an empty source.
    """

    def __init__(
        self, sources: Sequence[Sized | int], phases: Sequence[tuple[int, Sequence[float]]], total: int
    ) -> None:
        if len(sources) == 0:
            msg = "a mixture schedule needs at least one source"
            raise MixtureError(msg)
        lengths = [s if isinstance(s, (int, np.integer)) else len(s) for s in sources]
        self.lengths = [_int_at_least(n, 1, f"the length of source {i}") for i, n in enumerate(lengths)]
        self.offsets = [0]
        for n in self.lengths:
            self.offsets.append(self.offsets[-1] + n)
        self.num_samples = _int_at_least(total, 1, "the schedule's total")
        if len(phases) == 0:
            msg = "a mixture schedule needs at least one phase"
            raise MixtureError(msg)
        self.starts: list[int] = []
        self.phases: list[Mixture] = []
        self.members: list[list[int]] = []  # per phase, the sources it draws from (weight > 0)
        for i, phase in enumerate(phases):
            if not isinstance(phase, (tuple, list)) or len(phase) != 2:
                msg = f"phase {i} is {phase!r}: give (start position, weights)"
                raise MixtureError(msg)
            start = _int_at_least(phase[0], 0, f"the start of phase {i}")
            if i == 0 and start != 0:
                msg = f"phase 0 starts at {start}: the first phase must start at position 0"
                raise MixtureError(msg)
            if i and start <= self.starts[-1]:
                msg = f"phase {i} starts at {start}, not after phase {i - 1} ({self.starts[-1]}): starts must rise"
                raise MixtureError(msg)
            if start >= self.num_samples:
                msg = f"phase {i} starts at {start}, at or past the schedule's total of {self.num_samples} positions"
                raise MixtureError(msg)
            self.starts.append(start)
            self._add_phase(i, phase[1])
        ends = [*self.starts[1:], self.num_samples]
        # D_i[s]: source s's draws before phase i (its stream's position at the switch).
        self.before: list[list[int]] = [[0] * len(self.lengths)]
        for i, end in enumerate(ends):
            drawn = self._phase_counts(i, end - self.starts[i])
            self.before.append([a + b for a, b in zip(self.before[-1], drawn, strict=True)])
        key = json.dumps([self.lengths, self.starts, [m.shares for m in self.phases], self.members, total])
        self.digest = hashlib.blake2b(key.encode(), digest_size=8).hexdigest()

    def _add_phase(self, i: int, given: Sequence[float] | np.ndarray[Any, Any]) -> None:
        weights: Any = given.tolist() if isinstance(given, np.ndarray) and given.ndim == 1 else given
        if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
            msg = f"phase {i}'s weights are {weights!r}: give one number per source"
            raise MixtureError(msg)
        if len(weights) != len(self.lengths):
            msg = f"phase {i} has {len(weights)} weights for {len(self.lengths)} sources: give one per source"
            raise MixtureError(msg)
        members = []
        for s, w in enumerate(weights):
            if isinstance(w, (int, float, np.integer, np.floating)) and not isinstance(w, bool) and w == 0:
                continue  # left out of this phase
            members.append(s)
        if not members:
            msg = f"phase {i}'s weights are all 0: a phase must draw from at least one source"
            raise MixtureError(msg)
        try:
            mix = Mixture([self.lengths[s] for s in members], [weights[s] for s in members], stop=0)
        except MixtureError as e:
            msg = f"phase {i}: {e}"
            raise MixtureError(msg) from None
        self.phases.append(mix)
        self.members.append(members)

    def _phase_counts(self, i: int, m: int) -> list[int]:
        """Each source's draws in the first ``m`` positions of phase ``i``."""
        out = [0] * len(self.lengths)
        for s, c in zip(self.members[i], self.phases[i].counts(m), strict=True):
            out[s] = c
        return out

    def phase_of(self, position: int) -> int:
        """The phase holding ``position`` (O(log phases))."""
        return bisect.bisect_right(self.starts, position) - 1

    def count(self, source: int, n: int) -> int:
        """How many of positions ``[0, n)`` draw from ``source`` (exact for any ``0 <= n <= total``)."""
        i = self.phase_of(n)
        return self.before[i][source] + self._phase_counts(i, n - self.starts[i])[source]

    def weights(self, i: int) -> list[float]:
        """Phase ``i``'s weights, normalised (0 for a source it leaves out)."""
        out = [0.0] * len(self.lengths)
        for s, w in zip(self.members[i], self.phases[i].weights, strict=True):
            out[s] = float(w)
        return out

    def locate(
        self, positions: np.ndarray[Any, Any]
    ) -> tuple[np.ndarray[Any, np.dtype[np.int64]], np.ndarray[Any, np.dtype[np.int64]]]:
        """For positions ``p`` in ``[0, total)`` (flattened): the source each draws from and its draw
        number in the epoch (how many positions before ``p`` drew from that source)."""
        p = np.asarray(positions).astype(np.int64, copy=False).ravel()
        if p.size and (int(p.min()) < 0 or int(p.max()) >= self.num_samples):
            bad = int(p.min()) if int(p.min()) < 0 else int(p.max())
            msg = f"position {bad} out of range for a mixture schedule of {self.num_samples}"
            raise IndexError(msg)
        phase = np.searchsorted(np.asarray(self.starts, dtype=np.int64), p, side="right") - 1
        source = np.empty(p.size, dtype=np.int64)
        draw = np.empty(p.size, dtype=np.int64)
        for i in np.unique(phase).tolist():
            at = phase == i
            s, k = self.phases[i].locate(p[at] - self.starts[i])
            s = np.asarray(self.members[i], dtype=np.int64)[s]
            source[at] = s
            draw[at] = k + np.asarray(self.before[i], dtype=np.int64)[s]
        return source, draw

    @classmethod
    def parse(
        cls, sources: Sequence[Sized | int], text: str | Mapping[str, Any], *, global_batch: int | None = None
    ) -> MixtureSchedule:
        """The schedule of :func:`parse_schedule`'s text or dict over ``sources`` (in source order)."""
        phases, total, _ = parse_schedule(text, global_batch=global_batch)
        return cls(sources, phases, total)

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        phases = ", ".join(
            f"{b}: [{', '.join(f'{w:.4g}' for w in self.weights(i))}]" for i, b in enumerate(self.starts)
        )
        return f"MixtureSchedule(lengths={self.lengths}, phases={{{phases}}}, total={self.num_samples})"


class ScheduleOrder:
    """The order of one epoch of a schedule: position ``p`` -> ``offset_s + P_{s,e}(k mod n_s)``.

    ``s`` and the draw number ``k`` come from :meth:`MixtureSchedule.locate`; the permutations are
    :class:`~smstore.MixtureOrder`'s, keyed by ``(seed, epoch, s, e)``: a one-phase schedule gives
    the mixture's order, index for index.
    """

    def __init__(self, schedule: MixtureSchedule, seed: int, epoch: int) -> None:
        self.schedule = schedule
        self.n = schedule.num_samples
        self.prefix = f"smstore-mixture-v1:{seed}:{epoch}"
        self._keys: dict[tuple[int, int], list[int]] = {}

    def _round_keys(self, s: int, e: int) -> list[int]:
        keys = self._keys.get((s, e))
        if keys is None:
            if len(self._keys) >= 64:  # a chunk reaches each source's pass and the next at most
                self._keys.clear()
            n = self.schedule.lengths[s]
            keys = self._keys[(s, e)] = round_keys(f"{self.prefix}:{s}:{e}:{n}".encode())
        return keys

    def pairs(
        self, positions: np.ndarray[Any, Any]
    ) -> tuple[np.ndarray[Any, np.dtype[np.int64]], np.ndarray[Any, np.dtype[np.int64]]]:
        """``(source, index in source)`` for each position in ``[0, n)`` (flattened).

        Raises:
            IndexError: A position is outside ``[0, n)``.
        """
        source, draw = self.schedule.locate(positions)
        lengths = np.asarray(self.schedule.lengths, dtype=np.int64)[source]
        passes, within = np.divmod(draw, lengths)
        local = np.empty_like(draw)
        count = len(self.schedule.lengths)
        lanes, inverse = np.unique(passes * count + source, return_inverse=True)
        for j, lane in enumerate(lanes.tolist()):
            e, s = divmod(lane, count)
            at = inverse.ravel() == j
            keys = self._round_keys(s, e)
            local[at] = _core.feistel_permute(within[at].astype(np.uint64), self.schedule.lengths[s], keys)
        return source, local

    def _indices(self, flat: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.int64]]:
        source, local = self.pairs(flat)
        out: np.ndarray[Any, np.dtype[np.int64]] = np.asarray(self.schedule.offsets, dtype=np.int64)[source]
        return out + local

    def __call__(self, positions: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Global indices (into the concatenation of the sources) at an array of positions."""
        return map_positions(positions, self._indices, f"a mixture schedule of {self.n}")

    def strided_array(
        self, first: int, step: int, count: int, wrap: int
    ) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The indices at positions ``(first + i * step) % wrap`` for ``i < count``."""
        if count <= 0:
            return np.empty(0, dtype=np.int64)
        positions = (first + np.arange(count, dtype=np.uint64) * np.uint64(step)) % np.uint64(wrap)
        return self._indices(positions)

    def strided(self, first: int, step: int, count: int, wrap: int) -> list[int]:
        """:meth:`strided_array` as a list."""
        out: list[int] = self.strided_array(first, step, count, wrap).tolist()
        return out

    def __len__(self) -> int:
        return self.n


class ScheduleSpec(OrderSpec):
    """A mixture schedule's epoch (:class:`ScheduleOrder`): phases of weights over the same sources."""

    kind: ClassVar[str] = "mixture-schedule"
    error: ClassVar[type[ValueError]] = MixtureError

    def __init__(self, schedule: MixtureSchedule) -> None:
        self.schedule = schedule
        self.num_records = schedule.num_samples

    def order(self, seed: int, epoch: int) -> ScheduleOrder:
        return ScheduleOrder(self.schedule, seed, epoch)

    def params(self) -> dict[str, Any]:
        return {"schedule": self.schedule.digest}  # lengths, phase starts, weights and total

    def data(self) -> dict[str, Any]:
        return {"records": self.num_records, "sources": len(self.schedule.lengths)}

    def fields(self) -> str:
        return f"schedule={self.schedule!r}"


# -- the format ---------------------------------------------------------------------------------


def _start(word: str, global_batch: int | None, where: str) -> int:
    """A phase boundary: a position (``900000``) or a step (``step 9000``: times the global batch)."""
    parts = word.split()
    if len(parts) == 2 and parts[0] == "step":
        if global_batch is None:
            msg = f"{where}: {word!r} counts steps: pass global_batch= to turn steps into positions"
            raise MixtureError(msg)
        value, scale = parts[1], global_batch
    elif len(parts) == 1:
        value, scale = parts[0], 1
    else:
        msg = f"{where}: {word!r} is not a position ('900000') or a step ('step 9000')"
        raise MixtureError(msg)
    if not value.isdigit():
        msg = f"{where}: {value!r} is not a whole number"
        raise MixtureError(msg)
    return int(value) * scale


def _blend(words: str, names: list[str] | None, where: str) -> tuple[list[float], list[str] | None]:
    """A phase's weights: bare numbers in source order, or a Megatron blend ``weight name ...``."""
    parts = words.split()
    try:
        return [float(w) for w in parts], names
    except ValueError:
        pass
    pairs = parse_megatron_blend(parts) if len(parts) > 1 else []
    if not pairs:
        msg = f"{where}: {words!r} is neither weights ('0.7 0.3') nor a blend ('0.7 web 0.3 code')"
        raise MixtureError(msg)
    given = {name: w for w, name in pairs}
    if len(given) != len(pairs):
        msg = f"{where}: a source is named twice in {words!r}"
        raise MixtureError(msg)
    if names is None:
        names = [name for _, name in pairs]
    unknown = sorted(set(given) - set(names))
    if unknown:
        msg = f"{where}: {unknown} not among the first phase's sources {names}: every source is named in phase 0"
        raise MixtureError(msg)
    return [given.get(name, 0.0) for name in names], names


def parse_schedule(
    text: str | Mapping[str, Any], *, global_batch: int | None = None
) -> tuple[Phases, int, list[str] | None]:
    """A schedule's phases, total and source names (``None`` for bare weights) from its text or dict.

    **Text**: one phase a line (``;`` also separates), ``#`` starts a comment; ``START: BLEND``
    where ``START`` is a position or ``step N`` (``N x global_batch``) and ``BLEND`` Megatron's
    ``--data-path`` blend (``0.7 web 0.3 code``: the first phase names every source, later ones
    may leave one out: weight 0) or bare weights in source order; a last line ``END: end`` gives
    the total::

        0:          0.7 web 0.2 code 0.1 math
        step 9000:  0.4 web 0.3 code 0.3 math   # anneal
        step 10000: end

    **A dict** (or its JSON text): ``{"phases": [{"start": 0, "weights": [0.7, 0.3]}, {"step":
    9000, "weights": {"web": 0.4, "code": 0.6}}], "end": 1000000}`` (``"end": {"step": 10000}``
    in steps); weights a list in source order, a dict by name, or a blend string.

    Raises:
        MixtureError: (a ValueError) naming the line or phase and its fault.
    """
    if isinstance(text, str) and text.lstrip().startswith("{"):
        try:
            text = json.loads(text)
        except json.JSONDecodeError as e:
            msg = f"the schedule is not valid JSON: {e}"
            raise MixtureError(msg) from None
    if isinstance(text, Mapping):
        return _parse_dict(text, global_batch)
    if not isinstance(text, str):
        msg = f"a schedule is text or a dict, not {type(text).__name__}"
        raise MixtureError(msg)
    entries = [(f"line {n}", line.split("#")[0].strip()) for n, line in _lines(text)]
    return _assemble([(where, *_split_entry(body, where)) for where, body in entries if body], global_batch)


def _lines(text: str) -> list[tuple[int, str]]:
    return [(n, part) for n, line in enumerate(text.splitlines(), 1) for part in line.split(";")]


def _split_entry(body: str, where: str) -> tuple[str, str]:
    start, colon, blend = body.partition(":")
    if not colon:
        msg = f"{where}: {body!r} has no ':' (write 'START: weights', e.g. 'step 9000: 0.5 web 0.5 code')"
        raise MixtureError(msg)
    return start.strip(), blend.strip()


def _parse_dict(spec: Mapping[str, Any], global_batch: int | None) -> tuple[Phases, int, list[str] | None]:
    unknown = sorted(set(spec) - {"phases", "end"})
    if unknown or "phases" not in spec or "end" not in spec:
        msg = f"a schedule dict has 'phases' and 'end' only (got {sorted(spec)})"
        raise MixtureError(msg)
    phases = spec["phases"]
    if not isinstance(phases, list):
        msg = f"'phases' is {phases!r}: give a list of {{'start' or 'step', 'weights'}}"
        raise MixtureError(msg)
    entries = []
    for i, phase in enumerate([*phases, spec["end"]]):
        where = "'end'" if i == len(phases) else f"phase {i}"
        if isinstance(phase, int) and i == len(phases):
            phase = {"start": phase}
        if not isinstance(phase, Mapping) or len(set(phase) & {"start", "step"}) != 1:
            msg = f"{where} is {phase!r}: give one of 'start' (a position) or 'step'"
            raise MixtureError(msg)
        at = f"step {phase['step']}" if "step" in phase else str(phase["start"])
        weights = phase.get("weights", "end")
        if i < len(phases) and weights == "end":
            msg = f"{where} has no 'weights'"
            raise MixtureError(msg)
        if isinstance(weights, Mapping):
            weights = " ".join(f"{w} {name}" for name, w in weights.items())
        elif isinstance(weights, list):
            weights = " ".join(str(w) for w in weights)
        elif not isinstance(weights, str):
            msg = f"{where}'s weights are {weights!r}: a list, a dict by name or a blend string"
            raise MixtureError(msg)
        entries.append((where, at, weights))
    return _assemble(entries, global_batch)


def _assemble(
    entries: list[tuple[str, str, str]], global_batch: int | None
) -> tuple[Phases, int, list[str] | None]:
    if global_batch is not None:
        global_batch = _int_at_least(global_batch, 1, "global_batch")
    early = [where for where, _, blend in entries[:-1] if blend == "end"]
    if early:
        msg = f"{early[0]}: 'end' before the last line"
        raise MixtureError(msg)
    if len(entries) < 2 or entries[-1][2] != "end":
        msg = "a schedule lists its phases, then its end ('step 10000: end', or 'end' in a dict)"
        raise MixtureError(msg)
    phases: Phases = []
    names: list[str] | None = None
    for i, (where, at, blend) in enumerate(entries[:-1]):
        weights, named = _blend(blend, names, where)
        if i and names is None and named is not None:
            msg = f"{where} names its sources, but phase 0 gave bare weights: name them in phase 0 too"
            raise MixtureError(msg)
        names = named
        phases.append((_start(at, global_batch, where), weights))
    width = {len(w) for _, w in phases}
    if len(width) != 1:
        msg = f"the phases give {sorted(width)} weights: every phase gives one per source"
        raise MixtureError(msg)
    return phases, _start(entries[-1][1], global_batch, entries[-1][0]), names


class ScheduledMixtureDataset(MixtureDataset):
    """The concatenation of the sources, read through a schedule's global indices.

    What :class:`MixtureDataset` is for a mixture (index ``i`` is record ``i - offset_s`` of the
    source whose range holds it), for a :class:`MixtureSchedule`; :class:`~smstore.MixtureSampler`
    draws the schedule's order over it.

    Args:
        sources: Datasets with ``len`` and ``__getitem__``.
        schedule: A :class:`MixtureSchedule` over them, or its text or dict (:func:`parse_schedule`;
            named sources are taken in the first phase's order).
        global_batch: Positions a step, for a schedule written in steps.
    """

    def __init__(
        self,
        sources: Sequence[Any],
        schedule: MixtureSchedule | str | Mapping[str, Any],
        *,
        global_batch: int | None = None,
    ) -> None:
        self.sources = list(sources)
        if not isinstance(schedule, MixtureSchedule):
            phases, total, _ = parse_schedule(schedule, global_batch=global_batch)
            schedule = MixtureSchedule(self.sources, phases, total)
        elif schedule.lengths != [len(x) for x in self.sources]:
            msg = f"the schedule is over sources of {schedule.lengths} records, these have {[len(x) for x in self.sources]}"
            raise MixtureError(msg)
        self.schedule = schedule
        self.offsets = schedule.offsets

    def __repr__(self) -> str:
        return f"ScheduledMixtureDataset({self.schedule!r})"


def from_megatron_schedule(
    text: str | Mapping[str, Any],
    *,
    open_source: Callable[[str], Any] | None = None,
    global_batch: int | None = None,
) -> ScheduledMixtureDataset:
    """A :class:`ScheduledMixtureDataset` from a schedule whose phases are Megatron blends
    (:func:`parse_schedule`), each path of the first phase opened by ``open_source`` (default
    :class:`~smstore.SharedStoreDataset`).

    Raises:
        MixtureError: The schedule's fault, or phases that give bare weights instead of paths.
    """
    phases, total, names = parse_schedule(text, global_batch=global_batch)
    if names is None:
        msg = "a Megatron schedule names its paths ('0: 0.7 path_a 0.3 path_b'), not bare weights"
        raise MixtureError(msg)
    if open_source is None:
        from smstore.read.dataset import SharedStoreDataset

        open_source = SharedStoreDataset
    sources = [open_source(name) for name in names]
    return ScheduledMixtureDataset(sources, MixtureSchedule(sources, phases, total))
