"""`linear` on quantized weights: the weight is dequantized tile by tile inside the GEMM.

One program computes a [BLOCK_T, BLOCK_N] tile of ``x @ w.T``. For each K tile
it loads the stored codes of its BLOCK_N rows (each byte once, contiguous
along K, so the loads are wide), turns them into float32 with their group's
scale (and offset), loaded once per group and broadcast over its codes, and
feeds ``tl.dot``; the dequantized matrix never exists in memory, so the weight
is read at its stored width.

* int4 group (`Int4GroupWeight`: GGUF Q4_0/Q4_1, AWQ, GPTQ): byte ``k // 2`` of
  a row holds k's nibble (low for even k), ``w = q * scale + offset``.
* int8 group (`Int8GroupWeight`: Q8_0, Q5_0, Q6_K, ...): ``w = q * scale``,
  ``+ offset`` where the handle has offsets (Q5_1, Q5_K).
* mxfp4 (`Mxfp4Weight`: gpt-oss, GGUF MXFP4): nibbles as for int4, each an
  E2M1 code turned into its float32 bits, times its block of 32's E8M0
  power of two (also built from bits, exact), one per block per row.
* fp8 (`Fp8Weight`): e4m3fn codes decoded exactly (`fp8.py`: the hardware
  conversion on sm_89+, three integer ops per code before), the tile fed to
  `tl.dot` unscaled; the one scale per row or per tensor multiplies the
  finished products.

With fp16/bf16 activations the dequantized tile is rounded to their dtype (an
fp8 tile, unscaled, is exact in either) and the product runs on the tensor cores with a float32 accumulator (as vLLM's
AWQ/GPTQ kernels do): a float32 `tl.dot` runs on the FMA units, an order of
magnitude slower for prefill-sized T. float32 activations (and bf16 under the
interpreter, whose bf16 arithmetic is wrong) meet the tile in float32, exact
against the dequantized-weight reference. Bias is added in float32 before the
result is rounded to the activation dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...primitives.types import Fp8Weight, Int4GroupWeight, Int8GroupWeight, Mxfp4Weight, WeightHandle
from . import tuned
from .fp8 import e4m3_to_f16, fp8_rescale, native_fp8
from .launch import compute_f32

KINDS = {"int4_group": 0, "int8_group": 1, "fp8": 2, "mxfp4": 3}


@triton.jit
def _e2m1(c):
    """E2M1 codes (int32 0..15: sign, 2 exponent bits, 1 mantissa bit) as float32, built from bits."""
    e, m = (c >> 1) & 3, c & 1
    bits = tl.where(e > 0, ((e + 126) << 23) | (m << 22), m * 0x3F000000) | ((c >> 3) << 31)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e8m0(e):
    """E8M0 exponents (int32 0..255) as float32 2^(e - 127), exact (2^-127 is a subnormal); 255 is NaN."""
    bits = tl.where(e >= 1, e << 23, 0x400000)
    return tl.where(e == 255, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def _grouped(q, s_ptr, o_ptr, rows, n_ok, k0, K, stride_sn, GROUP: tl.constexpr, HAS_OFFSET: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The codes `q` [BLOCK_N, BLOCK_K] (K from k0) times their group's scale, plus its offset.

    Each group's scale is loaded once and broadcast over its codes, not gathered per code.
    """
    if GROUP % BLOCK_K == 0:  # the whole K tile lies in one group: one scale per row
        g = rows * stride_sn + k0 // GROUP
        w = q * tl.load(s_ptr + g, mask=n_ok, other=0.0)[:, None]
        if HAS_OFFSET:
            w += tl.load(o_ptr + g, mask=n_ok, other=0.0)[:, None]
    elif BLOCK_K % GROUP == 0:  # BLOCK_K // GROUP whole groups: scales [BLOCK_N, PER], broadcast over GROUP
        PER: tl.constexpr = BLOCK_K // GROUP
        gs = k0 // GROUP + tl.arange(0, PER)
        g = rows[:, None] * stride_sn + gs[None, :]
        m = n_ok[:, None] & (gs * GROUP < K)[None, :]
        w = tl.reshape(q, (BLOCK_N, PER, GROUP)) * tl.load(s_ptr + g, mask=m, other=0.0)[:, :, None]
        if HAS_OFFSET:
            w += tl.load(o_ptr + g, mask=m, other=0.0)[:, :, None]
        w = tl.reshape(w, (BLOCK_N, BLOCK_K))
    else:  # a group size that is not a power of two: one scale per code
        ks = k0 + tl.arange(0, BLOCK_K)
        g = rows[:, None] * stride_sn + (ks // GROUP)[None, :]
        m = n_ok[:, None] & (ks < K)[None, :]
        w = q * tl.load(s_ptr + g, mask=m, other=0.0)
        if HAS_OFFSET:
            w += tl.load(o_ptr + g, mask=m, other=0.0)
    return w


@triton.jit
def _quant_linear_kernel(x_ptr, q_ptr, s_ptr, o_ptr, b_ptr, out_ptr, T, N, K, KQ, stride_xt, stride_qn, stride_sn,
                         stride_out, KIND: tl.constexpr, GROUP: tl.constexpr, PER_TENSOR: tl.constexpr,
                         HAS_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, F32: tl.constexpr, FP8_NATIVE: tl.constexpr,
                         FP8_RESCALE: tl.constexpr):
    pid_t, pid_n = tl.program_id(0), tl.program_id(1)
    ts = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    ns = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    t_ok, n_ok = ts < T, ns < N
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + ts[:, None] * stride_xt + ks[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        if KIND == 0:
            # Each byte once, contiguous along K (wide loads); its low nibble is the even k, so
            # joining (low, high) on a new last axis and flattening restores K's order.
            js = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            byte = tl.load(q_ptr + ns[:, None] * stride_qn + js[None, :], mask=n_ok[:, None] & (js < KQ)[None, :],
                           other=0)
            q = tl.interleave(byte & 15, byte >> 4).to(tl.float32)
            w = _grouped(q, s_ptr, o_ptr, ns, n_ok, k0, K, stride_sn, GROUP, True, BLOCK_N, BLOCK_K)
        elif KIND == 1:
            q = tl.load(q_ptr + ns[:, None] * stride_qn + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
            w = _grouped(q.to(tl.float32), s_ptr, o_ptr, ns, n_ok, k0, K, stride_sn, GROUP, HAS_OFFSET, BLOCK_N,
                         BLOCK_K)
        elif KIND == 3:
            # MXFP4: nibbles as for int4, each code's E2M1 value times its block of 32's 2^(e - 127).
            js = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            byte = tl.load(q_ptr + ns[:, None] * stride_qn + js[None, :], mask=n_ok[:, None] & (js < KQ)[None, :],
                           other=0).to(tl.int32)
            v = _e2m1(tl.interleave(byte & 15, byte >> 4))
            PER: tl.constexpr = BLOCK_K // 32
            gs = k0 // 32 + tl.arange(0, PER)
            e = tl.load(s_ptr + ns[:, None] * stride_sn + gs[None, :], mask=n_ok[:, None] & (gs * 32 < K)[None, :],
                        other=127).to(tl.int32)
            w = tl.reshape(tl.reshape(v, (BLOCK_N, PER, 32)) * _e8m0(e)[:, :, None], (BLOCK_N, BLOCK_K))
        else:
            # The code's value (times 2^-8 without FP8_NATIVE), exact in any dtype: the
            # per-row scale multiplies the finished dot products below.
            w = e4m3_to_f16(tl.load(q_ptr + ns[:, None] * stride_qn + ks[None, :], mask=n_ok[:, None] & k_ok[None, :],
                                    other=0), FP8_NATIVE)
        if F32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if KIND == 2:
        if PER_TENSOR:
            acc *= tl.load(s_ptr) * FP8_RESCALE
        else:
            acc *= (tl.load(s_ptr + ns, mask=n_ok, other=0.0) * FP8_RESCALE)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + ns, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + ts[:, None] * stride_out + ns[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=t_ok[:, None] & n_ok[None, :])


def tiles(t: int, dtype: torch.dtype, device: torch.device | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_N, BLOCK_K, num_warps) for T rows of x.

    For fp16/bf16 x, the device's tuned file where it has one (`tuned.py`,
    written by `benchmarks/gpu_check.py --tune`). Otherwise guesses: few rows
    (decode) stream the weight, and long K tiles keep more bytes in flight per
    program (with 16-bit x, K 256: each thread copies 32 bytes of int4 codes per
    pipeline stage, twice K 128's, in the same grid); many rows with 16-bit x
    are a tensor-core GEMM; float32 x runs on the FMA units and keeps small tiles.
    """
    if device is not None and dtype in (torch.float16, torch.bfloat16):
        tile = tuned.quant_linear("decode" if t <= 16 else "prefill", device)
        if tile:
            return tile
    if t <= 16:
        return (16, 32, 128, 4) if compute_f32(dtype) else (16, 32, 256, 4)
    if compute_f32(dtype):
        return 32, 32, 32, 4
    return 64, 64, 64, 4


def linear(x: torch.Tensor, w: WeightHandle, config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """``x @ w.T`` (+ bias) for a quantized weight; `config` overrides `tiles` (for tuning)."""
    if w.kind not in KINDS:
        raise TypeError(f"cuda quantized linear: no kernel for weight kind {w.kind!r}")
    t, k = x.shape
    n = w.out_features
    if k != w.in_features:
        raise ValueError(f"linear: x has {k} features, the weight takes {w.in_features}")
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t == 0 or n == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    q, scales = w.qweight, w.scales
    has_offset = getattr(w, "offsets", None) is not None
    offsets = w.offsets if has_offset else scales  # unread without HAS_OFFSET
    group = w.group_size if isinstance(w, (Int4GroupWeight, Int8GroupWeight)) else 1
    per_tensor = isinstance(w, Fp8Weight) and scales.numel() == 1
    native = isinstance(w, Fp8Weight) and native_fp8(x.device)
    bias = w.bias if w.bias is not None else scales  # unread without HAS_BIAS
    block_t, block_n, block_k, warps = config or tiles(t, x.dtype, x.device)
    if isinstance(w, Mxfp4Weight) and block_k % 32:
        raise ValueError(f"cuda quantized linear: an MXFP4 K tile must hold whole blocks of 32, got {block_k}")
    grid = (triton.cdiv(t, block_t), triton.cdiv(n, block_n))
    # q.shape[1] (codes per row: k/2 for int4) is its own argument so the compiler knows
    # when it is a multiple of 16, which the int4 tail mask needs for 8- and 16-byte loads.
    _quant_linear_kernel[grid](
        x, q, scales, offsets, bias, out, t, n, k, q.shape[1], x.stride(0), q.stride(0),
        scales.stride(0) if scales.dim() > 1 or not per_tensor else 0, out.stride(0),
        KIND=KINDS[w.kind], GROUP=group, PER_TENSOR=per_tensor, HAS_OFFSET=has_offset, HAS_BIAS=w.bias is not None,
        BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k, F32=compute_f32(x.dtype),
        FP8_NATIVE=native, FP8_RESCALE=fp8_rescale(native), num_warps=warps)
    return out
