"""Routed experts: softmax top-k gating, then each expert on only its tokens.

The T*top_k (token, choice) pairs are sorted by expert, and the token rows
gathered once in that order. Two ways to run the experts over them:

- grouped: each expert that got tokens runs one GEMM pair over its contiguous
  slice of the sorted rows. No expert computes a token it was not routed and
  no unused expert's weights are read, but it is 4 ops per expert.
- padded: when every expert got tokens and the largest group is at most
  twice the mean, the groups are padded to one size and all experts run as
  two batched GEMMs. At most 2x the routed rows are computed (still
  proportional to top_k, not to E), in a constant number of ops: small
  per-expert GEMMs lose to one big batched one, and on a busy CPU every
  parallel op can stall on a descheduled thread.

MXFP4 expert stacks (`Mxfp4Weight`) run grouped, each routed expert's two
matrices dequantized into x's dtype for that step only (the stack stays in
its 4.25 bits a value).

A step of at most a GEMV's rows in bfloat16 (decode) runs grouped with each
projection through the native bf16 GEMV instead (`fast_paths.moe`): torch's
bf16 GEMM streams a weight several times slower at a few rows.

The combine un-sorts the rows and takes each token's gate-weighted sum of its
top_k rows as one batched product (no scatter-add, so the result does not
depend on thread timing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...primitives.types import WeightHandle
from . import mxfp4


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, routed_scaling_factor=None,
          scoring_func=None, routing_bias=None, expert_groups=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [T, k] int64, float32 weights [T, k]), lowest expert id first on ties;
    the routing cpu_ref's `route` defines."""
    logits = router_logits.float()
    probs = torch.sigmoid(logits) if scoring_func == "sigmoid" else torch.softmax(logits, dim=-1)
    # torch.topk does not promise which of equal values it returns; a stable
    # descending sort does (E is small, so the full sort costs nothing).
    if routing_bias is None and expert_groups is None:
        weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
        weights, ids = weights[:, :top_k], ids[:, :top_k]
    else:
        choice = probs if routing_bias is None else probs + routing_bias.float()
        if expert_groups is not None:
            groups, keep, kind = expert_groups
            g = choice.reshape(len(choice), groups, -1)
            score = g.amax(dim=-1) if kind == "max" else torch.sort(g, dim=-1).values[..., -2:].sum(dim=-1)
            kept = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :keep]
            mask = torch.zeros_like(score, dtype=torch.bool).scatter_(1, kept, True)
            choice = choice.masked_fill(~mask.repeat_interleave(g.shape[-1], dim=-1), float("-inf"))
        ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
        weights = probs.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if routed_scaling_factor is not None:
        weights = weights * routed_scaling_factor
    return ids, weights


@dataclass(frozen=True, slots=True)
class ExpertForm:
    """What an expert computes besides its two weights: biases and the gated activation."""

    w13_bias: torch.Tensor | None = None  # [E, 2I]
    w2_bias: torch.Tensor | None = None  # [E, H]
    activation: str | None = None  # None / 'silu': SwiGLU; 'swiglu_oai': gpt-oss's clamped form
    alpha: float = 1.702
    limit: float = 7.0

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        inter = gate_up.shape[-1] // 2
        gate, up = gate_up[..., :inter], gate_up[..., inter:]
        if self.activation != "swiglu_oai":
            return F.silu(gate) * up
        # In float32, rounded once: the clamp lets values reach the limit squared.
        gate, up = gate.float().clamp(max=self.limit), up.float().clamp(-self.limit, self.limit)
        return ((up + 1) * (gate * torch.sigmoid(gate * self.alpha))).to(gate_up.dtype)


_SWIGLU = ExpertForm()


class _DequantizedExperts:
    """A quantized stack of experts (`Mxfp4Weight` [E, N, K]) read like a dense one: indexing
    one expert dequantizes its matrix, in the activations' dtype, for that use only.

    `linear` is the product with one expert: on CPU the expert as the int8 groups it equals,
    packed for the native integer GEMM (its 25 codes in 5 bits, fp16 scales where exact: 0.69
    bytes a value) the first time it runs and kept in the handle's `prepared` list, over its rows in
    chunks of the kernel's; without the kernel, dequantized."""

    def __init__(self, w, dtype: torch.dtype):
        self.w, self.dtype = w, dtype
        self.shape = (*w.qweight.shape[:-2], w.out_features, w.in_features)

    def __getitem__(self, e: int) -> torch.Tensor:
        return mxfp4.dequantize(self.w.qweight[e], self.w.scales[e], self.dtype)

    def linear(self, x: torch.Tensor, e: int) -> torch.Tensor:
        from .native import ops as native

        if x.shape[0] > 0 and x.device.type == "cpu":
            if self.w.prepared is None:
                self.w.prepared = [None] * self.shape[0]
            p = self.w.prepared[e]
            if p is None:
                g = mxfp4.as_int8_groups(type(self.w)(self.w.qweight[e], self.w.scales[e]))
                p = self.w.prepared[e] = native.int8_prepare(g.qweight, g.scales, None, 32) or False
            if p is not False:
                # More rows (prefill) in chunks of the kernel's rows: each chunk streams the
                # packed expert again, still far faster than dequantizing it (measured: 64
                # tokens of a gpt-oss-20b layer 2.5 s dequantized).
                step = native.INT8_GEMM_MAX_ROWS
                parts = [native.int8_gemm_prepared(x[i:i + step].contiguous(), p) for i in range(0, x.shape[0], step)]
                if all(y is not None for y in parts):
                    return parts[0] if len(parts) == 1 else torch.cat(parts)
        return F.linear(x, self[e])


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, gemv) -> torch.Tensor:
    """x @ w.T (+ b) through `gemv(x, w)` where it gives a result, else torch's; the bias added after."""
    y = None if gemv is None else gemv(x, w)
    if y is None:
        return F.linear(x, w, b)
    return y if b is None else y + b


def _experts(x_sorted: torch.Tensor, counts: list[int], w13: torch.Tensor, w2: torch.Tensor,
             form: ExpertForm = _SWIGLU, gemv=None) -> torch.Tensor:
    """Each expert's gated MLP over its slice of the expert-sorted rows, in x's dtype."""
    y = torch.empty(x_sorted.shape[0], w2.shape[1], dtype=x_sorted.dtype, device=x_sorted.device)
    b13, b2 = form.w13_bias, form.w2_bias
    start = 0
    quantized = isinstance(w13, _DequantizedExperts)
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = slice(start, start + n)
        if quantized:
            h = w13.linear(x_sorted[rows], e)
            h = form.act(h if b13 is None else h + b13[e].to(h.dtype))
            y[rows] = w2.linear(h, e) if b2 is None else w2.linear(h, e) + b2[e].to(h.dtype)
            start += n
            continue
        h = form.act(_linear(x_sorted[rows], w13[e], None if b13 is None else b13[e].to(x_sorted.dtype), gemv))
        if b2 is None and gemv is None:
            torch.mm(h, w2[e].t(), out=y[rows])
        else:
            y[rows] = _linear(h, w2[e], None if b2 is None else b2[e].to(h.dtype), gemv)
        start += n
    return y


def _experts_padded(x_sorted: torch.Tensor, sorted_ids: torch.Tensor, counts: torch.Tensor, largest: int,
                    w13: torch.Tensor, w2: torch.Tensor, form: ExpertForm = _SWIGLU) -> torch.Tensor:
    """The same as `_experts`, with groups zero-padded to `largest` rows and
    each projection one batched GEMM over the experts."""
    num_experts, two_i, hidden = w13.shape
    # Row j of the sorted rows is row `slot[j]` of its expert's group.
    slot = torch.arange(x_sorted.shape[0], device=x_sorted.device) - (torch.cumsum(counts, 0) - counts)[sorted_ids]
    groups = x_sorted.new_zeros(num_experts, largest, hidden)
    groups[sorted_ids, slot] = x_sorted
    gate_up = torch.bmm(groups, w13.transpose(1, 2))
    if form.w13_bias is not None:
        gate_up += form.w13_bias.to(gate_up.dtype)[:, None]
    y = torch.bmm(form.act(gate_up), w2.transpose(1, 2))
    if form.w2_bias is not None:
        y += form.w2_bias.to(y.dtype)[:, None]
    return y[sorted_ids, slot]


def moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str | None = None,
    swiglu_alpha: float | None = None,
    swiglu_limit: float | None = None,
    routed_scaling_factor: float | None = None,
    scoring_func: str | None = None,
    routing_bias: torch.Tensor | None = None,
    expert_groups: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return routed_moe(None, x, router_logits, w13, w2, top_k, renormalize, shared, shared_gate, w13_bias, w2_bias,
                      activation, swiglu_alpha, swiglu_limit, routed_scaling_factor, scoring_func, routing_bias,
                      expert_groups)


def routed_moe(gemv, x, router_logits, w13, w2, top_k, renormalize, shared=None, shared_gate=None, w13_bias=None,
               w2_bias=None, activation=None, swiglu_alpha=None, swiglu_limit=None, routed_scaling_factor=None,
               scoring_func=None, routing_bias=None, expert_groups=None) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe` with each expert's projections through `gemv(x, w)` (None: torch's GEMMs, and the
    padded form where it applies)."""
    num_tokens, hidden = x.shape
    num_experts = router_logits.shape[1]
    quantized = isinstance(w13, WeightHandle)
    if quantized:  # MXFP4 experts: each routed one dequantized as it runs (grouped, never padded)
        w13, w2 = _DequantizedExperts(w13, x.dtype), _DequantizedExperts(w2, x.dtype)
    ids, weights = route(router_logits, top_k, renormalize, routed_scaling_factor, scoring_func, routing_bias,
                         expert_groups)
    flat_ids = ids.flatten()
    tokens_per_expert = torch.bincount(flat_ids, minlength=num_experts).long()
    order = torch.argsort(flat_ids, stable=True)
    x_sorted = x.index_select(0, order // top_k)
    # One host sync per call: slice bounds and the choice of path need Python ints.
    counts = tokens_per_expert.tolist()
    form = _SWIGLU
    if w13_bias is not None or w2_bias is not None or activation not in (None, "silu"):
        form = ExpertForm(w13_bias, w2_bias, activation, float(swiglu_alpha or 0.0), float(swiglu_limit or 0.0))
    if gemv is None and not quantized and min(counts) > 0 and max(counts) * num_experts <= 2 * len(flat_ids):
        y_sorted = _experts_padded(x_sorted, flat_ids[order], tokens_per_expert, max(counts), w13, w2, form)
    else:
        y_sorted = _experts(x_sorted, counts, w13, w2, form, gemv)
    # Row j of the sorted buffer is (token, choice) pair order[j]: put it back.
    y = torch.empty_like(y_sorted)
    y.index_copy_(0, order, y_sorted)
    out = torch.bmm(weights.unsqueeze(1), y.view(num_tokens, top_k, hidden).float()).squeeze(1)
    if shared is not None:
        s = shared.float()
        out += s if shared_gate is None else torch.sigmoid(shared_gate.float()) * s
    return out.to(x.dtype), tokens_per_expert
