"""RMSNorm with the residual add fused in: one read of x (and residual), one
write of y (and the new residual), the mean of squares in float32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import next_pow2, row_warps


@triton.jit
def _rms_norm_kernel(y_ptr, res_out_ptr, x_ptr, res_ptr, w_ptr, eps, hidden,
                     stride_x, stride_r, stride_y, stride_ro,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # The sum is rounded to the model dtype: that rounded value is the next
        # residual, and the norm must see exactly what the next layer adds to.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hidden + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (xf * inv_rms * w).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    num_tokens, hidden = x.shape
    y = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else y
    if num_tokens:
        if x.stride(-1) != 1:
            x = x.contiguous()
        res = residual if residual is None or residual.stride(-1) == 1 else residual.contiguous()
        block = next_pow2(hidden)
        _rms_norm_kernel[(num_tokens,)](
            y, res_out, x, x if res is None else res, weight, float(eps), hidden,
            x.stride(0), 0 if res is None else res.stride(0), y.stride(0), res_out.stride(0),
            HAS_RESIDUAL=res is not None, BLOCK=block, num_warps=row_warps(block),
        )  # fmt: skip
    return y if residual is None else (y, res_out)
