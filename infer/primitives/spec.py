"""The meta-primitives (contract v2): signatures, semantics, argument checks.

Every backend implements a primitive as a method of the same name and
signature. ``T`` is the number of flattened tokens in a step, ``B`` the number
of requests, ``H`` the hidden size, ``D`` the head dim. Float tensors are
float32, float16 or bfloat16 (inputs share one dtype; results have the
backend's storage dtype for it unless stated). Reductions (norms, softmax, GEMM accumulation) happen in at
least float32. The executable form of each semantic is in
`infer.backends.cpu_ref`.

embedding(ids, table) -> [T, H]
    ids [T] int, table [V, H]: row gather, ``table[ids]``. ``table`` may also
    be a quantized `WeightHandle` (a tied, quantized lm_head): the gathered
    rows are dequantized and returned in the handle's ``dtype``.

rms_norm(x, weight, eps, residual=None) -> y | (y, residual_out)
    x [T, H], weight [H]. ``y = x / sqrt(mean(x**2) + eps) * weight``.
    With residual [T, H]: first ``x = x + residual`` (rounded to x's dtype),
    returns ``(rms_norm(x), x)`` so the sum becomes the next residual.

layer_norm(x, weight, bias, eps, residual=None) -> y | (y, residual_out)
    x [T, H], weight [H], bias [H] or None. ``y = (x - mean(x)) / sqrt(var(x)
    + eps) * weight + bias`` over each row, var the population variance
    (BERT, XLM-R, ViT towers). With residual [T, H]: first ``x = x + residual``
    (rounded to x's dtype), returns ``(layer_norm(x), x)`` as rms_norm does.

linear(x, weight) -> [T, N]
    x [T, K], weight a `WeightHandle` of shape [N, K]: ``x @ W.T + bias``.

rotary(q, k, positions, cos_sin_cache, neox_style) -> (q, k)
    q [T, Hq, D], k [T, Hk, D], positions [T] int, cos_sin_cache [P, R] float32
    holding ``cos`` in its first R/2 columns and ``sin`` in the rest (R <= D,
    even). Rotates the first R dims of every head by the angle of its position:
    neox style pairs dim i with i + R/2, gptj style pairs 2i with 2i+1. Dims
    past R are unchanged. A backend may update q and k in place; callers use
    the returned pair.

act_and_mul(x, kind) -> [T, I]
    x [T, 2I]: ``act(x[:, :I]) * x[:, I:]`` with kind 'silu' (SwiGLU),
    'gelu' (erf) or 'gelu_tanh'.

activation(x, kind) -> x's shape
    Elementwise, not gated: ``act(x)`` with kind 'gelu' (erf), 'gelu_tanh',
    'quick_gelu' (``x * sigmoid(1.702 x)``, CLIP's), 'silu', 'relu' or 'tanh'
    (an encoder's MLP, a classifier's pooler, a vision tower), in
    float32, rounded once.

kv_write(k, v, kv_cache, slot_mapping, scales=None) -> None
    k, v [T, Hk, D] into the paged cache of one layer, token t at slot
    ``slot_mapping[t]`` (block ``slot // block_size``, offset
    ``slot % block_size``); slots of -1 are skipped. ``scales`` (k_scale,
    v_scale) is for quantized caches and is None for a cache in the model dtype.
    An fp8 cache (allocated with dtype 'fp8', asked for with
    ``kv_cache_dtype='fp8'``) stores e4m3fn codes of ``k / k_scale`` and
    ``v / v_scale``, rounded to nearest even and saturated at +-448
    (`infer.primitives.fp8`).

attention(q, kv_cache, meta, scale, sliding_window=None, soft_cap=None, kv_scales=None, sinks=None) -> [T, Hq, D]
    Causal paged attention over a mixed prefill/decode batch described by
    `AttentionMetadata`, after this step's K/V went through `kv_write`. Query
    head h reads KV head ``h // (Hq // Hk)`` (GQA/MQA). Scores are
    ``scale * q.k``; with ``soft_cap`` c, ``c * tanh(score / c)``. A query at
    position p sees key positions j with ``j <= p`` and, with a window W,
    ``p - j < W``. Softmax in float32. With an fp8 cache, ``kv_scales``
    (k_scale, v_scale) is given and K/V are read as ``e4m3(code) * scale``.
    A request with ``seq_len`` 0 (one query, slot -1: a padding row of a
    captured decode step) sees no key; its output row is zero.
    ``sinks`` [Hq] (float32 or q's dtype; gpt-oss's learned "attention
    sinks"): query head h's softmax gets one more logit, ``sinks[h]``, that
    takes probability mass and reads no value: ``p_j = exp(s_j) / (exp(sinks[h])
    + sum_i exp(s_i))`` over the keys the query sees (after soft-capping). `Ops.resolve`
    passes ``sinks=True``, and only a backend whose ``attention`` takes a
    ``sinks`` argument is asked.

encoder_attention(q, k, v, query_start_loc, scale) -> [T, Hq, D]
    Bidirectional attention without a cache: the flattened batch holds B
    sequences, sequence b the rows ``query_start_loc[b] .. query_start_loc[b+1]``
    of q [T, Hq, D], k and v [T, Hk, D]; each query sees every key of its own
    sequence and none of another's (encoders, a vision tower's images or
    windows). Query head h reads KV head ``h // (Hq // Hk)``; scores
    ``scale * q.k``, softmax in float32.

pool(x, query_start_loc, method) -> [B, H] ([T, H] for 'all')
    One row per sequence of the flattened batch (as in encoder_attention),
    in x's dtype: 'cls' its first row, 'last' its last row, 'mean' the mean
    of its rows and 'max' their elementwise maximum (accumulated in float32,
    rounded once); 'all' returns x. Every sequence has at least one row.

moe(x, router_logits, w13, w2, top_k, renormalize, shared=None, shared_gate=None,
    w13_bias=None, w2_bias=None, activation=None, swiglu_alpha=None, swiglu_limit=None) -> (out [T, H], tokens_per_expert [E])
    x [T, H], router_logits [T, E] (x's dtype or float32), w13 [E, 2I, H] (gate rows then up rows),
    w2 [E, H, I]. Gating: float32 softmax over E, the top_k experts per token
    (lowest expert id first on ties), weights renormalised to sum to 1 when
    ``renormalize``. Each chosen expert e computes
    ``(silu(x @ w13[e, :I].T) * (x @ w13[e, I:].T)) @ w2[e].T``; the output is
    the gate-weighted sum. tokens_per_expert [E] int64 counts routed tokens.
    Optional shared expert (Qwen2-MoE, DeepSeek): ``shared`` [T, H] in x's
    dtype, the output of an always-on expert the core computes as an MLP, is
    added to that sum, scaled by ``sigmoid(shared_gate)`` when ``shared_gate``
    [T, 1] (gate logits, x's dtype) is given. The sum is taken in float32 and
    rounded once. `Ops.resolve` passes ``shared_expert=True`` when a model
    uses it, so a backend without it can decline and fall back.
    Expert biases (gpt-oss): ``w13_bias`` [E, 2I] is added to
    ``x @ w13[e].T`` and ``w2_bias`` [E, H] to the down projection, each
    expert its own row, before the gate weight. ``activation`` None or
    'silu' is the SwiGLU above; 'swiglu_oai' (gpt-oss) with alpha a =
    ``swiglu_alpha`` and limit L = ``swiglu_limit``: g = min(gate, L),
    u = clip(up, -L, L), ``h = (u + 1) * g * sigmoid(a * g)``. `Ops.resolve`
    passes ``expert_bias=True`` and ``moe_activation='swiglu_oai'`` when a
    model uses them, and only a backend whose ``moe`` takes those arguments
    is asked.
    Quantized experts: w13 and w2 may both be `Mxfp4Weight` handles with a
    leading expert axis (qweight [E, 2I, H/2] and [E, H, I/2]); each expert means the matrix the handle stands for
    (`dequant.dequantize`), every product as above. `Ops.resolve` passes
    ``expert_weight_kind='mxfp4'``; a backend asked must list it in
    `Backend.expert_weight_kinds`.

lora(x, y, lora_a, lora_b, lora_indices, output_slices=None) -> [T, N]
    Batched LoRA on a linear's output (punica's shrink then expand). x [T, K]
    is the linear's input and y [T, N] its output, in x's dtype; lora_a
    [S, P*R, K] and lora_b [S, N, R] are S stacked adapters in x's dtype,
    one rank-R pair per output slice (`output_slices`, P column counts summing
    to N, e.g. q/k/v of a fused qkv; None: one slice of N), an adapter's
    scaling folded into its B, ranks below R padded with zeros. lora_indices
    [T] int picks each token's slot s. For s > 0 the columns of slice p get
    ``(x[t] @ lora_a[s, p*R:(p+1)*R].T) @ lora_b[s, cols_p].T`` added, in
    float32, rounded once to y's dtype; a token with s == 0 (no adapter) keeps
    its row of y, and slot 0's weights are never read. A backend may write
    into y.

sample(logits, params) -> SampleOutput
    logits [B, V] float32 with a `SamplingTensors` row per request; see
    `SamplingTensors` for the exact order of penalties, the structured-output
    token bitmask, filters and the seeded Gumbel noise that makes a seed give
    the same token on every backend.

all_reduce(x, group=None) -> x summed over the ranks of a torch.distributed group
    (x itself may be overwritten; use the result).
all_gather(x, dim=0, group=None) -> the ranks' x concatenated along ``dim`` in rank order.
"""

from __future__ import annotations

from typing import Any, Callable

from .types import EXPERT_WEIGHT_KINDS, FLOAT_DTYPES, AttentionMetadata, SamplingTensors, WeightHandle, dtype_name

PRIMITIVES: tuple[str, ...] = (
    "embedding",
    "rms_norm",
    "layer_norm",
    "linear",
    "rotary",
    "act_and_mul",
    "activation",
    "kv_write",
    "attention",
    "encoder_attention",
    "pool",
    "mla_kv_write",
    "mla_attention",
    "moe",
    "lora",
    "sample",
    "all_reduce",
    "all_gather",
)

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
# The kinds of the (ungated) `activation` primitive.
PLAIN_ACTIVATIONS = ("gelu", "gelu_tanh", "quick_gelu", "silu", "relu", "tanh")
POOL_METHODS = ("cls", "last", "mean", "max", "all")
# The gated activations of `moe` (None means 'silu').
MOE_ACTIVATIONS = ("silu", "swiglu_oai")


class PrimitiveArgumentError(ValueError):
    """A primitive was called with an argument that breaks the contract."""

    def __init__(self, primitive: str, argument: str, problem: str):
        super().__init__(f"{primitive}: argument '{argument}' {problem}")
        self.primitive = primitive
        self.argument = argument


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in x.shape)


def _check_rank(prim: str, name: str, x: Any, rank: int, layout: str) -> tuple[int, ...]:
    if not hasattr(x, "shape"):
        raise PrimitiveArgumentError(prim, name, f"must be an array {layout}, got {type(x).__name__}")
    shape = _shape(x)
    if len(shape) != rank:
        raise PrimitiveArgumentError(prim, name, f"must be {layout}, got shape {shape}")
    return shape


def _check_float(prim: str, name: str, x: Any) -> str:
    dt = dtype_name(x)
    if dt not in FLOAT_DTYPES:
        raise PrimitiveArgumentError(prim, name, f"must be one of {FLOAT_DTYPES}, got {dt}")
    return dt


def _check_int(prim: str, name: str, x: Any) -> None:
    dt = dtype_name(x)
    if not dt.startswith(("int", "uint")):
        raise PrimitiveArgumentError(prim, name, f"must be an integer array, got {dt}")


def _check_same_dtype(prim: str, name: str, x: Any, ref_dtype: str) -> None:
    if dtype_name(x) != ref_dtype:
        raise PrimitiveArgumentError(prim, name, f"must have dtype {ref_dtype}, got {dtype_name(x)}")


def check_embedding(ids, table) -> None:
    _check_rank("embedding", "ids", ids, 1, "[T]")
    _check_int("embedding", "ids", ids)
    if isinstance(table, WeightHandle):
        return
    _check_rank("embedding", "table", table, 2, "[V, H]")
    _check_float("embedding", "table", table)


def _check_norm(prim: str, x, eps, residual, **weights) -> None:
    """rms_norm's and layer_norm's arguments: x [T, H], each weight [H] (or None), eps, a residual like x."""
    t, h = _check_rank(prim, "x", x, 2, "[T, H]")
    dt = _check_float(prim, "x", x)
    for name, w in weights.items():
        if w is not None and _check_rank(prim, name, w, 1, "[H]") != (h,):
            raise PrimitiveArgumentError(prim, name, f"must be [{h}], got {_shape(w)}")
    if not eps > 0:
        raise PrimitiveArgumentError(prim, "eps", f"must be > 0, got {eps}")
    if residual is not None:
        if _shape(residual) != (t, h):
            raise PrimitiveArgumentError(prim, "residual", f"must be [{t}, {h}] like x, got {_shape(residual)}")
        _check_same_dtype(prim, "residual", residual, dt)


def check_rms_norm(x, weight, eps, residual=None) -> None:
    if weight is None:
        raise PrimitiveArgumentError("rms_norm", "weight", "must be an array [H], got None")
    _check_norm("rms_norm", x, eps, residual, weight=weight)


def check_layer_norm(x, weight, bias, eps, residual=None) -> None:
    if weight is None:
        raise PrimitiveArgumentError("layer_norm", "weight", "must be an array [H], got None")
    _check_norm("layer_norm", x, eps, residual, weight=weight, bias=bias)


def check_activation(x, kind) -> None:
    if not hasattr(x, "shape"):
        raise PrimitiveArgumentError("activation", "x", f"must be an array, got {type(x).__name__}")
    _check_float("activation", "x", x)
    if kind not in PLAIN_ACTIVATIONS:
        raise PrimitiveArgumentError("activation", "kind", f"must be one of {PLAIN_ACTIVATIONS}, got {kind!r}")


def _check_sequences(prim: str, query_start_loc, t: int) -> None:
    (n,) = _check_rank(prim, "query_start_loc", query_start_loc, 1, "[B + 1]")
    _check_int(prim, "query_start_loc", query_start_loc)
    if n < 1:
        raise PrimitiveArgumentError(prim, "query_start_loc", "must hold at least one offset (0)")
    last = int(query_start_loc[-1])
    if last != t:
        raise PrimitiveArgumentError(prim, "query_start_loc", f"ends at {last} but the batch has {t} rows")


def check_encoder_attention(q, k, v, query_start_loc, scale) -> None:
    t, hq, d = _check_rank("encoder_attention", "q", q, 3, "[T, Hq, D]")
    dt = _check_float("encoder_attention", "q", q)
    tk, hk, dk = _check_rank("encoder_attention", "k", k, 3, "[T, Hk, D]")
    if (tk, dk) != (t, d) or hk < 1 or hq % hk:
        raise PrimitiveArgumentError("encoder_attention", "k", f"must be [{t}, Hk, {d}] with Hk dividing {hq}, "
                                     f"got {_shape(k)}")
    if _shape(v) != (t, hk, d):
        raise PrimitiveArgumentError("encoder_attention", "v", f"must be [{t}, {hk}, {d}] like k, got {_shape(v)}")
    for name, a in (("k", k), ("v", v)):
        _check_same_dtype("encoder_attention", name, a, dt)
    _check_sequences("encoder_attention", query_start_loc, t)


def check_pool(x, query_start_loc, method) -> None:
    t, _ = _check_rank("pool", "x", x, 2, "[T, H]")
    _check_float("pool", "x", x)
    if method not in POOL_METHODS:
        raise PrimitiveArgumentError("pool", "method", f"must be one of {POOL_METHODS}, got {method!r}")
    _check_sequences("pool", query_start_loc, t)


def check_linear(x, weight) -> None:
    _, k = _check_rank("linear", "x", x, 2, "[T, K]")
    _check_float("linear", "x", x)
    if not isinstance(weight, WeightHandle):
        raise PrimitiveArgumentError("linear", "weight", f"must be a WeightHandle (e.g. DenseWeight), got {type(weight).__name__}")
    if weight.in_features != k:
        raise PrimitiveArgumentError("linear", "weight", f"has in_features {weight.in_features} but x has K={k}")


def check_rotary(q, k, positions, cos_sin_cache, neox_style) -> None:
    t, _, d = _check_rank("rotary", "q", q, 3, "[T, Hq, D]")
    dt = _check_float("rotary", "q", q)
    tk, _, dk = _check_rank("rotary", "k", k, 3, "[T, Hk, D]")
    if (tk, dk) != (t, d):
        raise PrimitiveArgumentError("rotary", "k", f"must be [{t}, Hk, {d}] like q, got {_shape(k)}")
    _check_same_dtype("rotary", "k", k, dt)
    if _check_rank("rotary", "positions", positions, 1, "[T]") != (t,):
        raise PrimitiveArgumentError("rotary", "positions", f"must be [{t}], got {_shape(positions)}")
    _check_int("rotary", "positions", positions)
    _, r = _check_rank("rotary", "cos_sin_cache", cos_sin_cache, 2, "[max_position, rot_dim]")
    if r % 2 or r > d:
        raise PrimitiveArgumentError("rotary", "cos_sin_cache", f"rot_dim {r} must be even and <= head_dim {d}")


def check_act_and_mul(x, kind) -> None:
    _, two_i = _check_rank("act_and_mul", "x", x, 2, "[T, 2I]")
    _check_float("act_and_mul", "x", x)
    if two_i % 2:
        raise PrimitiveArgumentError("act_and_mul", "x", f"last dim must be even, got {two_i}")
    if kind not in ACTIVATIONS:
        raise PrimitiveArgumentError("act_and_mul", "kind", f"must be one of {ACTIVATIONS}, got {kind!r}")


def _check_meta(primitive: str, meta, t: int, queries: str) -> None:
    if not isinstance(meta, AttentionMetadata):
        raise PrimitiveArgumentError(primitive, "meta", f"must be AttentionMetadata, got {type(meta).__name__}")
    if meta.num_tokens != t:
        raise PrimitiveArgumentError(primitive, "meta", f"describes {meta.num_tokens} tokens but {queries} has {t}")


def check_kv_write(k, v, kv_cache, slot_mapping, scales=None) -> None:
    t, hk, d = _check_rank("kv_write", "k", k, 3, "[T, Hk, D]")
    dt = _check_float("kv_write", "k", k)
    if _shape(v) != (t, hk, d):
        raise PrimitiveArgumentError("kv_write", "v", f"must be [{t}, {hk}, {d}] like k, got {_shape(v)}")
    _check_same_dtype("kv_write", "v", v, dt)
    if _check_rank("kv_write", "slot_mapping", slot_mapping, 1, "[T]") != (t,):
        raise PrimitiveArgumentError("kv_write", "slot_mapping", f"must be [{t}], got {_shape(slot_mapping)}")
    _check_int("kv_write", "slot_mapping", slot_mapping)


def check_attention(q, kv_cache, meta, scale, sliding_window=None, soft_cap=None, kv_scales=None, sinks=None) -> None:
    t, hq, _ = _check_rank("attention", "q", q, 3, "[T, Hq, D]")
    _check_float("attention", "q", q)
    _check_meta("attention", meta, t, "q")
    if sliding_window is not None and sliding_window < 1:
        raise PrimitiveArgumentError("attention", "sliding_window", f"must be >= 1 or None, got {sliding_window}")
    if soft_cap is not None and not soft_cap > 0:
        raise PrimitiveArgumentError("attention", "soft_cap", f"must be > 0 or None, got {soft_cap}")
    if sinks is not None:
        if _shape(sinks) != (hq,):
            raise PrimitiveArgumentError("attention", "sinks", f"must be [{hq}] (one logit per query head), got {_shape(sinks)}")
        _check_float("attention", "sinks", sinks)


def check_mla_kv_write(c_kv, k_pe, kv_cache, slot_mapping) -> None:
    t, r = _check_rank("mla_kv_write", "c_kv", c_kv, 2, "[T, R]")
    dt = _check_float("mla_kv_write", "c_kv", c_kv)
    tp, p = _check_rank("mla_kv_write", "k_pe", k_pe, 2, "[T, P]")
    if tp != t:
        raise PrimitiveArgumentError("mla_kv_write", "k_pe", f"must have {t} rows like c_kv, got {tp}")
    _check_same_dtype("mla_kv_write", "k_pe", k_pe, dt)
    if (r + p) % 2:
        raise PrimitiveArgumentError("mla_kv_write", "k_pe", f"R + P must be even (the latent fills two planes), got {r + p}")
    if _check_rank("mla_kv_write", "slot_mapping", slot_mapping, 1, "[T]") != (t,):
        raise PrimitiveArgumentError("mla_kv_write", "slot_mapping", f"must be [{t}], got {_shape(slot_mapping)}")
    _check_int("mla_kv_write", "slot_mapping", slot_mapping)


def check_mla_attention(q_nope, q_pe, kv_cache, meta, kv_b_proj, scale, v_head_dim) -> None:
    t, h, n = _check_rank("mla_attention", "q_nope", q_nope, 3, "[T, H, N]")
    dt = _check_float("mla_attention", "q_nope", q_nope)
    tp, hp, _ = _check_rank("mla_attention", "q_pe", q_pe, 3, "[T, H, P]")
    if (tp, hp) != (t, h):
        raise PrimitiveArgumentError("mla_attention", "q_pe", f"must be [{t}, {h}, P] like q_nope, got {_shape(q_pe)}")
    _check_same_dtype("mla_attention", "q_pe", q_pe, dt)
    _check_meta("mla_attention", meta, t, "q_nope")
    rows, _ = _check_rank("mla_attention", "kv_b_proj", kv_b_proj, 2, "[H * (N + V), R]")
    if v_head_dim < 1 or rows != h * (n + v_head_dim):
        raise PrimitiveArgumentError("mla_attention", "kv_b_proj", f"must have {h} * ({n} + {v_head_dim}) rows, got {rows}")


def _kind(w: Any) -> str:
    return w.kind if isinstance(w, WeightHandle) else "a dense array"


class _Stacked:
    """The [E, N, K] shape of a stack of experts: a dense array's, or a quantized handle's."""

    def __init__(self, w: Any):
        if isinstance(w, WeightHandle):
            self.shape = (*w.qweight.shape[:-2], w.out_features, w.in_features)
        elif hasattr(w, "shape"):
            self.shape = w.shape


def check_moe(x, router_logits, w13, w2, top_k, renormalize, shared=None, shared_gate=None, w13_bias=None, w2_bias=None,
              activation=None, swiglu_alpha=None, swiglu_limit=None, routed_scaling_factor=None, scoring_func=None,
              routing_bias=None, expert_groups=None) -> None:
    t, h = _check_rank("moe", "x", x, 2, "[T, H]")
    dt = _check_float("moe", "x", x)
    tr, e = _check_rank("moe", "router_logits", router_logits, 2, "[T, E]")
    if tr != t:
        raise PrimitiveArgumentError("moe", "router_logits", f"must have {t} rows like x, got {tr}")
    if isinstance(w13, WeightHandle) or isinstance(w2, WeightHandle):
        if type(w13) is not type(w2) or w13.kind not in EXPERT_WEIGHT_KINDS:
            raise PrimitiveArgumentError("moe", "w2", "w13 and w2 must both be dense arrays or both weights of one "
                                         f"kind in {EXPERT_WEIGHT_KINDS}, got {_kind(w13)} and {_kind(w2)}")
    e13, two_i, h13 = _check_rank("moe", "w13", _Stacked(w13), 3, "[E, 2I, H]")
    if e13 != e or h13 != h or two_i % 2:
        raise PrimitiveArgumentError("moe", "w13", f"must be [{e}, 2I, {h}], got {_shape(_Stacked(w13))}")
    if _check_rank("moe", "w2", _Stacked(w2), 3, "[E, H, I]") != (e, h, two_i // 2):
        raise PrimitiveArgumentError("moe", "w2", f"must be [{e}, {h}, {two_i // 2}], got {_shape(_Stacked(w2))}")
    if not isinstance(w13, WeightHandle):
        _check_same_dtype("moe", "w13", w13, dt)
        _check_same_dtype("moe", "w2", w2, dt)
    if not 1 <= top_k <= e:
        raise PrimitiveArgumentError("moe", "top_k", f"must be in [1, {e}], got {top_k}")
    if shared is not None:
        if _shape(shared) != (t, h):
            raise PrimitiveArgumentError("moe", "shared", f"must be [{t}, {h}] like x, got {_shape(shared)}")
        _check_same_dtype("moe", "shared", shared, dt)
    if shared_gate is not None:
        if shared is None:
            raise PrimitiveArgumentError("moe", "shared_gate", "is given without 'shared', which it would scale")
        if _check_rank("moe", "shared_gate", shared_gate, 2, "[T, 1]") != (t, 1):
            raise PrimitiveArgumentError("moe", "shared_gate", f"must be [{t}, 1], got {_shape(shared_gate)}")
    if scoring_func not in (None, "softmax", "sigmoid"):
        raise PrimitiveArgumentError("moe", "scoring_func", f"must be 'softmax' or 'sigmoid', got {scoring_func!r}")
    if routing_bias is not None and _shape(routing_bias) != (e,):
        raise PrimitiveArgumentError("moe", "routing_bias", f"must be [{e}] (one per expert), got {_shape(routing_bias)}")
    if expert_groups is not None:
        groups, keep, kind = expert_groups
        if groups < 1 or e % groups or not 1 <= keep <= groups or kind not in ("max", "top2"):
            raise PrimitiveArgumentError("moe", "expert_groups", f"must be (groups dividing {e}, groups kept in "
                                         f"[1, groups], 'max' or 'top2'), got {expert_groups!r}")
        if top_k > keep * (e // groups):
            raise PrimitiveArgumentError("moe", "expert_groups", f"keeps {keep * (e // groups)} experts, fewer than "
                                         f"top_k={top_k}")
    for name, bias, shape in (("w13_bias", w13_bias, (e, two_i)), ("w2_bias", w2_bias, (e, h))):
        if bias is not None:
            if _shape(bias) != shape:
                raise PrimitiveArgumentError("moe", name, f"must be {list(shape)} (one row per expert), got {_shape(bias)}")
            _check_float("moe", name, bias)
    if activation is not None and activation not in MOE_ACTIVATIONS:
        raise PrimitiveArgumentError("moe", "activation", f"must be one of {MOE_ACTIVATIONS} or None, got {activation!r}")
    if activation == "swiglu_oai":
        if swiglu_alpha is None or swiglu_limit is None or not swiglu_limit > 0:
            raise PrimitiveArgumentError("moe", "swiglu_limit", "'swiglu_oai' needs swiglu_alpha and a swiglu_limit > 0, "
                                         f"got {swiglu_alpha} and {swiglu_limit}")


def check_lora(x, y, lora_a, lora_b, lora_indices, output_slices=None) -> None:
    t, k = _check_rank("lora", "x", x, 2, "[T, K]")
    dt = _check_float("lora", "x", x)
    ty, n = _check_rank("lora", "y", y, 2, "[T, N]")
    if ty != t:
        raise PrimitiveArgumentError("lora", "y", f"must have {t} rows like x, got {ty}")
    _check_same_dtype("lora", "y", y, dt)
    slices = tuple(output_slices) if output_slices is not None else (n,)
    if sum(slices) != n or min(slices, default=0) <= 0:
        raise PrimitiveArgumentError("lora", "output_slices", f"must be positive and sum to N={n}, got {slices}")
    s, pr, ka = _check_rank("lora", "lora_a", lora_a, 3, "[S, P*R, K]")
    if ka != k or pr % len(slices):
        raise PrimitiveArgumentError("lora", "lora_a", f"must be [S, {len(slices)}*R, {k}], got {_shape(lora_a)}")
    _check_same_dtype("lora", "lora_a", lora_a, dt)
    if _check_rank("lora", "lora_b", lora_b, 3, "[S, N, R]") != (s, n, pr // len(slices)):
        raise PrimitiveArgumentError("lora", "lora_b", f"must be [{s}, {n}, {pr // len(slices)}], got {_shape(lora_b)}")
    _check_same_dtype("lora", "lora_b", lora_b, dt)
    if _check_rank("lora", "lora_indices", lora_indices, 1, "[T]") != (t,):
        raise PrimitiveArgumentError("lora", "lora_indices", f"must be [{t}], got {_shape(lora_indices)}")
    _check_int("lora", "lora_indices", lora_indices)


def check_sample(logits, params) -> None:
    b, _ = _check_rank("sample", "logits", logits, 2, "[B, V]")
    if dtype_name(logits) != "float32":
        raise PrimitiveArgumentError("sample", "logits", f"must be float32, got {dtype_name(logits)}")
    if not isinstance(params, SamplingTensors):
        raise PrimitiveArgumentError("sample", "params", f"must be SamplingTensors, got {type(params).__name__}")
    if params.num_seqs != b:
        raise PrimitiveArgumentError("sample", "params", f"has {params.num_seqs} rows but logits has {b}")
    mask = params.token_bitmask
    if mask is not None:
        words = -(-int(logits.shape[1]) // 32)
        if tuple(int(s) for s in getattr(mask, "shape", ())) != (b, words) or dtype_name(mask) != "int32":
            raise PrimitiveArgumentError("sample", "params.token_bitmask",
                                         f"must be int32 [{b}, {words}] (ceil(V / 32) words per row), got "
                                         f"{dtype_name(mask) if hasattr(mask, 'dtype') else type(mask).__name__} "
                                         f"{list(getattr(mask, 'shape', []))}")


    drafts = params.draft_token_ids
    if drafts is not None:
        if tuple(int(s) for s in getattr(drafts, "shape", ())) != (b,) or dtype_name(drafts) != "int64":
            raise PrimitiveArgumentError("sample", "params.draft_token_ids", f"must be int64 [{b}] (-1: no draft)")
    if params.draft_probs is not None:
        if drafts is None:
            raise PrimitiveArgumentError("sample", "params.draft_probs", "needs draft_token_ids")
        if tuple(int(s) for s in params.draft_probs.shape) != tuple(int(s) for s in logits.shape):
            raise PrimitiveArgumentError("sample", "params.draft_probs", f"must be float32 {list(logits.shape)}")


def check_all_reduce(x, group=None) -> None:
    if not hasattr(x, "shape"):
        raise PrimitiveArgumentError("all_reduce", "x", f"must be an array, got {type(x).__name__}")


def check_all_gather(x, dim=0, group=None) -> None:
    if not hasattr(x, "shape"):
        raise PrimitiveArgumentError("all_gather", "x", f"must be an array, got {type(x).__name__}")
    if not -len(x.shape) <= dim < len(x.shape):
        raise PrimitiveArgumentError("all_gather", "dim", f"must index one of x's {len(x.shape)} dims, got {dim}")


CHECKS: dict[str, Callable[..., None]] = {name: globals()[f"check_{name}"] for name in PRIMITIVES}
