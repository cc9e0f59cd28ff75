"""`TorchTensors`: a `Backend` whose tensors are torch tensors, with the plumbing written.

Public API for backend authors: subclass it, set the declarations, and
implement the primitives your device runs (in-tree, `torch`, `cuda` and
`ascend` do the same). Importing this module imports torch; `infer.primitives`
itself does not.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .backend import Backend

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class TorchTensors(Backend):
    """asarray / to_numpy / KV-cache allocation for torch tensors on `self.device`.

    Cache layout: one tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
    per layer (K at index 0, V at 1), as vLLM's flash-attention backend.
    """

    def asarray(self, x: np.ndarray, dtype: str | None = None) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(x))
        if dtype is not None:
            t = t.to(TORCH_DTYPES[dtype])
        return t.to(self.device)

    def cast(self, x: torch.Tensor, dtype: str) -> torch.Tensor:
        return x.to(TORCH_DTYPES[dtype])

    def to_numpy(self, x: torch.Tensor) -> np.ndarray:
        x = x.detach().cpu()
        if x.dtype in (torch.bfloat16, torch.float16):
            x = x.float()
        return x.numpy()

    def allocate_kv_cache(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: str) -> torch.Tensor:
        shape = self.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
        storage = torch.uint8 if dtype == "fp8" else TORCH_DTYPES[dtype]  # fp8: e4m3fn codes
        return torch.zeros(shape, dtype=storage, device=self.device)

    def kv_cache_to_numpy(self, kv_cache: Any) -> tuple[np.ndarray, np.ndarray]:
        if kv_cache.dtype == torch.uint8:  # fp8 codes as their (unscaled) values
            return tuple(self.to_numpy(kv_cache[i].view(torch.float8_e4m3fn).float()) for i in (0, 1))
        return self.to_numpy(kv_cache[0]), self.to_numpy(kv_cache[1])

    def _device_module(self):
        """torch.cuda or torch.npu for an accelerator device, else None."""
        kind = str(self.device).split(":")[0]
        return getattr(torch, kind, None) if kind in ("cuda", "npu") else None

    def memory_info(self) -> tuple[int, int] | None:
        mod = self._device_module()
        if mod is None:
            return None
        _, total = mod.mem_get_info(self.device)
        return int(total), int(mod.max_memory_reserved(self.device))

    def reset_peak_memory(self) -> None:
        mod = self._device_module()
        if mod is not None:
            mod.empty_cache()
            mod.reset_peak_memory_stats(self.device)

    def synchronize(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
