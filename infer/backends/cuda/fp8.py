"""e4m3fn codes in Triton: encoding for `kv_write`, decoding for `attention` and `linear`.

Encoding uses integer and float32 ops only: Triton's own cast to
``tl.float8e4nv`` needs sm_89 or newer (not the A100) and, in the interpreter,
rounds differently from torch. `e4m3_encode` gives the contract's codes
(`infer.primitives.fp8`: nearest, ties to even, saturated at +-448) on every
target and in the interpreter alike.

Decoding has two forms, both exact for every finite code (`native_fp8` picks):

* native (sm_89+: Ada, Hopper; and the interpreter): the GPU's own conversion,
  two codes per instruction, the value itself (the interpreter reads NaN codes
  as 480, the hardware as NaN);
* bits (the A100 and older): the code's exponent and mantissa bits placed in a
  float16's fields, which is the value times 2^-8 (the two formats' exponent
  biases differ by 8), subnormal codes included, in three integer ops. NaN
  codes read as 480 here.

Either way the result is a float16, and callers fold `fp8_rescale(native)` into
a scale they multiply by anyway. Per-element integer work matters: at one byte
per value a decode step streams codes as fast as HBM delivers them, and a few
ALU ops per code are already about that budget.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch import interpreting


@functools.lru_cache(maxsize=None)
def native_fp8(device: torch.device) -> bool:
    """Whether kernels on `device` decode e4m3 with the hardware conversion. The
    interpreter's conversion is exact for every finite code, so it runs that path."""
    device = torch.device(device)
    if device.type != "cuda":
        return interpreting()
    return torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_rescale(native: bool) -> float:
    """What `e4m3_to_f16(code, native)` is multiplied by to give the code's value."""
    return 1.0 if native else 256.0


@triton.jit
def e4m3_to_f16(code, NATIVE: tl.constexpr):
    """float16 of uint8 e4m3fn codes: the value (NATIVE) or the value * 2^-8 (bits), exact."""
    if NATIVE:
        return code.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:
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
