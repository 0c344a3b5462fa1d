"""Converters: data as people hold it, packed into smstore blobs (or sharded datasets).

Each format lives in its own module and imports its library there only, so ``import
smstore.convert`` stays light:

- :func:`convert_arrow` (``smstore.convert.arrow``): Parquet files, Arrow IPC files and streams,
  and Hugging Face ``save_to_disk`` folders, batch by batch (pyarrow).
- :func:`convert_webdataset` (``smstore.convert.webdataset``): WebDataset tar shards, one record
  per sample (``wds`` encoding: decoding gives ``{extension: bytes}``).
- :func:`convert_megatron` (``smstore.convert.megatron``): Megatron ``.bin``/``.idx`` token files,
  one ``npy:<dtype>`` record per document.
- :func:`convert_json_list` (``smstore.convert.json_list``): a JSON list of objects (COCO-style
  annotation lists), one object record each, streamed element by element.

Every converter streams with bounded memory, writes atomically, and with ``shard_size`` writes a
sharded dataset (docs/packing.md). The command line is ``smstore pack --format FORMAT``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from smstore.convert.arrow import convert_arrow
    from smstore.convert.json_list import convert_json_list
    from smstore.convert.megatron import convert_megatron
    from smstore.convert.webdataset import convert_webdataset

__all__ = ["convert_arrow", "convert_json_list", "convert_megatron", "convert_webdataset"]

_LAZY = {
    "convert_arrow": "smstore.convert.arrow",
    "convert_json_list": "smstore.convert.json_list",
    "convert_megatron": "smstore.convert.megatron",
    "convert_webdataset": "smstore.convert.webdataset",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    msg = f"module 'smstore.convert' has no attribute {name!r}"
    raise AttributeError(msg)
