"""`TorchTensors`: a `Backend` whose tensors are torch tensors, with the plumbing written.

Public API for backend authors: subclass it, set the declarations, and
implement the primitives your device runs (in-tree, `torch`, `cuda` and
`ascend` do the same). Importing this module imports torch; `infer.primitives`
itself does not.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from .backend import Backend, check_block_data

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def kv_storage_dtype(dtype: str) -> torch.dtype:
    """The torch dtype a KV cache of `dtype` (a float dtype name or 'fp8') is stored in."""
    return torch.uint8 if dtype == "fp8" else TORCH_DTYPES[dtype]  # fp8: e4m3fn codes


def _block_bytes(kv_cache: torch.Tensor) -> int:
    """Bytes per block of a cache whose block axis is 1."""
    return math.prod((kv_cache.shape[0], *kv_cache.shape[2:])) * kv_cache.element_size()


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
        return torch.zeros(shape, dtype=kv_storage_dtype(dtype), device=self.device)

    def read_blocks(self, kv_cache: torch.Tensor, block_ids: np.ndarray) -> np.ndarray:
        ids = torch.from_numpy(np.asarray(block_ids, dtype=np.int64)).to(kv_cache.device)
        # [n, 2, block_size, Hk, D] contiguous, then its bytes: bfloat16 has no NumPy dtype.
        blocks = kv_cache.index_select(1, ids).movedim(1, 0).contiguous()
        return blocks.view(torch.uint8).reshape(len(ids), _block_bytes(kv_cache)).cpu().numpy()

    def write_blocks(self, kv_cache: torch.Tensor, block_ids: np.ndarray, data: np.ndarray) -> None:
        ids = np.asarray(block_ids, dtype=np.int64)
        check_block_data(data, len(ids), _block_bytes(kv_cache))
        if len(ids):
            raw = torch.from_numpy(np.ascontiguousarray(data)).to(kv_cache.device)
            block_shape = (kv_cache.shape[0], *kv_cache.shape[2:])
            blocks = raw.view(kv_cache.dtype).reshape(len(ids), *block_shape)
            kv_cache[:, torch.from_numpy(ids).to(kv_cache.device)] = blocks.movedim(0, 1)

    def set_rows(self, dst: torch.Tensor, index: int, src: torch.Tensor) -> None:
        dst[index].copy_(src)

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
