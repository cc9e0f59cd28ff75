"""The torch backend's native C kernels as declared fast paths (`Backend.fast_path`).

Each takes its primitive's exact arguments and returns ``NotImplemented``
where its kernel does not apply (no compiler, a dtype, too many rows, a soft
cap ...): the torch implementation then runs. The kernels themselves are in
`native/` (see `native.ops` for what each accepts).
"""

from __future__ import annotations

import torch

from ...primitives.backend import FastPath
from ...primitives.types import DenseWeight, Int8GroupWeight
from . import fp8_kv
from . import moe as torch_moe
from .attention import LazyPlan
from .native import ops as native
from .quant_linear import Int4Prepared, native_int4_takes, offset_term, unwrap


def _served(result):
    return NotImplemented if result is None else result


def rms_norm(x, weight, eps, residual=None):
    return _served(native.rms_norm(x, weight, eps, residual))


def rotary(q, k, positions, cos_sin_cache, neox_style):
    return _served(native.rotary(q, k, positions, cos_sin_cache, neox_style))


def act_and_mul(x, kind):
    return _served(native.silu_and_mul(x, kind)) if kind in ("silu", "gelu_tanh") else NotImplemented


def kv_write(k, v, kv_cache, slot_mapping, scales=None):
    fp8, scales = fp8_kv.cache_scales(kv_cache, scales, "kv_write: scales")
    return None if native.kv_write(k, v, kv_cache, slot_mapping, scales if fp8 else None) else NotImplemented


def attention(q, kv_cache, meta, scale, sliding_window=None, soft_cap=None, kv_scales=None, sinks=None):
    plan = meta.plan
    if not isinstance(plan, LazyPlan):
        return NotImplemented
    work = plan.row_keys * q.shape[1] * q.shape[2]
    if sinks is not None:
        sinks = sinks.float().contiguous()
    return _served(native.attention(q, kv_cache, meta, scale, sliding_window, work,
                                    (1.0, 1.0) if kv_scales is None else kv_scales, plan.request_keys, soft_cap,
                                    sinks))


def linear(x, weight):
    """The int4 GEMM (up to its row limit), the Q8_0 GEMV and the bf16 dense GEMV; bias added
    after, as the torch paths do."""
    weight = unwrap(weight)
    t, p = x.shape[0], weight.prepared
    if isinstance(weight, DenseWeight) and 0 < t <= native.BF16_GEMV_MAX_ROWS:
        y = native.bf16_gemv(x, weight.weight)
        if y is not None:
            return y if weight.bias is None else y + weight.bias.to(x.dtype)
        return NotImplemented
    if isinstance(p, Int4Prepared) and p.native is not None and t > 0 and native_int4_takes(x, weight):
        y = native.int4_gemm_prepared(x, p.native)
        if y is not None:
            return y if weight.bias is None else y + weight.bias.to(x.dtype)
    if isinstance(p, native.Int8Native) and 0 < t <= native.INT8_GEMM_MAX_ROWS:
        y = native.int8_gemm_prepared(x, p)
        if y is not None:
            return y if weight.bias is None else y + weight.bias.to(x.dtype)
    packed = isinstance(p, native.Int8Native) and p.packed  # its codes are in p only
    if isinstance(weight, Int8GroupWeight) and not packed and 0 < t <= native.INT8_GEMV_MAX_ROWS:
        y = native.int8_gemv(x, weight.qweight, weight.scales, weight.group_size)
        if y is not None:
            if weight.offsets is not None:
                y += offset_term(x, weight)
            return (y if weight.bias is None else y + weight.bias.float()).to(x.dtype)
    return NotImplemented


def moe(x, router_logits, w13, w2, top_k, renormalize, shared=None, shared_gate=None, w13_bias=None, w2_bias=None,
        activation=None, swiglu_alpha=None, swiglu_limit=None, routed_scaling_factor=None, scoring_func=None,
        routing_bias=None, expert_groups=None):
    """Steps of up to the bf16 GEMV's rows (decode): the whole primitive in one native call
    (routing included), else each chosen expert's
    two projections through the GEMV, routing, activation and combine as the torch moe's."""
    if x.dtype != torch.bfloat16 or not 0 < x.shape[0] <= native.BF16_GEMV_MAX_ROWS \
            or not isinstance(w13, torch.Tensor):  # quantized experts: the torch moe's
        return NotImplemented
    out = native.moe_bf16(x, router_logits, w13, w2, top_k, renormalize, shared, shared_gate, w13_bias, w2_bias,
                          activation, 1.702 if swiglu_alpha is None else swiglu_alpha,
                          7.0 if swiglu_limit is None else swiglu_limit, routed_scaling_factor, scoring_func,
                          routing_bias, expert_groups)
    if out is not None:
        return out
    return torch_moe.routed_moe(native.bf16_gemv, x, router_logits, w13, w2, top_k, renormalize, shared, shared_gate,
                                w13_bias, w2_bias, activation, swiglu_alpha, swiglu_limit, routed_scaling_factor,
                                scoring_func, routing_bias, expert_groups)


NATIVE = {name: FastPath("native", fn) for name, fn in
          (("rms_norm", rms_norm), ("rotary", rotary), ("act_and_mul", act_and_mul), ("kv_write", kv_write),
           ("attention", attention), ("linear", linear), ("moe", moe))}
QUANTIZED_LINEAR_KINDS = ("int4_group", "int8_group", "mxfp4")  # mxfp4: prepared as int8 groups
