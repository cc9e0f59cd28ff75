"""Routed experts: softmax top-k gating, SwiGLU experts, weighted combine,
plus the optional gated shared expert."""

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


def expert(x, w13_e, w2_e):
    """One SwiGLU expert on the rows of x (float64)."""
    i = w13_e.shape[0] // 2
    gate = x @ w13_e[:i].astype(np.float64).T
    up = x @ w13_e[i:].astype(np.float64).T
    return (act(gate, "silu") * up) @ w2_e.astype(np.float64).T


def moe(x, router_logits, w13, w2, top_k, renormalize, shared=None, shared_gate=None):
    t, h = x.shape
    n_experts = w13.shape[0]
    ids, weights = route(router_logits, top_k, renormalize)
    x64 = x.astype(np.float64)
    out = np.zeros((t, h), dtype=np.float64)
    for e in range(n_experts):
        tokens, slot = np.nonzero(ids == e)
        if tokens.size == 0:  # an expert no token chose computes nothing
            continue
        ye = expert(x64[tokens], w13[e], w2[e])
        np.add.at(out, tokens, weights[tokens, slot][:, None] * ye)
    if shared is not None:
        scale = 1.0 if shared_gate is None else 1.0 / (1.0 + np.exp(-shared_gate.astype(np.float64)))
        out += scale * shared.astype(np.float64)
    tokens_per_expert = np.bincount(ids.ravel(), minlength=n_experts).astype(np.int64)
    return out.astype(np.float32), tokens_per_expert
