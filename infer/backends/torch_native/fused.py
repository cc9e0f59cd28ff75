"""The attention and MLP nodes of a decode step as one native call each.

A decode step of SmolLM2 runs ~15 primitives and views per layer, each a
Python call of a few microseconds around a kernel of a few more; for int4
weights (the GGUF/AWQ/GPTQ kinds kept quantized) the native library runs the
attention block (qkv GEMV, rotary, kv_write, attention, o GEMV) and the MLP
(gate_up GEMV, SiLU-and-mul, down GEMV) whole, through the same kernels and
roundings as the primitives. Anything else (prefill-sized batches, other weight
kinds, fp8 caches, q/k norms, soft-caps) is declined step by step, and the
runner runs the node's primitives instead.
"""

from __future__ import annotations

from ...primitives.types import Int4GroupWeight
from .native import ops as native
from .quant_linear import Int4Prepared


def _int4(handle) -> native.Int4Native | None:
    """The native GEMV's view of an int4 weight without bias, or None."""
    if isinstance(handle, Int4GroupWeight) and handle.bias is None and isinstance(handle.prepared, Int4Prepared):
        return handle.prepared.native
    return None


def attention(x, positions, *, params, attrs, env, runner, layer):
    qkv, o = _int4(params.get("qkv_proj")), _int4(params.get("o_proj"))
    if qkv is None or o is None or "q_norm" in params or attrs["soft_cap"] is not None or runner.kv_cache_dtype == "fp8":
        return NotImplemented
    meta = env["meta"]
    plan = meta.backend_data
    work = getattr(plan, "row_keys", -1)
    if work < 0:
        return NotImplemented
    heads = (attrs["num_heads"], attrs["num_kv_heads"], attrs["head_dim"])
    out = native.attention_block(x, positions, qkv, o, runner.rope_cache(attrs["rotary_dim"]), attrs["neox_style"],
                                 runner.kv_caches[layer], meta, heads, attrs["scale"], attrs["sliding_window"],
                                 work * heads[0] * heads[2])
    return NotImplemented if out is None else out


def mlp(x, *, params, attrs, env, runner, layer):
    gate_up, down = _int4(params.get("gate_up_proj")), _int4(params.get("down_proj"))
    if gate_up is None or down is None or attrs["act"] != "silu":
        return NotImplemented
    out = native.mlp(x, gate_up, down)
    return NotImplemented if out is None else out
