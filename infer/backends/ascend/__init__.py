"""The `ascend` backend plugin (Huawei Ascend 910B through torch_npu).

Its torch_npu kernels are not written yet, so every primitive is served by the
`torch` backend on the NPU by declaration (`fallback`). Without torch_npu and
Huawei's CANN toolkit it reports why it is unavailable.
"""

from ...primitives.hookspecs import hookimpl
from .backend import AscendBackend


@hookimpl
def infer_register_backends():
    return [AscendBackend]
