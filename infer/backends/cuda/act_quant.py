"""`linear` for int8 weights that quantize their input per token (``act_quant="int8_token"``, W8A8).

Two kernels: one program per row of x finds its scale ``s = max|x| / 127``
(1 for an all-zero row) and writes the row's int8 codes (``x / s`` correctly
rounded by `tl.div_rn`, then to the nearest integer, ties to even); the GEMM
multiplies codes by the weight's int8 rows with an int32 accumulator
(`tl.dot` on the int8 tensor cores, exact) and scales each product by its
row's ``s`` and its channel's weight scale, adding the bias in float32.
Weights with groups or offsets (legal handles, not W8A8's layout) go to the
torch backend's implementation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...primitives.types import Int8GroupWeight
from ..torch_native import act_quant as torch_act_quant

ROUND = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds |v| < 2^22 to an integer, ties to even


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + ks, mask=ks < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    m = tl.max(amax, axis=0)
    s = tl.where(m > 0, tl.div_rn(m, 127.0), 1.0)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + ks, mask=ks < K, other=0.0).to(tl.float32)
        v = (tl.div_rn(x, s) + ROUND) - ROUND
        v = tl.minimum(tl.maximum(v, -127.0), 127.0)
        tl.store(q_ptr + row * stride_q + ks, v.to(tl.int8), mask=ks < K)
    tl.store(s_ptr + row, s)


@triton.jit
def _int8_gemm_kernel(q_ptr, w_ptr, xs_ptr, ws_ptr, b_ptr, out_ptr, T, N, K, stride_q, stride_w, stride_o,
                      HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(q_ptr + ts[:, None] * stride_q + ks[None, :], mask=(ts < T)[:, None] & (ks < K)[None, :], other=0)
        b = tl.load(w_ptr + ns[:, None] * stride_w + ks[None, :], mask=(ns < N)[:, None] & (ks < K)[None, :], other=0)
        acc += tl.dot(a, tl.trans(b), out_dtype=tl.int32)
    xs = tl.load(xs_ptr + ts, mask=ts < T, other=0.0)
    ws = tl.load(ws_ptr + ns, mask=ns < N, other=0.0)
    y = acc.to(tl.float32) * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + ns, mask=ns < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + ts[:, None] * stride_o + ns[None, :], y.to(out_ptr.dtype.element_ty),
             mask=(ts < T)[:, None] & (ns < N)[None, :])


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([T, K] int8 codes, [T] float32 scales) of x's rows (`infer.primitives.act_quant`)."""
    t, k = x.shape
    q = torch.empty((t, k), dtype=torch.int8, device=x.device)
    s = torch.empty((t,), dtype=torch.float32, device=x.device)
    if t:
        x = x.contiguous()
        _quantize_rows_kernel[(t,)](x, q, s, k, x.stride(0), q.stride(0), BLOCK_K=128)
    return q, s


def linear(x: torch.Tensor, w: Int8GroupWeight) -> torch.Tensor:
    if w.act_quant != "int8_token" or w.group_size != w.in_features or w.offsets is not None:
        return torch_act_quant.linear(x, w)
    t, n, k = x.shape[0], w.out_features, w.in_features
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    q, s = quantize_per_token(x)
    qw = w.qweight.contiguous()
    bias = w.bias if w.bias is not None else s  # any pointer when there is none
    grid = (triton.cdiv(t, 16), triton.cdiv(n, 64))
    _int8_gemm_kernel[grid](q, qw, s, w.scales.reshape(-1).contiguous(), bias, out, t, n, k, q.stride(0),
                            qw.stride(0), out.stride(0), HAS_BIAS=w.bias is not None, BLOCK_T=16, BLOCK_N=64,
                            BLOCK_K=64)
    return out
