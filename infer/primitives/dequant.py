"""What a quantized weight handle stands for, in NumPy: its dequantized matrix.

The definition of every quantized format the contract knows (the formulas on
the handle classes in `types.py`), shared by the `cpu_ref` backend (whose
quantized `linear` is this, then a dense GEMM) and the loader (which
dequantizes when asked to load a quantized checkpoint as float).
"""

from __future__ import annotations

import numpy as np

from .fp8 import e4m3_decode
from .types import MXFP4_VALUES, DenseWeight, Fp8Weight, Int4GroupWeight, Int8GroupWeight, Mxfp4Weight, WeightHandle


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """[R, K/2] uint8 -> [R, K] q in 0..15 (low nibble first)."""
    packed = np.asarray(packed, dtype=np.uint8)
    return np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)


def pack_int4(q: np.ndarray) -> np.ndarray:
    """[R, K] values in 0..15 -> [R, K/2] uint8, the inverse of `unpack_int4`."""
    q = np.asarray(q, dtype=np.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)


def mxfp4_values(qweight: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float64 [..., N, K] of MXFP4 codes [..., N, K/2] and E8M0 exponents [..., N, K/32]."""
    packed = np.asarray(qweight, dtype=np.uint8)
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    e = np.asarray(scales, dtype=np.uint8)
    scale = np.where(e == 255, np.nan, np.ldexp(1.0, e.astype(np.int64) - 127))
    return np.asarray(MXFP4_VALUES, np.float64)[codes] * np.repeat(scale, 32, axis=-1)[..., : codes.shape[-1]]


def _groups(values: np.ndarray, per_group: np.ndarray, group_size: int) -> np.ndarray:
    """Each group's value broadcast over its `group_size` columns: [R, K/G] -> [R, K]."""
    return np.repeat(np.asarray(per_group, dtype=np.float64), group_size, axis=1)[:, : values.shape[1]]


def dequantize(w: WeightHandle, rows: np.ndarray | None = None) -> np.ndarray:
    """The float64 matrix a handle stands for (only `rows` of it when given; an MXFP4
    stack of experts [E, N, K] dequantizes whole, `rows` then picking experts)."""
    pick = (lambda a: a) if rows is None else (lambda a: np.asarray(a)[rows])
    if isinstance(w, DenseWeight):
        return pick(w.weight).astype(np.float64)
    if isinstance(w, Int4GroupWeight):
        q = unpack_int4(pick(w.qweight)).astype(np.float64)
        return q * _groups(q, pick(w.scales), w.group_size) + _groups(q, pick(w.offsets), w.group_size)
    if isinstance(w, Int8GroupWeight):
        q = pick(w.qweight).astype(np.float64)
        out = q * _groups(q, pick(w.scales), w.group_size)
        return out if w.offsets is None else out + _groups(q, pick(w.offsets), w.group_size)
    if isinstance(w, Fp8Weight):
        q = e4m3_decode(pick(w.qweight)).astype(np.float64)
        scales = np.asarray(w.scales, dtype=np.float64)
        return q * (scales[0] if scales.size == 1 else pick(scales)[:, None])
    if isinstance(w, Mxfp4Weight):
        return mxfp4_values(pick(w.qweight), pick(w.scales))
    raise TypeError(f"cpu_ref cannot dequantize a {type(w).__name__} (kind {w.kind!r})")
