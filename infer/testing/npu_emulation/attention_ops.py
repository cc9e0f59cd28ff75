"""torch_npu's paged-KV write and fused inference attention, emulated in torch on the CPU.

Written from torch_npu's documentation (Ascend/op-plugin
docs/zh/custom_APIs/torch_npu/: torch_npu-npu_scatter_pa_kv_cache.md,
torch_npu-npu_fused_infer_attention_score.md), CANN's aclnnScatterPaKvCache page
and vllm-ascend's op tests, for the argument combinations vllm-ascend uses on
910B, with torch_npu's argument defaults. What the documents forbid raises
here, so a backend that would fail on the device fails in CI too
(docs/backends/ascend.md lists each constraint and its source).
"""

from __future__ import annotations

import functools

import torch

from .checks import require

HALF_DTYPES = (torch.float16, torch.bfloat16)
# sparse_mode 2/3/4 take this "optimised" mask: a fixed 2048 x 2048 upper triangle.
COMPRESSED_MASK = 2048
# aclnnScatterPaKvCache on Atlas A2/A3: FLOAT16, BFLOAT16, INT8 only (torch_npu's page lists more, for other chips).
SCATTER_DTYPES = (torch.float16, torch.bfloat16, torch.int8)
# TND without query_rope/key_rope: Q_D = K_D = V_D = 128, or Q_D = K_D = 192 with V_D 128 or 192.
TND_HEAD_DIMS = (128, 192)
# TND: one actual_seq_lengths entry per batch entry, at most this many.
TND_MAX_BATCH = 4096


def npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, *, compress_lens=None,
                            compress_seq_offsets=None, seq_lens=None, cache_mode="PA_NZ") -> None:
    """key/value [T, N, D] written into paged caches in place, slot s at block ``s // block_size``,
    offset ``s % block_size``.

    ``cache_mode`` defaults to ``"PA_NZ"``, as in torch_npu: the caches must then be in
    the NZ layout ``[num_blocks, N*D // last, block_size, last]`` (or its 5-D form
    ``[num_blocks, N, D // last, block_size, last]``), ``last = 32 bytes / itemsize``,
    and slots must lie in ``[0, num_blocks * block_size - 1]``. ``"Norm"`` (or None)
    takes ND caches ``[num_blocks, block_size, N, D]`` and skips ``-1`` slots
    (vllm-ascend's padded rows). Slots must be unique either way.
    """
    op = "npu_scatter_pa_kv_cache"
    require(compress_lens is None and compress_seq_offsets is None and seq_lens is None, op,
            "compressed scenarios are not emulated")
    require(cache_mode in (None, "Norm", "PA_NZ"), op, f"cache_mode must be 'PA_NZ', 'Norm' or None, got {cache_mode!r}")
    require(key.dim() == 3 and value.dim() == 3, op, f"key/value must be [T, N, D], got {tuple(key.shape)}")
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache),
                    ("slot_mapping", slot_mapping)):
        require(t.is_contiguous(), op, f"{name} must be contiguous (the op takes no strided input)")
    require(key.dtype == value.dtype == key_cache.dtype == value_cache.dtype, op,
            f"key, value and caches must share one dtype, got {key.dtype}, {value.dtype}, {key_cache.dtype}, {value_cache.dtype}")
    require(key.dtype in SCATTER_DTYPES, op,
            f"Atlas A2/A3 take float16/bfloat16/int8 key/value (aclnnScatterPaKvCache), got {key.dtype}")
    require(slot_mapping.dtype in (torch.int32, torch.int64), op, f"slot_mapping must be int32/int64, got {slot_mapping.dtype}")
    require(key.shape[:2] == value.shape[:2], op, "key and value must agree on [T, N]")
    require(slot_mapping.shape == (key.shape[0],), op, "slot_mapping must be [T]")
    if cache_mode == "PA_NZ":
        caches = [_nz_as_4d(op, x, c, name) for x, c, name in ((key, key_cache, "key"), (value, value_cache, "value"))]
        num_blocks, block_size = caches[0].shape[0], caches[0].shape[2]
    else:
        require(key_cache.dim() == 4 and value_cache.dim() == 4, op, "key_cache/value_cache must be 4-D")
        num_blocks, block_size = key_cache.shape[:2]
        for x, c, name in ((key, key_cache, "key"), (value, value_cache, "value")):
            require(tuple(c.shape[:2]) == (num_blocks, block_size) and tuple(c.shape[2:]) == tuple(x.shape[1:]), op,
                    f"{name} [T, N, D] {tuple(x.shape)} does not fit {name}_cache [blocks, block_size, N, D] {tuple(c.shape)}")
    slots = slot_mapping.long()
    if cache_mode != "PA_NZ":
        keep = slots != -1  # "Norm" skips padded rows
        slots, key, value = slots[keep], key[keep], value[keep]
    if slots.numel():
        require(int(slots.min()) >= 0 and int(slots.max()) < num_blocks * block_size, op,
                f"slot_mapping values must lie in [0, {num_blocks * block_size - 1}]"
                + (" (cache_mode='PA_NZ' skips no -1 slots)" if cache_mode == "PA_NZ" else " or be -1"))
        require(slots.unique().numel() == slots.numel(), op, "slot_mapping values must be unique")
    if cache_mode == "PA_NZ":
        for x, c in zip((key, value), caches):
            # NZ: token s's N*D values in chunks of `last`, chunk j at [block, j, offset, :].
            rows = x.reshape(x.shape[0], c.shape[1], c.shape[3])
            c[slots // block_size, :, slots % block_size, :] = rows
        return
    for x, c in ((key, key_cache), (value, value_cache)):
        c.view(-1, *c.shape[2:]).index_copy_(0, slots, x)


def _nz_as_4d(op: str, x: torch.Tensor, cache: torch.Tensor, name: str) -> torch.Tensor:
    """An NZ cache as its 4-D view [num_blocks, N*D // last, block_size, last]; anything else is rejected."""
    last = 32 // x.element_size()
    heads, d = x.shape[1:]
    shape = tuple(cache.shape)
    nz4 = cache.dim() == 4 and shape[3] == last and shape[1] * last == heads * d
    nz5 = cache.dim() == 5 and shape[4] == last and shape[1] == heads and shape[2] * last == d
    require((nz4 or nz5) and (d * x.element_size()) % 32 == 0, op,
            f"cache_mode='PA_NZ' (the default) takes an NZ {name}_cache [num_blocks, {heads * d // last}, block_size, "
            f"{last}], got {shape}; an ND cache [num_blocks, block_size, N, D] needs cache_mode='Norm'")
    return cache if nz4 else cache.view(shape[0], shape[1] * shape[2], shape[3], shape[4])


def _paged_context(cache: torch.Tensor, table_row: torch.Tensor, kv_len: int, block_size: int, heads: int) -> torch.Tensor:
    """[kv_len, N, D] of one batch entry from a paged cache [blocks, block_size, N*D] or [blocks, N, block_size, D]."""
    n_blocks = -(-kv_len // block_size)
    blocks = cache.index_select(0, table_row[:n_blocks].long())
    if cache.dim() == 3:
        ctx = blocks.reshape(n_blocks * block_size, heads, -1)
    else:
        ctx = blocks.permute(0, 2, 1, 3).reshape(n_blocks * block_size, heads, -1)
    return ctx[:kv_len]


@functools.lru_cache(maxsize=1)
def _upper() -> torch.Tensor:
    return torch.triu(torch.ones(COMPRESSED_MASK, COMPRESSED_MASK, dtype=torch.bool), diagonal=1)


def _check_mask(op: str, atten_mask, sparse_mode: int) -> None:
    if sparse_mode == 0:
        require(atten_mask is None, op, "only sparse_mode=0 without a mask is emulated")
        return
    require(sparse_mode == 3, op, f"sparse_mode {sparse_mode} is not emulated (0 or 3)")
    require(atten_mask is not None, op, "sparse_mode=3 needs the optimised atten_mask")
    require(atten_mask.dtype in (torch.bool, torch.int8, torch.uint8), op, f"atten_mask must be bool/int8/uint8, got {atten_mask.dtype}")
    shape = tuple(atten_mask.shape)
    require(shape[-2:] == (COMPRESSED_MASK, COMPRESSED_MASK) and all(s == 1 for s in shape[:-2]), op,
            f"sparse_mode=3 takes a ({COMPRESSED_MASK}, {COMPRESSED_MASK}) mask, got {shape}")
    require(torch.equal(atten_mask.reshape(COMPRESSED_MASK, COMPRESSED_MASK).bool(), _upper()), op,
            "the sparse_mode=3 mask must be 1 strictly above the diagonal and 0 elsewhere")


def npu_fused_infer_attention_score(query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
                                    actual_seq_lengths_kv=None, block_table=None, num_heads=1, scale=1.0,
                                    pre_tokens=2147483647, next_tokens=2147483647, input_layout="BSH",
                                    num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0,
                                    softmax_lse_flag=False, **unused):
    """Layout TND with a paged KV cache (block_table), the combination vllm-ascend uses.

    * query [T, N, D]; batch b owns rows ``actual_seq_lengths[b-1] : actual_seq_lengths[b]``
      (cumulative, the entry count is the batch size).
    * key/value [blocks, block_size, Hk*D] (or [blocks, Hk, block_size, D]);
      batch b reads ``actual_seq_lengths_kv[b]`` tokens (not cumulative in the
      paged case) through ``block_table[b]`` (int32 block ids in order).
    * sparse_mode 3 (rightDownCausal): with s1 queries over s2 keys, query i
      sees key j iff ``j <= i + s2 - s1``; sparse_mode 0 without a mask sees all.
    * GQA: query head h reads KV head ``h // (num_heads / num_key_value_heads)``.
    Returns (attention_out [T, N, D] in query's dtype, softmax_lse [1] zeros).
    Softmax and both products run in float32 here.
    """
    op = "npu_fused_infer_attention_score"
    quantized = [k for k, v in unused.items() if v is not None and k not in ("antiquant_mode", "key_antiquant_mode",
                                                                            "value_antiquant_mode")]
    require(not quantized and pse_shift is None, op, f"arguments not emulated: {quantized or ['pse_shift']}")
    require(input_layout == "TND", op, f"only input_layout='TND' is emulated, got {input_layout!r}")
    require(not softmax_lse_flag, op, "softmax_lse_flag=True is not emulated")
    require(query.dtype in HALF_DTYPES, op, f"query must be float16/bfloat16 on Atlas A2, got {query.dtype}")
    require(key.dtype == value.dtype == query.dtype, op, "key/value must have query's dtype (no quantized cache emulated)")
    require(query.is_contiguous() and key.is_contiguous() and value.is_contiguous(), op, "query/key/value must be contiguous")
    require(query.dim() == 3 and query.shape[1] == num_heads, op, f"TND query must be [T, {num_heads}, D], got {tuple(query.shape)}")
    kv_heads = num_key_value_heads or num_heads
    require(num_heads % kv_heads == 0 and num_heads // kv_heads <= 64, op,
            f"num_heads {num_heads} must be a multiple of num_key_value_heads {kv_heads}, ratio <= 64")
    d = query.shape[2]
    require(d in TND_HEAD_DIMS, op, f"TND without rope takes head dim 128 or 192, got {d}")
    _check_mask(op, atten_mask, sparse_mode)
    require(actual_seq_lengths is not None and actual_seq_lengths_kv is not None, op,
            "TND needs actual_seq_lengths and actual_seq_lengths_kv")
    q_ends = [int(x) for x in actual_seq_lengths]
    kv_lens = [int(x) for x in actual_seq_lengths_kv]
    batch = len(q_ends)
    require(batch <= TND_MAX_BATCH, op, f"TND takes at most {TND_MAX_BATCH} batch entries, got {batch}")
    require(len(kv_lens) == batch, op, "actual_seq_lengths and actual_seq_lengths_kv must have one entry per batch")
    require(all(b >= a for a, b in zip([0] + q_ends, q_ends)), op, "actual_seq_lengths must be cumulative (non-decreasing)")
    require(not q_ends or q_ends[-1] == query.shape[0], op, f"actual_seq_lengths ends at {q_ends[-1:]} but query has {query.shape[0]} rows")
    require(block_table is not None, op, "only the paged (block_table) case is emulated")
    require(block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.shape[0] == batch, op,
            f"block_table must be int32 [batch={batch}, max_blocks], got {block_table.dtype} {tuple(block_table.shape)}")
    require(block_size % 128 == 0 and 128 <= block_size <= 512, op, f"page attention block_size must be 128..512 in steps of 128, got {block_size}")
    if key.dim() == 3:
        require(tuple(key.shape[1:]) == (block_size, kv_heads * d), op, f"key must be [blocks, {block_size}, {kv_heads * d}], got {tuple(key.shape)}")
    else:
        require(tuple(key.shape[1:]) == (kv_heads, block_size, d), op, f"key must be [blocks, {kv_heads}, {block_size}, {d}]")
    require(key.shape == value.shape, op, "key and value shapes must match")
    need = max((-(-n // block_size) for n in kv_lens), default=0)
    require(block_table.shape[1] >= need, op, f"block_table has {block_table.shape[1]} columns, the longest entry needs {need}")
    # PageAttention: the cache's block count bounds the blocks all entries read together
    # (entries sharing blocks, e.g. a prefix, still count once each).
    total = sum(-(-n // block_size) for n in kv_lens)
    require(total <= key.shape[0], op, f"the batch entries read {total} blocks in all (sum of ceil(actual_seq_lengths_kv / "
            f"block_size)), more than the cache's {key.shape[0]} blocks; split the batch into several calls")

    out = torch.zeros(query.shape, dtype=torch.float32)
    group = num_heads // kv_heads
    start = 0
    for b in range(batch):
        end, s2 = q_ends[b], kv_lens[b]
        s1 = end - start
        if s1 == 0 or s2 == 0:  # empty KV: the document fills zeros
            start = end
            continue
        k = _paged_context(key, block_table[b], s2, block_size, kv_heads).float().repeat_interleave(group, dim=1)
        v = _paged_context(value, block_table[b], s2, block_size, kv_heads).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query[start:end].float(), k) * scale
        if sparse_mode == 3:
            i = torch.arange(s1)[:, None]
            j = torch.arange(s2)[None, :]
            scores = scores.masked_fill(j > i + (s2 - s1), float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
        start = end
    # A row whose every key is masked (s1 > s2) comes out NaN; inner_precise's
    # "row invalid" correction (2, 3) zeroes it on the device.
    if inner_precise in (2, 3):
        out = torch.nan_to_num(out, nan=0.0)
    return out.to(query.dtype), torch.zeros(1, dtype=torch.float32)
