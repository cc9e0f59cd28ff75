"""Structured outputs and tool calls with the real SmolLM2-135M-Instruct: offline and
through `infer serve` with the official openai client. Every output is checked by
`jsonschema`, `re` or plain membership, never by code of ours."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from conftest import require_smollm2
from server_harness import Server
from structured_schemas import CHOICES, REGEXES, SCHEMAS

from infer.core.llm import LLM
from infer.core.sampling_params import SamplingParams
from infer.core.structured import StructuredOutputsParams

pytestmark = pytest.mark.slow
ENGINE = ["--backend", "torch", "--max-num-seqs", "32", "--max-model-len", "2048"]


def chat(prompt: str) -> list[dict]:
    return [{"role": "user", "content": f"Reply in JSON. {prompt}"}]


@pytest.fixture(scope="module")
def server():
    require_smollm2()
    srv = Server(["--model", "smollm2", *ENGINE])
    yield srv
    assert srv.stop() == 0, "".join(srv.log)


def test_json_schemas_offline_with_each_grammar_library():
    require_smollm2()
    for backend in ("xgrammar", "guidance"):
        llm = LLM("smollm2", max_num_seqs=32, structured_outputs_backend=backend)
        params = [SamplingParams(max_tokens=200, temperature=0.0, structured_outputs=StructuredOutputsParams(json=s))
                  for _, s in SCHEMAS]
        outs = llm.chat([chat(p) for p, _ in SCHEMAS], params, use_tqdm=False)
        for (_, schema), out in zip(SCHEMAS, outs):
            c = out.outputs[0]
            assert c.finish_reason == "stop", (backend, c.text)
            jsonschema.validate(json.loads(c.text), schema)
        llm.engine.shutdown()


def test_json_schemas_regexes_and_choices_through_the_openai_client(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert len(SCHEMAS) >= 20
    for prompt, schema in SCHEMAS:
        r = client.chat.completions.create(
            model="smollm2", messages=chat(prompt), max_tokens=200, temperature=0.0,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    for prompt, regex in REGEXES:
        r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=40, temperature=0.7, seed=1, n=2,
                                      extra_body={"structured_outputs": {"regex": regex}})
        assert all(re.fullmatch(regex, c.text) for c in r.choices), [c.text for c in r.choices]
    for prompt, choices in CHOICES:
        r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=10, temperature=1.0, seed=2, n=3,
                                      extra_body={"structured_outputs": {"choice": choices}})
        assert all(c.text in choices for c in r.choices), [c.text for c in r.choices]
    r = client.chat.completions.create(
        model="smollm2", messages=chat("The capital of France, as an object with one key, city."), max_tokens=400,
        temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": {"type": "object", "additionalProperties": False,
                                                     "required": ["city", "unit"],
                                                     "properties": {"city": {"type": "string", "maxLength": 30},
                                                                    "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                      "parameters": {"type": "object", "additionalProperties": False,
                                                     "required": ["a", "b"],
                                                     "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}},
]


def test_required_and_named_tool_calls_streamed_or_not(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    # required with parallel_tool_calls=False: one call (a 135M model, let free, lists calls until max_tokens).
    asks = [("What is the weather in Paris?", {"type": "function", "function": {"name": "get_weather"}}, True),
            ("What is 2 plus 3?", "required", False)]
    for question, choice, parallel in asks:
        kw = dict(model="smollm2", messages=[{"role": "user", "content": question}], tools=TOOLS, tool_choice=choice,
                  max_tokens=120, temperature=0, parallel_tool_calls=parallel)
        whole = client.chat.completions.create(**kw)
        calls = [(t.function.name, t.function.arguments) for t in whole.choices[0].message.tool_calls]
        assert whole.choices[0].finish_reason == ("stop" if isinstance(choice, dict) else "tool_calls") and calls
        if choice == "required":
            assert calls == [("add", '{"a": 2, "b": 3}')]
        for name, args in calls:
            jsonschema.validate(json.loads(args), schemas[name])
        streamed: dict[int, list] = {}
        for chunk in client.chat.completions.create(**kw, stream=True):
            for d in (chunk.choices[0].delta.tool_calls or ()) if chunk.choices else ():
                if d.id:
                    streamed[d.index] = [d.function.name, ""]
                streamed[d.index][1] += d.function.arguments or ""
        assert [tuple(v) for _, v in sorted(streamed.items())] == calls
