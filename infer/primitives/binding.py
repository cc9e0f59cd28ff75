"""How each primitive is called: one table read by the model runner and the conformance harness.

`SIGNATURES` lists every argument of every primitive in order, with where the
caller finds it:

  value   a tensor computed in this step (an activation, the positions, logits)
  weight  a model parameter (a linear's prepared `WeightHandle`, a norm's weight)
  attr    a constant of the call (eps, scale, activation kind, top_k, ...)
  layer   the layer's state (`LayerContext`: KV cache, rope table, fp8 scales)
  step    per-step data (`AttentionMetadata`, its slot_mapping, `SamplingTensors`)

`dispatch_key` derives, from the same facts, the static properties the
resolver asks a backend about (``supports(primitive, **key)``). Both callers
use these two, so the runtime and the tests cannot call a primitive two ways.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .types import WeightHandle

SOURCES = ("value", "weight", "attr", "layer", "step")


@dataclass(frozen=True, slots=True)
class Arg:
    name: str
    source: str
    optional: bool = False  # has a default (None) in the contract's signature


def _sig(*args: str) -> tuple[Arg, ...]:
    """'name:source', a trailing '?' marks an optional argument."""
    out = []
    for a in args:
        name, source = a.rstrip("?").split(":")
        assert source in SOURCES, a
        out.append(Arg(name, source, a.endswith("?")))
    return tuple(out)


SIGNATURES: dict[str, tuple[Arg, ...]] = {
    "embedding": _sig("ids:value", "table:weight"),
    "rms_norm": _sig("x:value", "weight:weight", "eps:attr", "residual:value?"),
    "layer_norm": _sig("x:value", "weight:weight", "bias:weight?", "eps:attr", "residual:value?"),
    "linear": _sig("x:value", "weight:weight"),
    "rotary": _sig("q:value", "k:value", "positions:value", "cos_sin_cache:layer", "neox_style:attr"),
    "act_and_mul": _sig("x:value", "kind:attr"),
    "activation": _sig("x:value", "kind:attr"),
    "encoder_attention": _sig("q:value", "k:value", "v:value", "query_start_loc:step", "scale:attr"),
    "pool": _sig("x:value", "query_start_loc:step", "method:attr"),
    "kv_write": _sig("k:value", "v:value", "kv_cache:layer", "slot_mapping:step", "scales:layer?"),
    "attention": _sig("q:value", "kv_cache:layer", "meta:step", "scale:attr", "sliding_window:attr?",
                      "soft_cap:attr?", "kv_scales:layer?", "sinks:weight?"),
    "mla_kv_write": _sig("c_kv:value", "k_pe:value", "kv_cache:layer", "slot_mapping:step"),
    "mla_attention": _sig("q_nope:value", "q_pe:value", "kv_cache:layer", "meta:step", "kv_b_proj:weight",
                          "scale:attr", "v_head_dim:attr"),
    "moe": _sig("x:value", "router_logits:value", "w13:weight", "w2:weight", "top_k:attr", "renormalize:attr",
                "shared:value?", "shared_gate:value?", "w13_bias:weight?", "w2_bias:weight?", "activation:attr?",
                "swiglu_alpha:attr?", "swiglu_limit:attr?", "routed_scaling_factor:attr?", "scoring_func:attr?",
                "routing_bias:weight?", "expert_groups:attr?"),
    "lora": _sig("x:value", "y:value", "lora_a:weight", "lora_b:weight", "lora_indices:step", "output_slices:attr?"),
    "sample": _sig("logits:value", "params:step"),
    "all_reduce": _sig("x:value", "group:attr?"),
    "all_gather": _sig("x:value", "dim:attr?", "group:attr?"),
}


def arguments(primitive: str, named: Mapping[str, Any]) -> list[Any]:
    """The positional arguments of a call from arguments by name.

    A missing optional argument is None, and trailing Nones are left off, so
    a backend sees exactly the contract's defaults (and a contract-v1 backend
    whose attention has no ``kv_scales`` is not given one it would not take).
    """
    sig = SIGNATURES[primitive]
    unknown = set(named) - {a.name for a in sig}
    if unknown:
        raise TypeError(f"{primitive} takes no argument(s) {sorted(unknown)}")
    args = []
    for a in sig:
        if a.name not in named and not a.optional:
            raise TypeError(f"{primitive} needs argument '{a.name}' ({a.source})")
        args.append(named.get(a.name))
    while args and args[-1] is None and sig[len(args) - 1].optional:
        args.pop()
    return args


def weight_key(weight: WeightHandle) -> dict[str, Any]:
    """What `linear`'s dispatch key says about its weight: the kind, and the activation
    quantization it asks for (`Int8GroupWeight.act_quant`) when it asks for one."""
    key: dict[str, Any] = {"weight_kind": weight.kind}
    act_quant = getattr(weight, "act_quant", None)
    if act_quant is not None:
        key["act_quant"] = act_quant
    return key


def dispatch_key(primitive: str, *, dtype: str, named: Mapping[str, Any] = {}, kv_cache_dtype: str = "auto",
                 head_dim: int | None = None) -> dict[str, Any]:
    """The static properties `Backend.supports` is asked about for one call site.

    `named` holds the call's constant arguments by name (weights and attrs; a
    value argument only needs to be present, as for moe's ``shared``).
    """
    key: dict[str, Any] = {"dtype": dtype}
    if primitive == "linear":
        key.update(weight_key(named["weight"]))
    elif primitive == "embedding" and isinstance(named.get("table"), WeightHandle):
        key["weight_kind"] = named["table"].kind  # a gathered row is not a linear's input: no act_quant
    elif primitive == "moe":
        if isinstance(named.get("w13"), WeightHandle):
            key["expert_weight_kind"] = named["w13"].kind
        if named.get("shared") is not None:
            key["shared_expert"] = True
        if named.get("w13_bias") is not None or named.get("w2_bias") is not None:
            key["expert_bias"] = True
        if named.get("activation") not in (None, "silu"):
            key["moe_activation"] = named["activation"]
        if any(named.get(a) is not None for a in ("routed_scaling_factor", "scoring_func", "routing_bias",
                                                   "expert_groups")):
            key["routing"] = True  # DeepSeek's: sigmoid scores, a selection bias, expert groups, a scale
    elif primitive in ("mla_kv_write", "mla_attention"):
        key["head_dim"] = head_dim
    elif primitive == "attention":
        key.update(head_dim=head_dim, sliding_window=named.get("sliding_window") is not None,
                   soft_cap=named.get("soft_cap") is not None)
        if named.get("sinks") is not None:
            key["sinks"] = True
    if primitive in ("kv_write", "attention") and kv_cache_dtype != "auto":
        key["kv_cache_dtype"] = kv_cache_dtype
    return key


def value_args(primitive: str) -> Sequence[str]:
    """Names of the arguments computed in the step (the graph's inputs of a call)."""
    return [a.name for a in SIGNATURES[primitive] if a.source == "value"]
