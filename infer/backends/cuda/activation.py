"""Gated activations: ``act(x[:, :I]) * x[:, I:]`` for SwiGLU and GeGLU, in float32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import next_pow2

KINDS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
BLOCK = 1024


@triton.jit
def _act_and_mul_kernel(out_ptr, x_ptr, inter, stride_x, stride_o, KIND: tl.constexpr, BLOCK_I: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = cols < inter
    a = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if KIND == 0:
        act = a / (1.0 + tl.exp(-a))
    elif KIND == 1:
        act = 0.5 * a * (1.0 + tl.math.erf(a * 0.7071067811865476))
    else:
        # 1 + tanh(u) = 2 sigmoid(2u): no libdevice tanh needed, exact at +-inf.
        u = 0.7978845608028654 * (a + 0.044715 * a * a * a)
        act = 0.5 * a * (2.0 / (1.0 + tl.exp(-2.0 * u)))
    tl.store(out_ptr + row * stride_o + cols, (act * g).to(out_ptr.dtype.element_ty), mask=mask)


def act_and_mul(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind not in KINDS:
        raise ValueError(f"act_and_mul: unknown activation {kind!r}; expected one of {tuple(KINDS)}")
    num_tokens, two_i = x.shape
    inter = two_i // 2
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    if num_tokens and inter:
        if x.stride(-1) != 1:
            x = x.contiguous()
        block = min(BLOCK, next_pow2(inter))
        _act_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
            out, x, inter, x.stride(0), out.stride(0), KIND=KINDS[kind], BLOCK_I=block,
            num_warps=4 if block >= 512 else 1)
    return out
