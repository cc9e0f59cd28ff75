"""POST /v1/chat/completions: the model's chat template, whole responses and SSE streams."""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..core.outputs import Logprob, RequestOutput
from .generation import (DeltaTracker, Generation, GenerationStream, clamp_logprob, ranked, sse,
                         until_disconnected, usage)
from .models import ServedModel
from .protocol import ChatCompletionRequest


async def create_chat_completion(body: ChatCompletionRequest, model: ServedModel, raw: Request) -> Response:
    params = body.to_sampling_params(model.sampling_defaults())
    ids = model.chat_prompt([m.for_template() for m in body.messages], body.add_generation_prompt)
    gen = Generation(model, f"chatcmpl-{uuid.uuid4().hex}", params, body.priority)
    await gen.start([{"prompt_token_ids": ids}])
    if body.stream:
        return GenerationStream(gen, _stream(gen, body, model))
    result = await until_disconnected(raw, lambda: _collect(gen, body, model))
    return JSONResponse(result) if result is not None else Response(status_code=499)


async def _collect(gen: Generation, body: ChatCompletionRequest, model: ServedModel) -> dict[str, Any]:
    final: RequestOutput | None = None
    async for _, out in gen.outputs():
        final = out
    assert final is not None  # the engine always ends a stream with a finished output
    choices = []
    for comp in final.outputs:
        lp = _logprobs(comp.logprobs, body.top_logprobs or 0) if comp.logprobs is not None else None
        choices.append({"index": comp.index, "message": {"role": "assistant", "content": comp.text},
                        "logprobs": lp, "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason})
    completion_tokens = sum(len(c.token_ids) for c in final.outputs)
    return {"id": gen.request_id, "object": "chat.completion", "created": int(time.time()), "model": model.name,
            "choices": choices, "usage": usage(len(final.prompt_token_ids), completion_tokens)}


async def _stream(gen: Generation, body: ChatCompletionRequest, model: ServedModel) -> AsyncIterator[str]:
    created = int(time.time())
    tracker = DeltaTracker(gen.params)
    prompt_tokens, completion_tokens = 0, 0

    def chunk(choices: list[dict], **extra: Any) -> str:
        return sse({"id": gen.request_id, "object": "chat.completion.chunk", "created": created,
                    "model": model.name, "choices": choices, **extra})

    # The role comes first, alone, as OpenAI sends it.
    yield chunk([{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                 for k in range(gen.params.n)])
    async for _, out in gen.outputs():
        prompt_tokens = len(out.prompt_token_ids)
        for comp in out.outputs:
            if comp.index in tracker.done:
                continue
            text, tokens, lps = tracker.delta(comp.index, comp)
            completion_tokens += len(tokens)
            if not text and not comp.finish_reason and not lps:
                continue
            choice: dict[str, Any] = {"index": comp.index, "delta": {"content": text} if text else {},
                                      "logprobs": _logprobs(lps, body.top_logprobs or 0) if lps is not None else None,
                                      "finish_reason": comp.finish_reason}
            if comp.finish_reason:
                choice["stop_reason"] = comp.stop_reason
                tracker.done.add(comp.index)
            yield chunk([choice])
    if body.include_usage:
        yield chunk([], usage=usage(prompt_tokens, completion_tokens))


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": clamp_logprob(logprob), "bytes": list(token.encode("utf-8"))}


def _logprobs(entries: list[dict[int, Logprob]], n: int) -> dict[str, Any]:
    """Chat logprobs: per token its logprob, bytes and the top n alternatives."""
    content = []
    for entry in entries:
        _, lp = next(iter(entry.items()))  # the sampled token comes first
        item = _entry(lp.decoded_token or "", lp.logprob)
        item["top_logprobs"] = [_entry(t.decoded_token or "", t.logprob) for _, t in ranked(entry, n)]
        content.append(item)
    return {"content": content}
