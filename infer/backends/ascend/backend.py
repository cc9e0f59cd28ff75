from __future__ import annotations

import importlib.util

from ...primitives.types import Support
from ..torch_native.plumbing import TorchPlumbing


class AscendBackend(TorchPlumbing):
    name = "ascend"
    description = "Huawei Ascend NPUs through torch_npu fused ops, XY-Serve style"
    dist_backend = "hccl"
    # vllm-ascend's block size on 910B.
    preferred_block_size = 128
    dtypes = ("float32", "float16", "bfloat16")
    fallback = "torch"

    def default_device(self) -> str:
        return "npu"

    @classmethod
    def is_available(cls) -> Support:
        if importlib.util.find_spec("torch_npu") is None:
            return Support(False, "torch_npu not installed (pip install 'infer[ascend]' on a host with Huawei's CANN toolkit)")
        try:
            import torch_npu  # noqa: F401
        except Exception as exc:  # ImportError: libhccl.so without CANN
            return Support(False, f"torch_npu not importable: {exc} (install the CANN toolkit)")
        import torch

        if not torch.npu.is_available():
            return Support(False, "torch_npu imported but no NPU is visible (torch.npu.is_available() is False)")
        return Support(True)
