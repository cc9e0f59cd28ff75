"""AsyncLLM: one LLMEngine stepped by its own thread, fed and drained by asyncio.

The engine is not thread-safe, so only the engine thread touches it: asyncio
code hands requests and aborts over through a locked inbox, and gets outputs
back through `loop.call_soon_threadsafe`. Outputs are cumulative (the whole
text and token list so far), so a slow consumer only needs the newest one: each
stream keeps the latest output, never a backlog.

Each step also yields an `IterationStats` and the scheduler's snapshot, handed
to the `stat_loggers` (the server's Prometheus metrics) on the engine thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from ..openmp import release_pool
from .engine import LLMEngine
from .outputs import RequestOutput
from .pooling import PoolingRequestOutput
from .sampling_params import SamplingParams
from .scheduler import SchedulerStats


class EngineDeadError(RuntimeError):
    """The engine thread failed; every live request was failed with it."""


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    """What one engine step did, for the metrics."""

    num_prompt_tokens: int = 0  # of requests whose prefill finished this step
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    queue_times: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    num_pooled: int = 0  # pooling requests (embeddings, scores) served this step


# Called on the engine thread after every loop iteration; the iteration stats
# are None when the loop only handled adds or aborts.
StatLogger = Callable[[SchedulerStats, "IterationStats | None"], None]


class _Stream:
    """The latest output of one request, awaited by its asyncio consumer."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.latest: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()
        self.accepted: asyncio.Future = loop.create_future()

    def put(self, item: RequestOutput | BaseException) -> None:  # on the event loop
        self.latest = item
        self.ready.set()


@dataclass
class _Tracked:
    """Engine-thread bookkeeping of a request, for latency stats."""

    arrival: float
    scheduled: bool = False
    num_tokens: int = 0
    last_token_time: float | None = None


class AsyncLLM:
    """Serve one LLMEngine to many concurrent asyncio callers."""

    def __init__(self, engine: LLMEngine, stat_loggers: list[StatLogger] | None = None):
        self.engine = engine
        self.stat_loggers = list(stat_loggers or [])
        self.dead: BaseException | None = None
        self._cv = threading.Condition()
        self._adds: list[tuple[str, Any, SamplingParams, int, _Stream, Any]] = []  # ..., the LoRARequest
        self._aborts: list[str] = []
        self._calls: list[tuple[Callable[[LLMEngine], Any], asyncio.Future]] = []  # `call`: fn(engine), its future
        self._stop = False
        self.kv_usage = 0.0  # the pool's use after the last iteration, published by the engine thread
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._thread = threading.Thread(target=self._loop, name="infer-engine", daemon=True)
        self._thread.start()

    # -- the asyncio side ---------------------------------------------------------
    async def generate(self, request_id: str, prompt: str | dict, params: SamplingParams,
                       priority: int = 0, lora_request=None) -> AsyncIterator[RequestOutput]:
        """Queue a request; once the engine accepted it, an iterator of its outputs.

        Raises ValueError/TypeError (the engine's message) when the engine
        refuses the request, EngineDeadError when the engine has failed.
        Closing the iterator before the last output aborts the request.
        """
        if getattr(params, "structured_outputs", None) is not None:  # (a pooling request's PoolingParams has none)
            # Compiled on the grammar thread before the engine sees the request: a bad
            # grammar is the caller's ValueError, and the step loop never waits for one.
            # Shielded: a caller that gives up must not cancel a compile others share.
            await asyncio.shield(asyncio.wrap_future(self.engine.structured.compile(params.structured_outputs)))
        stream = _Stream(asyncio.get_running_loop())
        with self._cv:
            if self.dead is not None:
                raise EngineDeadError(f"the engine failed earlier: {self.dead}")
            if self._stop:
                raise EngineDeadError("the engine is shutting down")
            self._adds.append((request_id, prompt, params, priority, stream, lora_request))
            self._cv.notify()
        try:
            await stream.accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # it may have been accepted meanwhile, with nobody left to read it
            raise
        return self._iterate(request_id, stream)

    async def encode(self, request_id: str, prompt: str | dict, params) -> PoolingRequestOutput:
        """A pooling model's result for one input (`PoolingEngine`): ValueError/TypeError when the
        engine refuses it, EngineDeadError when the engine has failed."""
        async for out in await self.generate(request_id, prompt, params):
            if out.finished:
                return out
        raise EngineDeadError(f"request {request_id!r} ended without a result")

    async def _iterate(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                await stream.ready.wait()
                stream.ready.clear()
                item = stream.latest
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # the consumer left early (client disconnect, cancel)
                self.abort(request_id)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """fn(engine) on the engine thread between two steps; its result, or its exception,
        here. The only way the server changes the engine (LoRA loads and unloads): the
        engine is touched by one thread, so its parts need no locks."""
        future = asyncio.get_running_loop().create_future()
        with self._cv:
            if self.dead is not None:
                raise EngineDeadError(f"the engine failed earlier: {self.dead}")
            if self._stop:
                raise EngineDeadError("the engine is shutting down")
            self._calls.append((fn, future))
            self._cv.notify()
        return await future

    def abort(self, request_id: str) -> None:
        """Abort a request; safe from any thread, a no-op once it finished."""
        with self._cv:
            self._aborts.append(request_id)
            self._cv.notify()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is left and stop the engine thread."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine.shutdown()  # worker ranks of a distributed engine stop with it

    @property
    def replicas(self) -> list[AsyncLLM]:
        return [self]

    @property
    def failure(self) -> str | None:
        """Why this engine cannot serve (it failed, or one of its worker ranks died), or None."""
        if self.dead is not None:
            return f"{type(self.dead).__name__}: {self.dead}"
        executor = getattr(self.engine, "executor", None)  # test doubles of the engine have none
        return executor.failure if executor is not None else None

    @property
    def num_unfinished(self) -> int:
        return len(self._tracked)

    # -- the engine thread ------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._cv:
                if not (self._adds or self._aborts or self._calls or self._stop or engine.has_unfinished_requests()):
                    release_pool()  # idle: no OpenMP pool of this thread's competes with another's (infer/openmp.py)
                while not (self._adds or self._aborts or self._calls or self._stop or engine.has_unfinished_requests()):
                    self._cv.wait()
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
                calls, self._calls = self._calls, []
                stop = self._stop
            for fn, future in calls:
                try:
                    result, error = fn(engine), None
                except Exception as exc:  # the caller's to handle (a bad adapter, an unknown name)
                    result, error = None, exc
                _call(future.get_loop(), _settle, future, result, error)
            for item in adds:
                self._add(*item)
            for rid in aborts + (list(self._streams) if stop else []):
                engine.abort_request(rid)
            iteration = None
            if engine.has_unfinished_requests():
                try:
                    iteration = self._step()
                except Exception as exc:  # a backend bug must not hang every client
                    self._fail_all(exc)
                    return
            elif stop:
                return
            stats = engine.get_stats()
            self.kv_usage = stats.kv_cache_usage
            self._log(stats, iteration)

    def _add(self, request_id: str, prompt: Any, params: SamplingParams, priority: int, stream: _Stream,
             lora_request=None) -> None:
        loop = stream.loop
        arrival = time.time()
        try:
            kw = {"lora_request": lora_request} if lora_request is not None else {}
            self.engine.add_request(request_id, prompt, params, priority=priority, arrival_time=arrival, **kw)
        except Exception as exc:  # the engine names what was wrong: the caller's 400
            _call(loop, _resolve, stream.accepted, exc)
            return
        self._streams[request_id] = stream
        self._tracked[request_id] = _Tracked(arrival)
        if not _call(loop, _resolve, stream.accepted, None):
            self.engine.abort_request(request_id)

    def _step(self) -> IterationStats:
        start = time.time()
        outputs = self.engine.step()
        now = time.time()
        it = IterationStats()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            tracked = self._tracked.get(out.request_id)
            if stream is None or tracked is None:
                continue
            self._account(it, out, tracked, start, now)
            if not _call(stream.loop, stream.put, _snapshot(out)) and not out.finished:
                self.engine.abort_request(out.request_id)  # its event loop is gone: nobody will read it
            if out.finished:
                del self._streams[out.request_id], self._tracked[out.request_id]
        return it

    @staticmethod
    def _account(it: IterationStats, out: RequestOutput, t: _Tracked, start: float, now: float) -> None:
        if not t.scheduled:
            t.scheduled = True
            it.queue_times.append(max(0.0, start - t.arrival))
        if isinstance(out, PoolingRequestOutput):  # one step, prompt only
            it.num_prompt_tokens += len(out.prompt_token_ids)
            it.num_pooled += 1
            it.finished.append(FinishedRequestStats("stop", now - t.arrival, len(out.prompt_token_ids), 0))
            return
        n = sum(len(c.token_ids) for c in out.outputs)
        new = n - t.num_tokens
        if new > 0:
            if t.last_token_time is None:
                it.num_prompt_tokens += len(out.prompt_token_ids)
                it.time_to_first_tokens.append(now - t.arrival)
            else:
                it.inter_token_latencies.append(now - t.last_token_time)
            it.num_generation_tokens += new
            t.num_tokens, t.last_token_time = n, now
        if out.finished:
            reason = out.outputs[0].finish_reason or "abort"
            it.finished.append(FinishedRequestStats(reason, now - t.arrival, len(out.prompt_token_ids), n))

    def _fail_all(self, exc: Exception) -> None:
        err = EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}")
        with self._cv:  # under the lock, so no add can slip in after the drain
            self.dead = exc
            pending, self._adds = self._adds, []
            calls, self._calls = self._calls, []
        for _, future in calls:
            _call(future.get_loop(), _resolve, future, err)
        for stream in self._streams.values():
            _call(stream.loop, stream.put, err)
        for item in pending:
            stream = item[4]
            _call(stream.loop, _resolve, stream.accepted, err)
        self._streams.clear()
        self._tracked.clear()

    def _log(self, stats: SchedulerStats, iteration: IterationStats | None) -> None:
        for logger in self.stat_loggers:
            logger(stats, iteration)


def _call(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> bool:
    """Run fn(*args) on the loop; False when that loop is closed (its caller is gone)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:
        return False


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    _settle(future, None, error)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def _snapshot(out: RequestOutput) -> RequestOutput:
    """A copy safe to read on the event loop while the engine keeps appending.

    The engine hands out its live logprobs lists; token_ids are copies already.
    A pooling result is made once and never changed.
    """
    if isinstance(out, PoolingRequestOutput):
        return out
    outputs = [dataclasses.replace(c, logprobs=list(c.logprobs)) if c.logprobs is not None else c for c in out.outputs]
    return dataclasses.replace(out, outputs=outputs)
