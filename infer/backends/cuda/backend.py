from __future__ import annotations

import importlib.util

from ...primitives.types import Support
from ..torch_native.plumbing import TorchPlumbing


class CudaBackend(TorchPlumbing):
    name = "cuda"
    description = "NVIDIA GPUs through Triton kernels (torch for what it does not override)"
    dist_backend = "nccl"
    preferred_block_size = 16
    dtypes = ("float32", "float16", "bfloat16")
    fallback = "torch"

    def default_device(self) -> str:
        return "cuda"

    @classmethod
    def is_available(cls) -> Support:
        if importlib.util.find_spec("triton") is None:
            return Support(False, "triton not installed (pip install 'infer[cuda]')")
        import torch

        if not torch.cuda.is_available():
            return Support(False, "no CUDA GPU visible to torch (torch.cuda.is_available() is False)")
        return Support(True)
