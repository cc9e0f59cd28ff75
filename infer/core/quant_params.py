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
import logging
from typing import Any, Sequence

import numpy as np

from ..primitives.dequant import dequantize, unpack_int4
from ..primitives.fp8 import quantize_per_channel
from ..primitives.types import MXFP4_VALUES, Fp8Weight, Int4GroupWeight, Int8GroupWeight, Mxfp4Weight, WeightHandle

# Per-row fields of the quantized handles (everything else is per tensor).
_ROW_FIELDS = ("qweight", "scales", "offsets", "bias")
QUANTIZATIONS = ("auto", "none", "fp8")


def concat_rows(parts: Sequence[Any], what: str = "a fused weight") -> WeightHandle | np.ndarray:
    """One matrix whose rows are the parts' rows in order (q/k/v into qkv, gate/up into gate_up).

    Parts of one format concatenate field by field. K-quant mixes store the parts of one
    fused weight in different types (a Q4_K q beside a Q6_K v); they are brought to one
    handle exactly (`_common_form`): int4 and int8 parts to int8, groups to the smallest
    group. A float part beside quantized ones, fp8 beside integer formats, or groups that
    do not divide one another: every part is dequantized to one float32 matrix (logged)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    handles = [p for p in parts if isinstance(p, WeightHandle)]
    same = len(handles) == len(parts) and all(
        type(p) is type(first) and getattr(p, "group_size", None) == getattr(first, "group_size", None)
        and (getattr(p, "offsets", None) is None) == (getattr(first, "offsets", None) is None)
        and getattr(p, "act_quant", None) == getattr(first, "act_quant", None) for p in parts)
    if not same:
        common = _common_form(parts) if len(handles) == len(parts) else None
        if common is None:
            kinds = ", ".join(p.kind if isinstance(p, WeightHandle) else f"float {np.asarray(p).dtype}" for p in parts)
            logging.getLogger("infer").warning("%s: its parts are stored as %s, which share no quantized form; "
                                               "it is dequantized to float32", what, kinds)
            return np.concatenate([np.asarray(dequantize(p), np.float32) if isinstance(p, WeightHandle)
                                   else np.asarray(p, np.float32) for p in parts])
        parts = common
        first = parts[0]
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
        arrays = [np.asarray(v) for v in values]  # rows are the next-to-last axis (a stack of experts leads)
        changes[f] = np.concatenate(arrays, axis=0 if arrays[0].ndim == 1 else -2)
    return dataclasses.replace(first, **changes)


def shape_of(handle: WeightHandle) -> tuple[int, ...]:
    """The matrix shape a handle stands for: [N, K], or [E, N, K] for a stack of experts."""
    return (*handle.qweight.shape[:-2], handle.out_features, handle.in_features)


def mxfp4_as_int8(w: Mxfp4Weight) -> Int8GroupWeight:
    """The same matrix in int8 groups of 32 (exact): q = 2 * e2m1 in -12..12, scale = 2^(e - 128)."""
    packed = np.asarray(w.qweight, np.uint8)
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    q = (np.asarray(MXFP4_VALUES) * 2).astype(np.int8)[codes]
    e = np.asarray(w.scales, np.int64)
    scales = np.where(e == 255, np.nan, np.ldexp(1.0, e - 128)).astype(np.float32)
    return Int8GroupWeight(q, scales, 32, w.bias, w.dtype)


def _common_form(parts: Sequence[WeightHandle]) -> list[WeightHandle] | None:
    """The parts as handles of one kind and group standing for the same matrices, or None.

    Integer group formats (and MXFP4, as the int8 groups it equals): int4 q (0..15) is an int8 q
    with the same scales and offsets;
    a group of G is G / g groups of the smallest g with its scale (and offset) repeated; a
    part without offsets gets zero ones where another part has them. Costs bytes (an int4
    part in int8 doubles its codes), never exactness."""
    parts = [mxfp4_as_int8(p) if isinstance(p, Mxfp4Weight) and np.ndim(p.qweight) == 2 else p for p in parts]
    if not all(isinstance(p, (Int4GroupWeight, Int8GroupWeight)) for p in parts):
        return None
    if any(getattr(p, "act_quant", None) is not None for p in parts):
        return None  # parts quantizing activations differently share no handle
    group = min(p.group_size for p in parts)
    if any(p.group_size % group for p in parts):
        return None
    to_int8 = any(isinstance(p, Int8GroupWeight) for p in parts)
    with_offsets = to_int8 and any(getattr(p, "offsets", None) is not None for p in parts)
    out = []
    for p in parts:
        r = p.group_size // group
        scales = np.repeat(np.asarray(p.scales, np.float32), r, axis=1)
        offsets = None if p.offsets is None else np.repeat(np.asarray(p.offsets, np.float32), r, axis=1)
        if not to_int8:
            out.append(dataclasses.replace(p, scales=scales, offsets=offsets, group_size=group))
            continue
        q = unpack_int4(p.qweight).astype(np.int8) if isinstance(p, Int4GroupWeight) else np.asarray(p.qweight)
        if with_offsets and offsets is None:
            offsets = np.zeros_like(scales)
        out.append(Int8GroupWeight(q, scales, group, p.bias, p.dtype, offsets=offsets))
    return out


def slice_handle(handle: WeightHandle, axis: int, start: int, stop: int) -> WeightHandle:
    """Rows (axis 0) or input columns (axis 1) [start, stop) of a quantized weight: a
    tensor-parallel shard. Columns must fall on the format's group boundaries. An MXFP4
    stack of experts [E, N, K] slices any of its axes (the last one by blocks of 32)."""
    if isinstance(handle, Mxfp4Weight):
        last = np.ndim(handle.qweight) - 1
        if axis == last and (start % 32 or stop % 32):
            raise ValueError(f"a tensor-parallel shard of input columns [{start}, {stop}) splits the 32-wide "
                             "blocks of an mxfp4 weight; choose a tensor_parallel_size that divides the blocks")
        cut = lambda a, per: np.asarray(a)[(slice(None),) * axis + (slice(start // per, stop // per),)]  # noqa: E731
        changes = {"qweight": cut(handle.qweight, 2 if axis == last else 1),
                   "scales": cut(handle.scales, 32 if axis == last else 1)}
        if handle.bias is not None and axis == 0 and last == 1:
            changes["bias"] = np.asarray(handle.bias)[start:stop]
        return dataclasses.replace(handle, **changes)
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
    if shape_of(handle) != tuple(shape):
        raise ValueError(f"checkpoint tensor for {what} is a {list(shape_of(handle))} "
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
