"""Tool calling and reasoning output through `infer serve` and the official openai client.

A tiny random Llama writes noise unless a grammar constrains it, so valid calls
prove the constraint; the parsers' formats have their own golden tests
(test_tool_parsers.py, test_reasoning_parsers.py).
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import transformers
from server_harness import CHATML, Server, make_tiny_model_dir
from structured_schemas import TOOLS

from infer.server.tool_parsers import HermesToolParser

ENGINE = ["--backend", "torch", "--max-num-seqs", "8", "--max-model-len", "2048", "--num-gpu-blocks-override", "256"]
# ChatML that closes an empty reasoning block in the generation prompt (Qwen3 with thinking off).
NO_THINK = CHATML.replace("<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n")
# ChatML that renders the tools itself.
WITH_TOOLS = "{% if tools %}<|im_start|>system\nTOOLS {{ tools | tojson }}<|im_end|>\n{% endif %}" + CHATML


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny-tools"), seed=4, max_positions=2048))


@pytest.fixture(scope="module")
def server(model_dir):
    srv = Server(["--model", model_dir, "--served-model-name", "tiny-a", *ENGINE])
    yield srv
    assert srv.stop() == 0, "".join(srv.log)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_named_and_required_tool_choice_give_valid_calls_streamed_or_not(client):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    base = dict(model="tiny-a", messages=[{"role": "user", "content": "weather?"}], tools=TOOLS, temperature=1.0,
                seed=3, max_tokens=96)
    # parallel_tool_calls=False: one call (a random model would otherwise list calls until max_tokens).
    for choice, extra in (({"type": "function", "function": {"name": "get_weather"}}, {}),
                          ("required", {"parallel_tool_calls": False})):
        whole = client.chat.completions.create(**base, tool_choice=choice, n=2, **extra)
        chunks = list(client.chat.completions.create(**base, tool_choice=choice, n=2, stream=True, **extra))
        # A forced named function ends with "stop" (as OpenAI and vLLM), calls the model chose with "tool_calls".
        reason = "stop" if isinstance(choice, dict) else "tool_calls"
        for c in whole.choices:
            assert c.finish_reason == reason and c.message.tool_calls, c
            calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
            for name, args in calls:
                jsonschema.validate(json.loads(args), schemas[name])
                assert name == "get_weather" or choice == "required"
            assert all(t.id.startswith("call_") and t.type == "function" for t in c.message.tool_calls)
            # The stream's fragments, put together per call index, are the same calls.
            streamed: dict[int, list] = {}
            for ch in chunks:
                for sc in ch.choices:
                    if sc.index != c.index:
                        continue
                    for d in sc.delta.tool_calls or ():
                        if d.id:
                            streamed[d.index] = [d.function.name, ""]
                        streamed[d.index][1] += d.function.arguments or ""
            assert [tuple(v) for _, v in sorted(streamed.items())] == calls
            finals = [sc.finish_reason for ch in chunks for sc in ch.choices if sc.index == c.index and sc.finish_reason]
            assert finals == [reason]


def test_required_tool_choice_with_tools_whose_schemas_use_defs(client):
    """Each tool's $defs are moved to the call list's root, so its $refs still resolve."""
    loc = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"enum": ["Paris", "Oslo"]}}}
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "$defs": {"Loc": loc}, "type": "object", "additionalProperties": False, "required": ["where"],
        "properties": {"where": {"$ref": "#/$defs/Loc"}}}}} for i in range(2)]
    r = client.chat.completions.create(model="tiny-a", messages=[{"role": "user", "content": "x"}], tools=tools,
                                       tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=1,
                                       max_tokens=64)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name in ("f0", "f1")
    assert json.loads(call.function.arguments)["where"]["city"] in ("Paris", "Oslo")


def test_tools_are_described_in_a_system_message_when_the_template_ignores_them(client, model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    msgs = [{"role": "user", "content": "weather?"}]
    described = [{"role": "system", "content": HermesToolParser().describe_tools(TOOLS)
                  + "\n\nNow call get_weather: answer with its arguments as one JSON object."}, *msgs]
    expected = len(tok.apply_chat_template(described, add_generation_prompt=True, tokenize=True, return_dict=False))
    r = client.chat.completions.create(model="tiny-a", messages=msgs, tools=TOOLS, max_tokens=40, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.usage.prompt_tokens == expected
    none = client.chat.completions.create(model="tiny-a", messages=msgs, tools=TOOLS, max_tokens=4, temperature=0,
                                          tool_choice="none")
    assert none.usage.prompt_tokens == len(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                                   return_dict=False))
    assert none.choices[0].message.tool_calls is None


def test_auto_tool_choice_with_a_parser_and_a_template_that_renders_tools(model_dir, tmp_path):
    template = tmp_path / "tools.jinja"
    template.write_text(WITH_TOOLS)
    srv = Server(["--model", model_dir, "--served-model-name", "tiny-a", *ENGINE, "--enable-auto-tool-choice",
                  "--tool-call-parser", "hermes", "--chat-template", str(template)])
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        msgs = [{"role": "user", "content": "weather?"}]
        r = client.chat.completions.create(model="tiny-a", messages=msgs, tools=TOOLS, max_tokens=8, temperature=0)
        tok = transformers.AutoTokenizer.from_pretrained(model_dir)
        # --chat-template's template got the tools (no system message added).
        assert r.usage.prompt_tokens == len(tok.apply_chat_template(msgs, tools=TOOLS, chat_template=WITH_TOOLS,
                                                                    add_generation_prompt=True, tokenize=True,
                                                                    return_dict=False))
        # The noise of a random model holds no <tool_call>: all of it is the content.
        whole = client.completions.create(model="tiny-a", prompt=tok.apply_chat_template(
            msgs, tools=TOOLS, chat_template=WITH_TOOLS, add_generation_prompt=True, tokenize=False),
            max_tokens=8, temperature=0)
        assert "<tool_call>" not in whole.choices[0].text
        assert r.choices[0].message.content == whole.choices[0].text
        assert r.choices[0].message.tool_calls is None
    finally:
        assert srv.stop() == 0, "".join(srv.log)


def test_reasoning_parser_and_a_grammar_after_a_closed_reasoning_block(model_dir, tmp_path):
    template = tmp_path / "no_think.jinja"
    template.write_text(NO_THINK)
    srv = Server(["--model", model_dir, "--served-model-name", "tiny-a", *ENGINE, "--reasoning-parser", "qwen3",
                  "--chat-template", str(template)])
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        kw = dict(model="tiny-a", messages=[{"role": "user", "content": "code?"}], temperature=1.0, seed=2, n=3,
                  max_tokens=20, extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}})
        r = client.chat.completions.create(**kw)
        # The prompt closed the reasoning, so the grammar held from the first token.
        assert all(c.message.content and __import__("re").fullmatch("[A-Z]{2}-[0-9]{3}", c.message.content)
                   for c in r.choices), r.choices
        # Reasoning text goes to reasoning_content, streamed or not.
        free = dict(model="tiny-a", messages=[{"role": "user", "content": "<think>"}], temperature=0, max_tokens=12)
        whole = client.chat.completions.create(**free)
        chunks = list(client.chat.completions.create(**free, stream=True))
        text = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        msg = whole.choices[0].message
        assert (getattr(msg, "reasoning_content", None) or "") == text and (msg.content or "") == content
    finally:
        assert srv.stop() == 0, "".join(srv.log)
