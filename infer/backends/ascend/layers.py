"""Row-wise primitives on torch_npu's fused ops: rms_norm, rotary, act_and_mul."""

from __future__ import annotations

import torch

from ..torch_native import ops as torch_ops
from .availability import torch_npu


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    npu = torch_npu()
    if residual is None:
        return npu.npu_rms_norm(x, weight, epsilon=eps)[0]
    # npu_add_rms_norm returns (y, rstd, x + residual): the sum is the next residual.
    y, _, summed = npu.npu_add_rms_norm(x, residual, weight, epsilon=eps)
    return y, summed


def _factors(cos: torch.Tensor, sin: torch.Tensor, neox_style: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """r1, r2 of npu_rotary_mul for a [T, 1, 1, R] layout: cos/sin repeated per half ('half')
    or per pair ('interleave')."""
    if neox_style:
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    return cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, neox_style: bool):
    npu = torch_npu()
    half = cos_sin_cache.shape[1] // 2
    rot = 2 * half
    cos_sin = cos_sin_cache.float().index_select(0, positions.long())
    r1, r2 = _factors(cos_sin[:, :half], cos_sin[:, half:], neox_style)
    # BSND with B=1, S=T: factors are 1S1D. Float32 in, so cos/sin are not rounded to the model dtype.
    r1, r2 = r1[None, :, None, :], r2[None, :, None, :]
    mode = "half" if neox_style else "interleave"

    def apply(x: torch.Tensor) -> torch.Tensor:
        head = x[..., :rot].float().contiguous()[None]
        out = npu.npu_rotary_mul(head, r1, r2, rotary_mode=mode)[0].to(x.dtype)
        return out if rot == x.shape[-1] else torch.cat((out, x[..., rot:]), dim=-1)

    return apply(q), apply(k)


def act_and_mul(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "silu":
        return torch_npu().npu_swiglu(x, dim=-1)
    # No fused gelu-and-mul in torch_npu's documented set: torch's ops run on the NPU.
    return torch_ops.act_and_mul(x, kind)
