"""infer: an LLM inference runtime whose core lowers work to a few meta-primitives."""

import os as _os
import sys as _sys

__version__ = "0.1.0"

# torch's OpenMP threads (libgomp) spin ~300k iterations after each parallel
# op before sleeping. The native CPU kernels hand work to Python threads between
# torch ops, and on a 2-core machine a spinning OpenMP thread starves them: decode
# measured faster with 10000, torch's own ops unchanged (docs/backends/torch-measurements.md).
# libgomp reads it once, when torch loads, so it is set only when torch is not
# loaded yet and the user has not set it.
if "torch" not in _sys.modules:
    _os.environ.setdefault("GOMP_SPINCOUNT", "10000")

_EXPORTS = {
    "LLM": "infer.core.llm",
    "LLMEngine": "infer.core.engine",
    "EngineArgs": "infer.core.engine",
    "SamplingParams": "infer.core.sampling_params",
    "RequestOutput": "infer.core.outputs",
    "CompletionOutput": "infer.core.outputs",
}


def __getattr__(name: str):
    # Lazy, so `import infer` (and the CLI) does not pay for torch and transformers.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'infer' has no attribute {name!r}")
