"""Data parallelism: N engine replicas of one model behind one API server.

Each replica is a whole `LLMEngine` (itself maybe tensor/pipeline parallel,
with its own ranks) served by its own `AsyncLLM`. `DataParallelLLM` has
AsyncLLM's interface and sends each new request to the least loaded replica:
fewest requests in flight (counted here, when routed, so a burst spreads
before any engine thread has seen it), then the lowest KV cache use, then the
lowest index.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from .async_engine import AsyncLLM
from .outputs import RequestOutput
from .sampling_params import SamplingParams


class DataParallelLLM:
    def __init__(self, replicas: list[AsyncLLM]):
        if not replicas:
            raise ValueError("data parallel needs at least one replica")
        self.replicas = replicas
        self.in_flight = [0] * len(replicas)
        self._owner: dict[str, int] = {}


    @property
    def engine(self):
        """The first replica's engine: tokenizer, config and limits are the same on every replica."""
        return self.replicas[0].engine

    @property
    def dead(self) -> BaseException | None:
        return next((r.dead for r in self.replicas if r.dead is not None), None)

    @property
    def failure(self) -> str | None:
        """Why a replica cannot serve, naming it; None when all can."""
        return next((f"replica {i}: {r.failure}" for i, r in enumerate(self.replicas) if r.failure), None)

    @property
    def num_unfinished(self) -> int:
        return sum(r.num_unfinished for r in self.replicas)

    def pick(self) -> int:
        """The replica the next request goes to."""
        def load(i: int) -> tuple:
            return self.in_flight[i], self.replicas[i].kv_usage, i

        live = [i for i, r in enumerate(self.replicas) if r.failure is None] or list(range(len(self.replicas)))
        return min(live, key=load)

    async def generate(self, request_id: str, prompt: str | dict, params: SamplingParams,
                       priority: int = 0, lora_request=None) -> AsyncIterator[RequestOutput]:
        i = self.pick()
        self.in_flight[i] += 1
        try:
            stream = await self.replicas[i].generate(request_id, prompt, params, priority, lora_request)
        except BaseException:
            self.in_flight[i] -= 1
            raise
        self._owner[request_id] = i
        return self._iterate(request_id, i, stream)

    async def encode(self, request_id: str, prompt: str | dict, params) -> Any:
        """A pooling request on the least loaded replica (`AsyncLLM.encode`)."""
        async for out in await self.generate(request_id, prompt, params):
            if out.finished:
                return out
        raise RuntimeError(f"request {request_id!r} ended without a result")

    async def _iterate(self, request_id: str, i: int, stream: AsyncIterator[RequestOutput]):
        try:
            async for out in stream:
                yield out
        finally:
            self.in_flight[i] -= 1
            self._owner.pop(request_id, None)
            await stream.aclose()

    def abort(self, request_id: str) -> None:
        i = self._owner.get(request_id)
        for r in self.replicas if i is None else [self.replicas[i]]:
            r.abort(request_id)

    def shutdown(self, timeout: float = 10.0) -> None:
        for r in self.replicas:
            r.shutdown(timeout)

    def __getattr__(self, name: str) -> Any:  # stat_loggers, ...: the first replica's
        return getattr(self.replicas[0], name)
