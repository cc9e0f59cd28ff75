"""`cpu_ref`: every primitive in NumPy, written to be read. The oracle.

Every float dtype is stored as float32 holding values rounded to that dtype
(NumPy has no bfloat16), and computed in float64, so the reference's own error
is far below any backend's tolerance.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...primitives.backend import Backend
from ...primitives.fp8 import e4m3_decode
from ...primitives.types import ACT_QUANTS, EXPERT_WEIGHT_KINDS, FLOAT_DTYPES, QUANTIZED_KINDS, round_to_dtype
from . import attention, moe, ops, quant, sampling


class CpuRefBackend(Backend):
    name = "cpu_ref"
    description = "NumPy reference: the executable spec and conformance oracle (slow by design)"
    dist_backend = "gloo"
    dtypes = FLOAT_DTYPES
    weight_kinds = ("dense", *QUANTIZED_KINDS)
    act_quants = ACT_QUANTS
    expert_weight_kinds = EXPERT_WEIGHT_KINDS
    kv_cache_dtypes = ("auto", "fp8")
    native_block_sizes = True  # attention reads blocks of several pages itself (the oracle of the page tables)
    fallback = None

    # -- plumbing -------------------------------------------------------------
    def asarray(self, x: np.ndarray, dtype: str | None = None) -> np.ndarray:
        if dtype is not None:
            return round_to_dtype(x, dtype)
        return np.array(x)

    def cast(self, x: np.ndarray, dtype: str) -> np.ndarray:
        return round_to_dtype(x, dtype)

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x)

    def allocate_kv_cache(self, num_blocks, block_size, num_kv_heads, head_dim, dtype) -> np.ndarray:
        storage = np.uint8 if dtype == "fp8" else np.float32  # fp8: e4m3fn codes
        return np.zeros(self.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), dtype=storage)

    def kv_cache_to_numpy(self, kv_cache: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if kv_cache.dtype == np.uint8:  # fp8 codes as their (unscaled) values
            return e4m3_decode(kv_cache[0]), e4m3_decode(kv_cache[1])
        return kv_cache[0].copy(), kv_cache[1].copy()

    # -- primitives -------------------------------------------------------------
    embedding = staticmethod(quant.embedding)
    rms_norm = staticmethod(ops.rms_norm)
    layer_norm = staticmethod(ops.layer_norm)
    activation = staticmethod(ops.activation)
    encoder_attention = staticmethod(attention.encoder_attention)
    pool = staticmethod(ops.pool)
    linear = staticmethod(quant.linear)
    rotary = staticmethod(ops.rotary)
    act_and_mul = staticmethod(ops.act_and_mul)
    kv_write = staticmethod(attention.kv_write)
    mla_kv_write = staticmethod(attention.mla_kv_write)
    mla_attention = staticmethod(attention.mla_attention)
    attention = staticmethod(attention.attention)
    moe = staticmethod(moe.moe)
    lora = staticmethod(ops.lora)
    sample = staticmethod(sampling.sample)

    # Collectives move data with torch.distributed by contract; NumPy has no
    # transport, so this is the one place cpu_ref touches torch (zero-copy views).
    def all_reduce(self, x: np.ndarray, group=None) -> np.ndarray:
        import torch
        import torch.distributed as dist

        t = torch.from_numpy(np.array(x))
        dist.all_reduce(t, group=group)
        return t.numpy()

    def all_gather(self, x: np.ndarray, dim: int = 0, group=None) -> np.ndarray:
        import torch
        import torch.distributed as dist

        t = torch.from_numpy(np.ascontiguousarray(x))
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t, group=group)
        return np.concatenate([p.numpy() for p in parts], axis=dim)
