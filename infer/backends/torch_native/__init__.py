"""The `torch` backend plugin: every primitive in plain PyTorch, on any torch device."""

from ...primitives.hookspecs import hookimpl
from .backend import TorchBackend


@hookimpl
def infer_register_backends():
    return [TorchBackend]
