"""`infer serve` as a real uvicorn process, driven by the official openai client and raw httpx.

Two tiny random Llamas (different weights, a real byte-level BPE tokenizer and
a ChatML template) are served by one process under an API key. The oracle for
every greedy output shares no code with infer: transformers' model of the same
directory, argmax token by token, its tokenizer's encode, chat template and
`decode` (cut before a last character left incomplete); usage is the count of
those tokens.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re

import httpx
import openai
import pytest
import schemathesis
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from server_harness import Server, make_tiny_model_dir, metric, wait_idle
from structured_schemas import TOOLS

KEY = "sk-test-key"
MODELS = ("tiny-a", "tiny-b")
PROMPTS = ["The quick brown fox", "Once upon a time", "Paris is the capital of", "def f(x):",
           "Ünïcödé 🙂", "Berlin", "a tiny model jumps", "The lazy dog."]
MAX_BODY = 1 << 20
# Short in CI; raise it for a deeper local run.
FUZZ_EXAMPLES = int(os.environ.get("INFER_SERVER_FUZZ_EXAMPLES", "8"))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {name: make_tiny_model_dir(tmp_path_factory.mktemp(name), seed=i) for i, name in enumerate(MODELS)}


@pytest.fixture(scope="module")
def server(model_dirs):
    args = ["--backend", "torch", "--max-num-seqs", "16", "--max-model-len", "256", "--num-gpu-blocks-override", "64",
            "--max-request-body-bytes", str(MAX_BODY)]
    for name, path in model_dirs.items():
        args += ["--model", str(path), "--served-model-name", name]
    srv = Server(args, api_key=KEY)
    yield srv
    assert srv.stop() == 0, "".join(srv.log)


class Oracle:
    """transformers' greedy decoding of one model directory, and its tokenizer's text."""

    def __init__(self, path):
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        self.eos = self.model.config.eos_token_id
        self._memo: dict = {}

    def generate(self, prompt_ids: list[int], max_tokens: int, ignore_eos: bool = False) -> list[int]:
        """The argmax token after each prefix (the whole sequence recomputed: no cache to get wrong)."""
        key = (tuple(prompt_ids), max_tokens, ignore_eos)
        if key not in self._memo:
            ids, out = list(prompt_ids), []
            with torch.no_grad():
                while len(out) < max_tokens and (ignore_eos or not out or out[-1] != self.eos):
                    out.append(int(self.model(torch.tensor([ids + out])).logits[0, -1].argmax()))
            self._memo[key] = out
        return self._memo[key]

    def text(self, ids: list[int]) -> str:
        """The tokenizer's decode of the ids, up to the last token that completes a character: a text
        never ends in the U+FFFD of a character whose remaining bytes never came (as in vLLM)."""
        for k in range(len(ids), -1, -1):
            text = self.tokenizer.decode(ids[:k], skip_special_tokens=True)
            if not text.endswith("\ufffd"):
                return text

    def chat(self, messages, max_tokens: int) -> tuple[list[int], list[int]]:
        """(prompt ids, generated ids) of a chat turn with the model's template."""
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)
        return prompt, self.generate(prompt, max_tokens)


@pytest.fixture(scope="module")
def oracle(model_dirs):
    return {name: Oracle(path) for name, path in model_dirs.items()}


def greedy(oracle: Oracle, prompts, max_tokens=16, ignore_eos=False) -> list[str]:
    return [oracle.text(oracle.generate(oracle.tokenizer(p).input_ids, max_tokens, ignore_eos)) for p in prompts]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


# -- the OpenAI API, through the official client ----------------------------------------------

def test_models_lists_every_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == list(MODELS)
    assert all(m.object == "model" and m.owned_by == "infer" for m in models.data)


@pytest.mark.parametrize("model", MODELS)
def test_greedy_completion_equals_transformers_greedy(client, oracle, model):
    """Routing by `model`: each name answers with its own weights."""
    want = greedy(oracle[model], PROMPTS[:3], ignore_eos=True)
    got = [client.completions.create(model=model, prompt=p, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
           for p in PROMPTS[:3]]
    assert [r.choices[0].text for r in got] == want
    assert all(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 16 for r in got)
    assert [r.usage.prompt_tokens for r in got] == [len(oracle[model].tokenizer(p).input_ids) for p in PROMPTS[:3]]
    assert want != greedy(oracle[MODELS[1 - MODELS.index(model)]], PROMPTS[:3], ignore_eos=True)


def test_batched_prompts_and_n_index_choices(client, oracle):
    r = client.completions.create(model="tiny-a", prompt=PROMPTS[:2], max_tokens=8, temperature=0, n=2,
                                  extra_body={"ignore_eos": True})
    want = greedy(oracle["tiny-a"], PROMPTS[:2], max_tokens=8, ignore_eos=True)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [want[0], want[0], want[1], want[1]]
    assert r.usage.completion_tokens == 32


def test_streamed_completion_concatenates_to_the_whole(client):
    kw = dict(model="tiny-a", prompt=PROMPTS[0], max_tokens=40, temperature=0)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_string_is_cut_from_streamed_and_whole_text(client, oracle):
    full = greedy(oracle["tiny-b"], [PROMPTS[1]], max_tokens=30, ignore_eos=True)[0]
    stop = full[10:13]  # ends mid-output, possibly spanning tokens
    kw = dict(model="tiny-b", prompt=PROMPTS[1], max_tokens=30, temperature=0, stop=[stop],
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0]
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert whole.text == full[:full.index(stop)] == streamed
    assert whole.finish_reason == "stop"


def test_chat_greedy_equals_transformers_chat_streamed_or_not(server, oracle):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a capital."}]
    prompt_ids, out_ids = oracle["tiny-b"].chat(messages, 24)
    want = oracle["tiny-b"].text(out_ids)

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        whole = await aclient.chat.completions.create(model="tiny-b", messages=messages, max_completion_tokens=24,
                                                      temperature=0)
        stream = await aclient.chat.completions.create(model="tiny-b", messages=messages, max_tokens=24,
                                                       temperature=0, stream=True)
        chunks = [c async for c in stream]
        await aclient.close()
        return whole, chunks

    whole, chunks = asyncio.run(run())
    assert whole.choices[0].message.content == want
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(prompt_ids)
    assert whole.usage.completion_tokens == len(out_ids)
    assert whole.choices[0].finish_reason == ("stop" if out_ids[-1] == oracle["tiny-b"].eos else "length")
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


RECORD = {"type": "object", "additionalProperties": False, "required": ["id", "tag"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tag": {"type": "string", "enum": ["red", "green"]}}}


def test_structured_outputs_through_the_openai_client_streamed_or_not(client):
    """A random tiny model only writes valid outputs because of the grammar; streamed
    chunks reassemble to the whole response of the same seed."""
    import jsonschema

    so = {"structured_outputs": {"json": RECORD, "disable_any_whitespace": True}}
    kw = dict(model="tiny-a", messages=[{"role": "user", "content": "a record"}], max_tokens=48, temperature=1.0,
              seed=5, n=2, extra_body=so)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    for c in whole.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), RECORD)
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks
                       if ch.choices and ch.choices[0].index == c.index) == c.message.content
    regex = client.completions.create(model="tiny-b", prompt="call me at", max_tokens=20, temperature=1.0, seed=1,
                                      n=3, extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}})
    assert all(re.fullmatch("[0-9]{3}-[0-9]{4}", c.text) for c in regex.choices), regex.choices
    choice = client.chat.completions.create(model="tiny-a", messages=[{"role": "user", "content": "pick"}], n=4,
                                            temperature=1.0, extra_body={"guided_choice": ["left", "right"]})
    assert {c.message.content for c in choice.choices} <= {"left", "right"}


def test_logprobs_of_greedy_tokens_are_the_top_ones(client):
    r = client.chat.completions.create(model="tiny-a", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].token == item.token and item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert item.logprob <= 0 and item.bytes == list(item.token.encode())
    c = client.completions.create(model="tiny-a", prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True}).choices[0]
    assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == len(c.logprobs.top_logprobs) == 5
    assert all(max(top.values()) == pytest.approx(lp) for top, lp in zip(c.logprobs.top_logprobs, c.logprobs.token_logprobs))


# -- SSE framing, metrics, utility routes: raw HTTP ----------------------------------------------

def test_sse_framing_ends_with_done(server):
    with server.client() as http, http.stream("POST", "/v1/chat/completions", json={
            "model": "tiny-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    bodies = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert all(b["object"] == "chat.completion.chunk" and b["id"] == bodies[0]["id"] for b in bodies)
    assert bodies[-1]["usage"]["completion_tokens"] <= 5 and bodies[-1]["choices"] == []


def test_metrics_move_by_the_request(server):
    prompt = "The quick brown fox jumps over the lazy dog. Once upon a time there was a tiny model."
    with server.client() as http:
        n_prompt = http.post("/tokenize", json={"model": "tiny-a", "prompt": prompt}).json()["count"]
        before = wait_idle(server, "tiny-a")
        for _ in range(2):  # the second one finds the first's full blocks in the prefix cache
            r = http.post("/v1/completions", json={"model": "tiny-a", "prompt": prompt, "max_tokens": 7,
                                                  "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200
    after = wait_idle(server, "tiny-a")

    def moved(name, **labels):
        return metric(after, name, "tiny-a", **labels) - metric(before, name, "tiny-a", **labels)

    assert moved("infer:prompt_tokens_total") == 2 * n_prompt
    assert moved("infer:generation_tokens_total") == 14
    assert moved("infer:request_success_total", finished_reason="length") == 2
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert moved(f"infer:{h}_count") == 2, h
    assert moved("infer:inter_token_latency_seconds_count") == 12
    assert moved("infer:prefix_cache_queries_total") == 2 * n_prompt
    assert moved("infer:prefix_cache_hits_total", tier="device") == (n_prompt - 1) // 16 * 16
    assert moved("infer:prefix_cache_hits_total", tier="host") == 0
    assert metric(after, "infer:generation_tokens_total", "tiny-b") == metric(before, "infer:generation_tokens_total",
                                                                             "tiny-b")


def test_tokenize_detokenize_version_health(server):
    with server.client() as http:
        t = http.post("/tokenize", json={"model": "tiny-b", "prompt": "Ünïcödé 🙂 text"}).json()
        assert t["count"] == len(t["tokens"]) and t["max_model_len"] == 256
        assert http.post("/detokenize", json={"model": "tiny-b", "tokens": t["tokens"]}).json() == {
            "prompt": "Ünïcödé 🙂 text"}
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert chat["count"] > 3
        assert http.get("/version").json()["version"]
        assert http.get("/health").status_code == 200
        assert http.get("/openapi.json").json()["paths"]["/v1/chat/completions"]["post"]


# -- security and errors ----------------------------------------------------------------------------

@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}])
def test_api_routes_need_the_key(server, headers):
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("POST", "/tokenize")]:
        r = httpx.request(method, server.url + path, headers=headers, json={"prompt": "x"})
        assert r.status_code == 401, path
        assert r.json()["error"]["type"] == "AuthenticationError" and r.json()["error"]["code"] == 401


def test_openai_client_with_a_wrong_key_gets_authentication_error(server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_probes_need_no_key(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
BAD = [  # (path, body, status, param)
    (COMP, b"{not json", 400, None),
    (COMP, b"[1, 2]", 400, None),
    (COMP, {}, 400, "prompt"),
    (CHAT, {"model": "tiny-a"}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema"}}, 400, "response_format.json_schema.schema"),
    (CHAT, {"messages": MSG, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, 400, "response_format.json_schema"),
    (COMP, {"prompt": "x", "structured_outputs": {"regex": "a(b"}}, 400, "structured_outputs.regex"),
    (COMP, {"prompt": "x", "structured_outputs": {}}, 400, "structured_outputs"),
    (COMP, {"prompt": "x", "structured_outputs": {"regex": "a", "json": {}}}, 400, "structured_outputs"),
    (COMP, {"prompt": "x", "structured_outputs": {"choice": "yes"}}, 400, "structured_outputs"),
    (CHAT, {"messages": MSG, "guided_regex": "a", "response_format": {"type": "json_object"}}, 400, "guided_*"),
    (CHAT, {"messages": MSG, "tools": TOOLS}, 400, "tool_choice"),  # auto needs --enable-auto-tool-choice
    (CHAT, {"messages": MSG, "tool_choice": "required"}, 400, "tool_choice"),
    (CHAT, {"messages": MSG, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400,
     "tool_choice"),
    (CHAT, {"messages": MSG, "tools": TOOLS, "tool_choice": "sometimes"}, 400, "tool_choice"),
    (CHAT, {"messages": MSG, "tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     400, "tool_choice"),
    (COMP, {"prompt": "x", "guided_grammar": 'root ::= "a" ( b'}, 400, "guided_grammar"),
    (COMP, {"prompt": "word " * 400}, 400, "prompt"),
    (COMP, {"prompt": []}, 400, "prompt"),
    (COMP, {"prompt": [[]]}, 400, "prompt"),
    (COMP, {"prompt": [99999]}, 400, "prompt"),
    (COMP, {"prompt": "x", "temperature": -1}, 400, "temperature"),
    (COMP, {"prompt": "x", "top_p": 5}, 400, "top_p"),
    (COMP, {"prompt": "x", "n": 0}, 400, "n"),
    (COMP, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (COMP, {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    (COMP, {"prompt": "x", "max_tokens": 300}, 400, "max_tokens"),  # prompt + max_tokens over max_model_len 256
    (CHAT, {"messages": MSG, "max_tokens": 250}, 400, "max_tokens"),
    (COMP, {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    (COMP, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    (COMP, {"prompt": "x", "top_k": -5}, 400, "top_k"),
    (COMP, {"prompt": "x", "min_p": 2}, 400, "min_p"),
    (COMP, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (COMP, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    (COMP, {"prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    (COMP, {"prompt": "x", "stop_token_ids": [99999]}, 400, "stop_token_ids"),
    (COMP, {"prompt": "x", "seed": "x"}, 400, "seed"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    (COMP, {"prompt": "x", "model": "nope"}, 404, "model"),
    (CHAT, {"messages": MSG, "model": "nope"}, 404, "model"),
    ("/detokenize", {"tokens": [99999]}, 400, "tokens"),
    ("/tokenize", {"prompt": "x", "messages": MSG}, 400, "prompt"),
    ("/v1/nope", {}, 404, None),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content,
                   headers={**server.headers, "content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status and err["message"]
    assert err["param"] == param
    assert "Traceback" not in r.text


def test_wrong_method_and_oversized_body(server):
    r = httpx.get(server.url + COMP, headers=server.headers)
    assert r.status_code == 405 and r.json()["error"]["code"] == 405
    big = json.dumps({"prompt": "x" * (MAX_BODY + 10)})
    r = httpx.post(server.url + COMP, content=big, headers={**server.headers, "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "RequestTooLargeError"


# -- disconnects and load ----------------------------------------------------------------------------

def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    before = wait_idle(server, "tiny-a")
    with server.client() as http, http.stream("POST", COMP, json={
            "model": "tiny-a", "prompt": PROMPTS[0], "max_tokens": 240, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # generation has begun; now hang up
    after = wait_idle(server, "tiny-a")
    assert metric(after, "infer:kv_cache_usage_perc", "tiny-a") == 0
    assert metric(after, "infer:num_requests_running", "tiny-a") == 0
    aborted = (metric(after, "infer:request_success_total", "tiny-a", finished_reason="abort")
               - metric(before, "infer:request_success_total", "tiny-a", finished_reason="abort"))
    assert aborted == 1
    assert metric(after, "infer:generation_tokens_total", "tiny-a") - metric(
        before, "infer:generation_tokens_total", "tiny-a") < 240


def test_disconnect_while_waiting_for_a_whole_response_aborts(server):
    before = wait_idle(server, "tiny-b")
    with pytest.raises(httpx.ReadTimeout):
        # 8 x 240 tokens take well over the 0.2 s the client waits.
        httpx.post(server.url + COMP, headers=server.headers, timeout=httpx.Timeout(30, read=0.2), json={
            "model": "tiny-b", "prompt": PROMPTS[0], "max_tokens": 240, "ignore_eos": True, "n": 8})
    after = wait_idle(server, "tiny-b")
    assert metric(after, "infer:request_success_total", "tiny-b", finished_reason="abort") - metric(
        before, "infer:request_success_total", "tiny-b", finished_reason="abort") == 1
    assert metric(after, "infer:kv_cache_usage_perc", "tiny-b") == 0


def test_64_streams_with_a_quarter_hanging_up(server, oracle):
    """All streams that stay get exactly the greedy text; afterwards nothing runs and no block is held."""
    want = dict(zip(PROMPTS, greedy(oracle["tiny-a"], PROMPTS, max_tokens=24, ignore_eos=True)))
    rng = random.Random(0)
    plan = [(PROMPTS[i % len(PROMPTS)], rng.randint(1, 6) if i % 4 == 0 else None) for i in range(64)]

    async def one(http: httpx.AsyncClient, prompt: str, leave_after: int | None) -> str | None:
        text = ""
        # Those that hang up ask for far more than they read, so they surely leave mid-stream.
        body = {"model": "tiny-a", "prompt": prompt, "max_tokens": 24 if leave_after is None else 200,
                "temperature": 0, "ignore_eos": True, "stream": True}
        async with http.stream("POST", COMP, json=body) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                text += json.loads(line[6:])["choices"][0]["text"]
                seen += 1
                if leave_after is not None and seen >= leave_after:
                    return None
        return text

    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120) as http:
            return await asyncio.gather(*(one(http, p, k) for p, k in plan))

    before = wait_idle(server, "tiny-a")
    results = asyncio.run(run())
    for (prompt, leave_after), text in zip(plan, results):
        if leave_after is None:
            assert text == want[prompt]
    after = wait_idle(server, "tiny-a")
    finished = {reason: metric(after, "infer:request_success_total", "tiny-a", finished_reason=reason)
                - metric(before, "infer:request_success_total", "tiny-a", finished_reason=reason)
                for reason in ("abort", "length")}
    assert finished == {"abort": 16, "length": 48}
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert metric(after, f"infer:{gauge}", "tiny-a") == 0, gauge


# -- shutdown --------------------------------------------------------------------------------------

def test_sigterm_finishes_in_flight_stream_then_exits_0(model_dirs):
    srv = Server(["--backend", "torch", "--model", str(model_dirs["tiny-a"]), "--max-model-len", "256"])
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http, http.stream("POST", COMP, json={
                "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            srv.proc.terminate()
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"  # drained, not cut
        assert srv.proc.wait(60) == 0, "".join(srv.log)
        with pytest.raises(httpx.ConnectError):
            httpx.get(srv.url + "/health")
    finally:
        srv.stop()


# -- the OpenAPI schema, fuzzed ----------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schema_fuzz_finds_no_server_error(server, mode):
    """schemathesis bodies from /openapi.json, valid and invalid: every answer is a 2xx or an OpenAI-style 4xx."""
    from schemathesis.generation import GenerationMode

    schema = schemathesis.openapi.from_dict(httpx.get(server.url + "/openapi.json").json())
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8
    if mode == "negative":  # only bodies can be made invalid; GET /health has nothing to break
        operations = [op for op in operations if op.method.upper() == "POST"]

    for op in operations:
        @given(case=op.as_strategy(generation_mode=GenerationMode(mode)))
        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def check(case):
            r = case.call(base_url=server.url, headers=server.headers, timeout=60)
            assert r.status_code < 500, (case.method, case.path, case.body, r.text)
            if r.status_code >= 400:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text

        check()
