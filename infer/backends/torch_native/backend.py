"""`TorchBackend`: the primitives of this folder behind the `Backend` interface."""

from __future__ import annotations

from typing import Any

from ...primitives.backend import Support
from ...primitives.types import FLOAT_DTYPES, QUANTIZED_KINDS, AttentionMetadata, WeightHandle
from . import collectives, fused, native, ops, quant_linear
from .attention import attention, kv_write, lazy_plan
from .moe import moe
from .plumbing import TorchPlumbing
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


class TorchBackend(TorchPlumbing):
    name = "torch"
    description = "plain PyTorch on any torch device (cpu by default); the fallback other torch backends inherit"
    dist_backend = _DistBackend()
    preferred_block_size = 16
    dtypes = FLOAT_DTYPES
    weight_kinds = ("dense", *QUANTIZED_KINDS)
    kv_cache_dtypes = ("auto", "fp8")
    fallback = None

    # -- plumbing -------------------------------------------------------------
    def prepare_metadata(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Device copies of the step's metadata plus its attention plan (built on the host when first needed)."""
        out = super().prepare_metadata(meta)
        out.backend_data = lazy_plan(meta.query_start_loc, meta.seq_lens, self.device)
        return out

    def keeps_quantized(self, dtype: str) -> bool:
        # float32 on CPU: the native GEMVs are exact to float32 rounding, and SmolLM2's
        # Q4_1 GGUF kept quantized decodes ~2x as fast as its dequantized float32 weights.
        cpu = str(self.device).split(":")[0] == "cpu"
        return super().keeps_quantized(dtype) or (cpu and native.library() is not None)

    def fuses(self, node_op: str, **attrs: Any) -> Support:
        # The native attention block and MLP (fused.py) on CPU; each step they cannot
        # serve (see there) runs the node's primitives.
        if node_op not in ("attention", "mlp"):
            return Support(False, f"backend '{self.name}' fuses attention and mlp nodes only")
        if str(self.device).split(":")[0] != "cpu" or native.library() is None:
            return Support(False, f"the native kernels are not in use ({native.status()})")
        return Support(True)

    fused_attention = staticmethod(fused.attention)
    fused_mlp = staticmethod(fused.mlp)

    def prepare_weight(self, weight: WeightHandle) -> WeightHandle:
        return quant_linear.prepare_any(weight)

    # -- primitives -------------------------------------------------------------
    embedding = staticmethod(quant_linear.embedding_any)
    rms_norm = staticmethod(ops.rms_norm)
    rotary = staticmethod(ops.rotary)
    act_and_mul = staticmethod(ops.act_and_mul)
    linear = staticmethod(quant_linear.linear_any)
    kv_write = staticmethod(kv_write)
    attention = staticmethod(attention)
    moe = staticmethod(moe)
    sample = staticmethod(sample)
    all_reduce = staticmethod(collectives.all_reduce)
    all_gather = staticmethod(collectives.all_gather)
