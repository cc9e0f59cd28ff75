"""`sample`, row by row, in the order `SamplingTensors` documents."""

from __future__ import annotations

import numpy as np

from ...primitives.types import SampleOutput, SamplingTensors
from ...primitives.noise import acceptance_uniforms, gumbel_noise


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def softmax(x: np.ndarray) -> np.ndarray:
    return np.exp(log_softmax(x))


def valid(ids_row) -> np.ndarray:
    """The non-padding entries of a -1-padded id row (none when absent)."""
    if ids_row is None:
        return np.zeros(0, dtype=np.int64)
    return ids_row[ids_row >= 0].astype(np.int64)


def apply_penalties(x: np.ndarray, p: SamplingTensors, b: int) -> np.ndarray:
    x = x.copy()
    prompt = valid(None if p.prompt_token_ids is None else p.prompt_token_ids[b])
    output = valid(None if p.output_token_ids is None else p.output_token_ids[b])
    r = float(p.repetition_penalty[b])
    if r != 1.0:
        seen = np.union1d(prompt, output)
        x[seen] = np.where(x[seen] > 0, x[seen] / r, x[seen] * r)
    counts = np.bincount(output, minlength=x.shape[0])[: x.shape[0]]
    x -= float(p.frequency_penalty[b]) * counts
    x -= float(p.presence_penalty[b]) * (counts > 0)
    if p.logit_bias_ids is not None:
        ids = p.logit_bias_ids[b]
        keep = ids >= 0
        np.add.at(x, ids[keep].astype(np.int64), p.logit_bias_values[b][keep].astype(np.float64))
    if p.token_bitmask is not None:
        x = np.where(allowed(p.token_bitmask[b], x.shape[0]), x, -np.inf)
    return x


def allowed(words: np.ndarray, vocab: int) -> np.ndarray:
    """[V] bool from one row of a structured-output bitmask: bit t % 32 of word t // 32."""
    bits = (words.astype(np.int64)[:, None] >> np.arange(32)) & 1
    return bits.reshape(-1)[:vocab].astype(bool)


def filter_logits(x: np.ndarray, p: SamplingTensors, b: int) -> np.ndarray:
    """Temperature, then min_p, top_k and top_p, each on the previous result."""
    x = x / float(p.temperature[b])
    min_p = float(p.min_p[b])
    if min_p > 0:
        probs = softmax(x)
        x = np.where(probs >= min_p * probs.max(), x, -np.inf)
    top_k = int(p.top_k[b])
    if 0 < top_k < x.shape[0]:
        kth = np.sort(x)[::-1][top_k - 1]
        x = np.where(x >= kth, x, -np.inf)
    top_p = float(p.top_p[b])
    if top_p < 1.0:
        probs = softmax(x)
        order = np.argsort(-probs, kind="stable")
        preceding = np.cumsum(probs[order]) - probs[order]
        keep = np.zeros(x.shape[0], dtype=bool)
        keep[order[preceding < top_p]] = True
        keep[order[0]] = True  # the most likely token always survives
        x = np.where(keep, x, -np.inf)
    return x


def verify_draft(p: np.ndarray, d: int, params: SamplingTensors, b: int, noise: np.ndarray) -> tuple[int, bool]:
    """Step 6 for one sampled row: (token, accepted) for draft d under p."""
    if params.draft_probs is None:
        q = np.zeros_like(p)
        q[d] = 1.0
    else:
        q = params.draft_probs[b].astype(np.float64)
    u = float(acceptance_uniforms(params.seeds[b : b + 1], params.steps[b : b + 1])[0])
    if u * q[d] < p[d]:
        return d, True
    residual = np.maximum(p - q, 0.0)
    with np.errstate(divide="ignore"):
        r = np.log(residual if residual.any() else p)
    return int(np.argmax(r + noise)), False


def sample(logits: np.ndarray, params: SamplingTensors) -> SampleOutput:
    n, vocab = logits.shape
    raw = log_softmax(logits.astype(np.float64))
    tokens = np.zeros(n, dtype=np.int64)
    drafts = params.draft_token_ids
    accepted = np.zeros(n, dtype=bool)
    for b in range(n):
        x = apply_penalties(logits[b].astype(np.float64), params, b)
        d = -1 if drafts is None else int(drafts[b])
        if float(params.temperature[b]) == 0.0:
            tokens[b] = int(np.argmax(x))  # argmax takes the lowest id on ties
            accepted[b] = d == tokens[b]
            continue
        x = filter_logits(x, params, b)
        noise = gumbel_noise(params.seeds[b : b + 1], params.steps[b : b + 1], vocab)[0]
        if d < 0:
            tokens[b] = int(np.argmax(x + noise))
            continue
        tokens[b], accepted[b] = verify_draft(softmax(x), d, params, b, noise)
    out = SampleOutput(token_ids=tokens, logprobs=raw[np.arange(n), tokens].astype(np.float32),
                       accepted=None if drafts is None else accepted)
    k = params.max_num_logprobs
    if k > 0:
        top = np.argsort(-raw, axis=-1, kind="stable")[:, :k]
        out.top_token_ids = top.astype(np.int64)
        out.top_logprobs = np.take_along_axis(raw, top, axis=-1).astype(np.float32)
        out.ranks = 1 + (raw > raw[np.arange(n), tokens][:, None]).sum(axis=1).astype(np.int64)
    return out
