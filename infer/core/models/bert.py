"""Encoders as a graph: BERT and XLM-RoBERTa (`BertModel`, `XLMRobertaModel`) and
their sequence classifiers (cross-encoder rerankers).

A post-LayerNorm encoder: word + absolute position (+ token type) embeddings and a
LayerNorm, then per layer bidirectional attention (`encoder_attention`, no KV
cache), residual add + LayerNorm, an ungated GELU MLP (`ffn`), residual add +
LayerNorm. The pooling head (`models/pooling.py`) reads ``hidden``.

XLM-RoBERTa numbers positions from ``pad_token_id + 1`` (transformers'
`create_position_ids_from_input_ids`): its position table is read from that row
on, so the core's positions 0..L-1 index it directly.
"""

from __future__ import annotations

from ..graph import Graph
from .config import ModelConfig

ENCODER_ARCHITECTURES = ("BertModel", "XLMRobertaModel", "BertForSequenceClassification",
                         "XLMRobertaForSequenceClassification")
_ACTS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu", "silu": "silu"}


def encoder_config(config: dict) -> ModelConfig:
    arch = (config.get("architectures") or ["BertModel"])[0]
    kind = config.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(f"{arch}: position_embedding_type {kind!r} is not supported (only 'absolute')")
    act = config.get("hidden_act", "gelu")
    if act not in _ACTS:
        raise ValueError(f"{arch}: hidden_act {act!r} is not supported (supported: {', '.join(_ACTS)})")
    h, heads = config["hidden_size"], config["num_attention_heads"]
    positions = config["max_position_embeddings"] - position_offset(config)
    return ModelConfig(architecture=arch, hidden_size=h, num_layers=config["num_hidden_layers"], num_heads=heads,
                       num_kv_heads=heads, head_dim=h // heads, intermediate_size=config["intermediate_size"],
                       vocab_size=config["vocab_size"], rms_norm_eps=config.get("layer_norm_eps", 1e-12),
                       max_position_embeddings=positions, rotary_dim=0, rope={}, hidden_act=_ACTS[act], raw=config)


def position_offset(config: dict) -> int:
    """The first row of the position table the first token uses (XLM-R: pad + 1)."""
    roberta = config.get("model_type") in ("xlm-roberta", "roberta", "camembert")
    return config.get("pad_token_id", 1) + 1 if roberta else 0


def checkpoint_prefix(arch: str) -> str:
    """Where a classifier's transformers class keeps the encoder (a bare encoder: at the root)."""
    if arch.endswith("ForSequenceClassification"):
        return "roberta." if arch.startswith("XLMRoberta") else "bert."
    return ""


def build_encoder(config: dict) -> tuple[Graph, ModelConfig]:
    """The encoder up to its last hidden state ``hidden`` [T, H]."""
    cfg = encoder_config(config)
    g = Graph(cfg.architecture, cfg, num_layers=cfg.num_layers)
    p = checkpoint_prefix(cfg.architecture)
    h, eps = cfg.hidden_size, cfg.rms_norm_eps
    emb = f"{p}embeddings"
    word = g.param("word_embeddings", (cfg.vocab_size, h), f"{emb}.word_embeddings.weight")
    g.add("embedding", "embed", ["input_ids"], ["hidden"], {"table": word})
    off, n = position_offset(config), cfg.max_position_embeddings
    pos = g.param("position_embeddings", (n, h), f"{emb}.position_embeddings.weight",
                  slices=((0, ((off, off + n),)),) if off else ())
    g.add("embedding", "embed.positions", ["positions"], ["position_embeds"], {"table": pos})
    g.add("add", "embed.add_positions", ["hidden", "position_embeds"], ["hidden"])
    types = config.get("type_vocab_size", 0)
    if types:
        table = g.param("token_type_embeddings", (types, h), f"{emb}.token_type_embeddings.weight")
        g.add("embedding", "embed.token_types", ["token_type_ids"], ["type_embeds"], {"table": table})
        g.add("add", "embed.add_token_types", ["hidden", "type_embeds"], ["hidden"])
    layer_norm_node(g, "embed.norm", f"{emb}.LayerNorm", h, ["hidden"], ["hidden"], eps)
    for i in range(cfg.num_layers):
        _encoder_layer(g, cfg, i, f"{p}encoder.layer.{i}")
    return g, cfg


def layer_norm_node(g: Graph, name: str, source: str, h: int, ins, outs, eps: float, layer: int | None = None) -> None:
    w = g.param(f"{name}.weight", (h,), f"{source}.weight")
    b = g.param(f"{name}.bias", (h,), f"{source}.bias")
    g.add("layer_norm", name, ins, outs, {"weight": w, "bias": b}, layer=layer, eps=eps)


def _encoder_layer(g: Graph, cfg: ModelConfig, i: int, src: str) -> None:
    h, n, d, eps = cfg.hidden_size, f"layers.{i}", cfg.head_dim, cfg.rms_norm_eps
    rows = (h, h, h)
    attn = {
        "qkv_proj": g.param(f"{n}.qkv_proj", (3 * h, h), tuple(f"{src}.attention.self.{x}.weight"
                                                              for x in ("query", "key", "value")), parts=rows),
        "qkv_bias": g.param(f"{n}.qkv_bias", (3 * h,), tuple(f"{src}.attention.self.{x}.bias"
                                                            for x in ("query", "key", "value")), parts=rows),
        "o_proj": g.param(f"{n}.o_proj", (h, h), f"{src}.attention.output.dense.weight"),
        "o_bias": g.param(f"{n}.o_bias", (h,), f"{src}.attention.output.dense.bias"),
    }
    g.add("encoder_attention", f"{n}.attention", ["hidden"], ["attn_out"], attn, layer=i, num_heads=cfg.num_heads,
          num_kv_heads=cfg.num_kv_heads, head_dim=d, scale=d**-0.5)
    # Post-LN: the sum is normalised and becomes the stream (the unnormalised sum is dropped).
    layer_norm_node(g, f"{n}.attention.norm", f"{src}.attention.output.LayerNorm", h, ["attn_out", "hidden"],
                ["hidden", f"{n}.attention.sum"], eps, i)
    inter = cfg.intermediate_size
    ffn = {
        "up_proj": g.param(f"{n}.up_proj", (inter, h), f"{src}.intermediate.dense.weight"),
        "up_bias": g.param(f"{n}.up_bias", (inter,), f"{src}.intermediate.dense.bias"),
        "down_proj": g.param(f"{n}.down_proj", (h, inter), f"{src}.output.dense.weight"),
        "down_bias": g.param(f"{n}.down_bias", (h,), f"{src}.output.dense.bias"),
    }
    g.add("ffn", f"{n}.ffn", ["hidden"], ["ffn_out"], ffn, layer=i, act=cfg.hidden_act)
    layer_norm_node(g, f"{n}.ffn.norm", f"{src}.output.LayerNorm", h, ["ffn_out", "hidden"], ["hidden", f"{n}.ffn.sum"],
                eps, i)
