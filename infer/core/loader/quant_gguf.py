"""GGUF block-quantized tensors as weight handles, kept quantized.

Every type below is repacked exactly into a handle of the contract
(`Int4GroupWeight`: ``q * scale + offset`` with q in 0..15; `Int8GroupWeight`:
``q * scale (+ offset)`` with int8 q; MXFP4 into `Mxfp4Weight`, its nibbles
reordered, also as a stack of experts [E, N, K]): a block's sub-block scales (and mins)
are products of the block's fp16 ``d`` (``dmin``) and small integers, exact in
float32, so a handle stands for exactly the matrix gguf-py's `dequantize`
gives. Layouts: ggml-common.h, gguf-py's quants.py.

| type | block | handle | per value kept |
| --- | --- | --- | --- |
| Q4_0 ``d * (q - 8)``, Q4_1 ``d * q + m`` | 32 | int4, G 32 | 6 bits |
| Q8_0 ``d * q`` | 32 | int8, G 32 | 9 bits |
| Q5_0 ``d * (q - 16)`` | 32 | int8, G 32 | 9 bits |
| Q5_1 ``d * q + m`` | 32 | int8 + offsets, G 32 | 10 bits |
| Q2_K ``d * sc * q - dmin * m`` (2-bit q) | 256 | int4, G 16 | 8 bits |
| Q3_K ``d * (sc - 32) * q`` (q in -4..3) | 256 | int8, G 16 | 10 bits |
| Q4_K ``d * sc * q - dmin * m`` | 256 | int4, G 32 | 6 bits |
| Q5_K ``d * sc * q - dmin * m`` (5-bit q) | 256 | int8 + offsets, G 32 | 10 bits |
| Q6_K ``d * sc * (q - 32)`` | 256 | int8, G 16 | 10 bits |
| IQ4_NL ``d * kvalues[q]`` | 32 | int8, G 32 | 9 bits |
| IQ4_XS ``d * (ls - 32) * kvalues[q]`` | 256 | int8, G 32 | 9 bits |
| MXFP4 ``e8m0 * e2m1(q)`` | 32 | mxfp4 (the codes and exponents as stored) | 4.25 bits |

The other I-quants (lattice codebooks: IQ1/IQ2/IQ3) and ternary TQ types have
no exact affine form: `to_handle` returns None and the loader dequantizes them.
"""

from __future__ import annotations

import numpy as np

from ...primitives.types import Int4GroupWeight, Int8GroupWeight, Mxfp4Weight, WeightHandle

# Block sizes and byte sizes per block, by ggml type name (gguf's GGML_QUANT_SIZES, by name).
_BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
           "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
           "IQ4_NL": (32, 18), "IQ4_XS": (256, 136), "MXFP4": (32, 17)}
KEPT_TYPES = tuple(_BLOCKS)
IQ4_VALUES = np.array((-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113), np.int8)
MXFP4_VALUES = np.array((0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12), np.int8)  # E2M1, doubled


def _fp16(blocks: np.ndarray, start: int) -> np.ndarray:
    """[rows, nb] float32 from the fp16 at byte `start` of every block."""
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0].astype(np.float32)


def _unpack(b: np.ndarray, width: int, bits: int) -> np.ndarray:
    """The `bits`-wide fields of bytes `b` [..., n], in value order: ggml packs chunks of
    `width` bytes, the chunk's values [s * width + j] in byte j's field s (lowest first)."""
    *lead, n = b.shape
    per = 8 // bits
    shifts = (np.arange(per, dtype=np.uint8) * bits).reshape(per, 1)
    fields = (b.reshape(*lead, n // width, 1, width) >> shifts) & np.uint8((1 << bits) - 1)
    return fields.reshape(*lead, n * per)


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of 6-bit sub-block scales and mins -> ([..., 8], [..., 8])."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _e8m0_half(e: np.ndarray) -> np.ndarray:
    """MXFP4's E8M0 block exponent as ggml reads it: half of 2^(e - 127), as float32 bits."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def _per_sub(block_scale: np.ndarray, sub: np.ndarray) -> np.ndarray:
    """[rows, nb] x [rows, nb, S] -> [rows, nb * S] sub-block scales (exact products)."""
    return (block_scale[..., None] * sub).reshape(sub.shape[0], -1)


def decode(data: np.ndarray, type_name: str, rows: int, cols: int):
    """(q [rows, cols] int, scales, offsets or None, group) of a raw ggml tensor, or None."""
    if type_name not in _BLOCKS:
        return None
    block, nbytes = _BLOCKS[type_name]
    if cols % block:
        raise ValueError(f"ggml {type_name} rows must hold whole blocks of {block}, got {cols} columns")
    b = np.asarray(data, dtype=np.uint8).reshape(rows, cols // block, nbytes)
    t = type_name
    if t in ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "IQ4_NL"):
        d = _fp16(b, 0)
        if t == "Q8_0":
            return b[..., 2:].view(np.int8), d, None, 32
        if t == "Q4_0":
            return _unpack(b[..., 2:], 16, 4), d, -8.0 * d, 32
        if t == "Q4_1":
            return _unpack(b[..., 4:], 16, 4), d, _fp16(b, 2), 32
        if t == "IQ4_NL":
            return IQ4_VALUES[_unpack(b[..., 2:], 16, 4)], d, None, 32
        qh, qs = (b[..., 2:6], b[..., 6:]) if t == "Q5_0" else (b[..., 4:8], b[..., 8:])
        q = (_unpack(qs, 16, 4) | (_unpack(qh, 1, 1) << 4)).astype(np.int8)
        return (q - 16, d, None, 32) if t == "Q5_0" else (q, d, _fp16(b, 2), 32)
    if t == "MXFP4":
        return MXFP4_VALUES[_unpack(b[..., 1:], 16, 4)], _e8m0_half(b[..., 0]), None, 32
    if t == "Q2_K":  # scales 16, qs 64, d, dmin
        sc = b[..., 0:16]
        d, dmin = _fp16(b, 80), _fp16(b, 82)
        return (_unpack(b[..., 16:80], 32, 2), _per_sub(d, (sc & 15).astype(np.float32)),
                -_per_sub(dmin, (sc >> 4).astype(np.float32)), 16)
    if t == "Q3_K":  # hmask 32, qs 64, scales 12, d
        low = _unpack(b[..., 96:104], 8, 4)
        high = _unpack(b[..., 104:108], 4, 2)
        sc = (low | (high << 4)).astype(np.float32) - 32
        q = _unpack(b[..., 32:96], 32, 2).astype(np.int8) - 4 * (1 - _unpack(b[..., 0:32], 32, 1).astype(np.int8))
        return q, _per_sub(_fp16(b, 108), sc), None, 16
    if t in ("Q4_K", "Q5_K"):  # d, dmin, scales 12, (qh 32), qs 128
        d, dmin = _fp16(b, 0), _fp16(b, 2)
        sc, mn = _k_scale_min(b[..., 4:16])
        scales, offsets = _per_sub(d, sc), -_per_sub(dmin, mn)
        if t == "Q4_K":
            return _unpack(b[..., 16:], 32, 4), scales, offsets, 32
        q = (_unpack(b[..., 48:], 32, 4) | (_unpack(b[..., 16:48], 32, 1) << 4)).astype(np.int8)
        return q, scales, offsets, 32
    if t == "Q6_K":  # ql 128, qh 64, scales 16 (int8), d
        q = (_unpack(b[..., 0:128], 64, 4) | (_unpack(b[..., 128:192], 32, 2) << 4)).astype(np.int8) - 32
        return q, _per_sub(_fp16(b, 208), b[..., 192:208].view(np.int8).astype(np.float32)), None, 16
    if t == "IQ4_XS":  # d, scales_h (uint16), scales_l 4, qs 128
        ls = (_unpack(b[..., 4:8], 1, 4) | (_unpack(b[..., 2:4], 1, 2) << 4)).astype(np.float32) - 32
        return IQ4_VALUES[_unpack(b[..., 8:], 16, 4)], _per_sub(_fp16(b, 0), ls), None, 32
    raise AssertionError(t)


def mxfp4_handle(data: np.ndarray, shape: tuple[int, ...]) -> Mxfp4Weight:
    """A raw ggml MXFP4 tensor [..., rows, cols] as `Mxfp4Weight`: ggml's block is the E8M0
    byte, then 16 bytes whose low nibbles are values 0..15 and high nibbles 16..31; the
    handle's byte j holds values 2j (low) and 2j + 1 (high)."""
    *lead, cols = shape
    if cols % 32:
        raise ValueError(f"ggml MXFP4 rows must hold whole blocks of 32, got {cols} columns")
    b = np.asarray(data, dtype=np.uint8).reshape(*lead, cols // 32, 17)
    codes = _unpack(b[..., 1:], 16, 4)  # [..., blocks, 32] in value order
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return Mxfp4Weight(np.ascontiguousarray(packed.reshape(*lead, cols // 2)), np.ascontiguousarray(b[..., 0]))


def to_handle(data: np.ndarray, type_name: str, rows: int, cols: int) -> WeightHandle | None:
    """The handle of a raw ggml tensor [rows, cols], or None for a type kept as float."""
    if type_name == "MXFP4":
        return mxfp4_handle(data, (rows, cols))
    decoded = decode(data, type_name, rows, cols)
    if decoded is None:
        return None
    q, scales, offsets, group = decoded
    q = q.reshape(rows, cols)
    scales = np.ascontiguousarray(scales.reshape(rows, cols // group), dtype=np.float32)
    if offsets is not None:
        offsets = np.ascontiguousarray(offsets.reshape(rows, cols // group), dtype=np.float32)
    if type_name in ("Q4_0", "Q4_1", "Q4_K", "Q2_K"):
        q = q.astype(np.uint8)
        return Int4GroupWeight((q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8), scales, offsets, group)
    return Int8GroupWeight(np.ascontiguousarray(q, dtype=np.int8), scales, group, offsets=offsets)


def permute_rows(handle: WeightHandle, permute) -> WeightHandle:
    """The handle with `permute` (a function of a [rows, ...] array) applied to
    every per-row field: rows are whole rows of blocks, so reordering them
    reorders the matrix's rows without touching its values."""
    import dataclasses

    changes = {f: permute(getattr(handle, f)) for f in ("qweight", "scales", "offsets")
               if getattr(handle, f, None) is not None}
    return dataclasses.replace(handle, **changes)
