"""`linear` for int8 weights that quantize their input per token (``act_quant="int8_token"``, W8A8).

x's rows become int8 codes and a float32 scale each (`infer.primitives.act_quant`
is the definition); the product of the codes with the int8 weight is exact in
int32 (``torch._int_mm``; on devices or shapes it refuses, an int64 matmul), then
scaled by the row's and the weight's scales. Per-group or offset weights (not a
W8A8 layout, but a legal handle) multiply the fake-quantized x with the
dequantized weight instead.
"""

from __future__ import annotations

import torch

from ...primitives.types import Int8GroupWeight

INT8_MAX = 127


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([T, K] int8 codes, [T] float32 scales): s = max|x| / 127 (1 for an all-zero row),
    codes = round_half_even(x / s) clipped to +-127."""
    xf = x.float()
    amax = xf.abs().amax(dim=1) if xf.shape[1] else xf.new_zeros(xf.shape[0])
    s = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    return torch.round(xf / s[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), s


def _int_mm(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """[T, K] int8 @ [K, N] int8 -> int32, exact."""
    try:
        return torch._int_mm(a, b_t)
    except RuntimeError:  # CUDA's wants T > 16 and K, N multiples of 8
        return (a.long() @ b_t.long()).to(torch.int32)


def prepare_weight(w: Int8GroupWeight) -> Int8GroupWeight:
    """As is: the int8 codes are what the integer GEMM reads (a transposed view of them)."""
    return w


def linear(x: torch.Tensor, w: Int8GroupWeight) -> torch.Tensor:
    if w.act_quant != "int8_token":
        raise ValueError(f"torch: unknown activation quantization {w.act_quant!r}")
    q, s = quantize_per_token(x)
    k = w.in_features
    if w.group_size == k and w.offsets is None:
        acc = _int_mm(q, w.qweight.t())
        y = acc.float() * s[:, None] * w.scales.reshape(1, -1)
    else:
        from .quant_linear import dequantize

        y = (q.float() * s[:, None]) @ dequantize(w).t()
    if w.bias is not None:
        y = y + w.bias.float()
    return y.to(x.dtype)
