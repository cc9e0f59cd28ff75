"""`example`: torch CPU tensors, three primitives of its own, the rest from `torch`.

A partial backend is legal: infer resolves what this class does not define to
its `fallback` backend, whose tensors are the same type. The three primitives
below compute in float32 and round once to the input dtype, as the contract's
reductions require. Only public API is used: `infer.primitives` (the contract)
and `infer.primitives.torch_tensors.TorchTensors` (a `Backend` whose tensor
plumbing for torch is written).
"""

from __future__ import annotations

import math

import torch

from infer.primitives.torch_tensors import TorchTensors
from infer.primitives import FLOAT_DTYPES


class ExampleBackend(TorchTensors):
    name = "example"
    description = "out-of-tree example: embedding, rms_norm and act_and_mul of its own; torch for the rest"
    dtypes = FLOAT_DTYPES
    preferred_block_size = 16
    fallback = "torch"

    def embedding(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        # index_select wants int64 or int32 indices; the core may send either.
        return table.index_select(0, ids.to(torch.int64))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual  # the sum is rounded to x's dtype: it is the next residual
        xf = x.float()
        y = xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps) * weight.float()
        y = y.to(x.dtype)
        return y if residual is None else (y, x)

    def act_and_mul(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        gate, up = x.float().chunk(2, dim=-1)
        if kind == "silu":
            act = gate * torch.sigmoid(gate)
        elif kind == "gelu":
            act = 0.5 * gate * (1.0 + torch.erf(gate / math.sqrt(2.0)))
        else:  # gelu_tanh; spec.check_act_and_mul has already rejected other kinds
            act = 0.5 * gate * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (gate + 0.044715 * gate**3)))
        return (act * up).to(x.dtype)
