"""Model loading: HF directories (config.json + safetensors + tokenizer) and GGUF files.

    from infer.core.loader import load_model
    m = load_model("smollm2")          # alias, HF directory, or .gguf file
    m.config["hidden_size"], m.weights["model.embed_tokens.weight"], m.tokenizer

Weights are NumPy arrays under HF parameter names, in HF layout. Nothing here
imports a backend; torch is only touched by transformers' tokenizer code.
"""

from .architectures import SUPPORTED_ARCHITECTURES, check_architecture
from .errors import (
    CorruptCheckpointError,
    LoaderError,
    ModelNotFoundError,
    PickledCheckpointError,
    UnsupportedArchitectureError,
)
from .load import LoadedModel, iter_weights, load_model, open_checkpoint
from .paths import DEFAULT_MODEL, MODEL_ALIASES, resolve_model_path

__all__ = [
    "DEFAULT_MODEL",
    "MODEL_ALIASES",
    "SUPPORTED_ARCHITECTURES",
    "CorruptCheckpointError",
    "LoadedModel",
    "LoaderError",
    "ModelNotFoundError",
    "PickledCheckpointError",
    "UnsupportedArchitectureError",
    "check_architecture",
    "iter_weights",
    "load_model",
    "open_checkpoint",
    "resolve_model_path",
]
