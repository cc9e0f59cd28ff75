"""`linear` for W8A8 weights (``act_quant="int8_token"``): vllm-ascend's pair of ops.

``npu_dynamic_quant`` turns each SmoothGEMM row tile of x into int8 codes and
a float32 scale per token (the contract's definition); ``npu_quant_matmul``
multiplies them with the [K, N] int8 weight and applies the channel scales,
the token scales and the bias (float32) in one op, output in x's dtype.
Where the documented constraints do not admit a call (float32 activations,
K past npu_dynamic_quant's 11264, weights with groups or offsets), the torch
backend's implementation runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ...primitives.types import Int8GroupWeight
from ..torch_native import act_quant as torch_act_quant
from .availability import torch_npu
from .linear import M_TILE, row_tiles

MAX_K = 11264  # npu_dynamic_quant's last dim on Atlas A2


@dataclass(frozen=True, slots=True)
class W8A8Weight:
    """An `Int8GroupWeight.prepared` for npu_quant_matmul: weight [K, N] int8, scale [N] float32,
    bias [N] float32 or None."""

    weight: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None


def takes(w: Int8GroupWeight) -> bool:
    return w.group_size == w.in_features and w.offsets is None and w.in_features <= MAX_K


def prepare_weight(w: Int8GroupWeight) -> Int8GroupWeight:
    if not takes(w) or isinstance(w.prepared, W8A8Weight):
        return w
    bias = None if w.bias is None else w.bias.float().contiguous()
    return dataclasses.replace(w, prepared=W8A8Weight(w.qweight.t().contiguous(), w.scales.reshape(-1).float(), bias))


def linear(x: torch.Tensor, w: Int8GroupWeight) -> torch.Tensor:
    p = w.prepared
    if not isinstance(p, W8A8Weight) or x.dtype not in (torch.float16, torch.bfloat16):
        return torch_act_quant.linear(x, w)
    npu = torch_npu()
    out = torch.empty(x.shape[0], w.out_features, dtype=x.dtype, device=x.device)
    for start, rows in row_tiles(x.shape[0], M_TILE) if x.shape[0] else ():
        q, s = npu.npu_dynamic_quant(x[start:start + rows])
        out[start:start + rows] = npu.npu_quant_matmul(q, p.weight, p.scale, pertoken_scale=s, bias=p.bias,
                                                       output_dtype=x.dtype)
    return out
