"""Quantized weights for the conformance cases: host fields, and the handle a backend gets.

Codes and scales are random (not quantized from a float matrix): the cases
check that a backend computes with exactly the matrix a handle stands for,
whatever the values. Scales are sized so results stay O(1), like the dense
cases.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..primitives.fp8 import e4m3_encode
from ..primitives.types import Fp8Weight, Int4GroupWeight, Int8GroupWeight, Mxfp4Weight, WeightHandle

QUANT_KINDS = ("int4", "int8", "int8_offset", "int8_token", "fp8", "fp8_tensor", "mxfp4")


def host_fields(rng: np.random.Generator, n: int, k: int, quant: str, group: int = 32) -> dict[str, Any]:
    """NumPy fields of an [n, k] weight in format `quant` (see QUANT_KINDS)."""
    if quant == "int4":
        scales = rng.uniform(0.5, 1.5, (n, k // group)) * k**-0.5 / 4
        # Zero points around the middle of 0..15 (AWQ/GPTQ/Q4_0 style), jittered as Q4_1's min is.
        offsets = -scales * rng.uniform(6.0, 9.0, (n, k // group))
        q = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
        return {"kind": quant, "qweight": q, "scales": scales.astype(np.float32),
                "offsets": offsets.astype(np.float32), "group_size": group}
    if quant == "int8":
        scales = rng.uniform(0.5, 1.5, (n, k // group)) * k**-0.5 / 64
        return {"kind": quant, "qweight": rng.integers(-127, 128, (n, k), dtype=np.int8),
                "scales": scales.astype(np.float32), "group_size": group}
    if quant == "int8_token":  # W8A8: one scale per output channel, activations int8 per token
        scales = rng.uniform(0.5, 1.5, (n, 1)) * k**-0.5 / 64
        return {"kind": quant, "qweight": rng.integers(-127, 128, (n, k), dtype=np.int8),
                "scales": scales.astype(np.float32), "group_size": k, "act_quant": "int8_token"}
    if quant == "int8_offset":  # GGUF Q5_1 / Q5_K's form: d * q + m with q in 0..31, m about -16 d
        scales = rng.uniform(0.5, 1.5, (n, k // group)) * k**-0.5 / 8
        offsets = -scales * rng.uniform(13.0, 18.0, (n, k // group))
        return {"kind": quant, "qweight": rng.integers(0, 32, (n, k), dtype=np.int8),
                "scales": scales.astype(np.float32), "offsets": offsets.astype(np.float32), "group_size": group}
    if quant in ("fp8", "fp8_tensor"):
        codes = e4m3_encode(rng.standard_normal((n, k)) * 64.0)
        count = 1 if quant == "fp8_tensor" else n
        scales = rng.uniform(0.5, 1.5, count) * k**-0.5 / 64
        return {"kind": quant, "qweight": codes, "scales": scales.astype(np.float32)}
    if quant == "mxfp4":
        return mxfp4_fields(rng, (n,), k)
    raise ValueError(f"unknown quantized format {quant!r}; expected one of {QUANT_KINDS}")


def mxfp4_fields(rng: np.random.Generator, lead: tuple[int, ...], k: int) -> dict[str, Any]:
    """An MXFP4 stack [*lead, k]: every code, exponents spread over 4 octaves around 2^-4 * k^-0.5
    (E2M1 values reach 6), about one block in eight at 2^-127 (a float32 subnormal) or two octaves above."""
    top = 127 - 4 - int(np.ceil(np.log2(k) / 2))
    e = rng.integers(top - 3, top + 1, (*lead, k // 32))
    e = np.where(rng.random(e.shape) < 1 / 16, 0, np.where(rng.random(e.shape) < 1 / 16, top + 2, e))
    return {"kind": "mxfp4", "qweight": rng.integers(0, 256, (*lead, k // 2), dtype=np.uint8),
            "scales": e.astype(np.uint8)}


def handle(fields: dict[str, Any], asarray, bias: Any, dtype: str) -> WeightHandle:
    """The handle of `fields` with arrays made by `asarray` (a backend's, or NumPy's)."""
    kind = fields["kind"]
    q, s = asarray(fields["qweight"]), asarray(fields["scales"])
    if kind == "int4":
        return Int4GroupWeight(q, s, asarray(fields["offsets"]), fields["group_size"], bias, dtype)
    if kind == "int8":
        return Int8GroupWeight(q, s, fields["group_size"], bias, dtype)
    if kind == "int8_token":
        return Int8GroupWeight(q, s, fields["group_size"], bias, dtype, act_quant=fields["act_quant"])
    if kind == "int8_offset":
        return Int8GroupWeight(q, s, fields["group_size"], bias, dtype, offsets=asarray(fields["offsets"]))
    if kind == "mxfp4":
        return Mxfp4Weight(q, s, bias, dtype)
    return Fp8Weight(q, s, bias, dtype)
