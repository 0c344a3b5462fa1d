"""The layout of a batch of fixed-shape samples in one shared buffer: its fields, their offsets and views.

A sample is an array, or a dict or tuple of them, of one shape per field; a batch of them is a
slot of ``batch_size`` rows per field, each field starting on a cache line. Worker processes write
rows into the slot through numpy views, the training process reads the batch through torch views
of the same bytes (:class:`smstore.TransformLoader`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from smstore.errors import CollateError

__all__ = ["ALIGN", "Field", "FieldSpec", "Layout", "Spec"]

ALIGN = 64  # every field of a slot starts on a cache line (and on its dtype's alignment)

# What a field spec may be: (shape, dtype), the dtype anything numpy.dtype() takes, or a torch dtype.
FieldSpec = tuple[Sequence[int], Any]
Spec = FieldSpec | Mapping[str, FieldSpec] | Sequence[FieldSpec]

_ADVICE_SHAPE = (
    "every record's output must have the same shape, since the loader writes it into a fixed slot: "
    "pad or crop in the transform to one shape (and return the true length as another field, "
    "e.g. {'x': padded, 'length': n}), or declare spec= with that shape"
)


# -- the layout of a batch slot --------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    key: str | int | None  # the dict key, the position in a tuple, or None for a single output
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    offset: int  # bytes from the start of the slot
    row_bytes: int


def _np_dtype(dtype: Any) -> np.dtype[Any]:
    if isinstance(dtype, torch.dtype):
        try:
            found: np.dtype[Any] = torch.empty(0, dtype=dtype).numpy().dtype
        except TypeError:
            msg = f"{dtype} has no numpy equivalent: declare a dtype numpy knows (and convert after loading)"
            raise TypeError(msg) from None
        return found
    named: np.dtype[Any] = np.dtype(dtype)
    return named


def _as_array(value: Any) -> np.ndarray[Any, Any]:
    """One output value as a numpy array (what default_collate would turn into a tensor)."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bfloat16:
            msg = "a bfloat16 tensor (numpy has no bfloat16): return float32 and convert after loading"
            raise CollateError(msg)
        return value.detach().cpu().numpy()
    if isinstance(value, (bool, int, float, np.generic)):
        return np.asarray(value)
    msg = (
        f"an output of type {type(value).__name__}, which is not an array: return numpy arrays, CPU "
        "tensors or numbers (np.asarray(image) for a PIL image)"
    )
    raise CollateError(msg)


class Layout:
    """Where each output field of a batch lives in a slot, and how a record's outputs are written there.

    A slot is ``[indices: int64 x batch_size][field 0: batch_size rows][field 1]...``, each part
    aligned to 64 bytes. ``kind`` is the structure of one output: ``"single"`` (one array),
    ``"dict"`` or ``"seq"`` (a tuple or list; ``seq_type`` a namedtuple class or None).
    """

    def __init__(
        self,
        kind: str,
        fields: Sequence[tuple[str | int | None, tuple[int, ...], np.dtype[Any]]],
        batch_size: int,
        seq_type: type | None = None,
    ) -> None:
        self.kind = kind
        self.seq_type = seq_type
        self.batch_size = batch_size
        offset = _round_up(8 * batch_size)
        placed = []
        for key, shape, dtype in fields:
            if dtype.hasobject or dtype.itemsize == 0:
                msg = f"field {key!r}: dtype {dtype} cannot live in shared memory: use a numeric dtype"
                raise CollateError(msg)
            row = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            placed.append(Field(key, shape, dtype, offset, row))
            offset = _round_up(offset + row * batch_size)
        self.fields = placed
        self.slot_bytes = offset

    @classmethod
    def from_spec(cls, spec: Spec, batch_size: int) -> Layout:
        def one(key: str | int | None, item: Any) -> tuple[str | int | None, tuple[int, ...], np.dtype[Any]]:
            try:
                shape, dtype = item
                dims = tuple(int(d) for d in shape)
            except (TypeError, ValueError):
                msg = (
                    f"spec field {key!r} must be (shape, dtype), e.g. ((3, 224, 224), 'uint8'), not {item!r}"
                )
                raise TypeError(msg) from None
            if any(d < 0 for d in dims):
                msg = f"spec field {key!r}: negative dimension in {dims}"
                raise ValueError(msg)
            return key, dims, _np_dtype(dtype)

        if isinstance(spec, Mapping):
            return cls("dict", [one(str(k), v) for k, v in spec.items()], batch_size)
        if _is_field_spec(spec):
            return cls("single", [one(None, spec)], batch_size)
        return cls("seq", [one(i, v) for i, v in enumerate(spec)], batch_size)

    @classmethod
    def from_sample(cls, sample: Any, batch_size: int) -> Layout:
        def one(key: str | int | None, value: Any) -> tuple[str | int | None, tuple[int, ...], np.dtype[Any]]:
            try:
                arr = _as_array(value)
            except CollateError as e:
                msg = f"output field {key!r}: {e}" if key is not None else str(e)
                raise CollateError(msg) from None
            return key, tuple(arr.shape), arr.dtype

        if isinstance(sample, Mapping):
            return cls("dict", [one(str(k), v) for k, v in sample.items()], batch_size)
        if isinstance(sample, (tuple, list)):
            seq_type = type(sample) if hasattr(sample, "_fields") else None
            return cls("seq", [one(i, v) for i, v in enumerate(sample)], batch_size, seq_type)
        return cls("single", [one(None, sample)], batch_size)

    def describe(self) -> str:
        parts = [f"{'' if f.key is None else f'{f.key!r}: '}{f.shape} {f.dtype}" for f in self.fields]
        return ", ".join(parts)

    def values(self, out: Any) -> list[Any]:
        """The output's values in field order, checked against the structure."""
        if self.kind == "single":
            return [out]
        if self.kind == "dict":
            if not isinstance(out, Mapping) or len(out) != len(self.fields):
                keys = [f.key for f in self.fields]
                got = list(out) if isinstance(out, Mapping) else type(out).__name__
                msg = f"an output {got!r} where the layout has the fields {keys}"
                raise CollateError(msg)
            try:
                return [out[f.key] for f in self.fields]
            except KeyError as e:
                msg = f"an output without the field {e.args[0]!r} (it has {list(out)})"
                raise CollateError(msg) from None
        if not isinstance(out, (tuple, list)) or len(out) != len(self.fields):
            msg = f"an output of type {type(out).__name__} where the layout is a tuple of {len(self.fields)}"
            raise CollateError(msg)
        return list(out)

    def write(self, rows: Sequence[np.ndarray[Any, Any]], row: int, out: Any) -> None:
        """Write one record's outputs into row ``row`` of a slot's field arrays."""
        for f, dest, value in zip(self.fields, rows, self.values(out), strict=True):
            arr = _as_array(value)
            name = "the output" if f.key is None else f"output field {f.key!r}"
            if arr.shape != f.shape:
                msg = f"{name} has shape {arr.shape}, not the layout's {f.shape}: {_ADVICE_SHAPE}"
                raise CollateError(msg)
            if not np.can_cast(arr.dtype, f.dtype, casting="same_kind"):
                msg = f"{name} has dtype {arr.dtype}, which does not cast safely to the layout's {f.dtype}"
                raise CollateError(msg)
            np.copyto(dest[row, ...], arr, casting="same_kind")  # [row, ...]: a view even for a scalar

    def numpy_views(
        self, buffer: np.ndarray[Any, Any], slot: int
    ) -> tuple[np.ndarray[Any, Any], list[np.ndarray[Any, Any]]]:
        """A slot's index array and field arrays (numpy views of the shared buffer)."""
        base = slot * self.slot_bytes
        index = buffer[base : base + 8 * self.batch_size].view(np.int64)
        fields = [
            buffer[base + f.offset : base + f.offset + f.row_bytes * self.batch_size]
            .view(f.dtype)
            .reshape(self.batch_size, *f.shape)
            for f in self.fields
        ]
        return index, fields

    def control_view(self, buffer: np.ndarray[Any, Any], depth: int) -> np.ndarray[Any, Any]:
        """The int64 control word after the slots (see _worker_main)."""
        end = depth * self.slot_bytes
        return buffer[end : end + 8].view(np.int64)

    def tensor_views(self, buffer: torch.Tensor, slot: int) -> list[torch.Tensor]:
        """A slot's field arrays as tensors over the shared buffer (they keep its storage alive)."""
        base = slot * self.slot_bytes
        return [_typed_view(buffer, base + f.offset, f, self.batch_size) for f in self.fields]

    def sample(self, values: list[Any]) -> Any:
        """One record's output from its field values, in the structure it came in: an array, a dict,
        a tuple (or namedtuple)."""
        if self.kind == "single":
            return values[0]
        if self.kind == "dict":
            return {f.key: v for f, v in zip(self.fields, values, strict=True)}
        return self.seq_type(*values) if self.seq_type is not None else tuple(values)

    def assemble(self, tensors: list[torch.Tensor]) -> Any:
        """The batch as default_collate builds it: a tensor, a dict of them, or a list (or namedtuple)."""
        if self.kind == "single":
            return tensors[0]
        if self.kind == "dict":
            return {f.key: t for f, t in zip(self.fields, tensors, strict=True)}
        if self.seq_type is not None:
            return self.seq_type(*tensors)
        return list(tensors)


def _typed_view(buffer: torch.Tensor, offset: int, f: Field, batch_size: int) -> torch.Tensor:
    flat = buffer[offset : offset + f.row_bytes * batch_size]
    dtype = torch.from_numpy(np.empty(0, f.dtype)).dtype
    return flat.view(dtype).view(batch_size, *f.shape)


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _is_field_spec(spec: Any) -> bool:
    """``(shape, dtype)`` rather than a sequence of them."""
    if not isinstance(spec, (tuple, list)) or len(spec) != 2:
        return False
    shape, dtype = spec
    return (
        isinstance(shape, (tuple, list))
        and all(isinstance(d, (int, np.integer)) for d in shape)
        and not (isinstance(dtype, (tuple, list)))
    )
