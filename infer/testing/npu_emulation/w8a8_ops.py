"""torch_npu's W8A8 pair, emulated in torch on the CPU: per-token int8 quantization and the int8 GEMM.

From torch_npu's documentation:

* ``npu_dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=None) -> (y, scale)``:
  per-token symmetric dynamic quantization, ``scale = row_max(|x|) / 127`` (float32, x's shape
  without its last dim), ``y = round(x / scale)`` (int8, x's shape). x float16/bfloat16 with at
  least 2 dims, its last dim at most 11264 on Atlas A2. smooth_scales, group_index (MoE) and int4
  output (dst_type quint4x2) are not emulated. The document says nothing of an all-zero row
  (scale 0): here its codes are 0; the backend multiplies them by that 0 scale, so its result
  does not depend on them.
* ``npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None,
  output_dtype=None)``: x1 [M, K] int8, x2 [K, N] int8 (ND), neither empty; ``scale`` 1-D (1 or N)
  float32; ``pertoken_scale`` float32 [M] (Atlas A2/A3); the combinations of the document's
  table that take pertoken_scale: output bfloat16 with bias int32/bfloat16/float32, output
  float16 with bias int32/float16/float32 (bias [N]). ``y = (x1 @ x2) * scale * pertoken_scale
  (+ bias)``: the integer product exact, the scaling and a float bias in float32, rounded once
  to output_dtype. int32 bias, ``offset``, int4 (int32-packed) inputs and int8 output are not
  emulated: the backend passes none of them.
"""

from __future__ import annotations

import torch

from .checks import require

_HALF = (torch.float16, torch.bfloat16)
MAX_DYNAMIC_QUANT_K = 11264  # the last dim npu_dynamic_quant takes on Atlas A2


def npu_dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=None):
    op = "npu_dynamic_quant"
    require(x.dim() > 1 and x.dtype in _HALF, op, f"x must be float16/bfloat16 with >1 dims, got {x.dtype} "
                                                  f"{tuple(x.shape)}")
    require(x.shape[-1] <= MAX_DYNAMIC_QUANT_K, op, f"x's last dim must be <= {MAX_DYNAMIC_QUANT_K}, got {x.shape[-1]}")
    require(smooth_scales is None and group_index is None, op, "smooth_scales / group_index are not emulated")
    require(dst_type in (None, torch.int8), op, f"only int8 output is emulated, got dst_type {dst_type}")
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = torch.round(xf / safe[..., None]).clamp(-127, 127).to(torch.int8)
    return y, scale


def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None):
    op = "npu_quant_matmul"
    require(x1.dim() == 2 and x2.dim() == 2 and x1.dtype == torch.int8 and x2.dtype == torch.int8, op,
            f"x1 [M, K] and x2 [K, N] must be 2-D int8 (others are not emulated), got {x1.dtype} "
            f"{tuple(x1.shape)}, {x2.dtype} {tuple(x2.shape)}")
    m, k = x1.shape
    n = x2.shape[1]
    require(x2.shape[0] == k, op, f"x1 has K={k}, x2 has K={x2.shape[0]}")
    require(m >= 1 and k >= 1 and n >= 1, op, "x1 and x2 may not be empty")
    require(scale.dim() == 1 and scale.shape[0] in (1, n) and scale.dtype == torch.float32, op,
            f"scale must be float32 of shape (1,) or ({n},), got {scale.dtype} {tuple(scale.shape)}")
    require(offset is None, op, "offset is not emulated (int8 output only)")
    require(output_dtype in _HALF, op, f"output_dtype float16/bfloat16 is emulated (with pertoken_scale), got "
                                       f"{output_dtype}")
    require(pertoken_scale is not None and pertoken_scale.dtype == torch.float32
            and tuple(pertoken_scale.shape) == (m,), op, f"pertoken_scale must be float32 ({m},)")
    if bias is not None:
        require(bias.dtype in (torch.float32, output_dtype) and tuple(bias.shape) == (n,), op,
                f"bias must be float32 or {output_dtype} of shape ({n},) (int32 is not emulated), got "
                f"{bias.dtype} {tuple(bias.shape)}")
    acc = (x1.long() @ x2.long()).float()  # the integer product, exact (|sums| < 2^24 not needed: int64)
    y = acc * scale.reshape(1, -1) * pertoken_scale.reshape(-1, 1)
    if bias is not None:
        y = y + bias.float().reshape(1, n)
    return y.to(output_dtype)
