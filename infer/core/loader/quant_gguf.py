"""GGUF Q4_0, Q4_1 and Q8_0 tensors as weight handles, kept quantized.

ggml's blocks (32 values each, along a row; ggml-common.h, gguf-py's quants.py):

* Q4_0: fp16 ``d``, 16 bytes of nibbles; ``w = d * (q - 8)``.
* Q4_1: fp16 ``d``, fp16 ``m``, 16 bytes of nibbles; ``w = d * q + m``.
* Q8_0: fp16 ``d``, 32 int8; ``w = d * q``.

A Q4 block stores value j in the low nibble of byte j and value j + 16 in its
high nibble; `Int4GroupWeight` wants consecutive pairs in a byte, so the
nibbles are re-paired here once, at load. fp16 scales widen to float32
exactly, so the handle stands for exactly the matrix gguf-py dequantizes.
"""

from __future__ import annotations

import numpy as np

from ...primitives.types import Int4GroupWeight, Int8GroupWeight, WeightHandle

BLOCK = 32
# ggml type name -> bytes per block of 32 values
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def _fp16(blocks: np.ndarray, start: int) -> np.ndarray:
    """[rows, nb] float32 from the fp16 at byte `start` of every block."""
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0].astype(np.float32)


def to_handle(data: np.ndarray, type_name: str, rows: int, cols: int) -> WeightHandle | None:
    """The handle of a raw ggml tensor [rows, cols], or None for a type kept as float."""
    if type_name not in BLOCK_BYTES:
        return None
    if cols % BLOCK:
        raise ValueError(f"ggml {type_name} rows must hold whole blocks of {BLOCK}, got {cols} columns")
    nb = cols // BLOCK
    blocks = np.asarray(data, dtype=np.uint8).reshape(rows, nb, BLOCK_BYTES[type_name])
    d = _fp16(blocks, 0)
    if type_name == "Q8_0":
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, cols)
        return Int8GroupWeight(q, d, BLOCK)
    nibbles = blocks[..., 4:] if type_name == "Q4_1" else blocks[..., 2:]  # [rows, nb, 16]
    q = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1).reshape(rows, cols)  # values in order
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
    if type_name == "Q4_1":
        return Int4GroupWeight(packed, d, _fp16(blocks, 2), BLOCK)
    return Int4GroupWeight(packed, d, -8.0 * d, BLOCK)


def permute_rows(handle: WeightHandle, permute) -> WeightHandle:
    """The handle with `permute` (a function of a [rows, ...] array) applied to
    every per-row field: rows are whole rows of blocks, so reordering them
    reorders the matrix's rows without touching its values."""
    import dataclasses

    changes = {f: permute(getattr(handle, f)) for f in ("qweight", "scales", "offsets") if hasattr(handle, f)}
    return dataclasses.replace(handle, **changes)
