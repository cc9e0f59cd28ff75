"""`linear` as SmoothGEMM: M (the step's token count) cut into fixed row tiles.

Every product runs on a tile of at most `m_tile` rows of x, read and written
in place (views, no copies); M is padded only virtually, so the last tile
computes just its real rows. On Ascend a GEMM's kernel and tiling are chosen
per shape: with fixed row tiles a serving run sees a handful of GEMM shapes
per layer instead of one per distinct batch size. The row tiles come from the
planner's SmoothGEMM Token-Table (`infer.core.xy_plan.linear_table`).

npu_weight_quant_batchmatmul takes K and N in [1, 65535]: a quantized weight
is prepared as column chunks of at most `N_CHUNK` outputs (a 152k-vocabulary
lm_head is three products per row tile), and one with K > 65535 or groups the
op refuses (not a multiple of 32) runs torch's quantized linear instead.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...core import xy_plan
from ...primitives.types import DenseWeight, Int4GroupWeight, Int8GroupWeight, WeightHandle
from ...primitives.torch_tensors import TORCH_DTYPES
from ..torch_native import quant_linear as torch_quant
from .availability import torch_npu

# Rows per GEMM tile. Decode batches up to this size are one product.
M_TILE = 512
# npu_weight_quant_batchmatmul's K and N range is [1, 65535].
MAX_KN = 65535
# Output columns per quantized product: the largest multiple of 64 within MAX_KN.
N_CHUNK = MAX_KN // 64 * 64


def row_tiles(num_tokens: int, m_tile: int = M_TILE) -> list[tuple[int, int]]:
    """(start, real rows) of each M tile."""
    table = xy_plan.linear_table("linear", num_tokens, 1, m_tile=m_tile, n_tile=1)
    return list(zip(table.start.tolist(), table.token_num.tolist()))


@dataclass(frozen=True, slots=True)
class WeightQuant:
    """A quantized handle as npu_weight_quant_batchmatmul takes it: ``(weight + offset) * scale``
    with weight [K, N] int8 and per-group (or per-channel) scale/offset [K/G or 1, N] in the
    activation dtype."""

    weight: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    group: int  # 0: per channel


@dataclass(frozen=True, slots=True)
class QuantChunks:
    """A prepared quantized weight: its output columns cut into products the op accepts."""

    starts: tuple[int, ...]  # first output column of each chunk
    parts: tuple[WeightQuant, ...]


def wqbmm_takes(w: WeightHandle) -> bool:
    """Whether npu_weight_quant_batchmatmul's documented constraints admit `w`: K and N in
    [1, 65535] (N is cut into chunks) and groups a multiple of 32, or one group spanning K.
    Others (GGUF Q6_K and Q3_K's groups of 16, K past the limit) run torch's quantized linear."""
    g = getattr(w, "group_size", 0)
    return w.in_features <= MAX_KN and (g >= w.in_features or g % 32 == 0)


def _centred(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, g: int):
    """``q * s + o`` as ``(q' + o') * s'`` with int8 q' = q - c and a small o' = c + o / s:
    the op rounds o' to the activation dtype, so each group's integer centre c = round(-o / s)
    (clamped so that every q - c of the group fits int8) moves the bulk of the offset
    into the exact integers. A group whose scale is 0 (all its weights equal o) becomes
    q' = 0, scale o, offset 1, which is exact."""
    n, k = q.shape
    flat = scale == 0
    ratio = offset / torch.where(flat, 1.0, scale)
    grouped = q.view(n, -1, g).to(torch.int32)
    qmin, qmax = grouped.amin(-1), grouped.amax(-1)
    c = torch.round(-ratio).clamp(min=qmax.float() - 127, max=qmin.float() + 128).to(torch.int32)
    c = torch.where(flat, 0, c)
    q = (grouped - c[..., None]).view(n, k).to(torch.int8)
    q = q.masked_fill(flat.repeat_interleave(g, dim=1)[:, :k], 0)
    new_offset = torch.where(flat, torch.ones_like(offset), c.float() + ratio)
    return q, torch.where(flat, offset, scale), new_offset


def prepare_weight(w: WeightHandle) -> WeightHandle:
    """int8 group (Q8_0, Q5_0, Q6_K ...): ``q * s``, with offsets ``(q' + o') * s`` (`_centred`).
    int4 group: ``q * s + o``, the nibbles as int8 and centred the same way (0 for GPTQ/AWQ
    zero points of 8, about 0.5 for GGUF Q4_1's minimum), so the offset's rounding error is small."""
    if isinstance(w, DenseWeight) or w.prepared is not None or not wqbmm_takes(w):
        return w  # torch's quantized linear runs it (see _quant_linear)
    dtype = TORCH_DTYPES[w.dtype]
    n, k, g = w.out_features, w.in_features, w.group_size
    if isinstance(w, Int8GroupWeight):
        q, scale, offset = w.qweight.to(torch.int8), w.scales.float(), None
        if w.offsets is not None:
            q, scale, offset = _centred(q, scale, w.offsets.float(), g)
    elif isinstance(w, Int4GroupWeight):
        q = torch.stack((w.qweight & 15, w.qweight >> 4), -1).view(n, k).to(torch.int8)
        q, scale, offset = _centred(q, w.scales.float(), w.offsets.float(), g)
    else:
        raise TypeError(f"ascend linear: no npu_weight_quant_batchmatmul form for {w.kind!r} weights")
    group = 0 if g >= k else g  # one group spanning K: per channel
    starts = tuple(range(0, n, N_CHUNK))
    # [K, N] weight and [K/G or 1, N] tables, each chunk its own contiguous copy (the op takes no column slices).
    cols = lambda t, c: t[c:c + N_CHUNK].t().contiguous()  # noqa: E731
    parts = tuple(WeightQuant(cols(q, c), cols(scale, c).to(dtype),
                              cols(offset, c).to(dtype) if offset is not None else None, group) for c in starts)
    return dataclasses.replace(w, prepared=QuantChunks(starts, parts))


def _quant_product(x: torch.Tensor, p: WeightQuant) -> torch.Tensor:
    return torch_npu().npu_weight_quant_batchmatmul(x, p.weight, p.scale, p.offset, antiquant_group_size=p.group)


def linear(x: torch.Tensor, weight: WeightHandle) -> torch.Tensor:
    """The `linear` primitive: SmoothGEMM tiles of M_TILE rows."""
    return tiled_linear(x, weight, M_TILE)


def tiled_linear(x: torch.Tensor, weight: WeightHandle, m_tile: int) -> torch.Tensor:
    if not isinstance(weight, DenseWeight):
        return _quant_linear(x, weight, m_tile)
    t = x.shape[0]
    if t <= m_tile:
        return F.linear(x, weight.weight, weight.bias)
    out = torch.empty(t, weight.out_features, dtype=x.dtype, device=x.device)
    for start, rows in row_tiles(t, m_tile):
        torch.matmul(x[start:start + rows], weight.weight.t(), out=out[start:start + rows])
    if weight.bias is not None:
        out += weight.bias
    return out


def _quant_linear(x: torch.Tensor, weight: WeightHandle, m_tile: int) -> torch.Tensor:
    if not wqbmm_takes(weight):
        return torch_quant.linear(x, weight)
    p = weight.prepared
    if not isinstance(p, QuantChunks):
        raise ValueError("ascend linear: a quantized weight must go through the backend's prepare_weight first")
    t = x.shape[0]
    out = torch.empty(t, weight.out_features, dtype=x.dtype, device=x.device)
    for start, rows in row_tiles(t, m_tile) if t else ():
        xs = x[start:start + rows]
        if len(p.parts) == 1:
            out[start:start + rows] = _quant_product(xs, p.parts[0])
            continue
        for col, part in zip(p.starts, p.parts):
            out[start:start + rows, col:col + part.weight.shape[1]] = _quant_product(xs, part)
    if weight.bias is not None:
        out += weight.bias.to(x.dtype)
    return out
