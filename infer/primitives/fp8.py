"""fp8 e4m3fn in NumPy: the format the contract stores fp8 weights and KV in.

NumPy has no fp8 dtype, so fp8 values travel as their uint8 bit patterns
(sign, 4 exponent bits with bias 7, 3 mantissa bits; exponent 0 is
subnormal; 0x7F/0xFF are NaN and there is no infinity: the largest finite
value is 448). Encoding rounds to nearest, ties to the even code, and
saturates at +-448 as vLLM's ``scaled_fp8_quant`` does (a plain cast would
make NaN of anything past 448).
"""

from __future__ import annotations

import numpy as np

E4M3_MAX = 448.0


def _decode_table() -> np.ndarray:
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp, man = (codes >> 3) & 0xF, codes & 0x7
    value = np.where(exp == 0, man / 8.0 * 2.0**-6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    value = sign * value
    value[(codes & 0x7F) == 0x7F] = np.nan
    return value.astype(np.float32)


DECODE = _decode_table()  # code -> float32 value
# The non-negative finite values in code order, which is also value order.
_POSITIVE = DECODE[:0x7F].astype(np.float64)


def e4m3_decode(codes: np.ndarray) -> np.ndarray:
    """float32 values of uint8 e4m3fn codes."""
    return DECODE[np.asarray(codes, dtype=np.uint8)]


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """uint8 e4m3fn codes of `x`: nearest value (ties to the even code), saturated at +-448; NaN to a NaN code."""
    x = np.asarray(x, dtype=np.float64)
    mag = np.minimum(np.abs(x), E4M3_MAX)
    hi = np.clip(np.searchsorted(_POSITIVE, mag), 1, len(_POSITIVE) - 1)
    lo = hi - 1
    d_lo, d_hi = mag - _POSITIVE[lo], _POSITIVE[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo).astype(np.uint8)
    code = np.where(np.isnan(x), 0x7F, code).astype(np.uint8)  # NaN stays NaN (torch's cast agrees)
    return np.where(np.signbit(x), code | 0x80, code).astype(np.uint8)


def quantize_per_channel(w: np.ndarray, per_tensor: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(codes [N, K], scales [N] or [1]) with ``scale = amax / 448`` so each row
    (or the whole tensor) uses fp8's full range, as vLLM's online fp8 does."""
    w = np.asarray(w, dtype=np.float32)
    amax = np.abs(w).max(axis=None if per_tensor else 1, keepdims=True).astype(np.float64)
    scales = np.where(amax > 0, amax / E4M3_MAX, 1.0)
    codes = e4m3_encode(w / scales)
    return codes, scales.reshape(-1).astype(np.float32)
