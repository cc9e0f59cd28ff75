"""Paged KV write and Meta-Attention on torch_npu, driven by the XY-Serve planner's tiles.

Cache layout (vllm-ascend's): one tensor ``[2, num_blocks, block_size, Hk, D]``
per layer; ``cache[0]`` / ``cache[1]`` are the ND ``[num_blocks, block_size, Hk, D]``
key and value caches npu_scatter_pa_kv_cache writes (``cache_mode="Norm"``: the
op's default, ``"PA_NZ"``, expects NZ caches), and their
``[num_blocks, block_size, Hk*D]`` views are what npu_fused_infer_attention_score
reads through a block table.

Attention: the planner cuts every request's query rows into fixed-shape tiles,
each with the context its last row sees (`infer.core.xy_plan`). With the
bottom-right causal mask (sparse_mode=3) a tile is a complete attention problem
of its own, so the tiles, in row order, are TND batch entries: each call's
``actual_seq_lengths`` are the cumulative tile sizes, ``actual_seq_lengths_kv``
the tiles' context lengths, and each tile reads its request's block-table row.
A long prefill becomes many short-query entries with growing contexts, a
decode one entry: the shapes the kernel splits across cores stay bounded.

The kernel bounds that batch. With a paged cache the blocks its entries read,
``sum(ceil(kv_len / block_size))``, may not exceed the cache's block count, and
TND takes at most 4096 entries. Tiles re-read their request's blocks (a
4096-row prefill's 32 tiles read 1 + 2 + ... + 32 = 528 blocks, where the
request owns 32), and prefix caching lets requests share blocks, so one call
per step cannot be guaranteed. `pack` therefore cuts the entries, in row
order, into as many calls as keep each within both bounds (one call whenever
they fit, which is the common case). A request whose tiles alone read more
blocks than the cache holds is merged back into one entry (query length
``q_len``, well inside the kernel's 20M bound): it reads each of its blocks
once, so it always fits, and the number of calls stays near
``blocks read / cache blocks`` instead of one per tile.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ...core import xy_plan
from ...primitives.types import AttentionMetadata, AttentionPlan
from ..torch_native import attention as torch_attention
from .availability import torch_npu

# The fused kernel's paged-attention block sizes (128 to 512 in steps of 128).
FUSED_BLOCK_SIZES = (128, 256, 384, 512)
# TND without rope takes Q_D = K_D = V_D = 128, or Q_D = K_D = 192 (V_D 128 or 192).
FUSED_HEAD_DIMS = (128, 192)
# TND: at most this many batch entries per call.
MAX_BATCH = 4096
# sparse_mode=3 takes this fixed mask: 1 strictly above the diagonal.
MASK_SIZE = 2048


@dataclass(frozen=True, slots=True)
class FusedCall:
    """One npu_fused_infer_attention_score call: a run of entries and the query rows they own."""

    rows: tuple[int, int]  # query rows [start, end)
    entries: tuple[int, int]  # entries [first, last) of the packed list
    q_ends: list[int]  # actual_seq_lengths, counted from the call's first row
    kv_lens: list[int]  # actual_seq_lengths_kv


@dataclass(frozen=True, slots=True)
class Packing:
    requests: np.ndarray  # [entries] request of each entry (its block-table row)
    calls: list[FusedCall]


def pack(token_num, kv_len, request, num_blocks: int, block_size: int, max_batch: int = MAX_BATCH) -> Packing:
    """The tiles (row order, a request's tiles adjacent) as batch entries cut into calls that each
    read at most `num_blocks` blocks and hold at most `max_batch` entries."""
    token_num, kv_len, request = (np.asarray(a, dtype=np.int64) for a in (token_num, kv_len, request))
    need = -(-kv_len // block_size)
    rows, kvs, reqs = [], [], []
    cuts = np.flatnonzero(np.diff(request)) + 1
    for run in np.split(np.arange(len(request)), cuts) if len(request) else ():
        if int(need[run].sum()) > num_blocks:  # its tiles cannot share one call: one entry for the request
            rows.append(int(token_num[run].sum()))
            kvs.append(int(kv_len[run].max()))
            reqs.append(int(request[run[0]]))
        else:
            rows += token_num[run].tolist()
            kvs += kv_len[run].tolist()
            reqs += request[run].tolist()
    calls: list[FusedCall] = []
    first = row = blocks = 0
    ends: list[int] = []
    for i, (n, kv) in enumerate(zip(rows, kvs)):
        b = -(-kv // block_size)
        if ends and (blocks + b > num_blocks or len(ends) == max_batch):
            calls.append(FusedCall((row, row + ends[-1]), (first, i), ends, kvs[first:i]))
            first, row, blocks, ends = i, row + ends[-1], 0, []
        blocks += b
        ends.append((ends[-1] if ends else 0) + n)
    if ends:
        calls.append(FusedCall((row, row + ends[-1]), (first, len(rows)), ends, kvs[first:]))
    return Packing(np.asarray(reqs, dtype=np.int64), calls)


@dataclass(slots=True)
class AscendStepPlan(AttentionPlan):
    """Per-step data every layer's attention shares, built once from the host arrays."""

    tiles: xy_plan.TokenTable  # the attention Token-Table (the Task-Table is the kernel's own business)
    torch_plan: torch_attention.LazyPlan  # the torch ops' plan (grouped on first use) for what the kernel declines
    # Per cache shape (num_blocks, block_size): the packed calls and, per block table, the entries' rows of it.
    _packings: dict = field(default_factory=dict)
    _tables: dict = field(default_factory=dict)

    def packing(self, num_blocks: int, block_size: int) -> Packing:
        key = (num_blocks, block_size)
        if key not in self._packings:
            t = self.tiles
            self._packings[key] = pack(t.token_num, t.kv_len, t.request, num_blocks, block_size)
        return self._packings[key]

    def entry_block_table(self, block_table: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
        """Block-table rows of the packed entries (gathered by the step's first layer)."""
        key = (num_blocks, block_size)
        held = self._tables.get(key)
        if held is None or held[0] is not block_table:
            reqs = torch.from_numpy(self.packing(num_blocks, block_size).requests).to(block_table.device)
            held = (block_table, block_table.index_select(0, reqs).to(torch.int32).contiguous())
            self._tables[key] = held
        return held[1]


def plan_step(query_start_loc, seq_lens) -> AscendStepPlan:
    """The step's tiles from host metadata (NumPy); packed into calls once the cache's shape is seen."""
    table = xy_plan.attention_table(query_start_loc, seq_lens)
    return AscendStepPlan(table, torch_attention.lazy_plan(query_start_loc, seq_lens))


def kv_write(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, scales=None) -> None:
    if scales is not None:
        raise NotImplementedError("kv_write: backend 'ascend' has no quantized KV cache yet; allocate the cache in the "
                                  "model dtype and pass scales=None")
    if kv_cache.dtype == torch.float32:  # the scatter takes float16/bfloat16/int8 on A2/A3: torch's ops write it
        return torch_attention.kv_write(k, v, kv_cache, slot_mapping)
    if k.shape[0] == 0:
        return
    # "Norm": the ND cache layout, and -1 (padded) slots are skipped by the op itself.
    torch_npu().npu_scatter_pa_kv_cache(k.to(kv_cache.dtype).contiguous(), v.to(kv_cache.dtype).contiguous(),
                                        kv_cache[0], kv_cache[1], slot_mapping.contiguous(), cache_mode="Norm")


_MASKS: dict[str, torch.Tensor] = {}


def causal_mask(device) -> torch.Tensor:
    """The 2048 x 2048 mask sparse_mode=3 expects (made once per device)."""
    key = str(device)
    if key not in _MASKS:
        _MASKS[key] = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool), diagonal=1).to(device)
    return _MASKS[key]


def fused_ok(kv_cache: torch.Tensor) -> bool:
    return int(kv_cache.shape[2]) in FUSED_BLOCK_SIZES and int(kv_cache.shape[-1]) in FUSED_HEAD_DIMS


def attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
              sliding_window: int | None = None, soft_cap: float | None = None,
              kv_scales: tuple[float, float] | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    if kv_scales is not None:
        raise ValueError("attention: backend 'ascend' has no fp8 KV cache (it declares kv_cache_dtypes "
                                  "('auto',)); allocate the cache in the model dtype")
    step = meta.plan
    if step is None:  # metadata built by hand, not by prepare_metadata: plan from its arrays (a device sync)
        step = plan_step(*_host_meta(meta))
    if (sliding_window is not None or soft_cap is not None or sinks is not None or not fused_ok(kv_cache)
            or q.dtype == torch.float32):
        # Declined in `supports` when the core can know it; a block size the
        # kernel does not page by is only known here. torch's ops run instead.
        return torch_attention.attention(q, kv_cache, replace(meta, plan=step.torch_plan), scale,
                                         sliding_window, soft_cap, None, sinks)
    t, hq, d = q.shape
    if t == 0:
        return torch.empty_like(q)
    nb, bs, hk, _ = kv_cache.shape[1:]
    calls = step.packing(nb, bs).calls
    table = step.entry_block_table(meta.block_table, nb, bs)
    q = q.contiguous()
    key, value = kv_cache[0].view(nb, bs, hk * d), kv_cache[1].view(nb, bs, hk * d)
    out = None if len(calls) == 1 else torch.empty_like(q)
    for call in calls:
        (r0, r1), (e0, e1) = call.rows, call.entries
        got, _ = torch_npu().npu_fused_infer_attention_score(
            q[r0:r1], key, value, atten_mask=causal_mask(q.device), block_table=table[e0:e1],
            actual_seq_lengths=call.q_ends, actual_seq_lengths_kv=call.kv_lens,
            num_heads=hq, num_key_value_heads=hk, scale=scale, input_layout="TND", sparse_mode=3, block_size=bs,
        )
        if out is None:
            return got
        out[r0:r1] = got
    return out


def _host_meta(meta: AttentionMetadata) -> tuple[np.ndarray, np.ndarray]:
    """query_start_loc and seq_lens as host arrays (one sync when metadata came without a plan)."""
    def host(x):
        return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)

    return host(meta.query_start_loc), host(meta.seq_lens)
