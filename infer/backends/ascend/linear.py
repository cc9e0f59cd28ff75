"""`linear` as SmoothGEMM: M (the step's token count) cut into fixed row tiles.

Every product runs on a tile of at most `m_tile` rows of x, read and written
in place (views, no copies); M is padded only virtually, so the last tile
computes just its real rows. On Ascend a GEMM's kernel and tiling are chosen
per shape: with fixed row tiles a serving run sees a handful of GEMM shapes
per layer instead of one per distinct batch size. The row tiles come from the
planner's SmoothGEMM Token-Table (`infer.core.xy_plan.linear_table`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...core import xy_plan
from ...primitives.types import DenseWeight

# Rows per GEMM tile. Decode batches up to this size are one product.
M_TILE = 512


def row_tiles(num_tokens: int, m_tile: int = M_TILE) -> list[tuple[int, int]]:
    """(start, real rows) of each M tile."""
    table = xy_plan.linear_table("linear", num_tokens, 1, m_tile=m_tile, n_tile=1)
    return list(zip(table.start.tolist(), table.token_num.tolist()))


def linear(x: torch.Tensor, weight: DenseWeight, m_tile: int = M_TILE) -> torch.Tensor:
    t = x.shape[0]
    if t <= m_tile:
        return F.linear(x, weight.weight, weight.bias)
    out = torch.empty(t, weight.out_features, dtype=x.dtype, device=x.device)
    for start, rows in row_tiles(t, m_tile):
        torch.matmul(x[start:start + rows], weight.weight.t(), out=out[start:start + rows])
    if weight.bias is not None:
        out += weight.bias
    return out
