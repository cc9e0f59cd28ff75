"""The `ascend` backend plugin (Huawei Ascend 910B through torch_npu's fused ops).

torch_npu is imported only when a primitive runs, never at plugin load: on a
machine without it (or without Huawei's CANN toolkit) the backend is listed as
unavailable with the reason. docs/backends/ascend.md says how to run it.
"""

from ...primitives.hookspecs import hookimpl
from .backend import AscendBackend


@hookimpl
def infer_register_backends():
    return [AscendBackend]
