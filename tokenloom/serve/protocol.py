"""Request bodies (pydantic) of the OpenAI API and vLLM's extensions; serve/frontend.py turns them into
prompts and SamplingParams. The Ollama bodies are in serve/ollama_protocol.py.

Nothing is ignored in silence: every body refuses unknown fields (`extra="forbid"`, a 400 naming the field).
The few OpenAI fields that mean nothing for a local server are accepted and have no effect; they are listed
in NO_EFFECT (and the README). A field tokenloom knows but does not implement is refused with a 400 saying
so (`_unsupported`). Numbers and booleans are taken as JSON types, never coerced ("n": "2" is a 400), and
ranges are declared on the fields, so the served OpenAPI document says what is accepted.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator, model_validator

from tokenloom.errors import InvalidRequest
from tokenloom.sampling_params import INT64_MAX, INT64_MIN, MAX_LOGPROBS

Int = StrictInt
Bool = StrictBool
Float = Annotated[StrictFloat, Field(allow_inf_nan=False)]  # StrictFloat still accepts an integer (1)
TokenId = Annotated[StrictInt, Field(ge=0, le=INT64_MAX)]  # below the vocabulary size: the engine checks
Seed = Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)]
Penalty = Annotated[StrictFloat, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]

# Accepted and without effect on a local server (documented in the README).
NO_EFFECT = ("user", "store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key")


def check_utf8(value: object, where: str) -> None:
    """Every string of a body (dict keys included) must encode to UTF-8: JSON may carry a lone surrogate
    ("a\\ud800b") that the tokenizer (and the JSON encoder of any answer quoting it) cannot handle. Raises
    InvalidRequest naming the field's path, e.g. messages.0.content."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest(f"{where or 'body'} is not valid Unicode (a lone surrogate?)", where or None) from None
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            check_utf8(getattr(value, name), f"{where}.{name}" if where else name)
    elif isinstance(value, dict):
        for k, v in value.items():
            check_utf8(k, where)
            check_utf8(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_utf8(v, f"{where}.{i}" if where else str(i))


def unsupported(field: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"{field} is not supported: {why}", field)


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Request(Body):
    """A whole request body (not a part of one): its strings are checked once, with their full paths."""

    @model_validator(mode="after")
    def _utf8(self) -> "Request":
        check_utf8(self, "")
        return self


# -- content, tools, response formats ----------------------------------------------------------------

class TextPart(Body):
    type: Literal["text"]
    text: str


def text_only(content: object) -> object:
    """Before validation: a content part that is not text (image_url, input_audio, file) gets a 400 that
    says why, instead of a schema error."""
    if isinstance(content, list):
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(f"part {i} is of type {kind!r}: this model takes text only")
    return content


class FunctionCall(Body):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers
    reasoning_content: str | None = None  # an earlier assistant turn's thinking, for templates that use it
    # What an OpenAI client sends back when it appends a returned message to the history as is.
    refusal: None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, content: object) -> object:
        return text_only(content)

    @model_validator(mode="after")
    def _roles(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls belong to assistant messages")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        """Content as plain text (text parts joined)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content)

    def template_dict(self) -> dict[str, Any]:
        """The message as a chat template sees it (the shape of transformers' apply_chat_template): tool
        calls with their arguments parsed to objects, as the Hermes, Qwen and Llama 3 templates expect."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            calls = []
            for c in self.tool_calls:
                try:
                    args: object = json.loads(c.function.arguments)
                except ValueError:
                    args = c.function.arguments
                calls.append({"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": args}})
            out["tool_calls"] = calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out


class FunctionDefinition(Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: Bool | None = None  # the arguments are always held to `parameters` when the grammar enforces them


class Tool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a json_schema object')
        return self


class StructuredOutputs(Body):
    """vLLM's `structured_outputs`: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: Bool | None = None

    @model_validator(mode="after")
    def _one(self) -> "StructuredOutputs":
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, json_object")
        return self


class StreamOptions(Body):
    include_usage: Bool = False


# -- OpenAI requests --------------------------------------------------------------------------------

class Sampling(Request):
    model: str
    n: Int = Field(1, ge=1)
    temperature: Annotated[Float, Field(ge=0)] | None = None
    top_p: Annotated[Float, Field(gt=0, le=1)] = 1.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, Annotated[Float, Field(ge=-100, le=100)]] | None = None  # token id (as text) -> bias
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: Bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extensions
    top_k: Int = Field(0, ge=-1)
    min_p: Annotated[Float, Field(ge=0, le=1)] = 0.0
    repetition_penalty: Annotated[Float, Field(gt=0)] = 1.0
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: Bool = False
    min_tokens: Int = Field(0, ge=0)
    skip_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1)
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    # Accepted without effect (NO_EFFECT).
    user: str | None = None
    store: Bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # prefix caching is automatic


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Int | None = Field(16, ge=1)
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Bool = False
    best_of: Int | None = Field(None, ge=1)
    suffix: None = None  # fill-in-the-middle is not supported: only null is accepted

    @model_validator(mode="after")
    def _best_of(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of != self.n:
            raise unsupported("best_of", "only best_of equal to n (every completion is returned)")
        return self


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = Field(None, ge=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: Bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool = True
    modalities: list[Literal["text"]] | None = None  # text is all this server produces
    # vLLM's extensions
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _tools(self) -> "ChatCompletionRequest":
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise InvalidRequest(f"tool_choice names {self.tool_choice.function.name!r}, which is not in "
                                     "tools", "tool_choice")
        if self.tool_choice is not None and not self.tools:
            raise InvalidRequest("tool_choice is only allowed when tools are given", "tool_choice")
        if self.continue_final_message and (self.add_generation_prompt or self.messages[-1].role != "assistant"):
            raise InvalidRequest("continue_final_message needs add_generation_prompt false and a final "
                                 "assistant message", "continue_final_message")
        return self


class TokenizeRequest(Request):
    """vLLM's /tokenize body: a prompt, or chat messages rendered through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: Bool = True
    add_generation_prompt: Bool = True
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(Request):
    model: str | None = None
    tokens: list[TokenId]
