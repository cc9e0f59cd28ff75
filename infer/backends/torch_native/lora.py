"""Batched LoRA (the `lora` primitive) with torch ops: every token's adapter in one step.

The step's slot indices are read on the host once per step (every layer's calls
get the same tensor: `_plan`; free on CPU, one sync on an accelerator) and
decide between two shapes of the same arithmetic (float32, rounded once into y):

* long runs of one adapter (prefill chunks: a request's tokens are
  consecutive): each run through its adapter's two GEMMs on views of x and y,
  nothing gathered or scattered.
* otherwise (decode): tokens grouped by slot, each group padded to the largest,
  through one batched GEMM over the slots for the shrink and one for the
  expand (every output slice at once against a block-diagonal B), a gather in
  and a gather back: a fixed handful of ops whatever the mix of adapters, and
  each token meets only its own adapter.

The stacks' float32 layouts for this are cached on the stack tensors and
rebuilt only when an adapter is written into a slot. Slot 0 (no adapter) is
never read: the layouts hold slots 1.. only.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

# Runs of one adapter at least this long on average go run by run.
RUN_MIN_TOKENS = 16


def lora(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, lora_indices: torch.Tensor,
         output_slices=None) -> torch.Tensor:
    if x.shape[0] == 0 or lora_a.shape[0] < 2:
        return y
    slices = tuple(output_slices) if output_slices is not None else (y.shape[1],)
    plan = _plan(lora_indices, x.device)
    if plan.used == 0:
        return y
    if plan.bounds is not None:
        return _by_run(x, y, lora_a, lora_b, plan, slices)
    return _padded(x, y, lora_a, lora_b, plan, slices)


class _Plan:
    """What every lora call of a step derives from its indices, computed at its first call."""

    __slots__ = ("host", "used", "bounds", "device", "_pad")

    def __init__(self, lora_indices: torch.Tensor, device):
        self.host = lora_indices.cpu().numpy().astype(np.int64)  # the step's one host read
        self.used = int(self.host.max(initial=0))  # slots 1..used hold the step's adapters
        self.device, self._pad, self.bounds = device, None, None
        starts = np.flatnonzero(np.diff(self.host)) + 1
        if self.used and len(starts) + 1 <= len(self.host) // RUN_MIN_TOKENS:
            self.bounds = np.concatenate(([0], starts, [len(self.host)])).tolist()

    @property
    def pad(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tokens grouped by slot, each group padded to M places: ([used * M] the token at
        each place, token 0 at a free one; float32 [used, M, 1] 1 where a token is; [T] the
        place of each token, a free place for a token without adapter)."""
        if self._pad is None:
            host, used = self.host, self.used
            counts = np.bincount(host, minlength=used + 1)
            # A token without adapter reads a free place: make sure there is one.
            width = int(counts[1:].max()) + int(counts[0] > 0 and (counts[1:] == counts[1:].max()).all())
            index, mask = np.zeros((used, width), np.int64), np.zeros((used, width, 1), np.float32)
            place = np.full(len(host), used * width - 1, np.int64)
            for s in range(used):
                rows = np.flatnonzero(host == s + 1)
                index[s, : len(rows)], mask[s, : len(rows)] = rows, 1.0
                place[rows] = s * width + np.arange(len(rows))
            if counts[0]:
                place[host == 0] = int(np.flatnonzero(mask.reshape(-1) == 0)[0])
            self._pad = tuple(torch.from_numpy(a).to(self.device) for a in (index.reshape(-1), mask, place))
        return self._pad


# Per engine thread (replicas and served models each step on their own): the step's
# lora_indices tensor, which every layer's calls pass, and its _Plan.
_steps = threading.local()


def _plan(lora_indices: torch.Tensor, device) -> _Plan:
    held = getattr(_steps, "held", None)
    if held is None or held[0] is not lora_indices:
        held = _steps.held = (lora_indices, _Plan(lora_indices, device))
    return held[1]


def _by_run(x, y, lora_a, lora_b, plan: _Plan, slices) -> torch.Tensor:
    """Each run of tokens with one adapter through that adapter's GEMMs, on views of x and y."""
    p = len(slices)
    r = lora_a.shape[1] // p
    a, bs = _shrink_t(lora_a), _expand_t(lora_b, slices)
    out = y.float()  # y itself when float32: the contract lets us write into it
    for lo_t, hi_t in zip(plan.bounds[:-1], plan.bounds[1:]):
        s = int(plan.host[lo_t])
        if s == 0:
            continue
        mid = x[lo_t:hi_t].float() @ a[s - 1]  # [n_tokens, P*R]
        lo = 0
        for i, (n, b) in enumerate(zip(slices, bs)):
            out[lo_t:hi_t, lo : lo + n].addmm_(mid[:, i * r : (i + 1) * r], b[s - 1])
            lo += n
    return out if out.dtype == y.dtype else out.to(y.dtype)


def _padded(x, y, lora_a, lora_b, plan: _Plan, slices) -> torch.Tensor:
    """Tokens grouped by slot (a slot's group padded to the largest) through one batched GEMM
    over the slots for the shrink and one for the expand (every slice at once against a
    block-diagonal B), then each token's row picked back: gathers only, no scatter. Free
    places have a zero mid, so their rows (read by tokens without adapter) are exact zeros."""
    index, mask, place = plan.pad
    used, width = mask.shape[:2]
    xs = x.index_select(0, index).float().view(used, width, -1)
    mid = torch.bmm(xs, _shrink_t(lora_a)[:used]).mul_(mask)  # [used, M, P*R]
    delta = torch.bmm(mid, _expand_blocks(lora_b, slices)[:used])  # [used, M, N]
    out = y.float()  # y itself when float32: the contract lets us write into it
    out.add_(delta.view(used * width, -1).index_select(0, place))
    return out if out.dtype == y.dtype else out.to(y.dtype)


def _expand_blocks(lora_b: torch.Tensor, slices) -> torch.Tensor:
    """float32 [S-1, P*R, N]: slots 1.., each slice's B transposed in its own rows and columns."""

    def build():
        b = lora_b[1:].float()
        s, n, r = b.shape
        out = torch.zeros(s, len(slices) * r, n, dtype=torch.float32, device=b.device)
        lo = 0
        for i, width in enumerate(slices):
            out[:, i * r : (i + 1) * r, lo : lo + width] = b[:, lo : lo + width, :].transpose(1, 2)
            lo += width
        return out

    return _cached(lora_b, ("expand_blocks", tuple(slices)), build)


def _cached(t: torch.Tensor, what, build):
    """A derived layout of a stack, kept on the stack tensor itself and rebuilt when the
    stack changed (an adapter written into a slot bumps the tensor's version counter)."""
    cache = t.__dict__.setdefault("_infer_lora_layouts", {})
    hit = cache.get(what)
    if hit is None or hit[0] != t._version:
        hit = cache[what] = (t._version, build())
    return hit[1]


def _shrink_t(lora_a: torch.Tensor) -> torch.Tensor:
    """float32 [S-1, K, P*R]: slots 1.., transposed for x @ A.T."""
    return _cached(lora_a, "shrink_t", lambda: lora_a[1:].float().transpose(1, 2).contiguous())


def _expand_t(lora_b: torch.Tensor, slices) -> list[torch.Tensor]:
    """Per output slice, float32 [S-1, R, n]: slots 1.., transposed for mid @ B.T."""

    def build():
        b, out, lo = lora_b[1:].float(), [], 0
        for n in slices:
            out.append(b[:, lo : lo + n, :].transpose(1, 2).contiguous())
            lo += n
        return out

    return _cached(lora_b, ("expand_t", tuple(slices)), build)
