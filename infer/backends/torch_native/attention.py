"""Paged KV write and paged attention over a mixed prefill/decode batch.

A step's requests are split into two groups, planned once per step on the host
(`plan_attention`): decode requests (one query each) and the rest (prefill
chunks, padded to the group's longest). Each group gathers the KV blocks of all
its requests at once into a padded ``[G, L, Hk, D]`` view and runs one masked
attention over it; splitting keeps one long prefill from padding every decode
row to its length. On CPU, torch's fused ``scaled_dot_product_attention`` beats
explicit matmuls (it reads the strided gathered K/V without a transposed copy
and never materialises the scores), so it is the path unless a soft-cap or
attention sinks ask for the explicit scores.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ...primitives.types import AttentionMetadata, AttentionPlan
from . import fp8_kv

# Gathered K+V per chunk of requests: past a few MiB the copies fall out of
# cache, and one whole-batch gather measured several times slower than chunks
# of this size (docs/backends/torch-measurements.md).
_KV_CHUNK_BYTES = 16 << 20
# Explicit-score path: scores of at most this many elements per chunk of queries.
_SCORE_CHUNK = 1 << 22


def kv_write(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, scales=None) -> None:
    # An fp8 cache holds e4m3 codes of k / k_scale, v / v_scale.
    fp8, scales = fp8_kv.cache_scales(kv_cache, scales, "kv_write: scales")
    scales = scales if fp8 else None
    if fp8:
        k, v = fp8_kv.quantize(k, scales[0]), fp8_kv.quantize(v, scales[1])
    hk, d = kv_cache.shape[-2:]
    # A view, so index_copy_ lands in the caller's cache (reshape could copy).
    flat = kv_cache.view(2, -1, hk, d)
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    flat[0].index_copy_(0, slots, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, v.to(kv_cache.dtype))


@dataclass(slots=True)
class AttentionGroup:
    """Requests attended together, their queries padded to ``max_q`` rows each.

    Requests are sorted by context length, longest first, so the chunks that
    `_group_attention` cuts hold similar lengths and pad little.
    """

    requests: torch.Tensor  # [G] request index in the batch
    query_rows: torch.Tensor  # [G, max_q] row of q feeding each padded query (padding repeats the last)
    query_pos: torch.Tensor  # [G, max_q] position of each padded query
    first_pos: torch.Tensor  # [G] position of each request's first query
    token_rows: torch.Tensor  # [n] rows of q this group answers
    padded_rows: torch.Tensor  # [n] where each of them sits among the G * max_q padded queries
    seq_lens: tuple[int, ...]  # host copy, descending: chunk sizes are planned without a device sync
    max_q: int
    # Every request starts at position 0, so the top-left causal mask is exact.
    fresh: bool
    # query_rows.flatten() is the range first_row, first_row + 1, ...: q is sliced, not gathered (-1: it is not).
    first_row: int = -1

    _TENSORS = ("requests", "query_rows", "query_pos", "first_pos", "token_rows", "padded_rows")

    def to(self, device) -> "AttentionGroup":
        moved = {f: getattr(self, f).to(device) for f in self._TENSORS}
        return AttentionGroup(**moved, seq_lens=self.seq_lens, max_q=self.max_q, fresh=self.fresh, first_row=self.first_row)

    def chunk(self, lo: int, hi: int) -> "AttentionGroup":
        """Requests lo:hi (what attention reads; the output maps stay the group's)."""
        first_row = self.first_row + lo * self.max_q if self.first_row >= 0 else -1
        return AttentionGroup(
            self.requests[lo:hi], self.query_rows[lo:hi], self.query_pos[lo:hi], self.first_pos[lo:hi],
            self.token_rows, self.padded_rows, self.seq_lens[lo:hi], self.max_q, self.fresh, first_row,
        )  # fmt: skip


@dataclass(slots=True)
class _ChunkIndex:
    """What one chunk of a group reads, worked out on its first layer and reused by the rest of the step."""

    g: AttentionGroup
    blocks: torch.Tensor  # [G * n_blocks] cache blocks gathered, in order
    block_start: int  # blocks is block_start, block_start + 1, ...: the cache is sliced, not gathered (-1: it is not)
    key_pos: torch.Tensor  # [G, L]
    masks: dict  # dtype (or None for bool) -> mask [G, 1, max_q, L]


@dataclass(slots=True)
class GroupPlan:
    """The per-step split of the batch into groups; built once, read by every layer."""

    groups: list[AttentionGroup]
    # Rows of q the batch's requests own (query_start_loc[-1]); -1 when unknown.
    num_tokens: int = -1
    # With one group answering rows 0..num_tokens-1: the padded row feeding each output row
    # (None with `direct`, where the padded output already is the output).
    out_rows: torch.Tensor | None = None
    direct: bool = False
    # Per-step memo of the gathers and masks (filled by the first layer; the block table it was built for).
    memo: dict = field(default_factory=dict)
    memo_table: object = None
    # Sum over requests of query rows x context length: what a one-row-at-a-time kernel reads (-1: unknown).
    row_keys: int = -1

    def to(self, device) -> "GroupPlan":
        rows = None if self.out_rows is None else self.out_rows.to(device)
        return GroupPlan([g.to(device) for g in self.groups], self.num_tokens, rows, self.direct,
                             row_keys=self.row_keys)


def _group(requests: torch.Tensor, starts: torch.Tensor, q_lens: torch.Tensor, seq_lens: torch.Tensor) -> AttentionGroup:
    order = torch.argsort(seq_lens, descending=True, stable=True)
    requests, starts, q_lens, seq_lens = requests[order], starts[order], q_lens[order], seq_lens[order]
    max_q = int(q_lens.max())
    offsets = torch.arange(max_q)
    clamped = torch.minimum(offsets[None, :], (q_lens - 1)[:, None])  # [G, max_q]
    first_pos = seq_lens - q_lens
    real = offsets[None, :] < q_lens[:, None]
    padded_index = torch.arange(requests.numel() * max_q).view(-1, max_q)
    query_rows = starts[:, None] + clamped
    flat = query_rows.flatten()
    first_row = int(flat[0]) if torch.equal(flat, flat[0] + torch.arange(flat.numel())) else -1
    return AttentionGroup(
        requests=requests,
        query_rows=query_rows,
        query_pos=first_pos[:, None] + clamped,
        first_pos=first_pos,
        token_rows=(starts[:, None] + offsets[None, :])[real],
        padded_rows=padded_index[real],
        seq_lens=tuple(seq_lens.tolist()),
        max_q=max_q,
        fresh=bool((first_pos == 0).all()),
        first_row=first_row,
    )


@dataclass(slots=True)
class LazyPlan(AttentionPlan):
    """The torch backend's `AttentionPlan`, attached by `prepare_metadata`: `row_keys` now
    (all the native kernels read), the `GroupPlan` of the torch ops when a step first
    needs it (a decode step served by the native kernels never does)."""

    query_start_loc: object  # host copies
    seq_lens: object
    row_keys: int
    request_keys: int  # the most query rows x keys of one request
    plan: GroupPlan | None = None
    native: object = None  # the native attention block's packed step arguments (False: unusable)

    def resolve(self, device) -> GroupPlan:
        """The groups on `device` (the queries'), planned on first use."""
        if self.plan is None:
            self.plan = plan_attention(self.query_start_loc, self.seq_lens).to(device)
        return self.plan


def lazy_plan(query_start_loc, seq_lens) -> LazyPlan:
    """The step's plan from its host arrays (no device sync)."""
    qsl, seq = np.asarray(query_start_loc, dtype=np.int64), np.asarray(seq_lens, dtype=np.int64)
    keys = (qsl[1:] - qsl[:-1]) * seq
    return LazyPlan(qsl, seq, int(keys.sum()), int(keys.max(initial=0)))


def plan_attention(query_start_loc, seq_lens) -> GroupPlan:
    """Split a batch into a decode group and a prefill group (host tensors in, host tensors out)."""
    qsl = torch.as_tensor(query_start_loc).long().cpu()
    seq = torch.as_tensor(seq_lens).long().cpu()
    q_lens = qsl[1:] - qsl[:-1]
    groups = []
    # Requests with no query this step join neither group, nor do padding rows (seq_len 0: they read nothing).
    for select in ((q_lens == 1) & (seq > 0), q_lens > 1):
        requests = torch.nonzero(select).flatten()
        if requests.numel():
            groups.append(_group(requests, qsl[requests], q_lens[requests], seq[requests]))
    plan = GroupPlan(groups, row_keys=int((q_lens * seq).sum()))
    if len(groups) == 1 and qsl.numel() and int(qsl[0]) == 0:
        g, n = groups[0], int(qsl[-1])
        if torch.equal(torch.sort(g.token_rows).values, torch.arange(n)):
            # One group answers every row: its padded output, reordered, is the output.
            rows = torch.empty(n, dtype=torch.long)
            rows[g.token_rows] = g.padded_rows
            plan.num_tokens = n
            plan.direct = rows.numel() == g.requests.numel() * g.max_q and torch.equal(rows, torch.arange(n))
            plan.out_rows = None if plan.direct else rows
    return plan


def _num_blocks(g: AttentionGroup, block_size: int, window: int | None) -> int:
    """KV blocks gathered per request of `g`: its longest context, or what a window lets it see."""
    n = -(-g.seq_lens[0] // block_size)  # sorted longest first
    if window is not None:
        # max_q queries see max_q + window - 1 keys, starting anywhere inside a block.
        n = min(n, (g.max_q + window - 2) // block_size + 2)
    return n


def _chunk_index(g: AttentionGroup, block_table: torch.Tensor, block_size: int, window: int | None) -> _ChunkIndex:
    """The blocks a chunk gathers and the position of each key [G, L]."""
    n_blocks = _num_blocks(g, block_size, window)
    first_block = torch.zeros_like(g.first_pos)
    if window is not None:
        # Keys older than the window of a request's first query are never read.
        first_block = (g.first_pos - window + 1).clamp(min=0) // block_size
    cols = first_block[:, None] + torch.arange(n_blocks, device=first_block.device)
    # Columns past the table only feed keys beyond every query's position: masked.
    cols = cols.clamp(max=block_table.shape[1] - 1)
    blocks = block_table.index_select(0, g.requests).gather(1, cols).flatten().long()
    start = int(blocks[0])
    if start < 0 or not torch.equal(blocks, start + torch.arange(blocks.numel(), device=blocks.device)):
        start = -1
    key_pos = first_block[:, None] * block_size + torch.arange(n_blocks * block_size, device=first_block.device)
    return _ChunkIndex(g, blocks, start, key_pos, {})


def _gather_kv(kv_cache: torch.Tensor, c: _ChunkIndex):
    """K, V [G, L, Hk, D] of the chunk's blocks."""
    hk, d = kv_cache.shape[-2:]
    gs = c.g.requests.numel()
    if c.block_start >= 0 and c.block_start + c.blocks.numel() <= kv_cache.shape[1]:
        k = kv_cache[0].narrow(0, c.block_start, c.blocks.numel())  # the blocks lie in order: a view
        v = kv_cache[1].narrow(0, c.block_start, c.blocks.numel())
    else:
        k = kv_cache[0].index_select(0, c.blocks)
        v = kv_cache[1].index_select(0, c.blocks)
    return k.view(gs, -1, hk, d), v.view(gs, -1, hk, d)


def _mask(g: AttentionGroup, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[G, max_q, L] True where a query may read a key."""
    qp, kp = g.query_pos[:, :, None], key_pos[:, None, :]
    allowed = kp <= qp
    if window is not None:
        allowed &= qp - kp < window
    return allowed


# Masks kept for the rest of the step up to this many elements each (larger ones are rebuilt per layer).
_MEMO_MASK_NUMEL = 1 << 22


def _chunk_mask(c: _ChunkIndex, window: int | None, dtype) -> torch.Tensor:
    """[G, 1, max_q, L]: bool (dtype None) or SDPA's additive form of it (0 / -inf in `dtype`)."""
    mask = c.masks.get(dtype)
    if mask is None:
        mask = c.masks.get(None)
        if mask is None:
            mask = _mask(c.g, c.key_pos, window)[:, None]
        if dtype is not None:
            # What SDPA makes of a bool mask on every call, made once.
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        if mask.numel() <= _MEMO_MASK_NUMEL:
            c.masks[dtype] = mask
    return mask


def _explicit_attention(q, k, v, mask, scale, soft_cap, sinks=None):
    """Scores materialised in float32 (for soft-capping and sinks), chunked over queries.

    q [G, Hq, Q, D], k/v [G, Hk, L, D], mask [G, 1, Q, L] -> [G, Hq, Q, D].
    """
    gs, hq, nq, d = q.shape
    hk, length = k.shape[1], k.shape[2]
    group = hq // hk
    kf, vf = k.float().contiguous(), v.float().contiguous()
    # GQA: the query heads of one KV head become extra query rows, so K/V are never repeated.
    qf = q.float().view(gs, hk, group, nq, d).transpose(2, 3)  # [G, Hk, Q, group, D]
    out = torch.empty(gs, hk, nq, group, d, dtype=torch.float32, device=q.device)
    step = max(1, _SCORE_CHUNK // (gs * hq * (length + 1)))
    # A sink is one more logit per query head, in the denominator only: a last column of
    # the scores whose probability is dropped before the values are read.
    sink = None if sinks is None else sinks.float().view(1, hk, 1, group, 1)
    for lo in range(0, nq, step):
        hi = min(nq, lo + step)
        qc = qf[:, :, lo:hi].reshape(gs, hk, (hi - lo) * group, d)
        s = torch.matmul(qc, kf.transpose(-1, -2)) * scale
        if soft_cap is not None:
            s = torch.tanh(s / soft_cap) * soft_cap
        s = s.view(gs, hk, hi - lo, group, length).masked_fill(~mask[:, :, lo:hi, None], float("-inf"))
        if sink is not None:
            s = torch.cat([s, sink.expand(gs, hk, hi - lo, group, 1)], dim=-1)
            p = torch.softmax(s, dim=-1)[..., :length].reshape(gs, hk, (hi - lo) * group, length)
        else:
            p = torch.softmax(s, dim=-1).view(gs, hk, (hi - lo) * group, length)
        out[:, :, lo:hi] = torch.matmul(p, vf).view(gs, hk, hi - lo, group, d)
    return out.transpose(2, 3).reshape(gs, hq, nq, d).to(q.dtype)


# Prefill groups run one SDPA per request when padding to the longest would add more than this
# fraction of work, for up to _RAGGED_MAX_REQUESTS requests (each call costs tens of microseconds).
_RAGGED_WASTE = 0.25
_RAGGED_MAX_REQUESTS = 64


def _ragged(g: AttentionGroup) -> bool:
    """Whether a prefill group is cheaper one request at a time (work ~ queries x keys)."""
    n = len(g.seq_lens)
    if g.max_q == 1 or not 1 < n <= _RAGGED_MAX_REQUESTS:
        return False
    own = sum(s * (s - f) for s, f in zip(g.seq_lens, g.first_pos.tolist()))
    return n * g.max_q * g.seq_lens[0] > (1 + _RAGGED_WASTE) * own


def _chunk_attention(q, kv_cache, c: _ChunkIndex, scale, window, soft_cap, kv_scales=None, sinks=None) -> torch.Tensor:
    """Attention of the requests of chunk `c`: [G * max_q, Hq, D], padded rows included."""
    g = c.g
    hq, d = q.shape[1:]
    k, v = _gather_kv(kv_cache, c)
    if kv_cache.dtype == torch.uint8:  # fp8: only the gathered blocks are dequantized
        k_scale, v_scale = kv_scales if kv_scales is not None else (1.0, 1.0)
        k, v = fp8_kv.dequantize(k, k_scale, q.dtype), fp8_kv.dequantize(v, v_scale, q.dtype)
    gs, hk = g.requests.numel(), k.shape[2]
    k, v = k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype)  # [G, Hk, L, D], strided
    if g.first_row >= 0:  # the chunk's queries are consecutive rows of q: a view
        qr = q.narrow(0, g.first_row, gs * g.max_q)
    else:
        qr = q.index_select(0, g.query_rows.flatten())
    if soft_cap is not None or sinks is not None:
        qg = qr.view(gs, g.max_q, hq, d).transpose(1, 2)  # [G, Hq, max_q, D]
        out = _explicit_attention(qg, k, v, _chunk_mask(c, window, None), scale, soft_cap, sinks)
    elif g.max_q == 1:
        # Decode: the query heads of a KV head are its query rows; no K/V repeat needed.
        qd = qr.view(gs, hk, hq // hk, d)
        mask = _chunk_mask(c, window, q.dtype)  # [G, 1, 1, L]
        out = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale)
        return out.view(gs, hq, d)
    elif window is None and _ragged(g):
        # Prompts of mixed lengths: one SDPA per request on its own queries and keys (padding
        # every prompt to the longest did twice the work on a batch of 20-200 token prompts,
        # docs/backends/torch-measurements.md); causal from position 0, masked after a prefix.
        out = q.new_zeros(gs, g.max_q, hq, d)  # rows past a request's queries are padding, never read
        qp = qr.view(gs, g.max_q, hq, d)
        for i, (n, first) in enumerate(zip(g.seq_lens, g.first_pos.tolist())):
            mask = None
            if first:  # a cached prefix: query j (position first + j) reads keys 0..first + j
                mask = torch.arange(n, device=q.device) <= torch.arange(first, n, device=q.device)[:, None]
            out[i, : n - first] = F.scaled_dot_product_attention(
                qp[i, : n - first].transpose(0, 1)[None], k[i : i + 1, :, :n], v[i : i + 1, :, :n], attn_mask=mask,
                is_causal=not first, scale=scale, enable_gqa=hk != hq)[0].transpose(0, 1)  # fmt: skip
        return out.view(gs * g.max_q, hq, d)
    elif g.fresh and window is None:
        # No cached prefix: query i reads keys 0..i, which is SDPA's own causal mask.
        qg = qr.view(gs, g.max_q, hq, d).transpose(1, 2)
        out = F.scaled_dot_product_attention(qg, k, v, is_causal=True, scale=scale, enable_gqa=hk != hq)
    else:
        qg = qr.view(gs, g.max_q, hq, d).transpose(1, 2)
        mask = _chunk_mask(c, window, q.dtype)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale, enable_gqa=hk != hq)
    return out.transpose(1, 2).reshape(gs * g.max_q, hq, d)


def _chunks(plan: GroupPlan, gi: int, g: AttentionGroup, kv_cache, meta, window) -> list[_ChunkIndex]:
    """The group's requests cut so that each cut gathers at most ~_KV_CHUNK_BYTES of K/V (memoised per step)."""
    hk, d = kv_cache.shape[-2:]
    bytes_per_block = 2 * meta.block_size * hk * d * kv_cache.element_size()
    key = (gi, window, meta.block_size, bytes_per_block, _KV_CHUNK_BYTES)
    chunks = plan.memo.get(key)
    if chunks is None:
        chunks, n, lo = [], g.requests.numel(), 0
        while lo < n:
            rest = g.chunk(lo, n)
            hi = min(n, lo + max(1, _KV_CHUNK_BYTES // (_num_blocks(rest, meta.block_size, window) * bytes_per_block)))
            chunks.append(_chunk_index(g.chunk(lo, hi), meta.block_table, meta.block_size, window))
            lo = hi
        plan.memo[key] = chunks
    return chunks


def _group_attention(q, kv_cache, meta, plan: GroupPlan, gi: int, scale, window, soft_cap,
                     kv_scales=None, sinks=None) -> torch.Tensor:
    """[G * max_q, Hq, D] for a group, gathering at most ~_KV_CHUNK_BYTES of K/V at a time."""
    g = plan.groups[gi]
    chunks = _chunks(plan, gi, g, kv_cache, meta, window)
    if len(chunks) == 1:
        return _chunk_attention(q, kv_cache, chunks[0], scale, window, soft_cap, kv_scales, sinks)
    out = q.new_empty(g.requests.numel() * g.max_q, *q.shape[1:])
    row = 0
    for c in chunks:
        part = _chunk_attention(q, kv_cache, c, scale, window, soft_cap, kv_scales, sinks)
        out[row : row + part.shape[0]] = part
        row += part.shape[0]
    return out


def attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    kv_scales: tuple[float, float] | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    lazy = meta.plan
    # Metadata built by hand has no plan: one from its (maybe device) arrays.
    plan = lazy.resolve(q.device) if isinstance(lazy, LazyPlan) else plan_attention(meta.query_start_loc, meta.seq_lens).to(q.device)
    if plan.memo_table is not meta.block_table:  # the memo is for one step's block table
        plan.memo.clear()
        plan.memo_table = meta.block_table
    if plan.num_tokens == q.shape[0]:
        # One group answers every row: no zero-filled output to scatter into.
        padded = _group_attention(q, kv_cache, meta, plan, 0, scale, sliding_window, soft_cap, kv_scales, sinks)
        return padded if plan.direct else padded.index_select(0, plan.out_rows)
    out = torch.zeros_like(q)  # rows past query_start_loc[-1] (padding) belong to no request
    for gi, g in enumerate(plan.groups):
        padded = _group_attention(q, kv_cache, meta, plan, gi, scale, sliding_window, soft_cap, kv_scales, sinks)
        out.index_copy_(0, g.token_rows, padded.index_select(0, g.padded_rows))
    return out


# -- multi-head latent attention (DeepSeek V2/V3): cpu_ref's definition ------------


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start_loc, scale: float) -> torch.Tensor:
    """Each sequence through SDPA on its own rows (no mask: every key of the sequence is seen)."""
    out = torch.empty_like(q)
    bounds = query_start_loc.tolist() if isinstance(query_start_loc, torch.Tensor) else list(query_start_loc)
    gqa = q.shape[1] != k.shape[1]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi > lo:
            o = F.scaled_dot_product_attention(q[lo:hi].transpose(0, 1), k[lo:hi].transpose(0, 1),
                                               v[lo:hi].transpose(0, 1), scale=scale, enable_gqa=gqa)
            out[lo:hi] = o.transpose(0, 1)
    return out


def mla_kv_write(c_kv: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    latent = torch.cat([c_kv, k_pe], dim=1)
    half = latent.shape[1] // 2
    kv_write(latent[:, None, :half], latent[:, None, half:], kv_cache, slot_mapping)


def mla_attention(q_nope, q_pe, kv_cache, meta: AttentionMetadata, kv_b_proj, scale, v_head_dim):
    """Absorbed: each head's query is taken into the latent space (``q_nope W_UK[h]``),
    scored against the cached latents and rope keys in float32, and the latent-space
    output is brought out by ``W_UV[h]``. The two absorptions run in the model dtype
    (a 16-bit model rounds there as its own k and v projections would); a decode step
    runs every request at once, other steps one request at a time."""
    t, h, n = q_nope.shape
    r = kv_b_proj.shape[1]
    w = kv_b_proj.reshape(h, n + v_head_dim, r)
    w_uk, w_uv = w[:, :n], w[:, n:]
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1).float()  # [T, H, R]
    qp = q_pe.float()
    if meta.block_sizes is None and meta.max_query_len == 1 and t == meta.num_seqs and t:
        o_lat = _mla_decode(q_lat, qp, kv_cache, meta, r, scale)
    else:
        o_lat = torch.zeros(t, h, r, dtype=torch.float32, device=q_nope.device)
        page = meta.block_size
        qsl, seq_lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
        sizes = None if meta.block_sizes is None else meta.block_sizes.tolist()
        for b, seq_len in enumerate(seq_lens):
            start, end = qsl[b], qsl[b + 1]
            if end == start or seq_len == 0:
                continue
            k = (sizes[b] if sizes else page) // page
            blocks = meta.block_table[b, : -(-seq_len // (k * page))].long()
            pages = (blocks[:, None] * k + torch.arange(k, device=blocks.device)).reshape(-1)[: -(-seq_len // page)]
            latent = torch.cat([kv_cache[0, pages], kv_cache[1, pages]], dim=-1).reshape(-1, kv_cache.shape[-1] * 2)
            latent = latent[:seq_len].float()
            c, k_pe = latent[:, :r], latent[:, r:]
            scores = (torch.einsum("thr,sr->hts", q_lat[start:end], c)
                      + torch.einsum("thp,sp->hts", qp[start:end], k_pe)) * scale
            pos = seq_len - (end - start) + torch.arange(end - start, device=c.device)
            scores = scores.masked_fill(torch.arange(seq_len, device=c.device)[None, None, :] > pos[None, :, None],
                                        float("-inf"))
            o_lat[start:end] = torch.einsum("hts,sr->thr", scores.softmax(dim=-1), c)
    out = torch.bmm(o_lat.to(q_nope.dtype).transpose(0, 1), w_uv.transpose(1, 2))  # [H, T, V]
    return out.transpose(0, 1).contiguous()


def _mla_decode(q_lat, q_pe, kv_cache, meta: AttentionMetadata, r: int, scale: float) -> torch.Tensor:
    """One query per request (a decode step), all requests at once: each one's latents
    gathered into a [B, S, R + P] batch (S its longest context, shorter ones masked)."""
    bs, half = meta.block_size, kv_cache.shape[-1]
    seq_lens = meta.seq_lens.long()
    pos = torch.arange(max(int(meta.max_seq_len), 1), device=q_lat.device)
    cols = (pos // bs).clamp(max=meta.block_table.shape[1] - 1)
    slots = meta.block_table.long()[:, cols] * bs + pos % bs  # [B, S]
    flat = kv_cache.reshape(2, -1, half)
    latent = torch.cat([flat[0][slots], flat[1][slots]], dim=-1).float()  # [B, S, R + P]
    c, k_pe = latent[..., :r], latent[..., r:]
    scores = torch.baddbmm(torch.bmm(q_lat, c.transpose(1, 2)), q_pe, k_pe.transpose(1, 2), alpha=1.0) * scale
    scores = scores.masked_fill(pos[None, None, :] >= seq_lens[:, None, None], float("-inf"))
    probs = scores.softmax(dim=-1).nan_to_num(0.0)  # a padding row (seq_len 0) reads nothing
    return torch.bmm(probs, c)
