"""AsyncLLM: one engine thread serving many asyncio callers, in-process on a tiny model."""

from __future__ import annotations

import asyncio
import time

import pytest
from server_harness import make_tiny_model_dir

from infer.core.async_engine import AsyncLLM, EngineDeadError
from infer.core.engine import LLMEngine
from infer.core.llm import LLM
from infer.core.sampling_params import SamplingParams

PROMPTS = ["The quick brown fox", "Once upon a time", "Paris is", "def f(x):", "Ünïcödé 🙂", "Berlin"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def stats():
    return []


@pytest.fixture
def allm(model_dir, stats):
    llm = AsyncLLM(LLMEngine(model=str(model_dir), backend="torch", max_num_seqs=4),
                   [lambda s, it: stats.append((s, it))])
    yield llm
    llm.shutdown()
    bm = llm.engine.scheduler.block_manager
    assert not llm.engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks


async def collect(allm: AsyncLLM, rid: str, prompt, params=GREEDY):
    outs = [out async for out in await allm.generate(rid, prompt, params)]
    return outs


def wait_idle(allm: AsyncLLM, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while allm.num_unfinished or allm.engine.has_unfinished_requests():
        assert time.time() < deadline, "the engine did not go idle"
        time.sleep(0.01)


def test_concurrent_requests_match_offline_generate(allm, model_dir):
    want = LLM(str(model_dir), backend="torch").generate(PROMPTS, GREEDY, use_tqdm=False)

    async def run():
        return await asyncio.gather(*(collect(allm, f"r{i}", p) for i, p in enumerate(PROMPTS)))

    results = asyncio.run(run())
    for outs, w in zip(results, want):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert outs[-1].outputs[0].text == w.outputs[0].text
        assert outs[-1].outputs[0].token_ids == w.outputs[0].token_ids
        # outputs are cumulative: each one extends the previous
        ids = [o.outputs[0].token_ids for o in outs]
        assert all(b[:len(a)] == a for a, b in zip(ids, ids[1:]))


def test_refused_request_raises_and_the_engine_keeps_serving(allm):
    async def run():
        with pytest.raises(ValueError, match="max_model_len"):
            await allm.generate("long", "word " * 400, GREEDY)
        with pytest.raises(ValueError, match="already in use"):
            first = await allm.generate("dup", PROMPTS[0], GREEDY)
            await allm.generate("dup", PROMPTS[0], GREEDY)
        outs = [o async for o in first]
        return outs, await collect(allm, "ok", PROMPTS[1])

    first, ok = asyncio.run(run())
    assert len(first[-1].outputs[0].token_ids) == 12 and len(ok[-1].outputs[0].token_ids) == 12


def test_leaving_the_iterator_early_aborts_and_frees_blocks(allm, stats):
    async def run():
        stream = await allm.generate("leave", PROMPTS[0], SamplingParams(temperature=0, max_tokens=200,
                                                                          ignore_eos=True))
        async for out in stream:
            if out.outputs[0].token_ids:
                break
        await stream.aclose()

    asyncio.run(run())
    wait_idle(allm)
    finished = [f for _, it in stats if it for f in it.finished]
    assert [f.finish_reason for f in finished] == ["abort"]
    assert finished[0].num_generation_tokens < 200


def test_stat_loggers_see_every_token(allm, stats):
    async def run():
        return await asyncio.gather(*(collect(allm, f"s{i}", p) for i, p in enumerate(PROMPTS[:3])))

    results = asyncio.run(run())
    wait_idle(allm)
    its = [it for _, it in stats if it]
    assert sum(it.num_generation_tokens for it in its) == 36
    assert sum(it.num_prompt_tokens for it in its) == sum(len(r[-1].prompt_token_ids) for r in results)
    assert len([t for it in its for t in it.time_to_first_tokens]) == 3
    assert len([t for it in its for t in it.inter_token_latencies]) == 33
    assert len([t for it in its for t in it.queue_times]) == 3
    assert sorted(f.finish_reason for it in its for f in it.finished) == ["length"] * 3
    last = stats[-1][0]
    assert last.num_running == 0 and last.num_waiting == 0 and last.kv_cache_usage == 0


def test_shutdown_aborts_in_flight_requests(allm):
    async def run():
        stream = await allm.generate("long", PROMPTS[0], SamplingParams(temperature=0, max_tokens=200,
                                                                         ignore_eos=True))
        outs = []
        async for out in stream:
            outs.append(out)
            if len(outs) == 2:
                await asyncio.to_thread(allm.shutdown)
        return outs

    outs = asyncio.run(run())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert not allm._thread.is_alive()

    async def late():
        await allm.generate("late", PROMPTS[0], GREEDY)

    with pytest.raises(EngineDeadError, match="shutting down"):
        asyncio.run(late())


def test_engine_failure_fails_streams_instead_of_hanging(allm, monkeypatch):
    def broken_step():
        raise RuntimeError("device lost")

    assert allm.failure is None  # a healthy one-process engine (no worker ranks) can serve

    async def run():
        stream = await allm.generate("x", PROMPTS[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        monkeypatch.setattr(allm.engine, "step", broken_step)
        return [o async for o in stream]

    with pytest.raises(EngineDeadError, match="device lost"):
        asyncio.run(run())
    assert allm.dead is not None and allm.failure == "RuntimeError: device lost"

    async def later():
        await allm.generate("y", PROMPTS[0], GREEDY)

    with pytest.raises(EngineDeadError, match="failed earlier"):
        asyncio.run(later())
    monkeypatch.undo()
    allm.engine.abort_request("x")  # the thread is gone; clean up so the fixture's leak check holds
    allm.engine.step()


def test_a_program_that_never_shuts_the_engine_down_still_exits(model_dir):
    """The engine thread is a daemon: forgetting `shutdown` must not keep the interpreter alive."""
    import subprocess
    import sys

    code = ("from infer.core.async_engine import AsyncLLM\nfrom infer.core.engine import LLMEngine\n"
            f"AsyncLLM(LLMEngine(model={str(model_dir)!r}, backend='cpu_ref', max_num_seqs=2))\nprint('built')\n")
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the process did not exit: {exc.stdout}") from None
    assert r.returncode == 0 and r.stdout.strip() == "built", r.stderr


def test_a_caller_cancelled_before_acceptance_leaves_no_request_running(allm, stats):
    """The engine thread cannot take the request until the caller has been cancelled (the
    test holds the engine's lock meanwhile): the request must then be aborted, not
    generated for nobody."""
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)

    async def run():
        with allm._cv:  # re-entrant: generate() takes it too, the engine thread waits
            task = asyncio.create_task(allm.generate("gone", "The quick brown fox", long))
            await asyncio.sleep(0)  # it queued the request and waits for acceptance
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        # The caller's loop stays open (a closed one would make the engine drop the request itself)
        # until the request has finished one way or the other.
        deadline = time.time() + 30
        while not finished_stats():
            assert time.time() < deadline, "the request never finished"
            await asyncio.sleep(0.01)

    def finished_stats():
        return [f for _, it in list(stats) if it is not None for f in it.finished]

    asyncio.run(run())
    wait_idle(allm)
    finished = finished_stats()
    assert [f.finish_reason for f in finished] == ["abort"]
    assert sum(f.num_generation_tokens for f in finished) < 60


def test_a_request_whose_caller_loop_closed_before_acceptance_is_never_run(allm, stats):
    """The caller's event loop closes before the engine thread takes the request (the test
    holds the engine's lock meanwhile): the request is aborted at once, not prefilled and
    sampled for nobody."""
    loop = asyncio.new_event_loop()
    with allm._cv:
        loop.create_task(allm.generate("orphan", PROMPTS[0], SamplingParams(temperature=0, max_tokens=60,
                                                                            ignore_eos=True)))
        loop.run_until_complete(asyncio.sleep(0))  # it queued the request and waits for acceptance
        loop.close()

    def finished_stats():
        return [f for _, it in list(stats) if it is not None for f in it.finished]

    deadline = time.time() + 30
    while not finished_stats():  # the stats of a step are logged after its requests are untracked
        assert time.time() < deadline, "the request never finished"
        time.sleep(0.01)
    wait_idle(allm)
    assert [f.finish_reason for f in finished_stats()] == ["abort"]
    assert sum(it.num_generation_tokens for _, it in stats if it) == 0


def test_an_output_nobody_streams_does_not_hide_the_rest_of_the_step(allm):
    """A step's output for a request no caller streams any more (aborted meanwhile) is skipped;
    the outputs after it in the same step still reach their callers."""
    import copy

    real = allm.engine.step

    def step():
        outs = real()
        if not outs:
            return outs
        ghost = copy.copy(outs[0])
        ghost.request_id = "ghost"
        return [ghost, *outs]

    allm.engine.step = step

    async def run():
        return await asyncio.wait_for(collect(allm, "r0", PROMPTS[0]), 20)

    outs = asyncio.run(run())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == GREEDY.max_tokens


def test_call_runs_on_the_engine_thread_between_steps(allm):
    """`AsyncLLM.call` is how the server changes an engine: fn(engine) runs on the engine
    thread (the only one that touches it), its result or exception comes back to the caller,
    and requests in flight keep going around it."""
    import threading

    def where(engine):
        assert engine is allm.engine
        return threading.current_thread().name

    def bad(engine):
        raise KeyError("no such adapter")

    async def run():
        outs = asyncio.ensure_future(collect(allm, "r", PROMPTS[0]))
        name = await allm.call(where)
        with pytest.raises(KeyError, match="no such adapter"):
            await allm.call(bad)
        return name, await outs

    name, outs = asyncio.run(run())
    assert name == "infer-engine" and outs[-1].finished
    assert 0.0 <= allm.kv_usage <= 1.0
    allm.shutdown()
    with pytest.raises(EngineDeadError, match="shutting down"):
        asyncio.run(allm.call(where))
