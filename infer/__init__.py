"""infer: an LLM inference runtime whose core lowers work to a few meta-primitives."""

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "infer.core.llm",
    "LLMEngine": "infer.core.engine",
    "EngineArgs": "infer.core.engine",
    "SamplingParams": "infer.core.sampling_params",
    "RequestOutput": "infer.core.outputs",
    "CompletionOutput": "infer.core.outputs",
    "LoRARequest": "infer.core.lora",
}


def __getattr__(name: str):
    # Lazy, so `import infer` (and the CLI) does not pay for torch and transformers.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'infer' has no attribute {name!r}")
