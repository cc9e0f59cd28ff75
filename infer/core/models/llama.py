"""The Llama family as a graph: Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2.

Differences between members are config flags (qkv bias, q/k norm, sliding
window, tied embeddings, rope scaling), read by `normalize_config`.
"""

from __future__ import annotations

from typing import Callable

from ..graph import Graph
from .config import ModelConfig, normalize_config

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def build_llama(config: dict) -> Graph:
    return build_decoder(normalize_config(config), dense_mlp)


def build_decoder(cfg: ModelConfig, feed_forward: Callable[[Graph, ModelConfig, int], None]) -> Graph:
    """Embedding, layers of attention then `feed_forward(g, cfg, layer)`, final
    norm and head: the skeleton the MoE architectures share with Llama."""
    g = Graph(cfg.architecture, cfg, num_layers=cfg.num_layers)
    h, v = cfg.hidden_size, cfg.vocab_size
    table = g.param("embed_tokens", (v, h), "model.embed_tokens.weight", shard="vocab")
    g.add("embedding", "embed", ["input_ids"], ["hidden"], {"table": table})
    for i in range(cfg.num_layers):
        attention_block(g, cfg, i)
        feed_forward(g, cfg, i)
    norm = g.param("norm", (h,), "model.norm.weight")
    g.add("rms_norm", "norm", ["hidden", "residual"], ["normed", "residual"], {"weight": norm}, eps=cfg.rms_norm_eps)
    head_source = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    head = g.param("lm_head", (v, h), head_source, shard="vocab")
    g.add("lm_head", "lm_head", ["normed", "sample_rows"], ["logits"], {"weight": head})
    return g


def attention_block(g: Graph, cfg: ModelConfig, i: int) -> None:
    """Layer i up to its feed-forward input: ``normed`` (and ``residual``)."""
    p, n = f"model.layers.{i}", f"layers.{i}"
    h, d = cfg.hidden_size, cfg.head_dim
    qkv_rows = (cfg.q_size, cfg.kv_size, cfg.kv_size)

    ln1 = g.param(f"{n}.input_layernorm", (h,), f"{p}.input_layernorm.weight")
    # The first layer starts the residual stream; later ones fuse the add of
    # the previous MLP output into their norm.
    ins = ["hidden"] if i == 0 else ["hidden", "residual"]
    g.add("rms_norm", f"{n}.input_layernorm", ins, ["normed", "residual"], {"weight": ln1}, layer=i, eps=cfg.rms_norm_eps)

    attn = {
        "qkv_proj": g.param(f"{n}.qkv_proj", (sum(qkv_rows), h), tuple(f"{p}.self_attn.{x}_proj.weight" for x in "qkv"),
                            shard="column", parts=qkv_rows),
        "o_proj": g.param(f"{n}.o_proj", (h, cfg.q_size), f"{p}.self_attn.o_proj.weight", shard="row"),
    }
    if cfg.qkv_bias:
        attn["qkv_bias"] = g.param(f"{n}.qkv_bias", (sum(qkv_rows),), tuple(f"{p}.self_attn.{x}_proj.bias" for x in "qkv"),
                                   shard="column", parts=qkv_rows)
    if cfg.o_bias:
        attn["o_bias"] = g.param(f"{n}.o_bias", (h,), f"{p}.self_attn.o_proj.bias")
    if cfg.qk_norm:
        attn["q_norm"] = g.param(f"{n}.q_norm", (d,), f"{p}.self_attn.q_norm.weight")
        attn["k_norm"] = g.param(f"{n}.k_norm", (d,), f"{p}.self_attn.k_norm.weight")
    g.add("attention", f"{n}.self_attn", ["normed", "positions"], ["attn_out"], attn, layer=i,
          num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=d, rotary_dim=cfg.rotary_dim,
          neox_style=True, scale=d**-0.5, sliding_window=cfg.window_for(i), soft_cap=None, eps=cfg.rms_norm_eps)

    ln2 = g.param(f"{n}.post_attention_layernorm", (h,), f"{p}.post_attention_layernorm.weight")
    g.add("rms_norm", f"{n}.post_attention_layernorm", ["attn_out", "residual"], ["normed", "residual"],
          {"weight": ln2}, layer=i, eps=cfg.rms_norm_eps)


def dense_mlp(g: Graph, cfg: ModelConfig, i: int, inter: int | None = None, module: str = "mlp",
              out: str = "hidden") -> None:
    """The SwiGLU MLP of layer i: checkpoint module ``mlp`` by default (an
    MoE's shared expert is another module of the same shape)."""
    p, n = f"model.layers.{i}.{module}", f"layers.{i}" + ("" if module == "mlp" else f".{module}")
    h, inter = cfg.hidden_size, inter or cfg.intermediate_size
    mlp = {
        "gate_up_proj": g.param(f"{n}.gate_up_proj", (2 * inter, h), (f"{p}.gate_proj.weight", f"{p}.up_proj.weight"),
                                shard="column", parts=(inter, inter)),
        "down_proj": g.param(f"{n}.down_proj", (h, inter), f"{p}.down_proj.weight", shard="row"),
    }
    if cfg.mlp_bias:
        mlp["gate_up_bias"] = g.param(f"{n}.gate_up_bias", (2 * inter,), (f"{p}.gate_proj.bias", f"{p}.up_proj.bias"),
                                      shard="column", parts=(inter, inter))
        mlp["down_bias"] = g.param(f"{n}.down_bias", (h,), f"{p}.down_proj.bias")
    g.add("mlp", f"layers.{i}.{module}", ["normed"], [out], mlp, layer=i, act=_act(cfg.hidden_act))


def _act(hidden_act: str) -> str:
    acts = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
    if hidden_act not in acts:
        raise ValueError(f"hidden_act {hidden_act!r} is not supported (supported: {', '.join(acts)})")
    return acts[hidden_act]
