"""The view the quantized HF checkpoint readers share (`quant_hf`, `quant_ct`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...primitives.dequant import dequantize
from ...primitives.types import WeightHandle


class QuantizedView:
    """A checkpoint whose quantized modules read as one ``.weight`` each (a handle from
    `read_quantized`, or float32 from `read`); everything else reads as stored. A subclass
    sets ``_ckpt``, ``_quantized`` (the module names) and `_parts` and reads the handles."""

    _ckpt: Any
    _quantized: Any  # a set or dict of module names

    def _parts(self, base: str) -> tuple[str, ...]:
        raise NotImplementedError

    def read_quantized(self, name: str) -> WeightHandle | None:
        raise NotImplementedError

    def __getattr__(self, attr: str) -> Any:  # format, path, config, tokenizer ...
        return getattr(self._ckpt, attr)

    def _base(self, name: str) -> str | None:
        base = name.removesuffix(".weight")
        return base if name.endswith(".weight") and base in self._quantized else None

    def nbytes(self, name: str) -> int:
        base = self._base(name)
        if base is None:
            return self._ckpt.nbytes(name)
        return sum(self._ckpt.nbytes(f"{base}.{p}") for p in self._parts(base) if f"{base}.{p}" in self._ckpt.names)

    def read(self, name: str) -> np.ndarray:
        handle = self.read_quantized(name)
        return self._ckpt.read(name) if handle is None else dequantize(handle).astype(np.float32)

    def read_slice(self, name: str, axis: int, start: int, stop: int) -> np.ndarray:
        """A slice of a float tensor as stored; a quantized one is dequantized whole, then sliced."""
        if self._base(name) is None:
            from .moe_layout import slice_of

            return slice_of(self._ckpt, name, axis, start, stop)
        return np.ascontiguousarray(self.read(name)[(slice(None),) * axis + (slice(start, stop),)])
