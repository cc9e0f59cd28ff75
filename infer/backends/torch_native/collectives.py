"""Tensor-parallel collectives over torch.distributed (gloo on CPU, nccl on CUDA).

With no process group initialised, or a world of one, both are identities, so
a single-process engine needs no distributed setup.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def world_size(group=None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def all_reduce(x: torch.Tensor, group=None) -> torch.Tensor:
    if world_size(group) == 1:
        return x
    # A copy: the contract returns the sum and does not allow clobbering x.
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


def all_gather(x: torch.Tensor, dim: int = 0, group=None) -> torch.Tensor:
    n = world_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)
