"""Paged KV cache write and paged attention, one request at a time.

Cache layout: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` float32,
or uint8 e4m3fn codes for an fp8 cache (values divided by the layer's scale).
"""

from __future__ import annotations

import numpy as np

from ...primitives.fp8 import e4m3_decode, e4m3_encode
from ...primitives.types import AttentionMetadata


def kv_write(k, v, kv_cache, slot_mapping, scales=None) -> None:
    block_size = kv_cache.shape[2]
    if kv_cache.dtype == np.uint8:  # fp8: store the codes of the scaled-down values
        k_scale, v_scale = scales if scales is not None else (1.0, 1.0)
        k, v = e4m3_encode(np.asarray(k, np.float64) / k_scale), e4m3_encode(np.asarray(v, np.float64) / v_scale)
    for t, slot in enumerate(slot_mapping):
        if slot < 0:  # padded row: nothing to store
            continue
        block, offset = divmod(int(slot), block_size)
        kv_cache[0, block, offset] = k[t]
        kv_cache[1, block, offset] = v[t]


def gather_context(kv_cache, block_ids, seq_len, kv_scales=None):
    """K and V of one request's first `seq_len` positions: [seq_len, Hk, D] each."""
    _, _, block_size, hk, d = kv_cache.shape
    k = kv_cache[0, block_ids].reshape(-1, hk, d)[:seq_len]
    v = kv_cache[1, block_ids].reshape(-1, hk, d)[:seq_len]
    if kv_cache.dtype == np.uint8:  # fp8 codes: value = e4m3(code) * scale
        k_scale, v_scale = kv_scales if kv_scales is not None else (1.0, 1.0)
        return e4m3_decode(k).astype(np.float64) * k_scale, e4m3_decode(v).astype(np.float64) * v_scale
    return k.astype(np.float64), v.astype(np.float64)


def context_pages(meta: AttentionMetadata, b: int) -> np.ndarray:
    """Cache pages holding request b's context, in order. With mixed block sizes
    (`meta.block_sizes`) its table counts blocks of `k` consecutive pages."""
    seq_len, page = int(meta.seq_lens[b]), meta.block_size
    size = page if meta.block_sizes is None else int(meta.block_sizes[b])
    k = size // page
    blocks = np.asarray(meta.block_table[b, : -(-seq_len // size)], dtype=np.int64)
    return (blocks[:, None] * k + np.arange(k)).reshape(-1)[: -(-seq_len // page)]


def attention(q, kv_cache, meta: AttentionMetadata, scale, sliding_window=None, soft_cap=None, kv_scales=None,
              sinks=None):
    t, hq, d = q.shape
    hk = kv_cache.shape[3]
    group = hq // hk
    out = np.zeros((t, hq, d), dtype=np.float32)
    for b in range(meta.num_seqs):
        start, end = int(meta.query_start_loc[b]), int(meta.query_start_loc[b + 1])
        seq_len, q_len = int(meta.seq_lens[b]), end - start
        if q_len == 0 or seq_len == 0:  # seq_len 0: a padding row, which reads nothing (zero output)
            continue
        k, v = gather_context(kv_cache, context_pages(meta, b), seq_len, kv_scales)
        # Query head h reads KV head h // group.
        k = np.repeat(k, group, axis=1)
        v = np.repeat(v, group, axis=1)
        q_pos = np.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = np.arange(seq_len)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= q_pos - k_pos < sliding_window
        scores = np.einsum("qhd,khd->hqk", q[start:end].astype(np.float64), k) * scale
        if soft_cap is not None:
            scores = soft_cap * np.tanh(scores / soft_cap)
        scores = np.where(allowed[None], scores, -np.inf)
        top = scores.max(axis=-1, keepdims=True)
        if sinks is not None:  # one more logit per head in the denominator, reading no value
            sink = np.asarray(sinks, np.float64)[:, None, None]
            top = np.maximum(top, sink)
        probs = np.exp(scores - top)
        total = probs.sum(axis=-1, keepdims=True)
        if sinks is not None:
            total += np.exp(sink - top)
        probs /= total
        out[start:end] = np.einsum("hqk,khd->qhd", probs, v)
    return out


# -- multi-head latent attention (DeepSeek V2/V3) ---------------------------------
# An MLA layer caches one latent per token: [c_kv (R), k_pe (P)], stored in the
# default layout with one KV head of (R + P) / 2 dims: its first half in the K
# plane, its second in the V plane.


def encoder_attention(q, k, v, query_start_loc, scale):
    """Each sequence's queries over all of its own keys (no mask within a sequence), float64."""
    t, hq, d = q.shape
    group = hq // k.shape[1]
    out = np.zeros((t, hq, d), dtype=np.float32)
    bounds = np.asarray(query_start_loc).tolist()
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi == lo:
            continue
        for h in range(hq):
            qh = q[lo:hi, h].astype(np.float64)
            kh, vh = k[lo:hi, h // group].astype(np.float64), v[lo:hi, h // group].astype(np.float64)
            s = scale * (qh @ kh.T)
            p = np.exp(s - s.max(axis=1, keepdims=True))
            out[lo:hi, h] = (p / p.sum(axis=1, keepdims=True)) @ vh
    return out


def mla_kv_write(c_kv, k_pe, kv_cache, slot_mapping) -> None:
    latent = np.concatenate([np.asarray(c_kv), np.asarray(k_pe)], axis=1)
    half = latent.shape[1] // 2
    kv_write(latent[:, None, :half], latent[:, None, half:], kv_cache, slot_mapping)


def mla_latents(kv_cache, meta: AttentionMetadata, b: int) -> np.ndarray:
    """Request b's cached latents, float64 [seq_len, R + P]."""
    k, v = gather_context(kv_cache, context_pages(meta, b), int(meta.seq_lens[b]))
    return np.concatenate([k[:, 0], v[:, 0]], axis=1)


def mla_attention(q_nope, q_pe, kv_cache, meta: AttentionMetadata, kv_b_proj, scale, v_head_dim):
    """Each head attends with keys ``[W_UK[h] c, k_pe]`` and values ``W_UV[h] c`` of the
    cached latents, where ``kv_b_proj`` [H * (N + V), R] holds each head's W_UK rows
    then its W_UV rows; causal, like `attention`."""
    t, h, n = q_nope.shape
    r = kv_b_proj.shape[1]
    w = np.asarray(kv_b_proj, np.float64).reshape(h, n + v_head_dim, r)
    w_uk, w_uv = w[:, :n], w[:, n:]
    qn, qp = np.asarray(q_nope, np.float64), np.asarray(q_pe, np.float64)
    out = np.zeros((t, h, v_head_dim), dtype=np.float32)
    for b in range(meta.num_seqs):
        start, end = int(meta.query_start_loc[b]), int(meta.query_start_loc[b + 1])
        seq_len, q_len = int(meta.seq_lens[b]), end - start
        if q_len == 0 or seq_len == 0:
            continue
        latent = mla_latents(kv_cache, meta, b)
        c, k_pe = latent[:, :r], latent[:, r:]
        keys = np.einsum("sr,hnr->hsn", c, w_uk)
        values = np.einsum("sr,hvr->hsv", c, w_uv)
        scores = (np.einsum("thn,hsn->hts", qn[start:end], keys) + np.einsum("thp,sp->hts", qp[start:end], k_pe)) * scale
        pos = seq_len - q_len + np.arange(q_len)
        scores = np.where(np.arange(seq_len)[None, None, :] <= pos[None, :, None], scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        out[start:end] = np.einsum("hts,hsv->thv", probs, values)
    return out
