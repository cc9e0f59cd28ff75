"""LLMEngine / LLM end to end on a tiny random Llama saved as an HF directory.

transformers' own model is the oracle: greedy tokens, logits and logprobs must
match it however the scheduler cuts the work (chunked prefill, preemption,
prefix caching, forks). Every engine a test builds through `make_llm` must end
the test with all its KV blocks free (see `leak_check` in conftest).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import make_model

from infer.core.engine import EngineArgs, LLMEngine
from infer.core.llm import LLM
from infer.core.loader import ModelNotFoundError
from infer.core.sampling_params import SamplingParams
from infer.registry import BackendUnavailableError

VOCAB = 211  # tiny_models' vocab_size
BACKENDS = ["torch", "cpu_ref"]
_rng = np.random.default_rng(0)
# Lengths: across a block boundary, short, several blocks, exactly one block, one token.
PROMPTS = [_rng.integers(3, VOCAB, n).tolist() for n in (21, 5, 37, 16, 1)]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


class Tiny:
    """The tiny transformers model and the HF directory it was saved to."""

    def __init__(self, model, path):
        self.model, self.path = model, str(path)
        self._greedy: dict[tuple, list[int]] = {}

    def greedy(self, prompt, max_tokens=MAX_TOKENS, min_tokens=0, eos=None) -> list[int]:
        """transformers' greedy generate (memoised); no EOS unless `eos` is given."""
        key = (tuple(prompt), max_tokens, min_tokens, eos)
        if key not in self._greedy:
            ids = torch.tensor([list(prompt)])
            with torch.no_grad():
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                          max_new_tokens=max_tokens, min_new_tokens=min_tokens, eos_token_id=eos,
                                          pad_token_id=0)
            self._greedy[key] = out[0, len(prompt):].tolist()
        return list(self._greedy[key])

    def logits(self, tokens) -> np.ndarray:
        """[len(tokens), V] float64 logits of one full forward pass."""
        with torch.no_grad():
            return self.model(torch.tensor([list(tokens)])).logits[0].double().numpy()

    def log_softmax_after(self, prompt, output) -> np.ndarray:
        """[len(output), V]: row t is the log-distribution output[t] was drawn from."""
        x = self.logits(list(prompt) + list(output))[len(prompt) - 1 : len(prompt) - 1 + len(output)]
        return torch.log_softmax(torch.from_numpy(x), dim=-1).numpy()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model, _, _ = make_model("llama3")
    path = tmp_path_factory.mktemp("tiny-llama3")
    model.save_pretrained(path)  # config.json + model.safetensors + generation_config.json (eos 2)
    return Tiny(model, path)


@pytest.fixture(scope="module")
def eos_tiny(tiny, tmp_path_factory):
    """The same weights, but EOS is the first token greedy decoding picks after PROMPTS[0]."""
    path = tmp_path_factory.mktemp("tiny-llama3-eos")
    shutil.copytree(tiny.path, path, dirs_exist_ok=True)
    eos = tiny.greedy(PROMPTS[0])[0]
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": eos}))
    return Tiny(tiny.model, path), eos


@pytest.fixture
def make_llm(tiny, leak_check):
    def make(model: str | None = None, **kwargs) -> LLM:
        kwargs = {"backend": "torch", "skip_tokenizer_init": True, "max_num_seqs": 8} | kwargs
        llm = LLM(model or tiny.path, **kwargs)
        leak_check.append(llm.engine)
        return llm
    return make


def tokens_prompt(ids):
    return {"prompt_token_ids": list(ids)}


def generate(llm, prompts, params=GREEDY, **kwargs):
    """Token ids of the first completion of each prompt."""
    outs = llm.generate([tokens_prompt(p) for p in prompts], params, use_tqdm=False, **kwargs)
    return [o.outputs[0].token_ids for o in outs]


def run_to_completion(engine: LLMEngine) -> dict:
    """Step until idle; the final RequestOutput of each request, in finishing order."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


# -- greedy decoding equals transformers, however the work is scheduled ------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_batch_matches_transformers(make_llm, tiny, backend):
    llm = make_llm(backend=backend)
    assert generate(llm, PROMPTS) == [tiny.greedy(p) for p in PROMPTS]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunking", [dict(max_num_batched_tokens=8, max_num_seqs=4),
                                      dict(long_prefill_token_threshold=3)], ids=["tiny_budget", "threshold"])
def test_greedy_matches_transformers_when_chunked_prefill_splits_prompts(make_llm, tiny, backend, chunking):
    llm = make_llm(backend=backend, **chunking)
    assert generate(llm, PROMPTS) == [tiny.greedy(p) for p in PROMPTS]


def test_greedy_matches_transformers_with_chunked_prefill_off(make_llm, tiny):
    llm = make_llm(enable_chunked_prefill=False, max_model_len=64, max_num_batched_tokens=64)
    assert generate(llm, PROMPTS) == [tiny.greedy(p) for p in PROMPTS]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_matches_transformers_when_requests_are_preempted_and_recomputed(make_llm, tiny, backend, policy):
    # 16 blocks of 4 tokens: one request fits (max_model_len 64), all of them together do not.
    llm = make_llm(backend=backend, block_size=4, max_model_len=64, num_gpu_blocks_override=16,
                   scheduling_policy=policy)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert generate(llm, PROMPTS, params) == [tiny.greedy(p, 16) for p in PROMPTS]
    assert llm.engine.scheduler.get_stats().num_preemptions > 0


def test_prefix_caching_on_and_off_give_identical_outputs(make_llm, tiny):
    shared = PROMPTS[2]  # 37 tokens: two full blocks of 16 are shareable
    prompts = [shared + [7], shared + [9, 11], shared[:20], shared]
    on, off = make_llm(enable_prefix_caching=True), make_llm(enable_prefix_caching=False)
    first_on, first_off = generate(on, prompts), generate(off, prompts)
    again_on = generate(on, prompts)  # every shared block is cached by now
    assert first_on == first_off == again_on == [tiny.greedy(p) for p in prompts]
    assert on.engine.scheduler.get_stats().prefix_cache.hits > 0
    assert off.engine.scheduler.get_stats().prefix_cache.hits == 0


def test_cache_salt_keeps_prefix_cache_entries_apart(make_llm):
    engine = make_llm().engine
    stats = engine.scheduler.block_manager.prefix_cache_stats
    engine.add_request("a", tokens_prompt(PROMPTS[2]), GREEDY, cache_salt="tenant-a")
    run_to_completion(engine)
    engine.add_request("b", tokens_prompt(PROMPTS[2]), GREEDY, cache_salt="tenant-b")
    run_to_completion(engine)
    assert stats.hits == 0
    engine.add_request("a2", tokens_prompt(PROMPTS[2]), GREEDY, cache_salt="tenant-a")
    run_to_completion(engine)
    assert stats.hits == 32


def test_prefix_cache_hit_within_one_batch_when_chunking_delays_the_second_prompt(make_llm, tiny):
    shared = PROMPTS[2]
    prompts = [shared + [7], shared + [9, 11]]
    llm = make_llm(max_num_batched_tokens=8, max_num_seqs=1)
    assert generate(llm, prompts) == [tiny.greedy(p) for p in prompts]
    assert llm.engine.scheduler.get_stats().prefix_cache.hits >= 32


# -- sampling -------------------------------------------------------------------------------

SEEDED = SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)


def test_seeded_sampling_is_reproducible_across_engines(make_llm):
    a, b = make_llm(), make_llm(seed=123)
    assert generate(a, PROMPTS[:1], SEEDED) == generate(b, PROMPTS[:1], SEEDED)


def test_seeded_sampling_does_not_depend_on_the_rest_of_the_batch(make_llm):
    llm = make_llm(max_num_batched_tokens=8, max_num_seqs=4)
    alone = generate(llm, PROMPTS[:1], SEEDED)[0]
    others = [SamplingParams(temperature=0.7, top_k=5, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=1.3, top_p=0.5, seed=1, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.0, repetition_penalty=1.5, max_tokens=3, ignore_eos=True)]
    outs = llm.generate([tokens_prompt(p) for p in PROMPTS[1:3] + PROMPTS[:1] + PROMPTS[3:4]],
                        [others[0], others[1], SEEDED, others[2]], use_tqdm=False)
    assert outs[2].outputs[0].token_ids == alone


def test_seeded_sampling_is_unaffected_by_chunking_and_preemption(make_llm):
    alone = generate(make_llm(), PROMPTS[:1], SEEDED)[0]
    cramped = make_llm(block_size=4, max_model_len=64, num_gpu_blocks_override=16, max_num_batched_tokens=8,
                       max_num_seqs=4)
    greedy_long = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = generate(cramped, PROMPTS[1:3] + PROMPTS[:1], [greedy_long, greedy_long, SEEDED])
    assert cramped.engine.scheduler.get_stats().num_preemptions > 0
    assert outs[2] == alone


def test_top_k_1_samples_the_greedy_token(make_llm, tiny):
    params = SamplingParams(temperature=1.0, top_k=1, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert generate(make_llm(), PROMPTS[:2], params) == [tiny.greedy(p) for p in PROMPTS[:2]]


def test_different_seeds_give_different_samples(make_llm):
    llm = make_llm()
    seeds = [SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True) for s in (7, 8)]
    a, b = generate(llm, PROMPTS[:1] * 2, seeds)
    assert a != b


@pytest.mark.parametrize("prompts, shown", [(1, True), (2, True), (0, False)])
def test_the_progress_bar_shows_for_any_prompt_that_runs(make_llm, capsys, prompts, shown):
    make_llm().generate([tokens_prompt(PROMPTS[0])] * prompts, SamplingParams(max_tokens=2), use_tqdm=True)
    assert ("Processed prompts" in capsys.readouterr().err) == shown


@pytest.mark.parametrize("prompts, total", [([PROMPTS[0], [], PROMPTS[1]], 2), ([[]], 0)])
def test_the_progress_bar_counts_only_the_prompts_that_run(make_llm, monkeypatch, prompts, total):
    """A refused prompt is finished at once, with an error: the bar leaves it out, so it ends full."""
    import infer.core.llm

    bars = []

    class Bar:
        def __init__(self, total, disable, **kwargs):
            self.total, self.shown, self.n = total, not disable, 0
            bars.append(self)

        def update(self, n):
            self.n += n

        def close(self):
            pass

    monkeypatch.setattr(infer.core.llm, "tqdm", Bar)
    make_llm().generate([tokens_prompt(p) for p in prompts], SamplingParams(max_tokens=2), use_tqdm=True)
    [bar] = bars
    assert (bar.total, bar.n, bar.shown) == (total, total, total > 0)


def test_unseeded_sampling_follows_the_engine_seed(make_llm):
    """The engine seed defaults to 0 (as in vLLM): an engine built without one samples like seed=0."""
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    a, b, c = make_llm(), make_llm(seed=0), make_llm(seed=1)
    assert generate(a, PROMPTS[:1], params) == generate(b, PROMPTS[:1], params) != generate(c, PROMPTS[:1], params)


def test_n_greedy_completions_all_equal_the_greedy_output(make_llm, tiny):
    llm = make_llm()
    out = llm.generate(tokens_prompt(PROMPTS[0]), SamplingParams(n=2, temperature=0.0, max_tokens=MAX_TOKENS,
                                                                ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1]
    assert [c.token_ids for c in out.outputs] == [tiny.greedy(PROMPTS[0])] * 2
    assert [c.finish_reason for c in out.outputs] == ["length", "length"]


def test_n_seeded_completions_are_those_of_seeds_seed_plus_index(make_llm):
    llm = make_llm()
    forked = llm.generate(tokens_prompt(PROMPTS[0]), SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16,
                                                                    ignore_eos=True), use_tqdm=False)[0]
    alone = [generate(llm, PROMPTS[:1], SamplingParams(temperature=1.0, seed=7 + i, max_tokens=16, ignore_eos=True))[0]
             for i in range(3)]
    assert [c.token_ids for c in forked.outputs] == alone
    assert len({tuple(t) for t in alone}) == 3


@pytest.mark.parametrize("prompt", [PROMPTS[0], PROMPTS[3]], ids=["partial_last_block", "full_last_block"])
def test_forked_completions_each_attend_to_their_own_tokens(make_llm, tiny, prompt):
    # Forks share the prompt's blocks; one writing into a shared block without
    # copy-on-write would corrupt its siblings' context and so their logprobs.
    llm = make_llm(block_size=4)
    out = llm.generate(tokens_prompt(prompt), SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=10,
                                                             ignore_eos=True, logprobs=0), use_tqdm=False)[0]
    for c in out.outputs:
        ref = tiny.log_softmax_after(prompt, c.token_ids)
        got = [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)]
        np.testing.assert_allclose(got, ref[np.arange(len(c.token_ids)), c.token_ids], atol=1e-4)


def test_logprobs_match_transformers_log_softmax(make_llm, tiny):
    llm = make_llm()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    c = llm.generate(tokens_prompt(PROMPTS[0]), params, use_tqdm=False)[0].outputs[0]
    ref = tiny.log_softmax_after(PROMPTS[0], c.token_ids)
    assert len(c.logprobs) == len(c.token_ids) == 6
    for step, token, row in zip(c.logprobs, c.token_ids, ref):
        assert len(step) == 3  # the greedy token is the top-1, so it is one of the 3
        top3 = np.argsort(-row, kind="stable")[:3].tolist()
        assert top3[0] == token and set(step) == set(top3)
        for tid, lp in step.items():
            assert lp.rank == top3.index(tid) + 1
            assert lp.logprob == pytest.approx(row[tid], abs=1e-4)
    assert c.cumulative_logprob == pytest.approx(sum(row[t] for row, t in zip(ref, c.token_ids)), abs=1e-3)


def test_logprobs_add_the_sampled_token_when_outside_the_top_k(make_llm, tiny):
    llm = make_llm()
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=16, ignore_eos=True, logprobs=1)
    c = llm.generate(tokens_prompt(PROMPTS[0]), params, use_tqdm=False)[0].outputs[0]
    ref = tiny.log_softmax_after(PROMPTS[0], c.token_ids)
    sizes = []
    for step, token, row in zip(c.logprobs, c.token_ids, ref):
        top1 = int(np.argmax(row))
        sizes.append(len(step))
        assert set(step) == {token, top1}
        assert step[token].logprob == pytest.approx(row[token], abs=1e-4)
        assert step[token].rank == 1 + int((row > row[token]).sum())  # vLLM's rank, even outside the top k
    assert 2 in sizes  # near-uniform logits: some sampled token was not the top-1


def test_logprobs_zero_returns_the_sampled_token_with_its_rank(make_llm, tiny):
    llm = make_llm()
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=8, ignore_eos=True, logprobs=0)
    c = llm.generate(tokens_prompt(PROMPTS[0]), params, use_tqdm=False)[0].outputs[0]
    ref = tiny.log_softmax_after(PROMPTS[0], c.token_ids)
    for step, token, row in zip(c.logprobs, c.token_ids, ref):
        assert list(step) == [token]
        assert step[token].rank == 1 + int((row > row[token]).sum())


# Penalties per SamplingTensors' contract, in float64 on transformers' logits.
def penalised(logits, prompt, output, presence=0.0, frequency=0.0, repetition=1.0):
    x = logits.copy()
    counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=x.shape[0])
    seen = counts > 0
    seen[np.asarray(prompt)] = True
    x = np.where(seen, np.where(x > 0, x / repetition, x * repetition), x)
    return x - frequency * counts - presence * (counts > 0)


PENALTIES = [dict(presence_penalty=1.5), dict(frequency_penalty=0.7), dict(repetition_penalty=1.8),
             dict(presence_penalty=-0.05, frequency_penalty=0.3, repetition_penalty=1.2)]
_NUMPY_NAMES = {"presence_penalty": "presence", "frequency_penalty": "frequency", "repetition_penalty": "repetition"}


@pytest.mark.parametrize("penalty", PENALTIES, ids=lambda p: "+".join(p))
def test_penalised_greedy_tokens_are_argmax_of_penalised_transformers_logits(make_llm, tiny, penalty):
    llm = make_llm()
    prompt = PROMPTS[1]
    out = generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, **penalty))[0]
    logits = tiny.logits(prompt + out)[len(prompt) - 1 : -1]
    kwargs = {_NUMPY_NAMES[k]: v for k, v in penalty.items()}
    expected = [int(np.argmax(penalised(row, prompt, out[:t], **kwargs))) for t, row in enumerate(logits)]
    assert out == expected
    assert out != tiny.greedy(prompt, 16)  # and the penalty mattered


def test_logit_bias_is_added_to_the_logits(make_llm, tiny):
    llm = make_llm()
    target = tiny.greedy(PROMPTS[0])[1]
    out = generate(llm, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                    logit_bias={target: 100.0}))[0]
    assert out == [target] * 4


# -- stopping -------------------------------------------------------------------------------

def test_max_tokens_finishes_with_reason_length(make_llm):
    out = make_llm().generate(tokens_prompt(PROMPTS[0]), SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5
    assert (out.finish_reason, out.stop_reason) == ("length", None)


def test_generation_stops_at_max_model_len(make_llm):
    llm = make_llm(max_model_len=32)
    out = llm.generate(tokens_prompt(PROMPTS[0]), SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(PROMPTS[0]) + len(out.token_ids) == 32
    assert out.finish_reason == "length"


def test_stop_token_id_ends_generation_with_it_as_stop_reason(make_llm, tiny):
    ref = tiny.greedy(PROMPTS[0])
    i = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])
    out = make_llm().generate(tokens_prompt(PROMPTS[0]), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                        stop_token_ids=[ref[i]], ignore_eos=True),
                              use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[: i + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", ref[i])


def test_eos_ends_generation_with_reason_stop(make_llm, eos_tiny):
    model, eos = eos_tiny
    out = make_llm(model.path).generate(tokens_prompt(PROMPTS[0]), SamplingParams(temperature=0.0, max_tokens=8),
                                        use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [eos]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)


def test_ignore_eos_generates_past_eos(make_llm, eos_tiny, tiny):
    model, _ = eos_tiny
    out = generate(make_llm(model.path), PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert out == [tiny.greedy(PROMPTS[0], 8)]


def test_min_tokens_suppresses_eos_like_transformers_min_new_tokens(make_llm, eos_tiny):
    model, eos = eos_tiny
    out = generate(make_llm(model.path), PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=4))[0]
    assert eos not in out[:4]
    assert out == model.greedy(PROMPTS[0], 12, min_tokens=4, eos=eos)


def test_min_tokens_suppresses_stop_token_ids(make_llm, tiny):
    stop = tiny.greedy(PROMPTS[0])[0]
    params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=3, stop_token_ids=[stop], ignore_eos=True)
    out = make_llm().generate(tokens_prompt(PROMPTS[0]), params, use_tqdm=False)[0].outputs[0]
    assert stop not in out.token_ids[:3]
    assert out.token_ids[0] == int(np.argsort(-tiny.logits(PROMPTS[0])[-1], kind="stable")[1])


# -- engine control: abort and priority ------------------------------------------------------

def test_abort_mid_generation_frees_all_blocks(make_llm):
    engine = make_llm(max_num_batched_tokens=8, max_num_seqs=4).engine
    bm = engine.scheduler.block_manager
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(f"r{i}", tokens_prompt(p), long)
    engine.add_request("forked", tokens_prompt(PROMPTS[0]), SamplingParams(n=3, temperature=1.0, max_tokens=100))
    for _ in range(10):
        engine.step()
    assert bm.num_free_blocks < bm.num_blocks
    for rid in ("r0", "r1", "r2", "forked"):
        assert engine.abort_request(rid)
    assert bm.num_free_blocks == bm.num_blocks
    done = run_to_completion(engine)
    assert sorted(done) == ["forked", "r0", "r1", "r2"]
    assert all(c.finish_reason == "abort" for o in done.values() for c in o.outputs)


def test_abort_of_a_waiting_request_reports_it_aborted(make_llm):
    engine = make_llm().engine
    engine.add_request("w", tokens_prompt(PROMPTS[0]), GREEDY)
    assert engine.abort_request("w")
    assert not engine.abort_request("unknown")
    [out] = engine.step()
    assert out.finished and out.outputs[0].finish_reason == "abort"


@pytest.mark.parametrize("policy, expected", [("priority", ["b", "c", "a"]), ("fcfs", ["a", "b", "c"])])
def test_scheduling_policy_order_when_only_one_request_fits(make_llm, policy, expected):
    engine = make_llm(max_num_seqs=1, scheduling_policy=policy).engine
    for rid, priority in (("a", 5), ("b", 0), ("c", 3)):
        engine.add_request(rid, tokens_prompt(PROMPTS[1]), SamplingParams(temperature=0.0, max_tokens=2),
                           priority=priority)
    assert list(run_to_completion(engine)) == expected


def test_generate_rejects_a_priority_list_of_the_wrong_length(make_llm):
    with pytest.raises(ValueError, match="got 2 priority values for 3 prompts"):
        make_llm(scheduling_policy="priority").generate([tokens_prompt(p) for p in PROMPTS[:3]], GREEDY,
                                                       use_tqdm=False, priority=[1, 2])


def test_generate_passes_priorities_to_the_engine(make_llm, tiny):
    llm = make_llm(max_num_seqs=1, scheduling_policy="priority")
    outs = llm.generate([tokens_prompt(p) for p in PROMPTS[:3]], GREEDY, use_tqdm=False, priority=[2, 0, 1])
    assert [o.outputs[0].token_ids for o in outs] == [tiny.greedy(p) for p in PROMPTS[:3]]
    first = [o.metrics["first_token_time"] for o in outs]
    assert first[1] < first[2] < first[0]


# -- bad input: each a clear error -----------------------------------------------------------

def test_empty_prompt_is_rejected(make_llm):
    with pytest.raises(ValueError, match="empty"):
        make_llm().engine.add_request("e", tokens_prompt([]), GREEDY)


def test_prompt_longer_than_max_model_len_is_rejected(make_llm):
    with pytest.raises(ValueError, match="max_model_len"):
        make_llm(max_model_len=16).engine.add_request("long", tokens_prompt(PROMPTS[0]), GREEDY)


@pytest.mark.parametrize("bad", [[5, VOCAB], [-1, 5]], ids=["past_the_end", "negative"])
def test_token_id_outside_the_vocabulary_is_rejected(make_llm, bad):
    with pytest.raises(ValueError, match="vocabulary"):
        make_llm().engine.add_request("v", tokens_prompt(bad), GREEDY)


def test_logit_bias_outside_the_vocabulary_is_rejected(make_llm):
    llm = make_llm()
    with pytest.raises(ValueError, match="logit_bias"):
        llm.engine.add_request("b", tokens_prompt(PROMPTS[1]), SamplingParams(logit_bias={VOCAB: 1.0}))
    assert generate(llm, PROMPTS[1:2]) != [[]]  # and the engine still serves


def test_stop_token_id_outside_the_vocabulary_is_rejected(make_llm):
    params = SamplingParams(stop_token_ids=[VOCAB + 5], min_tokens=2)
    with pytest.raises(ValueError, match="stop_token_ids"):
        make_llm().engine.add_request("s", tokens_prompt(PROMPTS[1]), params)


def test_stop_strings_without_a_tokenizer_are_rejected(make_llm):
    with pytest.raises(ValueError, match="stop"):
        make_llm().engine.add_request("s", tokens_prompt(PROMPTS[1]), SamplingParams(stop=["x"]))


def test_text_prompt_without_a_tokenizer_is_rejected(make_llm):
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        make_llm().engine.add_request("t", "hello", GREEDY)


def test_duplicate_request_id_is_rejected(make_llm):
    engine = make_llm().engine
    engine.add_request("same", tokens_prompt(PROMPTS[1]), GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("same", tokens_prompt(PROMPTS[0]), GREEDY)
    run_to_completion(engine)


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
    ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0), ("max_tokens", 0),
    ("min_tokens", -1), ("min_tokens", 17), ("logprobs", -1), ("stop", ["ok", ""]), ("seed", 1.5),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("args, message", [pytest.param(*case, id="-".join(f"{k}={v}" for k, v in case[0].items())) for case in [
    (dict(scheduling_policy="lifo"), "scheduling_policy must be one of fcfs, priority"),
    (dict(max_num_seqs=0), "max_num_seqs must be a positive integer"),
    (dict(max_num_seqs=8, max_num_batched_tokens=4), r"max_num_batched_tokens \(4\) must be >= max_num_seqs \(8\)"),
    (dict(block_size=0), "block_size must be a positive integer"),
    (dict(max_model_len=0), "max_model_len must be a positive integer"),
    (dict(max_model_len=1000), "max_model_len=1000 exceeds the model's max_position_embeddings=256"),
    (dict(num_gpu_blocks_override=0), "num_gpu_blocks_override must be a positive integer"),
    (dict(num_gpu_blocks_override=2), "needs 16 KV blocks of 16 tokens but the cache has 2"),
    (dict(dtype="float64"), "dtype float64 is not supported by backend 'torch'"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=64), "with chunked prefill off"),
]])
def test_invalid_engine_args_are_clear_errors(tiny, args, message):
    with pytest.raises(ValueError, match=message):
        LLMEngine(EngineArgs(model=tiny.path, backend="torch", skip_tokenizer_init=True, **args))


def test_unknown_model_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError, match="no model at .*no-such-model"):
        LLMEngine(EngineArgs(model=str(missing), backend="torch"))


@pytest.mark.parametrize("backend, message", [("ascend", "backend 'ascend' unavailable: .+"),
                                              ("no-such-backend", "unknown backend 'no-such-backend' .*known: ")])
def test_unavailable_backend_is_a_clear_error(tiny, backend, message):
    with pytest.raises(BackendUnavailableError, match=message):
        LLM(tiny.path, backend=backend, skip_tokenizer_init=True)


def test_generate_returns_an_error_output_for_a_bad_request_among_good_ones(make_llm, tiny):
    llm = make_llm(max_model_len=32)
    prompts = [PROMPTS[1], [], PROMPTS[3], [VOCAB], list(range(40)), PROMPTS[4], PROMPTS[1]]
    params = [GREEDY] * 6 + [SamplingParams(logit_bias={VOCAB: 1.0})]
    outs = llm.generate([tokens_prompt(p) for p in prompts], params, use_tqdm=False)
    assert [o.error is not None for o in outs] == [False, True, False, True, True, False, True]
    for o, p in zip(outs, prompts):
        if o.error is None:
            assert o.outputs[0].token_ids == tiny.greedy(p)
        else:
            assert o.finished and o.outputs[0].finish_reason == "error" and o.outputs[0].token_ids == []
    assert "empty" in outs[1].error and "vocabulary" in outs[3].error and "max_model_len" in outs[4].error
    assert "logit_bias" in outs[6].error


# -- any scheduling configuration gives the same tokens --------------------------------------

SHARED = PROMPTS[2]
POOL = PROMPTS + [SHARED + [7], SHARED + [9, 11], SHARED[:20]]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(order=st.permutations(range(len(POOL))), count=st.integers(1, len(POOL)),
       block_size=st.sampled_from([1, 4, 16]), extra_blocks=st.integers(0, 40),
       budget=st.integers(4, 64), max_num_seqs=st.integers(1, 4), threshold=st.sampled_from([0, 3]),
       prefix_caching=st.booleans(), policy=st.sampled_from(["fcfs", "priority"]), backend=st.sampled_from(BACKENDS))
def test_greedy_output_does_not_depend_on_scheduling(make_llm, tiny, order, count, block_size, extra_blocks, budget,
                                                     max_num_seqs, threshold, prefix_caching, policy, backend):
    max_model_len = 64
    llm = make_llm(backend=backend, block_size=block_size, max_model_len=max_model_len,
                   num_gpu_blocks_override=-(-max_model_len // block_size) + extra_blocks,
                   max_num_batched_tokens=max(budget, max_num_seqs), max_num_seqs=max_num_seqs,
                   long_prefill_token_threshold=threshold, enable_prefix_caching=prefix_caching,
                   scheduling_policy=policy)
    prompts = [POOL[i] for i in order[:count]]
    priority = [i % 3 for i in range(count)]
    assert generate(llm, prompts, priority=priority) == [tiny.greedy(p) for p in prompts]
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_forked_completions_survive_preemption(make_llm, tiny):
    llm = make_llm(block_size=4, max_model_len=64, num_gpu_blocks_override=16)
    params = [SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=16, ignore_eos=True, logprobs=0)] + \
             [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)] * 2
    outs = llm.generate([tokens_prompt(p) for p in PROMPTS[:3]], params, use_tqdm=False)
    assert llm.engine.scheduler.get_stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs[1:]] == [tiny.greedy(p, 16) for p in PROMPTS[1:3]]
    for c in outs[0].outputs:
        assert len(c.token_ids) == 16
        ref = tiny.log_softmax_after(PROMPTS[0], c.token_ids)
        got = [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)]
        np.testing.assert_allclose(got, ref[np.arange(16), c.token_ids], atol=1e-4)
