"""MXFP4 (`Mxfp4Weight`) in torch: codes and E8M0 exponents to the values they stand for.

On CPU a 2-D weight becomes, at prepare, the int8 group weight of the same
matrix (the E2M1 values doubled are the integers -12..12, the exponent's power
of two halved is the group's float32 scale: exact), so `linear` takes the
native integer GEMVs, whose 5-bit packing holds those 25 codes. Expert stacks
stay as stored (4.25 bits a value); `moe` dequantizes the experts a step
routes tokens to, one at a time, into the activations' dtype.
"""

from __future__ import annotations

import torch

from ...primitives.types import MXFP4_VALUES, Int8GroupWeight, Mxfp4Weight

_LUT: dict[torch.device, torch.Tensor] = {}


def _values(device: torch.device) -> torch.Tensor:
    lut = _LUT.get(device)
    if lut is None:
        lut = _LUT[device] = torch.tensor(MXFP4_VALUES, dtype=torch.float32, device=device)
    return lut


def codes(qweight: torch.Tensor) -> torch.Tensor:
    """[..., N, K/2] uint8 -> [..., N, K] uint8 codes (low nibble first)."""
    return torch.stack((qweight & 15, qweight >> 4), -1).flatten(-2)


def block_scales(scales: torch.Tensor, halve: bool = False) -> torch.Tensor:
    """E8M0 exponents [...] uint8 -> float32 2^(e - 127) (2^(e - 128) with `halve`), built from
    their bits so every one is exact (2^-127 and 2^-128 are float32 subnormals); 255 is NaN."""
    e = scales.to(torch.int32) - int(halve)
    bits = torch.where(e >= 1, e << 23, torch.full_like(e, 0x400000) >> (-e).clamp(max=1))
    bits = torch.where(scales == 255, torch.full_like(e, 0x7FC00000), bits)
    return bits.view(torch.float32)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The matrices [..., N, K] the codes and exponents stand for, in `dtype`."""
    v = _values(qweight.device)[codes(qweight).long()]
    v = v.unflatten(-1, (-1, 32)) * block_scales(scales)[..., None]
    return v.flatten(-2).to(dtype)


def as_int8_groups(w: Mxfp4Weight) -> Int8GroupWeight:
    """The same matrix as an int8 group weight: q = 2 * e2m1 in -12..12, scale = 2^(e - 128)."""
    doubled = (_values(w.qweight.device) * 2).to(torch.int8)
    return Int8GroupWeight(doubled[codes(w.qweight).long()], block_scales(w.scales, halve=True), 32, w.bias, w.dtype)
