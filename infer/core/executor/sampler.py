"""Sampling on the rank that holds a step's logits, draft verification with it.

The engine builds a step's `SamplingInput` on the host (`core/sampling_batch.py`:
per sampled row its parameters, seed, penalties' histories, grammar mask and,
in a step that verifies drafts, the draft the row checks); the worker runs the
forward and hands the logits here. The backend's `sample` primitive samples every
row and accepts or rejects each draft (min(1, p/q), else a token of the residual
distribution); `Sampler` then keeps, of each request that verified drafts, its
accepted drafts and the token after them, and returns host arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...primitives.types import SamplingTensors


@dataclass
class SamplingInput:
    """What sampling a step needs beyond its logits, all on the host.

    rows    the logits row of each sampled row (a forked request samples the
            parent's row again); None: sampled row i is logits row i.
    groups  (first row, number of drafts) of each request verifying drafts,
            its rows consecutive: the row before each draft, then the bonus row.
    keep_logits  hold the step's logits for `Sampler.resample` (grammar rows
            sampled without their mask first).
    """

    tensors: SamplingTensors
    rows: np.ndarray | None = None
    groups: tuple[tuple[int, int], ...] = ()
    keep_logits: bool = False


@dataclass
class ModelRunnerOutput:
    """A step's sampled rows, host arrays (`StepOutput`'s, without request ids).

    kept      with drafts, the sampled rows requests take (each group's accepted
              drafts and the token after them), ascending; None: every row.
    accepted  per group of `SamplingInput.groups`, its accepted drafts.
    non_finite  the sampled rows (before `kept`) whose logits held nan or inf
              (their logprob is nan): a token sampled there is garbage.
    """

    token_ids: np.ndarray
    logprobs: np.ndarray
    ranks: np.ndarray | None = None
    top_token_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    kept: np.ndarray | None = None
    accepted: tuple[int, ...] = ()
    non_finite: np.ndarray | None = None


class Sampler:
    def __init__(self, backend, ops):
        self.backend = backend
        self._sample = ops.bind("sample", "sampler")
        self._logits: Any = None  # the last step's rows, when it asked to keep them

    def __call__(self, logits, s: SamplingInput) -> ModelRunnerOutput:
        be = self.backend
        if not len(s.tensors.temperature):  # every row's request was aborted while its step ran
            return ModelRunnerOutput(np.zeros(0, np.int64), np.zeros(0, np.float32))
        if s.rows is not None:
            logits = logits[be.asarray(s.rows)]
        self._logits = logits if s.keep_logits else None
        out = self._sample(logits, be.prepare_sampling(s.tensors))
        host = (lambda x: be.to_numpy(x) if x is not None else None)  # noqa: E731
        result = ModelRunnerOutput(host(out.token_ids), host(out.logprobs), host(out.ranks), host(out.top_token_ids),
                                   host(out.top_logprobs))
        bad = np.flatnonzero(np.isnan(np.asarray(result.logprobs, dtype=np.float64)))
        result.non_finite = bad if bad.size else None
        return _verified(result, s.groups, host(out.accepted)) if s.groups else result

    def resample(self, rows: np.ndarray, tensors: SamplingTensors) -> ModelRunnerOutput:
        """Rows of the last step's logits (kept by `keep_logits`) sampled again under new tensors."""
        be = self.backend
        out = self._sample(self._logits[be.asarray(rows)], be.prepare_sampling(tensors))
        return ModelRunnerOutput(be.to_numpy(out.token_ids), be.to_numpy(out.logprobs),
                                 be.to_numpy(out.ranks) if out.ranks is not None else None)


def _verified(out: ModelRunnerOutput, groups, accepted: np.ndarray) -> ModelRunnerOutput:
    """The rows requests take from a step that verified drafts: of each group, its
    leading accepted drafts and the row after them."""
    keep = np.ones(len(out.token_ids), dtype=bool)
    counts = []
    for first, k in groups:
        a = 0
        while a < k and accepted[first + a]:
            a += 1
        keep[first + a + 1 : first + k + 1] = False
        counts.append(a)
    idx = np.flatnonzero(keep)
    pick = (lambda x: None if x is None else np.asarray(x)[idx])  # noqa: E731
    return ModelRunnerOutput(pick(out.token_ids), pick(out.logprobs), pick(out.ranks), pick(out.top_token_ids),
                             pick(out.top_logprobs), idx, tuple(counts), out.non_finite)
