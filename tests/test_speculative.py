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


# -- through the engine ------------------------------------------------------------------

from server_harness import make_tiny_model_dir  # noqa: E402

from infer.core.llm import LLM  # noqa: E402
from infer.core.sampling_params import SamplingParams  # noqa: E402
from infer.core.speculative import NgramProposer, Proposer, SpeculativeConfig  # noqa: E402
from infer.primitives.hookspecs import hookimpl  # noqa: E402
from test_registry import FakeEntryPoint, fake_registry  # noqa: E402

PROMPTS = ["The cat sat on", "Once upon a time", "x y z", "Numbers: 1 2 3"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny-spec"), seed=5))


WRONG = frozenset({2, 7, 8, 13})


class ScriptProposer(Proposer):
    """Drafts a known continuation (each prompt's plain greedy output), wrong at
    every output position in `wrong`: whole, partial and no acceptance all occur."""

    method = "script"
    script: dict[tuple, list[int]] = {}
    wrong = WRONG
    calls = 0

    def propose(self, requests, max_drafts):
        type(self).calls += 1
        out = []
        for r, k in zip(requests, max_drafts):
            ids, drafts = r.all_token_ids, []
            for prompt, cont in self.script.items():
                if tuple(ids[: len(prompt)]) == prompt:
                    pos = len(ids) - len(prompt)
                    drafts = [t if pos + j not in self.wrong else (t + 1) % 300
                              for j, t in enumerate(cont[pos : pos + k])]
            out.append(drafts)
        return out


class ScriptPlugin:
    @hookimpl
    def infer_register_spec_proposers(self):
        return {"script": ScriptProposer, "ngram": ScriptProposer}  # a taken method is reported, not replaced


@pytest.fixture
def script(monkeypatch):
    """ScriptProposer, registered as a third-party plugin would be (an entry point's pluggy hook)."""
    reg = fake_registry(monkeypatch, FakeEntryPoint("scripted", ScriptPlugin()))
    assert reg.spec_proposers["script"] is ScriptProposer and reg.spec_proposers["ngram"] is NgramProposer
    assert "speculative method name 'ngram' already registered" in reg.broken["scripted"]
    ScriptProposer.script, ScriptProposer.calls, ScriptProposer.wrong = {}, 0, WRONG
    return ScriptProposer


def _llm(tiny_dir, spec=None, **kw):
    args = dict(backend="torch", max_model_len=256, num_gpu_blocks_override=64, block_size=4)
    return LLM(tiny_dir, speculative_config=spec, **(args | kw))


def _same(a, b):
    for x, y in zip(a, b):
        for c, d in zip(x.outputs, y.outputs):
            assert c.token_ids == d.token_ids and c.text == d.text and c.finish_reason == d.finish_reason
            if c.logprobs is not None:
                assert [sorted(e) for e in c.logprobs] == [sorted(e) for e in d.logprobs]
                assert c.cumulative_logprob == pytest.approx(d.cumulative_logprob, abs=1e-4)


def _no_blocks_held(llm):
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.req_to_blocks


@pytest.mark.parametrize("extra", [dict(), dict(logprobs=3, frequency_penalty=0.7, presence_penalty=0.3),
                                   dict(repetition_penalty=1.3, min_tokens=5)], ids=["plain", "logprobs_penalties",
                                                                                      "repetition_min_tokens"])
def test_greedy_tokens_are_those_of_plain_decoding_whatever_is_accepted(tiny_dir, script, extra):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **extra)
    plain = _llm(tiny_dir).generate(PROMPTS, params, use_tqdm=False)
    tok_ids = [list(o.prompt_token_ids) for o in plain]
    script.script = {tuple(ids): list(o.outputs[0].token_ids) for ids, o in zip(tok_ids, plain)}
    llm = _llm(tiny_dir, {"method": "script", "num_speculative_tokens": 4, "adaptive": False})
    spec = llm.generate(PROMPTS, params, use_tqdm=False)
    _same(spec, plain)
    s = llm.engine.spec_stats
    assert script.calls > 0 and s.num_drafts > 0
    # Wrong drafts are rejected, right ones accepted: some steps take all, some none.
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens
    assert s.accepted_per_position[0] > s.accepted_per_position[-1] > 0
    # Fewer steps than tokens: each verifying step gave 1 + accepted tokens.
    assert s.mean_accepted_length > 1.5
    _no_blocks_held(llm)


def test_a_stop_string_inside_accepted_drafts_ends_the_output_there(tiny_dir, script):
    free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    base = _llm(tiny_dir).generate(PROMPTS[:1], free, use_tqdm=False)[0]
    text = base.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop])
    plain = _llm(tiny_dir).generate(PROMPTS[:1], params, use_tqdm=False)
    script.script = {tuple(base.prompt_token_ids): list(base.outputs[0].token_ids)}
    script.wrong = frozenset()
    llm = _llm(tiny_dir, {"method": "script", "num_speculative_tokens": 6, "adaptive": False})
    spec = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    _same(spec, plain)
    assert spec[0].outputs[0].finish_reason == "stop" and stop not in spec[0].outputs[0].text
    assert llm.engine.spec_stats.num_accepted_tokens > 0
    _no_blocks_held(llm)


def test_min_tokens_holds_back_a_stop_string_inside_accepted_drafts(tiny_dir, script):
    """A stop string before min_tokens does not count even when the same step's later
    drafts take the output past min_tokens (as in plain decoding)."""
    free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    base = _llm(tiny_dir).generate(PROMPTS[:1], free, use_tqdm=False)[0]
    stop = base.outputs[0].text[1:3]  # an early stop string, which min_tokens holds back
    script.script = {tuple(base.prompt_token_ids): list(base.outputs[0].token_ids)}
    script.wrong = frozenset()
    llm = _llm(tiny_dir, {"method": "script", "num_speculative_tokens": 6, "adaptive": False})
    plain_llm = _llm(tiny_dir)
    for min_tokens in range(2, 9):
        params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop], min_tokens=min_tokens)
        _same(llm.generate(PROMPTS[:1], params, use_tqdm=False), plain_llm.generate(PROMPTS[:1], params, use_tqdm=False))
    assert llm.engine.spec_stats.num_accepted_tokens > 0


def test_preempted_speculating_requests_recompute_to_the_same_tokens(tiny_dir, script):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [p + " again" * i for i, p in enumerate(PROMPTS * 2)]
    plain = _llm(tiny_dir).generate(prompts, params, use_tqdm=False)
    script.script = {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) for o in plain}
    llm = _llm(tiny_dir, {"method": "script", "num_speculative_tokens": 5, "adaptive": False},
               num_gpu_blocks_override=40, max_model_len=96)
    spec = llm.generate(prompts, params, use_tqdm=False)
    _same(spec, plain)
    assert llm.engine.scheduler.get_stats().num_preemptions > 0
    assert llm.engine.spec_stats.num_accepted_tokens > 0
    _no_blocks_held(llm)


def test_seeded_sampling_with_drafts_is_reproducible_and_n_forks_work(tiny_dir, script):
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=20, ignore_eos=True, n=2)
    greedy = _llm(tiny_dir).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                                     use_tqdm=False)
    script.script = {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) for o in greedy}
    runs = []
    for _ in range(2):
        llm = _llm(tiny_dir, {"method": "script", "num_speculative_tokens": 3, "adaptive": False})
        runs.append(llm.generate(PROMPTS, params, use_tqdm=False))
        assert llm.engine.spec_stats.num_drafts > 0
        _no_blocks_held(llm)
    _same(runs[0], runs[1])
    assert all(len(o.outputs) == 2 and all(len(c.token_ids) == 20 for c in o.outputs) for o in runs[0])


def test_drafts_respect_max_tokens_and_the_batch_size_limit(tiny_dir, script):
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    plain = _llm(tiny_dir).generate(PROMPTS, params, use_tqdm=False)
    script.script = {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) + [5] * 20 for o in plain}
    script.wrong = frozenset()
    llm = _llm(tiny_dir, {"method": "script", "num_speculative_tokens": 5, "adaptive": False, "disable_by_batch_size": 4})
    assert all(len(o.outputs[0].token_ids) == 7 for o in llm.generate(PROMPTS, params, use_tqdm=False))
    assert llm.engine.spec_stats.num_drafts == 0  # four requests running: at the limit, no drafts
    out = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    _same(out, plain[:2])
    s = llm.engine.spec_stats
    assert s.num_drafts > 0 and s.num_draft_tokens <= 2 * 6  # never past max_tokens: 6 tokens after the first


def test_ngram_proposer_looks_up_the_longest_recent_suffix():
    from types import SimpleNamespace

    p = NgramProposer(SpeculativeConfig("ngram", 3, prompt_lookup_max=3, prompt_lookup_min=2), None)
    look = lambda ids, k: p.propose([SimpleNamespace(all_token_ids=ids)], [k])[0]  # noqa: E731
    assert look([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 3) == [7, 8, 1]  # the latest of two matches
    assert look([5, 6, 7, 5, 6, 9, 6], 2) == []  # one token in common is below the minimum
    assert look([4, 5, 6, 4, 5], 5) == [6, 4, 5]  # up to the end of the context
    assert look([1, 1, 1, 1], 0) == []
    assert look([3], 2) == []


@pytest.mark.parametrize("bad, match", [
    ({"method": "ngram"}, "needs 'method' and 'num_speculative_tokens'"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "unknown speculative method 'medusa'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}, "exceeds prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown key"),
    ("{not json", "not valid JSON"),
])
def test_bad_speculative_configs_name_the_problem(bad, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.parse(bad)


def test_speculation_is_refused_with_pipeline_stages(tiny_dir):
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        _llm(tiny_dir, {"method": "ngram", "num_speculative_tokens": 2}, pipeline_parallel_size=2)


def test_each_draft_position_samples_as_if_the_drafts_before_it_were_output():

    from infer.core.request import Request
    from infer.core.request_state import CompletionState
    from infer.core.sampling_batch import build_sampling_tensors

    p = SamplingParams(temperature=0.8, frequency_penalty=0.5, min_tokens=3, stop_token_ids=[9], seed=1)
    req = Request("r", [1, 2], sampling_params=p, output_token_ids=[4], eos_token_ids=(0,))
    comp = CompletionState(0, req, p, seed=1, detokenizer=None)
    spec = [([], 7), ([7], 8), ([7, 8], -1)]
    t = build_sampling_tensors([comp] * 3, vocab_size=16, spec=spec)
    assert t.steps.tolist() == [1, 2, 3]  # each position has its own noise
    assert t.output_token_ids.tolist() == [[4, -1, -1], [4, 7, -1], [4, 7, 8]]
    assert t.draft_token_ids.tolist() == [7, 8, -1]
    # min_tokens=3: EOS and the stop token are banned at the first two positions only.
    banned = [sorted(int(i) for i, v in zip(ids, vals) if v == -np.inf)
              for ids, vals in zip(t.logit_bias_ids, t.logit_bias_values)]
    assert banned == [[0, 9], [0, 9], []]


def test_the_draft_budget_drafts_what_measured_costs_and_acceptance_pay_for():
    from infer.core.speculative import DraftBudget

    b = DraftBudget(max_drafts=5)
    assert b.plan(["a"], batch=1) == [0]  # no plain step seen yet: plain steps first
    b.observe_step(1, 0, 0.016)
    assert b.step_seconds(1, 2) == pytest.approx(0.016 * 1.6)  # the prior for what is not measured
    b._global = [9.0, 10.0]  # the engine's requests accept 90% of drafts
    assert b.plan(["b"], batch=1) == [5]  # the prior makes every draft look cheap
    # Measured: one draft costs 60% of a step, more cost far more (a kernel change).
    for drafted, seconds in ((1, 0.025), (2, 0.054), (3, 0.070), (4, 0.080), (5, 0.090)):
        for _ in range(30):
            b.observe_step(1, drafted, seconds)
    assert b.plan(["c"], batch=1) == [1]  # 1.9 tokens in 25 ms beats 1 in 16 and 4.7 in 90
    assert b.alpha("c") == pytest.approx(0.9)
    # A batch of 32 whose drafted tokens cost a token's share each: nothing pays.
    for drafted, seconds in ((0, 0.124), (32, 0.250), (64, 0.370)):
        for _ in range(30):
            b.observe_step(32, drafted, seconds)
    ids = [f"r{i}" for i in range(32)]
    plans = [b.plan(ids, batch=32) for _ in range(10)]
    assert plans == ([[0] * 32] * 4 + [[1] * 32]) * 2  # only a probe every 5th step
    b.record("r0", 1, 0)  # r0's probe was refused: it waits twice as long
    assert [b.plan(["r0"], batch=32)[0] for _ in range(9)] == [0] * 8 + [1]
    # A shape's first step paid one-time costs: the second, cheaper, replaces it; drafting
    # steps are interleaved with a plain one every REMEASURE_EVERY, so the plain cost is current.
    b2 = DraftBudget(max_drafts=2)
    b2._global = [9.0, 10.0]
    b2.observe_step(8, 0, 0.460)
    b2.observe_step(8, 8, 0.120)
    b2.observe_step(8, 0, 0.150)
    assert b2.step_seconds(8, 0) == pytest.approx(0.150)
    b2.observe_step(8, 0, 0.160)
    assert b2.step_seconds(8, 0) == pytest.approx(0.150 * 0.9 + 0.160 * 0.1)
    plans = [b2.plan([f"q{i}" for i in range(8)], batch=8) for _ in range(2 * b2.REMEASURE_EVERY + 2)]
    plain = [i for i, p in enumerate(plans) if p == [0] * 8]
    assert plain == [b2.REMEASURE_EVERY, 2 * b2.REMEASURE_EVERY + 1] and all(p[0] > 0 for p in plans[:plain[0]])
    # A request whose drafts are refused stops taking part at batch 1.
    for _ in range(30):
        b.record("c", 1, 0)
    assert b.alpha("c") < b.MIN_ALPHA and b.plan(["c"], batch=1) == [0]


@pytest.mark.slow
def test_speculation_on_smollm2_gives_the_plain_greedy_tokens_also_under_preemption():
    """A real model copying from its prompt: n-gram drafts are mostly accepted, and
    every output is the one plain decoding gives (adaptive and fixed drafting, and
    SmolLM2 drafting for itself)."""
    text = ("The city council met on Tuesday to discuss the new park. Members agreed that the park should have "
            "a playground, a small pond, and walking paths lined with oak trees.")
    messages = [[{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}],
                [{"role": "user", "content": f"Rewrite this text, replacing 'park' with 'garden':\n\n{text}"}],
                [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    plain = LLM("smollm2").chat(messages, params, use_tqdm=False)
    for spec, kw in (({"method": "ngram", "num_speculative_tokens": 5, "adaptive": False}, {}),
                     ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2},
                      dict(block_size=16, num_gpu_blocks_override=14, max_model_len=160)),
                     ({"method": "draft_model", "model": "smollm2", "num_speculative_tokens": 3, "adaptive": False},
                      {})):
        llm = LLM("smollm2", speculative_config=spec, **kw)
        out = llm.chat(messages, params, use_tqdm=False)
        for a, b in zip(out, plain):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids, (a.outputs[0].text, b.outputs[0].text)
        s = llm.engine.get_stats()
        assert s.spec_decode.num_accepted_tokens > 0 and s.spec_decode.acceptance_rate > 0.3
        if kw:
            assert s.num_preemptions > 0
        _no_blocks_held(llm)


def test_spec_decode_counters_reach_prometheus():
    from infer.core.block_manager import PrefixCacheStats
    from infer.core.scheduler import SchedulerStats
    from infer.core.speculative import SpecDecodeStats
    from infer.server.metrics import Metrics

    m = Metrics()
    log = m.logger("smol")
    stats = lambda s: SchedulerStats(1, 0, 0, 1, 8, 0.1, PrefixCacheStats(), s)  # noqa: E731
    log(stats(SpecDecodeStats(3, 12, 7, [3, 2, 1, 1])), None)
    log(stats(SpecDecodeStats(5, 20, 12, [5, 4, 2, 1])), None)
    text = m.render().decode()
    for line in ('infer:spec_decode_num_drafts_total{model_name="smol"} 5.0',
                 'infer:spec_decode_num_draft_tokens_total{model_name="smol"} 20.0',
                 'infer:spec_decode_num_accepted_tokens_total{model_name="smol"} 12.0',
                 'infer:spec_decode_num_accepted_tokens_per_pos_total{model_name="smol",position="1"} 4.0'):
        assert line in text, line


def test_the_scheduler_verifies_drafts_in_one_query_and_rolls_back_the_rejected():
    from infer.core.config import CacheConfig, SchedulerConfig
    from infer.core.request import Request
    from infer.core.scheduler import Scheduler
    from infer.core.scheduler_output import StepOutput

    def sched(blocks):
        return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
                         CacheConfig(block_size=4, num_blocks=blocks, enable_prefix_caching=True))

    s = sched(8)
    req = Request("a", [1, 2, 3, 4, 5, 6], sampling_params=SamplingParams(max_tokens=20, ignore_eos=True))
    s.add_request(req)
    out = s.schedule()
    s.update_from_output(out, StepOutput.of_tokens({"a": 7}))
    req.spec_token_ids = [8, 9, 10]
    out = s.schedule()
    (sr,) = out.scheduled
    assert (sr.start, sr.num_tokens, sr.num_drafts, sr.token_ids) == (6, 4, 3, [7, 8, 9, 10])
    mi = out.model_input()
    assert mi.logits_indices.tolist() == [0, 1, 2, 3] and mi.sample_num_rows.tolist() == [4]
    assert len(sr.block_ids) == 3  # room for all 10 tokens
    # Two drafts accepted, then the correction 11: 9 tokens computed (not the third draft's slot).
    s.update_from_output(out, StepOutput([req.request_id] * 3, np.array([8, 9, 11]), np.zeros(3, np.float32)))
    assert req.output_token_ids == [7, 8, 9, 11] and req.num_computed_tokens == 9 and req.spec_token_ids == []
    assert len(req.block_hashes) == 2  # full blocks of computed tokens only: [1-4], [5, 6, 7, 8]
    with pytest.raises(ValueError, match="took 3 tokens"):  # more tokens than drafts + 1
        req.spec_token_ids = [1]
        out = s.schedule()
        s.update_from_output(out, StepOutput([req.request_id] * 3, np.array([1, 2, 3]), np.zeros(3, np.float32)))

    # No block left for the drafts: a plain decode step, nobody preempted.
    s = sched(4)
    reqs = [Request(r, [1, 2, 3, 4, 5, 6, 7], sampling_params=SamplingParams(max_tokens=20, ignore_eos=True))
            for r in "bc"]
    for r in reqs:
        s.add_request(r)
    s.update_from_output(s.schedule(), StepOutput.of_tokens({"b": 8, "c": 8}))  # the 4 blocks are taken
    reqs[1].spec_token_ids = [9, 10]  # positions 8 and 9 would need a fifth block
    out = s.schedule()
    assert [(x.num_tokens, x.num_drafts) for x in out.scheduled] == [(1, 0), (1, 0)]
    assert s.num_preemptions == 0 and reqs[1].spec_token_ids == []


def test_served_speculation_streams_what_it_returns_whole(tiny_dir, tmp_path):
    """Through `infer serve` and the openai client: several tokens a step reach the
    stream as deltas that add up to the whole answer, which is plain greedy's."""
    import openai
    from server_harness import Server

    prompt = "one two three four one two three four one two"
    plain = _llm(tiny_dir).generate([prompt], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
                                    use_tqdm=False)[0].outputs[0].text
    srv = Server(["--model", tiny_dir, "--backend", "torch", "--max-model-len", "256", "--speculative-config",
                  '{"method": "ngram", "num_speculative_tokens": 4, "adaptive": false}'])
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        kw = dict(model=tiny_dir, prompt=prompt, max_tokens=32, temperature=0.0, extra_body={"ignore_eos": True})
        whole = client.completions.create(**kw).choices[0].text
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
        assert whole == streamed == plain
        import urllib.request

        metrics = urllib.request.urlopen(srv.url + "/metrics").read().decode()
        drafted = [float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("infer:spec_decode_num_draft_tokens_total")]
        assert drafted and drafted[0] > 0
    finally:
        assert srv.stop() == 0, "".join(srv.log)


def test_a_draft_model_that_is_the_target_has_every_greedy_draft_accepted(tiny_dir):
    """draft = the target: the drafts are the target's own greedy tokens (its own KV
    cache, catching up each step), so nearly all are accepted, also under preemption."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = [p + " again" * i for i, p in enumerate(PROMPTS * 2)]
    plain = _llm(tiny_dir).generate(prompts, params, use_tqdm=False)
    spec = {"method": "draft_model", "model": tiny_dir, "num_speculative_tokens": 3, "adaptive": False}
    for kw in ({}, dict(num_gpu_blocks_override=36, max_model_len=96)):
        llm = _llm(tiny_dir, spec, **kw)
        _same(llm.generate(prompts, params, use_tqdm=False), plain)
        s = llm.engine.get_stats()
        assert s.spec_decode.acceptance_rate > 0.9 and s.spec_decode.mean_accepted_length > 3
        if kw:
            assert s.num_preemptions > 0
        _no_blocks_held(llm)
        assert not llm.engine.proposer.blocks.req_to_blocks and not llm.engine.proposer._computed


def test_a_draft_model_needs_a_path_and_the_targets_tokenizer(tiny_dir):
    with pytest.raises(ValueError, match="needs 'model'"):
        _llm(tiny_dir, {"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="different tokenizer"):
        _llm(tiny_dir, {"method": "draft_model", "model": "smollm2", "num_speculative_tokens": 2})
