"""mmengine: a BaseDataset whose data_list is one SharedList per node instead of a numpy copy per rank.

Example:
    >>> from mmdet.datasets import CocoDataset
    >>> from mmdet.registry import DATASETS
    >>> from smstore.integrations.mmengine import SharedDataListMixin
    >>> @DATASETS.register_module()
    ... class SharedCocoDataset(SharedDataListMixin, CocoDataset):
    ...     pass

and in the config: ``dataset=dict(type="SharedCocoDataset", ...)`` with
``custom_imports=dict(imports=["your_module"])``.
"""

from __future__ import annotations

import os
from typing import Any

from smstore.read.shared_list import SharedList
from smstore.read.sources import file_key

__all__ = ["SharedDataListMixin"]


class SharedDataListMixin:
    """Put before an mmengine ``BaseDataset`` subclass to share its annotations across local ranks.

    With ``serialize_data=True`` (mmengine's default) the loaded, filtered ``data_list`` goes into
    a :class:`smstore.SharedList` instead of mmengine's per-rank pickled numpy array: local rank 0
    serializes it once per node and every other rank and DataLoader worker attaches. With
    ``serialize_data=False`` the dataset behaves exactly as mmengine's own.

    Only local rank 0 runs mmengine's ``load_data_list``, ``filter_data`` and subsetting, in a
    short-lived child process (:meth:`smstore.SharedList.from_loader`): no rank that forks
    DataLoader workers ever holds the annotations as Python objects, and the other ranks load
    nothing. Attributes that loading sets on the dataset (mmdet's ``cat_ids``, ``cat2label``,
    ``cat_img_map``) are handed to every rank.

    ``get_data_info(i)`` returns the same dict as mmengine's serialized path (a fresh one per call,
    with ``sample_idx``). Set ``shared_list_name`` on the class to name the list explicitly (by
    default lists are matched across ranks by the order in which each rank creates them), and
    ``shared_list_key`` to name its contents yourself (default: :meth:`shared_key`).
    """

    shared_list_name: str | None = None
    shared_list_key: str | None = None

    # Provided by mmengine's BaseDataset, which this mixin is combined with.
    _fully_initialized: bool
    serialize_data: bool
    data_list: Any

    def full_init(self) -> None:
        """Load, filter and subset as mmengine does, then share the list instead of serializing it."""
        if self._fully_initialized:
            return
        share = self.serialize_data
        self.serialize_data = False  # mmengine's load/filter/subset steps, without its serializing
        if not share:
            super().full_init()  # type: ignore[misc]
            return
        before = {k: id(v) for k, v in vars(self).items()}

        def load() -> Any:  # in local rank 0's loading child only
            super(SharedDataListMixin, self).full_init()  # type: ignore[misc]
            return self.data_list

        def state() -> dict[str, Any]:  # what loading set on the dataset, for every rank
            skip = ("data_list", "_fully_initialized")
            return {k: v for k, v in vars(self).items() if k not in skip and before.get(k) != id(v)}

        lst = SharedList.from_loader(
            load, key=self.shared_list_key or self.shared_key(), state=state, name=self.shared_list_name
        )
        vars(self).update(lst.loader_state)
        self.data_list = lst
        self._fully_initialized = True

    def shared_key(self) -> str:
        """What names this dataset's contents across ranks (and for the daemon, across jobs).

        The class, the annotation file's identity, size and mtime (a changed file is a new key),
        and the arguments that select from it. Override it (or set ``shared_list_key``) if
        ``load_data_list`` reads other inputs.
        """
        ann = getattr(self, "ann_file", "")
        source = file_key(ann, "mmengine", None, "pickle") if ann and os.path.isfile(ann) else repr(ann)
        cls = type(self)
        parts = [f"mmengine:{cls.__module__}.{cls.__qualname__}", source]
        for attr in ("data_root", "data_prefix", "filter_cfg", "_indices", "test_mode"):
            parts.append(f"{attr}={getattr(self, attr, None)!r}")
        return ":".join(parts)

    def get_data_info(self, idx: int) -> dict[str, Any]:
        """Annotation ``idx`` as a fresh dict, as mmengine's ``BaseDataset.get_data_info``."""
        if not self._fully_initialized:
            self.full_init()
        if not isinstance(self.data_list, SharedList):
            info: dict[str, Any] = super().get_data_info(idx)  # type: ignore[misc]
            return info
        info = self.data_list[idx]  # already a fresh object: no deepcopy needed
        info["sample_idx"] = idx if idx >= 0 else len(self.data_list) + idx
        return info
