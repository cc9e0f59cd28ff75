"""What a chat choice's text becomes in OpenAI's message shape: content, reasoning
content and tool calls, streamed piece by piece or whole.

A whole response is the stream's pieces put together (`Message`), so the two
never disagree. The request decides the mode (`ToolMode`): plain text, calls
parsed out of free text by the server's tool parser (``tool_choice: auto``),
the arguments of one named function (the grammar made the text exactly that
JSON), or a JSON list of calls (``required``, also grammar-made).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from .reasoning import ReasoningParser
from .tool_parsers import ToolParser


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolMode:
    """How a choice's answer turns into tool calls."""

    kind: str = "none"  # none | auto | named | required
    parser: ToolParser | None = None  # auto
    function: str | None = None  # named


def _call_pieces(index: int, name: str, arguments: str) -> list[dict]:
    head = {"index": index, "id": call_id(), "type": "function", "function": {"name": name, "arguments": ""}}
    pieces = [{"tool_calls": [head]}]
    if arguments:
        pieces.append({"tool_calls": [{"index": index, "function": {"arguments": arguments}}]})
    return pieces


class ChoiceStream:
    """One choice's text in, OpenAI delta pieces out: {"content"}, {"reasoning_content"},
    {"tool_calls": [...]}; `finish()` once the text is complete."""

    def __init__(self, mode: ToolMode, reasoning: ReasoningParser | None):
        self.mode = mode
        self.reasoning = reasoning.stream() if reasoning is not None else None
        self.tools = mode.parser.stream() if mode.kind == "auto" else None
        self.buffer = ""  # required: the JSON list, parsed at the end
        self.named_started = False

    def feed(self, delta: str) -> list[dict]:
        return self._answer(self.reasoning.feed(delta) if self.reasoning else [{"content": delta}] if delta else [],
                            final=False)

    def finish(self) -> list[dict]:
        return self._answer(self.reasoning.finish() if self.reasoning else [], final=True)

    def _answer(self, pieces: list[dict], final: bool) -> list[dict]:
        out = []
        for p in pieces:
            if "content" in p:
                out += self._content(p["content"])
            else:
                out.append(p)
        if final:
            out += self._end()
        return out

    def _content(self, text: str) -> list[dict]:
        kind = self.mode.kind
        if kind == "auto":
            return self.tools.feed(text)
        if kind == "named":
            if not text:
                return []
            if not self.named_started:  # the call starts with its first argument text
                self.named_started = True
                return _call_pieces(0, self.mode.function, text)
            return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]
        if kind == "required":
            self.buffer += text
            return []
        return [{"content": text}] if text else []

    def _end(self) -> list[dict]:
        kind = self.mode.kind
        if kind == "auto":
            return self.tools.finish()
        if kind == "required":
            try:
                calls = json.loads(self.buffer)
            except json.JSONDecodeError:  # cut short by max_tokens: not a call list
                return [{"content": self.buffer}] if self.buffer else []
            out = []
            for i, c in enumerate(calls):
                out += _call_pieces(i, c["name"], json.dumps(c["parameters"], ensure_ascii=False))
            return out
        return []


@dataclass
class Message:
    """The pieces of one choice put together."""

    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict] = field(default_factory=list)

    def add(self, pieces: list[dict]) -> None:
        for p in pieces:
            if "content" in p:
                self.content = (self.content or "") + p["content"]
            if "reasoning_content" in p:
                self.reasoning_content = (self.reasoning_content or "") + p["reasoning_content"]
            for d in p.get("tool_calls", ()):
                if "id" in d:
                    self.tool_calls.append({"id": d["id"], "type": "function",
                                            "function": {"name": d["function"]["name"], "arguments": ""}})
                self.tool_calls[d["index"]]["function"]["arguments"] += d["function"].get("arguments", "")

    def to_openai(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        elif msg["content"] is None:
            msg["content"] = ""
        return msg


def finish_reason(reason: str | None, has_calls: bool, mode: ToolMode) -> str | None:
    """OpenAI's 'tool_calls' when a choice that ended normally called tools the model chose
    (auto, required); a forced named function ends with 'stop', as OpenAI and vLLM do."""
    return "tool_calls" if has_calls and reason == "stop" and mode.kind != "named" else reason

