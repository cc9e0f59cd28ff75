"""fp8 (e4m3fn) KV cache storage for the torch backend.

The cache tensor is uint8 holding e4m3fn bit patterns (index_copy_ and
index_select work on it on every device, which float8 tensors do not
guarantee); conversions view it as torch.float8_e4m3fn. torch's cast rounds
to nearest even like the reference but makes NaN past 448, so values are
clamped first (vLLM's scaled_fp8_quant saturates the same way).
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0


def cache_scales(kv_cache: torch.Tensor, scales, name: str = "scales") -> tuple[bool, tuple[float, float]]:
    """(whether `kv_cache` is fp8, its (k_scale, v_scale)): scales belong to an fp8 (uint8)
    cache only, where None means 1.0. Shared by the torch and cuda kernels' wrappers."""
    fp8 = kv_cache.dtype == torch.uint8
    if scales is not None and not fp8:
        raise ValueError(f"{name} are for an fp8 cache; this cache is in the model dtype")
    return fp8, (scales if scales is not None else (1.0, 1.0))


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """uint8 codes of ``x / scale``."""
    return (x.float() / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def dequantize(codes: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``e4m3(codes) * scale`` in `dtype` (the multiply in float32, rounded once)."""
    return (codes.view(torch.float8_e4m3fn).float() * scale).to(dtype)
