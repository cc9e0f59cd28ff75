"""`TorchBackend`: the primitives of this folder behind the `Backend` interface."""

from __future__ import annotations

from typing import Any

from ...primitives.backend import FastPath, Support
from ...primitives.types import ACT_QUANTS, EXPERT_WEIGHT_KINDS, FLOAT_DTYPES, QUANTIZED_KINDS, AttentionMetadata, WeightHandle
from . import act_quant, collectives, fast_paths, fused, native, ops, quant_linear
from .attention import LazyPlan, attention, encoder_attention, kv_write, lazy_plan, mla_attention, mla_kv_write
from .lora import lora
from .moe import moe
from ...primitives.torch_tensors import TorchTensors
from .sampling import sample


class _DistBackend:
    """``dist_backend`` that follows the instance's device type (nccl on cuda, hccl on npu, else gloo).

    Read on the class (as `infer backends` does) it gives the CPU default.
    """

    BY_DEVICE_TYPE = {"cuda": "nccl", "npu": "hccl"}

    def __get__(self, backend, owner=None) -> str:
        if backend is None:
            return "gloo"
        return self.BY_DEVICE_TYPE.get(str(backend.device).split(":")[0], "gloo")


class TorchBackend(TorchTensors):
    name = "torch"
    description = "plain PyTorch on any torch device (cpu by default); the fallback other torch backends inherit"
    dist_backend = _DistBackend()
    preferred_block_size = 16
    dtypes = FLOAT_DTYPES
    weight_kinds = ("dense", *QUANTIZED_KINDS)
    expert_weight_kinds = EXPERT_WEIGHT_KINDS
    act_quants = ACT_QUANTS  # act_quant.py
    kv_cache_dtypes = ("auto", "fp8")
    fallback = None

    # -- plumbing -------------------------------------------------------------
    def plan_attention(self, meta: AttentionMetadata) -> LazyPlan:
        """What the native kernels read now; the torch ops' grouping when a step first needs it."""
        return lazy_plan(meta.query_start_loc, meta.seq_lens)

    def _native_kernels(self) -> bool:
        return str(self.device).split(":")[0] == "cpu" and native.library() is not None

    def fast_path(self, primitive: str, **kw: Any) -> FastPath | None:
        # The native C kernels on CPU (fast_paths.py); each declines what it has no kernel for.
        if kw.get("act_quant") is not None:
            return None  # the native GEMMs are weight-only
        if primitive == "linear" and kw.get("weight_kind") not in fast_paths.QUANTIZED_LINEAR_KINDS and not (
                kw.get("weight_kind") == "dense" and kw.get("dtype") == "bfloat16" and native.bf16_dot()):
            return None
        if primitive == "moe" and not (kw.get("dtype") == "bfloat16" and native.bf16_dot()):
            return None  # its fast path is the bf16 GEMV's
        return fast_paths.NATIVE.get(primitive) if self._native_kernels() else None

    def auto_dtype(self, stored: str | None, loaded: str) -> str:
        # A bf16 checkpoint on a CPU with AVX512-BF16: the native bf16 GEMV and fused layers
        # decode it ~2.6x faster than float32, and oneDNN's bf16 GEMM runs batches faster too
        # (docs/backends/torch-measurements.md).
        if stored == "bfloat16" and loaded == "float32" and self._native_kernels() and native.bf16_dot():
            return "bfloat16"
        return loaded

    def pooling_dtype(self, dtype: str) -> str:
        # An encoder's batch is all GEMMs of many rows: oneDNN's bf16 GEMM on AVX512-BF16 runs
        # them ~2x faster than float32 (benchmarks/pooling.py); generation keeps the checkpoint's
        # dtype, where float32 decides greedy text.
        if dtype == "float32" and self._native_kernels() and native.bf16_dot():
            return "bfloat16"
        return dtype

    def keeps_quantized(self, dtype: str) -> bool:
        # float32 on CPU: the native GEMVs are exact to float32 rounding and read a
        # quarter of the bytes (docs/quantization.md has the measured decode speeds).
        return super().keeps_quantized(dtype) or self._native_kernels()

    def fuses(self, node_op: str, **attrs: Any) -> Support:
        # The native attention block and MLP (fused.py) on CPU; each step they cannot
        # serve (see there) runs the node's primitives.
        if node_op not in ("attention", "mlp", "mla_attention"):
            return Support(False, f"backend '{self.name}' fuses attention, mla_attention and mlp nodes only")
        if not self._native_kernels():
            return Support(False, f"the native kernels are not in use ({native.status()})")
        return Support(True)

    fused_attention = staticmethod(fused.attention)
    fused_mla_attention = staticmethod(fused.mla_attention)
    fused_mlp = staticmethod(fused.mlp)

    def prepare_weight(self, weight: WeightHandle) -> WeightHandle:
        # Not the native kernels' re-layout: their GEMMs (and the fused layers that find it) are weight-only.
        if getattr(weight, "act_quant", None) is not None:
            return act_quant.prepare_weight(weight)
        return quant_linear.prepare_any(weight)

    @staticmethod
    def linear(x, weight):
        if getattr(weight, "act_quant", None) is not None:
            return act_quant.linear(x, weight)
        return quant_linear.linear_any(x, weight)

    # -- primitives -------------------------------------------------------------
    embedding = staticmethod(quant_linear.embedding_any)
    rms_norm = staticmethod(ops.rms_norm)
    layer_norm = staticmethod(ops.layer_norm)
    activation = staticmethod(ops.activation)
    encoder_attention = staticmethod(encoder_attention)
    pool = staticmethod(ops.pool)
    rotary = staticmethod(ops.rotary)
    act_and_mul = staticmethod(ops.act_and_mul)
    kv_write = staticmethod(kv_write)
    attention = staticmethod(attention)
    mla_kv_write = staticmethod(mla_kv_write)
    mla_attention = staticmethod(mla_attention)
    moe = staticmethod(moe)
    lora = staticmethod(lora)

    def sample(self, logits, params):
        return sample(logits, params)

    all_reduce = staticmethod(collectives.all_reduce)
    all_gather = staticmethod(collectives.all_gather)
