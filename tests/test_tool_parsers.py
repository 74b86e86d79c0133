"""Tool-call parsers: realistic outputs per format, malformed calls kept as text, and streaming that
reassembles to exactly what parse() returns however the text is chunked."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.errors import ConfigError
from tokenloom.serve.tool_parsers import (
    TOOL_PARSERS, ParsedMessage, ToolParser, detect_tool_parser, get_tool_parser, new_call_id,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'

HERMES = {
    "single": f"<tool_call>\n{WEATHER}\n</tool_call>",
    "parallel": f'<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n'
                '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
    "text_before": f"Let me check the weather for you.\n\n<tool_call>\n{WEATHER}\n</tool_call>",
    "nested_unicode": '<tool_call>\n{"name": "search", "parameters": {"q": "caf\\u00e9 \\"Zoë\\" 東京\\n", '
                      '"filters": {"tags": ["a", {"b": null}], "limit": 5, "ok": true}}}\n</tool_call>',
    "no_args": '<tool_call>{"name": "list_files"}</tool_call>',
    "plain": "The capital of France is Paris. Use <b>bold</b> and < signs freely.",
    "bad_json": '<tool_call>\n{"name": "f", "arguments": {"x": 1,}}\n</tool_call>',
    "missing_name": '<tool_call>\n{"arguments": {"x": 1}}\n</tool_call>',
    "args_not_object": '<tool_call>\n{"name": "f", "arguments": "x=1"}\n</tool_call>',
    "unterminated": f"Sure.\n<tool_call>\n{WEATHER}",
    "good_then_bad": f"<tool_call>{WEATHER}</tool_call>\n<tool_call>{{oops</tool_call> done",
    "partial_tag_at_end": "Compare a <tool",
}

LLAMA3 = {
    "single": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "python_tag": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "whitespace": '\n\n  {"name": "get_weather", "arguments": {"city": "Paris"}}\n',
    "parallel": '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"s": "semi;colon"}}',
    "nested_unicode": '{"name": "s", "parameters": {"q": "naïve \\"quoted\\" 🙂", "o": {"k": [1, 2.5]}}}',
    "plain": "Paris is the capital of France.",
    "plain_brace_later": "Here is JSON: {\"a\": 1}",
    "bad_json": '{"name": "f", "parameters": {"x": }',
    "missing_name": '{"parameters": {"x": 1}}',
    "args_not_object": '{"name": "f", "parameters": [1, 2]}',
    "trailing_text": '{"name": "f", "parameters": {}} and that is all',
    "partial_python_tag": "<|python",
}

MISTRAL = {
    "array": f"[TOOL_CALLS][{WEATHER}]",
    "array_parallel": '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]',
    "text_before": f"I will look it up.[TOOL_CALLS][{WEATHER}]",
    "named": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}',
    "named_parallel": '[TOOL_CALLS]a[ARGS]{"x": {"y": "é\\n"}}[TOOL_CALLS]b[ARGS]{}',
    "plain": "No tools needed: the answer is 42.",
    "bad_json": '[TOOL_CALLS][{"name": "f", "arguments": {]',
    "missing_name": '[TOOL_CALLS][{"arguments": {"x": 1}}]',
    "args_not_object": '[TOOL_CALLS][{"name": "f", "arguments": 3}]',
    "named_no_args_tag": "[TOOL_CALLS]get_weather",
    "named_good_then_bad": '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{bad',
    "partial_marker_at_end": "Almost [TOOL_CA",
}

SAMPLES = [(parser, text) for parser, cases in (("hermes", HERMES), ("llama3_json", LLAMA3), ("mistral", MISTRAL))
           for text in cases.values()]


def calls(msg: ParsedMessage) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in msg.tool_calls]


# --- hermes ---------------------------------------------------------------------------------------

def test_hermes_single_and_parallel() -> None:
    p = get_tool_parser("hermes")
    single = p.parse(HERMES["single"])
    assert single.content is None
    assert calls(single) == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert single.tool_calls[0].arguments == '{"city":"Paris","unit":"celsius"}'  # compact JSON text
    assert re.fullmatch(r"call_[0-9a-f]{24}", single.tool_calls[0].id)
    par = p.parse(HERMES["parallel"])
    assert par.content is None  # only the newline between the calls
    assert [c.name for c in par.tool_calls] == ["get_weather", "get_time"]
    assert len({c.id for c in par.tool_calls}) == 2


def test_hermes_text_before_nested_unicode_and_no_args() -> None:
    p = get_tool_parser("hermes")
    msg = p.parse(HERMES["text_before"])
    assert msg.content == "Let me check the weather for you.\n\n"
    assert calls(msg) == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    (call,) = p.parse(HERMES["nested_unicode"]).tool_calls  # "parameters" is an alias of "arguments"
    assert json.loads(call.arguments) == {"q": 'café "Zoë" 東京\n',
                                          "filters": {"tags": ["a", {"b": None}], "limit": 5, "ok": True}}
    assert "東京" in call.arguments  # unicode kept readable, not \\u-escaped
    assert calls(p.parse(HERMES["no_args"])) == [("list_files", {})]
    assert p.parse(HERMES["plain"]) == ParsedMessage(HERMES["plain"], [])


@pytest.mark.parametrize("case", ["bad_json", "missing_name", "args_not_object", "unterminated",
                                  "partial_tag_at_end"])
def test_hermes_malformed_is_content(case: str) -> None:
    msg = get_tool_parser("hermes").parse(HERMES[case])
    assert msg == ParsedMessage(HERMES[case], [])


def test_hermes_keeps_good_calls_next_to_bad_ones() -> None:
    msg = get_tool_parser("hermes").parse(HERMES["good_then_bad"])
    assert calls(msg) == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert msg.content == "\n<tool_call>{oops</tool_call> done"


def test_hermes_absurd_nesting_does_not_raise() -> None:
    text = "<tool_call>" + "[" * 100_000 + "</tool_call>"
    assert get_tool_parser("hermes").parse(text) == ParsedMessage(text, [])


# --- llama3_json ----------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["single", "python_tag", "whitespace"])
def test_llama3_single(case: str) -> None:
    msg = get_tool_parser("llama3_json").parse(LLAMA3[case])
    assert msg.content is None
    assert calls(msg) == [("get_weather", {"city": "Paris"})]


def test_llama3_parallel_nested_and_trailing_text() -> None:
    p = get_tool_parser("llama3_json")
    assert calls(p.parse(LLAMA3["parallel"])) == [("a", {"x": 1}), ("b", {"s": "semi;colon"})]
    assert calls(p.parse(LLAMA3["nested_unicode"])) == [("s", {"q": 'naïve "quoted" 🙂', "o": {"k": [1, 2.5]}})]
    msg = p.parse(LLAMA3["trailing_text"])
    assert calls(msg) == [("f", {})] and msg.content == " and that is all"


@pytest.mark.parametrize("case", ["plain", "plain_brace_later", "bad_json", "missing_name", "args_not_object",
                                  "partial_python_tag"])
def test_llama3_not_a_call_is_content(case: str) -> None:
    assert get_tool_parser("llama3_json").parse(LLAMA3[case]) == ParsedMessage(LLAMA3[case], [])


# --- mistral --------------------------------------------------------------------------------------

def test_mistral_array_and_named_formats() -> None:
    p = get_tool_parser("mistral")
    msg = p.parse(MISTRAL["array"])
    assert msg.content is None and calls(msg) == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert re.fullmatch(r"[A-Za-z0-9]{9}", msg.tool_calls[0].id)  # Mistral's own id format
    assert calls(p.parse(MISTRAL["array_parallel"])) == [("a", {"x": 1}), ("b", {})]
    before = p.parse(MISTRAL["text_before"])
    assert before.content == "I will look it up." and len(before.tool_calls) == 1
    assert calls(p.parse(MISTRAL["named"])) == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert calls(p.parse(MISTRAL["named_parallel"])) == [("a", {"x": {"y": "é\n"}}), ("b", {})]


@pytest.mark.parametrize("case", ["plain", "bad_json", "missing_name", "args_not_object", "named_no_args_tag",
                                  "partial_marker_at_end"])
def test_mistral_malformed_is_content(case: str) -> None:
    assert get_tool_parser("mistral").parse(MISTRAL[case]) == ParsedMessage(MISTRAL[case], [])


def test_mistral_named_keeps_good_call_next_to_bad_one() -> None:
    msg = get_tool_parser("mistral").parse(MISTRAL["named_good_then_bad"])
    assert calls(msg) == [("a", {"x": 1})] and msg.content == "[TOOL_CALLS]b[ARGS]{bad"


# --- streaming ------------------------------------------------------------------------------------

def run_stream(parser: ToolParser, chunks: list[str]) -> tuple[str, list[tuple[str | None, str | None, str]]]:
    """Reassemble a stream: (all content, per call index (id, name, joined arguments))."""
    stream = parser.stream()
    deltas = [stream.feed(c) for c in chunks] + [stream.finish()]
    content = "".join(d.content for d in deltas)
    by_index: dict[int, list] = {}
    for d in deltas:
        for tc in d.tool_calls:
            if tc.index not in by_index:
                assert tc.id is not None and tc.name is not None  # the first delta of a call names it
                by_index[tc.index] = [tc.id, tc.name, ""]
            else:
                assert tc.id is None and tc.name is None
            by_index[tc.index][2] += tc.arguments
    assert sorted(by_index) == list(range(len(by_index)))
    return content, [tuple(by_index[i]) for i in sorted(by_index)]


def assert_stream_matches(parser_name: str, text: str, chunks: list[str]) -> None:
    assert "".join(chunks) == text
    parser = get_tool_parser(parser_name)
    expected = parser.parse(text)
    content, streamed = run_stream(parser, chunks)
    assert content == (expected.content or "")
    assert [(name, args) for _, name, args in streamed] == [(c.name, c.arguments) for c in expected.tool_calls]


@pytest.mark.parametrize("parser_name,text", SAMPLES)
@pytest.mark.parametrize("size", range(1, 8))
def test_stream_fixed_chunks_match_parse(parser_name: str, text: str, size: int) -> None:
    assert_stream_matches(parser_name, text, [text[i:i + size] for i in range(0, len(text), size)])


@settings(max_examples=300, deadline=None)
@given(sample=st.sampled_from(SAMPLES), data=st.data())
def test_stream_random_splits_match_parse(sample: tuple[str, str], data: st.DataObject) -> None:
    parser_name, text = sample
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    assert_stream_matches(parser_name, text, [text[a:b] for a, b in zip(bounds, bounds[1:])])


def test_stream_sends_text_before_the_call_arrives() -> None:
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("Checking <tool").content == "Checking "  # "<tool" may open a call: held
    assert stream.feed("box> now").content == "<toolbox> now"
    d = stream.feed(f"<tool_call>{WEATHER}")
    assert d.content == "" and d.tool_calls == []  # the call is held until it closes
    d = stream.feed("</tool_call>")
    assert [(t.index, t.name) for t in d.tool_calls] == [(0, "get_weather")] and d.tool_calls[0].id


# --- selection ------------------------------------------------------------------------------------

@pytest.mark.parametrize("template,expected", [
    ("{% for tool in tools %}...<tool_call>\n{{ tool_call | tojson }}\n</tool_call>{% endfor %}", "hermes"),
    ("{{ '[AVAILABLE_TOOLS]' }}...{{ '[TOOL_CALLS]' }}{{ tool_calls | tojson }}", "mistral"),
    ("{%- if builtin_tools %}<|python_tag|>{{ call }}{% endif %}", "llama3_json"),
    ("<|start_header_id|>ipython<|end_header_id|> {\"name\": ..., \"parameters\": ...}", "llama3_json"),
    ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}", None),
    (None, None),
])
def test_detect_tool_parser(template: str | None, expected: str | None) -> None:
    assert detect_tool_parser(template) == expected


def test_registry_and_unknown_name() -> None:
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral"}
    for name in TOOL_PARSERS:
        assert get_tool_parser(name).name == name
    with pytest.raises(ConfigError, match="hermes"):
        get_tool_parser("nope")
    assert re.fullmatch(r"call_[0-9a-f]{24}", new_call_id())


FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool", "</tool_", WEATHER, '{"name": "f"}', "{", "}", "[", "]", ";",
             "[TOOL_CALLS]", "[TOOL_", "[ARGS]", "<|python_tag|>", "<|py", "g", " ", "\n"]


@settings(max_examples=300, deadline=None)
@given(parser_name=st.sampled_from(sorted(TOOL_PARSERS)), parts=st.lists(st.sampled_from(FRAGMENTS), max_size=10),
       data=st.data())
def test_stream_matches_parse_on_marker_soup(parser_name: str, parts: list[str], data: st.DataObject) -> None:
    text = "".join(parts)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=10)))
    bounds = [0, *cuts, len(text)]
    assert_stream_matches(parser_name, text, [text[a:b] for a, b in zip(bounds, bounds[1:])])
