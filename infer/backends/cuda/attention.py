"""Paged attention over the flattened mixed prefill/decode batch, in one launch.

Program ``(q_tile, kv_head, split)`` takes up to BLOCK_Q consecutive query
tokens of one request together with all GROUP query heads that share
`kv_head` (GROUP padded to a power of two), so the BLOCK_M rows of its score tile read each
K/V tile once per KV head, not once per query head (GQA/MQA). Keys are walked
TILE_N positions at a time through the block table with an online softmax in
float32 (exp2 domain); causality, the sliding window and the request's end
are one mask.

Query tiles are laid out without a host-side plan: request b's tiles start at
``query_start_loc[b] // BLOCK_Q + b`` (an upper bound of the tiles before it),
so the grid ``T // BLOCK_Q + B`` is known from shapes alone and each program
finds its request by binary search. Nothing here reads device memory on the
host, which is what lets a decode step be captured in a CUDA graph.

Flash-decoding: with ``num_splits > 1`` each one-query request (a decode row,
in a decode-only or a mixed step) also splits its key range into up to that
many parts of at least ``MIN_SPLIT_TOKENS`` keys when the count is the
default; the parts write partial (output, max, sum) triples, per request, that
`_combine_splits_kernel` merges. That keeps the GPU busy when batch * kv_heads
is small and contexts are long, and keeps a long decode from being the last
program of a mixed step. Splits past a request's keys (a shorter request than
the step's longest; a graph's capacity) only write (-inf, 0). The split count
is a runtime argument: contexts and batches that grow compile nothing new.

An fp8 cache (uint8 e4m3fn codes) is read at one byte per element and decoded
in registers (`fp8.e4m3_to_f16`, exact) to the query's dtype; the scales
never touch the tiles: k_scale joins the softmax scale and v_scale multiplies
the finished rows.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...primitives.types import AttentionMetadata
from ..torch_native.fp8_kv import cache_scales
from . import tuned
from .fp8 import e4m3_to_f16, fp8_rescale, native_fp8
from .launch import compute_f32, dot_precision, next_pow2

# Key positions per inner-loop step.
TILE_N = 64
# Smallest key range worth a split of its own: below it the partials cost more than they save.
MIN_SPLIT_TOKENS = 256
# Most splits the default picks; the combine kernel's split axis is padded to it (one variant for every count).
MAX_SPLITS = 32


@triton.jit
def _tanh(x):
    # tanh through the sigmoid: no libdevice (the interpreter has none), exact at +-inf.
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


# Int arguments that change from step to step (batch, context, split count, block-table
# width): Triton would otherwise specialise on each being 1 or a multiple of 16 and compile
# a variant per class as a request's context grows.
_PER_STEP = ["window", "num_seqs", "num_splits", "min_split_tiles", "stride_bt", "stride_pt", "stride_ph", "stride_ps"]


@triton.jit(do_not_specialize=_PER_STEP)
def _paged_attention_kernel(
    out_ptr, part_out_ptr, part_ml_ptr, q_ptr, k_ptr, v_ptr,
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr, sinks_ptr,
    scale, v_mul, soft_cap, window, num_seqs, num_splits, min_split_tiles,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_bt,
    stride_pt, stride_ph, stride_ps,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr, SPLIT: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, F32: tl.constexpr, FP8: tl.constexpr,
    FP8_NATIVE: tl.constexpr, PRECISION: tl.constexpr, USE_SINKS: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    # The request of this tile: the last b whose first tile index is <= pid.
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first_tile <= pid, mid, lo)
        hi = tl.where(first_tile <= pid, hi, mid - 1)
    b = lo
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    q_tile = pid - (q_start // BLOCK_Q + b)
    if q_tile * BLOCK_Q >= q_len:
        return  # a spare program of the upper-bound grid
    # Only one-query (decode) requests split their keys; a longer request's tiles are split 0's.
    n_splits = tl.where(q_len == 1, num_splits, 1)
    if split >= n_splits:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    first_pos = seq_len - q_len  # position of the request's first query

    rows = tl.arange(0, BLOCK_M)
    qi = q_tile * BLOCK_Q + rows // GROUP_PAD
    head_in_group = rows % GROUP_PAD
    row_ok = (qi < q_len) & (head_in_group < GROUP)
    head = kvh * GROUP + head_in_group
    token = q_start + qi
    q_pos = first_pos + qi

    # Keys this tile can see: up to its last query, from the window of its first.
    last_q = tl.minimum(q_len, (q_tile + 1) * BLOCK_Q) - 1
    k_end = first_pos + last_q + 1
    k_lo = 0
    if USE_WINDOW:
        k_lo = tl.maximum(first_pos + q_tile * BLOCK_Q - window + 1, 0)
    k_lo = (k_lo // TILE) * TILE
    # Each split takes at least min_split_tiles: a request shorter than the step's
    # longest (or than a graph's capacity) leaves the spare splits empty.
    per_split = tl.maximum(tl.cdiv(tl.cdiv(k_end - k_lo, TILE), n_splits), min_split_tiles) * TILE
    s_lo = k_lo + split * per_split
    s_hi = tl.minimum(s_lo + per_split, k_end)
    to_out = True  # rows finished here, not partials for the combine
    if SPLIT:
        to_out = q_len > 1
    part = b * stride_pt + head * stride_ph + split * stride_ps  # a one-query request's partial, per request
    if SPLIT:
        if (q_len == 1) & (s_lo >= s_hi):  # an empty split: only (max, sum) = (-inf, 0), weighed 0 by the combine
            tl.store(part_ml_ptr + 2 * part, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_ok)
            tl.store(part_ml_ptr + 2 * part + 1, tl.zeros([BLOCK_M], tl.float32), mask=row_ok)
            return

    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if USE_SINKS:
        # The head's sink logit starts split 0's running softmax: (max, sum) = (sink, 1) with
        # no value read, so it only adds to the denominator, once however the keys are split.
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        first = row_ok & (split == 0)
        m_i = tl.where(first, sink, m_i)
        l_i = tl.where(first, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_table_ptr + b * stride_bt
    for start in range(s_lo, s_hi, TILE):
        kpos = start + tl.arange(0, TILE)
        k_ok = kpos < s_hi
        # KV block size is a constexpr: a power of two turns these into shifts and masks.
        blk = tl.load(bt_row + kpos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        kv_off = blk * stride_kb + (kpos % BLOCK_SIZE) * stride_ks + kvh * stride_kh
        k = tl.load(k_ptr + kv_off[None, :] + d[:, None], mask=k_ok[None, :] & d_ok[:, None], other=0)
        v = tl.load(v_ptr + kv_off[:, None] + d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0)
        if FP8:  # codes to values (times 2^-8 without FP8_NATIVE: scale and v_mul hold the 2^8), exact
            k = e4m3_to_f16(k, FP8_NATIVE).to(q.dtype)
            v = e4m3_to_f16(v, FP8_NATIVE).to(q.dtype)
        elif F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k, input_precision=PRECISION) * scale
        if USE_SOFT_CAP:
            s = soft_cap * _tanh(s / soft_cap)
        s = s * 1.4426950408889634  # log2(e): the softmax runs on exp2
        allowed = k_ok[None, :] & (kpos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (q_pos[:, None] - kpos[None, :] < window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible yet keeps m = -inf; subtracting 0 keeps exp2 finite.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if FP8:
        acc = acc * v_mul
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    io_mask = row_ok[:, None] & d_ok[None, :]
    if to_out:
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        tl.store(part_out_ptr + part[:, None] * BLOCK_D + d[None, :], out, mask=io_mask)
        tl.store(part_ml_ptr + 2 * part, m_i, mask=row_ok)
        tl.store(part_ml_ptr + 2 * part + 1, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits", "stride_pt", "stride_ph", "stride_ps"])
def _combine_splits_kernel(out_ptr, part_out_ptr, part_ml_ptr, query_start_loc_ptr, num_splits,
                           stride_ot, stride_oh, stride_pt, stride_ph, stride_ps,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr):
    b = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(query_start_loc_ptr + b)
    if tl.load(query_start_loc_ptr + b + 1) - token != 1:
        return  # a request of several queries: the attention kernel wrote its rows
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < num_splits
    part = b * stride_pt + head * stride_ph + s * stride_ps
    m = tl.load(part_ml_ptr + 2 * part, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + 2 * part + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max) * l_s  # each split's share of the softmax denominator
    d = tl.arange(0, BLOCK_D)
    # An empty split (sum 0) wrote no output row: it weighs nothing, so it is not read.
    o = tl.load(part_out_ptr + part[:, None] * BLOCK_D + d[None, :],
                mask=(s_ok & (l_s > 0.0))[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(device: torch.device, num_seqs: int, num_kv_heads: int, max_query_len: int,
                       max_seq_len: int) -> int:
    """Flash-decoding splits for the one-query requests of a step too small to fill the GPU
    (two programs per SM), decode-only or mixed with prefills (whose tiles do not split)."""
    if device.type != "cuda" or (max_query_len > 1 and num_seqs == 1):
        return 1  # a lone request of several queries has no one-query row
    sms = _num_sms(device)
    want = triton.cdiv(2 * sms, max(1, num_seqs * num_kv_heads))
    return max(1, min(want, max_seq_len // MIN_SPLIT_TOKENS, MAX_SPLITS))


def launch_config(q_dtype: torch.dtype, max_query_len: int, group_pad: int, split: bool = False,
                  device: torch.device | None = None, head_dim: int | None = None) -> dict:
    """Tile rows (query tokens x query heads of a program), keys per step, warps and
    pipeline stages: for fp16/bf16, the device's tuned file where it has tiles for this
    head size and group (`tuned.py`, written by `benchmarks/gpu_check.py --tune`), else these guesses."""
    if device is not None and head_dim is not None and q_dtype in (torch.float16, torch.bfloat16):
        kind = "prefill" if max_query_len > 1 else "decode_split" if split else "decode"
        tuned_cfg = tuned.attention(kind, device, head_dim, group_pad)
        if tuned_cfg:
            return tuned_cfg
    # tl.dot wants >= 16 rows; a decode step has one query per request, so its
    # tiles are filled with query heads rather than with tokens it lacks.
    if q_dtype == torch.float32:
        # fp32 tiles are twice the bytes and fp32 dots run on FMA units: smaller
        # tiles, more warps and fewer pipeline stages keep them in registers and
        # shared memory (fp32 is for tests; the model dtypes are fp16/bf16).
        return dict(rows=16, tile_n=TILE_N // 2, num_warps=8, num_stages=2)
    rows = 16 if max_query_len <= 1 else 64
    # A program's score tile has max(rows, group_pad) rows (a KV head's query heads at least).
    return dict(rows=rows, tile_n=TILE_N, num_warps=4 if max(rows, group_pad) <= 16 else 8, num_stages=3)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    sliding_window: int | None = None, soft_cap: float | None = None,
                    kv_scales: tuple[float, float] | None = None,
                    num_splits: int | None = None, config: dict | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """[T, Hq, D] attention of every query row; rows of no request stay zero.
    `kv_scales` (k_scale, v_scale) only for an fp8 (uint8) cache, where None means 1.0.
    `config` overrides `launch_config` (for tuning)."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = int(meta.seq_lens.shape[0])
    out = torch.zeros_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    fp8_cache, (k_scale, v_scale) = cache_scales(kv_cache, kv_scales, "attention: kv_scales")
    native = fp8_cache and native_fp8(q.device)
    v_mul = 1.0
    if fp8_cache:
        scale, v_mul = scale * k_scale * fp8_rescale(native), v_scale * fp8_rescale(native)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    group_pad = next_pow2(group)
    # The default split count is the longest request's (a graph's: its capacity's); each split
    # then takes at least MIN_SPLIT_TOKENS, so shorter requests leave spare splits empty.
    # A count given by the caller splits every request evenly.
    min_split_tokens = MIN_SPLIT_TOKENS if num_splits is None else 1
    if num_splits is None:
        num_splits = default_num_splits(q.device, num_seqs, num_kv_heads, meta.max_query_len, meta.max_seq_len)
    cfg = config or launch_config(q.dtype, meta.max_query_len, group_pad, num_splits > 1, q.device, head_dim)
    block_q = max(1, cfg["rows"] // group_pad)
    block_d = max(16, next_pow2(head_dim))
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    if num_splits > 1:  # partials of the one-query requests, per request
        part_out = torch.empty(num_seqs, num_heads, num_splits, block_d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(num_seqs, num_heads, num_splits, 2, dtype=torch.float32, device=q.device)
        pstrides = (num_heads * num_splits, num_splits, 1)
    else:
        part_out = part_ml = out  # unused
        pstrides = (0, 0, 0)
    _paged_attention_kernel[grid](
        out, part_out, part_ml, q, k_cache, v_cache,
        meta.block_table, meta.seq_lens, meta.query_start_loc, q if sinks is None else sinks,
        float(scale), float(v_mul), float(soft_cap or 1.0), int(sliding_window or 0), num_seqs, num_splits,
        triton.cdiv(min_split_tokens, cfg["tile_n"]),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_table.stride(0), *pstrides,
        BLOCK_SIZE=meta.block_size, GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, HEAD_DIM=head_dim,
        BLOCK_D=block_d, TILE=cfg["tile_n"], SPLIT=num_splits > 1,
        USE_WINDOW=sliding_window is not None, USE_SOFT_CAP=soft_cap is not None,
        F32=compute_f32(q.dtype), FP8=fp8_cache, FP8_NATIVE=native, PRECISION=dot_precision(q.dtype),
        USE_SINKS=sinks is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if num_splits > 1:
        _combine_splits_kernel[(num_seqs, num_heads)](
            out, part_out, part_ml, meta.query_start_loc, num_splits, out.stride(0), out.stride(1),
            *pstrides, HEAD_DIM=head_dim, BLOCK_D=block_d, SPLITS_PAD=max(MAX_SPLITS, next_pow2(num_splits)),
        )  # fmt: skip
    return out

