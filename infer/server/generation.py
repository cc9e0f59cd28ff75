"""The engine requests behind one API request, and what completions and chat share:
merged streams, text deltas, usage, disconnect handling, SSE framing."""

from __future__ import annotations

import asyncio
import json
import math
import re
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..core.async_engine import EngineDeadError
from ..core.outputs import CompletionOutput, Logprob, RequestOutput
from ..core.sampling_params import SamplingParams
from .errors import APIError, error_body, log
from .models import ServedModel

T = TypeVar("T")
# JSON has no -inf; vLLM reports impossible tokens with this floor.
MIN_LOGPROB = -9999.0


class Generation:
    """One engine request per prompt of an API request (choice index = prompt * n + i)."""

    def __init__(self, model: ServedModel, request_id: str, params: SamplingParams, priority: int):
        self.model, self.request_id, self.params, self.priority = model, request_id, params, priority
        self._streams: list[AsyncIterator[RequestOutput]] = []
        self._ids: list[str] = []
        self._finished: set[str] = set()

    async def start(self, prompts: list[str | dict]) -> None:
        """Queue every prompt; a refused one aborts the others and becomes a 400."""
        if self.model.cut_short:
            raise APIError(503, "the server is shutting down")
        self.model.live.add(self)
        for i, prompt in enumerate(prompts):
            rid = f"{self.request_id}-{i}"
            try:
                prompt = await self._within_context(prompt)
                stream = await self.model.llm.generate(rid, prompt, self.params, self.priority, self.model.lora)
            except (ValueError, TypeError) as exc:
                self.abort()
                message = str(exc).replace(f"request {rid!r}: ", "")
                field = re.search(r"SamplingParams\.(\w+)", message)
                spec = self.params.structured_outputs
                param = spec.field_name if spec is not None and message.startswith(spec.field_name) else (
                    field[1] if field else "prompt")
                raise APIError(400, message.replace("SamplingParams.", ""), param) from None
            except EngineDeadError as exc:
                self.abort()
                raise APIError(503, str(exc)) from None
            except BaseException:
                self.abort()
                raise
            self._ids.append(rid)
            self._streams.append(stream)

    async def _within_context(self, prompt: str | dict) -> str | dict:
        """The prompt as token ids, after vLLM's check that the prompt and
        max_tokens fit the context (the engine alone would cut max_tokens).
        A prompt with no room at all is left for the engine to refuse."""
        if self.params.max_tokens is None:
            if isinstance(prompt, str):  # the engine thread tokenizes it
                self.model.check_text_length(len(prompt), "prompt")
            return prompt
        if isinstance(prompt, str):  # tokenized here, on the server's own copy of the tokenizer
            prompt = {"prompt": prompt, "prompt_token_ids": await self.model.off_loop(self.model.encode, prompt)}
        n, limit, asked = len(prompt.get("prompt_token_ids", ())), self.model.max_model_len, self.params.max_tokens
        if 0 < n < limit < n + asked:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{n + asked} tokens ({n} in the messages, {asked} in the completion). Please reduce "
                                "the length of the messages or completion.", "max_tokens")
        return prompt

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, newest output) as they come, over all prompts."""
        try:
            if len(self._streams) == 1:
                async for out in self._streams[0]:
                    self._note(out)
                    yield 0, out
                return
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
                try:
                    async for out in stream:
                        await queue.put((i, out))
                except Exception as exc:
                    await queue.put((i, exc))

            tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self._streams)]
            try:
                live = len(tasks)
                while live:
                    i, out = await queue.get()
                    if isinstance(out, Exception):
                        raise out
                    self._note(out)
                    live -= out.finished
                    yield i, out
            finally:
                for t in tasks:
                    t.cancel()
        finally:
            self.abort()

    def _note(self, out: RequestOutput) -> None:
        if out.finished:
            self._finished.add(out.request_id)
            if self.model.cut_short and any(c.finish_reason == "abort" for c in out.outputs):
                raise APIError(503, "the server is shutting down: the request was ended at --shutdown-timeout "
                                    "before it finished")
            if any(c.finish_reason == "error" for c in out.outputs):
                raise APIError(500, "the model produced non-finite values (nan or inf) for this request, which was "
                                    "ended; see the server log")

    def abort(self) -> None:
        """Abort every request still running (client gone, error, shutdown)."""
        self.model.live.discard(self)
        for rid in self._ids:
            if rid not in self._finished:
                self.model.llm.abort(rid)
                self._finished.add(rid)


class DeltaTracker:
    """What each choice has already sent, so a stream sends only the new part.

    With stop strings the tail that could still turn out to be the start of
    one is held back until it cannot, so streamed text always equals the final
    text (which the engine cuts before the stop string).
    """

    def __init__(self, params: SamplingParams):
        stops = params.stop_strings if not params.include_stop_str_in_output else ()
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text: dict[int, int] = {}
        self.tokens: dict[int, int] = {}
        self.done: set[int] = set()

    def delta(self, index: int, comp: CompletionOutput) -> tuple[str, list[int], list[dict[int, Logprob]] | None]:
        sent_text, sent_tokens = self.text.get(index, 0), self.tokens.get(index, 0)
        end = len(comp.text) if comp.finish_reason else max(sent_text, len(comp.text) - self.hold)
        self.text[index], self.tokens[index] = end, len(comp.token_ids)
        logprobs = comp.logprobs[sent_tokens:] if comp.logprobs is not None else None
        return comp.text[sent_text:end], comp.token_ids[sent_tokens:], logprobs


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def clamp_logprob(lp: float) -> float:
    return max(lp, MIN_LOGPROB) if not math.isnan(lp) else MIN_LOGPROB


def ranked(entry: dict[int, Logprob], n: int) -> list[tuple[int, Logprob]]:
    """The top-n entries of one position's logprobs, best first."""
    top = [(t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= n]
    return sorted(top, key=lambda x: x[1].rank)


def sse(data: dict | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n"


async def sse_stream(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """SSE frames ending with ``data: [DONE]``; a failure mid-stream becomes an error event."""
    try:
        async for chunk in chunks:
            yield chunk
    except APIError as exc:
        yield sse(error_body(exc.status, exc.message, exc.param))
    except EngineDeadError as exc:
        yield sse(error_body(503, str(exc)))
    except Exception:  # a bug: the client still gets an error and the end of the stream, not a cut connection
        log.exception("unhandled error in a stream")
        yield sse(error_body(500, "internal server error; see the server log"))
    yield sse("[DONE]")


class GenerationStream(StreamingResponse):
    """SSE response that aborts its engine requests however it ends.

    A client gone before the first chunk cancels the response before its body
    generator ever starts, so that generator's own cleanup never runs.
    """

    def __init__(self, gen: Generation, chunks: AsyncIterator[str]):
        super().__init__(sse_stream(chunks), media_type="text/event-stream")
        self.gen = gen

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.gen.abort()


async def until_disconnected(request: Request, work: Callable[[], Awaitable[T]]) -> T | None:
    """Run `work`; cancel it (aborting its requests) if the client hangs up first."""
    task = asyncio.ensure_future(work())

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # its generators' cleanup aborts the engine requests
            await asyncio.wait({task})
    if task.cancelled():
        return None
    try:
        return task.result()
    except EngineDeadError as exc:
        raise APIError(503, str(exc)) from None
