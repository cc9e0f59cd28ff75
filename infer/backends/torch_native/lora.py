"""Batched LoRA (the `lora` primitive) with torch ops: every token's adapter in one step.

Two shapes of the same arithmetic (float32, rounded once into y):

* few tokens (decode): every adapter slot at once. One GEMM shrinks x by all
  slots' A (``[T, K] @ [K, P*S'*R]``), a one-hot of each token's slot keeps its
  own part, and one GEMM per slice against every slot's B of it
  (``[T, S'*R] @ [S'*R, n]``) adds them into y: a fixed handful of ops whatever
  the mix of adapters. The stacks' float32 layouts for this are cached on the
  stack tensors and rebuilt only when an adapter is written into a slot.
* long runs of one adapter (prefill chunks, on CPU where the indices are read
  for free): each run through its adapter's GEMMs on views of x and y.
* otherwise on CPU (decode): tokens grouped by slot, each group padded to the
  largest, through batched GEMMs over the slots (a gather in, a scatter-add out).
* many tokens otherwise: tokens grouped by slot, each group through its own
  adapter's two GEMMs, so the work is T rows, not T rows per slot.

Slot 0 (no adapter) is never read: the stacks are sliced from slot 1.
"""

from __future__ import annotations

import numpy as np
import torch

# Up to this many (token, slot) pairs the all-slots form runs; past it, groups by slot.
ALL_SLOTS_MAX = 2048
# On CPU, runs of one adapter at least this long on average go run by run.
RUN_MIN_TOKENS = 16


def lora(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, lora_indices: torch.Tensor,
         output_slices=None) -> torch.Tensor:
    t = x.shape[0]
    if t == 0 or lora_a.shape[0] < 2:
        return y
    slices = tuple(output_slices) if output_slices is not None else (y.shape[1],)
    plan = _plan(lora_indices, x.device, lora_a.shape[0] - 1)
    if plan.used == 0:
        return y
    if plan.bounds is not None:
        return _by_run(x, y, lora_a, lora_b, plan.host, plan.bounds, slices)
    if plan.host is not None:
        return _padded(x, y, lora_a, lora_b, plan, slices)
    if t * plan.used <= ALL_SLOTS_MAX:
        return _all_slots(x, y, lora_a, lora_b, plan.used, plan.keep, slices)
    return _by_slot(x, y, lora_a, lora_b, plan.idx, slices)


class _Plan:
    """What every lora call of a step derives from its indices, computed at its first call."""

    __slots__ = ("used", "idx", "host", "bounds", "_keep", "_pad")

    def __init__(self, lora_indices: torch.Tensor, device, slots: int):
        self.idx = lora_indices.to(device=device, dtype=torch.long)
        self.used, self.host, self.bounds, self._keep, self._pad = slots, None, None, None, None  # slots 1..used
        if device.type == "cpu":  # reading the indices costs nothing here
            self.host = self.idx.numpy()
            self.used = int(self.host.max(initial=0))
            starts = np.flatnonzero(np.diff(self.host)) + 1  # runs of one slot: a request's tokens are consecutive
            if self.used and len(starts) + 1 <= len(self.host) // RUN_MIN_TOKENS:
                self.bounds = np.concatenate(([0], starts, [len(self.host)]))

    @property
    def keep(self) -> torch.Tensor:
        """float32 [T, used]: one-hot of each token's slot (a zero row for slot 0)."""
        if self._keep is None:
            self._keep = (self.idx[:, None] == torch.arange(1, self.used + 1, device=self.idx.device)).float()
        return self._keep


    @property
    def pad(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([used * M] token of each (slot, place) with M the most tokens of one slot, 0 for a
        free place; float32 [used, M, 1] 1 where a token is): the tokens grouped by slot."""
        if self._pad is None:
            host, used = self.host, self.used
            counts = np.bincount(host, minlength=used + 1)[1:]
            width = int(counts.max())
            index, mask = np.zeros((used, width), np.int64), np.zeros((used, width, 1), np.float32)
            for s in range(used):
                rows = np.flatnonzero(host == s + 1)
                index[s, : len(rows)], mask[s, : len(rows)] = rows, 1.0
            self._pad = (torch.from_numpy(index.reshape(-1)), torch.from_numpy(mask))
        return self._pad


_step: list = [None, None]  # (the step's lora_indices tensor, its _Plan): every layer passes the same tensor


def _plan(lora_indices: torch.Tensor, device, slots: int) -> _Plan:
    if _step[0] is not lora_indices:
        _step[0], _step[1] = lora_indices, _Plan(lora_indices, device, slots)
    return _step[1]


def _by_run(x, y, lora_a, lora_b, slot, bounds, slices) -> torch.Tensor:
    """Each run of tokens with one adapter (a prefill chunk) through that adapter's two
    GEMMs, on views of x and y: nothing gathered or scattered."""
    p = len(slices)
    r = lora_a.shape[1] // p
    a, bs = _shrink_matrix(lora_a, p), _expand_matrices(lora_b, slices)
    out = y.float()
    for lo_t, hi_t in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        s = int(slot[lo_t])
        if s == 0:
            continue
        mid = x[lo_t:hi_t].float() @ a[:, s - 1].reshape(p * r, -1).T  # [n_tokens, P*R]
        lo = 0
        for i, (n, b) in enumerate(zip(slices, bs)):
            out[lo_t:hi_t, lo : lo + n].addmm_(mid[:, i * r : (i + 1) * r], b[(s - 1) * r : s * r])
            lo += n
    return out if out.dtype == y.dtype else out.to(y.dtype)


def _padded(x, y, lora_a, lora_b, plan: _Plan, slices) -> torch.Tensor:
    """Tokens grouped by slot (a slot's group padded to the largest) through batched
    GEMMs over the slots: each token meets only its own adapter. Free places hold
    token 0 with a zero mid, so they add exact zeros."""
    index, mask = plan.pad
    used, width = mask.shape[:2]
    p = len(slices)
    r = lora_a.shape[1] // p
    xs = x.index_select(0, index).float().view(used, width, -1)
    mid = torch.bmm(xs, _shrink_t(lora_a)[:used]).mul_(mask)  # [used, M, P*R]
    deltas = [torch.bmm(mid[:, :, i * r : (i + 1) * r], b[:used]) for i, b in enumerate(_expand_t(lora_b, slices))]
    delta = deltas[0] if p == 1 else torch.cat(deltas, dim=2)
    out = y.float()
    out.index_add_(0, index, delta.view(used * width, -1))
    return out if out.dtype == y.dtype else out.to(y.dtype)


def _shrink_t(lora_a: torch.Tensor) -> torch.Tensor:
    """float32 [S-1, K, P*R]: slots 1.., transposed for x @ A.T."""
    return _cached(lora_a, "shrink_t", lambda: lora_a[1:].float().transpose(1, 2).contiguous())


def _expand_t(lora_b: torch.Tensor, slices) -> list[torch.Tensor]:
    """Per slice, float32 [S-1, R, n]: slots 1.., transposed for mid @ B.T."""

    def build():
        b, out, lo = lora_b[1:].float(), [], 0
        for n in slices:
            out.append(b[:, lo : lo + n, :].transpose(1, 2).contiguous())
            lo += n
        return out

    return _cached(lora_b, ("expand_t", tuple(slices)), build)


def _all_slots(x, y, lora_a, lora_b, used, keep, slices) -> torch.Tensor:
    """Slots 1..used at once (`keep`: each token's one-hot slot). The stacks are laid out
    once per adapter change (`_shrink_matrix`, `_expand_matrices`, float32) so that one
    GEMM shrinks by every slot's A of every slice, the one-hot keeps each token's own,
    and one GEMM per slice expands against every slot's B of that slice."""
    p = len(slices)
    r, k = lora_a.shape[1] // p, lora_a.shape[2]
    a = _shrink_matrix(lora_a, p)[:, :used].reshape(p * used * r, k)  # a view when every slot is used
    mid = x.float() @ a.T  # [T, P*used*R], ordered (slice, slot, rank)
    mid = mid.view(-1, p, used, r).mul_(keep[:, None, :, None]).view(-1, p, used * r)
    out = y.float()  # y itself when float32: the contract lets us write into it
    lo = 0
    for i, (n, b) in enumerate(zip(slices, _expand_matrices(lora_b, slices))):
        out[:, lo : lo + n].addmm_(mid[:, i], b[: used * r])
        lo += n
    return out if out.dtype == y.dtype else out.to(y.dtype)


def _cached(t: torch.Tensor, what, build):
    """A derived layout of a stack, kept on the stack tensor itself and rebuilt when the
    stack changed (an adapter written into a slot bumps the tensor's version counter)."""
    cache = t.__dict__.setdefault("_infer_lora_layouts", {})
    hit = cache.get(what)
    if hit is None or hit[0] != t._version:
        hit = cache[what] = (t._version, build())
    return hit[1]


def _shrink_matrix(lora_a: torch.Tensor, p: int) -> torch.Tensor:
    """float32 [P, S-1, R, K]: the A of slots 1.. grouped by slice."""

    def build():
        s, pr, k = lora_a.shape
        return lora_a[1:].float().view(s - 1, p, pr // p, k).transpose(0, 1).contiguous()

    return _cached(lora_a, ("shrink", p), build)


def _expand_matrices(lora_b: torch.Tensor, slices) -> list[torch.Tensor]:
    """Per slice, float32 [(S-1)*R, n]: rows (slot, rank) of slots 1.., that slice's columns."""

    def build():
        b, out, lo = lora_b[1:].float(), [], 0
        for n in slices:
            out.append(b[:, lo : lo + n, :].transpose(1, 2).reshape(-1, n).contiguous())
            lo += n
        return out

    return _cached(lora_b, ("expand", tuple(slices)), build)


def _by_slot(x, y, lora_a, lora_b, idx, slices) -> torch.Tensor:
    out = y.float()
    p = len(slices)
    r = lora_a.shape[1] // p
    order = torch.argsort(idx, stable=True)
    counts = torch.bincount(idx, minlength=lora_a.shape[0]).tolist()
    start = counts[0]
    for s in range(1, lora_a.shape[0]):
        n_rows = counts[s]
        if not n_rows:
            continue
        rows = order[start : start + n_rows]
        start += n_rows
        mid = x.index_select(0, rows).float() @ lora_a[s].float().T  # [n_rows, P*R]
        lo = 0
        for i, n in enumerate(slices):
            delta = mid[:, i * r : (i + 1) * r] @ lora_b[s, lo : lo + n].float().T
            out[rows, lo : lo + n] += delta
            lo += n
    return out.to(y.dtype)
