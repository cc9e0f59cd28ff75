"""Property tests: random attention batches and sampling settings, every
available backend against the cpu_ref oracle through the conformance harness."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infer.dispatch import Ops
from infer.registry import get_backend, registry
from infer.testing import calls, inputs
from infer.testing.conformance import compare

BACKENDS = [n for n, info in registry().backends.items() if info.available and n != "cpu_ref"]
ORACLE = get_backend("cpu_ref")
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check(backend_name: str, primitive: str, make, dtype: str) -> None:
    backend = get_backend(backend_name)
    got = calls.invoke(backend, Ops(backend), primitive, make(), dtype)
    want = calls.invoke(ORACLE, Ops(ORACLE), primitive, make(), "float32")
    problems, _, _ = compare(got.outputs, want.outputs, dtype)
    assert not got.problems + problems, got.problems + problems


@st.composite
def attention_batches(draw):
    block_size = draw(st.sampled_from([1, 4, 16, 32]))
    reqs = []
    for _ in range(draw(st.integers(0, 5))):
        seq_len = draw(st.integers(1, 70))
        reqs.append((draw(st.integers(1, seq_len)), seq_len))  # (q_len, seq_len): any prefill/decode mix
    hk = draw(st.sampled_from([1, 2, 3]))
    return dict(reqs=reqs, hk=hk, hq=hk * draw(st.sampled_from([1, 2, 3, 8])), d=draw(st.sampled_from([16, 64, 80])),
                block_size=block_size, sliding_window=draw(st.none() | st.integers(1, 40)),
                soft_cap=draw(st.none() | st.floats(1.0, 30.0)))


@pytest.mark.parametrize("backend_name", BACKENDS)
@FAST
@given(case=attention_batches(), seed=st.integers(0, 2**32 - 1), dtype=st.sampled_from(["float32", "bfloat16"]))
def test_attention_matches_reference_on_any_batch(backend_name, case, seed, dtype):
    check(backend_name, "attention", lambda: inputs.attention(np.random.default_rng(seed), dtype, **case), dtype)


@st.composite
def sampling_settings(draw):
    b = draw(st.integers(1, 6))
    v = draw(st.integers(50, 300))  # the input builder draws penalty ids below 50
    rows = lambda s: draw(st.lists(s, min_size=b, max_size=b))  # noqa: E731
    return dict(b=b, v=v, temperature=rows(st.sampled_from([0.0, 0.3, 1.0, 2.0])),
                top_k=rows(st.integers(0, v + 2)), top_p=rows(st.sampled_from([1.0, 0.95, 0.5, 0.05])),
                min_p=rows(st.sampled_from([0.0, 0.05, 0.5])), logprobs=draw(st.integers(0, min(v, 5))),
                penalties=draw(st.booleans()), logit_bias=draw(st.booleans()))


@pytest.mark.parametrize("backend_name", BACKENDS)
@FAST
@given(case=sampling_settings(), seed=st.integers(0, 2**32 - 1))
def test_sampled_tokens_equal_the_reference_for_any_settings(backend_name, case, seed):
    check(backend_name, "sample", lambda: inputs.sample(np.random.default_rng(seed), "float32", **case), "float32")
