"""torch_npu's fused row-wise ops, emulated in torch on the CPU.

From torch_npu's documentation (Ascend/op-plugin docs/context): npu_rms_norm,
npu_add_rms_norm, npu_rotary_mul (the 'half' and 'interleave' formulas are
given there in torch), npu_swiglu. Arithmetic runs in float32 and each output
is rounded once to the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .checks import require

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _rms(x: torch.Tensor, gamma: torch.Tensor, epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    rstd = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


def npu_rms_norm(x, gamma, epsilon=1e-6):
    """(y, rstd): ``y = x * rsqrt(mean(x**2, -1) + epsilon) * gamma`` over gamma's
    trailing dims; rstd is float32 with those dims kept as 1."""
    op = "npu_rms_norm"
    require(x.dtype in FLOAT_DTYPES and gamma.dtype == x.dtype, op, f"x/gamma must share a float dtype, got {x.dtype}/{gamma.dtype}")
    require(gamma.dim() == 1 and gamma.shape[0] == x.shape[-1], op, f"gamma must be [{x.shape[-1]}], got {tuple(gamma.shape)}")
    return _rms(x, gamma, epsilon)


def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    """(y, rstd, x): ``x = x1 + x2`` (in x1's dtype), then rms-norm of x."""
    op = "npu_add_rms_norm"
    require(x1.dtype == x2.dtype == gamma.dtype and x1.dtype in FLOAT_DTYPES, op,
            f"x1, x2, gamma must share a float dtype, got {x1.dtype}, {x2.dtype}, {gamma.dtype}")
    require(x1.shape == x2.shape, op, f"x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} must match")
    require(gamma.dim() == 1 and gamma.shape[0] == x1.shape[-1], op, f"gamma must be [{x1.shape[-1]}]")
    x = (x1.float() + x2.float()).to(x1.dtype)
    y, rstd = _rms(x, gamma, epsilon)
    return y, rstd, x


def npu_rotary_mul(input, r1, r2, rotary_mode="half"):
    """``r1 * input + r2 * rotate(input)``: 'half' rotates (x1, x2) -> (-x2, x1) over
    the two halves of the last dim, 'interleave' over its (even, odd) pairs.

    input, r1, r2 are 4-D; r1/r2 broadcast against input (e.g. [1, S, 1, D] for a BSND input).
    """
    op = "npu_rotary_mul"
    require(input.dim() == 4 and r1.dim() == 4 and r2.dim() == 4, op, "input, r1 and r2 must be 4-D")
    require(input.dtype in FLOAT_DTYPES and r1.dtype == r2.dtype == input.dtype, op,
            f"input, r1, r2 must share a float dtype, got {input.dtype}, {r1.dtype}, {r2.dtype}")
    d = input.shape[-1]
    require(d % 2 == 0 and d < 896, op, f"D must be even and < 896, got {d}")
    require(r1.shape == r2.shape and r1.shape[-1] == d, op, "r1 and r2 must share a shape ending in D")
    torch.broadcast_shapes(input.shape, r1.shape)
    x = input.float()
    if rotary_mode == "half":
        x1, x2 = torch.chunk(x, 2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    elif rotary_mode == "interleave":
        x1, x2 = x[..., ::2], x[..., 1::2]
        rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
    else:
        require(False, op, f"rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}")
    return (r1.float() * x + r2.float() * rotated).to(input.dtype)


def npu_swiglu(input, dim=-1):
    """``silu(a) * b`` with (a, b) the two halves of `input` along `dim`."""
    op = "npu_swiglu"
    require(input.dtype in FLOAT_DTYPES, op, f"input must be float16/bfloat16/float32, got {input.dtype}")
    require(input.shape[dim] % 2 == 0, op, f"dim {dim} must have even size, got {input.shape[dim]}")
    a, b = torch.chunk(input.float(), 2, dim=dim)
    return (F.silu(a) * b).to(input.dtype)
