"""HF checkpoints quantized by AutoAWQ (GEMM), GPTQ and fp8 (``quant_method: fp8``).

Each quantized projection ``X`` is stored as several tensors; `QuantizedHF`
shows it under the one name the model graph asks for, ``X.weight``, and reads
it as a weight handle (or, through `read`, dequantized to float32).

* AWQ GEMM: ``qweight`` [K, N/8] int32, ``qzeros`` [K/G, N/8] int32,
  ``scales`` [K/G, N] fp16, ``w = (q - z) * s``. Eight 4-bit values per
  int32 along N, interleaved: nibble i (bits 4i) holds column 8c + AWQ_ORDER[i].
* GPTQ (``desc_act: false``): ``qweight`` [K/8, N] int32 packed along K
  (k = 8r + j in bits 4j of row r), ``qzeros`` [K/G, N/8] packed along N in
  order, ``scales`` [K/G, N], ``g_idx`` [K] (k // G). The original ("gptq",
  v1) format stores each zero point minus one (AutoGPTQ's off-by-one, kept for
  compatibility); ``checkpoint_format: gptq_v2`` stores it as is. Symmetric
  checkpoints store zero 8 like any other zero.
* fp8: ``weight`` float8_e4m3fn [N, K] and ``weight_scale`` (one value per
  tensor, or [N] / [N, 1] per channel); ``input_scale`` (static activation
  scales) is ignored: activations stay in the model dtype.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...primitives.types import Fp8Weight, Int4GroupWeight, WeightHandle
from .errors import LoaderError
from .quant_view import QuantizedView

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_PARTS = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales", "g_idx"),
          "fp8": ("weight", "weight_scale", "input_scale")}


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[R, C] int32 -> [R, C, 8] values of its nibbles, lowest bits first."""
    u = np.asarray(packed).astype(np.int64) & 0xFFFFFFFF
    return ((u[..., None] >> (4 * np.arange(8))) & 0xF).astype(np.uint8)


def _pack_rows(q: np.ndarray) -> np.ndarray:
    """[N, K] values 0..15 -> `Int4GroupWeight.qweight` [N, K/2]."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)


def _group(group: int, k: int) -> int:
    """The group size of the handle: ``group_size`` -1 (or 0) in the config means one group per row."""
    return k if group <= 0 else group


def _affine(q_kn: np.ndarray, zeros: np.ndarray, scales: np.ndarray, group: int) -> Int4GroupWeight:
    """Handle of ``w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]`` given K-major arrays."""
    group = _group(group, q_kn.shape[0])
    scales = np.asarray(scales, dtype=np.float32)
    offsets = (-zeros.astype(np.float64) * scales).astype(np.float32)
    return Int4GroupWeight(_pack_rows(np.ascontiguousarray(q_kn.T)), np.ascontiguousarray(scales.T),
                           np.ascontiguousarray(offsets.T), group)


def awq_handle(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, group: int) -> Int4GroupWeight:
    inverse = np.argsort(AWQ_ORDER)  # column 8c + j sits in nibble inverse[j]
    q = _nibbles(qweight)[..., inverse].reshape(qweight.shape[0], -1)
    z = _nibbles(qzeros)[..., inverse].reshape(qzeros.shape[0], -1)
    return _affine(q, z, scales, group)


def gptq_handle(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray | None,
                group: int, v1: bool) -> Int4GroupWeight:
    k = qweight.shape[0] * 8
    q = _nibbles(qweight).transpose(0, 2, 1).reshape(k, -1)  # k = 8r + j
    z = _nibbles(qzeros).reshape(qzeros.shape[0], -1).astype(np.int16)
    if v1:
        z = (z + 1) & 0xF  # v1 stores zero - 1 in 4 bits; 8 - 1 = 7 (sym) comes back as 8
    if g_idx is not None and not np.array_equal(np.asarray(g_idx), np.arange(k) // _group(group, k)):
        raise LoaderError("GPTQ checkpoint has act-order (desc_act) groups (g_idx is not k // group_size); "
                          "infer reads desc_act=false GPTQ only: re-quantize with desc_act=false")
    return _affine(q, z, scales, group)


class QuantizedHF(QuantizedView):
    """A view of an HF checkpoint whose quantized projections read as one ``.weight`` each."""

    def __init__(self, ckpt: Any, qconfig: dict[str, Any]):
        self._ckpt, self.qconfig = ckpt, qconfig
        self.method = qconfig["quant_method"]
        self.group = int(qconfig.get("group_size") or 0)
        self.v1 = qconfig.get("checkpoint_format", "gptq") == "gptq"
        stored = set(ckpt.names)
        marker = "weight_scale" if self.method == "fp8" else "qweight"
        self._quantized = {n.rsplit(".", 1)[0] for n in stored if n.endswith("." + marker)}
        parts = {f"{base}.{p}" for base in self._quantized for p in _PARTS[self.method]}
        self.names = [n for n in ckpt.names if n not in parts] + [f"{b}.weight" for b in sorted(self._quantized)]

    def _parts(self, base: str) -> tuple[str, ...]:
        return _PARTS[self.method]

    def stored_type(self, name: str) -> str:
        return self.method if self._base(name) is not None else self._ckpt.stored_type(name)

    def read_quantized(self, name: str) -> WeightHandle | None:
        base = self._base(name)
        if base is None:
            return None
        get = lambda part: self._ckpt.read(f"{base}.{part}")  # noqa: E731
        if self.method == "awq":
            return awq_handle(get("qweight"), get("qzeros"), get("scales"), self.group)
        if self.method == "gptq":
            g_idx = get("g_idx") if f"{base}.g_idx" in self._ckpt.names else None
            return gptq_handle(get("qweight"), get("qzeros"), get("scales"), g_idx, self.group, self.v1)
        scales = np.asarray(get("weight_scale"), dtype=np.float32).reshape(-1)
        return Fp8Weight(np.asarray(get("weight")).view(np.uint8), scales)



def with_quantization(ckpt: Any) -> Any:
    """`ckpt` itself for a float checkpoint, else a `QuantizedHF` view of it (a
    `quant_ct.CompressedTensorsHF` one for compressed-tensors)."""
    qconfig = ckpt.config.get("quantization_config")
    if not qconfig:
        return ckpt
    method = qconfig.get("quant_method")
    if method == "compressed-tensors":
        from .quant_ct import open_compressed_tensors

        return open_compressed_tensors(ckpt, qconfig)
    if method == "mxfp4":
        from .quant_mxfp4 import Mxfp4HF

        return Mxfp4HF(ckpt)
    if method not in _PARTS:
        raise LoaderError(f"{ckpt.path}: quant_method {method!r} is not supported (infer reads awq, gptq, fp8, "
                          "mxfp4, compressed-tensors and GGUF)")
    if method in ("awq", "gptq") and qconfig.get("bits", 4) != 4:
        raise LoaderError(f"{ckpt.path}: {method} with {qconfig.get('bits')} bits; infer reads 4-bit {method} only")
    if method == "awq" and str(qconfig.get("version", "gemm")).lower() != "gemm":
        raise LoaderError(f"{ckpt.path}: AWQ version {qconfig.get('version')!r}; infer reads the GEMM packing only")
    if method == "gptq" and qconfig.get("desc_act"):
        raise LoaderError(f"{ckpt.path}: GPTQ with desc_act=true; infer reads desc_act=false only")
    if method == "fp8" and qconfig.get("weight_block_size"):
        raise LoaderError(f"{ckpt.path}: block-wise fp8 (weight_block_size) is not supported; per-tensor and "
                          "per-channel fp8 are")
    return QuantizedHF(ckpt, qconfig)
