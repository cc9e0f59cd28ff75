"""Rotary position embedding, in place, on q and k of one step at once.

One program per token rotates the first R dims of every query and key head:
neox style pairs dim i with i + R/2, gptj style pairs 2i with 2i + 1. The
angles come from the float32 ``[max_position, R]`` cos|sin cache, read once
per token for all heads; dims past R are never touched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import next_pow2, row_warps


@triton.jit
def _rotate_heads(x_ptr, stride_h, num_heads, cos, sin, half,
                  NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_R)[None, :]
    mask = (h < num_heads) & (i < half)
    if NEOX:
        first, second = i, i + half
    else:
        first, second = 2 * i, 2 * i + 1
    p1 = x_ptr + h * stride_h + first
    p2 = x_ptr + h * stride_h + second
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p2, mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(p1, (x1f * cos - x2f * sin).to(x1.dtype), mask=mask)
    tl.store(p2, (x2f * cos + x1f * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, pos_ptr, cos_sin_ptr, num_q_heads, num_k_heads, half,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
                   NEOX: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_R)[None, :]
    cos = tl.load(cos_sin_ptr + pos * stride_cs + i, mask=i < half, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + half + i, mask=i < half, other=0.0)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, num_q_heads, cos, sin, half, NEOX, BLOCK_HQ, BLOCK_R)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, num_k_heads, cos, sin, half, NEOX, BLOCK_HK, BLOCK_R)


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
           neox_style: bool) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_q_heads, _ = q.shape
    num_k_heads = k.shape[1]
    if num_tokens == 0:
        return q, k
    # In place through strides, so q/k may be views into the fused qkv output;
    # only a non-unit last stride needs a copy (returned, as the contract allows).
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    cos_sin = cos_sin_cache if cos_sin_cache.dtype == torch.float32 else cos_sin_cache.float()
    half = cos_sin.shape[1] // 2
    block_r = next_pow2(half)
    bq, bk = next_pow2(num_q_heads), next_pow2(num_k_heads)
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos_sin, num_q_heads, num_k_heads, half,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0),
        NEOX=neox_style, BLOCK_HQ=bq, BLOCK_HK=bk, BLOCK_R=block_r, num_warps=row_warps(bq * block_r),
    )  # fmt: skip
    return q, k
