"""LoRA adapters through `infer serve` and the official openai client: two adapters and
the base model concurrently, each answering with transformers' greedy tokens of the
base with that adapter merged; load and unload at run time behind the API key;
unknown adapters 404; the adapters in /metrics."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch
import transformers
from server_harness import Server, make_tiny_model_dir, metric, wait_idle
from test_lora import ALL, make_adapter

KEY = "sk-lora"
PROMPTS = ["The quick brown fox", "Once upon a time", "Paris is the capital of", "def f(x):"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base_dir = make_tiny_model_dir(tmp_path_factory.mktemp("base"), seed=3)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
    merged = {"base": base}
    paths = {}
    for i, (name, r, targets) in enumerate((("sql", 8, ALL), ("chat", 4, ["q_proj", "v_proj", "down_proj"]),
                                           ("late", 8, ["o_proj", "up_proj"]))):
        paths[name] = tmp_path_factory.mktemp(f"lora-{name}")
        merged[name] = make_adapter(base, paths[name], r, 2 * r, targets, False, seed=40 + i).eval()
    tok = transformers.AutoTokenizer.from_pretrained(base_dir)
    return base_dir, paths, merged, tok


def _greedy(model, tok, prompt: str, n: int = 12) -> str:
    ids = tok(prompt).input_ids
    out = []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([ids + out])).logits[0, -1].argmax()))
    for k in range(len(out), -1, -1):  # a text never ends in half a character (the server cuts it, as vLLM)
        text = tok.decode(out[:k], skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            return text


@pytest.fixture(scope="module")
def server(setup):
    base_dir, paths, _, _ = setup
    args = ["--model", str(base_dir), "--served-model-name", "base", "--backend", "torch", "--max-model-len", "256",
            "--num-gpu-blocks-override", "64", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
            "--lora-modules", f"sql={paths['sql']}", f'{{"name": "chat", "path": "{paths["chat"]}"}}',
            "--allow-runtime-lora-updating"]
    srv = Server(args, api_key=KEY)
    yield srv
    assert srv.stop() == 0, "".join(srv.log)


def test_models_list_adapters_with_their_parent(server, setup):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    models = {m.id: m for m in client.models.list().data}
    assert set(models) >= {"base", "sql", "chat"}
    assert models["sql"].parent == "base" and models["chat"].parent == "base" and models["base"].parent is None
    assert models["sql"].root == str(setup[1]["sql"])


def test_adapters_and_base_concurrently_match_merged_transformers(server, setup):
    _, _, merged, tok = setup
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    jobs = [(name, p) for p in PROMPTS for name in ("base", "sql", "chat")]

    async def run():
        return await asyncio.gather(*(client.completions.create(model=name, prompt=p, max_tokens=12, temperature=0,
                                                                extra_body={"ignore_eos": True}) for name, p in jobs))

    got = asyncio.run(run())
    for (name, p), r in zip(jobs, got):
        assert r.model == name
        assert r.choices[0].text == _greedy(merged[name], tok, p), (name, p)
    assert _greedy(merged["sql"], tok, PROMPTS[0]) != _greedy(merged["base"], tok, PROMPTS[0])
    m = wait_idle(server, "base")
    info = [k for k in m if k.startswith("infer:lora_requests_info{")]
    assert info and all('max_lora="2"' in k for k in info)


def test_load_and_unload_at_run_time_behind_the_key(server, setup):
    _, paths, merged, tok = setup
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt="x", max_tokens=2)
    body = {"lora_name": "late", "lora_path": str(paths["late"])}
    assert httpx.post(server.url + "/v1/load_lora_adapter", json=body).status_code == 401  # no key
    with server.client() as http:
        r = http.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == 200, r.text
        assert http.post("/v1/load_lora_adapter", json=body).status_code == 400  # already loaded
        bad = http.post("/v1/load_lora_adapter", json={"lora_name": "nope", "lora_path": "/no/such/dir"})
        assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
        out = client.chat.completions.create(model="late", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=6, temperature=0)
        assert out.model == "late"
        r = client.completions.create(model="late", prompt=PROMPTS[2], max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == _greedy(merged["late"], tok, PROMPTS[2])
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt="x", max_tokens=2)
    assert "late" not in {m.id for m in client.models.list().data}
    assert metric(server.metrics(), "infer:num_requests_running", "base") == 0
