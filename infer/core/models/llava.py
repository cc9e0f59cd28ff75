"""LLaVA (`LlavaForConditionalGeneration`): a CLIP or SigLIP vision tower, a two-layer
projector, and a decoder of the Llama family whose image-token rows take the
projected image features.

The vision tower is a graph of the same primitives as the language model:

- the patch embedding (a convolution whose stride is its kernel) is a `linear`
  over the image's patches, unfolded on the host into rows of C*P*P pixels;
- CLIP's class token is an extra row per image whose pixels are zero (the
  patch linear has no bias, so it gives zero) and whose class-table row is the
  learned class embedding; patch rows read the table's zero row. Absolute
  position embeddings are an `embedding` over each row's place in its image;
- each layer is pre-LayerNorm: `layer_norm`, bidirectional `encoder_attention`
  within each image (block-diagonal over the flattened batch of images), the
  residual-fused `layer_norm`, an ungated `ffn` (CLIP's quick GELU, SigLIP's
  tanh GELU), then the residual add;
- the features are the hidden states after `vision_feature_layer` layers
  (transformers' ``hidden_states[vision_feature_layer]``: no post-LayerNorm),
  without the class row under the "default" select strategy (a ``rows`` gather),
  then the projector, an `ffn` of its own.

The language model reads ``mm_rows``/``mm_embeds`` (`merge_rows`): the batch
rows of image placeholder tokens and the features that replace their token
embeddings, given per step by the engine's encoder (`core/multimodal.py`).
"""

from __future__ import annotations

from typing import Iterable

from ..graph import Graph
from .bert import layer_norm_node
from .config import ModelConfig
from .llama import build_llama

VLM_ARCHITECTURES = ("LlavaForConditionalGeneration",)

# The causal LM class of each text model_type a LLaVA checkpoint names (all of the Llama family's builder).
TEXT_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "granite": "GraniteForCausalLM"}
_VISION_ACTS = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
# Canonical checkpoint prefixes (transformers 4 LLaVA layout) and what other layouts call them.
_LAYOUTS = {
    "language_model.model.": ("model.language_model.", "language_model."),
    "language_model.lm_head.": ("lm_head.",),
    "vision_tower.vision_model.": ("vision_tower.", "model.vision_tower.vision_model.", "model.vision_tower."),
    "multi_modal_projector.": ("model.multi_modal_projector.",),
}


def text_config(config: dict) -> dict:
    """The language model's config as a causal LM's own config.json."""
    text = dict(config.get("text_config") or {})
    kind = text.get("model_type", "llama")
    if kind not in TEXT_ARCHITECTURES:
        raise ValueError(f"LLaVA with a {kind!r} language model is not supported "
                         f"(supported: {', '.join(TEXT_ARCHITECTURES)})")
    text.setdefault("architectures", [TEXT_ARCHITECTURES[kind]])
    if "tie_word_embeddings" in config and "tie_word_embeddings" not in text:
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    return text


def build_llava(config: dict) -> Graph:
    """The language model (`Graph.encoder`: the vision tower and projector)."""
    text = text_config(config)
    graph = build_llama(text)
    for p in graph.params.values():  # the decoder's names under LLaVA's prefix
        p.sources = tuple(("language_model." + s) if s.startswith(("model.", "lm_head.")) else s for s in p.sources)
    insert_merge(graph)
    graph.architecture = (config.get("architectures") or ["LlavaForConditionalGeneration"])[0]
    graph.encoder = build_llava_vision(config, graph.config.hidden_size)
    graph.image_token_id = int(config.get("image_token_index", config.get("image_token_id", -1)))
    return graph


def insert_merge(graph: Graph) -> None:
    """A `merge_rows` node after the token embedding (and its scaling): image rows take the encoder's features."""
    first = next(i for i, n in enumerate(graph.nodes) if n.layer is not None)
    graph.nodes.insert(first, graph.make_node("merge_rows", "embed.merge_images", ["hidden", "mm_rows", "mm_embeds"],
                                              ["hidden"]))


def vision_config(config: dict) -> tuple[dict, str]:
    vision = dict(config.get("vision_config") or {})
    kind = vision.get("model_type", "clip_vision_model")
    if kind not in ("clip_vision_model", "siglip_vision_model"):
        raise ValueError(f"a {kind!r} vision tower is not supported (supported: CLIP, SigLIP)")
    return vision, "clip" if kind.startswith("clip") else "siglip"


def feature_layers(config: dict, num_layers: int) -> int:
    """How many tower layers run: transformers' hidden_states[vision_feature_layer] (index 0: the embeddings)."""
    layer = config.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise ValueError(f"vision_feature_layer {layer!r}: several feature layers (concatenated) are not supported")
    n = layer if layer >= 0 else num_layers + 1 + layer
    if not 0 <= n <= num_layers:
        raise ValueError(f"vision_feature_layer {layer} is outside the tower's {num_layers} layers")
    return n


def build_llava_vision(config: dict, text_hidden: int) -> Graph:
    """Inputs ``patches`` [N, C*P*P], ``positions`` [N] (a row's place in its image), ``class_ids`` [N]
    (0: the class row, 1: a patch; CLIP only), ``feature_rows`` [M] and the images' ``query_start_loc``;
    output ``image_embeds`` [M, text hidden]."""
    vision, kind = vision_config(config)
    h, heads = int(vision["hidden_size"]), int(vision["num_attention_heads"])
    size, patch, channels = int(vision["image_size"]), int(vision["patch_size"]), int(vision.get("num_channels", 3))
    act = vision.get("hidden_act", "quick_gelu" if kind == "clip" else "gelu_pytorch_tanh")
    if act not in _VISION_ACTS:
        raise ValueError(f"vision tower hidden_act {act!r} is not supported (supported: {', '.join(_VISION_ACTS)})")
    layers = feature_layers(config, int(vision["num_hidden_layers"]))
    patches = (size // patch) ** 2
    rows = patches + (kind == "clip")
    cfg = ModelConfig(architecture=f"{kind}_vision_tower", hidden_size=h, num_layers=layers, num_heads=heads,
                      num_kv_heads=heads, head_dim=h // heads, intermediate_size=int(vision["intermediate_size"]),
                      vocab_size=0, rms_norm_eps=float(vision.get("layer_norm_eps", 1e-5 if kind == "clip" else 1e-6)),
                      max_position_embeddings=rows, rotary_dim=0, rope={}, hidden_act=_VISION_ACTS[act], raw=vision)
    g = Graph(cfg.architecture, cfg, num_layers=layers)
    g.output = "image_embeds"
    g.encoder_inputs = {"kind": kind, "image_size": size, "patch_size": patch, "channels": channels,
                        "rows_per_image": rows, "class_row": kind == "clip",
                        "drop_class": config.get("vision_feature_select_strategy", "default") == "default"}
    v, eps = "vision_tower.vision_model.", cfg.rms_norm_eps
    emb = v + "embeddings."
    w = g.param("patch_embed", (h, channels * patch * patch), emb + "patch_embedding.weight", reshape=True)
    pe = {"weight": w}
    if kind == "siglip":
        pe["bias"] = g.param("patch_embed.bias", (h,), emb + "patch_embedding.bias")
    g.add("linear", "embed.patches", ["patches"], ["hidden"], pe)
    if kind == "clip":  # the class row's learned vector; patch rows read the zero row after it
        table = g.param("class_table", (2, h), emb + "class_embedding", reshape=True, pad_rows=1)
        g.add("embedding", "embed.class", ["class_ids"], ["class_embeds"], {"table": table})
        g.add("add", "embed.add_class", ["hidden", "class_embeds"], ["hidden"])
    pos = g.param("position_embeddings", (rows, h), emb + "position_embedding.weight")
    g.add("embedding", "embed.positions", ["positions"], ["position_embeds"], {"table": pos})
    g.add("add", "embed.add_positions", ["hidden", "position_embeds"], ["hidden"])
    if kind == "clip":
        layer_norm_node(g, "embed.norm", v + "pre_layrnorm", h, ["hidden"], ["hidden"], eps)
    for i in range(layers):
        src, n = f"{v}encoder.layers.{i}.", f"layers.{i}"
        ins = ["hidden"] if i == 0 else ["ffn_out", "hidden"]
        layer_norm_node(g, f"{n}.norm1", src + "layer_norm1", h, ins, ["normed"] if i == 0 else ["normed", "hidden"], eps, i)
        qkv = tuple(f"{src}self_attn.{x}_proj" for x in "qkv")
        attn = {"qkv_proj": g.param(f"{n}.qkv_proj", (3 * h, h), tuple(s + ".weight" for s in qkv), parts=(h, h, h)),
                "qkv_bias": g.param(f"{n}.qkv_bias", (3 * h,), tuple(s + ".bias" for s in qkv), parts=(h, h, h)),
                "o_proj": g.param(f"{n}.o_proj", (h, h), src + "self_attn.out_proj.weight"),
                "o_bias": g.param(f"{n}.o_bias", (h,), src + "self_attn.out_proj.bias")}
        g.add("encoder_attention", f"{n}.attention", ["normed"], ["attn_out"], attn, layer=i, num_heads=heads,
              num_kv_heads=heads, head_dim=h // heads, scale=(h // heads) ** -0.5)
        layer_norm_node(g, f"{n}.norm2", src + "layer_norm2", h, ["attn_out", "hidden"], ["normed", "hidden"], eps, i)
        inter = cfg.intermediate_size
        ffn = {"up_proj": g.param(f"{n}.up_proj", (inter, h), src + "mlp.fc1.weight"),
               "up_bias": g.param(f"{n}.up_bias", (inter,), src + "mlp.fc1.bias"),
               "down_proj": g.param(f"{n}.down_proj", (h, inter), src + "mlp.fc2.weight"),
               "down_bias": g.param(f"{n}.down_bias", (h,), src + "mlp.fc2.bias")}
        g.add("ffn", f"{n}.ffn", ["normed"], ["ffn_out"], ffn, layer=i, act=cfg.hidden_act)
    if layers:
        g.add("add", "features.residual", ["ffn_out", "hidden"], ["hidden"])
    g.add("rows", "features.select", ["hidden", "feature_rows"], ["features"])
    pa = config.get("projector_hidden_act", "gelu")
    if pa not in _VISION_ACTS:
        raise ValueError(f"projector_hidden_act {pa!r} is not supported (supported: {', '.join(_VISION_ACTS)})")
    pr = "multi_modal_projector."
    proj = {"up_proj": g.param("projector.up_proj", (text_hidden, h), pr + "linear_1.weight"),
            "up_bias": g.param("projector.up_bias", (text_hidden,), pr + "linear_1.bias"),
            "down_proj": g.param("projector.down_proj", (text_hidden, text_hidden), pr + "linear_2.weight"),
            "down_bias": g.param("projector.down_bias", (text_hidden,), pr + "linear_2.bias")}
    g.add("ffn", "projector", ["features"], ["image_embeds"], proj, act=_VISION_ACTS[pa])
    return g


def align_layout(graph: Graph, names: Iterable[str]) -> None:
    """Point a VLM's parameters (and its encoder's) at the checkpoint's layout: transformers 4
    (``language_model.model.``, ``vision_tower.vision_model.``) or 5 (``model.language_model.``,
    ``model.vision_tower.``, a bare ``vision_tower.``)."""
    have = set(names)
    for g in (graph, getattr(graph, "encoder", None)):
        for p in (g.params.values() if g is not None else ()):
            fixed = []
            for s in p.sources:
                if s not in have:
                    for canon, others in _LAYOUTS.items():
                        if s.startswith(canon):
                            rest = s[len(canon):]
                            s = next((o + rest for o in others if o + rest in have), s)
                            break
                fixed.append(s)
            p.sources = tuple(fixed)
