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
        if self.sliding_window_layers is not None and layer not in self.sliding_window_layers:
            return None
        return self.sliding_window


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def _require(cfg: dict, key: str):
    if cfg.get(key) is None:
        raise ValueError(f"config.json lacks '{key}', which a {cfg.get('architectures', ['?'])[0]} model needs")
    return cfg[key]


def normalize_config(cfg: dict) -> ModelConfig:
    """Read the Llama-family fields of an HF config (Llama, Mistral, Qwen2, Qwen3)."""
    arch = (cfg.get("architectures") or [""])[0]
    hidden, heads = int(_require(cfg, "hidden_size")), int(_require(cfg, "num_attention_heads"))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    rotary_dim = int(head_dim * float(cfg.get("partial_rotary_factor", 1.0)))
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
        hidden_act=cfg.get("hidden_act", "silu"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
        o_bias=attention_bias and arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM"),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_window=int(window) if window else None,
        sliding_window_layers=window_layers,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_ids(cfg.get("eos_token_id")),
        raw=cfg,
    )
