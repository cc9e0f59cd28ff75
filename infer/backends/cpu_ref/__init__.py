"""The `cpu_ref` backend plugin: the NumPy reference implementation."""

from ...primitives.hookspecs import hookimpl
from .backend import CpuRefBackend


@hookimpl
def infer_register_backends():
    return [CpuRefBackend]
