"""Hostile-but-fair input to the server and the engine: invalid Unicode, bodies FastAPI
cannot parse, oversized requests, text too long for the context, tokenization off the
event loop, non-finite logits, a KV size below its floor, a model without a tokenizer.
Through the app in-process (httpx's ASGI transport) on a tiny random Llama."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import socket
import threading
import time

import httpx
import numpy as np
import pytest
from server_harness import Server, make_tiny_model_dir, metric, wait_idle

from infer import LLM, SamplingParams
from infer.core.async_engine import AsyncLLM
from infer.core.engine import LLMEngine
from infer.server.app import create_app
from infer.server.metrics import Metrics
from infer.server.models import ModelRegistry, ServedModel
from infer.server.protocol import RequestLimits

COMP, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def served(model_dir):
    llm = AsyncLLM(LLMEngine(model=str(model_dir), backend="torch", max_num_seqs=8, max_model_len=256))
    app = create_app(ModelRegistry([ServedModel("tiny", llm)]), Metrics(), limits=RequestLimits(8, 40))
    yield app, llm
    llm.shutdown()


def post(app, path: str, body=None, content: bytes | None = None) -> httpx.Response:
    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=60) as http:
            # json.dumps escapes non-ASCII (a lone surrogate as \ud800, as a client in another language may send it)
            data = content if content is not None else json.dumps(body).encode()
            return await http.post(path, content=data, headers={"content-type": "application/json"})

    return asyncio.run(run())


def error_of(r: httpx.Response, status: int, param) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["param"] == param, err
    assert "Traceback" not in r.text
    return err["message"]


SURROGATE = "caf\u00e9 x\ud800 y"  # a lone high surrogate: valid JSON (\ud800), not Unicode


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": SURROGATE}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": SURROGATE}]}, "messages.0.content"),
    (COMP, {"prompt": SURROGATE, "max_tokens": 2}, "prompt"),
    (COMP, {"prompt": ["fine", SURROGATE], "max_tokens": 2}, "prompt.1"),
    (COMP, {"prompt": "x", "stop": ["\udc00"], "max_tokens": 2}, "stop.0"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": SURROGATE}]},
     "messages.1.content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]},
     "messages.0.content.0.text"),
], ids=["tokenize", "tokenize-chat", "completion", "completion-list", "stop", "chat", "chat-parts"])
def test_lone_surrogates_are_a_400_naming_the_field_on_every_route(served, path, body, param):
    message = error_of(post(served[0], path, body), 400, param)
    assert "lone UTF-16 surrogate" in message and "not valid Unicode" in message


def test_a_connection_keeps_serving_after_an_invalid_unicode_request(served):
    app, _ = served

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            bad = await http.post("/tokenize", content=json.dumps({"prompt": SURROGATE}),
                                  headers={"content-type": "application/json"})
            good = await http.post("/tokenize", json={"prompt": "caf\u00e9 \U0001f642"})
            return bad, good

    bad, good = asyncio.run(run())
    assert bad.status_code == 400 and good.status_code == 200 and good.json()["count"] > 0


def test_bodies_fastapi_cannot_parse_say_what_is_wrong(served):
    app = served[0]
    message = error_of(post(app, COMP, content=b'{"prompt": "caf\xe9", "max_tokens": 2}'), 400, None)
    assert "not valid UTF-8" in message and "0xe9" in message
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert "too deeply" in error_of(post(app, COMP, content=deep), 400, None)


def test_prompts_and_sequences_per_request_are_capped(served):
    app = served[0]
    message = error_of(post(app, COMP, {"prompt": ["a"] * 9, "max_tokens": 1}), 400, "prompt")
    assert "9 prompts" in message and "--max-prompts-per-request" in message
    message = error_of(post(app, COMP, {"prompt": ["a"] * 5, "n": 9, "max_tokens": 1}), 400, "n")
    assert "45 sequences" in message and "--max-sequences-per-request" in message
    ok = post(app, COMP, {"prompt": ["a"] * 8, "n": 5, "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 40
    assert served[1].engine.scheduler.block_manager.num_free_blocks == served[1].engine.cache_config.num_blocks


def test_text_that_cannot_fit_the_context_is_refused_before_tokenizing(served, monkeypatch):
    app, llm = served
    model = app.state.models.get("tiny")
    calls = []
    real = type(model._tokenizer).__call__
    monkeypatch.setattr(type(model._tokenizer), "__call__", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    huge = "word " * 400_000  # 2 MB
    for path, body, param in ((COMP, {"prompt": huge, "max_tokens": 2}, "prompt"),
                              (CHAT, {"messages": [{"role": "user", "content": huge}]}, "messages"),
                              ("/tokenize", {"prompt": huge}, "prompt")):
        message = error_of(post(app, path, body), 400, param)
        assert "2000000 characters" in message and "maximum context of 256 tokens" in message
    assert calls == []  # refused on length alone
    # under that bound the exact count decides, as before
    message = error_of(post(app, COMP, {"prompt": "word " * 60, "max_tokens": 250}), 400, "max_tokens")
    assert "maximum context length is 256 tokens" in message and calls


def test_tokenizing_and_templating_run_off_the_event_loop(served, monkeypatch):
    app = served[0]
    model = app.state.models.get("tiny")
    threads = []
    for name in ("__call__", "apply_chat_template", "decode"):
        real = getattr(type(model._tokenizer), name)

        def spy(self, *a, _real=real, **k):
            if self is model._tokenizer:  # the server's copy (the engine thread has its own)
                threads.append(threading.current_thread().name)
            return _real(self, *a, **k)
        monkeypatch.setattr(type(model._tokenizer), name, spy)
    assert post(app, COMP, {"prompt": "hello there", "max_tokens": 2}).status_code == 200
    assert post(app, CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code == 200
    assert post(app, "/tokenize", {"prompt": "hi"}).status_code == 200
    assert post(app, "/detokenize", {"tokens": [5, 6, 7]}).status_code == 200
    assert len(threads) >= 4 and all(t.startswith("infer-tokenizer-tiny") for t in threads), threads


def test_health_answers_while_a_15_mb_prompt_is_refused(served):
    """The prompt is refused on its length, never tokenized; /health keeps answering
    meanwhile (tokenizing it on the event loop took ~11 s)."""
    app = served[0]
    body = b'{"max_tokens": 2, "prompt": "' + b"abcdefgh " * ((15 << 20) // 9) + b'"}'

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=60) as http:
            big = asyncio.create_task(http.post(COMP, content=body, headers={"content-type": "application/json"}))
            worst = 0.0
            while not big.done():
                start = time.perf_counter()
                assert (await http.get("/health")).status_code == 200
                worst = max(worst, time.perf_counter() - start)
                await asyncio.sleep(0.01)
            return await big, worst

    r, worst = asyncio.run(run())
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
    assert worst < 5.0, worst  # a stall of the loop would be the whole tokenization


def poison_logits(engine: LLMEngine, monkeypatch, victim=lambda rid: True, after: int = 2) -> None:
    """Set the logits rows of `victim` requests to nan once they have `after` output tokens."""
    real_plan, sampler_type = engine._plan, type(engine.worker.sampler)
    real_call = sampler_type.__call__

    def plan(out, mi):
        p = real_plan(out, mi)
        p.sampling.poison = [i for i, c in enumerate(p.comps)
                             if victim(c.request.request_id.request_id) and c.request.num_output_tokens >= after]
        return p

    def call(self, logits, s):
        for i in getattr(s, "poison", ()):
            logits[i if s.rows is None else int(s.rows[i])] = float("nan")
        return real_call(self, logits, s)

    monkeypatch.setattr(engine, "_plan", plan)
    monkeypatch.setattr(sampler_type, "__call__", call)


def test_non_finite_logits_end_that_request_with_an_error_and_the_others_run_on(model_dir, monkeypatch):
    llm = LLM(str(model_dir), backend="torch", max_num_seqs=4, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = ["The quick brown fox", "Once upon a time", "Paris is the capital"]
    clean = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    poison_logits(llm.engine, monkeypatch, victim=lambda rid: int(rid) % 3 == 1)  # LLM's ids count up: the middle one
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "length"]
    assert outs[1].outputs[0].token_ids == clean[1][:2]  # its tokens before the nan step, none after
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == [clean[0], clean[2]]
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == llm.engine.cache_config.num_blocks


def test_non_finite_logits_are_a_500_or_an_error_event_and_the_server_serves_on(model_dir, monkeypatch):
    llm = AsyncLLM(LLMEngine(model=str(model_dir), backend="torch", max_num_seqs=4, max_model_len=256))
    try:
        app = create_app(ModelRegistry([ServedModel("tiny", llm)]), Metrics())
        body = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        poisoned = {"on": True}
        poison_logits(llm.engine, monkeypatch, victim=lambda rid: poisoned["on"])
        message = error_of(post(app, COMP, body), 500, None)
        assert "non-finite" in message
        r = post(app, COMP, {**body, "stream": True})
        frames = [f for f in r.text.split("\n\n") if f]
        assert r.status_code == 200 and frames[-1] == "data: [DONE]" and '"code":500' in frames[-2]
        poisoned["on"] = False
        ok = post(app, COMP, body)
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    finally:
        llm.shutdown()


def test_a_kv_size_below_one_context_is_a_warning_stating_the_size_used(model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="infer"):
        engine = LLMEngine(model=str(model_dir), backend="torch", max_num_seqs=2, max_model_len=256,
                           kv_cache_memory=1024)
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("kv_cache_memory=0.0 MiB is less than one full context" in w and "max_model_len=256" in w
               for w in warning), warning
    tokens = engine.cache_config.num_blocks * engine.cache_config.block_size
    assert tokens >= 256
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "KV cache:" in r.getMessage()]
    assert info and f"= {tokens} tokens" in info[0] and f"{tokens / 256:.2f}x" in info[0], info


def test_a_model_without_a_tokenizer_says_so_for_text_prompts(model_dir, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in model_dir.iterdir():
        if f.name.endswith((".json", ".safetensors")) and "token" not in f.name:
            shutil.copy(f, bare)
    llm = LLM(str(bare), backend="torch", max_num_seqs=2, max_model_len=64)
    failed = llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert failed.outputs[0].finish_reason == "error" and "ships no tokenizer" in failed.error
    assert "skip_tokenizer_init" not in failed.error
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2, temperature=0),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2 and np.all(np.array(out[0].outputs[0].token_ids) >= 0)


# -- slow and idle clients, against a real `infer serve` ------------------------------------------

def _partial(url: str, payload: bytes) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=30)
    s.sendall(payload)
    return s


def _closed_within(s: socket.socket, seconds: float) -> bool:
    """Whether the server closes `s` within `seconds` (what it sends before, if anything, is read)."""
    s.settimeout(seconds)
    try:
        while s.recv(65536):
            pass
        return True
    except (socket.timeout, TimeoutError):
        return False
    except OSError:  # reset
        return True
    finally:
        s.close()


@pytest.fixture(scope="module")
def guarded(model_dir):
    srv = Server(["--model", str(model_dir), "--served-model-name", "tiny", "--backend", "torch",
                  "--max-num-seqs", "16", "--max-model-len", "256", "--timeout-header", "1.5",
                  "--timeout-idle", "1.5", "--max-connections", "64"])
    yield srv
    assert srv.stop() == 0, "".join(srv.log)


def test_headers_that_never_end_and_stalled_bodies_are_closed(guarded):
    url = guarded.url
    slow_head = _partial(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
    stalled = _partial(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro")
    # a kept-alive connection that answers one request, then starts another and stops
    kept = _partial(url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert kept.recv(4096).startswith(b"HTTP/1.1 200")
    kept.sendall(b"GET /health HTTP/1.1\r\nHo")
    idle = _partial(url, b"")  # sends nothing at all
    assert all(_closed_within(s, 6) for s in (slow_head, stalled, kept, idle))


def test_a_slow_header_flood_with_64_streams_leaves_health_and_greedy_text_intact(guarded, model_dir):
    """A soak: a flood of connections that never finish their headers (new ones all the
    time, twice the connection cap open) while 64 streaming clients run, a quarter hanging up
    mid-stream; /health stays fast, the streams that stay get the greedy text of an
    unloaded run, and afterwards no request runs and no KV block is held."""
    url, stop, held = guarded.url, threading.Event(), []

    def flood():
        while not stop.is_set():
            for _ in range(16):  # refilled at up to 320 connections a second, to 2x the cap
                if len(held) >= 128:
                    held.pop(0).close()  # the server closed it long ago, or will
                try:
                    held.append(_partial(url, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: "))
                except OSError:
                    break
            time.sleep(0.05)

    prompts = ["The quick brown fox", "Once upon a time", "Paris is the capital", "def f(x):"]
    body = {"model": "tiny", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=60) as http:
        want = {p: http.post(COMP, json={**body, "prompt": p}).json()["choices"][0]["text"] for p in prompts}
    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    health: list[float] = []

    def probe():
        with httpx.Client(base_url=url, timeout=30) as http:
            while not stop.is_set():
                start = time.perf_counter()
                assert http.get("/health").status_code == 200
                health.append(time.perf_counter() - start)
                time.sleep(0.1)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()

    async def one(http: httpx.AsyncClient, prompt: str, leave_after: int | None) -> str | None:
        text = ""
        req = {**body, "prompt": prompt, "stream": True, "max_tokens": 24 if leave_after is None else 200}
        async with http.stream("POST", COMP, json=req) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
                    if leave_after is not None and len(text) >= leave_after:
                        return None
        return text

    async def streams():
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=32)) as http:
            plan = [(prompts[i % 4], 3 if i % 4 == 0 else None) for i in range(64)]
            return plan, await asyncio.gather(*(one(http, p, k) for p, k in plan))

    try:
        time.sleep(2)  # the flood is at the cap
        plan, results = asyncio.run(streams())
    finally:
        stop.set()
        flooder.join(10)
        prober.join(10)
        for s in held:
            s.close()
    assert all(text == want[p] for (p, k), text in zip(plan, results) if k is None)
    assert health and max(health) < 5.0, max(health)
    m = wait_idle(guarded, "tiny")
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert metric(m, f"infer:{gauge}", "tiny") == 0, gauge
    closing = [line for line in guarded.log if "closing a connection" in line]
    assert 1 <= len(closing) <= 10, closing  # rate-limited, not a line per connection


def test_at_the_shutdown_timeout_running_requests_end_with_errors_not_cuts(model_dir):
    """SIGTERM with requests that outlast --shutdown-timeout (24 sequences of 240 tokens,
    4 at a time): those still running then end with an error event and [DONE] (streams)
    or a 503 (whole responses) instead of a cut connection; no traceback; exit 0."""
    srv = Server(["--model", str(model_dir), "--served-model-name", "tiny", "--backend", "torch",
                  "--max-num-seqs", "4", "--max-model-len", "256", "--shutdown-timeout", "1"])
    body = {"prompt": "The quick brown fox", "max_tokens": 240, "temperature": 0, "ignore_eos": True, "n": 4}
    try:
        async def stream(http):
            async with http.stream("POST", COMP, json={**body, "stream": True}) as r:
                return r.status_code, [line async for line in r.aiter_lines() if line]

        async def run():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
                tasks = [asyncio.create_task(stream(http)) for _ in range(5)]
                await asyncio.sleep(0.2)
                tasks.append(asyncio.create_task(http.post(COMP, json=body)))  # queued last
                await asyncio.sleep(0.3)
                srv.proc.terminate()
                return await asyncio.gather(*tasks)

        *streams, whole = asyncio.run(run())
        cut = 0
        for status, lines in streams:
            assert status == 200 and lines[-1] == "data: [DONE]", lines[-3:]
            last = json.loads(lines[-2][6:])
            if "error" in last:
                cut += 1
                assert last["error"]["code"] == 503 and "shutting down" in last["error"]["message"]
            else:
                assert last["choices"][0]["finish_reason"] == "length"
        assert cut >= 2
        assert whole.status_code == 503 and "shutting down" in whole.json()["error"]["message"]
        assert srv.proc.wait(60) == 0
        time.sleep(0.5)  # the drain thread has the last lines
        assert not any("Traceback" in line or "Cancel" in line for line in srv.log), "".join(srv.log)
    finally:
        srv.stop()


def test_failed_accepts_are_logged_once_per_interval_not_per_attempt(caplog, monkeypatch):
    """What a file-handle exhaustion logs (asyncio reports each failed accept): one line per
    interval instead of ~390 MB a minute; other loop errors still reach the old handler."""
    from infer.server import guard

    monkeypatch.setattr(guard, "_last_logged", {})
    loop = asyncio.new_event_loop()
    try:
        others = []
        loop.set_exception_handler(lambda lp, ctx: others.append(ctx["message"]))
        guard.install_accept_error_limiter(loop)
        with caplog.at_level(logging.WARNING, logger="infer.server"):
            for _ in range(1000):
                loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                             "exception": OSError(24, "Too many open files")})
            loop.call_exception_handler({"message": "something else"})
    finally:
        loop.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "Too many open files" in lines[0], lines
    assert others == ["something else"]
