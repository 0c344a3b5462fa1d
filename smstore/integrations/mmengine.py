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

import gc
from typing import Any

from smstore.shared_list import SharedList

__all__ = ["SharedDataListMixin"]


class SharedDataListMixin:
    """Put before an mmengine ``BaseDataset`` subclass to share its annotations across local ranks.

    With ``serialize_data=True`` (mmengine's default) the loaded, filtered ``data_list`` goes into
    a :class:`smstore.SharedList` instead of mmengine's per-rank pickled numpy array: local rank 0
    serializes it once per node and every other rank and DataLoader worker attaches. With
    ``serialize_data=False`` the dataset behaves exactly as mmengine's own.

    ``get_data_info(i)`` returns the same dict as mmengine's serialized path (a fresh one per call,
    with ``sample_idx``). Set ``shared_list_name`` on the class to name the list explicitly (by
    default lists are matched across ranks by the order in which each rank creates them).
    """

    shared_list_name: str | None = None

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
        super().full_init()  # type: ignore[misc]
        if share:
            self.data_list = SharedList(self.data_list, name=self.shared_list_name)
            gc.collect()  # the per-rank dicts go now, as mmengine's _serialize_data frees them

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
