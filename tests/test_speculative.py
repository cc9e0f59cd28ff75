"""Speculative decoding: the draft verification of `sample` (step 6 of
SamplingTensors) follows the target distribution whatever the drafter proposes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from infer.backends.cpu_ref.backend import CpuRefBackend
from infer.backends.torch_native.backend import TorchBackend
from infer.primitives.types import SamplingTensors

V = 8
# The 0.999 quantile of the chi-square distribution with V - 1 = 7 degrees of freedom.
CHI2_7_999 = 24.32


def _params(n: int, temperature: float, drafts: np.ndarray, q: np.ndarray | None, seed: int) -> SamplingTensors:
    rng = np.random.default_rng(seed)
    return SamplingTensors(
        temperature=np.full(n, temperature, np.float32), top_k=np.zeros(n, np.int32), top_p=np.ones(n, np.float32),
        min_p=np.zeros(n, np.float32), seeds=rng.integers(-(2**62), 2**62, n).astype(np.int64),
        steps=rng.integers(0, 1000, n).astype(np.int64), presence_penalty=np.zeros(n, np.float32),
        frequency_penalty=np.zeros(n, np.float32), repetition_penalty=np.ones(n, np.float32),
        draft_token_ids=drafts, draft_probs=None if q is None else np.tile(q.astype(np.float32), (n, 1)))


def _chi2(counts: np.ndarray, p: np.ndarray) -> float:
    expected = counts.sum() * p
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("backend, n", [(TorchBackend(), 40000), (CpuRefBackend(), 6000)], ids=["torch", "cpu_ref"])
@pytest.mark.parametrize("drafter", ["probs", "onehot"])
def test_verified_tokens_follow_the_target_distribution(backend, n, drafter):
    rng = np.random.default_rng(11)
    logits = rng.standard_normal(V).astype(np.float32) * 1.5
    p = np.exp(logits - logits.max())
    p /= p.sum()
    if drafter == "probs":  # a drafter that disagrees with the target
        q = rng.dirichlet(np.full(V, 0.7))
        drafts = rng.choice(V, n, p=q).astype(np.int64)
    else:  # n-gram: always proposes the same token, q one-hot there
        q, drafts = None, np.full(n, int(np.argsort(p)[-2]), np.int64)
    params = _params(n, 1.0, drafts, q, seed=5)
    out = backend.sample(backend.asarray(np.tile(logits, (n, 1))), backend.prepare_sampling(params))
    tokens, accepted = backend.to_numpy(out.token_ids), backend.to_numpy(out.accepted)
    counts = np.bincount(tokens, minlength=V).astype(np.float64)
    assert _chi2(counts, p) < CHI2_7_999, (counts / n, p)
    # Acceptance is min(1, p/q) per draft: sum(min(p, q)) on average.
    q_full = np.eye(V)[drafts[0]] if q is None else q
    want = np.minimum(p, q_full).sum()
    assert abs(accepted.mean() - want) < 4 * np.sqrt(want * (1 - want) / n) + 1e-9
    assert (tokens[accepted] == drafts[accepted]).all()


def test_a_rejected_one_hot_draft_is_never_returned():
    """q one-hot at d: the residual max(p - q, 0) has no mass at d."""
    rng = np.random.default_rng(2)
    n = 4000
    logits = np.tile(rng.standard_normal(V).astype(np.float32), (n, 1))
    be = TorchBackend()
    out = be.sample(torch.from_numpy(logits), be.prepare_sampling(_params(n, 0.8, np.full(n, 3, np.int64), None, seed=9)))
    tokens, accepted = out.token_ids.numpy(), out.accepted.numpy()
    assert 0 < accepted.mean() < 1
    assert (tokens[~accepted] != 3).all() and (tokens[accepted] == 3).all()


def test_greedy_rows_accept_exactly_their_argmax_and_rows_without_drafts_sample_as_usual():
    rng = np.random.default_rng(4)
    n = 64
    logits = rng.standard_normal((n, 50)).astype(np.float32)
    best = logits.argmax(1)
    drafts = np.where(np.arange(n) % 2 == 0, best, (best + 1) % 50).astype(np.int64)
    drafts[::5] = -1
    temps = np.where(np.arange(n) % 3 == 0, 0.0, 0.9).astype(np.float32)
    for backend in (TorchBackend(), CpuRefBackend()):
        params = _params(n, 0.0, drafts, None, seed=1)
        params.temperature = temps
        out = backend.sample(backend.asarray(logits), backend.prepare_sampling(params))
        plain = backend.sample(backend.asarray(logits), backend.prepare_sampling(
            SamplingTensors(**{**{f: getattr(params, f) for f in SamplingTensors.__dataclass_fields__},
                               "draft_token_ids": None})))
        tokens, accepted = backend.to_numpy(out.token_ids), backend.to_numpy(out.accepted)
        greedy = temps == 0
        assert (accepted[greedy] == (drafts[greedy] == best[greedy])).all()
        assert (tokens[greedy] == best[greedy]).all()
        none = drafts < 0
        assert not accepted[none].any()
        assert (tokens[none] == backend.to_numpy(plain.token_ids)[none]).all()
        assert plain.accepted is None
