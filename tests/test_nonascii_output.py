"""Non-ASCII output through the engine and the server, checked against the text itself.

The model is a tiny Llama built to be a lookup table: its only path from
input to logits is embedding -> final norm -> lm_head (attention and MLP
outputs are zero), with one-hot embeddings and an lm_head that maps each token
of TEXT to the next. Greedy decoding therefore spells TEXT, token by token,
through the byte-level BPE tokenizer of the server tests, which splits its
emoji, CJK and accented characters across tokens. The oracle is TEXT and the
tokenizer's own ids and chat template: nothing that runs the engine's
detokenizer or the server's accounting.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import httpx
import pytest
import torch
import transformers
from server_harness import make_tokenizer

from infer.core.async_engine import AsyncLLM
from infer.core.engine import LLMEngine
from infer.core.llm import LLM
from infer.core.sampling_params import SamplingParams
from infer.server.app import create_app
from infer.server.metrics import Metrics
from infer.server.models import ModelRegistry, ServedModel

TEXT = " é日🙂Жω½!"  # 2-, 3- and 4-byte characters, each byte a token of its own, no token twice
PROMPT = "Say it:"
MESSAGES = [{"role": "user", "content": "Say it."}]


@dataclass
class Chain:
    """The lookup-table model's directory, its tokenizer, and the ids of TEXT it will say."""

    path: str
    tokenizer: transformers.PreTrainedTokenizerFast
    ids: list[int]


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> Chain:
    tok = make_tokenizer()
    ids = tok(TEXT, add_special_tokens=False).input_ids
    starts = {tok(PROMPT).input_ids[-1], chat_prompt(tok)[-1]}
    successor = {t: ids[0] for t in starts} | dict(zip(ids, ids[1:])) | {ids[-1]: tok.eos_token_id}
    # A lookup table needs each token to have one successor.
    assert len(successor) == len(starts) + len(ids) and not starts & set(ids), "pick a TEXT without repeated tokens"
    vocab = len(tok)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=vocab, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=5, num_key_value_heads=1, max_position_embeddings=256,
                                   tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                                   eos_token_id=tok.eos_token_id)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(vocab))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.zeros(vocab, vocab)
        for t, nxt in successor.items():
            head[nxt, t] = 1.0  # logit sqrt(vocab) for the successor after the final RMSNorm, 0 for the rest
        model.lm_head.weight.copy_(head)
    path = tmp_path_factory.mktemp("chain")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # some characters really are split
    return Chain(str(path), tok, ids)


def chat_prompt(tok) -> list[int]:
    return tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)


def engine(chain: Chain) -> LLMEngine:
    return LLMEngine(model=chain.path, backend="torch", max_num_seqs=4, max_model_len=256)


# -- the engine -----------------------------------------------------------------------------------

def test_engine_spells_the_text_and_every_intermediate_output_is_a_clean_prefix(chain):
    eng = engine(chain)
    eng.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=100))
    texts, final = [], None
    while eng.has_unfinished_requests():
        for out in eng.step():
            texts.append(out.outputs[0].text)
            final = out
    comp = final.outputs[0]
    assert comp.token_ids == chain.ids + [chain.tokenizer.eos_token_id] and comp.finish_reason == "stop"
    assert comp.text == TEXT
    for text in texts:
        assert "\ufffd" not in text and TEXT.startswith(text), text


def test_engine_stops_at_a_multibyte_stop_string(chain):
    eng = engine(chain)
    eng.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=100, stop=["日🙂"]))
    while eng.has_unfinished_requests():
        for out in eng.step():
            final = out.outputs[0]
    assert final.text == TEXT[: TEXT.index("日🙂")] and final.stop_reason == "日🙂"


def test_offline_chat_applies_the_template_and_spells_the_text(chain):
    llm = LLM(chain.path, backend="torch", max_num_seqs=4, max_model_len=256)
    out = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=100), use_tqdm=False)[0]
    assert out.prompt_token_ids == chat_prompt(chain.tokenizer)
    assert out.outputs[0].text == TEXT


# -- the server, in-process -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def app(chain):
    llm = AsyncLLM(engine(chain))
    yield create_app(ModelRegistry([ServedModel("chain", llm)]), Metrics())
    llm.shutdown()


def post(app, path: str, body: dict) -> httpx.Response:
    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=60) as http:
            return await http.post(path, json=body)

    return asyncio.run(run())


def events(r: httpx.Response) -> list[dict]:
    """The JSON events of an SSE body, which must end with [DONE]."""
    frames = r.text.split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""], frames[-3:]
    return [json.loads(f.removeprefix("data: ")) for f in frames[:-2]]


def test_completion_text_is_the_text(app, chain):
    r = post(app, "/v1/completions", {"prompt": PROMPT, "max_tokens": 100, "temperature": 0}).json()
    assert r["choices"][0]["text"] == TEXT and r["choices"][0]["finish_reason"] == "stop"
    n_prompt = len(chain.tokenizer(PROMPT).input_ids)
    assert r["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": len(chain.ids) + 1,
                          "total_tokens": n_prompt + len(chain.ids) + 1}


def test_streamed_completion_sends_whole_characters_only(app, chain):
    r = post(app, "/v1/completions", {"prompt": PROMPT, "max_tokens": 100, "temperature": 0, "stream": True,
                                      "stream_options": {"include_usage": True}})
    chunks = events(r)
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert all("\ufffd" not in t for t in texts) and "".join(texts) == TEXT
    n_prompt = len(chain.tokenizer(PROMPT).input_ids)
    assert chunks[-1]["usage"]["completion_tokens"] == len(chain.ids) + 1
    assert chunks[-1]["usage"]["prompt_tokens"] == n_prompt


def test_chat_content_is_the_text_streamed_or_not(app, chain):
    body = {"messages": MESSAGES, "max_tokens": 100, "temperature": 0}
    whole = post(app, "/v1/chat/completions", body).json()
    assert whole["choices"][0]["message"]["content"] == TEXT
    chunks = events(post(app, "/v1/chat/completions", body | {"stream": True}))
    deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]]
    assert all("\ufffd" not in d for d in deltas) and "".join(deltas) == TEXT


@pytest.mark.parametrize("n", [1, 2])
def test_chat_stream_usage_counts_the_tokens(app, chain, n):
    r = post(app, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 100, "temperature": 0, "n": n,
                                           "stream": True, "stream_options": {"include_usage": True}})
    chunks = events(r)
    n_prompt = len(chat_prompt(chain.tokenizer))
    n_completion = n * (len(chain.ids) + 1)  # the text's tokens and EOS, per choice
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": n_completion,
                                   "total_tokens": n_prompt + n_completion}
    assert all(c.get("usage") is None for c in chunks[:-1])
    for k in range(n):
        content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks
                          if c["choices"] and c["choices"][0]["index"] == k)
        assert content == TEXT
