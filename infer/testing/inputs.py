"""Host (NumPy) inputs of each conformance case, one builder per primitive.

Every builder takes a seeded `rng` and the case dtype and returns plain NumPy
data: float tensors already rounded to the dtype (float32 storage), integer
tensors in the dtypes the core uses, and host records (`AttentionMetadata`,
`SamplingTensors`) that the runner moves with `prepare_metadata` /
`prepare_sampling`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..primitives.types import AttentionMetadata, SamplingTensors, round_to_dtype
from .quant_inputs import host_fields, mxfp4_fields


def _normal(rng: np.random.Generator, shape, dtype: str, scale: float = 1.0) -> np.ndarray:
    return round_to_dtype(rng.standard_normal(shape).astype(np.float32) * scale, dtype)


def embedding(rng, dtype, t, v=64, h=32, id_dtype="int64", quant=None):
    ids = rng.integers(0, v, t).astype(id_dtype)
    if quant:  # a quantized (tied lm_head) table
        return {"ids": ids, "table": None, "quant": host_fields(rng, v, h, quant)}
    return {"ids": ids, "table": _normal(rng, (v, h), dtype), "quant": None}


def rms_norm(rng, dtype, t, h, residual=False, scale=1.0):
    return {
        "x": _normal(rng, (t, h), dtype, scale),
        "weight": round_to_dtype(1.0 + 0.1 * rng.standard_normal(h), dtype),
        "eps": 1e-6,
        "residual": _normal(rng, (t, h), dtype, scale) if residual else None,
    }


def layer_norm(rng, dtype, t, h, residual=False, bias=True, scale=1.0, shift=0.0):
    return {
        "x": round_to_dtype(rng.standard_normal((t, h)).astype(np.float32) * scale + shift, dtype),
        "weight": round_to_dtype(1.0 + 0.1 * rng.standard_normal(h), dtype),
        "bias": _normal(rng, (h,), dtype, 0.1) if bias else None,
        "eps": 1e-12 if bias else 1e-5,
        "residual": _normal(rng, (t, h), dtype, scale) if residual else None,
    }


def activation(rng, dtype, kind, t=5, n=40):
    return {"x": _normal(rng, (t, n), dtype, 2.0), "kind": kind}


def _starts(lens) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def encoder_attention(rng, dtype, lens, hq=4, hk=2, d=32, q_scale=1.0):
    t = int(sum(lens))
    return {"q": _normal(rng, (t, hq, d), dtype, q_scale), "k": _normal(rng, (t, hk, d), dtype),
            "v": _normal(rng, (t, hk, d), dtype), "query_start_loc": _starts(lens), "scale": d**-0.5}


def pool(rng, dtype, lens, method, h=24):
    return {"x": _normal(rng, (int(sum(lens)), h), dtype), "query_start_loc": _starts(lens), "method": method}


def _token_quantizable(rng, dtype, t, k, zero_row=False) -> np.ndarray:
    """x for a weight that quantizes its input per token: each row a power of two d times values
    in [-127, 127] with one of them at +-127, so its scale max|x| / 127 is d exactly and x / s is
    exact in every dtype: the codes then depend on the rounding rule alone (ties included, which
    bf16's half steps produce), never on how a backend divides."""
    d = 2.0 ** rng.integers(-7, -4, (t, 1))
    v = rng.uniform(-127, 127, (t, k))
    if k:
        v[np.arange(t), rng.integers(0, k, t)] = rng.choice([-127.0, 127.0], t)
    x = round_to_dtype((v * d).astype(np.float32), dtype)
    if zero_row and t:
        x[t // 2] = 0.0  # scale 1 by definition, codes 0
    return x


def linear(rng, dtype, t, k, n, bias=False, quant=None, group=32, zero_row=False):
    x = _token_quantizable(rng, dtype, t, k, zero_row) if quant == "int8_token" else _normal(rng, (t, k), dtype)
    return {
        "x": x,
        "weight": None if quant else _normal(rng, (n, k), dtype, k**-0.5),
        "quant": host_fields(rng, n, k, quant, group) if quant else None,
        "bias": _normal(rng, (n,), dtype, 0.1) if bias else None,
    }


def rotary(rng, dtype, d, neox, t=7, hq=4, hk=2, rot=None, max_pos=64):
    rot = rot or d
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, rot, 2, dtype=np.float64) / rot))
    angles = np.outer(np.arange(max_pos, dtype=np.float64), inv_freq)
    return {
        "q": _normal(rng, (t, hq, d), dtype),
        "k": _normal(rng, (t, hk, d), dtype),
        "positions": rng.integers(0, max_pos, t).astype(np.int64),
        "cos_sin_cache": np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32),
        "neox_style": neox,
    }


def act_and_mul(rng, dtype, kind, t=5, i=40):
    return {"x": _normal(rng, (t, 2 * i), dtype, 2.0), "kind": kind}


def kv_write(rng, dtype, t, slots, hk=2, d=64, block_size=16, num_blocks=4, kv_scales=None):
    """`kv_scales`: (k_scale, v_scale) of an fp8 cache (powers of two here, so
    dividing by them is exact and every backend rounds the same value)."""
    capacity = num_blocks * block_size
    if slots == "contiguous":  # starts 5 slots before a block ends, so it crosses into the next
        mapping = np.arange(block_size - 5, block_size - 5 + t)
    else:
        mapping = rng.choice(capacity, size=t, replace=False)
    mapping = mapping.astype(np.int64)
    if slots == "padded":
        mapping[::3] = -1
    return {
        "k": _normal(rng, (t, hk, d), dtype),
        "v": _normal(rng, (t, hk, d), dtype),
        "slot_mapping": mapping,
        "cache_shape": (num_blocks, block_size, hk, d),
        "kv_scales": kv_scales,
    }


def copy_blocks(rng, dtype, src, dst, hk=2, d=64, block_size=16, num_blocks=5):
    slots = num_blocks * block_size  # every slot written, so a wrong copy shows anywhere
    return {
        "k": _normal(rng, (slots, hk, d), dtype),
        "v": _normal(rng, (slots, hk, d), dtype),
        "slot_mapping": np.arange(slots, dtype=np.int64),
        "cache_shape": (num_blocks, block_size, hk, d),
        "src": np.array(src, dtype=np.int64),
        "dst": np.array(dst, dtype=np.int64),
    }


def read_write_blocks(rng, dtype, src, dst, kv_scales=None, **shape):
    """`copy_blocks`' cache, every slot written, and an fp8 cache's `kv_scales`."""
    return {**copy_blocks(rng, dtype, src, dst, **shape), "kv_scales": kv_scales}


def _mixed_blocks(rng, blocks_per_req: list[int], pages: list[int]) -> list[np.ndarray]:
    """Each request's block ids in units of its own block (`pages[b]` pages, aligned):
    every block in a different group of max(pages) pages (group 0 unused, groups
    shuffled) at a random aligned place in it, so the rest of the group stays empty."""
    group = max(pages)
    groups = rng.permutation(sum(blocks_per_req)) + 1
    rows, start = [], 0
    for n, k in zip(blocks_per_req, pages):
        first = groups[start : start + n] * group + rng.integers(0, group // k, size=n) * k
        rows.append((first // k).astype(np.int32))
        start += n
    return rows


def attention(rng, dtype, reqs, hq, d, hk=2, block_size=16, sliding_window=None, soft_cap=None, q_scale=1.0,
              kv_scales=None, pages=None, sinks=None):
    """A paged batch: `reqs` is (q_len, seq_len) per request; (1, 0) is a
    padding row (as a captured decode step pads its batch): slot -1, no key.

    Blocks are shuffled and block 0 is never used, so a backend that ignores
    `block_table` or assumes contiguous blocks reads wrong (or zero) K/V.
    `pages`: mixed block sizes (`AttentionMetadata.block_sizes`), request b's
    blocks being `pages[b]` pages of `block_size` tokens each. `sinks`: the
    spread of per-head sink logits (gpt-oss's are of the scores' size).
    """
    q_lens = np.array([q for q, _ in reqs], dtype=np.int32)
    seq_lens = np.array([s for _, s in reqs], dtype=np.int32)
    sizes = [block_size * k for k in (pages or [1] * len(reqs))]
    blocks_per_req = [-(-int(s) // size) for s, size in zip(seq_lens, sizes)]
    if pages:
        rows = _mixed_blocks(rng, blocks_per_req, pages)
    else:
        physical = rng.permutation(sum(blocks_per_req)) + 1
        rows = np.split(physical, np.cumsum(blocks_per_req)[:-1]) if reqs else []
    block_table = np.zeros((len(reqs), max(blocks_per_req, default=1)), dtype=np.int32)
    cached_k, cached_v, cached_slots, new_k, new_v, new_slots = [], [], [], [], [], []
    for b, (q_len, seq_len) in enumerate(reqs):
        block_table[b, : blocks_per_req[b]] = rows[b]
        pos, size = np.arange(seq_len), sizes[b]
        page = block_table[b, pos // size].astype(np.int64) * (size // block_size) + (pos % size) // block_size
        slots = page * block_size + pos % block_size
        if seq_len == 0:  # a padding row (one query, no key): its K/V go to slot -1, nowhere
            assert q_len == 1, "a request with seq_len 0 is a padding row of one query"
            new_k.append(_normal(rng, (1, hk, d), dtype)), new_v.append(_normal(rng, (1, hk, d), dtype))
            new_slots.append(np.array([-1], np.int64))
            continue
        k, v = _normal(rng, (seq_len, hk, d), dtype), _normal(rng, (seq_len, hk, d), dtype)
        cut = seq_len - q_len
        cached_k.append(k[:cut]), cached_v.append(v[:cut]), cached_slots.append(slots[:cut])
        new_k.append(k[cut:]), new_v.append(v[cut:]), new_slots.append(slots[cut:])

    def cat(parts, shape_tail, dt=np.float32):
        return np.concatenate(parts).astype(dt) if parts else np.zeros((0, *shape_tail), dt)

    meta = AttentionMetadata(
        query_start_loc=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
        seq_lens=seq_lens,
        block_table=block_table,
        slot_mapping=cat(new_slots, (), np.int64),
        max_query_len=int(q_lens.max(initial=0)),
        max_seq_len=int(seq_lens.max(initial=0)),
        block_size=block_size,
        block_sizes=np.array(sizes, dtype=np.int32) if pages else None,
    )
    num_pages = max((int(sl.max()) // block_size for sl in cached_slots + new_slots if len(sl)), default=0) + 1
    return {
        "q": _normal(rng, (int(q_lens.sum()), hq, d), dtype, q_scale),
        "cached_k": cat(cached_k, (hk, d)), "cached_v": cat(cached_v, (hk, d)),
        "cached_slots": cat(cached_slots, (), np.int64),
        "new_k": cat(new_k, (hk, d)), "new_v": cat(new_v, (hk, d)),
        "meta": meta,
        "cache_shape": (num_pages + (max(pages) if pages else 0), block_size, hk, d),
        "scale": d**-0.5, "sliding_window": sliding_window, "soft_cap": soft_cap, "kv_scales": kv_scales,
        "sinks": None if sinks is None else round_to_dtype(rng.normal(0.0, sinks, hq), dtype),
    }


def mla_kv_write(rng, dtype, t, r=32, p=8, block_size=16, num_blocks=4, padded=False):
    """A latent of `r` + `p` dims per token to scattered slots (-1 on every third with `padded`)."""
    mapping = rng.choice(num_blocks * block_size, size=t, replace=False).astype(np.int64)
    if padded:
        mapping[::3] = -1
    return {"c_kv": _normal(rng, (t, r), dtype), "k_pe": _normal(rng, (t, p), dtype), "slot_mapping": mapping,
            "cache_shape": (num_blocks, block_size, 1, (r + p) // 2)}


def mla_attention(rng, dtype, reqs, h, r=32, p=8, nope=16, v=12, block_size=16, pages=None):
    """`attention`'s paged batch with one KV "head" holding each token's latent halves
    ((r + p) / 2 dims a plane), queries split into their no-rope and rope parts, and
    ``kv_b_proj`` [h * (nope + v), r]."""
    x = attention(rng, dtype, reqs, 1, (r + p) // 2, hk=1, block_size=block_size, pages=pages)
    t = len(x["q"])
    return {**x, "q_nope": _normal(rng, (t, h, nope), dtype), "q_pe": _normal(rng, (t, h, p), dtype),
            "kv_b_proj": _normal(rng, (h * (nope + v), r), dtype, r**-0.5), "v_head_dim": v,
            "scale": (nope + p) ** -0.5}


def moe(rng, dtype, top_k, renormalize, t=12, h=32, i=16, e=8, ties=0, hot_expert=None, shared=None, bias=False,
        activation=None, limit=7.0, w_scale=1.0, routing=None, quant=None):
    """`hot_expert`: every token's top choice is that expert. `shared`:
    'gated' (Qwen2-MoE's sigmoid-gated shared expert) or 'plain'. `bias`:
    per-expert biases; `activation` 'swiglu_oai' with clamp `limit`
    (a low `limit`, or `w_scale` > 1, makes the clamp bite). `routing`: DeepSeek's
    (`scoring_func`, `expert_groups`, `routed_scaling_factor`, and with `bias` in it
    a selection bias of that spread). `quant` 'mxfp4': the expert stacks as MXFP4
    (`w13_quant`, `w2_quant` fields; h and i multiples of 32)."""
    # Router logits spaced >= 0.25 apart so no dtype rounding creates a tie by
    # accident; `ties` then makes the lowest-id-first rule decide on purpose.
    logits = np.stack([rng.permutation(e) * 0.5 - 2.0 + rng.uniform(0, 0.1, e) for _ in range(t)]) if t else np.zeros((0, e))
    for row in logits[: t if ties else 0]:
        tied = rng.choice(e, size=ties, replace=False)
        row[tied] = row.max() + 0.5
    if hot_expert is not None and t:
        logits[:, hot_expert] = logits.max(axis=1) + 1.0
    return {
        "x": _normal(rng, (t, h), dtype),
        "router_logits": round_to_dtype(logits, dtype),
        "w13": None if quant else _normal(rng, (e, 2 * i, h), dtype, w_scale * h**-0.5),
        "w2": None if quant else _normal(rng, (e, h, i), dtype, i**-0.5),
        "w13_quant": mxfp4_fields(rng, (e, 2 * i), h) if quant == "mxfp4" else None,
        "w2_quant": mxfp4_fields(rng, (e, h), i) if quant == "mxfp4" else None,
        "top_k": top_k,
        "renormalize": renormalize,
        "shared": _normal(rng, (t, h), dtype) if shared else None,
        "shared_gate": _normal(rng, (t, 1), dtype, 2.0) if shared == "gated" else None,
        "w13_bias": _normal(rng, (e, 2 * i), dtype, 0.5) if bias else None,
        "w2_bias": _normal(rng, (e, h), dtype, 0.5) if bias else None,
        "activation": activation,
        "swiglu_alpha": 1.702 if activation == "swiglu_oai" else None,
        "swiglu_limit": limit if activation == "swiglu_oai" else None,
        "scoring_func": (routing or {}).get("scoring_func"),
        "expert_groups": (routing or {}).get("expert_groups"),
        "routed_scaling_factor": (routing or {}).get("routed_scaling_factor"),
        "routing_bias": round_to_dtype(rng.normal(0.0, routing["bias"], e), dtype) if (routing or {}).get("bias")
        else None,
    }


def _per_row(value, b, dt) -> np.ndarray:
    # A list of per-row values is cycled over the batch, so any b works.
    return np.resize(np.asarray(value, dtype=dt), b)


def _padded(rows: list[np.ndarray], dt=np.int64, fill=-1) -> np.ndarray:
    width = max((len(r) for r in rows), default=0) or 1
    out = np.full((len(rows), width), fill, dtype=dt)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def token_bitmask(rng, logits: np.ndarray, density: float | None = 0.3, banned=()) -> np.ndarray:
    """A structured-output bitmask [B, ceil(V/32)] int32 for `logits` [B, V].

    Row 0 is unconstrained (all ones), so a mixed batch is checked. Every
    other row allows a random share `density` of the vocabulary (exactly one
    token when density is None) but never its best logit nor the ids in
    `banned[row]`, so the mask always changes the answer; the bits past V are
    random, since the contract says they are ignored."""
    b, v = logits.shape
    words = -(-v // 32)
    bits = rng.random((b, words * 32)) < (density or 0.0)
    bits[:, v:] = rng.random((b, words * 32 - v)) < 0.5
    for r in range(1, b):
        row = bits[r, :v]
        if density is None:
            row[:] = False
        row[int(np.argmax(logits[r]))] = False
        for t in (banned[r] if r < len(banned) else ()):
            if t >= 0:
                row[int(t)] = False
        if not row.any() or density is None:  # the core guarantees one allowed token
            choices = np.flatnonzero(~np.isin(np.arange(v), [int(np.argmax(logits[r])), *list(banned[r] if r < len(banned) else ())]))
            row[int(rng.choice(choices))] = True
    if b:
        bits[0] = True
    packed = (bits.reshape(b, words, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(axis=2)
    return packed.astype(np.uint32).view(np.int32)


def sample(rng, dtype, temperature, b=4, v=96, top_k=0, top_p=1.0, min_p=0.0, penalties=False,
           logit_bias=False, logprobs=0, ties=0, same_seed=False, bitmask=False, drafts=None):
    logits = (rng.standard_normal((b, v)) * 3.0).astype(np.float32)
    for row in logits if ties else ():  # `ties` ids share the row maximum, well above the rest
        row[rng.choice(v, ties, replace=False)] = row.max() + 2.0
    seeds = rng.integers(-(2**62), 2**62, b).astype(np.int64)  # uses the high 32 bits too
    steps = rng.integers(0, 50, b).astype(np.int64)
    if same_seed:  # rows 0/1 and 2/3 share seed and step: same noise, not same batch slot
        seeds[1::2], steps[1::2] = seeds[0::2][: b // 2], steps[0::2][: b // 2]
        logits[1::2] = logits[0::2][: b // 2]
    params = dict(
        temperature=_per_row(temperature, b, np.float32), top_k=_per_row(top_k, b, np.int32),
        top_p=_per_row(top_p, b, np.float32), min_p=_per_row(min_p, b, np.float32),
        seeds=seeds, steps=steps,
        presence_penalty=np.zeros(b, np.float32), frequency_penalty=np.zeros(b, np.float32),
        repetition_penalty=np.ones(b, np.float32), max_num_logprobs=logprobs,
    )
    if penalties:  # row 0 has none, so "disabled" is checked in the same batch
        params["repetition_penalty"] = _per_row([1.0, 1.3, 0.8, 1.5], b, np.float32)
        params["frequency_penalty"] = _per_row([0.0, 0.4, 0.0, 0.9], b, np.float32)
        params["presence_penalty"] = _per_row([0.0, 0.6, 1.1, 0.0], b, np.float32)
        # The best token was generated twice (frequency counts it twice) and
        # the runner-up is in the prompt, so penalties change greedy choices.
        best = np.argsort(-logits, axis=1, kind="stable")[:, :2]
        params["prompt_token_ids"] = _padded([np.append(rng.integers(0, v, rng.integers(0, 6)), best[r, 1]) for r in range(b)])
        params["output_token_ids"] = _padded([np.append(rng.choice(8, rng.integers(0, 5)) * 7, [best[r, 0]] * 2) for r in range(b)])
    if logit_bias:
        rows = [rng.choice(v, rng.integers(0, 4), replace=False) for _ in range(b)]
        if b:  # ban row 0's argmax so greedy has to move
            top = int(np.argmax(logits[0]))
            rows[0] = np.array([top, *[i for i in rows[0] if i != top][:2]])
        params["logit_bias_ids"] = _padded(rows)
        values = np.where(params["logit_bias_ids"] >= 0, rng.uniform(-3, 3, params["logit_bias_ids"].shape), 0.0)
        if b:
            values[0, 0] = -np.inf
        params["logit_bias_values"] = values.astype(np.float32)
    if bitmask:  # "one": a single allowed token per constrained row; else a random share
        # The biased ids of the constrained rows are masked out: no bias brings a token back.
        biased = params.get("logit_bias_ids")
        params["token_bitmask"] = token_bitmask(rng, logits, None if bitmask == "one" else 0.3,
                                                biased if biased is not None else ())
    if drafts:  # "onehot" (n-gram) or "probs" (a draft model's q): step 6 of the contract
        params["draft_token_ids"], params["draft_probs"] = draft_inputs(rng, logits, drafts)
    return {"logits": logits, "params": SamplingTensors(**params)}


def draft_inputs(rng, logits: np.ndarray, kind: str):
    """Drafted tokens for `logits` [B, V]: the last row has none (-1), every third
    row drafts its argmax (greedy accepts it, sampling likely does), the others a
    random token; with "probs", q is a random peaked distribution per row and the
    drafts are drawn from it."""
    b, v = logits.shape
    ids = rng.integers(0, v, b).astype(np.int64)
    ids[::3] = np.argmax(logits[::3], axis=1)
    probs = None
    if kind == "probs":
        z = rng.standard_normal((b, v)) * 2.0 + 0.5 * logits
        probs = np.exp(z - z.max(axis=1, keepdims=True))
        probs = (probs / probs.sum(axis=1, keepdims=True)).astype(np.float32)
        for r in range(b):
            if r % 3:
                q = probs[r].astype(np.float64)
                ids[r] = rng.choice(v, p=q / q.sum())
    if b:
        ids[-1] = -1
    return ids, probs


def _per_rank(rng, dtype, world_size=2, shape=(4, 6)) -> list[np.ndarray]:
    return [_normal(rng, shape, dtype) for _ in range(world_size)]


def all_reduce(rng, dtype):
    return {"xs": _per_rank(rng, dtype)}


def all_gather(rng, dtype, dim):
    return {"xs": _per_rank(rng, dtype), "dim": dim}


def lora(rng, dtype, t, slices=(40,), k=48, rank=8, slots=4, indices="mixed"):
    """A linear's input and output and `slots` stacked adapters; slot 0 holds
    garbage (it must never be read). `indices`: 'mixed' (every slot, 0 included,
    in random order), 'runs' (six runs of one slot), 'none' (all 0) or one slot
    for every token ('same')."""
    n, p = sum(slices), len(slices)
    a = _normal(rng, (slots, p * rank, k), dtype, 0.3)
    b = _normal(rng, (slots, n, rank), dtype, 0.3)
    a[0], b[0] = 1e4, -1e4  # a backend that reads slot 0 shows it
    if indices == "mixed":
        idx = rng.permutation(np.arange(t) % slots)
    elif indices == "runs":  # long runs of one slot each, as a batch of prefill chunks has them
        idx = np.repeat(rng.integers(0, slots, 6), -(-t // 6))[:t]
    elif indices == "none":
        idx = np.zeros(t)
    else:
        idx = np.full(t, slots - 1)
    return {"x": _normal(rng, (t, k), dtype), "y": _normal(rng, (t, n), dtype), "lora_a": a, "lora_b": b,
            "lora_indices": idx.astype(np.int64), "output_slices": tuple(slices) if p > 1 else None}


BUILDERS: dict[str, Any] = {
    name: globals()[name]
    for name in ("embedding", "rms_norm", "layer_norm", "linear", "rotary", "act_and_mul", "activation",
                 "encoder_attention", "pool", "kv_write", "attention", "mla_kv_write",
                 "mla_attention", "moe", "lora",
                 "sample", "all_reduce", "all_gather", "copy_blocks", "read_write_blocks")
}
