"""The `torch` backend against independent computations: dense float64
attention per request, transformers' rotary helpers, a loop-over-experts MoE,
the contract's NumPy noise, and two real gloo processes for the collectives.
Each test runs with the backend's native CPU kernels and with torch ops only."""

from __future__ import annotations

import inspect
import math
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import infer.backends.torch_native.attention as attention_mod
from infer.primitives.noise import gumbel_noise as reference_noise
from infer.backends.torch_native import TorchBackend, noise, ranking, sampling
from infer.backends.torch_native.native import ops as native_ops
from infer.primitives.spec import CHECKS, PRIMITIVES
from infer.primitives.types import AttentionMetadata, DenseWeight, SamplingTensors
from infer.dispatch import Ops
from infer.registry import get_backend

BACKEND = TorchBackend()
# The primitives as the runtime resolves them: the native fast paths first (declined with torch ops only).
OPS = Ops(BACKEND, validate=False)


@pytest.fixture(autouse=True, params=["native", "torch_ops"])
def kernels(request, monkeypatch):
    """Every test twice: with the native CPU kernels (where they apply) and with torch ops only."""
    if request.param == "torch_ops":
        monkeypatch.setattr(native_ops, "library", lambda: None)
    return request.param


# -- attention -------------------------------------------------------------------
def paged_batch(q_lens, seq_lens, hk, d, block_size, dtype=torch.float32, seed=0):
    """A filled paged cache, its metadata and the dense per-request K/V it holds."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = [-(-s // block_size) for s in seq_lens]
    perm = torch.randperm(sum(n_blocks) + 2, generator=g).tolist()  # scattered, non-contiguous blocks
    table = np.zeros((len(seq_lens), max(n_blocks, default=0) + 1), np.int32)
    cache = BACKEND.allocate_kv_cache(sum(n_blocks) + 2, block_size, hk, d, str(dtype).removeprefix("torch."))
    dense, slots = [], []
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        table[b, : n_blocks[b]] = [perm.pop() for _ in range(n_blocks[b])]
        pos_slots = [table[b, p // block_size] * block_size + p % block_size for p in range(seq_len)]
        kv = torch.randn(2, seq_len, hk, d, generator=g).to(dtype)
        OPS.kv_write(kv[0], kv[1], cache, torch.tensor(pos_slots, dtype=torch.int64))
        dense.append(kv)
        slots += pos_slots[seq_len - q_len :]
    meta = AttentionMetadata(
        query_start_loc=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
        seq_lens=np.array(seq_lens, np.int32),
        block_table=table,
        slot_mapping=np.array(slots, np.int64),
        max_query_len=max(q_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        block_size=block_size,
    )
    q = torch.randn(sum(q_lens), hk * 3, d, generator=g).to(dtype)
    return q, cache, meta, dense


def dense_attention(q, dense, q_lens, scale, window=None, soft_cap=None):
    """Float64 attention per request over unpaged K/V, with the contract's mask."""
    out, start = torch.zeros(q.shape, dtype=torch.float64), 0
    for kv, q_len in zip(dense, q_lens):
        k, v = kv.double()
        seq_len, hk = k.shape[0], k.shape[1]
        qb = q[start : start + q_len].double()
        k, v = k.repeat_interleave(q.shape[1] // hk, 1), v.repeat_interleave(q.shape[1] // hk, 1)
        s = torch.einsum("qhd,khd->hqk", qb, k) * scale
        if soft_cap is not None:
            s = soft_cap * torch.tanh(s / soft_cap)
        qp = torch.arange(seq_len - q_len, seq_len)[:, None]
        kp = torch.arange(seq_len)[None, :]
        allowed = (kp <= qp) & ((qp - kp < window) if window else True)
        s = s.masked_fill(~allowed, float("-inf"))
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
        start += q_len
    return out


BATCHES = {
    "decode": ([1, 1, 1], [5, 16, 33]),
    "prefill": ([7, 12], [7, 12]),
    "chunked_prefill_after_cache": ([5, 9], [21, 9]),
    "mixed": ([1, 6, 1, 3], [40, 6, 17, 19]),
    "request_without_queries": ([2, 0, 1], [2, 8, 4]),
}


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("hk", [1, 3])
@pytest.mark.parametrize("block_size", [1, 16])
def test_attention_matches_dense_attention(batch, hk, block_size):
    q_lens, seq_lens = BATCHES[batch]
    q, cache, meta, dense = paged_batch(q_lens, seq_lens, hk, 16, block_size)
    got = OPS.attention(q, cache, OPS.prepare_metadata(meta), 0.25)
    torch.testing.assert_close(got.double(), dense_attention(q, dense, q_lens, 0.25), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 4, 20])
def test_attention_sliding_window_sees_only_the_last_w_positions(window):
    q_lens, seq_lens = BATCHES["mixed"]
    q, cache, meta, dense = paged_batch(q_lens, seq_lens, 3, 16, 4)
    got = OPS.attention(q, cache, OPS.prepare_metadata(meta), 0.25, sliding_window=window)
    want = dense_attention(q, dense, q_lens, 0.25, window=window)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 6])
def test_attention_soft_cap_squashes_scores(window):
    q_lens, seq_lens = BATCHES["mixed"]
    q, cache, meta, dense = paged_batch(q_lens, seq_lens, 3, 16, 4)
    got = OPS.attention(4 * q, cache, OPS.prepare_metadata(meta), 0.25, window, soft_cap=3.0)
    want = dense_attention(4 * q, dense, q_lens, 0.25, window=window, soft_cap=3.0)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_attention_without_a_prepared_plan_builds_one():
    q_lens, seq_lens = BATCHES["mixed"]
    q, cache, meta, dense = paged_batch(q_lens, seq_lens, 1, 16, 4)
    raw = AttentionMetadata(*(torch.as_tensor(getattr(meta, f)) for f in ("query_start_loc", "seq_lens", "block_table", "slot_mapping")),
                            meta.max_query_len, meta.max_seq_len, meta.block_size)  # fmt: skip
    want = dense_attention(q, dense, q_lens, 0.25)
    torch.testing.assert_close(OPS.attention(q, cache, raw, 0.25).double(), want, atol=1e-5, rtol=1e-5)


def test_attention_in_small_chunks_matches(monkeypatch):
    monkeypatch.setattr(attention_mod, "_KV_CHUNK_BYTES", 1)  # one request per gather
    monkeypatch.setattr(attention_mod, "_SCORE_CHUNK", 1)  # one query per score block
    q_lens, seq_lens = BATCHES["mixed"]
    q, cache, meta, dense = paged_batch(q_lens, seq_lens, 3, 16, 4)
    m = OPS.prepare_metadata(meta)
    want = dense_attention(q, dense, q_lens, 0.25)
    torch.testing.assert_close(OPS.attention(q, cache, m, 0.25).double(), want, atol=1e-5, rtol=1e-5)
    got = OPS.attention(q, cache, m, 0.25, soft_cap=2.0).double()
    torch.testing.assert_close(got, dense_attention(q, dense, q_lens, 0.25, soft_cap=2.0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_half_precision_keeps_its_dtype(dtype):
    q_lens, seq_lens = BATCHES["mixed"]
    q, cache, meta, dense = paged_batch(q_lens, seq_lens, 3, 32, 16, dtype=dtype)
    got = OPS.attention(q, cache, OPS.prepare_metadata(meta), 32**-0.5)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), dense_attention(q, dense, q_lens, 32**-0.5), atol=2e-2, rtol=2e-2)


def test_attention_of_an_empty_batch_is_empty():
    q, cache, meta, _ = paged_batch([], [], 2, 8, 16)
    out = OPS.attention(torch.zeros(0, 6, 8), cache, OPS.prepare_metadata(meta), 1.0)
    assert out.shape == (0, 6, 8)


def test_kv_write_scatters_in_place_and_skips_padding():
    cache = BACKEND.allocate_kv_cache(3, 4, 2, 8, "float32")
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    OPS.kv_write(k, v, cache, torch.tensor([5, -1, 11]))
    assert torch.equal(cache[0, 1, 1], k[0]) and torch.equal(cache[1, 2, 3], v[2])
    assert int((cache != 0).flatten(2).any(-1).sum()) == 4  # K and V of two tokens, nothing for the -1 row


# -- blocks to host bytes and back (KV offload, swap) -------------------------------
def filled_cache(dtype: str, num_blocks=6, block_size=4, hk=2, d=8) -> torch.Tensor:
    """A cache with every byte of every block random (fp8: every uint8 code, NaNs included)."""
    g = torch.Generator().manual_seed(7)
    cache = BACKEND.allocate_kv_cache(num_blocks, block_size, hk, d, dtype)
    raw = torch.randint(0, 256, (cache.numel() * cache.element_size(),), dtype=torch.uint8, generator=g)
    cache.view(torch.uint8).view(-1).copy_(raw)
    return cache


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8", "float32"])
def test_read_blocks_gives_host_uint8_rows_of_the_blocks_bytes(dtype):
    cache = filled_cache(dtype)
    data = BACKEND.read_blocks(cache, np.array([4, 1], np.int32))
    block_bytes = 2 * 4 * 2 * 8 * {"bfloat16": 2, "fp8": 1, "float32": 4}[dtype]  # K and V of 4 tokens x 2 heads x 8
    assert isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.shape == (2, block_bytes)
    assert block_bytes == cache.nbytes // 6
    # Row i holds block 4's, then block 1's, K then V, in the cache's own layout.
    want = cache[:, [4, 1]].movedim(1, 0).contiguous().view(torch.uint8).reshape(2, -1)
    assert np.array_equal(data, want.numpy())
    cache.zero_()
    assert data.any()  # a copy, not a view of the cache


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
def test_blocks_written_back_reproduce_the_read_blocks_bytes_exactly(dtype):
    cache = filled_cache(dtype)
    before = cache.clone()
    data = BACKEND.read_blocks(cache, np.array([0, 2, 5]))
    BACKEND.write_blocks(cache, np.array([5, 3, 0]), data)  # 0 and 5 trade places, 2 lands on 3
    want = before.clone()
    want[:, [5, 3, 0]] = before[:, [0, 2, 5]]
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))  # bytes, so NaN codes and -0 count too


def test_read_and_write_of_no_blocks_are_empty_and_change_nothing():
    cache = filled_cache("bfloat16")
    before = cache.clone()
    data = BACKEND.read_blocks(cache, np.zeros(0, np.int64))
    assert data.dtype == np.uint8 and data.shape == (0, cache.nbytes // 6)
    BACKEND.write_blocks(cache, np.zeros(0, np.int64), data)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))


def test_write_blocks_refuses_bytes_of_another_cache_shape():
    data = BACKEND.read_blocks(filled_cache("bfloat16", d=16), np.array([1]))
    with pytest.raises(ValueError, match=r"uint8 bytes \[1, 256\].*got ndarray uint8 \(1, 512\)"):
        BACKEND.write_blocks(filled_cache("bfloat16"), np.array([1]), data)


# -- row-wise ops ------------------------------------------------------------------
def test_rms_norm_with_residual_returns_the_rounded_sum():
    x, r, w = torch.randn(4, 32, dtype=torch.bfloat16), torch.randn(4, 32, dtype=torch.bfloat16), torch.randn(32)
    y, new_residual = OPS.rms_norm(x, w.bfloat16(), 1e-5, r)
    s = x.double() + r.double()
    assert torch.equal(new_residual, s.to(torch.bfloat16))
    s = new_residual.double()
    want = s / torch.sqrt(s.square().mean(-1, keepdim=True) + 1e-5) * w.bfloat16().double()
    torch.testing.assert_close(y.double(), want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("neox_style", [True, False])
@pytest.mark.parametrize("rot_dim", [64, 32])
def test_rotary_matches_transformers(neox_style, rot_dim):
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_rope
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope

    t, d = 5, 64
    q, k, pos = torch.randn(t, 4, d), torch.randn(t, 2, d), torch.tensor([0, 3, 7, 7, 100])
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    freqs = torch.outer(torch.arange(128).float(), inv_freq)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    got_q, got_k = OPS.rotary(q.clone(), k.clone(), pos, cache, neox_style)
    if neox_style:
        cos, sin = torch.cat([freqs.cos()] * 2, -1)[pos], torch.cat([freqs.sin()] * 2, -1)[pos]  # [T, R]
        qr, kr = llama_rope(q[..., :rot_dim], k[..., :rot_dim], cos, sin, unsqueeze_dim=1)
    else:
        sin, cos = freqs.sin()[pos][None], freqs.cos()[pos][None]  # gpt-j's [1, T, R/2]
        qr, kr = gptj_rope(q[None, ..., :rot_dim], sin, cos)[0], gptj_rope(k[None, ..., :rot_dim], sin, cos)[0]
    torch.testing.assert_close(got_q[..., :rot_dim], qr)
    torch.testing.assert_close(got_k[..., :rot_dim], kr)
    assert torch.equal(got_q[..., rot_dim:], q[..., rot_dim:])


@pytest.mark.parametrize("kind", ["silu", "gelu", "gelu_tanh"])
def test_act_and_mul(kind):
    x = 3 * torch.randn(6, 20, dtype=torch.float64)
    a, b = x[:, :10], x[:, 10:]
    acts = {
        "silu": a / (1 + torch.exp(-a)),
        "gelu": 0.5 * a * (1 + torch.erf(a / math.sqrt(2))),
        "gelu_tanh": 0.5 * a * (1 + torch.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3))),
    }
    torch.testing.assert_close(OPS.act_and_mul(x.float(), kind).double(), acts[kind] * b, atol=1e-5, rtol=1e-5)


def test_embedding_gathers_rows():
    table = torch.randn(10, 4)
    assert torch.equal(BACKEND.embedding(torch.tensor([3, 0, 3], dtype=torch.int32), table), table[[3, 0, 3]])


def test_linear_goes_through_the_dense_weight():
    w = BACKEND.prepare_weight(DenseWeight(torch.randn(5, 3), torch.randn(5)))
    x = torch.randn(2, 3)
    torch.testing.assert_close(OPS.linear(x, w), x @ w.weight.T + w.bias)


# -- moe ---------------------------------------------------------------------------
def loop_over_experts_moe(x, logits, w13, w2, top_k, renormalize):
    probs = logits.double().softmax(-1)
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    counts = torch.zeros(w13.shape[0], dtype=torch.int64)
    for t in range(x.shape[0]):
        chosen = sorted(range(probs.shape[1]), key=lambda e: (-probs[t, e].item(), e))[:top_k]
        weights = probs[t, chosen] / (probs[t, chosen].sum() if renormalize else 1)
        for e, w in zip(chosen, weights):
            h = w13[e].double() @ x[t].double()
            out[t] += w * (w2[e].double() @ (F.silu(h[:inter]) * h[inter:]))
            counts[e] += 1
    return out, counts


@pytest.mark.parametrize("top_k, renormalize", [(1, False), (2, True), (3, False)])
def test_moe_matches_a_loop_over_experts(top_k, renormalize):
    x, logits = torch.randn(9, 16), torch.randn(9, 6)
    logits[:3] = 0.0  # all-equal rows: the lowest expert ids must win
    w13, w2 = 0.3 * torch.randn(6, 2 * 8, 16), 0.3 * torch.randn(6, 16, 8)
    out, counts = BACKEND.moe(x, logits, w13, w2, top_k, renormalize)
    want, want_counts = loop_over_experts_moe(x, logits, w13, w2, top_k, renormalize)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    assert counts.dtype == torch.int64 and torch.equal(counts, want_counts)


def test_moe_of_no_tokens():
    out, counts = BACKEND.moe(torch.zeros(0, 4), torch.zeros(0, 3), torch.zeros(3, 4, 4), torch.zeros(3, 4, 2), 2, True)
    assert out.shape == (0, 4) and torch.equal(counts, torch.zeros(3, dtype=torch.int64))


# -- sample ------------------------------------------------------------------------
def params(n, **kw):
    base = dict(temperature=np.ones(n, np.float32), top_k=np.zeros(n, np.int32), top_p=np.ones(n, np.float32),
                min_p=np.zeros(n, np.float32), seeds=np.arange(n, dtype=np.int64) + 7, steps=np.zeros(n, np.int64),
                presence_penalty=np.zeros(n, np.float32), frequency_penalty=np.zeros(n, np.float32),
                repetition_penalty=np.ones(n, np.float32))  # fmt: skip
    base.update(kw)
    return BACKEND.prepare_sampling(SamplingTensors(**base))


def test_noise_hash_matches_the_contract_bit_for_bit():
    seeds = torch.tensor([0, -1, 2**63 - 1, -(2**63), 123456789012345])
    steps = torch.tensor([0, 3, 2**40 + 5, 9, 1])
    got = noise.gumbel_noise(seeds, steps, 3000).numpy()
    np.testing.assert_array_equal(got, reference_noise(seeds.numpy(), steps.numpy(), 3000))
    at = noise.gumbel_noise_at(seeds, steps, torch.tensor([1, 4]), torch.tensor([2999, 0]))
    np.testing.assert_array_equal(at.numpy(), got[[1, 4], [2999, 0]])


def test_greedy_takes_the_lowest_id_on_ties_and_skips_the_noise(monkeypatch):
    monkeypatch.setattr(sampling, "gumbel_noise", None)  # calling it would fail
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 1.0, 5.0, 5.0]])
    out = BACKEND.sample(logits, params(2, temperature=np.zeros(2, np.float32)))
    assert out.token_ids.tolist() == [1, 0] and out.token_ids.dtype == torch.int64
    torch.testing.assert_close(out.logprobs, logits.log_softmax(-1)[[0, 1], [1, 0]])


def test_seeded_sampling_is_the_argmax_of_logits_plus_contract_noise():
    logits = torch.randn(3, 50)
    p = params(3, temperature=np.array([0.5, 1.0, 2.0], np.float32), steps=np.array([0, 4, 9]))
    want = (logits / p.temperature[:, None] + torch.from_numpy(reference_noise(p.seeds.numpy(), p.steps.numpy(), 50))).argmax(-1)
    before = logits.clone()
    assert torch.equal(BACKEND.sample(logits, p).token_ids, want)
    assert torch.equal(logits, before)  # the caller's logits are never filtered in place
    # The same seed and step give the same token whatever else is in the batch.
    alone = BACKEND.sample(logits[1:2], params(1, seeds=p.seeds[1:2].numpy(), steps=np.array([4])))
    assert alone.token_ids.item() == want[1].item()


def test_filters_keep_what_the_contract_says():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4))
    p = params(4, top_k=np.array([1, 2, 0, 0], np.int32), top_p=np.array([1, 1, 0.6, 1], np.float32),
               min_p=np.array([0, 0, 0, 0.5], np.float32))  # fmt: skip
    kept = sampling.filter_logits(logits, p.temperature, p.top_k, p.top_p, p.min_p) > float("-inf")
    assert kept.tolist() == [[True, False, False, False], [True, True, False, False],
                             [True, True, False, False], [True, True, False, False]]  # fmt: skip


def test_penalties_and_bias_follow_the_documented_order():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    p = params(1, repetition_penalty=np.array([2.0], np.float32), frequency_penalty=np.array([0.1], np.float32),
               presence_penalty=np.array([0.3], np.float32), prompt_token_ids=np.array([[0, -1]]),
               output_token_ids=np.array([[1, 1, -1]]), logit_bias_ids=np.array([[3, -1]]),
               logit_bias_values=np.array([[float("-inf"), 9.0]], np.float32))  # fmt: skip
    got = sampling.apply_penalties(logits, p)
    torch.testing.assert_close(got, torch.tensor([[1.0, -4.0 - 0.2 - 0.3, 1.0, float("-inf")]]))


def test_top_logprobs_are_raw_descending_lowest_id_first():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0]])
    out = BACKEND.sample(logits, params(1, max_num_logprobs=3, temperature=np.zeros(1, np.float32)))
    assert out.top_token_ids.tolist() == [[1, 3, 4]]
    torch.testing.assert_close(out.top_logprobs, logits.log_softmax(-1)[:, [1, 3, 4]])


def stable_descending(x):
    return torch.sort(x, dim=-1, descending=True, stable=True)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_topk_lowest_id_equals_a_stable_sort_even_with_ties_at_the_cut(k):
    x = torch.randint(0, 4, (6, 8)).float()  # heavy ties
    values, ids = ranking.topk_lowest_id(x, k)
    want_values, want_ids = stable_descending(x)
    assert torch.equal(ids, want_ids[:, :k]) and torch.equal(values, want_values[:, :k])


@pytest.mark.parametrize("candidates", [(2, 5), ranking.TOP_P_CANDIDATES])
def test_top_p_mask_equals_the_sorted_definition(monkeypatch, candidates):
    monkeypatch.setattr(ranking, "TOP_P_CANDIDATES", candidates)  # small: rows fall back to wider searches
    logits = torch.cat([torch.randint(0, 3, (4, 40)).float(), torch.randn(4, 40), torch.zeros(2, 40)])
    probs, top_p = logits.softmax(-1), torch.tensor([0.05, 0.3, 0.5, 0.9, 0.99, 0.6, 0.2, 1.0, 0.5, 0.9])
    sorted_probs, order = stable_descending(probs)
    keep_sorted = (sorted_probs.cumsum(-1) - sorted_probs) < top_p[:, None]
    want = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    assert torch.equal(ranking.top_p_mask(probs, top_p), want)
    assert torch.equal(ranking.top_p_mask(probs[-2:], top_p[-2:]), want[-2:])  # flat rows: no early finish


def test_gumbel_argmax_prunes_only_tokens_that_cannot_win():
    x = 40 * torch.randn(5, 3000)  # wide logits: most tokens are pruned
    x[0, :100] = float("-inf")
    seeds, steps = torch.arange(5), torch.arange(5) * 3
    want = (x + noise.gumbel_noise(seeds, steps, 3000)).argmax(-1)
    assert torch.equal(sampling.gumbel_argmax(x, seeds, steps), want)


# -- collectives and registration ----------------------------------------------------
def _collectives_worker(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.full((2, 3), float(rank + 1), dtype=dtype)
            summed = BACKEND.all_reduce(x)
            assert torch.equal(summed, torch.full((2, 3), 3.0, dtype=dtype)) and x[0, 0] == rank + 1
            gathered = BACKEND.all_gather(x, dim=1)
            assert torch.equal(gathered, torch.cat([torch.full((2, 3), 1.0, dtype=dtype), torch.full((2, 3), 2.0, dtype=dtype)], 1))
    finally:
        dist.destroy_process_group()


def test_collectives_over_two_gloo_processes():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_collectives_worker, args=(port,), nprocs=2)


def test_collectives_are_identities_without_a_process_group():
    x = torch.randn(3)
    assert BACKEND.all_reduce(x) is x and BACKEND.all_gather(x) is x


@pytest.mark.parametrize("primitive", PRIMITIVES)
def test_primitive_signatures_match_the_contract(primitive):
    got = inspect.signature(getattr(BACKEND, primitive)).parameters
    assert list(got) == list(inspect.signature(CHECKS[primitive]).parameters)


def test_registered_as_torch_with_gloo_on_cpu_and_every_primitive():
    backend = get_backend("torch")
    assert isinstance(backend, TorchBackend) and backend.dist_backend == "gloo" and TorchBackend.dist_backend == "gloo"
    assert set(Ops(backend).coverage().values()) == {"torch"}
    assert TorchBackend(device="cuda:0").dist_backend == "nccl"


@pytest.mark.parametrize("q_len, seq_len", [(23, 23), (1, 23), (6, 23)])
def test_attention_over_blocks_in_cache_order(q_len, seq_len):
    """Blocks lying in cache order are read as a slice of the cache; a new block table drops the step's memo."""
    q, cache, meta, dense = paged_batch([q_len], [seq_len], 3, 16, 4)
    n = -(-seq_len // 4)
    ordered = cache.clone()
    ordered[:, 1 : n + 1] = cache[:, torch.as_tensor(meta.block_table[0, :n]).long()]
    table = meta.block_table.copy()
    table[0, :n] = np.arange(1, n + 1)
    want = dense_attention(q, dense, [q_len], 0.25)
    m = OPS.prepare_metadata(AttentionMetadata(meta.query_start_loc, meta.seq_lens, table, meta.slot_mapping,
                                                   meta.max_query_len, meta.max_seq_len, 4))  # fmt: skip
    for _ in range(2):  # the second call reads the memo of the first
        torch.testing.assert_close(OPS.attention(q, ordered, m, 0.25).double(), want, atol=1e-5, rtol=1e-5)
    m.block_table = OPS.prepare_metadata(meta).block_table  # the scattered table, same plan
    torch.testing.assert_close(OPS.attention(q, cache, m, 0.25).double(), want, atol=1e-5, rtol=1e-5)


class _SyncCounter:
    """Counts reads of tensor values on the host (each a blocking sync on a device)."""

    def __init__(self, monkeypatch):
        self.calls = []
        for name in ("__bool__", "__int__", "__index__", "__float__", "item", "tolist"):
            original = getattr(torch.Tensor, name)

            def counted(t, *a, _name=name, _original=original, **k):
                self.calls.append(_name)
                return _original(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)
        for name in ("nonzero", "count_nonzero"):
            original = getattr(torch, name)

            def counted_fn(*a, _name=name, _original=original, **k):
                self.calls.append(_name)
                return _original(*a, **k)

            monkeypatch.setattr(torch, name, counted_fn)


@pytest.mark.parametrize("case", [
    dict(temperature=0.0, penalties=True, logit_bias=True),  # greedy rows
    dict(temperature=[0.0, 0.7, 1.0, 0.0], top_k=[0, 5, 200, 3], top_p=[1.0, 0.9, 0.5, 1.0], min_p=[0.0, 0.1, 0.0, 0.0],
         penalties=True),  # greedy and sampled rows mixed, every filter
    dict(temperature=0.8, top_k=4, top_p=0.8),
    dict(temperature=1.0, top_p=0.95, ties=3),  # ties at the top_p cut are ranked by id either way
])
def test_sampling_decides_from_the_host_copy_without_reading_the_device(monkeypatch, case):
    from infer.testing import inputs

    x = inputs.sample(np.random.default_rng(7), "float32", **case)
    be = TorchBackend()
    params = be.prepare_sampling(x["params"])
    assert params.host is x["params"]
    logits = be.asarray(x["logits"])
    without_host = sampling.sample(logits, SamplingTensors(**{f: getattr(params, f) for f in params.__dataclass_fields__
                                                              if f != "host"}))
    # As on an accelerator: the sync-free forms (full-row top_p sort and noise), decisions from `host`.
    monkeypatch.setattr(ranking, "avoid_host_reads", lambda device: True)
    monkeypatch.setattr(sampling, "avoid_host_reads", lambda device: True)
    counter = _SyncCounter(monkeypatch)
    with_host = sampling.sample(logits, params)
    assert counter.calls == []
    assert torch.equal(with_host.token_ids, without_host.token_ids)
    assert torch.equal(with_host.logprobs, without_host.logprobs)
