"""infer: an LLM inference runtime whose core lowers work to a few meta-primitives."""

__version__ = "0.1.0"
