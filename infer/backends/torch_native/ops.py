"""Row-wise primitives of the torch backend: embedding, rms_norm, rotary, act_and_mul.

Half-precision inputs are widened to float32 for the arithmetic and rounded
once at the end, so a bf16 result is the float32 result rounded, as the
reference computes it, instead of a chain of per-op bf16 roundings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    if ids.dtype not in (torch.int32, torch.int64):
        ids = ids.long()
    return table.index_select(0, ids)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        # The sum is rounded to x's dtype: it is what the next layer adds to.
        x = x + residual
    xf = x.float()
    inv_rms = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    y = (xf * inv_rms * weight.float()).to(x.dtype)
    return y if residual is None else (y, x)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox_style: bool) -> torch.Tensor:
    rot = 2 * cos.shape[-1]
    xr = x[..., :rot].float()
    if neox_style:
        x1, x2 = xr.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        # Re-interleave the pairs: stack on a new last dim, then flatten it.
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    rotated = rotated.to(x.dtype)
    if rot == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., rot:]), dim=-1)


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, neox_style: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache.float().index_select(0, positions.long())[:, None, :]  # [T, 1, R]
    cos, sin = cos_sin[..., :half], cos_sin[..., half:]
    return _rotate(q, cos, sin, neox_style), _rotate(k, cos, sin, neox_style)


_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def act_and_mul(x: torch.Tensor, kind: str) -> torch.Tensor:
    try:
        act = _ACTIVATIONS[kind]
    except KeyError:
        raise ValueError(f"act_and_mul: unknown activation {kind!r}; expected one of {tuple(_ACTIVATIONS)}") from None
    half = x.shape[-1] // 2
    xf = x.float()
    return (act(xf[:, :half]) * xf[:, half:]).to(x.dtype)
