"""An out-of-tree backend for infer (see README.md)."""

from .backend import ExampleBackend

__all__ = ["ExampleBackend"]
