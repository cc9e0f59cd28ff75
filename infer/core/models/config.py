"""A transformers `config.json` normalised to the fields the builders read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..rope import rope_parameters


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    rotary_dim: int
    rope: dict[str, Any]
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    # Layers that use the sliding window (Qwen2's max_window_layers); None: all.
    sliding_window_layers: tuple[int, ...] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Per-layer kinds ("sliding_attention" / "full_attention": Gemma 2/3); None: the window rule above.
    layer_types: tuple[str, ...] | None = None
    # Rope settings per layer type where a type has its own (Gemma 3's local layers).
    rope_variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    rope_layers: tuple[bool, ...] | None = None  # SmolLM3: False for the layers without rope
    neox_style: bool = True  # False: GPT-J's interleaved pairs (GLM-4)
    qk_norm_whole: bool = False  # OLMo 2: q/k norms over the whole projection, not per head
    # "pre" (Llama), "sandwich" (Gemma 2/3, GLM-4: norms after attention and MLP too),
    # "post" (OLMo 2: only after them)
    norm_layout: str = "pre"
    norm_offset: float = 0.0  # Gemma: a norm weight w scales by 1 + w
    fused_qkv: bool = False  # Phi-3: one qkv_proj tensor in the checkpoint
    fused_gate_up: bool = False  # Phi-3, GLM-4: one gate_up_proj tensor
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_soft_cap: float | None = None
    final_soft_cap: float | None = None
    embed_scale: float | None = None
    embed_scale_rounded: bool = False  # Gemma multiplies by the scale in the model dtype
    residual_scale: float | None = None  # Granite: attention and MLP outputs scaled before the residual add
    logit_scale: float | None = None  # Granite: logits / logits_scaling
    attn_sinks: bool = False  # gpt-oss: a learned logit per head in every softmax denominator
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def window_for(self, layer: int) -> int | None:
        if self.sliding_window is None:
            return None
        if self.layer_types is not None:
            return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None
        if self.sliding_window_layers is not None and layer not in self.sliding_window_layers:
            return None
        return self.sliding_window

    def rope_for(self, layer: int) -> str | None:
        """The rope variant of layer i (a key of `rope_variants`), None for the config's own."""
        kind = self.layer_types[layer] if self.layer_types is not None else None
        return kind if kind in self.rope_variants else None

    def rotary_dim_for(self, layer: int) -> int:
        return self.rotary_dim if self.rope_layers is None or self.rope_layers[layer] else 0


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def _require(cfg: dict, key: str):
    if cfg.get(key) is None:
        raise ValueError(f"config.json lacks '{key}', which a {cfg.get('architectures', ['?'])[0]} model needs")
    return cfg[key]


GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


def normalize_config(cfg: dict) -> ModelConfig:
    """Read the fields of an HF config the dense decoders use: the Llama family
    (Llama, Mistral, Qwen2, Qwen3) and what sets Gemma 2/3, Phi-3, Granite,
    OLMo 2, SmolLM3 and GLM-4 apart from it."""
    arch = (cfg.get("architectures") or [""])[0]
    hidden, heads = int(_require(cfg, "hidden_size")), int(_require(cfg, "num_attention_heads"))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    # transformers 5 keeps partial_rotary_factor in rope_parameters, older configs beside them
    partial = cfg.get("partial_rotary_factor") or rope_parameters(cfg).get("partial_rotary_factor") or 1.0
    rotary_dim = int(head_dim * float(partial))
    layers = int(_require(cfg, "num_hidden_layers"))
    window = cfg.get("sliding_window")
    window_layers = None
    if arch.startswith("Qwen"):
        # Qwen2/3 configs carry a sliding_window they only use when enabled,
        # and then only from layer max_window_layers on.
        if not cfg.get("use_sliding_window", False):
            window = None
        else:
            window_layers = tuple(range(int(cfg.get("max_window_layers", 0)), layers))
    attention_bias = bool(cfg.get("attention_bias", False))
    if arch == "SmolLM3ForCausalLM" and not cfg.get("use_sliding_window", False):
        window = None
    if arch in GEMMA:
        layer_types = cfg.get("layer_types") or [
            "full_attention" if (i + 1) % (2 if arch == "Gemma2ForCausalLM" else int(cfg.get("sliding_window_pattern", 6))) == 0
            else "sliding_attention" for i in range(layers)]
    elif arch == "GptOssForCausalLM":  # transformers' default: windowed layers first, alternating
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    else:
        layer_types = cfg.get("layer_types")
    if layer_types is not None and len(layer_types) != layers:
        raise ValueError(f"config.json's layer_types has {len(layer_types)} entries for {layers} layers")
    extra = _architecture_fields(arch, cfg, hidden, head_dim, layers)
    return ModelConfig(
        architecture=arch,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        intermediate_size=int(_require(cfg, "intermediate_size")),
        vocab_size=int(_require(cfg, "vocab_size")),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rotary_dim=rotary_dim,
        rope=rope_parameters(cfg),
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act", "silu"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
        o_bias=attention_bias and arch != "Glm4ForCausalLM",  # GLM-4 biases q/k/v only
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Olmo2ForCausalLM"),
        sliding_window=int(window) if window else None,
        sliding_window_layers=window_layers,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_ids(cfg.get("eos_token_id")),
        layer_types=tuple(layer_types) if layer_types is not None else None,
        raw=cfg,
        **extra,
    )


def _architecture_fields(arch: str, cfg: dict, hidden: int, head_dim: int, layers: int) -> dict[str, Any]:
    """The ModelConfig fields an architecture sets beyond the Llama family's."""
    if arch in GEMMA:
        scalar = cfg.get("query_pre_attn_scalar")
        variants = {}
        if arch == "Gemma3ForCausalLM":
            local = rope_parameters(cfg, "sliding_attention")
            if not isinstance((cfg.get("rope_parameters") or {}).get("sliding_attention"), dict):
                # transformers 4 configs: the local base alone, no scaling
                local = {"rope_type": "default", "rope_theta": float(cfg.get("rope_local_base_freq", 10000.0))}
            variants["sliding_attention"] = local
        # A GGUF's norms already hold 1 + w (llama.cpp's converter adds it): `gguf_norm_shift` 1.
        shift = float(cfg.get("gguf_norm_shift", 0.0))
        return dict(norm_layout="sandwich", norm_offset=1.0 - shift, embed_scale=hidden**0.5, embed_scale_rounded=True,
                    attn_scale=float(scalar) ** -0.5 if scalar else None,
                    attn_soft_cap=cfg.get("attn_logit_softcapping"), final_soft_cap=cfg.get("final_logit_softcapping"),
                    rope_variants=variants)
    if arch == "Phi3ForCausalLM":
        return dict(fused_qkv=True, fused_gate_up=True)
    if arch == "GraniteForCausalLM":
        return dict(attn_scale=cfg.get("attention_multiplier"), embed_scale=cfg.get("embedding_multiplier"),
                    residual_scale=cfg.get("residual_multiplier"),
                    logit_scale=1.0 / float(cfg["logits_scaling"]) if cfg.get("logits_scaling") else None)
    if arch == "Olmo2ForCausalLM":
        return dict(norm_layout="post", qk_norm_whole=True)
    if arch == "SmolLM3ForCausalLM":
        interval = int(cfg.get("no_rope_layer_interval", 4))
        flags = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
        return dict(rope_layers=tuple(bool(f) for f in flags))
    if arch == "Glm4ForCausalLM":
        return dict(norm_layout="sandwich", fused_gate_up=True, neox_style=False)
    if arch == "GptOssForCausalLM":
        return dict(attn_sinks=True)
    return {}
