"""Reasoning parsers: split a model's thinking from its answer, whole or as it streams.

The ``<think>...</think>`` convention (DeepSeek-R1 distills, Qwen3, QwQ). Some chat templates put
``<think>`` into the prompt, so the output starts inside the reasoning and only ``</think>`` shows
(``starts_in_reasoning``). A generation cut before ``</think>`` is all reasoning. Thinking that is
only whitespace (Qwen3's empty ``<think>\\n\\n</think>`` when it skips thinking) counts as none.
Streaming holds back a tail that could still grow into a tag, so a tag split across chunks is never
sent as text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tokenloom.errors import ConfigError


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None  # None when there was no thinking (or only whitespace)
    content: str


def _held_suffix(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningParser:
    name: ClassVar[str] = "think"
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    default_starts_in_reasoning: ClassVar[bool] = False

    def __init__(self, starts_in_reasoning: bool | None = None) -> None:
        self.starts_in_reasoning = (self.default_starts_in_reasoning if starts_in_reasoning is None
                                    else starts_in_reasoning)

    def split(self, text: str) -> ReasoningSplit:
        stripped = text.lstrip()
        if stripped.startswith(self.start):
            body = stripped[len(self.start):]
        elif self.starts_in_reasoning:
            body = text
        else:
            return ReasoningSplit(None, text)
        reasoning, closed, content = body.partition(self.end)
        return ReasoningSplit(reasoning if reasoning.strip() else None, content.lstrip("\n") if closed else "")

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


class ReasoningStream:
    """Incremental ``split()``: ``feed()`` returns (reasoning_delta, content_delta); ``finish()`` once."""

    def __init__(self, parser: ReasoningParser) -> None:
        self._p = parser
        self._buf = ""
        self._state = "start"  # "start" (does the output open with <think>?), "reasoning", "content"
        self._strip_newlines = False  # right after </think>: leading newlines of the answer are dropped
        # Whitespace-only thinking is reported as none, so hold it until real reasoning text shows.
        self._held_ws = ""
        self._shown = False

    @property
    def in_reasoning(self) -> bool:
        """True while the output is (or, undecided, may still be) thinking: structured-output
        constraints apply only once this turns False."""
        if self._state == "start":
            return self._p.starts_in_reasoning or bool(self._buf.strip())
        return self._state == "reasoning"

    def feed(self, chunk: str) -> tuple[str, str]:
        self._buf += chunk
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning, content = "", ""
        if self._state == "start":
            stripped = self._buf.lstrip()
            if stripped.startswith(self._p.start):
                self._buf, self._state = stripped[len(self._p.start):], "reasoning"
            elif not final and self._p.start.startswith(stripped):
                return "", ""  # only whitespace or part of "<think>" so far: undecided
            else:
                self._state = "reasoning" if self._p.starts_in_reasoning else "content"
        if self._state == "reasoning":
            i = self._buf.find(self._p.end)
            if i >= 0:
                reasoning = self._reasoning(self._buf[:i])
                self._buf = self._buf[i + len(self._p.end):]
                self._state, self._strip_newlines = "content", True
            else:
                n = len(self._buf) if final else len(self._buf) - _held_suffix(self._buf, self._p.end)
                reasoning = self._reasoning(self._buf[:n])
                self._buf = self._buf[n:]
        if self._state == "content":
            if self._strip_newlines:
                self._buf = self._buf.lstrip("\n")
                self._strip_newlines = not self._buf
            content, self._buf = self._buf, ""
        return reasoning, content

    def _reasoning(self, text: str) -> str:
        if self._shown or text.strip():
            text, self._held_ws, self._shown = self._held_ws + text, "", True
            return text
        self._held_ws += text
        return ""


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 (and its distills): the template opens ``<think>`` in the prompt."""

    name = "deepseek_r1"
    default_starts_in_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 / QwQ: the model writes ``<think>`` itself when it thinks."""

    name = "qwen3"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def get_reasoning_parser(name: str, starts_in_reasoning: bool | None = None) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ConfigError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name](starts_in_reasoning)
