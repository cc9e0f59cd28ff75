"""Routed experts: softmax top-k gating, SwiGLU experts (or gpt-oss's clamped
form, with per-expert biases), weighted combine, plus the optional gated
shared expert."""

from __future__ import annotations

import numpy as np

from ...primitives.dequant import dequantize
from ...primitives.types import WeightHandle
from .ops import act


def route(router_logits, top_k, renormalize, routed_scaling_factor=None, scoring_func=None, routing_bias=None,
          expert_groups=None):
    """(expert ids [T, k], weights [T, k]) per token.

    Scores are the softmax of the logits (or their sigmoid); experts are chosen by
    score plus `routing_bias`, only among the `keep` groups of experts whose best
    score (``"max"``) or two best summed (``"top2"``) lead, when `expert_groups` =
    (groups, keep, kind) is given; their weights are the scores without the bias,
    renormalised if asked, times `routed_scaling_factor`."""
    logits = router_logits.astype(np.float64)
    if scoring_func == "sigmoid":
        probs = 1.0 / (1.0 + np.exp(-logits))
    else:
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
    choice = probs if routing_bias is None else probs + np.asarray(routing_bias, np.float64)
    if expert_groups is not None:
        groups, keep, kind = expert_groups
        g = choice.reshape(len(choice), groups, -1)
        score = g.max(axis=-1) if kind == "max" else np.sort(g, axis=-1)[..., -2:].sum(axis=-1)
        kept = np.argsort(-score, axis=-1, kind="stable")[:, :keep]
        mask = np.zeros_like(score, dtype=bool)
        np.put_along_axis(mask, kept, True, axis=-1)
        choice = np.where(np.repeat(mask, g.shape[-1], axis=-1), choice, -np.inf)
    # A stable sort puts the lowest expert id first among equals.
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, ids, axis=-1)
    if renormalize:
        weights /= weights.sum(axis=-1, keepdims=True)
    if routed_scaling_factor is not None:
        weights *= routed_scaling_factor
    return ids, weights


def expert(x, w13_e, w2_e, b13_e=None, b2_e=None, activation=None, alpha=None, limit=None):
    """One gated expert on the rows of x (float64): SwiGLU, or gpt-oss's clamped form."""
    i = w13_e.shape[0] // 2
    gate = x @ w13_e[:i].astype(np.float64).T
    up = x @ w13_e[i:].astype(np.float64).T
    if b13_e is not None:
        gate, up = gate + b13_e[:i].astype(np.float64), up + b13_e[i:].astype(np.float64)
    if activation == "swiglu_oai":
        gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
        h = (up + 1.0) * gate / (1.0 + np.exp(-alpha * gate))
    else:
        h = act(gate, "silu") * up
    y = h @ w2_e.astype(np.float64).T
    return y if b2_e is None else y + b2_e.astype(np.float64)


def _expert(w, e: int) -> np.ndarray:
    """Expert e's matrix of a stack: a dense array's slice, or what a quantized handle stands for."""
    return dequantize(w, np.asarray([e]))[0] if isinstance(w, WeightHandle) else w[e]


def moe(x, router_logits, w13, w2, top_k, renormalize, shared=None, shared_gate=None, w13_bias=None, w2_bias=None,
        activation=None, swiglu_alpha=None, swiglu_limit=None, routed_scaling_factor=None, scoring_func=None,
        routing_bias=None, expert_groups=None):
    t, h = x.shape
    n_experts = int(router_logits.shape[1])
    ids, weights = route(router_logits, top_k, renormalize, routed_scaling_factor, scoring_func, routing_bias,
                         expert_groups)
    x64 = x.astype(np.float64)
    out = np.zeros((t, h), dtype=np.float64)
    for e in range(n_experts):
        tokens, slot = np.nonzero(ids == e)
        if tokens.size == 0:  # an expert no token chose computes nothing
            continue
        ye = expert(x64[tokens], _expert(w13, e), _expert(w2, e), None if w13_bias is None else w13_bias[e],
                    None if w2_bias is None else w2_bias[e], activation, swiglu_alpha, swiglu_limit)
        np.add.at(out, tokens, weights[tokens, slot][:, None] * ye)
    if shared is not None:
        scale = 1.0 if shared_gate is None else 1.0 / (1.0 + np.exp(-shared_gate.astype(np.float64)))
        out += scale * shared.astype(np.float64)
    tokens_per_expert = np.bincount(ids.ravel(), minlength=n_experts).astype(np.int64)
    return out.astype(np.float32), tokens_per_expert
