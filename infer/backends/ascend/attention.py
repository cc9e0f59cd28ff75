"""Paged KV write and Meta-Attention on torch_npu, driven by the XY-Serve planner's tiles.

Cache layout (vllm-ascend's): one tensor ``[2, num_blocks, block_size, Hk, D]``
per layer; ``cache[0]`` / ``cache[1]`` are the ``[num_blocks, block_size, Hk, D]``
key and value caches npu_scatter_pa_kv_cache writes, and their
``[num_blocks, block_size, Hk*D]`` views are what npu_fused_infer_attention_score
reads through a block table.

Attention: the planner cuts every request's query rows into fixed-shape tiles,
each with the context its last row sees (`infer.core.xy_plan`). With the
bottom-right causal mask (sparse_mode=3) a tile is a complete attention problem
of its own, so the tiles, in row order, are the batch entries of one TND call:
``actual_seq_lengths`` are the cumulative tile sizes, ``actual_seq_lengths_kv``
the tiles' context lengths, and each tile reads its request's block-table row.
A long prefill becomes many short-query entries with growing contexts, a
decode one entry: the shapes the kernel splits across cores stay bounded.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from ...core import xy_plan
from ...primitives.types import AttentionMetadata, AttentionPlan
from ..torch_native import attention as torch_attention
from .availability import torch_npu

# The fused kernel's paged-attention block sizes (128 to 512 in steps of 128).
FUSED_BLOCK_SIZES = (128, 256, 384, 512)
# sparse_mode=3 takes this fixed mask: 1 strictly above the diagonal.
MASK_SIZE = 2048


@dataclass(slots=True)
class AscendStepPlan(AttentionPlan):
    """Per-step data every layer's attention shares, built once from the host arrays."""

    tiles: xy_plan.TokenTable  # the attention Token-Table (the Task-Table is the kernel's own business)
    tile_ends: list[int]  # actual_seq_lengths: cumulative tile sizes
    tile_kv_lens: list[int]  # actual_seq_lengths_kv
    tile_requests: torch.Tensor  # [tiles] request of each tile, on the device
    torch_plan: torch_attention.LazyPlan  # the torch ops' plan (grouped on first use) for what the kernel declines
    _tile_table: torch.Tensor | None = None  # block-table rows per tile, gathered by the step's first layer
    _table_of: object = None  # ...from this block table

    def tile_block_table(self, block_table: torch.Tensor) -> torch.Tensor:
        if self._table_of is not block_table:
            self._tile_table = block_table.index_select(0, self.tile_requests).to(torch.int32).contiguous()
            self._table_of = block_table
        return self._tile_table


def plan_step(query_start_loc, seq_lens, device) -> AscendStepPlan:
    """The step's tiles from host metadata (NumPy); the per-tile request ids moved to `device`."""
    table = xy_plan.attention_table(query_start_loc, seq_lens)
    ends = np.cumsum(table.token_num).tolist()
    reqs = torch.from_numpy(table.request.copy()).to(device)
    return AscendStepPlan(table, [int(e) for e in ends], [int(k) for k in table.kv_len], reqs,
                          torch_attention.lazy_plan(query_start_loc, seq_lens))


def kv_write(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, scales=None) -> None:
    if scales is not None:
        raise NotImplementedError("kv_write: backend 'ascend' has no quantized KV cache yet; allocate the cache in the "
                                  "model dtype and pass scales=None")
    slots = slot_mapping
    keep = slots >= 0
    # The op takes slots in [0, blocks*block_size): padded rows (-1) are dropped first.
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    if slots.numel() == 0:
        return
    torch_npu().npu_scatter_pa_kv_cache(k.to(kv_cache.dtype).contiguous(), v.to(kv_cache.dtype).contiguous(),
                                        kv_cache[0], kv_cache[1], slots.contiguous())


_MASKS: dict[str, torch.Tensor] = {}


def causal_mask(device) -> torch.Tensor:
    """The 2048 x 2048 mask sparse_mode=3 expects (made once per device)."""
    key = str(device)
    if key not in _MASKS:
        _MASKS[key] = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool), diagonal=1).to(device)
    return _MASKS[key]


def fused_ok(kv_cache: torch.Tensor) -> bool:
    return int(kv_cache.shape[2]) in FUSED_BLOCK_SIZES


def attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
              sliding_window: int | None = None, soft_cap: float | None = None,
              kv_scales: tuple[float, float] | None = None) -> torch.Tensor:
    if kv_scales is not None:
        raise ValueError("attention: backend 'ascend' has no fp8 KV cache (it declares kv_cache_dtypes "
                                  "('auto',)); allocate the cache in the model dtype")
    step = meta.plan
    if step is None:  # metadata built by hand, not by prepare_metadata: plan from its arrays (a device sync)
        step = plan_step(*_host_meta(meta), q.device)
    if sliding_window is not None or soft_cap is not None or not fused_ok(kv_cache) or q.dtype == torch.float32:
        # Declined in `supports` when the core can know it; a block size the
        # kernel does not page by is only known here. torch's ops run instead.
        return torch_attention.attention(q, kv_cache, replace(meta, plan=step.torch_plan), scale,
                                         sliding_window, soft_cap)
    t, hq, d = q.shape
    if t == 0:
        return torch.empty_like(q)
    nb, bs, hk, _ = kv_cache.shape[1:]
    out, _ = torch_npu().npu_fused_infer_attention_score(
        q.contiguous(), kv_cache[0].view(nb, bs, hk * d), kv_cache[1].view(nb, bs, hk * d),
        atten_mask=causal_mask(q.device), block_table=step.tile_block_table(meta.block_table),
        actual_seq_lengths=step.tile_ends, actual_seq_lengths_kv=step.tile_kv_lens,
        num_heads=hq, num_key_value_heads=hk, scale=scale, input_layout="TND", sparse_mode=3, block_size=bs,
    )
    return out


def _host_meta(meta: AttentionMetadata) -> tuple[np.ndarray, np.ndarray]:
    """query_start_loc and seq_lens as host arrays (one sync when metadata came without a plan)."""
    def host(x):
        return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)

    return host(meta.query_start_loc), host(meta.seq_lens)
