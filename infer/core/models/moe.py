"""Mixture-of-Experts decoders as graphs: Mixtral, Qwen2-MoE, Qwen3-MoE.

Attention is the Llama family's; the feed-forward of a sparse layer is one
`moe` node: router logits from a `linear`, then the `moe` primitive (top-k
softmax gating, each expert on its own tokens, weighted combine). The three
differ only in what `MoESpec` records:

- Mixtral: top-k weights renormalised to sum to 1, every layer sparse.
- Qwen2-MoE: top-k weights as the softmax gives them (unless
  ``norm_topk_prob``), plus a shared expert, a plain SwiGLU MLP (its own
  `mlp` node) whose output the `moe` primitive adds, scaled by
  ``sigmoid(shared_expert_gate(x))``; layers in ``mlp_only_layers`` or off
  the ``decoder_sparse_step`` are dense.
- Qwen3-MoE: Qwen3's q/k norm, ``norm_topk_prob``, no shared expert.
- gpt-oss: a router with a bias, whose top-k logits' softmax (the top-k of
  the full softmax, renormalised) weighs experts with biases and a clamped
  SwiGLU (``swiglu_oai``); attention with sinks, biases, and windowed layers
  alternating with full ones (the attention side is `ModelConfig` flags).

Expert weights are read in transformers' fused layout
(``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]);
`core/loader/moe_layout.py` fuses the per-expert tensors checkpoints store.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..graph import Graph
from .config import ModelConfig, normalize_config
from .llama import build_decoder, dense_mlp

ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM")


@dataclass(frozen=True, slots=True)
class MoESpec:
    num_experts: int
    top_k: int
    renormalize: bool
    expert_intermediate_size: int
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_gate: bool = False
    sparse_layers: frozenset[int] = frozenset()
    router: str = "gate"  # the router's module name (gpt-oss: "router")
    router_bias: bool = False
    expert_bias: bool = False
    activation: str | None = None  # None: SwiGLU; "swiglu_oai": gpt-oss's clamped form
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None
    shared_module: str = "mlp.shared_expert"  # the shared expert's module (DeepSeek: "mlp.shared_experts")
    # DeepSeek's routing (see the `moe` primitive): None where the softmax's top-k is all
    routed_scaling_factor: float | None = None
    scoring_func: str | None = None
    routing_bias: str | None = None  # the router's module attribute holding the selection bias
    expert_groups: tuple | None = None  # (groups, groups kept, "max" | "top2")


def moe_spec(config: dict, num_layers: int) -> MoESpec:
    """The expert layout of an HF MoE config."""
    arch = (config.get("architectures") or [""])[0]
    # transformers 5 writes `num_local_experts` for Qwen3-MoE too; hub configs say `num_experts`.
    experts = config.get("num_experts", config.get("num_local_experts"))
    if experts is None or config.get("num_experts_per_tok") is None:
        raise ValueError(f"config.json of {arch} lacks num_experts (or num_local_experts) or num_experts_per_tok")
    experts, top_k = int(experts), int(config["num_experts_per_tok"])
    if arch == "MixtralForCausalLM":
        return MoESpec(experts, top_k, True, int(config["intermediate_size"]), sparse_layers=frozenset(range(num_layers)))
    if arch == "GptOssForCausalLM":
        return MoESpec(experts, top_k, True, int(config["intermediate_size"]), sparse_layers=frozenset(range(num_layers)),
                       router="router", router_bias=True, expert_bias=True, activation="swiglu_oai",
                       swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
                       swiglu_limit=float(config.get("swiglu_limit", 7.0)))
    if arch not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        raise ValueError(f"{arch!r} is not an MoE architecture infer knows (known: {', '.join(ARCHITECTURES)})")
    step = int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or ())
    # transformers' rule: a layer is sparse unless listed as MLP-only or off the sparse step.
    sparse = frozenset(i for i in range(num_layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
    shared = int(config.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
    return MoESpec(experts, top_k, bool(config.get("norm_topk_prob", False)),
                   int(config["moe_intermediate_size"]), shared, shared_gate=shared > 0, sparse_layers=sparse)


def moe_model_config(config: dict) -> ModelConfig:
    """The attention-side config: `normalize_config`, corrected where the MoE
    variants name things differently from their dense siblings."""
    cfg = normalize_config(config)
    arch = cfg.architecture
    if arch == "Qwen2MoeForCausalLM":
        # Qwen2-MoE has its own `qkv_bias` flag, and marks its windowed layers in layer_types.
        cfg = dataclasses.replace(cfg, qkv_bias=bool(config.get("qkv_bias", True)), o_bias=False)
        types = config.get("layer_types")
        if cfg.sliding_window is not None and types:
            cfg = dataclasses.replace(cfg, sliding_window_layers=tuple(
                i for i, t in enumerate(types) if t == "sliding_attention"))
    elif arch == "Qwen3MoeForCausalLM":
        bias = bool(config.get("attention_bias", False))
        # Every Qwen3-MoE layer uses the window when it is enabled.
        cfg = dataclasses.replace(cfg, qk_norm=True, qkv_bias=bias, o_bias=bias, sliding_window_layers=None)
    return cfg


def build_moe(config: dict) -> Graph:
    cfg = moe_model_config(config)
    spec = moe_spec(config, cfg.num_layers)

    def feed_forward(g: Graph, c: ModelConfig, i: int) -> None:
        if i in spec.sparse_layers:
            sparse_block(g, c, spec, i)
        else:
            dense_mlp(g, c, i)

    return build_decoder(cfg, feed_forward)


def sparse_block(g: Graph, cfg: ModelConfig, spec: MoESpec, i: int) -> None:
    """Layer i's experts (and shared expert) from ``normed`` into ``hidden``."""
    p, n = f"model.layers.{i}.mlp", f"layers.{i}.mlp"
    h, e, inter = cfg.hidden_size, spec.num_experts, spec.expert_intermediate_size
    params = {
        "router": g.param(f"{n}.router", (e, h), f"{p}.{spec.router}.weight"),
        # Tensor parallel inside experts (see core/parallel.py): each expert's gate and up rows split like an MLP's.
        "w13": g.param(f"{n}.w13", (e, 2 * inter, h), f"{p}.experts.gate_up_proj", shard="column", parts=(inter, inter)),
        "w2": g.param(f"{n}.w2", (e, h, inter), f"{p}.experts.down_proj", shard="row"),
    }
    if spec.router_bias:
        params["router_bias"] = g.param(f"{n}.router_bias", (e,), f"{p}.{spec.router}.bias")
    if spec.expert_bias:
        params["w13_bias"] = g.param(f"{n}.w13_bias", (e, 2 * inter), f"{p}.experts.gate_up_proj_bias", shard="column",
                                     parts=(inter, inter))
        params["w2_bias"] = g.param(f"{n}.w2_bias", (e, h), f"{p}.experts.down_proj_bias")
    inputs = ["normed"]
    if spec.shared_intermediate_size:
        dense_mlp(g, cfg, i, spec.shared_intermediate_size, module=spec.shared_module, out="shared")
        inputs.append("shared")
        if spec.shared_gate:
            params["shared_gate"] = g.param(f"{n}.shared_gate", (1, h), f"{p}.shared_expert_gate.weight")
    extra = {}
    if spec.activation is not None:
        extra = dict(activation=spec.activation, swiglu_alpha=spec.swiglu_alpha, swiglu_limit=spec.swiglu_limit)
    if spec.routing_bias is not None:
        params["routing_bias"] = g.param(f"{n}.routing_bias", (e,), f"{p}.{spec.router}.{spec.routing_bias}")
    for name in ("routed_scaling_factor", "scoring_func", "expert_groups"):
        if getattr(spec, name) is not None:
            extra[name] = getattr(spec, name)
    g.add("moe", n, inputs, ["hidden"], params, layer=i, top_k=spec.top_k, renormalize=spec.renormalize, **extra)
