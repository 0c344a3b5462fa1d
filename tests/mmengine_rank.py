"""One local rank for tests/test_mmengine.py: a real mmengine BaseDataset, shared vs mmengine's serialize_data; prints one JSON line."""

from __future__ import annotations

import json
import os
import pickle
import sys
from typing import Any

import torch.utils.data
from mmengine.dataset import BaseDataset
from smstore_testlib import annotation, identity_collate

from smstore.integrations.mmengine import SharedDataListMixin
from smstore.read.shared_list import SharedList

N = int(os.environ.get("MM_N", "400"))


class Annotations(BaseDataset):
    METAINFO = {"classes": ("cat", "dog", "bus")}

    def load_data_list(self) -> list[dict[str, Any]]:
        # As mmdet's CocoDataset sets cat_ids and cat_img_map: state that filter_data and users read.
        self.skip_digit = 3
        self.loaded_by = os.getpid()
        return [annotation(i) for i in range(N)]

    def filter_data(self) -> list[dict[str, Any]]:
        return [d for d in self.data_list if d["img_id"] % 10 != self.skip_digit]  # mmengine's own step


class SharedAnnotations(SharedDataListMixin, Annotations):
    pass


class Both(torch.utils.data.Dataset[Any]):
    """Reads item i from both datasets inside a worker and returns their pickles."""

    def __init__(self, shared: BaseDataset, ref: BaseDataset) -> None:
        self.shared, self.ref = shared, ref

    def __len__(self) -> int:
        return len(self.ref)

    def __getitem__(self, i: int) -> tuple[int, bytes, bytes, str]:
        a, b = self.shared.get_data_info(i), self.ref.get_data_info(i)
        role = getattr(self.shared.data_list, "role", "")
        return i, pickle.dumps(a, protocol=5), pickle.dumps(b, protocol=5), role


def main() -> None:
    method = sys.argv[1]
    shared = SharedAnnotations()
    ref = Annotations(serialize_data=True)
    assert isinstance(shared.data_list, SharedList)
    loader = torch.utils.data.DataLoader(
        Both(shared, ref),
        batch_size=8,
        num_workers=2,
        collate_fn=identity_collate,
        multiprocessing_context=method,
    )
    rows = [row for batch in loader for row in batch]
    mismatches = [i for i, a, b, _ in rows if a != b or pickle.loads(a) != pickle.loads(b)]
    in_rank = [i for i in range(-3, len(ref)) if shared.get_data_info(i) != ref.get_data_info(i)]
    print(
        json.dumps(
            {
                "role": shared.data_list.role,
                "worker_roles": sorted({r for *_, r in rows}),
                "indices": sorted(i for i, *_ in rows),
                "len": len(shared),
                "ref_len": len(ref),
                "mismatches": mismatches,
                "in_rank_mismatches": in_rank,
                "item": shared[5],
                "pid": os.getpid(),
                "loaded_by": shared.loaded_by,
                "ref_loaded_by": ref.loaded_by,
            },
            default=str,
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
