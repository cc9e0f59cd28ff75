"""Activation quantization a weight asks of `linear`, in NumPy: the spec.

``int8_token`` (`Int8GroupWeight.act_quant`, compressed-tensors' W8A8 with
``input_activations: {type: int, num_bits: 8, strategy: token, dynamic: true,
symmetric: true}``): each row of x gets its own scale ``s = max|x| / 127``
(1 for an all-zero row, whose codes are then all 0), and its codes are
``clip(round_half_even(x / s), -127, 127)``. `linear` multiplies the codes
with the weight's matrix and scales each output row by its ``s``, which is
the product of ``codes * s`` (the fake-quantized x) with the weight: for a
per-channel int8 weight, exactly ``(xq @ q.T) * s[:, None] * scales.T``.
Computed in float64 here, so the codes are those of the exact quotient.
"""

from __future__ import annotations

import numpy as np

INT8_MAX = 127


def quantize_per_token(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([T, K] int8 codes, [T] float64 scales) of the rows of `x`."""
    x = np.asarray(x, dtype=np.float64)
    amax = np.abs(x).max(axis=1) if x.shape[1] else np.zeros(x.shape[0])
    s = np.where(amax > 0, amax / INT8_MAX, 1.0)
    q = np.clip(np.rint(x / s[:, None]), -INT8_MAX, INT8_MAX).astype(np.int8)  # rint: half to even
    return q, s


def fake_quantize(x: np.ndarray, act_quant: str) -> np.ndarray:
    """The float64 activations `linear` multiplies with the weight under `act_quant`."""
    if act_quant != "int8_token":
        raise ValueError(f"unknown activation quantization {act_quant!r}; expected 'int8_token'")
    q, s = quantize_per_token(x)
    return q.astype(np.float64) * s[:, None]
