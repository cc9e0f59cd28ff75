"""Quantized weights in NumPy: dequantize plainly, then the dense math. The spec.

`linear` and `embedding` of `cpu_ref` accept every weight handle; a quantized
one means exactly the float32 matrix `dequantize` returns (the formulas are
on the handle classes in `infer.primitives.types`).
"""

from __future__ import annotations

import numpy as np

from ...primitives.dequant import dequantize, pack_int4, unpack_int4
from ...primitives.types import DenseWeight, WeightHandle, round_to_dtype
from . import ops

__all__ = ["dequantize", "embedding", "linear", "pack_int4", "unpack_int4"]


def linear(x: np.ndarray, weight: WeightHandle) -> np.ndarray:
    if isinstance(weight, DenseWeight):
        return ops.linear(x, weight)
    y = ops.linear(x, DenseWeight(dequantize(weight), weight.bias))
    return round_to_dtype(y, weight.dtype)


def embedding(ids: np.ndarray, table) -> np.ndarray:
    """Row gather; a quantized table is dequantized row by row (only the rows asked for)."""
    if not isinstance(table, WeightHandle):
        return ops.embedding(ids, table)
    rows = dequantize(table, np.asarray(ids, dtype=np.int64))
    return round_to_dtype(rows.astype(np.float32), table.dtype)
