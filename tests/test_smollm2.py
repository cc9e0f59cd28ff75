"""Acceptance: the real SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32)
generates exactly what transformers generates from the same weights.

All prompts go in one batch through a small token budget, so prompts are
chunked and mixed with other requests' decodes, and two of them share a long
prefix so the second takes the first's cached blocks.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from infer.core.llm import LLM
from infer.core.loader import load_model
from infer.core.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

NUM_TOKENS = 64
BUDGET = 64  # max_num_batched_tokens: every prompt longer than this is chunked

SYSTEM = ("You are a meticulous research assistant for a university library. You answer questions about history, "
          "science and literature. Keep answers short, cite the kind of source a reader could check, say plainly "
          "when you are unsure, and never invent quotations. Prefer simple words. When a question is ambiguous, "
          "answer the most likely reading and mention the other one in a single sentence at the end.")
LONG_TEXT = (
    "The printing press, developed in the middle of the fifteenth century, changed the way knowledge moved through "
    "Europe. Before it, books were copied by hand, usually in monasteries, and a single volume could take months to "
    "finish. Errors crept in with every copy, and only the wealthy or the church could afford a library. Movable "
    "metal type made it possible to print hundreds of identical pages in a day. Within fifty years, presses were "
    "running in more than two hundred cities, and millions of books had been printed. Scholars could now compare "
    "the same text in different places, which made it easier to notice mistakes and argue about them in public. "
    "Pamphlets spread political and religious ideas quickly, sometimes faster than authorities could respond. "
    "Literacy rose slowly at first, then faster as cheap books reached merchants and craftsmen. Historians still "
    "debate how much the press caused these changes and how much it simply sped up trends that had already begun. "
    "What is certain is that, by the year 1600, a European reader could own more books than a medieval king. "
    "Summarize the passage above in three sentences:")


def chat(*turns: str) -> list[dict]:
    roles = ["system", "user"] if len(turns) == 2 else ["user"]
    return [{"role": r, "content": c} for r, c in zip(roles, turns)]


# (kind, content): "chat" prompts go through the chat template, "plain" ones are tokenized as is.
PROMPTS = [
    ("chat", chat(SYSTEM, "Who wrote the novel Middlemarch, and when was it published?")),  # shares SYSTEM with [7]
    ("chat", chat("What is the capital of France?")),
    ("plain", LONG_TEXT),  # > 200 tokens
    ("plain", "1, 2, 3, 4, 5,"),
    ("chat", chat("Write a haiku about the sea.")),
    ("plain", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
    ("plain", "Bonjour, je m'appelle"),
    ("chat", chat(SYSTEM, "Explain in two sentences why the sky is blue.")),
    ("plain", "Once upon a time"),
]


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    # Decode GEMMs of a few rows are memory bound; two threads on a shared
    # 2-core machine (or beside another xdist worker) wait on each other at
    # every op and ran ~4x slower here than one.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2", backend="torch", dtype="float32", max_model_len=1024, max_num_seqs=16,
               max_num_batched_tokens=BUDGET, enable_chunked_prefill=True, enable_prefix_caching=True)


@pytest.fixture(autouse=True)
def _blocks_freed_after_each_test(llm, leak_check):
    leak_check.append(llm.engine)


@pytest.fixture(scope="module")
def hf_model():
    """transformers' Llama holding the very weights infer loaded (tied embeddings: no lm_head.weight)."""
    m = load_model("smollm2", load_tokenizer=False)
    c = m.config
    config = LlamaConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"], num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"], head_dim=c["head_dim"], rms_norm_eps=c["rms_norm_eps"],
        rope_parameters={"rope_type": "default", "rope_theta": c["rope_theta"]},
        max_position_embeddings=c["max_position_embeddings"], tie_word_embeddings=c["tie_word_embeddings"],
        hidden_act=c["hidden_act"], attention_bias=c["attention_bias"], mlp_bias=c["mlp_bias"],
        bos_token_id=c["bos_token_id"], eos_token_id=c["eos_token_id"], pad_token_id=c["pad_token_id"],
    )
    assert c["rope_scaling"] is None and c["tie_word_embeddings"]
    model = LlamaForCausalLM(config).eval()
    result = model.load_state_dict({k: torch.from_numpy(v) for k, v in m.weights.items()}, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def hf_greedy(model, prompt_ids: list[int]) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NUM_TOKENS,
                             eos_token_id=None, pad_token_id=0)  # no EOS: all NUM_TOKENS are compared
    return out[0, len(prompt_ids):].tolist()


def prompt_ids(llm, kind, content) -> list[int]:
    if kind == "chat":
        return llm.apply_chat_template(content)
    return llm.get_tokenizer()(content).input_ids


@pytest.fixture(scope="module")
def batch(llm):
    """Every prompt in one generate() call: (prompt ids, outputs, prefix-cache hits during the call)."""
    prompts = [prompt_ids(llm, kind, content) for kind, content in PROMPTS]
    hits_before = llm.engine.scheduler.get_stats().prefix_cache.hits
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return prompts, [o.outputs[0] for o in outs], llm.engine.scheduler.get_stats().prefix_cache.hits - hits_before


def test_greedy_batch_is_token_identical_to_transformers(batch, hf_model):
    prompts, outs, _ = batch
    lengths = [len(p) for p in prompts]
    assert max(lengths) > 200 and sum(n > BUDGET for n in lengths) >= 3  # long prompts really were chunked
    assert all(len(o.token_ids) == NUM_TOKENS for o in outs)
    for (kind, content), ids, out in zip(PROMPTS, prompts, outs):
        assert out.token_ids == hf_greedy(hf_model, ids), f"{kind} prompt {content!r:.60} diverged"


def test_prompts_sharing_a_system_message_hit_the_prefix_cache(batch, llm):
    *_, hits = batch
    shared = len(llm.apply_chat_template([PROMPTS[0][1][0]], add_generation_prompt=False))
    assert hits >= shared // llm.engine.cache_config.block_size * llm.engine.cache_config.block_size > 0


def test_generated_text_is_the_decoded_tokens(batch, llm):
    tok = llm.get_tokenizer()
    for out in batch[1]:
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)


FRANCE = chat("What is the capital of France?")
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


def test_chat_answers_the_capital_of_france(llm):
    out = llm.chat(FRANCE, GREEDY, use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm.engine.eos_token_ids  # ended by <|im_end|>


def test_stop_string_cuts_the_text_before_it(llm):
    params = SamplingParams(temperature=0.0, max_tokens=32, stop=["Paris"])
    out = llm.chat(FRANCE, params, use_tqdm=False)[0].outputs[0]
    assert "Paris" not in out.text and out.text.startswith("The capital of France")
    assert (out.finish_reason, out.stop_reason) == ("stop", "Paris")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_and_ending_mid_token(llm, include):
    # "ance is Par" starts inside " France", spans " is" and ends inside " Paris".
    params = SamplingParams(temperature=0.0, max_tokens=32, stop=["ance is Par"], include_stop_str_in_output=include)
    out = llm.chat(FRANCE, params, use_tqdm=False)[0].outputs[0]
    free = llm.chat(FRANCE, GREEDY, use_tqdm=False)[0].outputs[0].text
    end = free.index("ance is Par") + (len("ance is Par") if include else 0)
    assert out.text == free[:end]
    assert (out.finish_reason, out.stop_reason) == ("stop", "ance is Par")


def test_chat_answers_a_batch_of_conversations_in_order(llm):
    conversations = [chat("Name a primary colour."), FRANCE]
    batch = llm.chat(conversations, GREEDY, use_tqdm=False)
    alone = [llm.chat(c, GREEDY, use_tqdm=False)[0] for c in conversations]
    assert [o.outputs[0].text for o in batch] == [o.outputs[0].text for o in alone]
    assert "Paris" in batch[1].outputs[0].text


def test_logprobs_carry_the_decoded_tokens(llm):
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
    out = llm.chat(FRANCE, params, use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    for step, token in zip(out.logprobs, out.token_ids):
        assert step[token].rank == 1 and len(step) == 2
        assert all(lp.decoded_token == tok.decode([tid]) for tid, lp in step.items())
    assert " Paris" in [step[t].decoded_token for step, t in zip(out.logprobs, out.token_ids)]
