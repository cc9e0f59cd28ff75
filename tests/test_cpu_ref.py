"""The reference backend checked against code nobody here wrote: torch's SDPA,
transformers' rotary, RMSNorm, Mixtral/Qwen2-MoE blocks and logits warpers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from infer.backends.cpu_ref import CpuRefBackend
from infer.primitives import AttentionMetadata, DenseWeight, SamplingTensors
from infer.primitives.types import round_to_dtype

ref = CpuRefBackend()
rng = np.random.default_rng(0)


def randn(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def paged_batch(ctx_lens, q_lens, hk, d, block_size=16, num_blocks=64):
    """Write each request's full context into shuffled blocks; return cache, meta, dense K/V."""
    cache = ref.allocate_kv_cache(num_blocks, block_size, hk, d, "float32")
    free = list(rng.permutation(num_blocks))
    max_blocks = max([-(-c // block_size) for c in ctx_lens] + [1])
    table = np.zeros((len(ctx_lens), max_blocks), dtype=np.int32)
    dense = []
    for b, n in enumerate(ctx_lens):
        blocks = [free.pop() for _ in range(-(-n // block_size))]
        table[b, : len(blocks)] = blocks
        k, v = randn(n, hk, d), randn(n, hk, d)
        slots = np.array([blocks[i // block_size] * block_size + i % block_size for i in range(n)])
        ref.kv_write(k, v, cache, slots)
        dense.append((k, v))
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    meta = AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=np.array(ctx_lens, dtype=np.int32),
        block_table=table,
        slot_mapping=np.zeros(int(qsl[-1]), dtype=np.int64),
        max_query_len=max(q_lens, default=0),
        max_seq_len=max(ctx_lens, default=0),
        block_size=block_size,
    )
    return cache, meta, dense


@pytest.mark.parametrize("hq,hk", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("window", [None, 5])
def test_attention_matches_torch_sdpa(hq, hk, window):
    ctx, qlen, d = [1, 17, 33, 16], [1, 17, 3, 1], 64
    cache, meta, dense = paged_batch(ctx, qlen, hk, d)
    q = randn(sum(qlen), hq, d)
    out = ref.attention(q, cache, meta, 1 / math.sqrt(d), sliding_window=window)
    for b, ((k, v), n, ql) in enumerate(zip(dense, ctx, qlen)):
        s = meta.query_start_loc[b]
        qpos = torch.arange(n - ql, n)[:, None]
        kpos = torch.arange(n)[None, :]
        mask = kpos <= qpos
        if window:
            mask &= qpos - kpos < window
        expect = F.scaled_dot_product_attention(
            torch.from_numpy(q[s : s + ql]).transpose(0, 1),
            torch.from_numpy(k).transpose(0, 1).repeat_interleave(hq // hk, 0),
            torch.from_numpy(v).transpose(0, 1).repeat_interleave(hq // hk, 0),
            attn_mask=mask,
        ).transpose(0, 1)
        np.testing.assert_allclose(out[s : s + ql], expect.numpy(), atol=1e-5, rtol=1e-5)


def test_attention_soft_cap_bounds_scores_like_gemma2():
    cache, meta, dense = paged_batch([20], [20], 2, 64)
    q = randn(20, 2, 64) * 4
    out = ref.attention(q, cache, meta, 0.125, soft_cap=5.0)
    k, v = (torch.from_numpy(a).transpose(0, 1) for a in dense[0])
    scores = torch.from_numpy(q).transpose(0, 1) @ k.transpose(1, 2) * 0.125
    scores = 5.0 * torch.tanh(scores / 5.0)
    scores = scores.masked_fill(~torch.ones(20, 20, dtype=torch.bool).tril(), -torch.inf)
    expect = (scores.softmax(-1) @ v).transpose(0, 1)
    np.testing.assert_allclose(out, expect.numpy(), atol=1e-5)


def test_kv_write_skips_padded_slots():
    cache = ref.allocate_kv_cache(4, 4, 1, 2, "float32")
    k, v = randn(3, 1, 2), randn(3, 1, 2)
    ref.kv_write(k, v, cache, np.array([5, -1, 15]))
    kc, vc = ref.kv_cache_to_numpy(cache)
    np.testing.assert_array_equal(kc[1, 1], k[0])
    np.testing.assert_array_equal(vc[3, 3], v[2])
    assert np.count_nonzero(kc) == 4


@pytest.mark.parametrize("neox", [True, False])
def test_rotary_matches_transformers(neox):
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_rope
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope

    t, h, d, rot = 5, 3, 16, 8 if not neox else 16
    inv_freq = 1.0 / (10000 ** (np.arange(0, rot, 2) / rot))
    freqs = np.outer(np.arange(64), inv_freq)
    cache = np.concatenate([np.cos(freqs), np.sin(freqs)], axis=1).astype(np.float32)
    pos = np.array([0, 3, 7, 63, 1])
    q, k = randn(t, h, d), randn(t, 1, d)
    q_out, k_out = ref.rotary(q, k, pos, cache, neox)
    cos, sin = torch.from_numpy(cache[pos, : rot // 2]), torch.from_numpy(cache[pos, rot // 2 :])
    tq = torch.from_numpy(q).transpose(0, 1)[None]  # [1, H, T, D]
    if neox:
        c2, s2 = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]
        expect, _ = llama_rope(tq, tq, c2, s2)
    else:
        # GPT-J rotates only the first rot dims, pairing adjacent elements; it takes [B, T, H, D].
        tq = torch.from_numpy(q)[None]
        expect = torch.cat([gptj_rope(tq[..., :rot], sin[None], cos[None]), tq[..., rot:]], -1)
        expect = expect.transpose(1, 2)
    np.testing.assert_allclose(q_out, expect[0].transpose(0, 1).numpy(), atol=1e-5)
    assert k_out.shape == k.shape


def test_rms_norm_matches_transformers_and_fuses_residual():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, res, w = randn(7, 32), randn(7, 32), randn(32)
    norm = LlamaRMSNorm(32, eps=1e-6)
    norm.weight.data = torch.from_numpy(w)
    np.testing.assert_allclose(ref.rms_norm(x, w, 1e-6), norm(torch.from_numpy(x)).detach().numpy(), atol=1e-5)
    y, summed = ref.rms_norm(x, w, 1e-6, residual=res)
    np.testing.assert_allclose(summed, x + res, atol=1e-6)
    np.testing.assert_allclose(y, norm(torch.from_numpy(x + res)).detach().numpy(), atol=1e-5)


@pytest.mark.parametrize("kind,fn", [
    ("silu", F.silu),
    ("gelu", F.gelu),
    ("gelu_tanh", lambda t: F.gelu(t, approximate="tanh")),
])
def test_act_and_mul_matches_torch(kind, fn):
    x = randn(5, 12)
    expect = fn(torch.from_numpy(x[:, :6])) * torch.from_numpy(x[:, 6:])
    np.testing.assert_allclose(ref.act_and_mul(x, kind), expect.numpy(), atol=1e-6)


def test_linear_and_embedding():
    x, w, bias = randn(3, 8), randn(5, 8), randn(5)
    np.testing.assert_allclose(ref.linear(x, DenseWeight(w, bias)), x @ w.T + bias, atol=1e-5)
    np.testing.assert_array_equal(ref.embedding(np.array([2, 0, 2]), w), w[[2, 0, 2]])


def test_bfloat16_rounding_is_torchs_cast_ties_to_even():
    """bf16 values live in float32 storage on the host and in cpu_ref; `round_to_dtype` must round as
    torch casts: to nearest, a value halfway between two bf16 neighbours to the even one."""
    halfway = (0x3F800000 + 0x10000 * np.arange(64, dtype=np.uint32) + 0x8000).view(np.float32)  # even and odd below
    x = np.concatenate([halfway, -halfway, randn(1000)])
    want = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(round_to_dtype(x, "bfloat16"), want)


@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_matches_transformers_blocks(renormalize):
    from transformers import MixtralConfig, Qwen2MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    h, i, e, k = 16, 8, 6, 2
    torch.manual_seed(0)
    if renormalize:
        block = MixtralSparseMoeBlock(MixtralConfig(hidden_size=h, intermediate_size=i, num_local_experts=e, num_experts_per_tok=k))
        experts = block.experts
    else:
        cfg = Qwen2MoeConfig(hidden_size=h, moe_intermediate_size=i, num_experts=e, num_experts_per_tok=k,
                             norm_topk_prob=False, shared_expert_intermediate_size=i)
        block = Qwen2MoeSparseMoeBlock(cfg)
        experts = block.experts
    for p in block.parameters():
        p.data.normal_(0, 0.3)
    x = torch.randn(9, h)
    with torch.no_grad():
        router_logits = F.linear(x, block.gate.weight)
        expect = block(x[None])[0] if renormalize else experts(x, *_qwen_route(router_logits, k))
    out, counts = ref.moe(x.numpy(), router_logits.numpy(), experts.gate_up_proj.detach().numpy(),
                          experts.down_proj.detach().numpy(), k, renormalize)
    np.testing.assert_allclose(out, expect.numpy(), atol=1e-5)
    assert counts.sum() == 9 * k


def _qwen_route(router_logits, k):
    probs = router_logits.softmax(-1)
    w, idx = probs.topk(k, dim=-1)
    return idx, w


def sampling(b, **kw):
    base = dict(
        temperature=np.ones(b, np.float32), top_k=np.zeros(b, np.int32), top_p=np.ones(b, np.float32),
        min_p=np.zeros(b, np.float32), seeds=np.arange(b, dtype=np.int64), steps=np.zeros(b, np.int64),
        presence_penalty=np.zeros(b, np.float32), frequency_penalty=np.zeros(b, np.float32),
        repetition_penalty=np.ones(b, np.float32),
    )
    base.update(kw)
    return SamplingTensors(**base)


def kept_tokens(logits, params):
    from infer.backends.cpu_ref.sampling import filter_logits

    return set(np.flatnonzero(np.isfinite(filter_logits(logits[0].astype(np.float64), params, 0))))


@pytest.mark.parametrize("warper,kw", [
    ("TopKLogitsWarper", dict(top_k=np.array([7], np.int32))),
    ("TopPLogitsWarper", dict(top_p=np.array([0.6], np.float32))),
    ("MinPLogitsWarper", dict(min_p=np.array([0.1], np.float32))),
])
def test_filters_keep_the_same_tokens_as_transformers(warper, kw):
    import transformers

    logits = randn(1, 50) * 2
    value = float(next(iter(kw.values()))[0])
    hf = getattr(transformers, warper)(int(value) if warper == "TopKLogitsWarper" else value)
    expect = set(np.flatnonzero(np.isfinite(hf(None, torch.from_numpy(logits)).numpy()[0])))
    assert kept_tokens(logits, sampling(1, **kw)) == expect


def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor
    from infer.backends.cpu_ref.sampling import apply_penalties

    logits, seen = randn(1, 30), np.array([[3, 7, 7, 20, -1, -1]])
    p = sampling(1, repetition_penalty=np.array([1.3], np.float32), prompt_token_ids=seen)
    expect = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor(seen[:, :4]), torch.from_numpy(logits.copy()))
    np.testing.assert_allclose(apply_penalties(logits[0].astype(np.float64), p, 0), expect[0].numpy(), atol=1e-6)


def test_greedy_and_logprobs():
    logits = randn(3, 40)
    out = ref.sample(logits, sampling(3, temperature=np.zeros(3, np.float32), max_num_logprobs=4))
    np.testing.assert_array_equal(out.token_ids, logits.argmax(-1))
    lp = torch.log_softmax(torch.from_numpy(logits), -1)
    top = lp.topk(4, -1)
    np.testing.assert_allclose(out.top_logprobs, top.values.numpy(), atol=1e-6)
    np.testing.assert_array_equal(out.top_token_ids, top.indices.numpy())
    np.testing.assert_allclose(out.logprobs, top.values[:, 0].numpy(), atol=1e-6)


def test_seeded_sampling_follows_the_distribution():
    """Over many steps, the seeded Gumbel draws reproduce softmax(logits / T)."""
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32)) * 0.5
    n = 4000
    tokens = [int(ref.sample(logits, sampling(1, temperature=np.array([0.5], np.float32), seeds=np.array([42]),
                                              steps=np.array([s]))).token_ids[0]) for s in range(n)]
    freq = np.bincount(tokens, minlength=4) / n
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.03)


def test_same_seed_and_step_give_the_same_token_whatever_the_batch():
    logits = randn(1, 100)
    alone = ref.sample(logits, sampling(1, seeds=np.array([7]), steps=np.array([3]))).token_ids[0]
    batch = np.concatenate([randn(2, 100), logits])
    together = ref.sample(batch, sampling(3, seeds=np.array([1, 2, 7]), steps=np.array([0, 9, 3]))).token_ids[2]
    assert alone == together
