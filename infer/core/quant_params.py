"""Quantized parameters on their way from a checkpoint to a backend.

The loader hands the model runner quantized weights as `WeightHandle`s of
NumPy arrays; here they are fused (q/k/v into qkv, gate/up into gate_up: the
rows of a quantized matrix are independent, so fusing is a row concatenation
of every per-row field), checked against the shape the graph expects and
moved to the backend. Online fp8 (``quantization="fp8"``) quantizes dense
float weights here as well.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from ..primitives.fp8 import quantize_per_channel
from ..primitives.types import Fp8Weight, WeightHandle

# Per-row fields of the quantized handles (everything else is per tensor).
_ROW_FIELDS = ("qweight", "scales", "offsets", "bias")
QUANTIZATIONS = ("auto", "none", "fp8")


def concat_rows(parts: Sequence[WeightHandle]) -> WeightHandle:
    """One handle whose rows are the parts' rows in order (they must share a format)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    for p in parts[1:]:
        same = type(p) is type(first) and getattr(p, "group_size", None) == getattr(first, "group_size", None)
        if not same:
            raise ValueError(f"cannot fuse a {p.kind} weight with a {first.kind} one (group sizes "
                             f"{getattr(p, 'group_size', None)} vs {getattr(first, 'group_size', None)}); "
                             "load this checkpoint with quantization='none'")
    if isinstance(first, Fp8Weight) and any(np.asarray(p.scales).size == 1 for p in parts):
        # Per-tensor scales differ between q, k and v: give every row its tensor's scale.
        parts = [dataclasses.replace(p, scales=np.broadcast_to(np.asarray(p.scales, np.float32), (p.out_features,)))
                 for p in parts]
    changes = {}
    for f in _ROW_FIELDS:
        values = [getattr(p, f, None) for p in parts]
        if all(v is None for v in values):
            continue
        if any(v is None for v in values):
            raise ValueError(f"cannot fuse weights where only some have {f}")
        changes[f] = np.concatenate([np.asarray(v) for v in values])
    return dataclasses.replace(first, **changes)


def slice_handle(handle: WeightHandle, axis: int, start: int, stop: int) -> WeightHandle:
    """Rows (axis 0) or input columns (axis 1) [start, stop) of a quantized weight: a
    tensor-parallel shard. Columns must fall on the format's group boundaries."""
    if axis == 0:
        changes = {f: np.asarray(getattr(handle, f))[start:stop] for f in ("qweight", "offsets", "bias")
                   if getattr(handle, f, None) is not None}
        scales = np.asarray(handle.scales)
        changes["scales"] = scales if scales.size == 1 and isinstance(handle, Fp8Weight) else scales[start:stop]
        return dataclasses.replace(handle, **changes)
    if axis != 1:
        raise ValueError(f"a {handle.kind} weight is 2-D; cannot slice axis {axis}")
    group = getattr(handle, "group_size", 1)
    if start % group or stop % group:
        raise ValueError(f"a tensor-parallel shard of input columns [{start}, {stop}) splits the {group}-wide "
                         f"groups of a {handle.kind} weight; choose a tensor_parallel_size that divides the groups, "
                         "or load the model with quantization='none'")
    per_byte = 2 if handle.kind == "int4_group" else 1
    changes = {"qweight": np.asarray(handle.qweight)[:, start // per_byte:stop // per_byte]}
    if not isinstance(handle, Fp8Weight):  # fp8 scales are per output channel: unchanged
        changes["scales"] = np.asarray(handle.scales)[:, start // group:stop // group]
        if getattr(handle, "offsets", None) is not None:
            changes["offsets"] = np.asarray(handle.offsets)[:, start // group:stop // group]
    return dataclasses.replace(handle, **changes)


def pad_rows(handle: WeightHandle, rows: int) -> WeightHandle:
    """`handle` with `rows` all-zero rows appended (zero scales and offsets: the rows dequantize to 0)."""
    changes = {}
    for f in _ROW_FIELDS:
        value = getattr(handle, f, None)
        if value is not None:
            value = np.asarray(value)
            if f == "scales" and value.size == 1 and isinstance(handle, Fp8Weight):
                value = np.broadcast_to(value.astype(np.float32), (handle.out_features,))
            changes[f] = np.concatenate([value, np.zeros((rows,) + value.shape[1:], value.dtype)])
    return dataclasses.replace(handle, **changes)


def to_backend(handle: WeightHandle, backend: Any, dtype: str, shape: tuple[int, ...], what: str) -> WeightHandle:
    """`handle` with its arrays on `backend` (scales in float32) and compute dtype `dtype`."""
    if (handle.out_features, handle.in_features) != tuple(shape):
        raise ValueError(f"checkpoint tensor for {what} is a [{handle.out_features}, {handle.in_features}] "
                         f"{handle.kind} weight, the config implies {list(shape)}")
    changes: dict[str, Any] = {"dtype": dtype}
    for f in _ROW_FIELDS:
        value = getattr(handle, f, None)
        if value is None:
            continue
        value = np.asarray(value)
        if f == "bias":
            changes[f] = backend.asarray(value.astype(np.float32), dtype)
        elif np.issubdtype(value.dtype, np.floating):
            changes[f] = backend.asarray(value.astype(np.float32))
        else:
            changes[f] = backend.asarray(value)
    return dataclasses.replace(handle, **changes)


def online_fp8(weight: np.ndarray) -> Fp8Weight:
    """A dense [N, K] float weight as fp8 e4m3 with one scale per output channel."""
    codes, scales = quantize_per_channel(weight)
    return Fp8Weight(codes, scales)
