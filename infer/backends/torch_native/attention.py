"""Paged KV write and paged attention over a mixed prefill/decode batch.

A step's requests are split into two groups, planned once per step on the host
(`plan_attention`): decode requests (one query each) and the rest (prefill
chunks, padded to the group's longest). Each group gathers the KV blocks of all
its requests at once into a padded ``[G, L, Hk, D]`` view and runs one masked
attention over it; splitting keeps one long prefill from padding every decode
row to its length. On CPU, torch's fused ``scaled_dot_product_attention`` beats
explicit matmuls (it reads the strided gathered K/V without a transposed copy
and never materialises the scores), so it is the path unless a soft-cap asks
for the explicit scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...primitives.types import AttentionMetadata

# Gathered K+V per chunk of requests: past a few MiB the copies fall out of
# cache, and on 2 cores a 32-request x 1k-context decode ran ~4x slower with
# one 270 MiB gather than with 16 MiB chunks.
_KV_CHUNK_BYTES = 16 << 20
# Explicit-score path: scores of at most this many elements per chunk of queries.
_SCORE_CHUNK = 1 << 22


def kv_write(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, scales=None) -> None:
    if scales is not None:
        raise NotImplementedError(
            "kv_write: backend 'torch' has no quantized KV cache; allocate the cache in the model dtype and pass scales=None"
        )
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

    _TENSORS = ("requests", "query_rows", "query_pos", "first_pos", "token_rows", "padded_rows")

    def to(self, device) -> "AttentionGroup":
        moved = {f: getattr(self, f).to(device) for f in self._TENSORS}
        return AttentionGroup(**moved, seq_lens=self.seq_lens, max_q=self.max_q, fresh=self.fresh)

    def chunk(self, lo: int, hi: int) -> "AttentionGroup":
        """Requests lo:hi (what attention reads; the output maps stay the group's)."""
        return AttentionGroup(
            self.requests[lo:hi], self.query_rows[lo:hi], self.query_pos[lo:hi], self.first_pos[lo:hi],
            self.token_rows, self.padded_rows, self.seq_lens[lo:hi], self.max_q, self.fresh,
        )  # fmt: skip


@dataclass(slots=True)
class AttentionPlan:
    """The per-step split of the batch into groups; built once, read by every layer."""

    groups: list[AttentionGroup]

    def to(self, device) -> "AttentionPlan":
        return AttentionPlan([g.to(device) for g in self.groups])


def _group(requests: torch.Tensor, starts: torch.Tensor, q_lens: torch.Tensor, seq_lens: torch.Tensor) -> AttentionGroup:
    order = torch.argsort(seq_lens, descending=True, stable=True)
    requests, starts, q_lens, seq_lens = requests[order], starts[order], q_lens[order], seq_lens[order]
    max_q = int(q_lens.max())
    offsets = torch.arange(max_q)
    clamped = torch.minimum(offsets[None, :], (q_lens - 1)[:, None])  # [G, max_q]
    first_pos = seq_lens - q_lens
    real = offsets[None, :] < q_lens[:, None]
    padded_index = torch.arange(requests.numel() * max_q).view(-1, max_q)
    return AttentionGroup(
        requests=requests,
        query_rows=starts[:, None] + clamped,
        query_pos=first_pos[:, None] + clamped,
        first_pos=first_pos,
        token_rows=(starts[:, None] + offsets[None, :])[real],
        padded_rows=padded_index[real],
        seq_lens=tuple(seq_lens.tolist()),
        max_q=max_q,
        fresh=bool((first_pos == 0).all()),
    )


def plan_attention(query_start_loc, seq_lens) -> AttentionPlan:
    """Split a batch into a decode group and a prefill group (host tensors in, host tensors out)."""
    qsl = torch.as_tensor(query_start_loc).long().cpu()
    seq = torch.as_tensor(seq_lens).long().cpu()
    q_lens = qsl[1:] - qsl[:-1]
    groups = []
    for select in (q_lens == 1, q_lens > 1):  # requests with no query this step join neither
        requests = torch.nonzero(select).flatten()
        if requests.numel():
            groups.append(_group(requests, qsl[requests], q_lens[requests], seq[requests]))
    return AttentionPlan(groups)


def _num_blocks(g: AttentionGroup, block_size: int, window: int | None) -> int:
    """KV blocks gathered per request of `g`: its longest context, or what a window lets it see."""
    n = -(-g.seq_lens[0] // block_size)  # sorted longest first
    if window is not None:
        # max_q queries see max_q + window - 1 keys, starting anywhere inside a block.
        n = min(n, (g.max_q + window - 2) // block_size + 2)
    return n


def _gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, g: AttentionGroup, block_size: int, window: int | None):
    """K, V [G, L, Hk, D] of the group's blocks and the position of each key [G, L]."""
    n_blocks = _num_blocks(g, block_size, window)
    first_block = torch.zeros_like(g.first_pos)
    if window is not None:
        # Keys older than the window of a request's first query are never read.
        first_block = (g.first_pos - window + 1).clamp(min=0) // block_size
    cols = first_block[:, None] + torch.arange(n_blocks, device=first_block.device)
    # Columns past the table only feed keys beyond every query's position: masked.
    cols = cols.clamp(max=block_table.shape[1] - 1)
    blocks = block_table.index_select(0, g.requests).gather(1, cols).flatten().long()
    hk, d = kv_cache.shape[-2:]
    k = kv_cache[0].index_select(0, blocks).view(g.requests.numel(), -1, hk, d)
    v = kv_cache[1].index_select(0, blocks).view(g.requests.numel(), -1, hk, d)
    key_pos = first_block[:, None] * block_size + torch.arange(n_blocks * block_size, device=first_block.device)
    return k, v, key_pos


def _mask(g: AttentionGroup, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[G, max_q, L] True where a query may read a key."""
    qp, kp = g.query_pos[:, :, None], key_pos[:, None, :]
    allowed = kp <= qp
    if window is not None:
        allowed &= qp - kp < window
    return allowed


def _explicit_attention(q, k, v, mask, scale, soft_cap):
    """Scores materialised in float32 (for soft-capping), chunked over queries.

    q [G, Hq, Q, D], k/v [G, Hk, L, D], mask [G, 1, Q, L] -> [G, Hq, Q, D].
    """
    gs, hq, nq, d = q.shape
    hk, length = k.shape[1], k.shape[2]
    group = hq // hk
    kf, vf = k.float().contiguous(), v.float().contiguous()
    # GQA: the query heads of one KV head become extra query rows, so K/V are never repeated.
    qf = q.float().view(gs, hk, group, nq, d).transpose(2, 3)  # [G, Hk, Q, group, D]
    out = torch.empty(gs, hk, nq, group, d, dtype=torch.float32, device=q.device)
    step = max(1, _SCORE_CHUNK // (gs * hq * length))
    for lo in range(0, nq, step):
        hi = min(nq, lo + step)
        qc = qf[:, :, lo:hi].reshape(gs, hk, (hi - lo) * group, d)
        s = torch.matmul(qc, kf.transpose(-1, -2)) * scale
        if soft_cap is not None:
            s = torch.tanh(s / soft_cap) * soft_cap
        s = s.view(gs, hk, hi - lo, group, length).masked_fill(~mask[:, :, lo:hi, None], float("-inf"))
        p = torch.softmax(s, dim=-1).view(gs, hk, (hi - lo) * group, length)
        out[:, :, lo:hi] = torch.matmul(p, vf).view(gs, hk, hi - lo, group, d)
    return out.transpose(2, 3).reshape(gs, hq, nq, d).to(q.dtype)


def _chunk_attention(q, kv_cache, meta, g: AttentionGroup, scale, window, soft_cap) -> torch.Tensor:
    """Attention of the requests of `g`: [G * max_q, Hq, D], padded rows included."""
    hq, d = q.shape[1:]
    k, v, key_pos = _gather_kv(kv_cache, meta.block_table, g, meta.block_size, window)
    gs, hk = g.requests.numel(), k.shape[2]
    k, v = k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype)  # [G, Hk, L, D], strided
    qg = q.index_select(0, g.query_rows.flatten()).view(gs, g.max_q, hq, d).transpose(1, 2)  # [G, Hq, max_q, D]
    if soft_cap is not None:
        out = _explicit_attention(qg, k, v, _mask(g, key_pos, window)[:, None], scale, soft_cap)
    elif g.max_q == 1:
        # Decode: the query heads of a KV head are its query rows; no K/V repeat needed.
        qd = qg.reshape(gs, hk, hq // hk, d)
        mask = _mask(g, key_pos, window)[:, None]  # [G, 1, 1, L]
        out = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale).view(gs, hq, 1, d)
    elif g.fresh and window is None:
        # No cached prefix: query i reads keys 0..i, which is SDPA's own causal mask.
        out = F.scaled_dot_product_attention(qg, k, v, is_causal=True, scale=scale, enable_gqa=hk != hq)
    else:
        mask = _mask(g, key_pos, window)[:, None]
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale, enable_gqa=hk != hq)
    return out.transpose(1, 2).reshape(gs * g.max_q, hq, d)


def _group_attention(q, kv_cache, meta, g: AttentionGroup, scale, window, soft_cap) -> torch.Tensor:
    """[G * max_q, Hq, D] for a group, gathering at most ~_KV_CHUNK_BYTES of K/V at a time."""
    n = g.requests.numel()
    hk, d = kv_cache.shape[-2:]
    bytes_per_block = 2 * meta.block_size * hk * d * kv_cache.element_size()
    out = q.new_empty(n * g.max_q, *q.shape[1:])
    lo = 0
    while lo < n:
        rest = g.chunk(lo, n)
        hi = lo + max(1, _KV_CHUNK_BYTES // (_num_blocks(rest, meta.block_size, window) * bytes_per_block))
        out[lo * g.max_q : hi * g.max_q] = _chunk_attention(q, kv_cache, meta, g.chunk(lo, hi), scale, window, soft_cap)
        lo = hi
    return out


def attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    plan = meta.backend_data
    if not isinstance(plan, AttentionPlan):
        plan = plan_attention(meta.query_start_loc, meta.seq_lens).to(q.device)
    out = torch.zeros_like(q)  # rows past query_start_loc[-1] (padding) belong to no request
    for g in plan.groups:
        padded = _group_attention(q, kv_cache, meta, g, scale, sliding_window, soft_cap)
        out.index_copy_(0, g.token_rows, padded.index_select(0, g.padded_rows))
    return out
