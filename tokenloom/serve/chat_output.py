"""One chat choice's generated text as an assistant message: reasoning split off, tool calls parsed out.

How a request's tools are served (`ToolMode`, decided once per request by `tool_mode`):
- "none": no tools, or tool_choice "none": the text is content;
- "auto": the model may call tools in its own format; the tool-call parser of its family reads them out;
- "named": tool_choice names a function; the grammar makes the whole output that function's arguments
  (a JSON object held to its schema), which become one call;
- "required": the grammar makes the output a JSON array of calls [{"name", "parameters"}], each held to its
  function's schema (serve/constraints.py), which become the calls.

`ChoiceOutput` works both ways: `message(text)` for a whole response and `feed(delta)` / `finish(reason)`
for a stream, whose deltas reassemble to the same message (the parsers guarantee it for their part).
With a reasoning parser, thinking goes to `reasoning_content` first and only the rest is read for calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from tokenloom.errors import InvalidRequest
from tokenloom.serve.protocol import ChatCompletionRequest, NamedToolChoice
from tokenloom.serve.reasoning import ReasoningParser, ReasoningStream
from tokenloom.serve.tool_parsers import ToolCall, ToolParser, ToolStream, new_call_id


@dataclass(frozen=True)
class ToolMode:
    kind: Literal["none", "auto", "named", "required"]
    parser: ToolParser | None = None  # auto
    function: str | None = None  # named


def tool_mode(body: ChatCompletionRequest, parser: ToolParser | None) -> ToolMode:
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")
    if not body.tools or choice == "none":
        return ToolMode("none")
    if isinstance(choice, NamedToolChoice):
        return ToolMode("named", function=choice.function.name)
    if choice == "required":
        return ToolMode("required")
    if parser is None:
        raise InvalidRequest('tool_choice "auto" needs a tool-call parser for this model: start the server with '
                             '--tool-call-parser (hermes, llama3_json, mistral), or use tool_choice "required" or '
                             "a named function", "tool_choice")
    return ToolMode("auto", parser=parser)


def _call_dict(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _required_calls(text: str) -> list[ToolCall] | None:
    """The "required" grammar's JSON array as calls; None when it does not parse (the output was cut)."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list):
        return None
    calls = []
    for item in items:
        if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
            return None
        args = json.dumps(item.get("parameters", {}), ensure_ascii=False, separators=(",", ":"))
        calls.append(ToolCall(item["name"], args, new_call_id()))
    return calls


class ChoiceOutput:
    def __init__(self, mode: ToolMode, reasoning: ReasoningParser | None) -> None:
        self.mode = mode
        self.reasoning = reasoning
        self._reasoning_stream: ReasoningStream | None = reasoning.stream() if reasoning else None
        self._tool_stream: ToolStream | None = mode.parser.stream() if mode.parser else None
        self._text = ""  # content text held for "required" (parsed once complete)
        self._named_id: str | None = None
        self.num_calls = 0

    # -- a whole response ---------------------------------------------------------------------------

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message for `text`, and the finish reason ("tool_calls" when calls were made)."""
        msg: dict[str, Any] = {"role": "assistant"}
        if self.reasoning is not None:
            split = self.reasoning.split(text)
            text = split.content
            msg["reasoning_content"] = split.reasoning
        calls: list[ToolCall] = []
        content: str | None = text
        if self.mode.kind == "auto" and self.mode.parser is not None:
            parsed = self.mode.parser.parse(text)
            content, calls = parsed.content, parsed.tool_calls
        elif self.mode.kind == "named":  # a call even when cut by max_tokens (finish_reason "length"), as
            # a stream has already sent its id and name by then
            calls, content = [ToolCall(self.mode.function or "", text, new_call_id())], None
        elif self.mode.kind == "required" and finish_reason == "stop":
            got = _required_calls(text)
            if got is not None:
                calls, content = got, None
        msg["content"] = content
        if calls:
            msg["tool_calls"] = [_call_dict(c) for c in calls]
        return msg, _finish(finish_reason, bool(calls))

    # -- a stream -----------------------------------------------------------------------------------

    def feed(self, text: str) -> dict[str, Any]:
        """The delta fields (reasoning_content, content, tool_calls) for newly generated `text`."""
        delta: dict[str, Any] = {}
        if self._reasoning_stream is not None:
            thought, text = self._reasoning_stream.feed(text)
            if thought:
                delta["reasoning_content"] = thought
        self._content(text, delta, final=False)
        return delta

    def finish(self, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The last delta (whatever the parsers held back) and the finish reason."""
        delta: dict[str, Any] = {}
        text = ""
        if self._reasoning_stream is not None:
            thought, text = self._reasoning_stream.finish()
            if thought:
                delta["reasoning_content"] = thought
        self._content(text, delta, final=True, stopped=finish_reason == "stop")
        return delta, _finish(finish_reason, self.num_calls > 0)

    def _content(self, text: str, delta: dict[str, Any], final: bool, stopped: bool = False) -> None:
        kind = self.mode.kind
        if kind == "auto" and self._tool_stream is not None:
            got = self._tool_stream.feed(text) if not final else _merge(self._tool_stream.feed(text),
                                                                         self._tool_stream.finish())
            if got.content:
                delta["content"] = got.content
            if got.tool_calls:
                delta["tool_calls"] = [_call_delta(d.index, d.id, d.name, d.arguments) for d in got.tool_calls]
                self.num_calls = max(self.num_calls, max(d.index for d in got.tool_calls) + 1)
        elif kind == "named":
            # The output is the arguments object: the call's id and name go first, the text streams as its
            # arguments.
            pieces = []
            if self._named_id is None and (text or final):
                self._named_id = new_call_id()
                self.num_calls = 1
                pieces.append(_call_delta(0, self._named_id, self.mode.function, ""))
            if text:
                pieces.append(_call_delta(0, None, None, text))
            if pieces:
                delta["tool_calls"] = pieces
        elif kind == "required":
            self._text += text
            if final:
                calls = _required_calls(self._text) if stopped else None
                if calls is None:
                    if self._text:
                        delta["content"] = self._text
                else:
                    delta["tool_calls"] = [_call_delta(i, c.id, c.name, c.arguments) for i, c in enumerate(calls)]
                    self.num_calls = len(calls)
        elif text:
            delta["content"] = text


def _merge(a: Any, b: Any) -> Any:
    a.content += b.content
    a.tool_calls += b.tool_calls
    return a


def _call_delta(index: int, call_id: str | None, name: str | None, arguments: str) -> dict[str, Any]:
    d: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if call_id is not None:
        d["id"], d["type"] = call_id, "function"
    if name is not None:
        d["function"]["name"] = name
    return d


def _finish(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when the model stopped after calling tools."""
    return "tool_calls" if called and reason == "stop" else reason
