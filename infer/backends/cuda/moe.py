"""Fused routed experts: top-k gating, tokens aligned per expert, two grouped GEMMs.

1. `_gating_kernel`: softmax over the router logits in float32 and the top_k
   experts of each token (argmax picks the lowest id on ties, as the contract
   asks), renormalised when asked.
2. Alignment (torch ops, no host sync): the T * top_k (token, choice) pairs
   are sorted by expert and each expert's run is padded to a multiple of
   BLOCK_M, so every M-tile of the sorted list belongs to one expert. The
   padding is an upper bound known from shapes, so the grid is too.
3. `_grouped_gemm_kernel` twice: gate and up projections in one pass with
   SiLU(gate) * up (or gpt-oss's clamped form) fused into the epilogue, then
   the down projection with the gate weight fused into its epilogue; expert
   biases (gpt-oss) are added in both epilogues. Each tile reads only its expert's
   weights and only the rows routed to it.
   MXFP4 expert stacks (`Mxfp4Weight`, gpt-oss) are read as stored: each
   K tile's codes and block exponents are turned into values in the tile.
4. The top_k weighted rows of each token (and a shared expert's output, when
   the model has one) are summed in float32 and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...primitives.types import Mxfp4Weight
from .launch import compute_f32, dot_precision, next_pow2
from .quant_linear import _e2m1, _e8m0


@triton.jit
def _gating_kernel(ids_ptr, weights_ptr, logits_ptr, num_experts, stride_l,
                   TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + t * stride_l + e, mask=e < num_experts, other=float("-inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, 0))
    p = p / tl.sum(p, 0)
    p = tl.where(e < num_experts, p, -1.0)
    kk = tl.arange(0, BLOCK_K)
    chosen = tl.zeros([BLOCK_K], tl.int32)
    w = tl.zeros([BLOCK_K], tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(p, 0, tie_break_left=True)
        chosen = tl.where(kk == j, best, chosen)
        w = tl.where(kk == j, tl.max(p, 0), w)
        p = tl.where(e == best, -1.0, p)  # probabilities are >= 0: a taken expert never wins again
    if RENORMALIZE:
        w = w / tl.sum(w, 0)
    tl.store(ids_ptr + t * TOP_K + kk, chosen, mask=kk < TOP_K)
    tl.store(weights_ptr + t * TOP_K + kk, w, mask=kk < TOP_K)


@triton.jit
def _mxfp4_tile(q_ptr, s_ptr, expert, n, n_ok, k0, k_in, stride_we, stride_wn, stride_se, stride_sn,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows n, columns [k0, k0 + BLOCK_K) of expert's MXFP4 matrix, as float32 [BLOCK_K, BLOCK_N]."""
    js = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    byte = tl.load(q_ptr + expert * stride_we + n[:, None] * stride_wn + js[None, :],
                   mask=n_ok[:, None] & (js * 2 < k_in)[None, :], other=0).to(tl.int32)
    v = _e2m1(tl.interleave(byte & 15, byte >> 4))
    PER: tl.constexpr = BLOCK_K // 32
    gs = k0 // 32 + tl.arange(0, PER)
    e = tl.load(s_ptr + expert * stride_se + n[:, None] * stride_sn + gs[None, :],
                mask=n_ok[:, None] & (gs * 32 < k_in)[None, :], other=127).to(tl.int32)
    return tl.trans(tl.reshape(tl.reshape(v, (BLOCK_N, PER, 32)) * _e8m0(e)[:, :, None], (BLOCK_N, BLOCK_K)))


@triton.jit
def _grouped_gemm_kernel(c_ptr, a_ptr, w_ptr, s_ptr, sorted_pairs_ptr, block_expert_ptr, pair_weight_ptr, bias_ptr,
                         num_pairs, n_out, k_in, gate_offset, alpha, limit,
                         stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_cm, stride_be,
                         ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                         HAS_BIAS: tl.constexpr, OAI: tl.constexpr, MX: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         F32: tl.constexpr, PRECISION: tl.constexpr):
    """C[pair, n] = A[pair // ROW_DIV] @ W[e, n]^T (+ bias[e, n]) for the pairs of one M-tile;
    GATED: also the rows n + gate_offset of W (and of the bias), giving silu(first) * second, or
    with OAI gpt-oss's (clamp(second, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(first, limit).
    MX: W is MXFP4 (codes at w_ptr, E8M0 exponents at s_ptr), dequantized tile by tile."""
    m_tile = tl.program_id(0)
    expert = tl.load(block_expert_ptr + m_tile).to(tl.int64)
    if expert < 0:
        return  # past the last expert's padded run
    pairs = tl.load(sorted_pairs_ptr + m_tile * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs  # padding holds num_pairs
    a_rows = (pairs // ROW_DIV).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_out
    kk = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert * stride_we + n[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        k = k0 + kk
        k_ok = k < k_in
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if MX:
            w = _mxfp4_tile(w_ptr, s_ptr, expert, n, n_ok, k0, k_in, stride_we, stride_wn, stride_se, stride_sn,
                            BLOCK_N, BLOCK_K)
            w = w if F32 else w.to(a.dtype)  # E2M1 times a power of two: exact in fp16/bf16 range
        else:
            w = tl.load(w_base + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if F32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if GATED:
            if MX:
                w_up = _mxfp4_tile(w_ptr, s_ptr, expert, n + gate_offset, n_ok, k0, k_in, stride_we, stride_wn,
                                   stride_se, stride_sn, BLOCK_N, BLOCK_K)
                w_up = w_up if F32 else w_up.to(a.dtype)
            else:
                w_up = tl.load(w_base + gate_offset * stride_wn + k[:, None], mask=k_ok[:, None] & n_ok[None, :],
                               other=0.0)
            if F32:
                w_up = w_up.to(tl.float32)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
    if HAS_BIAS:
        bias_row = bias_ptr + expert * stride_be + n
        acc += tl.load(bias_row, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_row + gate_offset, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        if OAI:
            g = tl.minimum(acc, limit)
            u = tl.minimum(tl.maximum(acc_up, -limit), limit)
            acc = (u + 1.0) * g / (1.0 + tl.exp(-alpha * g))
        else:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(pair_weight_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    tl.store(c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [T, top_k] int32, float32 weights [T, top_k])."""
    num_tokens, num_experts = router_logits.shape
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    _gating_kernel[(num_tokens,)](ids, weights, logits, num_experts, logits.stride(0), TOP_K=top_k,
                                  RENORMALIZE=renormalize, BLOCK_E=next_pow2(num_experts),
                                  BLOCK_K=max(2, next_pow2(top_k)), num_warps=1)
    return ids, weights


def align(flat_ids: torch.Tensor, num_experts: int, block_m: int):
    """(sorted_pairs [P], block_expert [P // block_m], tokens_per_expert [E]) for the pairs' expert ids.

    sorted_pairs lists pair indices grouped by expert, each group padded with
    ``len(flat_ids)`` to a multiple of block_m; block_expert is -1 for tiles
    past the last group. P is the shape-only upper bound of the padded length.
    """
    num_pairs = flat_ids.numel()
    dev = flat_ids.device
    ids = flat_ids.long()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(ids, stable=True)
    expert_of = ids[order]
    rank = torch.arange(num_pairs, device=dev) - (torch.cumsum(counts, 0) - counts)[expert_of]
    capacity = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int32, device=dev)
    sorted_pairs[(padded_end - padded)[expert_of] + rank] = order.to(torch.int32)
    tile_start = torch.arange(0, capacity, block_m, device=dev)
    block_expert = torch.searchsorted(padded_end, tile_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert, counts


def _gemm(c, a, w, sorted_pairs, block_expert, pair_weight, num_pairs, n_out, row_div, gated, block_m,
          bias=None, oai=None):
    """`oai`: (alpha, limit) of gpt-oss's clamped SwiGLU for a gated GEMM, else SiLU. `w`: a dense
    [E, N, K] tensor or an `Mxfp4Weight` stack (its tiles hold whole blocks of 32: K tiles of 32 or 64)."""
    mx = isinstance(w, Mxfp4Weight)
    q, scales = (w.qweight.contiguous(), w.scales.contiguous()) if mx else (w, w)
    k_in = w.in_features if mx else w.shape[-1]
    block_n = max(16, min(64, next_pow2(n_out)))
    block_k = max(32 if mx else 16, min(64, next_pow2(k_in)))
    grid = (block_expert.numel(), triton.cdiv(n_out, block_n))
    alpha, limit = oai or (0.0, 0.0)
    _grouped_gemm_kernel[grid](
        c, a, q, scales, sorted_pairs, block_expert, pair_weight, c if bias is None else bias, num_pairs, n_out, k_in,
        n_out, float(alpha), float(limit),
        a.stride(0), q.stride(0), q.stride(1), scales.stride(0), scales.stride(1), c.stride(0),
        0 if bias is None else bias.stride(0),
        ROW_DIV=row_div, GATED=gated, MUL_WEIGHT=pair_weight is not None, HAS_BIAS=bias is not None,
        OAI=oai is not None, MX=mx, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, F32=compute_f32(a.dtype), PRECISION=dot_precision(a.dtype), num_warps=4,
    )  # fmt: skip


def moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
        renormalize: bool, shared: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None,
        w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None, activation: str | None = None,
        swiglu_alpha: float | None = None, swiglu_limit: float | None = None, routed_scaling_factor: float | None = None,
        scoring_func: str | None = None, routing_bias: torch.Tensor | None = None,
        expert_groups: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, hidden = x.shape
    num_experts = router_logits.shape[1]
    inter = (w13.out_features if isinstance(w13, Mxfp4Weight) else w13.shape[1]) // 2
    if num_tokens == 0:
        return torch.zeros_like(x), torch.zeros(num_experts, dtype=torch.int64, device=x.device)
    x = x if x.stride(-1) == 1 else x.contiguous()
    if not isinstance(w13, Mxfp4Weight):
        w13 = w13 if w13.stride(-1) == 1 else w13.contiguous()
        w2 = w2 if w2.stride(-1) == 1 else w2.contiguous()
    if any(a is not None for a in (routed_scaling_factor, scoring_func, routing_bias, expert_groups)):
        # DeepSeek's routing (sigmoid scores, a selection bias, expert groups): torch's, then the same kernels.
        from ..torch_native.moe import route as grouped_route

        ids, weights = grouped_route(router_logits, top_k, renormalize, routed_scaling_factor, scoring_func,
                                     routing_bias, expert_groups)
        ids = ids.to(torch.int32)
    else:
        ids, weights = route(router_logits, top_k, renormalize)
    num_pairs = num_tokens * top_k
    # Small batches (decode) get small tiles: less padding per expert.
    block_m = 16 if num_pairs <= 4 * num_experts else 64
    sorted_pairs, block_expert, counts = align(ids.flatten(), num_experts, block_m)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    oai = (swiglu_alpha, swiglu_limit) if activation == "swiglu_oai" else None
    contiguous = lambda b: None if b is None else (b if b.stride(-1) == 1 else b.contiguous())  # noqa: E731
    _gemm(h, x, w13, sorted_pairs, block_expert, None, num_pairs, inter, top_k, True, block_m, contiguous(w13_bias), oai)
    out_pairs = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    _gemm(out_pairs, h, w2, sorted_pairs, block_expert, weights.flatten(), num_pairs, hidden, 1, False, block_m,
          contiguous(w2_bias))
    out = out_pairs.view(num_tokens, top_k, hidden).sum(1)
    if shared is not None:  # the always-on expert joins the float32 sum, rounded once with it
        s = shared.float()
        out += s if shared_gate is None else torch.sigmoid(shared_gate.float()) * s
    return out.to(x.dtype), counts
