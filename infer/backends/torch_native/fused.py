"""The attention and MLP nodes of a decode step as one native call each.

A decode step of SmolLM2 runs ~15 primitives and views per layer, each a
Python call of a few microseconds around a kernel of a few more; for int4 and
int8 weights (the GGUF/AWQ/GPTQ kinds kept quantized, K-quant mixes of the two
in one layer included), and for dense bf16 weights
with bf16 activations on a CPU with AVX512-BF16, the native library runs the
attention block (qkv GEMV and bias, q/k norms, rotary (or none), kv_write, attention with its
sinks, o GEMV and bias) and the MLP
(gate_up GEMV, SiLU- or GELU-tanh-and-mul, down GEMV) whole, through the same kernels and
roundings as the primitives. Anything else (prefill-sized batches, other weight
kinds, fp8 caches, MLP biases) is declined step by step, and the
runner runs the node's primitives instead.
"""

from __future__ import annotations

import torch

from ...primitives.context import LayerContext
from ...primitives.types import AttentionMetadata, DenseWeight, Int4GroupWeight, Int8GroupWeight
from .attention import LazyPlan
from .native import ops as native
from .quant_linear import Int4Prepared, native_int4_takes, unwrap


def _gemv(handle, bias: bool = False):
    """The native GEMV's view of an int4, int8 or dense bf16 weight (without bias unless `bias`), or None."""
    handle = None if handle is None else unwrap(handle)
    if handle is None or (handle.bias is not None and not bias):
        return None
    if isinstance(handle, Int4GroupWeight) and isinstance(handle.prepared, Int4Prepared):
        return handle.prepared.native
    if isinstance(handle, Int8GroupWeight) and isinstance(handle.prepared, native.Int8Native):
        return handle.prepared
    if isinstance(handle, DenseWeight):
        return native.dense_prepare(handle.weight)
    return None


def _bias(handle, dtype):
    return None if handle.bias is None else handle.bias.to(dtype).contiguous()


def _takes(x, packed, *weights) -> bool:
    """This step's rows go to the packed layer: the int4 kernels' measured limits (in
    float32 fewer where dense copies can take the batch), the dense bf16 GEMV's."""
    if not all(isinstance(w, native.Int4Native) for w in packed.keep[:2]):  # dense bf16, int8, or a mix
        return x.shape[0] <= packed.max_rows
    return native_int4_takes(x, *weights)


# Key under which a fused call keeps, in the `params` dict the runner gives it, its layer's
# packed arguments (checked once; the dict lives as long as the bound call).
_MEMO = "native packed"


def _layer_memo(params: dict, build, *keys):
    """params' packed layer arguments, built (or found unusable: False) on the first call, and
    rebuilt when one of `keys` (a KV cache) is no longer the one they were packed for."""
    memo = params.get(_MEMO)
    if memo is None or memo[0] != tuple(map(id, keys)):
        memo = params[_MEMO] = (tuple(map(id, keys)), build() or False, keys)
    return memo[1]


def attention(x, positions, *, params, attrs, ctx: LayerContext, meta: AttentionMetadata):
    plan = meta.plan
    if not isinstance(plan, LazyPlan):  # another backend serves attention (this runs as a fallback's node)
        return NotImplemented

    def build():
        qkv, o = _gemv(params.get("qkv_proj"), bias=True), _gemv(params.get("o_proj"), bias=True)
        if qkv is None or o is None or ctx.kv_cache_dtype == "fp8":
            return None
        heads = (attrs["num_heads"], attrs["num_kv_heads"], attrs["head_dim"])
        norms = None
        if "q_norm" in params:
            norms = (params["q_norm"], params["k_norm"], attrs.get("qk_norm") == "whole", attrs["eps"])
        dtype = ctx.kv_cache.dtype
        biases = (_bias(params["qkv_proj"], dtype), _bias(params["o_proj"], dtype))
        sinks = params["sinks"].float().contiguous() if "sinks" in params else None
        cos_sin = ctx.cos_sin_cache(attrs["rotary_dim"]) if attrs["rotary_dim"] else None
        return native.attention_block_layer(qkv, o, cos_sin, attrs["neox_style"], ctx.kv_cache, heads, attrs["scale"],
                                            attrs["sliding_window"], attrs["soft_cap"], norms, biases, sinks)

    packed = _layer_memo(params, build, ctx.kv_cache)
    if packed is False or not _takes(x, packed, params["qkv_proj"], params["o_proj"]):
        return NotImplemented
    if plan.native is None:  # the step's side, packed by the first layer
        plan.native = native.attention_block_step(meta) or False
    if plan.native is False:
        return NotImplemented
    work = plan.row_keys * attrs["num_heads"] * attrs["head_dim"]
    out = native.attention_block(x, positions, packed, plan.native, work, plan.request_keys)
    return NotImplemented if out is None else out


def mlp(x, *, params, attrs, ctx: LayerContext, meta: AttentionMetadata):
    def build():
        gate_up, down = _gemv(params.get("gate_up_proj")), _gemv(params.get("down_proj"))
        if gate_up is None or down is None:
            return None
        return native.mlp_layer(gate_up, down, x.dtype, attrs["act"])

    packed = _layer_memo(params, build)
    if packed is False or not _takes(x, packed, params["gate_up_proj"], params["down_proj"]):
        return NotImplemented
    out = native.mlp(x, packed)
    return NotImplemented if out is None else out


def mla_attention(x, positions, *, params, attrs, ctx: LayerContext, meta: AttentionMetadata):
    """DeepSeek's latent attention node (bf16 weights and cache, AVX512-BF16) in one native call."""
    plan = meta.plan
    if not isinstance(plan, LazyPlan) or x.dtype != torch.bfloat16:
        return NotImplemented

    def build():
        lora = "q_a_kv_a_proj" in params
        down = _gemv(params["q_a_kv_a_proj" if lora else "kv_a_proj"])
        up, o = _gemv(params["q_b_proj" if lora else "q_proj"]), _gemv(params["o_proj"])
        if down is None or up is None or o is None or ctx.kv_cache_dtype == "fp8":
            return None
        return native.mla_block_layer(down, up, o, params.get("q_a_norm"), params["kv_a_norm"], params["kv_b_proj"],
                                      ctx.cos_sin_cache(attrs["rotary_dim"]), attrs["neox_style"], ctx.kv_cache,
                                      attrs, x.dtype)

    packed = _layer_memo(params, build, ctx.kv_cache)
    if packed is False or not 0 < x.shape[0] <= packed.max_rows:
        return NotImplemented
    if plan.native is None:  # the step's side, packed by the first layer
        plan.native = native.attention_block_step(meta) or False
    if plan.native is False:
        return NotImplemented
    out = native.mla_block(x, positions, packed, plan.native, plan.row_keys)
    return NotImplemented if out is None else out
