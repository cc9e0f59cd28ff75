"""The filters and penalties of `sample` at their exact boundaries, on every
available backend (cpu_ref included), against results worked out by hand from
the contract in `SamplingTensors` (not from cpu_ref):

- top_p keeps each token whose *preceding* cumulative probability is < top_p;
- top_k keeps every token tied with the k-th largest logit;
- min_p keeps tokens with prob >= min_p * max prob, measured after temperature;
- each filter sees the renormalised result of the one before;
- repetition divides positive / multiplies negative logits of tokens seen
  (once, however often), frequency subtracts per occurrence, presence once,
  logit_bias adds up over repeated ids, after the penalties.

Tied logits give exactly representable probabilities (1/4, 1/2), so a
boundary is hit exactly rather than within rounding. The kept set is observed
as the set of tokens sampled by ROWS rows that differ only in their seed: every
kept token is drawn by some row, no other token ever is.

On the host side: SamplingParams' validation boundaries, and the -1 padding of
the token histories the penalties read.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from infer.core.request import Request
from infer.core.sampling_batch import build_sampling_tensors
from infer.core.sampling_params import SamplingParams
from infer.dispatch import Ops
from infer.primitives.types import SamplingTensors
from infer.registry import get_backend, registry
from infer.testing import calls

AVAILABLE = sorted(name for name, info in registry().backends.items() if info.available)
ROWS = 96
NEG = -8.0  # far enough below the rest that no filter here keeps it

# name: (logits, temperature, top_k, top_p, min_p, kept token ids)
CASES = {
    # 4 ties: probs 1/4 each, preceding mass 0, 1/4, 1/2, 3/4.
    "top_p_half_of_four_ties_keeps_two": ([1.5] * 4, 0.7, 0, 0.5, 0.0, {0, 1}),
    "top_p_quarter_of_four_ties_keeps_one": ([1.5] * 4, 1.3, 0, 0.25, 0.0, {0}),
    "top_p_just_over_a_half_keeps_three": ([1.5] * 4, 0.7, 0, 0.5 + 2**-20, 0.0, {0, 1, 2}),
    # top_k leaves the 4 ties, renormalised to 1/4 each, then top_p 3/4 keeps 3 of them.
    "top_k_then_top_p_on_the_renormalised_ties": ([2.0] * 4 + [1.9, 1.8, NEG, NEG], 1.5, 4, 0.75, 0.0, {0, 1, 2}),
    # The 2nd largest value is shared by ids 1..3: all stay.
    "top_k_keeps_every_tie_at_the_kth_value": ([4.0, 3.0, 3.0, 3.0, 2.9, NEG], 0.5, 2, 1.0, 0.0, {0, 1, 2, 3}),
    # prob == max prob sits exactly on the min_p = 1 boundary: kept.
    "min_p_one_keeps_the_tied_maximum": ([2.0, 2.0, 2.0, 1.9, NEG, NEG], 0.5, 0, 1.0, 1.0, {0, 1, 2}),
    # Runner-up ratio e^(-1/T): e^-2 = 0.14 at T = 0.5 (dropped by min_p 0.25), e^-1 = 0.37 before temperature.
    "min_p_after_a_low_temperature_drops_the_runner_up": ([0.0, -1.0, NEG, NEG, NEG], 0.5, 0, 1.0, 0.25, {0}),
    # At T = 2 the ratio is e^-0.5 = 0.61 (kept by min_p 0.5); before temperature e^-1 = 0.37.
    "min_p_after_a_high_temperature_keeps_the_runner_up": ([0.0, -1.0, NEG, NEG, NEG], 2.0, 0, 1.0, 0.5, {0, 1}),
    # min_p 0.3 at T = 2 keeps ids 0..2 (ratios 1, 0.61, 0.37, 0.22, 0.22); top_p 0.45 on their
    # renormalised probs (0.51, 0.31, 0.19) keeps id 0 alone; on all five (0.41, 0.25, ...) it would keep 0 and 1.
    "min_p_then_top_p_on_the_renormalised_survivors": ([0.0, -1.0, -2.0, -3.0, -3.0], 2.0, 0, 0.45, 0.3, {0}),
}


def sample(backend_name: str, logits, rows: int, **params) -> np.ndarray:
    """The tokens `rows` copies of one logits row get, with per-row seeds 11, 7930, ..."""
    def ids(values):  # one id row, -1 padded as the contract wants, or None
        return None if values is None else np.tile(np.asarray(values, np.int64), (rows, 1))

    full = lambda name, value, dtype: np.full(rows, params.get(name, value), dtype)  # noqa: E731
    bias = params.get("logit_bias")
    tensors = SamplingTensors(
        temperature=full("temperature", 1.0, np.float32), top_k=full("top_k", 0, np.int32),
        top_p=full("top_p", 1.0, np.float32), min_p=full("min_p", 0.0, np.float32),
        seeds=np.arange(rows, dtype=np.int64) * 7919 + 11, steps=np.zeros(rows, np.int64),
        presence_penalty=full("presence", 0.0, np.float32), frequency_penalty=full("frequency", 0.0, np.float32),
        repetition_penalty=full("repetition", 1.0, np.float32),
        prompt_token_ids=ids(params.get("prompt", [-1])), output_token_ids=ids(params.get("output", [-1])),
        logit_bias_ids=ids(None if bias is None else list(bias[0])),
        logit_bias_values=None if bias is None else np.tile(np.asarray(bias[1], np.float32), (rows, 1)),
    )
    backend = get_backend(backend_name)
    inputs = {"logits": np.tile(np.asarray(logits, np.float32), (rows, 1)), "params": tensors}
    h = calls.invoke(backend, Ops(backend), "sample", inputs, "float32")
    assert not h.problems, h.problems
    return h.outputs["token_ids"]


def sampled_tokens(backend_name: str, logits, temperature, top_k, top_p, min_p) -> set[int]:
    tokens = sample(backend_name, logits, ROWS, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    return set(tokens.tolist())


@pytest.mark.parametrize("backend", AVAILABLE)
@pytest.mark.parametrize("case", list(CASES))
def test_sampled_tokens_are_exactly_the_kept_set(backend, case):
    logits, temperature, top_k, top_p, min_p, kept = CASES[case]
    assert sampled_tokens(backend, logits, temperature, top_k, top_p, min_p) == kept


def test_the_cases_sit_on_the_boundaries_they_claim():
    """The arithmetic behind CASES, so a reader need not trust the comments."""
    assert 0.25 + 0.25 == 0.5 and 3 * 0.25 == 0.75  # tie probabilities are exact
    assert math.exp(-1 / 0.5) < 0.25 < math.exp(-1)  # low temperature: dropped only after it
    assert math.exp(-1) < 0.5 < math.exp(-1 / 2.0)  # high temperature: kept only after it
    ratios = np.exp(np.array([0.0, -1.0, -2.0, -3.0, -3.0]) / 2.0)
    assert list(ratios >= 0.3) == [True, True, True, False, False]
    assert ratios[0] / ratios[:3].sum() > 0.45 > ratios[0] / ratios.sum()


# name: (logits, penalties, the greedy token). Each margin is 0.1 or more, each wrong rule flips the token.
PENALTY_CASES = {
    # 2 - 0.4 = 1.6 beats 1.5; counted per occurrence it would be 2 - 0.8.
    "presence_counts_a_token_once": ([2.0, 1.5, 0.0], dict(output=[0, 0], presence=0.4), 0),
    # 2 - 2 * 0.3 = 1.4 loses to 1.5; counted once it would be 1.7.
    "frequency_counts_every_occurrence": ([2.0, 1.5, 0.0], dict(output=[0, 0], frequency=0.3), 1),
    # 2 / 1.5 = 1.33 loses to 1.5 (multiplied it would win).
    "repetition_divides_a_positive_logit_seen_in_the_prompt": ([2.0, 1.5, 0.0], dict(prompt=[0], repetition=1.5), 1),
    "repetition_divides_a_positive_logit_seen_in_the_output": ([2.0, 1.5, 0.0], dict(output=[0], repetition=1.5), 1),
    # -1 * 1.5 = -1.5 loses to -1.2 (divided it would win).
    "repetition_multiplies_a_negative_logit": ([-1.0, -1.2, -5.0], dict(prompt=[0], repetition=1.5), 1),
    # 2 / 1.5 = 1.33 still beats 1.2: seen twice is penalised once (2 / 1.5**2 = 0.89 would lose).
    "repetition_penalises_a_token_once_however_often_seen": ([2.0, 1.2, 0.0],
                                                             dict(prompt=[0], output=[0, 0], repetition=1.5), 0),
    # 1.5 + 0.3 + 0.3 = 2.1 beats 2; a repeated id adds up.
    "logit_bias_of_a_repeated_id_adds_up": ([2.0, 1.5, 0.0], dict(logit_bias=([1, 1], [0.3, 0.3])), 1),
    # 2 / 2 + 0.8 = 1.8 beats 1.5; bias before the penalty would give (2 + 0.8) / 2 = 1.4.
    "logit_bias_is_added_after_the_penalties": ([2.0, 1.5, 0.0], dict(prompt=[0], repetition=2.0,
                                                                      logit_bias=([0], [0.8])), 0),
    # -inf bans the best token.
    "logit_bias_minus_inf_bans_a_token": ([2.0, 1.5, 0.0], dict(logit_bias=([0], [-np.inf])), 1),
}


@pytest.mark.parametrize("backend", AVAILABLE)
@pytest.mark.parametrize("case", list(PENALTY_CASES))
def test_penalised_greedy_token(backend, case):
    logits, penalties, want = PENALTY_CASES[case]
    assert sample(backend, logits, 2, temperature=0.0, **penalties).tolist() == [want, want]


def test_validation_accepts_the_boundary_values_and_rejects_just_past_them():
    SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, min_p=1.0, top_k=0)
    SamplingParams(min_p=0.0, top_k=-1, presence_penalty=2.0, frequency_penalty=-2.0)
    SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, seed=-(2**63))
    SamplingParams(seed=2**63 - 1)
    for seed in (-(2**63) - 1, 2**63):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=seed)
    for bad in (dict(max_tokens=0), dict(top_p=0.0), dict(min_p=1.01), dict(temperature=-0.01),
                dict(presence_penalty=2.01), dict(repetition_penalty=0.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


def test_token_histories_of_different_lengths_are_padded_with_minus_one_never_a_token_id():
    """Padding with 0 would penalise token 0 for every shorter row."""
    def row(prompt, output):
        return SimpleNamespace(params=SamplingParams(repetition_penalty=1.2), seed=0, banned_tokens=lambda ahead=0: (),
                               request=Request("r", prompt, output_token_ids=output), matcher=None)

    t = build_sampling_tensors([row([5, 6, 7], [8]), row([9], [])], vocab_size=16)
    assert t.prompt_token_ids.tolist() == [[5, 6, 7], [9, -1, -1]]
    assert t.output_token_ids.tolist() == [[8], [-1]]


@pytest.mark.parametrize("top_k, ok", [(0, True), (-1, True), (1, True), (2**30, True), (2**31 - 1, True),
                                       (2**31, False), (2**32, False), (-2, False), (1.5, False)])
def test_top_k_takes_any_int32_from_0_and_nothing_else(top_k, ok):
    """The sampling tensors hold top_k as int32: 2**31 - 1 is the largest a request may ask for."""
    if ok:
        assert SamplingParams(top_k=top_k).top_k == max(top_k, 0)
    else:
        with pytest.raises(ValueError, match="top_k"):
            SamplingParams(top_k=top_k)
