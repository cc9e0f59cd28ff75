"""POST /v1/chat/completions: the model's chat template, whole responses and SSE streams."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..core.outputs import Logprob, RequestOutput
from ..core.structured import StructuredOutputsParams
from .chat_output import ChoiceStream, Message, ToolMode, finish_reason
from .errors import APIError
from .generation import (DeltaTracker, Generation, GenerationStream, clamp_logprob, ranked, sse,
                         until_disconnected, usage)
from .models import ServedModel
from .protocol import ChatCompletionRequest
from .tool_parsers import HermesToolParser


async def create_chat_completion(body: ChatCompletionRequest, model: ServedModel, raw: Request) -> Response:
    params = body.to_sampling_params(model.sampling_defaults())
    mode, grammar, messages, tools = _tool_plan(body, model)
    if grammar is not None:
        params = dataclasses.replace(params, structured_outputs=grammar)
    prompt = await model.off_loop(model.chat_prompt, messages, body.add_generation_prompt, tools)
    gen = Generation(model, f"chatcmpl-{uuid.uuid4().hex}", params, body.priority)
    await gen.start([prompt])
    if body.stream:
        return GenerationStream(gen, _stream(gen, body, model, mode))
    result = await until_disconnected(raw, lambda: _collect(gen, body, model, mode))
    return JSONResponse(result) if result is not None else Response(status_code=499)


def _tool_plan(body: ChatCompletionRequest, model: ServedModel):
    """(ToolMode, grammar for the tool choice or None, messages for the template, tools for the template)."""
    messages = [m.for_template() for m in body.messages]
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return ToolMode(), None, messages, None
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    functions = {t.function.name: t.function for t in body.tools}
    choice = "auto" if choice is None else choice
    if choice == "none":
        return ToolMode(), None, messages, None
    structured = body.structured_spec()
    if structured is not None and choice != "auto":
        raise APIError(400, "tool_choice 'required' or a named function already fixes the output's format; "
                            "drop response_format / structured_outputs", "tool_choice")
    parser = model.tool_parser
    if choice == "auto":
        if not (model.auto_tool_choice and parser is not None):
            raise APIError(400, '"auto" tool choice requires the server to run with --enable-auto-tool-choice and '
                                "--tool-call-parser", "tool_choice")
        mode, grammar = ToolMode("auto", parser=parser), None
    elif choice == "required":
        defs: dict = {}
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                  "properties": {"name": {"const": name}, "parameters": _hoist_defs(_parameters(f), f"{i}_", defs)}}
                 for i, (name, f) in enumerate(functions.items())]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if defs:
            schema["$defs"] = defs
        if not body.parallel_tool_calls:
            schema["maxItems"] = 1
        mode, grammar = ToolMode("required"), _arguments_grammar(schema)
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in functions:
            raise APIError(400, f"tool_choice names the function {name!r}, which is not among tools "
                                f"({', '.join(functions)})", "tool_choice")
        mode = ToolMode("named", function=name)
        grammar = _arguments_grammar(_parameters(functions[name]))
    else:
        raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or "
                            '{"type": "function", "function": {"name": ...}}', "tool_choice")
    if model.template_takes_tools:
        return mode, grammar, messages, tools
    # A template that ignores tools: describe them in a system message, in the parser's format.
    text = (parser or HermesToolParser()).describe_tools(tools)
    if mode.kind == "named":
        text += f"\n\nNow call {mode.function}: answer with its arguments as one JSON object."
    elif mode.kind == "required":
        text += '\n\nNow call tools: answer with a JSON list of {"name": ..., "parameters": {...}} objects.'
    if messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}
    else:
        messages.insert(0, {"role": "system", "content": text})
    return mode, grammar, messages, None


def _arguments_grammar(schema: dict) -> StructuredOutputsParams:
    # Arguments are read by programs: compact JSON, so no model can pad them with whitespace forever.
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True, source="tool_choice")


def _hoist_defs(schema: dict, prefix: str, defs: dict) -> dict:
    """`schema` with its $defs (or definitions) moved into `defs` under `prefix`, and its
    local $refs rewritten to them: nested in the call-list schema, "#/$defs/X" would
    otherwise point at that schema's root, where X is not."""
    local = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    if not local:
        return schema

    def rewrite(node):
        if isinstance(node, dict):
            out = {k: rewrite(v) for k, v in node.items() if k not in ("$defs", "definitions")}
            ref = node.get("$ref")
            if isinstance(ref, str):
                for head in ("#/$defs/", "#/definitions/"):
                    if ref.startswith(head):
                        out["$ref"] = "#/$defs/" + prefix + ref[len(head):]
            return out
        return [rewrite(v) for v in node] if isinstance(node, list) else node

    for name, sub in local.items():
        defs[prefix + name] = rewrite(sub)
    return rewrite(schema)


def _parameters(function) -> dict:
    return function.parameters if function.parameters is not None else {"type": "object"}


async def _collect(gen: Generation, body: ChatCompletionRequest, model: ServedModel, mode: ToolMode) -> dict[str, Any]:
    final: RequestOutput | None = None
    async for _, out in gen.outputs():
        final = out
    assert final is not None  # the engine always ends a stream with a finished output
    choices = []
    for comp in final.outputs:
        lp = _logprobs(comp.logprobs, body.top_logprobs or 0) if comp.logprobs is not None else None
        parse = ChoiceStream(mode, model.reasoning)
        msg = Message()
        msg.add(parse.feed(comp.text) + parse.finish())
        choices.append({"index": comp.index, "message": msg.to_openai(), "logprobs": lp,
                        "finish_reason": finish_reason(comp.finish_reason, bool(msg.tool_calls), mode),
                        "stop_reason": comp.stop_reason})
    completion_tokens = sum(len(c.token_ids) for c in final.outputs)
    return {"id": gen.request_id, "object": "chat.completion", "created": int(time.time()), "model": model.name,
            "choices": choices, "usage": usage(len(final.prompt_token_ids), completion_tokens)}


async def _stream(gen: Generation, body: ChatCompletionRequest, model: ServedModel,
                  mode: ToolMode) -> AsyncIterator[str]:
    created = int(time.time())
    tracker = DeltaTracker(gen.params)
    prompt_tokens, completion_tokens = 0, 0
    parsers = {k: ChoiceStream(mode, model.reasoning) for k in range(gen.params.n)}
    called: set[int] = set()

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
            parse = parsers[comp.index]
            pieces = parse.feed(text) + (parse.finish() if comp.finish_reason else [])
            called |= {comp.index for p in pieces if "tool_calls" in p}
            lp = _logprobs(lps, body.top_logprobs or 0) if lps else None
            # One chunk per piece; the logprobs ride on the first (or on an empty delta when no text showed).
            deltas = pieces or ([{}] if comp.finish_reason or lp else [])
            for i, delta in enumerate(deltas):
                last = i == len(deltas) - 1
                choice: dict[str, Any] = {"index": comp.index, "delta": delta, "logprobs": lp if i == 0 else None,
                                          "finish_reason": None}
                if last and comp.finish_reason:
                    choice["finish_reason"] = finish_reason(comp.finish_reason, comp.index in called, mode)
                    choice["stop_reason"] = comp.stop_reason
                yield chunk([choice])
            if comp.finish_reason:
                tracker.done.add(comp.index)
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
