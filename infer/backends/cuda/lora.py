"""Batched LoRA as two Triton kernels, punica's shrink and expand (BGMV form: one
program per token, reading that token's adapter).

shrink: ``mid[t, p*R:(p+1)*R] = A[s_t, p*R:(p+1)*R] @ x[t]`` for every slice p, float32.
expand: ``y[t, cols_p] += B[s_t, cols_p] @ mid[t, p*R:(p+1)*R]``, added in float32 and
rounded once into y (in place). Tokens of slot 0 (no adapter) return at once, so
slot 0's weights are never read and their rows of y are untouched. A column's
slice is found from the slice bounds (at most three slices: q/k/v).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import next_pow2

BLOCK_K = 128
BLOCK_N = 128


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, idx_ptr, mid_ptr, K, R, stride_x, stride_as, stride_ar, stride_mid,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    s = tl.load(idx_ptr + t).to(tl.int64)
    if s > 0:
        rows = tl.arange(0, BLOCK_R)
        r_ok = rows < R
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        a_rows = a_ptr + s * stride_as + (p * R + rows)[:, None].to(tl.int64) * stride_ar
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            xv = tl.load(x_ptr + t * stride_x + ks, mask=k_ok, other=0.0).to(tl.float32)
            a = tl.load(a_rows + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(a * xv[None, :], axis=1)
        tl.store(mid_ptr + t * stride_mid + p * R + rows, acc, mask=r_ok)


@triton.jit
def _expand_kernel(y_ptr, b_ptr, idx_ptr, mid_ptr, N, R, bound1, bound2, stride_y, stride_bs, stride_bn,
                   stride_mid, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    s = tl.load(idx_ptr + t).to(tl.int64)
    if s > 0:
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        c_ok = cols < N
        rows = tl.arange(0, BLOCK_R)
        r_ok = rows < R
        part = (cols >= bound1).to(tl.int32) + (cols >= bound2).to(tl.int32)  # each column's slice
        mid = tl.load(mid_ptr + t * stride_mid + part[:, None] * R + rows[None, :],
                      mask=c_ok[:, None] & r_ok[None, :], other=0.0)
        b = tl.load(b_ptr + s * stride_bs + cols[:, None].to(tl.int64) * stride_bn + rows[None, :],
                    mask=c_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
        delta = tl.sum(b * mid, axis=1)
        y = tl.load(y_ptr + t * stride_y + cols, mask=c_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + t * stride_y + cols, (y + delta).to(y_ptr.dtype.element_ty), mask=c_ok)


def lora(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, lora_indices: torch.Tensor,
         output_slices=None) -> torch.Tensor:
    t, k = x.shape
    n = y.shape[1]
    slices = tuple(output_slices) if output_slices is not None else (n,)
    if len(slices) > 3:
        raise ValueError(f"lora: the cuda kernels take up to 3 output slices, got {len(slices)}")
    if t == 0:
        return y
    p = len(slices)
    r = lora_a.shape[1] // p
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = y if y.stride(-1) == 1 else y.contiguous()
    a = lora_a if lora_a.stride(-1) == 1 else lora_a.contiguous()
    b = lora_b if lora_b.stride(-1) == 1 else lora_b.contiguous()
    idx = lora_indices.to(device=x.device, dtype=torch.int32)
    mid = torch.empty(t, p * r, dtype=torch.float32, device=x.device)
    block_r = max(16, next_pow2(r))
    _shrink_kernel[(t, p)](x, a, idx, mid, k, r, x.stride(0), a.stride(0), a.stride(1), mid.stride(0),
                           BLOCK_R=block_r, BLOCK_K=min(BLOCK_K, max(16, next_pow2(k))), num_warps=4)
    bounds = [sum(slices[: i + 1]) for i in range(p - 1)] + [n + 1] * (3 - p)
    block_n = min(BLOCK_N, max(16, next_pow2(n)))
    _expand_kernel[(t, triton.cdiv(n, block_n))](y, b, idx, mid, n, r, bounds[0], bounds[1], y.stride(0), b.stride(0),
                                                   b.stride(1), mid.stride(0), BLOCK_R=block_r, BLOCK_N=block_n,
                                                   num_warps=4)
    return y
