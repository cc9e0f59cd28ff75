"""Dense decoders as a graph: Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2/3,
Gemma 2/3 (text), Phi-3/3.5/4-mini, Granite, OLMo 2 and GLM-4.

Differences between members are config flags (qkv bias, q/k norm, sliding
window per layer, tied embeddings, rope scaling and per-layer rope, norm
layout and offset, scaling multipliers, soft-caps, fused checkpoint
projections), read by `normalize_config`.
"""

from __future__ import annotations

from typing import Callable

from ..graph import Graph
from .config import ModelConfig, normalize_config

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "GraniteForCausalLM",
                 "Olmo2ForCausalLM", "SmolLM3ForCausalLM", "Glm4ForCausalLM")

# Checkpoint names of a layer's norms by `ModelConfig.norm_layout` and architecture:
# (before attention, after attention, before the MLP, after the MLP); None: no such norm.
NORM_NAMES = {
    "pre": ("input_layernorm", None, "post_attention_layernorm", None),
    "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"),
    "post": (None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
}
GLM4_NORM_NAMES = ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")


def build_llama(config: dict) -> Graph:
    cfg = normalize_config(config)
    if cfg.norm_layout == "post":
        return build_decoder(cfg, lambda g, cfg, i: dense_mlp(g, cfg, i, inp="residual"))
    return build_decoder(cfg, dense_mlp)


def norm_names(cfg: ModelConfig) -> tuple[str | None, ...]:
    return GLM4_NORM_NAMES if cfg.architecture == "Glm4ForCausalLM" else NORM_NAMES[cfg.norm_layout]


def _norm(g: Graph, cfg: ModelConfig, i: int, which: int, ins, outs) -> None:
    name = norm_names(cfg)[which]
    w = g.param(f"layers.{i}.{name}", (cfg.hidden_size,), f"model.layers.{i}.{name}.weight", offset=cfg.norm_offset)
    g.add("rms_norm", f"layers.{i}.{name}", ins, outs, {"weight": w}, layer=i, eps=cfg.rms_norm_eps)


def build_decoder(cfg: ModelConfig, feed_forward: Callable[[Graph, ModelConfig, int], None],
                  attention: Callable[[Graph, ModelConfig, int], None] | None = None) -> Graph:
    """Embedding, layers of attention then `feed_forward(g, cfg, layer)` (which
    writes ``hidden``), final norm and head: the skeleton the MoE architectures
    share with Llama.

    The residual stream is the pair (``hidden``, ``residual``) whose sum is the
    stream (``hidden`` alone before the first layer): a norm with two inputs adds
    them first, so the add costs no pass of its own. Norms after attention and
    the MLP ("sandwich", "post" layouts) normalise a block's output before it
    joins the stream; OLMo 2 ("post") feeds blocks the stream itself, summed by
    an ``add`` node. `attention` replaces `attention_block` (DeepSeek's latent attention)."""
    g = Graph(cfg.architecture, cfg, num_layers=cfg.num_layers)
    h, v = cfg.hidden_size, cfg.vocab_size
    table = g.param("embed_tokens", (v, h), "model.embed_tokens.weight", shard="vocab")
    g.add("embedding", "embed", ["input_ids"], ["hidden"], {"table": table})
    if cfg.embed_scale is not None:
        g.add("scale", "embed.scale", ["hidden"], ["hidden"], factor=cfg.embed_scale, rounded=cfg.embed_scale_rounded)
    post = norm_names(cfg)
    for i in range(cfg.num_layers):
        (attention or attention_block)(g, cfg, i)
        feed_forward(g, cfg, i)
        if cfg.residual_scale is not None:
            g.add("scale", f"layers.{i}.mlp.scale", ["hidden"], ["hidden"], layer=i, factor=cfg.residual_scale)
        if post[3] is not None:
            _norm(g, cfg, i, 3, ["hidden"], ["hidden"])
    norm = g.param("norm", (h,), "model.norm.weight", offset=cfg.norm_offset)
    g.add("rms_norm", "norm", ["hidden", "residual"], ["normed", "residual"], {"weight": norm}, eps=cfg.rms_norm_eps)
    head_source = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    head = g.param("lm_head", (v, h), head_source, shard="vocab")
    g.add("lm_head", "lm_head", ["normed", "sample_rows"], ["logits"], {"weight": head})
    if cfg.logit_scale is not None:
        g.add("scale", "lm_head.scale", ["logits"], ["logits"], factor=cfg.logit_scale)
    if cfg.final_soft_cap is not None:
        g.add("soft_cap", "lm_head.soft_cap", ["logits"], ["logits"], cap=float(cfg.final_soft_cap))
    return g


def attention_block(g: Graph, cfg: ModelConfig, i: int) -> None:
    """Layer i up to its feed-forward input: ``normed`` and ``residual``
    (with the "post" layout: ``residual`` alone, the stream)."""
    p, n = f"model.layers.{i}", f"layers.{i}"
    h, d = cfg.hidden_size, cfg.head_dim
    qkv_rows = (cfg.q_size, cfg.kv_size, cfg.kv_size)
    names = norm_names(cfg)

    # The first layer starts the residual stream; later ones add the previous
    # block's output to it in their first norm (or add node).
    ins = ["hidden"] if i == 0 else ["hidden", "residual"]
    if names[0] is not None:
        _norm(g, cfg, i, 0, ins, ["normed", "residual"])
        x = "normed"
    elif i == 0:
        x = "hidden"
    else:
        g.add("add", f"{n}.stream", ins, ["stream"], layer=i)
        x = "stream"

    qkv_source = f"{p}.self_attn.qkv_proj.weight" if cfg.fused_qkv else tuple(f"{p}.self_attn.{x}_proj.weight" for x in "qkv")
    attn = {
        "qkv_proj": g.param(f"{n}.qkv_proj", (sum(qkv_rows), h), qkv_source, shard="column", parts=qkv_rows),
        "o_proj": g.param(f"{n}.o_proj", (h, cfg.q_size), f"{p}.self_attn.o_proj.weight", shard="row"),
    }
    if cfg.qkv_bias:
        attn["qkv_bias"] = g.param(f"{n}.qkv_bias", (sum(qkv_rows),), tuple(f"{p}.self_attn.{x}_proj.bias" for x in "qkv"),
                                   shard="column", parts=qkv_rows)
    if cfg.o_bias:
        attn["o_bias"] = g.param(f"{n}.o_bias", (h,), f"{p}.self_attn.o_proj.bias")
    if cfg.attn_sinks:  # one per query head: split with the heads under TP
        attn["sinks"] = g.param(f"{n}.sinks", (cfg.num_heads,), f"{p}.self_attn.sinks")
    if cfg.qk_norm:
        qn, kn = (cfg.q_size, cfg.kv_size) if cfg.qk_norm_whole else (d, d)
        attn["q_norm"] = g.param(f"{n}.q_norm", (qn,), f"{p}.self_attn.q_norm.weight", offset=cfg.norm_offset)
        attn["k_norm"] = g.param(f"{n}.k_norm", (kn,), f"{p}.self_attn.k_norm.weight", offset=cfg.norm_offset)
    g.add("attention", f"{n}.self_attn", [x, "positions"], ["attn_out"], attn, layer=i,
          num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=d, rotary_dim=cfg.rotary_dim_for(i),
          neox_style=cfg.neox_style, scale=cfg.attn_scale if cfg.attn_scale is not None else d**-0.5,
          sliding_window=cfg.window_for(i), soft_cap=cfg.attn_soft_cap, eps=cfg.rms_norm_eps,
          rope=cfg.rope_for(i), qk_norm="whole" if cfg.qk_norm_whole else "head")

    out = "attn_out"
    if cfg.residual_scale is not None:
        g.add("scale", f"{n}.self_attn.scale", [out], [out], layer=i, factor=cfg.residual_scale)
    if names[1] is not None:
        _norm(g, cfg, i, 1, [out], ["attn_normed"])
        out = "attn_normed"
    if names[2] is not None:
        _norm(g, cfg, i, 2, [out, "residual"], ["normed", "residual"])
    else:  # "post": the MLP reads the stream
        g.add("add", f"{n}.attn_residual", [out, x], ["residual"], layer=i)


def dense_mlp(g: Graph, cfg: ModelConfig, i: int, inter: int | None = None, module: str = "mlp",
              out: str = "hidden", inp: str = "normed") -> None:
    """The gated MLP of layer i: checkpoint module ``mlp`` by default (an
    MoE's shared expert is another module of the same shape)."""
    p, n = f"model.layers.{i}.{module}", f"layers.{i}" + ("" if module == "mlp" else f".{module}")
    h, inter = cfg.hidden_size, inter or cfg.intermediate_size
    gate_up = f"{p}.gate_up_proj.weight" if cfg.fused_gate_up else (f"{p}.gate_proj.weight", f"{p}.up_proj.weight")
    mlp = {
        "gate_up_proj": g.param(f"{n}.gate_up_proj", (2 * inter, h), gate_up, shard="column", parts=(inter, inter)),
        "down_proj": g.param(f"{n}.down_proj", (h, inter), f"{p}.down_proj.weight", shard="row"),
    }
    if cfg.mlp_bias:
        mlp["gate_up_bias"] = g.param(f"{n}.gate_up_bias", (2 * inter,), (f"{p}.gate_proj.bias", f"{p}.up_proj.bias"),
                                      shard="column", parts=(inter, inter))
        mlp["down_bias"] = g.param(f"{n}.down_bias", (h,), f"{p}.down_proj.bias")
    g.add("mlp", f"layers.{i}.{module}", [inp], [out], mlp, layer=i, act=_act(cfg.hidden_act))


def _act(hidden_act: str) -> str:
    acts = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
    if hidden_act not in acts:
        raise ValueError(f"hidden_act {hidden_act!r} is not supported (supported: {', '.join(acts)})")
    return acts[hidden_act]
