"""The `cuda` backend plugin (NVIDIA H100/H200/A100 through Triton).

Triton kernels for paged attention (with flash-decoding splits), kv_write,
rms_norm (+residual), rotary, act_and_mul, fused MoE, quantized linear and the
structured-output bitmask of `sample` (the rest of `sample` is torch's code);
the other primitives are served by the `torch` backend on the same device by
declaration (`fallback`), which `infer backends --coverage` shows.
`graphs.DecodeGraphs` captures decode steps in CUDA graphs. With
TRITON_INTERPRET=1 the kernels run on the CPU in Triton's interpreter (for
tests); without a GPU or that variable the backend reports itself unavailable
and why.
"""

from ...primitives.hookspecs import hookimpl
from .backend import CudaBackend


@hookimpl
def infer_register_backends():
    return [CudaBackend]
