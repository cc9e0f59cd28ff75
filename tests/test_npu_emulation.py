"""The torch_npu emulation: each op against cpu_ref (the spec), its documented
argument checks, and the install/uninstall of the stand-in modules."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from infer.backends.cpu_ref import CpuRefBackend, attention as ref_attention, moe as ref_moe, ops as ref_ops
from infer.primitives.types import AttentionMetadata, round_to_dtype
from infer.testing.npu_emulation import NpuOpError, attention_ops as A, installed, layer_ops as L, moe_ops as M

TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}
HALF = [torch.float16, torch.bfloat16]


def rounded(rng, shape, dtype, scale=1.0):
    """(float32 numpy values exactly representable in dtype, the torch tensor of them)."""
    name = str(dtype).removeprefix("torch.")
    x = round_to_dtype(rng.standard_normal(shape).astype(np.float32) * scale, name)
    return x, torch.from_numpy(x).to(dtype)


def close(got: torch.Tensor, want: np.ndarray, dtype) -> None:
    np.testing.assert_allclose(got.float().numpy(), want, atol=TOL[dtype], rtol=TOL[dtype])


# -- installation ------------------------------------------------------------
def test_installed_provides_torch_npu_and_torch_npu_namespace_then_removes_them():
    import importlib.util

    assert importlib.util.find_spec("torch_npu") is None and not hasattr(torch, "npu")
    with installed() as mod:
        import torch_npu

        assert torch_npu is mod and importlib.util.find_spec("torch_npu") is not None
        assert torch.npu.is_available() and torch.npu.emulated_host_device == "cpu"
    assert "torch_npu" not in sys.modules and not hasattr(torch, "npu")


# -- kv cache write ------------------------------------------------------------
def test_scatter_pa_kv_cache_norm_matches_cpu_ref_kv_write():
    rng = np.random.default_rng(0)
    nb, bs, hk, d, t = 3, 128, 2, 64, 10
    slots = rng.choice(nb * bs, t, replace=False)
    slots[[2, 7]] = -1  # padded rows: skipped by "Norm" as by cpu_ref
    k_np, k = rounded(rng, (t, hk, d), torch.float16)
    v_np, v = rounded(rng, (t, hk, d), torch.float16)
    cache = torch.zeros(2, nb, bs, hk, d, dtype=torch.float16)
    A.npu_scatter_pa_kv_cache(k, v, cache[0], cache[1], torch.from_numpy(slots).int(), cache_mode="Norm")
    ref = np.zeros((2, nb, bs, hk, d), np.float32)
    ref_attention.kv_write(k_np, v_np, ref, slots)
    np.testing.assert_array_equal(cache.float().numpy(), ref)


def test_scatter_pa_kv_cache_norm_skips_minus_one_slots_as_in_vllm_ascend():
    """vllm-ascend's op test (test_pa_kv_cache_ops.py): slots [0, -1, 3], block_size 4, 2 blocks, head_dim 8."""
    torch.manual_seed(20260709)
    key = torch.arange(3 * 8, dtype=torch.float16).view(3, 1, 8)
    value = key + 100
    key_cache = torch.randn(2, 4, 1, 8, dtype=torch.float16)
    value_cache = torch.randn_like(key_cache)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    want_k[0, 0], want_k[0, 3] = key[0], key[2]
    want_v[0, 0], want_v[0, 3] = value[0], value[2]
    A.npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, torch.tensor([0, -1, 3], dtype=torch.int32),
                              cache_mode="Norm")
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)
    before = key_cache.clone()
    A.npu_scatter_pa_kv_cache(key[:2], value[:2], key_cache, value_cache, torch.tensor([-1, -1], dtype=torch.int32),
                              cache_mode="Norm")
    assert torch.equal(key_cache, before)


def test_scatter_pa_kv_cache_default_pa_nz_mode_rejects_an_nd_cache():
    """torch_npu's default cache_mode is "PA_NZ": the call without cache_mode, on ND caches, must fail."""
    cache = torch.zeros(2, 2, 128, 2, 64, dtype=torch.float16)
    k = torch.ones(3, 2, 64, dtype=torch.float16)
    with pytest.raises(NpuOpError, match="cache_mode='Norm'"):
        A.npu_scatter_pa_kv_cache(k, k, cache[0], cache[1], torch.tensor([0, 5, 9]))


def test_scatter_pa_kv_cache_pa_nz_writes_the_nz_layout_as_op_plugins_golden():
    """op-plugin's test_scatter_pa_kv_cache.py golden: [blocks, N*D/16, block_size, 16] caches, 16 of 64 slots."""
    rng = np.random.default_rng(3)
    bs_tokens, heads, dk, dv, nb, last, block = 16, 4, 32, 64, 2, 16, 32
    key = torch.from_numpy(rng.standard_normal((bs_tokens, heads, dk)).astype(np.float16))
    value = torch.from_numpy(rng.standard_normal((bs_tokens, heads, dv)).astype(np.float16))
    key_cache = torch.from_numpy(rng.standard_normal((nb, heads * dk // last, block, last)).astype(np.float16))
    value_cache = torch.zeros(nb, heads * dv // last, block, last, dtype=torch.float16)
    slots = rng.choice(nb * block, bs_tokens, replace=False).astype(np.int32)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    for i, s in enumerate(slots.tolist()):
        for j in range(heads * dk // last):
            want_k[s // block, j, s % block] = key[i].reshape(-1)[j * last:(j + 1) * last]
        for j in range(heads * dv // last):
            want_v[s // block, j, s % block] = value[i].reshape(-1)[j * last:(j + 1) * last]
    A.npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, torch.from_numpy(slots))
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)
    with pytest.raises(NpuOpError, match=r"\[0, 63\]"):  # PA_NZ documents no -1 padding
        A.npu_scatter_pa_kv_cache(key[:2], value[:2], key_cache, value_cache, torch.tensor([0, -1]))


def test_scatter_pa_kv_cache_rejects_float32_strided_and_out_of_range_slots():
    cache = torch.zeros(2, 1, 128, 2, 16, dtype=torch.float16)
    k = torch.ones(2, 2, 16, dtype=torch.float16)
    with pytest.raises(NpuOpError, match="float16/bfloat16/int8"):  # aclnnScatterPaKvCache on A2/A3
        A.npu_scatter_pa_kv_cache(k.float(), k.float(), cache[0].float(), cache[1].float(), torch.tensor([0, 1]),
                                  cache_mode="Norm")
    for bad in ([0, 128], [0, -2]):
        with pytest.raises(NpuOpError, match=r"\[0, 127\]"):
            A.npu_scatter_pa_kv_cache(k, k, cache[0], cache[1], torch.tensor(bad), cache_mode="Norm")
    with pytest.raises(NpuOpError, match="unique"):
        A.npu_scatter_pa_kv_cache(k, k, cache[0], cache[1], torch.tensor([4, 4]), cache_mode="Norm")
    strided = torch.ones(2, 16, 2, dtype=torch.float16).transpose(1, 2)
    with pytest.raises(NpuOpError, match="contiguous"):
        A.npu_scatter_pa_kv_cache(strided, strided, cache[0], cache[1], torch.tensor([0, 1]), cache_mode="Norm")


# -- fused attention -----------------------------------------------------------
def _paged_case(rng, dtype, reqs, hq, hk, d, bs=128):
    """A paged cache holding each request's context, the TND query and the cpu_ref metadata."""
    seq = np.array([s for _, s in reqs], np.int32)
    qlen = np.array([q for q, _ in reqs], np.int32)
    nblocks = [-(-int(s) // bs) for s in seq]
    physical = rng.permutation(sum(nblocks) + 2)[: sum(nblocks)]
    table = np.zeros((len(reqs), max(nblocks)), np.int32)
    table[np.arange(len(reqs)).repeat(nblocks), np.concatenate([np.arange(n) for n in nblocks])] = physical
    kv_np, kv = rounded(rng, (2, int(physical.max()) + 1, bs, hk, d), dtype)
    q_np, q = rounded(rng, (int(qlen.sum()), hq, d), dtype)
    qsl = np.concatenate([[0], np.cumsum(qlen)]).astype(np.int32)
    meta = AttentionMetadata(qsl, seq, table, np.zeros(int(qlen.sum()), np.int64), int(qlen.max()), int(seq.max()), bs)
    return kv_np, kv, q_np, q, meta


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("hq, hk", [(4, 4), (6, 2), (8, 1)])
def test_fused_infer_attention_tnd_paged_causal_matches_cpu_ref(dtype, hq, hk):
    rng = np.random.default_rng(hq * 10 + hk)
    reqs = [(5, 300), (1, 129), (17, 17), (1, 1), (40, 200)]
    kv_np, kv, q_np, q, meta = _paged_case(rng, dtype, reqs, hq, hk, 128)
    nb = kv.shape[1]
    out, lse = A.npu_fused_infer_attention_score(
        q, kv[0].reshape(nb, 128, hk * 128), kv[1].reshape(nb, 128, hk * 128),
        atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1), block_table=torch.from_numpy(meta.block_table),
        actual_seq_lengths=meta.query_start_loc[1:].tolist(), actual_seq_lengths_kv=meta.seq_lens.tolist(),
        num_heads=hq, num_key_value_heads=hk, scale=0.125, input_layout="TND", sparse_mode=3, block_size=128)
    assert out.dtype == dtype and lse.shape == (1,)
    close(out, ref_attention.attention(q_np, kv_np, meta, 0.125), dtype)


def test_fused_infer_attention_enforces_documented_limits():
    rng = np.random.default_rng(0)
    _, kv, _, q, meta = _paged_case(rng, torch.float16, [(3, 10)], 2, 2, 128)
    args = dict(atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1), block_table=torch.from_numpy(meta.block_table),
                actual_seq_lengths=[3], actual_seq_lengths_kv=[10], num_heads=2, num_key_value_heads=2, scale=1.0,
                input_layout="TND", sparse_mode=3, block_size=128)
    key = kv[0].reshape(kv.shape[1], 128, 256)
    with pytest.raises(NpuOpError, match="float16/bfloat16"):
        A.npu_fused_infer_attention_score(q.float(), key.float(), key.float(), **args)
    with pytest.raises(NpuOpError, match="block_size"):
        A.npu_fused_infer_attention_score(q, key, key, **{**args, "block_size": 16})
    with pytest.raises(NpuOpError, match="2048"):
        A.npu_fused_infer_attention_score(q, key, key, **{**args, "atten_mask": torch.ones(16, 16, dtype=torch.bool)})
    with pytest.raises(NpuOpError, match="int32"):
        A.npu_fused_infer_attention_score(q, key, key, **{**args, "block_table": args["block_table"].long()})


@pytest.mark.parametrize("d", [64, 80, 96, 256])
def test_fused_infer_attention_tnd_rejects_head_dims_other_than_128_and_192(d):
    """TND without rope: Q_D = K_D = V_D = 128, or Q_D = K_D = 192; 16-aligned is not enough."""
    rng = np.random.default_rng(0)
    _, kv, _, q, meta = _paged_case(rng, torch.float16, [(3, 10)], 2, 2, d)
    key = kv[0].reshape(kv.shape[1], 128, 2 * d)
    with pytest.raises(NpuOpError, match="head dim 128 or 192"):
        A.npu_fused_infer_attention_score(
            q, key, key, atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1),
            block_table=torch.from_numpy(meta.block_table), actual_seq_lengths=[3], actual_seq_lengths_kv=[10],
            num_heads=2, num_key_value_heads=2, input_layout="TND", sparse_mode=3, block_size=128)


def _tnd_args(q_ends, kv_lens, table_rows, max_blocks=1):
    return dict(atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1),
                block_table=torch.zeros(table_rows, max_blocks, dtype=torch.int32), actual_seq_lengths=q_ends,
                actual_seq_lengths_kv=kv_lens, num_heads=1, num_key_value_heads=1, input_layout="TND", sparse_mode=3,
                block_size=128)


def test_fused_infer_attention_rejects_entries_reading_more_blocks_than_the_cache_holds():
    """A 4096-row prefill cut into 32 tiles of 128 reads 1 + 2 + ... + 32 = 528 blocks (the
    request owns 32): one call of every tile fails on a cache of 100 blocks."""
    from infer.core.xy_plan import attention_table

    table = attention_table([0, 4096], [4096])
    assert len(table) == 32 and int((-(-table.kv_len // 128)).sum()) == 528
    q = torch.zeros(4096, 1, 128, dtype=torch.float16)
    key = torch.zeros(100, 128, 128, dtype=torch.float16)
    args = _tnd_args(np.cumsum(table.token_num).tolist(), table.kv_len.tolist(), 32, max_blocks=32)
    with pytest.raises(NpuOpError, match="528 blocks"):
        A.npu_fused_infer_attention_score(q, key, key, **args)


def test_fused_infer_attention_tnd_takes_at_most_4096_batch_entries():
    q = torch.zeros(4097, 1, 128, dtype=torch.float16)
    key = torch.zeros(1, 128, 128, dtype=torch.float16)
    with pytest.raises(NpuOpError, match="at most 4096"):
        A.npu_fused_infer_attention_score(q, key, key, **_tnd_args(list(range(1, 4098)), [0] * 4097, 4097))
    out, _ = A.npu_fused_infer_attention_score(q[:4096], key, key, **_tnd_args(list(range(1, 4097)), [0] * 4096, 4096))
    assert out.shape == (4096, 1, 128)


# -- row-wise ops --------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=["fp32", "fp16", "bf16"])
def test_rms_norm_and_add_rms_norm_match_cpu_ref(dtype):
    rng = np.random.default_rng(1)
    x_np, x = rounded(rng, (5, 64), dtype)
    r_np, r = rounded(rng, (5, 64), dtype)
    w_np, w = rounded(rng, (64,), dtype)
    y, rstd = L.npu_rms_norm(x, w, epsilon=1e-5)
    close(y, ref_ops.rms_norm(x_np, w_np, 1e-5), dtype)
    assert rstd.dtype == torch.float32 and rstd.shape == (5, 1)
    y, _, summed = L.npu_add_rms_norm(x, r, w, epsilon=1e-5)
    _, want_sum = CpuRefBackend().rms_norm(x_np, w_np, 1e-5, residual=r_np)
    close(y, ref_ops.rms_norm(round_to_dtype(want_sum, str(dtype)[6:]), w_np, 1e-5), dtype)
    close(summed, round_to_dtype(want_sum, str(dtype)[6:]), dtype)


@pytest.mark.parametrize("neox", [True, False], ids=["half", "interleave"])
def test_rotary_mul_matches_cpu_ref_rotary(neox):
    rng = np.random.default_rng(2)
    t, h, d = 6, 3, 64
    x_np, x = rounded(rng, (t, h, d), torch.float32)
    pos = rng.integers(0, 32, t)
    ang = pos[:, None] * (1.0 / 10000 ** (np.arange(0, d, 2) / d))[None]
    cos_sin = np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32)
    cos, sin = torch.from_numpy(cos_sin[:, : d // 2]), torch.from_numpy(cos_sin[:, d // 2:])
    r1 = torch.cat((cos, cos), -1) if neox else cos.repeat_interleave(2, -1)
    r2 = torch.cat((sin, sin), -1) if neox else sin.repeat_interleave(2, -1)
    out = L.npu_rotary_mul(x[None], r1[None, :, None], r2[None, :, None], rotary_mode="half" if neox else "interleave")[0]
    # cos_sin already holds one row per token: the reference reads row t for token t.
    want, _ = ref_ops.rotary(x_np, x_np[:, :1], np.arange(t), cos_sin, neox)
    close(out, want, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=["fp32", "fp16", "bf16"])
def test_swiglu_matches_cpu_ref_silu_and_mul(dtype):
    x_np, x = rounded(np.random.default_rng(3), (5, 80), dtype)
    close(L.npu_swiglu(x, dim=-1), ref_ops.act_and_mul(x_np, "silu"), dtype)


# -- MoE chain -----------------------------------------------------------------
@pytest.mark.parametrize("top_k, renormalize", [(1, False), (2, True), (3, False)])
def test_gating_routing_grouped_matmul_unpermute_chain_matches_cpu_ref_moe(top_k, renormalize):
    rng = np.random.default_rng(top_k)
    t, h, i, e = 9, 32, 16, 6
    dtype = torch.float32
    x_np, x = rounded(rng, (t, h), dtype)
    logit_np, logits = rounded(rng, (t, e), dtype)
    w13_np, w13 = rounded(rng, (e, 2 * i, h), dtype, 0.2)
    w2_np, w2 = rounded(rng, (e, h, i), dtype, 0.2)
    _, ids, probs = M.npu_moe_gating_top_k(logits, top_k, out_flag=True)
    weights = probs.gather(1, ids.long())
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    ex, row_idx, counts, _ = M.npu_moe_init_routing_v2(x, ids, active_num=t * top_k, expert_num=e, expert_tokens_num_type=1,
                                                       expert_tokens_num_flag=True, active_expert_range=[0, e], quant_mode=-1)
    gate_up = M.npu_grouped_matmul([ex], [w13.transpose(1, 2)], group_list=counts, split_item=2, group_type=0, group_list_type=1)[0]
    down = M.npu_grouped_matmul([L.npu_swiglu(gate_up)], [w2.transpose(1, 2)], group_list=counts, split_item=2,
                                group_type=0, group_list_type=1)[0]
    out = M.npu_moe_token_unpermute(down, row_idx, probs=weights)
    want, want_counts = ref_moe.moe(x_np, logit_np, w13_np, w2_np, top_k, renormalize)
    close(out, want, dtype)
    np.testing.assert_array_equal(counts.numpy(), want_counts)


def test_init_routing_sorts_pairs_by_expert_and_unpermute_undoes_it():
    x = torch.arange(4, dtype=torch.float32)[:, None].repeat(1, 3)
    ids = torch.tensor([[2, 0], [1, 2], [0, 0], [2, 1]], dtype=torch.int32)
    ex, row_idx, counts, _ = M.npu_moe_init_routing_v2(x, ids, active_num=8, expert_num=3, expert_tokens_num_type=1,
                                                       expert_tokens_num_flag=True, active_expert_range=[0, 3], quant_mode=-1)
    assert ex[:, 0].tolist() == [0, 2, 2, 1, 3, 0, 1, 3]  # expert 0: pairs 1, 4, 5; expert 1: 2, 7; expert 2: 0, 3, 6
    assert counts.tolist() == [3, 2, 3]
    back = M.npu_moe_token_unpermute(ex, row_idx, probs=torch.full((4, 2), 0.5))
    torch.testing.assert_close(back, x)


def test_grouped_matmul_takes_cumsum_or_count_group_lists():
    rng = np.random.default_rng(5)
    a = torch.from_numpy(rng.standard_normal((7, 4)).astype(np.float32))
    w = torch.from_numpy(rng.standard_normal((3, 4, 5)).astype(np.float32))
    want = torch.cat([a[:2] @ w[0], a[2:2] @ w[1], a[2:] @ w[2]])
    for gl, kind in ((torch.tensor([2, 0, 5]), 1), (torch.tensor([2, 2, 7]), 0)):
        got = M.npu_grouped_matmul([a], [w], group_list=gl, split_item=2, group_type=0, group_list_type=kind)[0]
        torch.testing.assert_close(got, want)
    with pytest.raises(NpuOpError, match="sum to M"):
        M.npu_grouped_matmul([a], [w], group_list=torch.tensor([1, 1, 1]), split_item=2, group_type=0, group_list_type=1)


# -- npu_weight_quant_batchmatmul ------------------------------------------------------
from infer.testing.npu_emulation import quant_ops as Q  # noqa: E402


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("group", [0, 32])
def test_weight_quant_batchmatmul_dequantizes_weight_plus_offset_times_scale(dtype, group):
    rng = np.random.default_rng(group)
    k, n = 64, 24
    x, xt = rounded(rng, (5, k), dtype)
    q = rng.integers(-128, 128, (k, n)).astype(np.int8)
    rows = k // group if group else 1
    s, st = rounded(rng, (rows, n), dtype, 0.01)
    o, ot = rounded(rng, (rows, n), dtype, 4.0)
    per_k = (lambda t: np.repeat(t, group, 0)) if group else (lambda t: t)
    want = x @ ((q.astype(np.float32) + per_k(o)) * per_k(s))
    close(Q.npu_weight_quant_batchmatmul(xt, torch.from_numpy(q), st, ot, antiquant_group_size=group), want, dtype)
    # bias: float16 for float16 x, float32 for bfloat16 x (the document's pairing)
    bias_dtype = torch.float32 if dtype == torch.bfloat16 else torch.float16
    bias, bt = rounded(rng, (n,), bias_dtype)
    got = Q.npu_weight_quant_batchmatmul(xt, torch.from_numpy(q), st, ot, bias=bt, antiquant_group_size=group)
    close(got, want + bias, dtype)
    wrong = torch.float16 if dtype == torch.bfloat16 else torch.float32
    with pytest.raises(NpuOpError, match="bias must be"):
        Q.npu_weight_quant_batchmatmul(xt, torch.from_numpy(q), st, ot, bias=bt.to(wrong), antiquant_group_size=group)


def test_weight_quant_batchmatmul_enforces_documented_limits():
    x, w = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(64, 8, dtype=torch.int8)
    s = torch.ones(2, 8, dtype=torch.bfloat16)
    with pytest.raises(NpuOpError, match="float16/bfloat16"):
        Q.npu_weight_quant_batchmatmul(x.float(), w, s.float(), antiquant_group_size=32)
    with pytest.raises(NpuOpError, match="multiple of 32"):
        Q.npu_weight_quant_batchmatmul(x, w, torch.ones(4, 8, dtype=torch.bfloat16), antiquant_group_size=16)
    with pytest.raises(NpuOpError, match="x's dtype"):
        Q.npu_weight_quant_batchmatmul(x, w, s.half(), antiquant_group_size=32)
    with pytest.raises(NpuOpError, match="int8"):
        Q.npu_weight_quant_batchmatmul(x, w.int(), s, antiquant_group_size=32)
    with pytest.raises(NpuOpError, match="not emulated"):
        Q.npu_weight_quant_batchmatmul(x, w, s, quant_scale=torch.ones(8), antiquant_group_size=32)
    with pytest.raises(NpuOpError, match="per-channel"):
        Q.npu_weight_quant_batchmatmul(x, w, s)
    with pytest.raises(NpuOpError, match="no rows"):
        Q.npu_weight_quant_batchmatmul(x[:0], w, s, antiquant_group_size=32)


def test_weight_quant_batchmatmul_takes_n_up_to_65535_only():
    """K and N lie in [1, 65535]: a 152k-vocabulary lm_head in one product is rejected."""
    x = torch.zeros(1, 64, dtype=torch.float16)
    for n, ok in ((65535, True), (65536, False), (151936, False)):
        w, s = torch.zeros(64, n, dtype=torch.int8), torch.ones(1, n, dtype=torch.float16)
        if ok:
            assert Q.npu_weight_quant_batchmatmul(x, w, s).shape == (1, n)
        else:
            with pytest.raises(NpuOpError, match=r"\[1, 65535\]"):
                Q.npu_weight_quant_batchmatmul(x, w, s)
    with pytest.raises(NpuOpError, match="K=65536"):
        Q.npu_weight_quant_batchmatmul(torch.zeros(1, 65536, dtype=torch.float16), torch.zeros(65536, 2, dtype=torch.int8),
                                       torch.ones(1, 2, dtype=torch.float16))
