"""Routed experts: softmax top-k gating, then each expert on only its tokens.

Tokens are sorted by expert so every expert runs one GEMM pair over a
contiguous slice of the routed rows; the Python loop is over experts that got
tokens, never over tokens, and no expert computes a token it was not routed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [T, k] int64, float32 weights [T, k]), lowest expert id first on ties."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    # torch.topk does not promise which of equal values it returns; a stable
    # descending sort does (E is small, so the full sort costs nothing).
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def moe(
    x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    ids, weights = route(router_logits, top_k, renormalize)
    flat_ids = ids.flatten()
    tokens_per_expert = torch.bincount(flat_ids, minlength=num_experts).long()
    order = torch.argsort(flat_ids, stable=True)
    token_of = order // top_k  # which token each sorted (token, choice) pair belongs to
    weight_of = weights.flatten().index_select(0, order)
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
    # One host sync per call: slice bounds must be Python ints to slice.
    counts = tokens_per_expert.tolist()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = token_of[start : start + n]
        xe = x.index_select(0, rows)
        gate_up = F.linear(xe, w13[e]).float()
        h = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype)
        ye = F.linear(h, w2[e]).float()
        out.index_add_(0, rows, ye * weight_of[start : start + n, None])
        start += n
    return out.to(x.dtype), tokens_per_expert
