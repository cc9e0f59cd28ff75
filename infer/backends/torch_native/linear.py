"""`linear` for the torch backend: dense weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...primitives.types import DenseWeight


def prepare_weight(weight: DenseWeight) -> DenseWeight:
    return weight


def linear(x: torch.Tensor, weight: DenseWeight) -> torch.Tensor:
    return F.linear(x, weight.weight, weight.bias)
