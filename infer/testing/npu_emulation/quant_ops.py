"""torch_npu's weight-only quantized matmul, emulated in torch on the CPU.

From torch_npu's documentation of ``npu_weight_quant_batchmatmul(x, weight,
antiquant_scale, antiquant_offset=None, quant_scale=None, quant_offset=None,
bias=None, antiquant_group_size=0, inner_precise=0)``: ``x`` [M, K] float16 or
bfloat16; ``weight`` [K, N] int8 (int4 rides in int32, not emulated here);
``antiquant_scale`` / ``antiquant_offset`` in x's dtype, shaped (1, N), (N,) or
(1,) per channel, or (ceil(K / group), N) per group, where the group size is a
multiple of 32 in [32, K - 1]; K and N lie in [1, 65535] and M >= 1 (no empty
tensors); the weight is dequantized as
``(weight + antiquant_offset) * antiquant_scale``. ``quant_scale`` /
``quant_offset`` quantize the output to int8 (not emulated: infer never asks
for it). ``bias`` is (N,) or (1, N), float16 for float16 x and float32 for bfloat16 x. The output has x's
dtype. Arithmetic here is float32, rounded once.
"""

from __future__ import annotations

import torch

from .checks import require

_HALF = (torch.float16, torch.bfloat16)
# The document's range for K and N (and for M when x is transposed).
MAX_KN = 65535


def _per_k(t: torch.Tensor, k: int, group: int) -> torch.Tensor:
    """A scale/offset table as one row per input feature: [K, N]."""
    t = t.float().reshape(-1, t.shape[-1]) if t.dim() == 2 else t.float().reshape(1, -1)
    return t.repeat_interleave(group, dim=0)[:k] if group else t.expand(k, -1)


def npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None,
                                 quant_offset=None, bias=None, antiquant_group_size=0, inner_precise=0):
    op = "npu_weight_quant_batchmatmul"
    require(x.dim() == 2 and x.dtype in _HALF, op, f"x must be a 2-D float16/bfloat16 tensor, got {x.dtype} {tuple(x.shape)}")
    require(weight.dim() == 2 and weight.dtype == torch.int8, op,
            f"weight must be [K, N] int8 (int32-packed int4 is not emulated), got {weight.dtype} {tuple(weight.shape)}")
    k, n = weight.shape
    require(x.shape[1] == k, op, f"x has K={x.shape[1]}, weight has K={k}")
    require(1 <= k <= MAX_KN and 1 <= n <= MAX_KN, op, f"K and N must lie in [1, {MAX_KN}], got K={k}, N={n}")
    require(x.shape[0] >= 1, op, "x has no rows (the op takes no empty tensors)")
    require(antiquant_scale.dtype == x.dtype, op, f"antiquant_scale must have x's dtype {x.dtype}, got {antiquant_scale.dtype}")
    g = int(antiquant_group_size)
    if g:
        require(g % 32 == 0 and 32 <= g <= k - 1, op, f"antiquant_group_size must be a multiple of 32 in [32, K-1], got {g}")
        require(tuple(antiquant_scale.shape) == (-(-k // g), n), op,
                f"per-group antiquant_scale must be ({-(-k // g)}, {n}), got {tuple(antiquant_scale.shape)}")
    else:
        require(tuple(antiquant_scale.shape) in ((1, n), (n,), (1,)), op,
                f"per-channel antiquant_scale must be (1, {n}), ({n},) or (1,), got {tuple(antiquant_scale.shape)}")
    if antiquant_offset is not None:
        require(antiquant_offset.dtype == antiquant_scale.dtype and antiquant_offset.shape == antiquant_scale.shape, op,
                "antiquant_offset must match antiquant_scale's dtype and shape")
    require(quant_scale is None and quant_offset is None, op, "output quantization (quant_scale) is not emulated")
    if bias is not None:
        want = torch.float32 if x.dtype == torch.bfloat16 else torch.float16
        require(bias.dtype == want and tuple(bias.shape) in ((n,), (1, n)), op,
                f"bias must be {want} (for {x.dtype} x) of shape ({n},) or (1, {n}), got {bias.dtype} {tuple(bias.shape)}")
    w = weight.float()
    if antiquant_offset is not None:
        w = w + _per_k(antiquant_offset, k, g)
    w = w * _per_k(antiquant_scale, k, g)
    y = x.float() @ w
    if bias is not None:
        y = y + bias.float().reshape(1, n)
    return y.to(x.dtype)
