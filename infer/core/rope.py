"""Rotary position embedding tables (the `cos_sin_cache` of `rotary`).

Reads both config styles: transformers 5's ``rope_parameters`` dict and the
older ``rope_theta`` + ``rope_scaling`` pair.
"""

from __future__ import annotations

import math

import numpy as np

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


def rope_parameters(config: dict, layer_type: str | None = None) -> dict:
    """The config's rope settings as one dict with a ``rope_type`` key; with
    `layer_type`, those of that kind of layer where the config gives rope
    settings per layer type (Gemma 3: ``full_attention`` / ``sliding_attention``)."""
    params = dict(config.get("rope_parameters") or {})
    if layer_type is not None or any(isinstance(v, dict) for v in params.values()):
        params = dict(params.get(layer_type or "full_attention") or {})
    scaling = config.get("rope_scaling") or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if config.get("original_max_position_embeddings"):  # Phi-3 keeps it beside rope_scaling
        params.setdefault("original_max_position_embeddings", config["original_max_position_embeddings"])
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    params["rope_type"] = rope_type
    return params


def inv_frequencies(params: dict, rotary_dim: int, max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """(inverse frequencies [rotary_dim / 2], attention scaling factor)."""
    base = float(params["rope_theta"])
    inv_freq = 1.0 / base ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    kind = params["rope_type"]
    if kind == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, params, max_position_embeddings), 1.0
    if kind == "yarn":
        return _yarn(inv_freq, params, rotary_dim, base, max_position_embeddings)
    return inv_freq, 1.0


def _dynamic_ntk(params: dict, rotary_dim: int, max_position_embeddings: int, max_positions: int) -> np.ndarray:
    """Dynamic NTK scaling: the base grows with the context past max_position_embeddings.
    transformers grows it with each sequence; a paged cache keeps keys rotated once, so
    the served context (`max_positions`) sets it for every position, as vLLM does."""
    factor, length = float(params["factor"]), max(max_positions, max_position_embeddings)
    base = float(params["rope_theta"]) * ((factor * length / max_position_embeddings) - (factor - 1)) ** (
        rotary_dim / (rotary_dim - 2))
    return 1.0 / base ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)


def _longrope(params: dict, rotary_dim: int, max_position_embeddings: int, max_positions: int):
    """Phi-3's LongRoPE: per-frequency divisors, `short_factor` within the
    pretraining length and `long_factor` beyond it, and a cos/sin scale from
    the length ratio. transformers picks the factors per forward by the
    sequence's length; a paged cache keeps keys rotated once, so here the
    served context decides for every position, as llama.cpp does: short
    factors when ``max_model_len`` fits the original length, long otherwise."""
    base = float(params["rope_theta"])
    old_len = int(params.get("original_max_position_embeddings") or max_position_embeddings)
    factors = params["long_factor"] if max_positions > old_len else params["short_factor"]
    factors = np.asarray(factors, dtype=np.float64)
    if factors.shape != (rotary_dim // 2,):
        raise ValueError(f"longrope factors have {factors.size} entries; rotary_dim {rotary_dim} needs {rotary_dim // 2}")
    # float32 exponents as transformers computes them
    shape = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(rotary_dim)
    inv_freq = 1.0 / (factors * base ** shape.astype(np.float64))
    factor = params.get("factor") or max_position_embeddings / old_len
    scale = params.get("attention_factor")
    if scale is None:
        scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    return inv_freq, float(scale)


def _llama3(inv_freq: np.ndarray, p: dict, max_pos: int) -> np.ndarray:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and
    # the band between is interpolated smoothly.
    factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_len = float(p.get("original_max_position_embeddings", max_pos))
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return np.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def _yarn(inv_freq, p, dim, base, max_pos):
    factor = float(p["factor"])
    old_len = float(p.get("original_max_position_embeddings") or max_pos)
    beta_fast, beta_slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        def mscale(scale: float = 1.0) -> float:
            return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

        # DeepSeek's configs give mscale and mscale_all_dim, whose ratio is the factor.
        both = p.get("mscale") and p.get("mscale_all_dim")
        attention_factor = mscale(float(p["mscale"])) / mscale(float(p["mscale_all_dim"])) if both else mscale()

    def correction_dim(rotations):
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):  # gpt-oss keeps the fractional range (truncate: false)
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / max(high - low, 1e-3), 0, 1)
    extrapolation = 1 - ramp
    return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation, float(attention_factor)


def cos_sin_cache(config: dict, rotary_dim: int, max_positions: int, params: dict | None = None) -> np.ndarray:
    """[max_positions, rotary_dim] float32: cos in the first half, sin in the second;
    `params` (`rope_parameters`' form): the settings of one kind of layer, else the config's."""
    params = params or rope_parameters(config)
    max_len = int(config.get("max_position_embeddings", max_positions))
    if params["rope_type"] == "longrope":
        inv_freq, scale = _longrope(params, rotary_dim, max_len, max_positions)
    elif params["rope_type"] == "dynamic":
        inv_freq, scale = _dynamic_ntk(params, rotary_dim, max_len, max_positions), 1.0
    else:
        inv_freq, scale = inv_frequencies(params, rotary_dim, max_len)
    angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)
    return np.concatenate([np.cos(angles) * scale, np.sin(angles) * scale], axis=1).astype(np.float32)
