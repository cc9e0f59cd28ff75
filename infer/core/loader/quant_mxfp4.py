"""HF checkpoints with MXFP4 experts: gpt-oss's ``quant_method: mxfp4``.

Each expert projection is stored as ``{name}_blocks`` [E, N, K/32, 16] uint8
(two E2M1 codes a byte, the even k in the low nibble) and ``{name}_scales``
[E, N, K/32] uint8 (E8M0 exponents), rows output features: transformers'
`convert_moe_packed_tensors` reads them as ``lut[code] * 2^(scale - 127)``.
That is `Mxfp4Weight`'s layout byte for byte, so the view hands them over as
stored (4.25 bits a value), with gpt-oss's interleaved gate/up rows (gate at
even rows) reordered to gate rows then up rows, as `moe_layout.InterleavedExperts`
does for the float tensors. ``modules_to_not_convert`` (attention, router,
embeddings) are float tensors and read as stored.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from ...primitives.dequant import dequantize
from ...primitives.types import Mxfp4Weight
from .errors import LoaderError

_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")


class Mxfp4HF:
    """A view in which ``...experts.gate_up_proj`` / ``down_proj`` read as `Mxfp4Weight` stacks."""

    def __init__(self, ckpt: Any):
        self._ckpt = ckpt
        stored = set(ckpt.names)
        self._quantized = {n.removesuffix("_blocks") for n in stored
                           if n.endswith("_blocks") and _EXPERTS.search(n.removesuffix("_blocks"))}
        missing = [f"{b}_scales" for b in sorted(self._quantized) if f"{b}_scales" not in stored]
        if missing:
            raise LoaderError(f"{ckpt.path}: MXFP4 blocks without their scales: {', '.join(missing[:3])}")
        parts = {f"{b}_{p}" for b in self._quantized for p in ("blocks", "scales")}
        self.names = [n for n in ckpt.names if n not in parts] + sorted(self._quantized)

    def __getattr__(self, attr: str) -> Any:  # format, path, config, tokenizer ...
        return getattr(self._ckpt, attr)

    def nbytes(self, name: str) -> int:
        if name not in self._quantized:
            return self._ckpt.nbytes(name)
        return self._ckpt.nbytes(f"{name}_blocks") + self._ckpt.nbytes(f"{name}_scales")

    def stored_type(self, name: str) -> str:
        return "mxfp4" if name in self._quantized else self._ckpt.stored_type(name)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._quantized:
            return tuple(self._ckpt.shape(name))
        e, n, blocks, _ = self._ckpt.shape(f"{name}_blocks")
        return (e, n, blocks * 32)

    def read_quantized(self, name: str) -> Mxfp4Weight | None:
        if name not in self._quantized:
            return None
        blocks = np.asarray(self._ckpt.read(f"{name}_blocks"), dtype=np.uint8)
        scales = np.asarray(self._ckpt.read(f"{name}_scales"), dtype=np.uint8)
        e, n, nb, width = blocks.shape
        if width != 16 or scales.shape != (e, n, nb):
            raise LoaderError(f"{self._ckpt.path}: {name}_blocks {list(blocks.shape)} / _scales {list(scales.shape)} "
                              "are not MXFP4's [E, N, K/32, 16] / [E, N, K/32]")
        q = blocks.reshape(e, n, nb * 16)
        if name.endswith("gate_up_proj"):  # interleaved gate/up rows -> gate rows, then up rows
            q = np.concatenate([q[:, 0::2], q[:, 1::2]], axis=1)
            scales = np.concatenate([scales[:, 0::2], scales[:, 1::2]], axis=1)
        return Mxfp4Weight(np.ascontiguousarray(q), np.ascontiguousarray(scales))

    def read(self, name: str) -> np.ndarray:
        handle = self.read_quantized(name)
        return self._ckpt.read(name) if handle is None else dequantize(handle).astype(np.float32)

    def read_slice(self, name: str, axis: int, start: int, stop: int) -> np.ndarray:
        if name not in self._quantized:
            return self._ckpt.read_slice(name, axis, start, stop)
        return np.ascontiguousarray(self.read(name)[(slice(None),) * axis + (slice(start, stop),)])
