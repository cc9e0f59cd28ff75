"""Which architectures the loader accepts: the one place that decides.

The engine may pass the names its plugin registry knows (`infer_register_models`)
as `supported`; without it, the built-in architectures (Llama family, MoE) are assumed.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ..models.llama import ARCHITECTURES as LLAMA_ARCHITECTURES
from ..models.deepseek import ARCHITECTURES as DEEPSEEK_ARCHITECTURES
from ..models.moe import ARCHITECTURES as MOE_ARCHITECTURES
from .errors import UnsupportedArchitectureError

SUPPORTED_ARCHITECTURES = LLAMA_ARCHITECTURES + MOE_ARCHITECTURES + DEEPSEEK_ARCHITECTURES


def check_architecture(config: dict, source: Path | str, supported: Iterable[str] | None = None) -> str:
    """The config's architecture name, or an error listing the supported ones."""
    allowed = tuple(supported) if supported is not None else SUPPORTED_ARCHITECTURES
    names = config.get("architectures") or []
    for name in names:
        if name in allowed:
            return name
    found = ", ".join(names) if names else f"none (model_type {config.get('model_type')!r})"
    raise UnsupportedArchitectureError(
        f"{source}: unsupported architecture {found}; infer supports {', '.join(allowed)}. "
        "Use a checkpoint of a supported architecture, or install a plugin that registers this one."
    )
