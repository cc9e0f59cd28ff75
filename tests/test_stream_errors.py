"""A stream that fails part-way still ends as an SSE stream must: an OpenAI
error event, then ``data: [DONE]``; and its engine requests are aborted."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from server_harness import make_tiny_model_dir

from infer.core.async_engine import AsyncLLM, EngineDeadError
from infer.core.engine import LLMEngine
from infer.core.sampling_params import SamplingParams
from infer.server import generation
from infer.server.app import create_app
from infer.server.errors import APIError
from infer.server.generation import sse, sse_stream
from infer.server.metrics import Metrics
from infer.server.models import ModelRegistry, ServedModel

COMP = {"prompt": "The quick brown fox", "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "temperature": 0, "ignore_eos": True,
        "stream": True}


def frames_of(chunks) -> list[str]:
    async def run():
        return [f async for f in sse_stream(chunks)]

    return asyncio.run(run())


async def two_chunks_then(exc: BaseException):
    yield sse({"n": 1})
    yield sse({"n": 2})
    raise exc


@pytest.mark.parametrize("exc, status, param", [
    (APIError(400, "bad stop", "stop"), 400, "stop"),
    (EngineDeadError("the engine failed: RuntimeError: device lost"), 503, None),
    (RuntimeError("a bug"), 500, None),
], ids=["api-error", "engine-dead", "unexpected"])
def test_failure_mid_stream_becomes_an_error_event_then_done(exc, status, param):
    frames = frames_of(two_chunks_then(exc))
    assert frames[:2] == [sse({"n": 1}), sse({"n": 2})]
    assert frames[-1] == "data: [DONE]\n\n" and len(frames) == 4
    err = json.loads(frames[2].removeprefix("data: "))["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status and err["param"] == param
    assert "Traceback" not in err["message"]


def test_stream_that_ends_normally_ends_with_done_once():
    async def chunks():
        yield sse({"n": 1})

    assert frames_of(chunks()) == [sse({"n": 1}), "data: [DONE]\n\n"]


# -- through the app, in-process ----------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def served(model_dir):
    """(app, AsyncLLM) of a fresh engine: a test may kill it."""
    llm = AsyncLLM(LLMEngine(model=str(model_dir), backend="torch", max_num_seqs=4, max_model_len=256))
    yield create_app(ModelRegistry([ServedModel("tiny", llm)]), Metrics()), llm
    llm.shutdown()


def stream(app, path: str, body: dict) -> list[str]:
    """The SSE frames of one streamed response, as sent."""
    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=60) as http:
            r = await http.post(path, json=body)
            assert r.status_code == 200
            return r.text

    text = asyncio.run(run())
    assert text.endswith("\n\n")
    return [f + "\n\n" for f in text.split("\n\n")[:-1]]


def fail_engine_once_a_token_was_streamed(llm: AsyncLLM, monkeypatch) -> None:
    """The engine's step raises, as a lost device would, once the stream has sent
    a token: the failure is surely mid-stream. Until then each step gives the
    event loop a moment (all prompts of a request must be queued before the
    response, and its first token, can start)."""
    sent = threading.Event()
    real_delta, real_step = generation.DeltaTracker.delta, llm.engine.step

    def delta(self, index, comp):
        text, tokens, lps = real_delta(self, index, comp)
        if tokens:
            sent.set()
        return text, tokens, lps

    def step():
        if sent.wait(0.05):
            raise RuntimeError("device lost")
        return real_step()

    monkeypatch.setattr(generation.DeltaTracker, "delta", delta)
    monkeypatch.setattr(llm.engine, "step", step)


def error_of(frame: str) -> dict:
    return json.loads(frame.removeprefix("data: "))["error"]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", COMP),
    ("/v1/completions", COMP | {"prompt": ["one prompt", "and another"]}),  # merged streams
    ("/v1/chat/completions", CHAT),
], ids=["completion", "two-prompts", "chat"])
def test_engine_failing_mid_stream_sends_503_then_done(served, monkeypatch, path, body):
    app, llm = served
    fail_engine_once_a_token_was_streamed(llm, monkeypatch)
    frames = stream(app, path, body | {"max_tokens": 200})  # far more steps than the stream needs to start
    assert frames[-1] == "data: [DONE]\n\n"
    err = error_of(frames[-2])
    assert err["code"] == 503 and err["type"] == "ServiceUnavailableError" and "device lost" in err["message"]
    chunks = [json.loads(f.removeprefix("data: ")) for f in frames[:-2]]
    assert chunks and all("error" not in c for c in chunks)


def test_unexpected_error_mid_stream_sends_500_then_done_and_aborts(served, monkeypatch):
    app, llm = served
    real, calls = generation.DeltaTracker.delta, [0]

    def delta(self, index, comp):
        calls[0] += 1
        if calls[0] == 3:
            raise ValueError("a bug in the stream")
        return real(self, index, comp)

    monkeypatch.setattr(generation.DeltaTracker, "delta", delta)
    frames = stream(app, "/v1/completions", COMP | {"max_tokens": 200})
    assert frames[-1] == "data: [DONE]\n\n"
    err = error_of(frames[-2])
    assert err["code"] == 500 and "a bug" not in err["message"]  # no internals leak to the client
    deadline = time.time() + 10
    while llm.num_unfinished or llm.engine.has_unfinished_requests():
        assert time.time() < deadline, "the failed stream's request was not aborted"
        time.sleep(0.01)
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_stream_left_early_is_aborted_while_its_event_loop_lives_on(served):
    """The consumer's loop stays up (as a server's does), so only the iterator's own cleanup can abort.
    The stats of the step that aborts it count no token: one first token, one latency per later token."""
    _, llm = served
    stats = []
    llm.stat_loggers.append(lambda _, it: stats.append(it) if it else None)

    async def run():
        stream = await llm.generate("leave", "The quick brown fox",
                                    SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await stream.aclose()
        deadline = time.time() + 10
        while llm.num_unfinished:
            assert time.time() < deadline, "the request kept running after its consumer left"
            await asyncio.sleep(0.01)
        return llm.engine.scheduler.block_manager

    bm = asyncio.run(run())
    finished = [f for it in stats for f in it.finished]
    assert [f.finish_reason for f in finished] == ["abort"] and 3 <= finished[0].num_generation_tokens < 200
    assert len([t for it in stats for t in it.time_to_first_tokens]) == 1
    assert len([t for it in stats for t in it.inter_token_latencies]) == finished[0].num_generation_tokens - 1
    assert [q > 0 for it in stats for q in it.queue_times] == [True]  # it waited, however briefly
    assert bm.num_free_blocks == bm.num_blocks


def test_request_queued_while_the_engine_fails_gets_engine_dead_not_a_hang(served, monkeypatch):
    _, llm = served
    in_step, release = threading.Event(), threading.Event()

    def step():
        in_step.set()
        release.wait(30)
        raise RuntimeError("device lost")

    monkeypatch.setattr(llm.engine, "step", step)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def run():
        first = await llm.generate("first", "The quick brown fox", params)
        await asyncio.to_thread(in_step.wait, 30)  # the engine is inside the step that will fail
        second = asyncio.ensure_future(llm.generate("second", "Once upon a time", params))
        await asyncio.sleep(0.05)  # "second" is queued for the engine thread
        release.set()
        with pytest.raises(EngineDeadError, match="device lost"):
            await asyncio.wait_for(second, 10)
        with pytest.raises(EngineDeadError, match="device lost"):
            await asyncio.wait_for(first.__anext__(), 10)

    asyncio.run(run())
