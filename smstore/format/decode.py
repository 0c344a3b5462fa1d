"""Record decoders of SharedStoreDataset (decode=) and the dtype rules TokenCollator shares; torch loads only in the torch decoder."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from smstore.errors import StoreFormatError
from smstore.format.objects import object_decoder
from smstore.write.pack import numpy_dtype

__all__ = ["Decoder", "make_decoder", "partial_items_error", "torch_dtype"]

Decoder = Callable[[memoryview], Any]


def partial_items_error(
    path: str, dtype: np.dtype[Any], nbytes: int, record: int | None = None
) -> StoreFormatError:
    """The error for an array record that is not a whole number of ``dtype`` items."""
    which = "a record" if record is None else f"record {record}"
    msg = (
        f"{path}: {which} of {nbytes} bytes is not a whole number of {dtype.str} items "
        f"({dtype.itemsize} bytes each); the blob was written wrongly, re-pack it"
    )
    return StoreFormatError(msg)


def _utf8(view: memoryview) -> str:
    return str(view, "utf-8")


def _bytes(view: memoryview) -> bytes:
    return view.tobytes()


def _json(view: memoryview) -> Any:
    return json.loads(view.tobytes())


def torch_dtype(dtype: np.dtype[Any], path: str) -> Any:
    """The torch dtype of records of numpy ``dtype`` (torch imported here only)."""
    import torch

    try:
        return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    except (TypeError, RuntimeError) as e:
        msg = f"{path}: records of dtype {dtype} have no torch equivalent ({e})"
        raise StoreFormatError(msg) from None


def _torch_decoder(dtype: np.dtype[Any], path: str) -> Decoder:
    """Records as zero-copy, read-only 1-D tensors over the mapping (torch imported here only)."""
    import torch

    tdtype = torch_dtype(dtype, path)
    frombuffer = torch.frombuffer
    silenced = False

    def _torch(view: memoryview) -> Any:
        nonlocal silenced
        if not view.nbytes:
            return torch.empty(0, dtype=tdtype)  # frombuffer refuses empty buffers
        if view.nbytes % dtype.itemsize:
            raise partial_items_error(path, dtype, view.nbytes)
        if silenced:
            return frombuffer(view, dtype=tdtype)
        # torch warns (once per process) that the buffer is not writable. It is read-only by
        # design: the mapping is PROT_READ, so writing through the tensor kills the process with
        # SIGSEGV. Silence that one warning, once, instead of paying catch_warnings per record.
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message="The given buffer is not writable", category=UserWarning
            )
            tensor = frombuffer(view, dtype=tdtype)
        silenced = True
        return tensor

    return _torch


def make_decoder(decode: str | Decoder | None, encoding: str, path: str) -> Decoder | None:
    """Turn a ``decode=`` argument into a function of one memoryview (None: no decoding).

    ``"auto"`` decodes object records (encodings ``pickle`` and ``json``, see pack_objects) to
    objects and leaves every other record a memoryview.
    """
    if decode is None or callable(decode):
        return decode
    if decode == "auto":
        return object_decoder(encoding)
    if decode == "bytes":
        return _bytes
    if decode == "utf8":
        return _utf8
    if decode == "json":
        return _json
    if decode == "numpy":
        dtype = numpy_dtype(encoding, path)

        def _numpy(view: memoryview) -> np.ndarray[Any, Any]:
            if view.nbytes % dtype.itemsize:
                raise partial_items_error(path, dtype, view.nbytes)
            return np.frombuffer(view, dtype=dtype)

        return _numpy
    if decode == "torch":
        return _torch_decoder(numpy_dtype(encoding, path), path)
    msg = (
        "decode must be 'auto', None, 'bytes', 'utf8', 'json', 'numpy', 'torch' or a callable, "
        f"not {decode!r}"
    )
    raise ValueError(msg)
