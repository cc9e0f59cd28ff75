"""Tool-call parsers: read OpenAI `tool_calls` out of a model's text, whole or streamed.

Pure text in, text out; no tokenizer, no engine. `extract` is the streaming parser fed the
whole text at once, so a response reads the same whether it was streamed or not.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from ..primitives.hookspecs import hookimpl
from ..registry import get_tool_parser
from .reasoning import partial_tag


@dataclass
class ToolCall:
    id: str  # "call_<24 hex>"
    name: str
    arguments: str  # a JSON text

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolParser:
    """A tool-call format. Subclasses set `name` and `call_format` and implement `stream()`."""

    name = ""
    call_format = ""  # how to call a tool, for `describe_tools`

    def describe_tools(self, tools: list[dict]) -> str:
        """System-message text for a model whose chat template ignores `tools` (OpenAI's
        [{"type": "function", "function": {...}}]): the tools, and how to call them."""
        specs = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
        return f"You can call these tools, given as JSON schemas:\n{specs}\n\n{self.call_format}"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content outside the calls or None, the calls) of a whole output."""
        s = self.stream()
        pieces = s.feed(text) + s.finish()
        return "".join(p["content"] for p in pieces if "content" in p) or None, s.calls

    def stream(self) -> ToolCallStream:
        """A fresh state for one streamed output."""
        raise NotImplementedError


class ToolCallStream:
    """One output's parse. `feed(delta)` and then `finish()` return OpenAI chat delta pieces:
    {"content": str}, a call's first piece {"tool_calls": [{"index", "id", "type", "function":
    {"name", "arguments": ""}}]}, then {"tool_calls": [{"index", "function": {"arguments"}}]}.

    A call is sent only once it is complete and valid: one found malformed stays content, and
    what was sent cannot be taken back. Whitespace around calls is content only between
    content: "Hi\n<call>\n<call>\nbye" has the content "Hi\nbye".
    Subclasses implement `_advance` over `_buf` with `_content` and `_call`.
    """

    def __init__(self):
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._ws = ""  # whitespace held until we know whether content follows it
        self._has_content = False
        self._after_call = False  # no content since the last call

    def feed(self, delta: str) -> list[dict]:
        self._buf += delta
        return self._advance(final=False)

    def finish(self) -> list[dict]:
        out = self._advance(final=True)
        if self._ws and not self._after_call:
            out.append({"content": self._ws})
        return out

    def _advance(self, final: bool) -> list[dict]:
        """Pieces for what `_buf` settles; `final`: no more text comes."""
        raise NotImplementedError

    def _content(self, text: str) -> list[dict]:
        """Pieces for `text` outside any call."""
        if self._after_call:
            text = text.lstrip()  # the whitespace held before the call stands for it
            self._after_call = not text
        body = text.rstrip()
        if not body:
            self._ws += text
            return []
        piece, self._ws, self._has_content = self._ws + body, text[len(body):], True
        return [{"content": piece}]

    def _call(self, name: str, arguments: str) -> list[dict]:
        """Pieces for a valid call."""
        call = ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, arguments)
        index = len(self.calls)
        self.calls.append(call)
        self._ws = self._ws if self._has_content else ""
        self._after_call = True
        return [{"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                 "function": {"name": name, "arguments": ""}}]},
                {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}]


class _ObjectEnd:
    """Finds where a JSON object starting at `start` of a growing text ends, resuming where it
    stopped. It tracks strings and nesting only: that places the end of any valid object, and
    what it places in invalid text, json.loads rejects."""

    def __init__(self, start: int):
        self._i, self._depth, self._in_string, self._escaped = start, 0, False, False
        self._end: int | None = None

    def scan(self, text: str) -> int | None:
        """The index after the object's closing brace, or None while it is open."""
        if self._end is not None:
            return self._end
        for i in range(self._i, len(text)):
            c = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._end = i + 1
                    return self._end
        self._i = len(text)
        return None


def _function(text: str, argument_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a call object's text, or None if it is not a call:
    a JSON object with a non-empty string "name" and an object under one of `argument_keys`."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = next((obj[k] for k in argument_keys if k in obj), None)
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


class HermesToolParser(ToolParser):
    """Calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, anywhere in the
    output; the rest is content. A last call may lack (the end of) its closing tag, as when
    generation stopped there."""

    name = "hermes"
    open_tag, close_tag = "<tool_call>", "</tool_call>"
    call_format = ("To call a tool, write one block per call, each holding a JSON object with the "
                   "tool's name and an object of its arguments:\n<tool_call>\n"
                   '{"name": "<tool name>", "arguments": {"<argument>": <value>}}\n</tool_call>\n'
                   "If no tool is needed, answer directly.")

    def stream(self) -> ToolCallStream:
        return _HermesStream(self.open_tag, self.close_tag)


class _HermesStream(ToolCallStream):
    def __init__(self, open_tag: str, close_tag: str):
        super().__init__()
        self._open, self._close = open_tag, close_tag
        self._object: _ObjectEnd | None = None
        self._in_call = False  # `_buf` starts right after an open tag

    def _advance(self, final: bool) -> list[dict]:
        out = []
        while True:
            if not self._in_call:
                start = self._buf.find(self._open)
                if start < 0:
                    end = len(self._buf) - (0 if final else partial_tag(self._buf, self._open))
                    out += self._content(self._buf[:end])
                    self._buf = self._buf[end:]
                    return out
                out += self._content(self._buf[:start])
                self._buf, self._in_call, self._object = self._buf[start + len(self._open):], True, None
            verdict = self._verdict(final)
            if verdict is None:
                return out
            self._in_call = False
            if verdict is False:  # the open tag is text; what follows it is read again
                out += self._content(self._open)
            else:
                out += self._call(*verdict[0])
                self._buf = verdict[1]

    def _verdict(self, final: bool) -> tuple[tuple[str, str], str] | bool | None:
        """For `_buf` after an open tag: ((name, arguments), text after the call), False if
        it is no call, None while undecided."""
        start = len(self._buf) - len(self._buf.lstrip())
        if start == len(self._buf):
            return False if final else None
        if self._buf[start] != "{":
            return False
        self._object = self._object or _ObjectEnd(start)
        end = self._object.scan(self._buf)
        if end is None:
            return False if final else None
        function = _function(self._buf[start:end], ("arguments",))
        if function is None:
            return False
        tail = self._buf[end:].lstrip()
        if tail.startswith(self._close):
            return function, tail[len(self._close):]
        if self._close.startswith(tail):
            return (function, "") if final else None
        return False


class Llama3JsonToolParser(ToolParser):
    """The whole output is calls: `{"name": ..., "parameters": {...}}` ("arguments" also
    read), several separated by `;`, optionally after `<|python_tag|>`. Any other output is
    content, all of it, so calls are sent when the output ends."""

    name = "llama3_json"
    python_tag = "<|python_tag|>"
    call_format = ("To call a tool, reply with only a JSON object of the form "
                   '{"name": "<tool name>", "parameters": {"<argument>": <value>}}; separate several '
                   'calls with ";" and write nothing else. If no tool is needed, answer in plain text.')

    def stream(self) -> ToolCallStream:
        return _Llama3JsonStream(self.python_tag)


class _Llama3JsonStream(ToolCallStream):
    def __init__(self, python_tag: str):
        super().__init__()
        self._tag = python_tag
        self._pos = 0  # how far `_buf` is read
        self._expect = "tag"  # tag -> object -> inside -> separator -> object ...
        self._object: _ObjectEnd | None = None
        self._functions: list[tuple[str, str]] = []
        self._is_content = False

    def _advance(self, final: bool) -> list[dict]:
        if not self._is_content:
            verdict = self._read()
            if verdict is not False and not final:
                return []
            if verdict is True:
                return [piece for function in self._functions for piece in self._call(*function)]
            self._is_content = True
        out = self._content(self._buf)
        self._buf = ""
        return out

    def _read(self) -> bool | None:
        """True if `_buf` is calls so far, each complete; None while the last may be one;
        False once it is not all calls."""
        while True:
            rest = self._buf[self._pos:]
            head = rest.lstrip()
            self._pos += len(rest) - len(head)
            if not head:
                return self._expect == "separator" or None
            if self._expect == "tag":
                if head.startswith(self._tag):
                    self._pos += len(self._tag)
                    self._expect = "object"
                    continue
                if self._tag.startswith(head):
                    return None
                self._expect = "object"
            if self._expect == "object":
                if head[0] != "{":
                    return False
                self._object, self._expect = _ObjectEnd(self._pos), "inside"
            if self._expect == "inside":
                end = self._object.scan(self._buf)
                if end is None:
                    return None
                function = _function(self._buf[self._pos:end], ("parameters", "arguments"))
                if function is None:
                    return False
                self._functions.append(function)
                self._pos, self._expect = end, "separator"
            elif head[0] == ";":
                self._pos += 1
                self._expect = "object"
            else:
                return False


@hookimpl
def infer_register_tool_parsers() -> dict[str, type]:
    return {cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser)}


def tool_parser(name: str) -> type[ToolParser]:
    """The tool parser class registered as `name`, in-tree or by a plugin."""
    return get_tool_parser(name)
