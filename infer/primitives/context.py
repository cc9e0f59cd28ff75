"""Records a backend receives beyond a primitive's arguments: one layer's state, one forward's result.

The model runner owns the KV caches, rope tables and fp8 scales; a fused node
(`Backend.fuses`) reads them from its layer's `LayerContext`, never from the
runner. A captured decode (`Backend.decode_graphs`) calls the forward it was
given and hands back what it returns, a `ForwardOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True, slots=True)
class LayerContext:
    """What one decoder layer's calls read besides their inputs.

      layer           layer index.
      kv_cache        this layer's cache, as the backend that writes it allocated it.
      kv_cache_dtype  'auto' (the model dtype) or 'fp8'.
      kv_scales       (k_scale, v_scale) of an fp8 cache; None otherwise.
      rope            rotary_dim -> this layer's cos/sin table [max_position, rotary_dim]
                      (`spec.rotary`'s ``cos_sin_cache``), on the device; layers of
                      one rope variant share a table (Gemma 3's local layers have
                      their own base); empty for a layer without rope (SmolLM3).
    """

    layer: int
    kv_cache: Any
    kv_cache_dtype: str = "auto"
    kv_scales: tuple[float, float] | None = None
    rope: Mapping[int, Any] = field(default_factory=dict)

    def cos_sin_cache(self, rotary_dim: int) -> Any:
        return self.rope[rotary_dim]

    def argument(self, name: str, attrs: Mapping[str, Any]) -> Any:
        """The value of a primitive argument whose source is 'layer' (`binding.SIGNATURES`)."""
        if name == "kv_cache":
            return self.kv_cache
        if name in ("scales", "kv_scales"):
            return self.kv_scales
        if name == "cos_sin_cache":
            return self.cos_sin_cache(attrs["rotary_dim"])
        raise KeyError(f"no layer argument {name!r}")


@dataclass(slots=True)
class ForwardOutput:
    """One forward pass: the logits of the sampled rows and, for MoE models,
    the tokens each layer routed to each expert (layer -> int64 [E] tensor)."""

    logits: Any
    expert_counts: dict[int, Any] = field(default_factory=dict)
    # A pipeline stage before the last: the values the next stage starts from
    # (``hidden``, ``residual``); its logits are None.
    carry: dict[str, Any] | None = None
    # A pooling model: one float32 row per sequence (``pool``, then any classifier head); logits None.
    pooled: Any = None
