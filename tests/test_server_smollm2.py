"""`infer serve` with the real SmolLM2-135M-Instruct, through the official openai client."""

from __future__ import annotations

import asyncio

import openai
import pytest
from conftest import require_smollm2
from server_harness import Server, metric, wait_idle

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ENGINE = ["--backend", "torch", "--max-num-seqs", "4", "--max-model-len", "1024"]


@pytest.fixture(scope="module")
def server():
    require_smollm2()
    srv = Server(["--model", "smollm2", *ENGINE])
    yield srv
    assert srv.stop() == 0, "".join(srv.log)


def test_chat_answers_streamed_or_not(server):
    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        whole = await client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=16, temperature=0)
        stream = await client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=16,
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        await client.close()
        return whole, chunks

    whole, chunks = asyncio.run(run())
    text = whole.choices[0].message.content
    assert "Paris" in text and whole.choices[0].finish_reason == "stop"  # before max_tokens
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage == whole.usage


def test_concurrent_streams_equal_sequential_whole_completions(server):
    """Batched with others or alone, greedy text is the same; afterwards no KV block is held."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    prompts = ["Once upon a time", "The three primary colors are", "def fibonacci(n):"]
    whole = [client.completions.create(model="smollm2", prompt=p, max_tokens=12, temperature=0).choices[0].text
             for p in prompts]

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

        async def one(p):
            stream = await aclient.completions.create(model="smollm2", prompt=p, max_tokens=12, temperature=0,
                                                      stream=True)
            return "".join([c.choices[0].text async for c in stream])

        out = await asyncio.gather(*(one(p) for p in prompts))
        await aclient.close()
        return out

    assert asyncio.run(run()) == whole
    m = wait_idle(server, "smollm2")
    assert metric(m, "infer:kv_cache_usage_perc", "smollm2") == 0
    assert metric(m, "infer:request_success_total", "smollm2", finished_reason="length") >= 3
