"""The attention and MLP nodes of a decode step as one native call each.

A decode step of SmolLM2 runs ~15 primitives and views per layer, each a
Python call of a few microseconds around a kernel of a few more; for int4
weights (the GGUF/AWQ/GPTQ kinds kept quantized), and for dense bf16 weights
with bf16 activations on a CPU with AVX512-BF16, the native library runs the
attention block (qkv GEMV, q/k norms, rotary, kv_write, attention, o GEMV) and the MLP
(gate_up GEMV, SiLU- or GELU-tanh-and-mul, down GEMV) whole, through the same kernels and
roundings as the primitives. Anything else (prefill-sized batches, other weight
kinds, fp8 caches, layers without rope, attention sinks) is declined step by step, and the
runner runs the node's primitives instead.
"""

from __future__ import annotations

from ...primitives.context import LayerContext
from ...primitives.types import AttentionMetadata, DenseWeight, Int4GroupWeight
from .attention import LazyPlan
from .native import ops as native
from .quant_linear import Int4Prepared, native_int4_takes


def _gemv(handle):
    """The native GEMV's view of an int4 or dense bf16 weight without bias, or None."""
    if isinstance(handle, Int4GroupWeight) and handle.bias is None and isinstance(handle.prepared, Int4Prepared):
        return handle.prepared.native
    if isinstance(handle, DenseWeight) and handle.bias is None:
        return native.dense_prepare(handle.weight)
    return None


def _takes(x, packed, *weights) -> bool:
    """This step's rows go to the packed layer: the int4 kernels' measured limits (in
    float32 fewer where dense copies can take the batch), the dense bf16 GEMV's."""
    if isinstance(packed.keep[0], native.DenseNative):
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
        qkv, o = _gemv(params.get("qkv_proj")), _gemv(params.get("o_proj"))
        if qkv is None or o is None or not attrs["rotary_dim"] or ctx.kv_cache_dtype == "fp8" or "sinks" in params:
            return None
        heads = (attrs["num_heads"], attrs["num_kv_heads"], attrs["head_dim"])
        norms = None
        if "q_norm" in params:
            norms = (params["q_norm"], params["k_norm"], attrs.get("qk_norm") == "whole", attrs["eps"])
        return native.attention_block_layer(qkv, o, ctx.cos_sin_cache(attrs["rotary_dim"]), attrs["neox_style"],
                                            ctx.kv_cache, heads, attrs["scale"], attrs["sliding_window"],
                                            attrs["soft_cap"], norms)

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
