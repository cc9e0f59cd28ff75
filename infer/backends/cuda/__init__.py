"""The `cuda` backend plugin (NVIDIA H100/A100 through Triton).

Its Triton kernels are not written yet, so every primitive is served by the
`torch` backend on the GPU by declaration (`fallback`); `infer backends` shows
that coverage. On a machine without triton or a GPU it reports why it is
unavailable.
"""

from ...primitives.hookspecs import hookimpl
from .backend import CudaBackend


@hookimpl
def infer_register_backends():
    return [CudaBackend]
