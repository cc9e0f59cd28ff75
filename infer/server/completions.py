"""POST /v1/completions: whole responses and SSE streams."""

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
from .protocol import CompletionRequest


async def create_completion(body: CompletionRequest, model: ServedModel, raw: Request) -> Response:
    params = body.to_sampling_params(model.sampling_defaults())
    prompts = body.prompts()
    raw.app.state.limits.check(len(prompts), params.n)
    gen = Generation(model, f"cmpl-{uuid.uuid4().hex}", params, body.priority)
    await gen.start(prompts)
    if body.stream:
        return GenerationStream(gen, _stream(gen, body, model))
    result = await until_disconnected(raw, lambda: _collect(gen, body, model))
    return JSONResponse(result) if result is not None else Response(status_code=499)


def _echo(model: ServedModel, out: RequestOutput) -> str:
    if out.prompt is not None:
        return out.prompt
    tok = model.tokenizer("echo the prompt")
    return tok.decode(out.prompt_token_ids)


async def _collect(gen: Generation, body: CompletionRequest, model: ServedModel) -> dict[str, Any]:
    final: dict[int, RequestOutput] = {}
    async for i, out in gen.outputs():
        final[i] = out
    n, choices = gen.params.n, []
    for i in sorted(final):
        out = final[i]
        prefix = _echo(model, out) if body.echo else ""
        for comp in out.outputs:
            lp = _logprobs(comp.logprobs, body.logprobs, len(prefix)) if comp.logprobs is not None else None
            choices.append({"index": i * n + comp.index, "text": prefix + comp.text, "logprobs": lp,
                            "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason})
    prompt_tokens = sum(len(o.prompt_token_ids) for o in final.values())
    completion_tokens = sum(len(c.token_ids) for o in final.values() for c in o.outputs)
    return {"id": gen.request_id, "object": "text_completion", "created": int(time.time()), "model": model.name,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}


async def _stream(gen: Generation, body: CompletionRequest, model: ServedModel) -> AsyncIterator[str]:
    created, n = int(time.time()), gen.params.n
    tracker = DeltaTracker(gen.params)
    prompt_tokens: dict[int, int] = {}
    completion_tokens = 0
    offsets: dict[int, int] = {}

    def chunk(choices: list[dict]) -> str:
        return sse({"id": gen.request_id, "object": "text_completion", "created": created, "model": model.name,
                    "choices": choices})

    async for i, out in gen.outputs():
        if i not in prompt_tokens:
            prompt_tokens[i] = len(out.prompt_token_ids)
            if body.echo:
                text = _echo(model, out)
                for k in range(n):
                    offsets[i * n + k] = len(text)
                yield chunk([{"index": i * n + k, "text": text, "logprobs": None, "finish_reason": None}
                             for k in range(n)])
        for comp in out.outputs:
            index = i * n + comp.index
            if index in tracker.done:
                continue
            text, tokens, lps = tracker.delta(index, comp)
            completion_tokens += len(tokens)
            if not text and not comp.finish_reason and not (lps and body.logprobs is not None):
                continue
            lp = None
            if lps is not None:
                lp = _logprobs(lps, body.logprobs, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + sum(len(x["token"]) for x in _tokens(lps))
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": comp.finish_reason}
            if comp.finish_reason:
                choice["stop_reason"] = comp.stop_reason
                tracker.done.add(index)
            yield chunk([choice])
    if body.include_usage:
        yield sse({"id": gen.request_id, "object": "text_completion", "created": created, "model": model.name,
                   "choices": [], "usage": usage(sum(prompt_tokens.values()), completion_tokens)})


def _tokens(entries: list[dict[int, Logprob]]) -> list[dict[str, Any]]:
    """The sampled token of each position (the first key, as the engine records it)."""
    out = []
    for entry in entries:
        tid, lp = next(iter(entry.items()))
        out.append({"id": tid, "token": lp.decoded_token or "", "logprob": clamp_logprob(lp.logprob)})
    return out


def _logprobs(entries: list[dict[int, Logprob]], n: int | None, offset: int) -> dict[str, Any]:
    """OpenAI's legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    sampled = _tokens(entries)
    offsets = []
    for tok in sampled:
        offsets.append(offset)
        offset += len(tok["token"])
    # vLLM's top_logprobs hold the sampled token as well as the top n.
    top = [{(lp.decoded_token or ""): clamp_logprob(lp.logprob) for _, lp in [next(iter(e.items()))] + ranked(e, n or 0)}
           for e in entries]
    return {"tokens": [t["token"] for t in sampled], "token_logprobs": [t["logprob"] for t in sampled],
            "top_logprobs": top, "text_offset": offsets}
