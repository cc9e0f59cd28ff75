"""The loaded config dict (HF field names) and the weight dtype."""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import LoaderError

_DTYPES = {
    "float32": np.float32, "fp32": np.float32, "float": np.float32,
    "float16": np.float16, "fp16": np.float16, "half": np.float16,
}


def normalize_config(raw: dict[str, Any]) -> dict[str, Any]:
    """An HF config dict with the fields the core reads filled in.

    transformers >= 5 writes rope settings as ``rope_parameters``, older
    releases as ``rope_theta`` + ``rope_scaling``; both are given. Missing
    ``num_key_value_heads`` and ``head_dim`` get their HF defaults.
    """
    cfg = dict(raw)
    params = dict(cfg.get("rope_parameters") or {})
    cfg.setdefault("rope_theta", params.get("rope_theta", 10000.0))
    if cfg.get("rope_scaling") is None:
        extra = {k: v for k, v in params.items() if k != "rope_theta"}
        cfg["rope_scaling"] = extra if extra.get("rope_type", extra.get("type", "default")) != "default" else None
    scaling = cfg["rope_scaling"]
    if isinstance(scaling, dict) and "rope_type" not in scaling and "type" in scaling:
        cfg["rope_scaling"] = {"rope_type": scaling["type"], **scaling}
    heads = cfg.get("num_attention_heads")
    if heads:
        if cfg.get("num_key_value_heads") is None:
            cfg["num_key_value_heads"] = heads
        if cfg.get("head_dim") is None and cfg.get("hidden_size"):
            cfg["head_dim"] = cfg["hidden_size"] // heads
    cfg.setdefault("tie_word_embeddings", False)  # the class default of every supported architecture
    return cfg


def resolve_dtype(dtype: Any, config: dict[str, Any], fmt: str) -> np.dtype:
    """The NumPy dtype weights are returned in.

    ``"auto"``: float16 for a float16 safetensors checkpoint, else float32
    (NumPy has no bfloat16, and GGUF blocks dequantize to float32).
    """
    if dtype is None or dtype == "auto":
        stored = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
        return np.dtype(np.float16 if fmt == "safetensors" and stored == "float16" else np.float32)
    name = str(dtype).removeprefix("torch.") if not isinstance(dtype, (type, np.dtype)) else np.dtype(dtype).name
    if name in _DTYPES:
        return np.dtype(_DTYPES[name])
    hint = " (NumPy has no bfloat16)" if "bfloat16" in name or name == "bf16" else ""
    raise LoaderError(f"dtype {dtype!r} is not supported{hint}; use 'auto', 'float32' or 'float16'")
