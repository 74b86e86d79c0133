"""Reasoning parsers: <think> splitting on whole texts, and streams that reassemble to split() however
the text is chunked (tags cut across chunks included)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.errors import ConfigError
from tokenloom.serve.reasoning import REASONING_PARSERS, ReasoningParser, ReasoningSplit, get_reasoning_parser

# (text, split with starts_in_reasoning=False, split with starts_in_reasoning=True)
CASES = [
    ("<think>\nThe user greets me.\n</think>\n\nHello!",
     ReasoningSplit("\nThe user greets me.\n", "Hello!"), ReasoningSplit("\nThe user greets me.\n", "Hello!")),
    ("\n<think>2+2=4</think>The answer is 4.",
     ReasoningSplit("2+2=4", "The answer is 4."), ReasoningSplit("2+2=4", "The answer is 4.")),
    ("Okay, so 2+2... it is 4.\n</think>\n\n**4**",
     ReasoningSplit(None, "Okay, so 2+2... it is 4.\n</think>\n\n**4**"),
     ReasoningSplit("Okay, so 2+2... it is 4.\n", "**4**")),
    ("<think>\nLet me think about this carefully, step by",  # cut by max_tokens: all reasoning
     ReasoningSplit("\nLet me think about this carefully, step by", ""),
     ReasoningSplit("\nLet me think about this carefully, step by", "")),
    ("<think>\n\n</think>\n\nNo thinking needed.",  # Qwen3's empty block: no reasoning
     ReasoningSplit(None, "No thinking needed."), ReasoningSplit(None, "No thinking needed.")),
    ("Just an answer, no tags.",
     ReasoningSplit(None, "Just an answer, no tags."), ReasoningSplit("Just an answer, no tags.", "")),
    ("<think>a < b and </thin is not a tag</think>x </think> y\n",  # only the first </think> ends it
     ReasoningSplit("a < b and </thin is not a tag", "x </think> y\n"),
     ReasoningSplit("a < b and </thin is not a tag", "x </think> y\n")),
    ("<thinking>is not the tag</thinking>",
     ReasoningSplit(None, "<thinking>is not the tag</thinking>"),  # "</thinking>" holds no "</think>"
     ReasoningSplit("<thinking>is not the tag</thinking>", "")),
    ("<think>思考：東京 🙂</think>\n答え",
     ReasoningSplit("思考：東京 🙂", "答え"), ReasoningSplit("思考：東京 🙂", "答え")),
    ("", ReasoningSplit(None, ""), ReasoningSplit(None, "")),
    ("  \n", ReasoningSplit(None, "  \n"), ReasoningSplit(None, "")),
    ("<thi", ReasoningSplit(None, "<thi"), ReasoningSplit("<thi", "")),
]
SAMPLES = [(text, starts_in) for text, _, _ in CASES for starts_in in (False, True)]


@pytest.mark.parametrize("text,plain,started", CASES)
def test_split(text: str, plain: ReasoningSplit, started: ReasoningSplit) -> None:
    assert ReasoningParser(starts_in_reasoning=False).split(text) == plain
    assert ReasoningParser(starts_in_reasoning=True).split(text) == started


def test_registry_defaults() -> None:
    assert get_reasoning_parser("deepseek_r1").starts_in_reasoning is True
    assert get_reasoning_parser("qwen3").starts_in_reasoning is False
    assert get_reasoning_parser("qwen3", starts_in_reasoning=True).starts_in_reasoning is True
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    assert get_reasoning_parser("qwen3").split("<think>x</think>y") == ReasoningSplit("x", "y")
    with pytest.raises(ConfigError, match="deepseek_r1"):
        get_reasoning_parser("nope")


def run_stream(parser: ReasoningParser, chunks: list[str]) -> tuple[str, str]:
    stream = parser.stream()
    deltas = [stream.feed(c) for c in chunks] + [stream.finish()]
    return "".join(r for r, _ in deltas), "".join(c for _, c in deltas)


def assert_stream_matches(text: str, starts_in: bool, chunks: list[str]) -> None:
    assert "".join(chunks) == text
    parser = ReasoningParser(starts_in_reasoning=starts_in)
    expected = parser.split(text)
    assert run_stream(parser, chunks) == (expected.reasoning or "", expected.content)


@pytest.mark.parametrize("text,starts_in", SAMPLES)
@pytest.mark.parametrize("size", range(1, 8))
def test_stream_fixed_chunks_match_split(text: str, starts_in: bool, size: int) -> None:
    assert_stream_matches(text, starts_in, [text[i:i + size] for i in range(0, len(text), size)])


@settings(max_examples=300, deadline=None)
@given(sample=st.sampled_from(SAMPLES), data=st.data())
def test_stream_random_splits_match_split(sample: tuple[str, bool], data: st.DataObject) -> None:
    text, starts_in = sample
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    assert_stream_matches(text, starts_in, [text[a:b] for a, b in zip(bounds, bounds[1:])])


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("<>/thinko \n"))), starts_in=st.booleans(), data=st.data())
def test_stream_matches_split_on_tag_soup(text: str, starts_in: bool, data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    assert_stream_matches(text, starts_in, [text[a:b] for a, b in zip(bounds, bounds[1:])])


def test_stream_holds_split_tags_and_tracks_in_reasoning() -> None:
    stream = get_reasoning_parser("qwen3").stream()
    assert stream.in_reasoning is False  # nothing yet: qwen3 does not assume thinking
    assert stream.feed("<th") == ("", "") and stream.in_reasoning  # may still become <think>
    assert stream.feed("ink>plan") == ("plan", "") and stream.in_reasoning
    assert stream.feed(" more</thi") == (" more", "")  # "</thi" held: it may close the thinking
    assert stream.feed("nk>\n") == ("", "") and stream.in_reasoning is False
    assert stream.feed("\nAnswer") == ("", "Answer")
    assert stream.finish() == ("", "")


def test_stream_starts_in_reasoning() -> None:
    stream = get_reasoning_parser("deepseek_r1").stream()
    assert stream.in_reasoning
    assert stream.feed("Hmm, ") == ("Hmm, ", "") and stream.in_reasoning
    assert stream.feed("done.</think>\n\n") == ("done.", "") and stream.in_reasoning is False
    assert stream.feed("42") == ("", "42")
    cut = get_reasoning_parser("deepseek_r1").stream()
    assert cut.feed("still thinking <") == ("still thinking ", "")
    assert cut.finish() == ("<", "")  # cut mid-thought: the held tail is reasoning after all
