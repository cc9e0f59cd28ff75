"""Reshape-and-cache: scatter this step's K/V rows into the paged cache.

One program per token copies its K and V (all KV heads) to slot
``slot_mapping[t]`` of the ``[2, num_blocks, block_size, Hk, D]`` cache.
Slots < 0 mark padded rows (a CUDA-graph batch rounded up, say): the program
returns before touching memory, so padding never lands in block 0 or the
last slot.

An fp8 cache (uint8) receives the e4m3fn codes of ``k / k_scale`` and
``v / v_scale``, divided in float32 (correctly rounded) and rounded as the
contract says (`fp8.e4m3_encode`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..torch_native.fp8_kv import cache_scales
from .fp8 import e4m3_encode
from .launch import next_pow2, row_warps


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale, v_scale,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
                     BLOCK_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_HEADS) & (d < HEAD_DIM)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch + d
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    if FP8:
        # div_rn: `/` compiles to an approximate reciprocal, which moves values across code ties.
        k = e4m3_encode(tl.div_rn(k.to(tl.float32), k_scale))
        v = e4m3_encode(tl.div_rn(v.to(tl.float32), v_scale))
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def kv_write(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             scales: tuple[float, float] | None = None) -> None:
    """`scales` (k_scale, v_scale) only for an fp8 (uint8) cache, where None means 1.0."""
    fp8, (k_scale, v_scale) = cache_scales(kv_cache, scales, "kv_write: scales")
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    block_h, block_d = next_pow2(num_heads), next_pow2(head_dim)
    _kv_write_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, float(k_scale), float(v_scale),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
        FP8=fp8, num_warps=row_warps(block_h * block_d),
    )  # fmt: skip
