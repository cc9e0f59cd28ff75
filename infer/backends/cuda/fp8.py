"""e4m3fn codes in Triton, with integer and float32 ops only.

Triton's own ``tl.float8e4nv`` needs sm_89 or newer (not the A100) and, in the
interpreter, rounds differently from torch. These helpers give the contract's
codes (`infer.primitives.fp8`: nearest, ties to even, saturated at +-448) on
every target and in the interpreter alike.

Decoding places a code's exponent and mantissa bits into a float16's fields:
the float16 then holds the code's value times 2^-8 (the two formats' exponent
biases differ by 8), subnormal codes included, exactly. Callers fold the 2^8
into the scale they multiply by anyway, so a decode is three integer ops.
"""

from __future__ import annotations

import triton
import triton.language as tl

# `e4m3_to_f16_scaled(code) * F16_RESCALE` is the code's value.
F16_RESCALE = 256.0


@triton.jit
def e4m3_to_f16_scaled(code):
    """float16 of (uint8 e4m3fn codes) * 2^-8, exact; NaN codes decode as 1.875."""
    c = code.to(tl.uint16)
    bits = ((c & 0x80) << 8) | ((c & 0x7F) << 7)
    return bits.to(tl.float16, bitcast=True)


@triton.jit
def e4m3_encode(x):
    """uint8 e4m3fn codes of float32 `x`: nearest, ties to even, saturated at +-448; NaN keeps a NaN code."""
    sign = ((x.to(tl.int32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
    mag = tl.minimum(tl.abs(x), 448.0)
    bits = mag.to(tl.int32, bitcast=True)
    # Normal codes (mag >= 2^-6): round float32's 23 mantissa bits to 3, ties to even;
    # a carry moves into the exponent by itself. float32 bias 127, e4m3 bias 7.
    rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20
    normal = rounded - (120 << 3)
    # Subnormal codes (mag < 2^-6) count steps of 2^-9: adding 2^23 leaves the
    # value rounded to an integer, ties to even, in the float's low mantissa bits.
    sub = (mag * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(bits >= 0x3C800000, normal, sub)  # 0x3C800000 is 2^-6
    code = tl.where(x != x, 0x7F, code)
    return code.to(tl.uint8) | sign
