"""Sampling: orders as data (:mod:`.orders`, :mod:`.mixture`, :mod:`.schedule`), the one sampler that splits, resumes and
holds them (:mod:`.sampler`, its constructors in :mod:`.samplers`), the one budget planner
(:mod:`.plan`) and :class:`ResumableLoader` (:mod:`.resume`)."""

from smstore.sampling.mixture import (
    Mixture,
    MixtureDataset,
    MixtureOrder,
    WindowedMixtureOrder,
    from_megatron_blend,
    parse_megatron_blend,
)
from smstore.sampling.orders import (
    BlockWindowOrder,
    FeistelPermutation,
    WindowedOrder,
    block_bounds,
    round_keys,
)
from smstore.sampling.resume import ResumableLoader
from smstore.sampling.sampler import GlobalShuffleSampler
from smstore.sampling.samplers import (
    BlockWindowSampler,
    MixtureSampler,
    WindowedMixtureSampler,
    WindowedShuffleSampler,
)
from smstore.sampling.schedule import (
    MixtureSchedule,
    ScheduledMixtureDataset,
    from_megatron_schedule,
    parse_schedule,
)

__all__ = [
    "BlockWindowOrder",
    "BlockWindowSampler",
    "FeistelPermutation",
    "GlobalShuffleSampler",
    "Mixture",
    "MixtureDataset",
    "MixtureOrder",
    "MixtureSampler",
    "MixtureSchedule",
    "ResumableLoader",
    "ScheduledMixtureDataset",
    "WindowedMixtureOrder",
    "WindowedMixtureSampler",
    "WindowedOrder",
    "WindowedShuffleSampler",
    "block_bounds",
    "from_megatron_blend",
    "from_megatron_schedule",
    "parse_megatron_blend",
    "parse_schedule",
    "round_keys",
]
