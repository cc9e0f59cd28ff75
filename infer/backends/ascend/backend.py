"""`AscendBackend`: Huawei Ascend NPUs through torch_npu's fused ops, XY-Serve style.

Native: rms_norm (npu_rms_norm / npu_add_rms_norm), rotary (npu_rotary_mul),
act_and_mul (npu_swiglu for silu), kv_write (npu_scatter_pa_kv_cache, float16/bfloat16
caches), attention (npu_fused_infer_attention_score over the planner's tiles,
head_dim 128 or 192), moe
(gating top-k, init routing v2, grouped matmul, token unpermute) and linear
(SmoothGEMM row tiles; int4/int8 group-quantized weights through
npu_weight_quant_batchmatmul, fp16/bf16 activations). Everything else, and what `supports` declines, is the
`torch` backend's code running on the NPU: `sample` among them, its
structured-output token bitmask included.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ...primitives.types import ACT_QUANTS, AttentionMetadata, Support
from ...primitives.torch_tensors import TORCH_DTYPES, TorchTensors
from . import attention as attn
from . import layers, linear, lora, moe, w8a8
from .availability import probe, tensor_device

# Why attention goes to torch for a static property (the core asks once per layer).
_ATTENTION_DECLINES = {
    "sliding_window": "npu_fused_infer_attention_score's band mode (sparse_mode=4) is not wired up for sliding windows",
    "soft_cap": "npu_fused_infer_attention_score has no logit soft-cap",
    "sinks": "npu_fused_infer_attention_score as wired here has no per-head sink logit",
}


class AscendBackend(TorchTensors):
    name = "ascend"
    description = "Huawei Ascend NPUs through torch_npu fused ops, XY-Serve style"
    dist_backend = "hccl"
    # vllm-ascend's block size on 910B; the fused attention pages by 128..512.
    preferred_block_size = 128
    auto_block_sizes = (32, 64, 128)  # FIA pages are multiples of 16; 128 (its best) for long requests
    kv_cache_layout = "[2, num_blocks, block_size, num_kv_heads, head_dim] (K, V caches for npu_scatter_pa_kv_cache)"
    dtypes = ("float32", "float16", "bfloat16")
    weight_kinds = ("dense", "int4_group", "int8_group")  # weight-only quantized: npu_weight_quant_batchmatmul
    act_quants = ACT_QUANTS  # W8A8: npu_dynamic_quant + npu_quant_matmul (w8a8.py)
    fallback = "torch"

    def __init__(self, device: str | None = None):
        super().__init__(device)
        # Tensors go to the NPU; under the test emulation, to the host.
        self.placement = tensor_device(self.device)

    def default_device(self) -> str:
        return "npu:0"

    @classmethod
    def is_available(cls) -> Support:
        return probe()

    def supports(self, primitive: str, **kw: Any) -> Support:
        base = super().supports(primitive, **kw)
        if base and primitive == "linear" and kw.get("weight_kind", "dense") != "dense" and kw.get("dtype") == "float32":
            return Support(False, "npu_weight_quant_batchmatmul and npu_dynamic_quant take float16/bfloat16 "
                                  "activations only")
        if base and primitive == "kv_write" and kw.get("dtype") == "float32":
            return Support(False, "npu_scatter_pa_kv_cache takes float16/bfloat16/int8 on Atlas A2/A3 "
                                  "(aclnnScatterPaKvCache), not float32")
        if not base or primitive not in ("attention", "moe"):
            return base
        if primitive == "moe":
            if kw.get("shared_expert"):
                return Support(False, "backend 'ascend' moe has no shared expert yet")
            if kw.get("expert_bias") or kw.get("moe_activation"):
                return Support(False, "npu_grouped_matmul + npu_swiglu as chained here take no expert biases "
                                      "and no clamped SwiGLU (gpt-oss)")
            if kw.get("routing"):
                return Support(False, "npu_moe_gating_top_k_softmax is the softmax top-k; DeepSeek's routing "
                                      "(sigmoid scores, selection bias, expert groups, a routed scale) is torch's")
            return base
        if kw.get("dtype") == "float32":
            return Support(False, "npu_fused_infer_attention_score takes float16/bfloat16 queries only")
        for key, reason in _ATTENTION_DECLINES.items():
            if kw.get(key):
                return Support(False, reason)
        head_dim = kw.get("head_dim")
        if head_dim is not None and head_dim not in attn.FUSED_HEAD_DIMS:
            return Support(False, f"npu_fused_infer_attention_score's TND layout takes head_dim 128 or 192, got {head_dim}")
        return base

    # -- plumbing on `placement` -------------------------------------------------
    def asarray(self, x: np.ndarray, dtype: str | None = None) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(x))
        if dtype is not None:
            t = t.to(TORCH_DTYPES[dtype])
        return t.to(self.placement)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: str) -> torch.Tensor:
        shape = self.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
        return torch.zeros(shape, dtype=TORCH_DTYPES[dtype], device=self.placement)

    def prepare_weight(self, weight):
        if getattr(weight, "act_quant", None) is not None:
            return w8a8.prepare_weight(weight)
        return linear.prepare_weight(weight)

    def plan_attention(self, meta: AttentionMetadata) -> attn.AscendStepPlan:
        """The step's XY-Serve tiles, planned once on the host for every layer."""
        return attn.plan_step(meta.query_start_loc, meta.seq_lens)

    def synchronize(self) -> None:
        torch.npu.synchronize()

    def memory_info(self) -> tuple[int, int] | None:
        _, total = torch.npu.mem_get_info(self.device)
        return int(total), int(torch.npu.max_memory_reserved(self.device))

    def reset_peak_memory(self) -> None:
        torch.npu.empty_cache()
        torch.npu.reset_peak_memory_stats(self.device)

    # -- primitives -------------------------------------------------------------
    rms_norm = staticmethod(layers.rms_norm)
    rotary = staticmethod(layers.rotary)
    act_and_mul = staticmethod(layers.act_and_mul)
    @staticmethod
    def linear(x, weight):
        if getattr(weight, "act_quant", None) is not None:
            return w8a8.linear(x, weight)
        return linear.linear(x, weight)

    kv_write = staticmethod(attn.kv_write)
    attention = staticmethod(attn.attention)
    moe = staticmethod(moe.moe)
    lora = staticmethod(lora.lora)
