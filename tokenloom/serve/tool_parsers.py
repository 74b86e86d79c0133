"""Tool-call parsers: turn a model's text into OpenAI ``tool_calls``, whole or as it streams.

Every format has the same shape: plain text, then *call regions* that open with a marker
(``<tool_call>``, ``[TOOL_CALLS]``, a leading ``{``) and close with an end tag or at the end of the
text. A parser only says where regions open and close and how to read one region; the one scanner in
``ToolStream`` runs both ``parse()`` (one final pass over the whole text) and streaming (many passes
over a growing buffer), so a stream reassembles to exactly what ``parse()`` returns, whatever the
chunking. Plain text streams at once, except a tail that could still grow into a marker; a call
region is held until it closes and then goes out as one delta. A region that does not read as
well-formed calls comes back verbatim as content: parsing never raises on model output.
"""

from __future__ import annotations

import json
import secrets
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from tokenloom.errors import ConfigError


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object as compact JSON text: OpenAI sends arguments as a string
    id: str


@dataclass(frozen=True)
class ParsedMessage:
    content: str | None  # None when there are tool calls and nothing but whitespace around them
    tool_calls: list[ToolCall]


@dataclass
class ToolCallDelta:
    index: int
    id: str | None  # set on the first delta of a call
    name: str | None  # set on the first delta of a call
    arguments: str


@dataclass
class StreamDelta:
    content: str
    tool_calls: list[ToolCallDelta]


Piece = str | ToolCall  # what reading text yields, in order: content text or a finished call


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _held_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker`` (it may still
    become the marker once more text arrives, so it must not go out as content yet)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _up_to_marker(buf: str, marker: str, final: bool) -> tuple[int, bool]:
    """``ToolParser.plain`` for a region that opens with ``marker`` anywhere in the text."""
    i = buf.find(marker)
    if i >= 0:
        return i, True
    return (len(buf) if final else len(buf) - _held_suffix(buf, marker)), False


class ToolParser(ABC):
    name: ClassVar[str]

    @abstractmethod
    def plain(self, buf: str, final: bool, at_start: bool) -> tuple[int, bool]:
        """Outside a call: (how many leading chars of ``buf`` are surely content, whether a call region
        opens right after them). ``at_start``: nothing of the message has been consumed yet."""

    @abstractmethod
    def region_end(self, buf: str) -> int | None:
        """``buf`` starts with an open region: the index just past its end, or None if not seen yet
        (at the end of the text the region then runs to the end)."""

    @abstractmethod
    def read_region(self, region: str) -> list[Piece]:
        """Read one whole region into calls, with anything malformed kept verbatim as content."""

    def new_id(self) -> str:
        return new_call_id()

    def make_call(self, obj: Any) -> ToolCall | None:
        """A call from ``{"name": ..., "arguments"|"parameters": {...}}``, or None if it is not one.
        Missing arguments mean a call without any (models omit ``{}`` for argument-less tools)."""
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(args, dict):
            return None
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False, separators=(",", ":")),
                        self.new_id())

    def stream(self) -> ToolStream:
        return ToolStream(self)

    def parse(self, text: str) -> ParsedMessage:
        pieces = ToolStream(self, text).read(final=True)
        calls = [p for p in pieces if isinstance(p, ToolCall)]
        content = "".join(p for p in pieces if isinstance(p, str))
        return ParsedMessage(None if calls and not content.strip() else content, calls)


class ToolStream:
    """Incremental parsing of one generation: ``feed()`` each new piece of text, ``finish()`` once."""

    def __init__(self, parser: ToolParser, text: str = "") -> None:
        self._parser = parser
        self._buf = text
        self._in_region = False
        self._at_start = True
        self._n_calls = 0
        # Whitespace before any real content is held: if the message turns out to be only tool calls,
        # parse() reports content None and the stream must not have sent that whitespace either.
        self._held_ws = ""
        self._shown = False

    def read(self, final: bool) -> list[Piece]:
        """Consume what can be decided from the buffer now; ``final`` means no more text will come."""
        out: list[Piece] = []
        while True:
            if not self._in_region:
                n, opens = self._parser.plain(self._buf, final, self._at_start)
                if n:
                    out.append(self._buf[:n])
                    self._buf = self._buf[n:]
                if n or opens:
                    self._at_start = False
                if not opens:
                    return out
                self._in_region = True
            end = self._parser.region_end(self._buf)
            if end is None:
                if not final:
                    return out
                end = len(self._buf)
            out.extend(self._parser.read_region(self._buf[:end]))
            self._buf = self._buf[end:]
            self._in_region = False

    def feed(self, chunk: str) -> StreamDelta:
        self._buf += chunk
        return self._delta(self.read(final=False), final=False)

    def finish(self) -> StreamDelta:
        return self._delta(self.read(final=True), final=True)

    def _delta(self, pieces: list[Piece], final: bool) -> StreamDelta:
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        for p in pieces:
            if isinstance(p, ToolCall):
                calls.append(ToolCallDelta(self._n_calls, p.id, p.name, p.arguments))
                self._n_calls += 1
            elif self._shown or p.strip():
                content.append(self._held_ws + p)
                self._held_ws, self._shown = "", True
            else:
                self._held_ws += p
        if final and self._n_calls == 0:
            content.append(self._held_ws)
            self._held_ws = ""
        return StreamDelta("".join(content), calls)


class TaggedToolParser(ToolParser):
    """Calls between an open and a close tag, one JSON object each: ``<tool_call>{...}</tool_call>``."""

    start: ClassVar[str]
    end: ClassVar[str]

    def plain(self, buf: str, final: bool, at_start: bool) -> tuple[int, bool]:
        return _up_to_marker(buf, self.start, final)

    def region_end(self, buf: str) -> int | None:
        j = buf.find(self.end, len(self.start))
        return None if j < 0 else j + len(self.end)

    def read_region(self, region: str) -> list[Piece]:
        if not region.endswith(self.end):  # unterminated: the generation was cut inside the call
            return [region]
        try:
            call = self.make_call(json.loads(region[len(self.start):-len(self.end)]))
        except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
            call = None
        return [call if call is not None else region]


class HermesToolParser(TaggedToolParser):
    """Hermes 2 Pro, Qwen2.5, Qwen3: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""

    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1/3.2 JSON tool calling: the whole message is ``{"name": ..., "parameters": {...}}``
    (optionally after ``<|python_tag|>``), or several such objects joined by ``;``. Only the start of
    the message decides, so a message that opens with JSON is held to the end."""

    name = "llama3_json"
    python_tag: ClassVar[str] = "<|python_tag|>"

    def plain(self, buf: str, final: bool, at_start: bool) -> tuple[int, bool]:
        if not at_start:
            return len(buf), False
        s = buf.lstrip()
        if s.startswith("{") or s.startswith(self.python_tag):
            return len(buf) - len(s), True
        if not final and self.python_tag.startswith(s):  # only whitespace, or a partial python tag
            return 0, False
        return len(buf), False

    def region_end(self, buf: str) -> int | None:
        return None

    def read_region(self, region: str) -> list[Piece]:
        body = region.removeprefix(self.python_tag)
        decoder = json.JSONDecoder()
        calls: list[Piece] = []
        pos = len(body) - len(body.lstrip())
        while pos < len(body):
            try:
                obj, after = decoder.raw_decode(body, pos)
            except (ValueError, RecursionError):
                break
            call = self.make_call(obj)
            if call is None:
                break
            calls.append(call)
            rest = body[after:].lstrip()
            if not rest.startswith(";"):
                pos = after if rest else len(body)
                break
            pos = len(body) - len(rest[1:].lstrip())
        if not calls:
            return [region]
        # Calls read up to a point: what follows is not a call and stays as text.
        return calls + ([body[pos:]] if pos < len(body) else [])


class MistralToolParser(ToolParser):
    """Mistral: ``[TOOL_CALLS]`` then a JSON array of calls (older tokenizers), or
    ``[TOOL_CALLS]name[ARGS]{...}`` once per call (v11 and later). The region runs to the end of the
    message. Mistral's own call ids are 9 alphanumerics, so those are generated here."""

    name = "mistral"
    start: ClassVar[str] = "[TOOL_CALLS]"
    args_tag: ClassVar[str] = "[ARGS]"
    _id_chars: ClassVar[str] = string.ascii_letters + string.digits

    def new_id(self) -> str:
        return "".join(secrets.choice(self._id_chars) for _ in range(9))

    def plain(self, buf: str, final: bool, at_start: bool) -> tuple[int, bool]:
        return _up_to_marker(buf, self.start, final)

    def region_end(self, buf: str) -> int | None:
        return None

    def read_region(self, region: str) -> list[Piece]:
        body = region[len(self.start):]
        if body.lstrip().startswith("["):
            return self._read_array(region, body)
        out: list[Piece] = []
        for seg in body.split(self.start):
            out.extend(self._read_named(seg))
        return out

    def _read_array(self, region: str, body: str) -> list[Piece]:
        try:
            items, after = json.JSONDecoder().raw_decode(body, len(body) - len(body.lstrip()))
        except (ValueError, RecursionError):
            return [region]
        calls = [self.make_call(item) for item in items]
        if not calls or any(c is None for c in calls):
            return [region]  # the array is one unit: it is calls only if every element is one
        return [c for c in calls if c is not None] + ([body[after:]] if body[after:] else [])

    def _read_named(self, seg: str) -> list[Piece]:
        """One ``name[ARGS]{...}`` after a ``[TOOL_CALLS]``; anything after the object is text."""
        name, sep, rest = seg.partition(self.args_tag)
        try:
            args, after = json.JSONDecoder().raw_decode(rest, len(rest) - len(rest.lstrip()))
        except (ValueError, RecursionError):
            args, after = None, 0
        call = self.make_call({"name": name.strip(), "arguments": args}) if sep else None
        if call is None:
            return [self.start + seg]
        return [call] + ([rest[after:]] if rest[after:] else [])


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's tool-call syntax implies, or None if it shows none."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|python_tag|>" in chat_template or ("ipython" in chat_template and "parameters" in chat_template):
        return "llama3_json"
    return None


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ConfigError(f"unknown tool parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()
