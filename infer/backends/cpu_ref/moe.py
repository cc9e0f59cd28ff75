"""Routed experts: softmax top-k gating, SwiGLU experts, weighted combine."""

from __future__ import annotations

import numpy as np

from .ops import act


def route(router_logits, top_k, renormalize):
    """(expert ids [T, k], weights [T, k]) per token."""
    logits = router_logits.astype(np.float64)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    # A stable sort of -probs puts the lowest expert id first among equals.
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, ids, axis=-1)
    if renormalize:
        weights /= weights.sum(axis=-1, keepdims=True)
    return ids, weights


def moe(x, router_logits, w13, w2, top_k, renormalize):
    t, h = x.shape
    n_experts, two_i, _ = w13.shape
    i = two_i // 2
    ids, weights = route(router_logits, top_k, renormalize)
    x64 = x.astype(np.float64)
    out = np.zeros((t, h), dtype=np.float64)
    for e in range(n_experts):
        tokens, slot = np.nonzero(ids == e)
        if tokens.size == 0:
            continue
        xe = x64[tokens]
        gate = xe @ w13[e, :i].astype(np.float64).T
        up = xe @ w13[e, i:].astype(np.float64).T
        ye = (act(gate, "silu") * up) @ w2[e].astype(np.float64).T
        np.add.at(out, tokens, weights[tokens, slot][:, None] * ye)
    tokens_per_expert = np.bincount(ids.ravel(), minlength=n_experts).astype(np.int64)
    return out.astype(np.float32), tokens_per_expert
