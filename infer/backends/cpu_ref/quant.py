"""Quantized weights in NumPy: dequantize plainly, then the dense math. The spec.

`linear` and `embedding` of `cpu_ref` accept every weight handle; a quantized
one means exactly the float32 matrix `dequantize` returns (the formulas are
on the handle classes in `infer.primitives.types`); a weight that quantizes
activations (``act_quant``) multiplies it with x as `act_quant.fake_quantize`
leaves it.
"""

from __future__ import annotations

import numpy as np

from ...primitives.act_quant import fake_quantize
from ...primitives.dequant import dequantize, pack_int4, unpack_int4
from ...primitives.types import DenseWeight, WeightHandle, round_to_dtype
from . import ops

__all__ = ["dequantize", "embedding", "linear", "pack_int4", "unpack_int4"]


def linear(x: np.ndarray, weight: WeightHandle) -> np.ndarray:
    if isinstance(weight, DenseWeight):
        return ops.linear(x, weight)
    act_quant = getattr(weight, "act_quant", None)
    if act_quant is not None:  # x as the weight's activation quantization leaves it (act_quant.py)
        x = fake_quantize(x, act_quant)
    y = ops.linear(x, DenseWeight(dequantize(weight), weight.bias))
    return round_to_dtype(y, weight.dtype)


def embedding(ids: np.ndarray, table) -> np.ndarray:
    """Row gather; a quantized table is dequantized row by row (only the rows asked for)."""
    if not isinstance(table, WeightHandle):
        return ops.embedding(ids, table)
    rows = dequantize(table, np.asarray(ids, dtype=np.int64))
    return round_to_dtype(rows.astype(np.float32), table.dtype)
