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


# Up to this many rows, float32 rms_norm runs as torch's fused F.rms_norm (one
# kernel: faster at decode sizes); past it the fused CPU kernel was measured
# slower than the composite below, which parallelises better
# (docs/backends/torch-measurements.md).
FUSED_RMS_NORM_MAX_ROWS = 256


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        # The sum is rounded to x's dtype: it is what the next layer adds to.
        x = x + residual
    if x.shape[0] <= FUSED_RMS_NORM_MAX_ROWS:
        # In float32 whatever x's dtype, rounded once: the same arithmetic as below.
        y = F.rms_norm(x.float(), weight.shape, weight.float(), eps).to(x.dtype)
    else:
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


def _rotate_neox_f32(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox rotation of every dim of a float32 x, written into one output (no cat).

    Each product is rounded before the sum, as transformers' `q * cos +
    rotate_half(q) * sin` does: addcmul_ would fuse them and round differently.
    """
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=o1).sub_(x2 * sin)
    torch.mul(x2, cos, out=o2).add_(x1 * sin)
    return out


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q and k as one [T, Hq + Hk, D] view when k's heads follow q's in memory (both split from one qkv row)."""
    if q.dim() != 3 or q.dtype != k.dtype or q.stride() != k.stride() or q.shape[0] != k.shape[0]:
        return None
    t, hq, d = q.shape
    if q.stride(2) != 1 or q.stride(1) != d or k.data_ptr() != q.data_ptr() + hq * d * q.element_size():
        return None
    return q.as_strided((t, hq + k.shape[1], d), q.stride())


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, neox_style: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache.float().index_select(0, positions.long())[:, None, :]  # [T, 1, R]
    cos, sin = cos_sin[..., :half], cos_sin[..., half:]
    if neox_style and 2 * half == q.shape[-1] == k.shape[-1]:
        # float32 arithmetic, rounded once to q's dtype (a no-op for float32)
        qk = _adjacent_heads(q, k)
        if qk is not None:  # one pass over both (decode: half the kernel launches)
            out = _rotate_neox_f32(qk.float(), cos, sin).to(q.dtype)
            return out[:, : q.shape[1]], out[:, q.shape[1]:]
        return (_rotate_neox_f32(q.float(), cos, sin).to(q.dtype),
                _rotate_neox_f32(k.float(), cos, sin).to(k.dtype))
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


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
               residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual  # rounded to x's dtype: the stream the next block adds to
    y = F.layer_norm(x.float(), weight.shape, weight.float(), None if bias is None else bias.float(), eps).to(x.dtype)
    return y if residual is None else (y, x)


_PLAIN = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "relu": F.relu,
          "tanh": torch.tanh, "quick_gelu": lambda x: (x.float() * torch.sigmoid(1.702 * x.float())).to(x.dtype)}


def activation(x: torch.Tensor, kind: str) -> torch.Tensor:
    try:
        act = _PLAIN[kind]
    except KeyError:
        raise ValueError(f"activation: unknown kind {kind!r}; expected one of {tuple(_PLAIN)}") from None
    # torch's elementwise kernels compute 16-bit inputs in float32 and round once: no widened copy needed.
    return act(x)


def pool(x: torch.Tensor, query_start_loc: torch.Tensor, method: str) -> torch.Tensor:
    if method == "all":
        return x
    starts = query_start_loc.long()
    if method == "cls":
        return x.index_select(0, starts[:-1])
    if method == "last":
        return x.index_select(0, starts[1:] - 1)
    lengths = starts[1:] - starts[:-1]
    if method not in ("mean", "max"):
        raise ValueError(f"pool: unknown method {method!r}")
    if not len(lengths):
        return x.new_zeros((0, x.shape[1]))
    return torch.segment_reduce(x.float(), method, lengths=lengths, axis=0).to(x.dtype)
