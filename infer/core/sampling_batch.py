"""Host-side SamplingTensors for one step's sampled rows."""

from __future__ import annotations

import numpy as np

from ..primitives.types import SamplingTensors
from .request_state import CompletionState


def _padded(rows: list[list[int]]) -> np.ndarray:
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), max(width, 1)), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def _constrained(c: CompletionState) -> bool:
    """The row's grammar decides its next token (it has one, not waiting for the reasoning, not ended)."""
    return c.matcher is not None and c.reasoning is None and not c.matcher.is_terminated()


def deferrable(c: CompletionState) -> bool:
    """A grammar row may sample without its mask first when that cannot change its
    token: sampling takes argmax(logits / T + noise(seed, step, token)), so when no
    top-k/top-p/min-p filter depends on which tokens the mask removes, the unmasked
    winner (bans applied) is the masked winner whenever the grammar allows it. The
    mask is then only filled for rows whose first choice the grammar refuses
    (llama.cpp samples grammars this way). `mask_next`: refused last step."""
    p = c.params
    unfiltered = p.temperature == 0 or (p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0)
    return unfiltered and not c.mask_next and _constrained(c)


def token_bitmask(rows: list[CompletionState], vocab_size: int, deferred=frozenset()) -> np.ndarray | None:
    """The structured-output bitmask of a step's rows (all ones for a row without
    a grammar or in `deferred`), with each grammar row's banned tokens (EOS before
    min_tokens) cleared unless the grammar allows nothing else; None when no row has one."""
    constrained = [_constrained(c) and i not in deferred for i, c in enumerate(rows)]
    if not any(constrained):
        return None
    mask = np.full((len(rows), -(-vocab_size // 32)), -1, dtype=np.int32)
    by_kind: dict[type, list] = {}
    for i, c in enumerate(rows):
        if constrained[i]:
            by_kind.setdefault(type(c.matcher), []).append((c.matcher, i))
    for kind, pairs in by_kind.items():
        kind.fill_bitmasks(pairs, mask)
    for i, c in enumerate(rows):
        if not constrained[i]:
            continue
        banned = [t for t in c.banned_tokens() if 0 <= t < vocab_size]
        if banned:
            row = mask[i].view(np.uint32).copy()
            for t in banned:
                row[t // 32] &= ~np.uint32(1 << (t % 32))
            if row.any():
                mask[i] = row.view(np.int32)
    return mask


def build_sampling_tensors(rows: list[CompletionState], vocab_size: int, deferred=frozenset(),
                           spec: list[tuple[list[int], int]] | None = None) -> SamplingTensors:
    """`deferred`: indices of grammar rows sampled without their mask this time
    (their bans go to logit_bias, as an unconstrained row's). `spec`: per row of a
    step verifying drafts, (the drafted tokens before the row's position, the draft
    it verifies or -1): the row samples as if those drafts were already output."""
    ps = [c.params for c in rows]
    ahead = [len(before) for before, _ in spec] if spec is not None else [0] * len(rows)
    f32 = lambda xs: np.array(xs, dtype=np.float32)  # noqa: E731
    t = SamplingTensors(
        temperature=f32([p.temperature for p in ps]),
        top_k=np.array([p.top_k for p in ps], dtype=np.int32),
        top_p=f32([p.top_p for p in ps]),
        min_p=f32([p.min_p for p in ps]),
        seeds=np.array([c.seed for c in rows], dtype=np.int64),
        steps=np.array([c.request.num_output_tokens + a for c, a in zip(rows, ahead)], dtype=np.int64),
        presence_penalty=f32([p.presence_penalty for p in ps]),
        frequency_penalty=f32([p.frequency_penalty for p in ps]),
        repetition_penalty=f32([p.repetition_penalty for p in ps]),
        # logprobs=0 still wants the sampled token's rank, which comes with K >= 1.
        max_num_logprobs=max((max(p.logprobs, 1) for p in ps if p.logprobs is not None), default=0),
    )
    # Token histories only cross to the device when some row is penalised.
    if any(p.repetition_penalty != 1.0 for p in ps):
        t.prompt_token_ids = _padded([c.request.prompt_token_ids for c in rows])
    if any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in ps):
        t.output_token_ids = _padded([c.request.output_token_ids + list(spec[i][0]) if ahead[i]
                                      else c.request.output_token_ids for i, c in enumerate(rows)])
    t.token_bitmask = token_bitmask(rows, vocab_size, deferred)
    # A masked grammar row's bans are in its bitmask (where the grammar leaves another choice).
    masked = [_constrained(c) and i not in deferred for i, c in enumerate(rows)]
    biases = [dict(c.params.logit_bias or {}) | {tok: -np.inf for tok in (() if masked[i] else c.banned_tokens(ahead[i]))}
              for i, c in enumerate(rows)]
    if spec is not None:
        t.draft_token_ids = np.array([d for _, d in spec], dtype=np.int64)
    if any(biases):
        t.logit_bias_ids = _padded([list(b) for b in biases])
        values = np.zeros(t.logit_bias_ids.shape, dtype=np.float32)
        for i, b in enumerate(biases):
            values[i, : len(b)] = list(b.values())
        t.logit_bias_values = values
    return t
