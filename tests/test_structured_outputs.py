"""Structured outputs through the engine: grammars constrain a random tiny model.

The model is a tiny random Llama with the byte-level BPE tokenizer of the
server tests: left alone it writes noise, so every valid output below is the
grammar's doing. Outputs are checked by tools nobody here wrote (`json` +
`jsonschema`, `re.fullmatch`, the tokenizer's own decode), on both grammar
libraries.
"""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import Future

import jsonschema
import numpy as np
import pytest
import transformers
from server_harness import make_tiny_model_dir

from infer.core.async_engine import AsyncLLM
from infer.core.llm import LLM
from infer.core.sampling_batch import token_bitmask
from infer.core.sampling_params import SamplingParams
from infer.core.structured import Matcher, StructuredOutputs, StructuredOutputsParams as S

GRAMMAR_BACKENDS = ("xgrammar", "guidance")
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "tag": {"type": "string", "enum": ["red", "green", "blue"]},
        "code": {"type": "string", "pattern": "^[a-c]{2,4}$"},
        "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1,
                  "maxItems": 3},
    },
    "required": ["id", "ok", "tag", "code", "items"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-f]{2,3}"
CHOICES = ["alpha", "beta", "gamma delta", "ünï"]
GBNF = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9]'
LARK = 'start: "[" WORD ("," WORD)? "]"\nWORD: /[xyz]{1,3}/'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny-structured"), seed=3))


@pytest.fixture(scope="module", params=GRAMMAR_BACKENDS)
def llm(request, model_dir):
    engine = LLM(model_dir, backend="torch", max_num_seqs=8, max_model_len=256, num_gpu_blocks_override=64,
                 structured_outputs_backend=request.param)
    yield engine
    engine.engine.shutdown()


def sampled(**kw) -> SamplingParams:
    return SamplingParams(**{"n": 3, "temperature": 1.0, "seed": 7, "max_tokens": 96, **kw})


def texts(out) -> list[str]:
    assert all(c.finish_reason == "stop" for c in out.outputs), [(c.text, c.finish_reason) for c in out.outputs]
    return [c.text for c in out.outputs]


def test_json_schema_outputs_validate_under_every_sampling_setting(llm):
    settings = [dict(temperature=0.0, n=1), dict(), dict(top_k=5, top_p=0.8), dict(min_p=0.2, temperature=1.5),
                dict(repetition_penalty=1.3, presence_penalty=1.0, frequency_penalty=0.5),
                # a huge bias toward '}' and the EOS token: only the grammar keeps the output valid
                dict(logit_bias={llm.get_tokenizer().convert_tokens_to_ids("}"): 100.0,
                                 llm.get_tokenizer().eos_token_id: 100.0})]
    # Compact JSON: a random model left free whitespace would write it forever.
    params = [sampled(**{**kw, "structured_outputs": S(json=SCHEMA, disable_any_whitespace=True)}) for kw in settings]
    for out in llm.generate([f"Return record {i}:" for i in range(len(params))], params, use_tqdm=False):
        for text in texts(out):
            jsonschema.validate(json.loads(text), SCHEMA)


def test_regex_choice_and_both_grammar_syntaxes(llm):
    tok = llm.get_tokenizer()
    outs = llm.generate(["a", "b", "c", "d"], [
        sampled(structured_outputs=S(regex=REGEX)), sampled(structured_outputs=S(choice=CHOICES)),
        sampled(structured_outputs=S(grammar=GBNF)), sampled(structured_outputs=S(grammar=LARK))], use_tqdm=False)
    regex, choice, gbnf, lark = (texts(o) for o in outs)
    assert all(re.fullmatch(REGEX, t) for t in regex), regex
    assert all(t in CHOICES for t in choice), choice
    assert all(re.fullmatch(r"\([1-9](\+[1-9])*\)", t) for t in gbnf), gbnf
    assert all(re.fullmatch(r"\[[xyz]{1,3}(,[xyz]{1,3})?\]", t) for t in lark), lark
    # The text is the tokenizer's own decode of the tokens (the grammar worked on token ids).
    for o in outs:
        for c in o.outputs:
            assert tok.decode(c.token_ids, skip_special_tokens=True) == c.text


def test_json_object_and_whitespace_options(llm):
    (out,) = llm.generate(["{"], sampled(n=4, structured_outputs=S(json_object=True, disable_any_whitespace=True)),
                          use_tqdm=False)
    # Free keys and values may run past max_tokens; those that end are objects.
    done = [c.text for c in out.outputs if c.finish_reason == "stop"]
    assert done and all(isinstance(json.loads(t), dict) for t in done)
    (out,) = llm.generate(["{"], sampled(structured_outputs=S(json=SCHEMA, disable_any_whitespace=True)),
                          use_tqdm=False)
    for t in texts(out):
        jsonschema.validate(json.loads(t), SCHEMA)
        # One of the two standard layouts (xgrammar writes ", " and ": "), never free whitespace.
        assert t in (json.dumps(json.loads(t), separators=sep, ensure_ascii=False) for sep in ((",", ":"), (", ", ": ")))


def test_unconstrained_and_constrained_requests_share_a_batch(llm):
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["The sky"], free, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(["The sky", "x"], [free, sampled(structured_outputs=S(regex=REGEX))], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone  # an all-ones row changes nothing
    assert all(re.fullmatch(REGEX, t) for t in texts(mixed[1]))


def test_unmasked_first_sampling_gives_the_masked_tokens(llm, monkeypatch):
    """Rows that sample without their mask first (greedy, or unfiltered sampling)
    and rows that must not (top-k/top-p/min-p) give exactly the tokens of masking
    every row every step, with and without logprobs and min_tokens bans."""
    from infer.core import engine as engine_mod

    loose = S(regex=r"[a-z ]{3,40}\.")  # room for the model's own choice: some first choices pass
    specs = [S(json=SCHEMA, disable_any_whitespace=True), loose, S(choice=CHOICES)]
    settings = [dict(temperature=0.0, n=1), dict(), dict(logprobs=3, min_tokens=4),
                dict(top_k=5), dict(top_p=0.7), dict(min_p=0.1)]
    params = [sampled(max_tokens=48, **kw, structured_outputs=spec) for spec in specs for kw in settings]
    prompts = [f"Item {i}:" for i in range(len(params))]
    verdicts = []
    allows = {kind: kind.allows for kind in {type(m) for m in (llm.engine.structured.compile(x).result().matcher()
                                                                 for x in specs)}}
    for kind, real in allows.items():
        monkeypatch.setattr(kind, "allows", lambda self, t, real=real: verdicts.append(real(self, t)) or verdicts[-1])
    skipped = llm.engine.grammar_masks_skipped
    lazy = llm.generate(prompts, params, use_tqdm=False)
    assert True in verdicts and False in verdicts  # both the kept and the resampled path ran
    assert llm.engine.grammar_masks_skipped - skipped == verdicts.count(True)
    # A refused row masks first for one step only, then tries unmasked again.
    unfiltered = [o for i, o in enumerate(lazy) if i % len(settings) < 3]
    assert len(verdicts) >= sum(len(c.token_ids) // 2 for o in unfiltered for c in o.outputs)
    monkeypatch.setattr(engine_mod, "deferrable", lambda c: False)
    eager = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(lazy, eager):
        for x, y in zip(a.outputs, b.outputs):
            assert x.token_ids == y.token_ids and x.text == y.text
            assert x.logprobs == y.logprobs and x.cumulative_logprob == pytest.approx(y.cumulative_logprob)
    assert all(re.fullmatch(r"[a-z ]{3,40}\.", t) for t in texts(lazy[len(settings)]))


def test_min_tokens_bans_eos_only_while_the_grammar_allows_more():
    class Fixed(Matcher):  # a matcher that allows the given tokens (and ends nowhere)
        def __init__(self, allowed):
            self.allowed = allowed

        def is_terminated(self):
            return False

        def fill_bitmask(self, mask, row):
            mask[row] = 0
            for t in self.allowed:
                mask[row, t // 32] |= np.int32(1 << (t % 32)) if t % 32 < 31 else np.int32(-(2**31))

    class Row:
        reasoning = None

        def __init__(self, allowed, banned):
            self.matcher, self._banned = Fixed(allowed), banned

        def banned_tokens(self, ahead=0):
            return self._banned

    mask = token_bitmask([Row([3, 63], (63,)), Row([63], (63,)), Row([31, 5], (31, 5))], vocab_size=70)
    bits = ((mask.astype(np.int64)[:, :, None] >> np.arange(32)) & 1).reshape(3, -1)[:, :70]
    assert np.flatnonzero(bits[0]).tolist() == [3]  # EOS (63) banned: the grammar allows 3 too
    assert np.flatnonzero(bits[1]).tolist() == [63]  # the grammar allows only EOS: the ban yields
    assert np.flatnonzero(bits[2]).tolist() == [5, 31]  # everything banned would leave nothing: kept


def test_min_tokens_with_a_grammar_still_ends(llm):
    (out,) = llm.generate(["x"], sampled(min_tokens=40, structured_outputs=S(choice=["ab", "cd"])), use_tqdm=False)
    assert all(t in ("ab", "cd") for t in texts(out))


def test_preemption_keeps_the_grammar_state(model_dir):
    # 12 KV blocks of 16 tokens for 6 requests of ~60-110 tokens: some are preempted and recomputed.
    llm = LLM(model_dir, backend="torch", max_num_seqs=6, max_model_len=160, num_gpu_blocks_override=12,
              block_size=16)
    p = SamplingParams(temperature=0.8, seed=1, max_tokens=100,
                       structured_outputs=S(json=SCHEMA, disable_any_whitespace=True))
    outs = llm.generate([f"record {i}:" for i in range(6)], p, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for o in outs:
        for t in texts(o):
            jsonschema.validate(json.loads(t), SCHEMA)
    # The same seeds without preemption give the same tokens.
    roomy = LLM(model_dir, backend="torch", max_num_seqs=6, max_model_len=160, num_gpu_blocks_override=64)
    again = roomy.generate([f"record {i}:" for i in range(6)], p, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in again]


def test_a_bad_grammar_is_the_prompts_error_offline_and_a_value_error_async(llm):
    good, bad = llm.generate(["x", "y"], [sampled(n=1, structured_outputs=S(regex="a|b")),
                                          sampled(n=1, structured_outputs=S(regex="a(b"))], use_tqdm=False)
    assert good.outputs[0].text in ("a", "b")
    assert bad.outputs[0].finish_reason == "error" and "structured_outputs.regex" in bad.error

    async def go():
        engine = AsyncLLM(llm.engine)
        try:
            with pytest.raises(ValueError, match="structured_outputs.json cannot be compiled"):
                await engine.generate("r1", "x", sampled(structured_outputs=S(json={"type": "objectx"})))
        finally:
            engine.shutdown()
    asyncio.run(go())


def test_a_request_waits_for_its_grammar_while_others_decode(llm):
    engine = llm.engine
    pending: Future = Future()
    real = engine.structured.compile
    engine.structured.compile = lambda spec: pending if spec.regex == "slow" else real(spec)
    try:
        engine.add_request("free", "x", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
        engine.add_request("slow", "x", sampled(n=2, structured_outputs=S(regex="slow")))
        engine.add_request("gone", "x", sampled(n=1, structured_outputs=S(regex="slow")))
        assert engine.abort_request("gone")
        finished = {}
        for _ in range(5):  # the free request runs to its end meanwhile
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        assert set(finished) == {"free", "gone"} and finished["gone"].outputs[0].finish_reason == "abort"
        assert "slow" in engine.output.states and not engine.scheduler.requests
        pending.set_result(real(S(regex="ab|cd")).result())
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        assert all(t in ("ab", "cd") for t in texts(finished["slow"]))
        # A compile that fails after the request was queued ends it as aborted.
        pending = Future()
        engine.add_request("fails", "x", sampled(n=1, structured_outputs=S(regex="slow")))
        pending.set_exception(ValueError("structured_outputs.regex cannot be compiled: no"))
        (out,) = [o for o in engine.step() if o.request_id == "fails"]
        assert out.finished and out.outputs[0].finish_reason == "abort"
        assert not engine.has_unfinished_requests()
    finally:
        engine.structured.compile = real


def test_a_caller_that_gives_up_does_not_poison_the_compile_cache(llm):
    """Cancelling the awaiting task leaves the shared compile running; a cancelled future in
    the cache (should one get there) is compiled again, not handed out."""
    engine = AsyncLLM(llm.engine)
    spec = S(regex="[a-z]{3}-cancel")

    async def go():
        task = asyncio.ensure_future(engine.generate("c1", "x", sampled(n=1, structured_outputs=spec)))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stream = await engine.generate("c2", "x", sampled(n=1, structured_outputs=spec))
        return [o async for o in stream][-1]

    try:
        out = asyncio.run(go())
        assert re.fullmatch("[a-z]{3}-cancel", out.outputs[0].text)
    finally:
        engine.shutdown()
    so = llm.engine.structured
    cancelled: Future = Future()
    cancelled.cancel()
    so._cache[S(regex="zz").key()] = cancelled
    assert so.compile(S(regex="zz")).result().matcher() is not None


def test_compiled_grammars_are_cached_by_spec(llm):
    so = llm.engine.structured
    a = so.compile(S(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    b = so.compile(S(json='{"type": "object", "properties": {"a": {"type": "integer"}}}'))
    c = so.compile(S(json={"type": "object", "properties": {"b": {"type": "integer"}}}))
    assert a is b and a is not c


@pytest.mark.parametrize("backend", GRAMMAR_BACKENDS)
def test_matcher_rollback_and_allows_leave_the_mask(backend, model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    so = StructuredOutputs(backend, tok, len(tok), (tok.eos_token_id,))
    m = so.compile(S(regex="[a-z]+-[0-9]+")).result().matcher()
    masks = np.zeros((3, -(-len(tok) // 32)), np.int32)
    ids = tok("abc-12", add_special_tokens=False).input_ids
    assert len(ids) > 2
    for t in ids[:2]:
        assert m.accept(t)
    m.fill_bitmask(masks, 0)
    for t in ids[2:]:
        assert m.accept(t)
    m.fill_bitmask(masks, 1)
    assert not (masks[0] == masks[1]).all()
    m.rollback(len(ids) - 2)
    m.fill_bitmask(masks, 2)
    assert (masks[0] == masks[2]).all()
    assert not m.accept(tok.convert_tokens_to_ids("]"))  # a token the grammar forbids here
    assert not m.is_terminated()
    # `allows` answers as the mask's bit does, for every token, and moves nothing.
    for t in ids[2:]:
        assert m.accept(t)
    bits = lambda row: [bool((int(masks[row, t // 32]) >> (t % 32)) & 1) for t in range(len(tok))]  # noqa: E731
    m.fill_bitmask(masks, 0)
    assert [m.allows(t) for t in range(len(tok))] == bits(0)
    assert bits(0)[tok.eos_token_id] and m.allows(tok.eos_token_id) and not m.is_terminated()
    m.fill_bitmask(masks, 2)
    assert (masks[0] == masks[2]).all() and (masks[1] == masks[2]).all()
    so.shutdown()


def test_whitespace_pattern_falls_back_to_guidance_under_auto(model_dir):
    llm = LLM(model_dir, backend="torch", max_model_len=256, num_gpu_blocks_override=32)
    spec = S(json=SCHEMA, whitespace_pattern=r"[ ]?")
    assert llm.engine.structured.compile(spec).result().backend.name == "guidance"
    (out,) = llm.generate(["{"], sampled(structured_outputs=spec), use_tqdm=False)
    for t in texts(out):
        jsonschema.validate(json.loads(t), SCHEMA)
        assert "\n" not in t


@pytest.mark.parametrize("bad, match", [
    (dict(), "exactly one of"), (dict(regex="a", choice=["a"]), "exactly one of"),
    (dict(json="{not json"), "not valid JSON"), (dict(json=[1]), "JSON schema"),
    (dict(choice=[]), "non-empty list"), (dict(choice=["a", ""]), "non-empty"), (dict(regex=""), "non-empty"),
])
def test_spec_validation_names_the_problem(bad, match):
    with pytest.raises(ValueError, match=match):
        S(**bad)


def test_sampling_params_take_a_dict_and_refuse_unknown_fields():
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs == S(regex="a+")
    with pytest.raises(ValueError, match="unknown fields"):
        SamplingParams(structured_outputs={"regexp": "a+"})
    with pytest.raises(ValueError, match="structured_outputs_backend"):
        StructuredOutputs("outlines", None, 10, ())


def test_the_grammar_waits_for_the_end_of_the_reasoning(model_dir):
    """deepseek_r1: reasoning until "</think>"; the tokens up to it are neither masked nor fed to the grammar."""
    from infer.core.detokenizer import IncrementalDetokenizer
    from infer.core.request import Request
    from infer.core.request_state import CompletionState
    from infer.core.scheduler_output import StepOutput
    from infer.server.reasoning import DeepSeekR1ReasoningParser

    class Recorder(Matcher):
        def __init__(self):
            self.accepted = []

        def accept(self, token):
            self.accepted.append(token)
            return True

        def is_terminated(self):
            return False

        def fill_bitmask(self, mask, row):
            mask[row] = 0

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompt = tok("q", add_special_tokens=False).input_ids
    reasoning = tok("mull it over</think>", add_special_tokens=False).input_ids
    answer = tok("ab", add_special_tokens=False).input_ids
    req = Request("r", prompt)
    comp = CompletionState(0, req, SamplingParams(structured_outputs=S(regex="ab")), 0,
                           IncrementalDetokenizer(tok, prompt), matcher=Recorder(),
                           reasoning=DeepSeekR1ReasoningParser())
    for i, t in enumerate(reasoning + answer):
        waiting = i < len(reasoning)
        assert (token_bitmask([comp], len(tok)) is None) == waiting
        req.append_output_token(t)
        comp.on_token(StepOutput(["r"], np.array([t]), np.array([0.0], np.float32)), 0, tok.decode)
    assert comp.reasoning is None and comp.matcher.accepted == answer


def test_an_answer_that_opens_no_reasoning_block_is_fed_to_the_grammar_from_its_first_token(model_dir):
    """qwen3: an output that does not start with <think> is all answer; the tokens sampled
    before that was known go to the grammar too, so it does not start over."""
    from infer.core.detokenizer import IncrementalDetokenizer
    from infer.core.request import Request
    from infer.core.request_state import CompletionState
    from infer.core.scheduler_output import StepOutput
    from infer.server.reasoning import Qwen3ReasoningParser

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    so = StructuredOutputs("xgrammar", tok, len(tok), (tok.eos_token_id,))
    prompt = tok("q", add_special_tokens=False).input_ids
    answer = tok("abc-12", add_special_tokens=False).input_ids
    req = Request("r", prompt)
    comp = CompletionState(0, req, SamplingParams(), 0, IncrementalDetokenizer(tok, prompt),
                           matcher=so.compile(S(regex="abc-12")).result().matcher(),
                           reasoning=Qwen3ReasoningParser())
    for t in answer:
        req.append_output_token(t)
        comp.on_token(StepOutput(["r"], np.array([t]), np.array([0.0], np.float32)), 0, tok.decode)
    assert comp.reasoning is None and comp.matcher is not None and comp.matcher.is_terminated() is False
    assert comp.matcher.accept(tok.eos_token_id) and comp.matcher.is_terminated()  # the whole answer was taken
    so.shutdown()


def test_torch_bitmask_native_kernel_byte_table_and_shifts_agree_bit_for_bit(monkeypatch):
    """The three ways the torch backend applies a bitmask: the native CPU kernel, the byte
    table (other devices, little-endian hosts) and the shifts (big-endian hosts)."""
    import sys

    import torch

    from infer.backends.torch_native import sampling
    from infer.backends.torch_native.native import ops as native

    g = torch.Generator().manual_seed(0)
    for vocab in (100, 1000, 49152):
        x = torch.randn(3, vocab, generator=g)
        mask = torch.randint(-(2**31), 2**31 - 1, (3, -(-vocab // 32)), dtype=torch.int32, generator=g)
        mask[0], mask[1, ::2] = -1, 0  # an unconstrained row; words that allow nothing
        kernel = native.token_bitmask(x, mask)
        assert kernel is not None
        with monkeypatch.context() as m:
            m.setattr(native, "token_bitmask", lambda x, b: None)
            table = sampling.apply_token_bitmask(x, mask)
            m.setattr(sys, "byteorder", "big")
            shifts = sampling.apply_token_bitmask(x, mask)
        expected = [[bool((int(mask[r, t // 32]) >> (t % 32)) & 1) for t in range(vocab)] for r in range(3)]
        assert torch.equal(torch.isfinite(kernel), torch.tensor(expected))
        assert torch.equal(kernel, table) and torch.equal(kernel, shifts)
        assert torch.equal(kernel[torch.isfinite(kernel)], x[torch.isfinite(kernel)])
        assert sampling.apply_token_bitmask(x, mask) is not x
