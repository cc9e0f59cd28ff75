"""Tool-call parsers: golden outputs, the same result however the text is streamed, and
parsers from plugins."""

from __future__ import annotations

import json
import random
import re

import pytest

from infer.primitives import hookimpl
from infer.server.tool_parsers import HermesToolParser, Llama3JsonToolParser, ToolCall, ToolParser, tool_parser
from test_registry import FakeEntryPoint, fake_registry


def call(name: str, arguments: dict) -> tuple[str, str]:
    return name, json.dumps(arguments, ensure_ascii=False)


def tc(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


NESTED = {"query": 'a {b} "c" }{ [x] \\ ünïcödé 日本 😀', "filter": {"tags": ["x", {"y": [1, 2.5, None, True]}]}}
WEATHER = {"city": "Paris", "unit": "celsius"}

def plain(case_id: str, text: str) -> tuple:
    """A case whose whole output is content."""
    return case_id, text, text, []


# (id, output, content, calls)
HERMES = [
    plain("no_calls", "Hello, world! 1 < 2 and <b>bold</b>."),
    plain("whitespace_around_content", "  Hi  \n"),
    ("one_call", tc("get_weather", WEATHER), None, [call("get_weather", WEATHER)]),
    ("content_before_call", "Let me check.\n" + tc("get_weather", WEATHER), "Let me check.",
     [call("get_weather", WEATHER)]),
    ("several_calls", tc("a", {}) + "\n" + tc("b", {"n": 1}) + tc("c", {"s": "x"}), None,
     [call("a", {}), call("b", {"n": 1}), call("c", {"s": "x"})]),
    ("content_around_calls", "Hi\n" + tc("a", {}) + "\n" + tc("b", {}) + "\nbye", "Hi\nbye",
     [call("a", {}), call("b", {})]),
    ("nested_arguments", tc("search", NESTED), None, [call("search", NESTED)]),
    ("unescaped_unicode", '<tool_call>{"name": "say", "arguments": {"text": "日本 😀"}}</tool_call>', None,
     [call("say", {"text": "日本 😀"})]),
    ("close_tag_inside_string",
     '<tool_call>{"name": "echo", "arguments": {"text": "write </tool_call> and <tool_call> literally"}}</tool_call>',
     None, [call("echo", {"text": "write </tool_call> and <tool_call> literally"})]),
    ("escaped_quote_before_brace", '<tool_call>{"name": "f", "arguments": {"s": "a \\"} b"}}</tool_call>', None,
     [call("f", {"s": 'a "} b'})]),
    ("escaped_backslash_ends_string", tc("f", {"path": "C:\\dir\\", "s": "}"}), None,
     [call("f", {"path": "C:\\dir\\", "s": "}"})]),
    ("compact_no_newlines", 'x<tool_call>{"name":"f","arguments":{"a":[1,{"b":"}"}]}}</tool_call>y', "xy",
     [call("f", {"a": [1, {"b": "}"}]})]),
    ("unclosed_last_call", "ok " + tc("f", {"a": 1})[: -len("</tool_call>")], "ok", [call("f", {"a": 1})]),
    ("truncated_close_tag", tc("f", {})[:-3], None, [call("f", {})]),
    plain("malformed_json", '<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call> done'),
    plain("unbalanced_json", '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call> done'),
    plain("not_json", "<tool_call>get_weather(Paris)</tool_call>"),
    plain("name_not_a_string", '<tool_call>{"name": 3, "arguments": {}}</tool_call>'),
    plain("arguments_not_an_object", '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>'),
    plain("text_between_object_and_close_tag", '<tool_call>{"name": "f", "arguments": {}} oops</tool_call>'),
    ("malformed_then_valid", "<tool_call>nope</tool_call>\n" + tc("g", {}), "<tool_call>nope</tool_call>",
     [call("g", {})]),
    plain("tag_mentioned_in_prose", "Use the <tool_call> tag."),
    plain("tag_prefixes_in_prose", "a <tool b <tool_cal c </tool_call> d <tool_call"),
    ("empty", "", None, []),
]

LLAMA3 = [
    ("one_call", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None,
     [call("get_weather", WEATHER)]),
    ("python_tag_and_arguments_key", '<|python_tag|>{"name": "f", "arguments": {"x": 1}}', None,
     [call("f", {"x": 1})]),
    ("several_calls",
     '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"q": "x; y"}};{"name": "c", "parameters": {}}',
     None, [call("a", {}), call("b", {"q": "x; y"}), call("c", {})]),
    ("nested_arguments", json.dumps({"name": "search", "parameters": NESTED}, ensure_ascii=False), None,
     [call("search", NESTED)]),
    ("surrounding_whitespace", '\n <|python_tag|> {"name": "a", "parameters": {}}\n', None, [call("a", {})]),
    plain("plain_text", "The weather in Paris is nice."),
    plain("json_that_is_no_call", '{"answer": 42}'),
    plain("call_without_parameters", '{"name": "a"}'),
    plain("call_then_text", '{"name": "a", "parameters": {}} and more'),
    plain("valid_then_malformed", '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": }}'),
    plain("trailing_separator", '{"name": "a", "parameters": {}};'),
    plain("unclosed_object", '{"name": "a", "parameters": {'),
    plain("python_tag_then_code", "<|python_tag|>print(1)"),
    plain("tag_prefix_only", "<|python"),
    ("empty", "", None, []),
]

CASES = [(HermesToolParser, *c) for c in HERMES] + [(Llama3JsonToolParser, *c) for c in LLAMA3]
IDS = [f"{cls.name}-{c[0]}" for cls, *c in CASES]


def reassemble(pieces: list[dict]) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) from OpenAI delta pieces, checking each piece's shape."""
    content, calls = [], []
    for piece in pieces:
        assert len(piece) == 1, piece
        if "content" in piece:
            assert isinstance(piece["content"], str) and piece["content"], piece
            content.append(piece["content"])
            continue
        [delta] = piece["tool_calls"]
        if "id" in delta:
            assert delta["index"] == len(calls)
            assert delta["type"] == "function" and set(delta["function"]) == {"name", "arguments"}
            assert delta["function"]["arguments"] == ""
            calls.append([delta["function"]["name"], ""])
        else:
            assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}, delta
            calls[delta["index"]][1] += delta["function"]["arguments"]
    return "".join(content) or None, [tuple(c) for c in calls]


def streamed(parser: ToolParser, chunks: list[str]) -> list[dict]:
    s = parser.stream()
    return [piece for chunk in chunks for piece in s.feed(chunk)] + s.finish()


def random_chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("cls, _, text, content, calls", CASES, ids=IDS)
def test_extract_golden(cls, _, text, content, calls):
    got_content, got_calls = cls().extract(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls


@pytest.mark.parametrize("cls, _, text, content, calls", CASES, ids=IDS)
def test_stream_matches_extract_in_any_split(cls, _, text, content, calls):
    parser = cls()
    ext_content, ext_calls = parser.extract(text)
    expected = (ext_content, [(c.name, c.arguments) for c in ext_calls])
    rng = random.Random(f"{cls.name}:{text}")
    splits = [[text], list(text), *(random_chunks(text, rng) for _ in range(20))]
    for chunks in splits:
        assert reassemble(streamed(parser, chunks)) == expected, chunks


def test_stream_emits_empty_deltas_as_nothing():
    s = HermesToolParser().stream()
    assert s.feed("") == [] and s.feed("Hi") == [{"content": "Hi"}] and s.feed("") == [] and s.finish() == []


def test_arguments_keep_unicode_unescaped():
    _, [c] = HermesToolParser().extract(tc("say", {"text": "日本 😀"}))
    assert c.arguments == '{"text": "日本 😀"}'


def test_hermes_holds_back_a_possible_tag_and_releases_it_when_it_is_not_one():
    s = HermesToolParser().stream()
    assert s.feed("Hello <tool_c") == [{"content": "Hello"}]
    assert s.feed("ing") == [{"content": " <tool_cing"}]
    assert s.finish() == []


def test_hermes_sends_a_call_when_its_close_tag_arrives():
    s = HermesToolParser().stream()
    assert s.feed('Hi <tool_call>{"name": "f", "arguments": {"a": 1}}') == [{"content": "Hi"}]
    assert s.feed("</tool_ca") == []
    pieces = s.feed("ll>")
    assert reassemble(pieces) == (None, [("f", '{"a": 1}')])
    assert pieces[0]["tool_calls"][0]["id"] == s.calls[0].id


def test_hermes_releases_prose_after_a_tag_that_opens_no_json_object():
    s = HermesToolParser().stream()
    pieces = s.feed("Use <tool_call> tags, like")
    assert reassemble(pieces) == ("Use <tool_call> tags, like", [])


def test_hermes_too_deeply_nested_arguments_stay_content():
    text = '<tool_call>{"name": "f", "arguments": {"x": ' + "[" * 100_000 + "]" * 100_000 + "}}</tool_call>"
    assert HermesToolParser().extract(text) == (text, [])


def test_llama3_holds_calls_until_the_output_ends():
    s = Llama3JsonToolParser().stream()
    assert s.feed('{"name": "a", "parameters": {}}') == []
    assert reassemble(s.finish()) == (None, [("a", "{}")])


@pytest.mark.parametrize("held, deciding", [("", "Sure"), ('{"answer": 4', "2}"),
                                            ('{"name": "a", "parameters": {}} ', "x"), ("<|python_tag|>", "print(1)")])
def test_llama3_sends_content_as_soon_as_the_output_cannot_be_calls(held, deciding):
    s = Llama3JsonToolParser().stream()
    assert s.feed(held) == []
    assert reassemble(s.feed(deciding)) == (held + deciding, [])


def test_call_ids_are_unique_openai_style():
    _, calls = HermesToolParser().extract(tc("a", {}) + tc("a", {}))
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in calls)
    assert calls[0].id != calls[1].id


def test_tool_call_to_openai():
    assert ToolCall("call_1", "f", '{"a": 1}').to_openai() == {
        "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}


WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city, now",
                                           "parameters": WEATHER_SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("cls, markers", [(HermesToolParser, ["<tool_call>", "</tool_call>", '"arguments"']),
                                          (Llama3JsonToolParser, ['"parameters"', '";"'])])
def test_describe_tools_gives_every_tool_and_the_call_format(cls, markers):
    text = cls().describe_tools(TOOLS)
    for tool in TOOLS:
        assert json.dumps(tool["function"]) in text
    for marker in markers:
        assert marker in text


# -- registry -------------------------------------------------------------------------
class BracketToolParser(HermesToolParser):
    name = "test_brackets"
    open_tag, close_tag = "[TOOL_CALLS]", "[/TOOL_CALLS]"


class ParserPlugin:
    def __init__(self, parsers):
        self.parsers = parsers

    @hookimpl
    def infer_register_tool_parsers(self):
        return self.parsers


def test_builtin_tool_parsers_are_registered():
    assert tool_parser("hermes") is HermesToolParser
    assert tool_parser("llama3_json") is Llama3JsonToolParser


def test_unknown_tool_parser_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown tool parser 'nope' \(known: .*hermes.*llama3_json"):
        tool_parser("nope")


def test_plugin_tool_parser_is_registered_and_parses(monkeypatch):
    fake_registry(monkeypatch, FakeEntryPoint("brackets", ParserPlugin({"test_brackets": BracketToolParser})))
    parser = tool_parser("test_brackets")()
    content, [c] = parser.extract('Hi [TOOL_CALLS]{"name": "f", "arguments": {}}[/TOOL_CALLS]')
    assert (content, c.name, c.arguments) == ("Hi", "f", "{}")
    assert tool_parser("hermes") is HermesToolParser


def test_plugin_cannot_take_a_registered_name(monkeypatch):
    reg = fake_registry(monkeypatch, FakeEntryPoint("copycat", ParserPlugin({"hermes": BracketToolParser})))
    assert tool_parser("hermes") is HermesToolParser
    assert reg.broken["copycat"] == "tool parser name 'hermes' already registered by infer.server.tool_parsers"


def test_plugin_registering_a_non_class_is_reported(monkeypatch):
    reg = fake_registry(monkeypatch, FakeEntryPoint("instance", ParserPlugin({"test_obj": HermesToolParser()})))
    assert "not a class" in reg.broken["instance"]
    with pytest.raises(ValueError, match="unknown tool parser 'test_obj'"):
        tool_parser("test_obj")
