"""`CudaBackend`: Triton kernels for the hot primitives, `torch` for the rest.

What runs where is declared, not patched: `NATIVE` lists the primitives this
backend implements with its own kernels; everything else (embedding, dense
linear, collectives) is resolved to the `torch` backend on the same device by
`fallback`. `linear` is its own only for quantized weights (`weight_kinds`):
dense GEMMs stay with torch, that is cuBLAS. `sample` is torch's code with its
structured-output bitmask step done by a Triton kernel (`bitmask.py`). The KV
layout is torch's, so kv_write, attention and copy_blocks agree whichever side
serves them.

The kernel modules are imported on first use: registering the plugin must
stay cheap, and `@triton.jit` fixes interpreter-or-GPU when it runs, so it
must not run before TRITON_INTERPRET has been read.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from ...primitives.types import ACT_QUANTS, EXPERT_WEIGHT_KINDS, QUANTIZED_KINDS, Support
from ...primitives.torch_tensors import TorchTensors
from .launch import interpreting

NATIVE = ("rms_norm", "rotary", "act_and_mul", "kv_write", "attention", "moe", "linear", "lora", "sample")
INTERPRETER_NOTE = "Triton interpreter mode (TRITON_INTERPRET=1): kernels run on the CPU, for testing only"


class CudaBackend(TorchTensors):
    name = "cuda"
    description = "NVIDIA GPUs through Triton kernels (torch for what it does not override)"
    dist_backend = "nccl"
    preferred_block_size = 16
    kv_cache_dtypes = ("auto", "fp8")
    dtypes = ("float32", "float16", "bfloat16")
    weight_kinds = QUANTIZED_KINDS
    act_quants = ACT_QUANTS  # act_quant.py: per-token int8 codes, int8 tensor-core GEMM
    expert_weight_kinds = EXPERT_WEIGHT_KINDS  # moe.py reads MXFP4 experts tile by tile
    fallback = "torch"

    def default_device(self) -> str:
        return "cpu" if interpreting() else "cuda"

    @classmethod
    def is_available(cls) -> Support:
        if importlib.util.find_spec("triton") is None:
            return Support(False, "triton not installed (pip install 'infer[cuda]')")
        if interpreting():
            return Support(True, INTERPRETER_NOTE)
        import torch

        if not torch.cuda.is_available():
            return Support(False, "no CUDA GPU visible to torch (torch.cuda.is_available() is False); "
                                  "TRITON_INTERPRET=1 runs the kernels on the CPU for testing")
        return Support(True)

    def supports(self, primitive: str, **kw: Any) -> Support:
        if primitive not in NATIVE:
            return Support(False, f"backend 'cuda' has no kernel for {primitive}; served by '{self.fallback}'")
        if primitive == "linear" and kw.get("weight_kind", "dense") == "dense":
            return Support(False, f"backend 'cuda' leaves dense linear to '{self.fallback}' (cuBLAS)")
        return super().supports(primitive, **kw)

    def decode_graphs(self, forward, *, max_model_len, block_size, batch_sizes, progress=iter):
        """CUDA graphs of the decode step on a GPU (`graphs.DecodeGraphs`); None in interpreter mode."""
        if interpreting() or not str(self.device).startswith("cuda"):
            return None
        from .graphs import DecodeGraphs

        graphs = DecodeGraphs(forward, self.device, max_model_len, block_size, batch_sizes)
        graphs.capture(progress)
        return graphs

    # -- primitives (kernels imported on first call) ----------------------------
    def rms_norm(self, x, weight, eps, residual=None):
        from .norm import rms_norm

        return rms_norm(x, weight, eps, residual)

    def rotary(self, q, k, positions, cos_sin_cache, neox_style):
        from .rotary import rotary

        return rotary(q, k, positions, cos_sin_cache, neox_style)

    def act_and_mul(self, x, kind):
        from .activation import act_and_mul

        return act_and_mul(x, kind)

    def linear(self, x, weight):
        if getattr(weight, "act_quant", None) is not None:
            from .act_quant import linear as act_quant_linear

            return act_quant_linear(x, weight)
        from .quant_linear import linear

        return linear(x, weight)

    def kv_write(self, k, v, kv_cache, slot_mapping, scales=None):
        from .kv_write import kv_write

        kv_write(k, v, kv_cache, slot_mapping, scales)

    def attention(self, q, kv_cache, meta, scale, sliding_window=None, soft_cap=None, kv_scales=None, sinks=None):
        from .attention import paged_attention

        return paged_attention(q, kv_cache, meta, scale, sliding_window, soft_cap, kv_scales, sinks=sinks)

    def moe(self, x, router_logits, w13, w2, top_k, renormalize, shared=None, shared_gate=None, w13_bias=None,
            w2_bias=None, activation=None, swiglu_alpha=None, swiglu_limit=None, routed_scaling_factor=None,
            scoring_func=None, routing_bias=None, expert_groups=None):
        from .moe import moe

        return moe(x, router_logits, w13, w2, top_k, renormalize, shared, shared_gate, w13_bias, w2_bias, activation,
                   swiglu_alpha, swiglu_limit, routed_scaling_factor, scoring_func, routing_bias, expert_groups)

    def lora(self, x, y, lora_a, lora_b, lora_indices, output_slices=None):
        from .lora import lora

        return lora(x, y, lora_a, lora_b, lora_indices, output_slices)

    def sample(self, logits, params):
        from ..torch_native.sampling import sample
        from .bitmask import apply_token_bitmask

        return sample(logits, params, mask_tokens=apply_token_bitmask)
