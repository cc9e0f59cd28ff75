"""Reasoning parsers: split a reasoning model's output into `reasoning_content` and `content`.

Pure text in, text out; no tokenizer, no engine. `extract` is the streaming parser fed the
whole text at once, so a response reads the same whether it was streamed or not.
"""

from __future__ import annotations

from ..primitives.hookspecs import hookimpl
from ..registry import get_reasoning_parser


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag`: text that may
    still become the tag, so a stream must hold it back."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningParser:
    """Reasoning between `start_marker` and `end_marker`, at the start of the output.

    Leading whitespace before `start_marker` is dropped with it. An output that starts with
    something else is reasoning when `implicit_start` (the chat template opened the block),
    content otherwise. A block never closed is all reasoning: streamed reasoning cannot be
    taken back, so a truncated one stays reasoning. Text after `end_marker` is content,
    verbatim. Subclasses for other formats override `stream()`.
    """

    name = ""
    start_marker = "<think>"
    end_marker = "</think>"
    implicit_start = False

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output; None for an empty part."""
        s = self.stream()
        pieces = s.feed(text) + s.finish()
        parts = ("".join(p.get(key, "") for p in pieces) for key in ("reasoning_content", "content"))
        reasoning, content = (part or None for part in parts)
        return reasoning, content

    def stream(self) -> ReasoningStream:
        """A fresh state for one streamed output."""
        return ReasoningStream(self)

    def reasoning_ended(self, text: str) -> bool:
        """Whether the output so far settles that all that follows is content (structured
        outputs start constraining there). Agrees with `stream()` fed the same text."""
        if self.end_marker in text:
            return True
        head = text.lstrip()
        opening = head.startswith(self.start_marker) or self.start_marker.startswith(head)
        return not self.implicit_start and not opening


class ReasoningStream:
    """`feed(delta)` and then `finish()` return OpenAI delta pieces, {"reasoning_content": str}
    or {"content": str}, never empty; a possible marker prefix is held back until resolved."""

    def __init__(self, parser: ReasoningParser):
        self._p = parser
        self._buf = ""
        self._state = "start"  # start -> reasoning -> content, or start -> content

    def feed(self, delta: str) -> list[dict]:
        self._buf += delta
        return self._advance(final=False)

    def finish(self) -> list[dict]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> list[dict]:
        p, out = self._p, []
        if self._state == "start":
            head = self._buf.lstrip()
            if head.startswith(p.start_marker):
                self._buf, self._state = head[len(p.start_marker):], "reasoning"
            elif p.start_marker.startswith(head) and not final:
                return out
            else:
                self._state = "reasoning" if p.implicit_start else "content"
        if self._state == "reasoning":
            end = self._buf.find(p.end_marker)
            if end < 0:
                end = len(self._buf) - (0 if final else partial_tag(self._buf, p.end_marker))
                rest = self._buf[end:]
            else:
                rest, self._state = self._buf[end + len(p.end_marker):], "content"
            if end:
                out.append({"reasoning_content": self._buf[:end]})
            self._buf = rest
        if self._state == "content" and self._buf:
            out.append({"content": self._buf})
            self._buf = ""
        return out


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: the template opens `<think>`, so the output starts inside the reasoning
    (R1-0528 repeats `<think>`, which is dropped); without `</think>` it is all reasoning."""

    name = "deepseek_r1"
    implicit_start = True


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: reasoning only in a `<think>...</think>` block the output starts with."""

    name = "qwen3"


@hookimpl
def infer_register_reasoning_parsers() -> dict[str, type]:
    return {cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def reasoning_parser(name: str) -> type[ReasoningParser]:
    """The reasoning parser class registered as `name`, in-tree or by a plugin."""
    return get_reasoning_parser(name)
