"""`sample`, vectorised over the batch, in the order `SamplingTensors` documents.

Work no row asks for is skipped: no penalty pass without penalties, no noise
or filters when every row is greedy, top_p only over the rows that set it, and
noise hashed only for tokens that can still win. Nothing sorts the vocabulary
(see `ranking`).
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from ...primitives.types import SampleOutput, SamplingTensors
from .native import ops as native
from .noise import acceptance_uniforms, gumbel_noise, gumbel_noise_at
from .ranking import avoid_host_reads, top_p_mask, topk_lowest_id

NEG_INF = float("-inf")
# Width of the Gumbel noise's range (-log(-log(u)) for u in [2**-25, 1 - 2**-25]) plus a margin.
GUMBEL_SPAN = 21.0


def _token_counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] float32 occurrences of each token in a -1-padded id matrix."""
    ids = ids.long()
    keep = ids >= 0
    counts = torch.zeros(ids.shape[0], vocab, dtype=torch.float32, device=ids.device)
    # Padding adds 0 to column 0 instead of needing a spare column.
    return counts.scatter_add_(1, ids.clamp(min=0), keep.float())


_PENALTY_BY_BYTE: dict[torch.device, torch.Tensor] = {}  # [256, 8] float32: 0 or -inf per bit of a byte value


def _byte_table(device: torch.device) -> torch.Tensor:
    table = _PENALTY_BY_BYTE.get(device)
    if table is None:
        bits = (torch.arange(256, device=device)[:, None] >> torch.arange(8, device=device)) & 1
        table = _PENALTY_BY_BYTE[device] = torch.where(bits.bool(), 0.0, NEG_INF)
    return table


def apply_token_bitmask(x: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """-inf on every token the bitmask [B, ceil(V/32)] int32 does not allow (a new tensor).

    On the CPU a native kernel does it in one pass. Elsewhere, on a little-endian host the words' bytes hold the tokens in order, 8 per
    byte: one row of a [256, 8] table of 0/-inf per byte, added to the logits,
    is 7x faster than expanding the bits to a bool mask."""
    out = native.token_bitmask(x, bitmask)  # one pass over the logits on the CPU
    if out is not None:
        return out
    b, vocab = x.shape
    if sys.byteorder != "little":
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        allowed = ((bitmask[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab].bool()
        return x.masked_fill(~allowed, NEG_INF)
    codes = bitmask.contiguous().view(torch.uint8).flatten().long()
    return x + _byte_table(x.device).index_select(0, codes).view(b, -1)[:, :vocab]


def _row_ids(mask, device) -> torch.Tensor:
    """Indices of the set rows of a host (NumPy) or device boolean mask, on `device`."""
    if isinstance(mask, np.ndarray):
        return torch.from_numpy(np.flatnonzero(mask)).to(device)
    return torch.nonzero(mask).flatten()


def apply_penalties(x: torch.Tensor, p: SamplingTensors) -> torch.Tensor:
    """Repetition, frequency and presence penalties, then the logit bias (a new tensor when any applies)."""
    vocab = x.shape[1]
    h = p.host or p  # the decisions below read host arrays when they came along (no device sync)
    use_rep = (p.prompt_token_ids is not None or p.output_token_ids is not None) and bool(
        (h.repetition_penalty != 1).any()
    )
    use_out = p.output_token_ids is not None and bool(((h.frequency_penalty != 0) | (h.presence_penalty != 0)).any())
    if not (use_rep or use_out or p.logit_bias_ids is not None):
        return x
    counts = _token_counts(p.output_token_ids, vocab) if p.output_token_ids is not None else None
    if use_rep:
        seen = torch.zeros_like(x, dtype=torch.bool)
        if counts is not None:
            seen |= counts > 0
        if p.prompt_token_ids is not None:
            seen |= _token_counts(p.prompt_token_ids, vocab) > 0
        r = p.repetition_penalty.float()[:, None]
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    if use_out:
        x = x - p.frequency_penalty.float()[:, None] * counts
        x = x - p.presence_penalty.float()[:, None] * (counts > 0)
    if p.logit_bias_ids is not None:
        ids = p.logit_bias_ids.long()
        keep = ids >= 0
        bias = torch.where(keep, p.logit_bias_values.float(), 0.0)
        x = x.scatter_add(1, ids.clamp(min=0), bias)
    return x


def filter_logits(x: torch.Tensor, temperature, top_k, top_p, min_p, host=None) -> torch.Tensor:
    """Temperature, then min_p, top_k and top_p, each on the renormalised result of the one before.
    `host`: (top_k, top_p, min_p) of the same rows as NumPy arrays, which the choices of
    what to compute read instead of the device tensors."""
    vocab = x.shape[1]
    hk, hp, hm = host if host is not None else (top_k, top_p, min_p)
    x = x / temperature.float()[:, None]  # a fresh tensor: the filters below work in place
    if bool((hm > 0).any()):
        # prob >= min_p * max_prob  <=>  logit >= max_logit + log(min_p): no softmax needed.
        floor = x.max(dim=-1, keepdim=True).values + torch.log(min_p.float())[:, None]
        x.masked_fill_(x < floor, NEG_INF)
    hk_rows = (hk > 0) & (hk < vocab)
    few_left = None  # tokens left by top_k when it applied to every row: where top_p looks first
    if bool(hk_rows.any()):
        k_max = int(hk[hk_rows].max())
        k_rows = (top_k > 0) & (top_k < vocab)
        top = torch.topk(x, k_max, dim=-1).values
        kth = top.gather(1, (top_k.long().clamp(1, k_max) - 1)[:, None])
        # Ties at the k-th value all stay: the filter is a threshold, not a count.
        kth = torch.where(k_rows[:, None], kth, NEG_INF)
        x.masked_fill_(x < kth, NEG_INF)
        if bool(hk_rows.all()):
            few_left = k_max + 1  # one more shows whether a tie continues past the k-th
    num_p = int((hp < 1).sum())
    if num_p == x.shape[0]:
        x.masked_fill_(~top_p_mask(torch.softmax(x, dim=-1), top_p.float(), few_left), NEG_INF)
    elif num_p:
        p_rows = _row_ids(hp < 1, x.device)
        xs = x.index_select(0, p_rows)
        keep = top_p_mask(torch.softmax(xs, dim=-1), top_p.float().index_select(0, p_rows), few_left)
        x.index_copy_(0, p_rows, xs.masked_fill_(~keep, NEG_INF))
    return x


def gumbel_argmax(x: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """argmax(x + noise) per row, hashing the noise only of tokens that can win.

    The noise lies in [-2.86, 17.33] (24-bit uniforms), so a token more than
    that span below its row's best logit never wins; filtered (-inf) tokens
    never do either.
    """
    alive = x >= x.max(dim=-1, keepdim=True).values - GUMBEL_SPAN
    if avoid_host_reads(x.device) or int(torch.count_nonzero(alive)) * 4 >= x.numel():
        return gumbel_noise(seeds, steps, x.shape[1]).add_(x).argmax(dim=-1)
    r, c = torch.nonzero(alive, as_tuple=True)
    noisy = torch.full_like(x, NEG_INF)
    noisy[r, c] = x[r, c] + gumbel_noise_at(seeds, steps, r, c)
    return noisy.argmax(dim=-1)


def verify_drafts(z: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, seeds, steps):
    """Step 6 of `SamplingTensors` on sampled rows: (tokens, accepted). `z`: the
    rows' filtered logits; rows whose draft is -1 take the plain Gumbel argmax."""
    has = drafts >= 0
    rows = torch.nonzero(has).flatten()
    if rows.numel() < has.numel():
        tokens = gumbel_argmax(z, seeds, steps)  # rows without a draft (the others are replaced below)
        if not rows.numel():
            return tokens, has
        z, seeds, steps = z.index_select(0, rows), seeds.index_select(0, rows), steps.index_select(0, rows)
        drafts = drafts.index_select(0, rows)
        q = None if q is None else q.index_select(0, rows)
    d = drafts[:, None]
    p = torch.softmax(z.double(), dim=-1)  # float64, as the reference decides u * q(d) < p(d)
    q = torch.zeros_like(p).scatter_(1, d, 1.0) if q is None else q.double()
    ok = acceptance_uniforms(seeds, steps) * q.gather(1, d).squeeze(1) < p.gather(1, d).squeeze(1)
    residual = (p - q).clamp_(min=0)
    residual = torch.where((residual > 0).any(dim=-1, keepdim=True), residual, p)
    resampled = gumbel_noise(seeds, steps, z.shape[1]).double().add_(residual.log()).argmax(dim=-1)
    verified = torch.where(ok, drafts, resampled)
    if rows.numel() == has.numel():
        return verified, ok
    return tokens.index_copy(0, rows, verified), has.index_copy(0, rows, ok)


def sample(logits: torch.Tensor, params: SamplingTensors, mask_tokens=apply_token_bitmask) -> SampleOutput:
    """The torch `sample`; `mask_tokens(x, bitmask)` is the step a backend with
    its own kernel for the structured-output mask replaces (cuda: Triton)."""
    n, vocab = logits.shape
    raw = torch.log_softmax(logits.float(), dim=-1)
    x = apply_penalties(logits.float(), params)
    if params.token_bitmask is not None:
        x = mask_tokens(x, params.token_bitmask)
    greedy = params.temperature == 0
    host = params.host
    host_greedy = host.temperature == 0 if host is not None else greedy
    drafts = params.draft_token_ids
    tokens = torch.zeros(n, dtype=torch.int64, device=logits.device)
    if bool(host_greedy.any()):
        tokens = x.argmax(dim=-1)  # documented to return the first maximum
    accepted = None if drafts is None else greedy & (drafts.long() == tokens)
    num_sampled = int((~host_greedy).sum())
    if num_sampled:
        every_row = num_sampled == n  # then row selection would only copy
        rows = None if every_row else _row_ids(~host_greedy, logits.device)
        pick = (lambda t: t) if every_row else (lambda t: t.index_select(0, rows))  # noqa: E731
        per_row = (params.temperature, params.top_k, params.top_p, params.min_p, params.seeds, params.steps)
        temperature, top_k, top_p, min_p, seeds, steps = map(pick, per_row)
        on_host = None
        if host is not None:
            keep = slice(None) if every_row else ~host_greedy
            on_host = (host.top_k[keep], host.top_p[keep], host.min_p[keep])
        z = filter_logits(pick(x), temperature, top_k, top_p, min_p, on_host)
        if drafts is None:
            sampled = gumbel_argmax(z, seeds, steps)
        else:
            probs = None if params.draft_probs is None else pick(params.draft_probs)
            sampled, ok = verify_drafts(z, pick(drafts).long(), probs, seeds, steps)
            accepted = ok if every_row else accepted.index_copy(0, rows, ok)
        tokens = sampled if every_row else tokens.index_copy(0, rows, sampled)
    out = SampleOutput(token_ids=tokens, logprobs=raw.gather(1, tokens[:, None]).squeeze(1), accepted=accepted)
    if params.max_num_logprobs > 0:
        out.top_logprobs, out.top_token_ids = topk_lowest_id(raw, min(params.max_num_logprobs, vocab))
        out.ranks = (raw > out.logprobs[:, None]).sum(dim=1) + 1
    return out
