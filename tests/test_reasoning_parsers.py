"""Reasoning parsers: golden outputs, the same split however the text is streamed, where
reasoning ends, and parsers from plugins."""

from __future__ import annotations

import random

import pytest

from infer.primitives import hookimpl
from infer.server.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser, ReasoningParser, reasoning_parser
from test_registry import FakeEntryPoint, fake_registry

R1, QWEN3 = DeepSeekR1ReasoningParser, Qwen3ReasoningParser

# (parser, output, reasoning_content, content)
CASES = [
    (R1, "Let me think.</think>The answer is 4.", "Let me think.", "The answer is 4."),
    (R1, "<think>\nhmm\n</think>\n\nAnswer", "\nhmm\n", "\n\nAnswer"),
    (R1, "  <think>x</think>y", "x", "y"),
    (R1, "never closed, 1 < 2 </thin", "never closed, 1 < 2 </thin", None),
    (R1, "</think>Only content", None, "Only content"),
    (R1, "a < b </thin and </think> c </think> <think>", "a < b </thin and ", " c </think> <think>"),
    (R1, "\n<thinking>x</think>y", "\n<thinking>x", "y"),
    (R1, "<think>", None, None),
    (R1, "<thi", "<thi", None),
    (R1, "ünï 日本 😀</think>😀", "ünï 日本 😀", "😀"),
    (R1, "", None, None),
    (QWEN3, "<think>\nstep 1 {}\n</think>\n\nAnswer", "\nstep 1 {}\n", "\n\nAnswer"),
    (QWEN3, "Plain answer.", None, "Plain answer."),
    (QWEN3, "\n <think>x</think>y", "x", "y"),
    (QWEN3, "<think>truncated", "truncated", None),
    (QWEN3, "<think></think>Hi", None, "Hi"),
    (QWEN3, "Answer with <think> and </think> inside", None, "Answer with <think> and </think> inside"),
    (QWEN3, "<thinking is fun", None, "<thinking is fun"),
    (QWEN3, "<thi", None, "<thi"),
    (QWEN3, "  ", None, "  "),
    (QWEN3, "", None, None),
]
IDS = [f"{p.name}-{i}" for i, (p, *_) in enumerate(CASES)]


def reassemble(pieces: list[dict]) -> tuple[str | None, str | None]:
    """(reasoning_content, content) from delta pieces, checking their shape and order."""
    parts = {"reasoning_content": "", "content": ""}
    for piece in pieces:
        [(key, text)] = piece.items()
        assert isinstance(text, str) and text, piece
        assert key == "content" or not parts["content"], "reasoning after content"
        parts[key] += text
    return parts["reasoning_content"] or None, parts["content"] or None


def streamed(parser: ReasoningParser, chunks: list[str]) -> list[dict]:
    s = parser.stream()
    return [piece for chunk in chunks for piece in s.feed(chunk)] + s.finish()


def random_chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("cls, text, reasoning, content", CASES, ids=IDS)
def test_extract_golden(cls, text, reasoning, content):
    assert cls().extract(text) == (reasoning, content)


@pytest.mark.parametrize("cls, text, reasoning, content", CASES, ids=IDS)
def test_stream_matches_extract_in_any_split(cls, text, reasoning, content):
    parser = cls()
    expected = parser.extract(text)
    rng = random.Random(f"{cls.name}:{text}")
    for chunks in [[text], list(text), *(random_chunks(text, rng) for _ in range(20))]:
        assert reassemble(streamed(parser, chunks)) == expected, chunks


def test_stream_holds_back_only_what_may_be_a_marker():
    s = R1().stream()
    assert s.feed("abc</thi") == [{"reasoning_content": "abc"}]
    assert s.feed("s") == [{"reasoning_content": "</this"}]
    assert s.feed("</think>x") == [{"content": "x"}]
    q = QWEN3().stream()
    assert q.feed(" <thi") == []
    assert q.feed("nk>a") == [{"reasoning_content": "a"}]


def test_end_marker():
    assert R1.end_marker == QWEN3.end_marker == "</think>"


@pytest.mark.parametrize("cls, text, ended", [
    (R1, "", False), (R1, "abc", False), (R1, "<think>abc</thi", False), (R1, "abc</think>", True),
    (R1, "</think>x", True),
    (QWEN3, "", False), (QWEN3, "  <thi", False), (QWEN3, "<think>abc", False), (QWEN3, "<think>a</think>", True),
    (QWEN3, "Hello", True), (QWEN3, "<b>", True),
])
def test_reasoning_ended(cls, text, ended):
    assert cls().reasoning_ended(text) is ended


@pytest.mark.parametrize("cls, text", [(c[0], c[1]) for c in CASES], ids=IDS)
def test_after_reasoning_ended_everything_that_follows_is_content(cls, text):
    parser = cls()
    ended = [parser.reasoning_ended(text[:k]) for k in range(len(text) + 1)]
    assert ended == sorted(ended), "reasoning_ended turned back to False"
    for k in (k for k, e in enumerate(ended) if e):
        reasoning, content = parser.extract(text[:k])
        for suffix in ("x", "<think>", "</think>y"):
            assert parser.extract(text[:k] + suffix) == (reasoning, (content or "") + suffix)


# -- registry -------------------------------------------------------------------------
class BracketReasoningParser(ReasoningParser):
    name = "test_brackets"
    start_marker, end_marker = "[THINK]", "[/THINK]"


class ParserPlugin:
    @hookimpl
    def infer_register_reasoning_parsers(self):
        return {"test_brackets": BracketReasoningParser, "qwen3": BracketReasoningParser}


def test_builtin_reasoning_parsers_are_registered():
    assert reasoning_parser("deepseek_r1") is R1
    assert reasoning_parser("qwen3") is QWEN3


def test_unknown_reasoning_parser_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown reasoning parser 'nope' \(known: .*deepseek_r1.*qwen3"):
        reasoning_parser("nope")


def test_plugin_reasoning_parser_is_registered_and_parses(monkeypatch):
    reg = fake_registry(monkeypatch, FakeEntryPoint("brackets", ParserPlugin()))
    assert reasoning_parser("test_brackets")().extract("[THINK]a[/THINK]b") == ("a", "b")
    assert reasoning_parser("qwen3") is QWEN3  # an in-tree name is not taken over
    assert reg.broken["brackets"] == "reasoning parser name 'qwen3' already registered by infer.server.reasoning"
