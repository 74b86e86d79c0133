"""Request bodies (pydantic) of the OpenAI and Ollama APIs; serve/frontend.py turns them into prompts and
SamplingParams."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator, model_validator

from tokenloom.errors import InvalidRequest

# Numbers and booleans are taken as JSON types, never coerced: "n": "2", "stream": "yes" and "prompt": [true]
# are 400s. StrictFloat still accepts an integer (temperature 1).
Int = StrictInt
Bool = StrictBool
Float = StrictFloat


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


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown OpenAI fields (user, logit_bias, ...) are accepted


class _Request(_Body):
    """A whole request body (not a part of one): its strings are checked once, with their full paths."""

    @model_validator(mode="after")
    def _utf8(self) -> "_Request":
        check_utf8(self, "")
        return self


class StreamOptions(_Body):
    include_usage: Bool = False


class _Sampling(_Request):
    model: str
    n: Int = 1
    temperature: Float | None = None
    top_p: Float = 1.0
    top_k: Int = 0  # extension, as in vLLM
    min_p: Float = 0.0  # extension
    presence_penalty: Float = 0.0
    frequency_penalty: Float = 0.0
    repetition_penalty: Float = 1.0  # extension
    seed: Int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None  # extension
    stream: Bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: Bool = False  # extension
    min_tokens: Int = 0  # extension


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = 16
    logprobs: Int | None = None
    echo: Bool = False


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _parts(cls, content: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        """Content parts are objects with a string "type"; a text part's "text" is a string."""
        if isinstance(content, list):
            for i, part in enumerate(content):
                if not isinstance(part.get("type"), str):
                    raise ValueError(f"part {i} needs a string \"type\"")
                if part["type"] == "text" and not isinstance(part.get("text"), str):
                    raise ValueError(f"part {i} is of type text and needs a string \"text\"")
        return content

    def text(self) -> str:
        """Content as plain text; multi-part content keeps its text parts."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: Bool = False
    top_logprobs: Int | None = None
    add_generation_prompt: Bool = True  # extension


class TokenizeRequest(_Request):
    """vLLM's /tokenize body: a prompt, or chat messages rendered through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Bool = True
    add_generation_prompt: Bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Int]


# -- Ollama ------------------------------------------------------------------------------------------


class Options(_Body):
    temperature: Float | None = None
    top_k: Int | None = None
    top_p: Float | None = None
    min_p: Float | None = None
    seed: Int | None = None
    num_predict: Int | None = None  # -1: until the context is full
    num_ctx: Int | None = None
    stop: list[str] | None = None
    repeat_penalty: Float | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None


class OllamaRequest(_Request):
    model: str
    stream: Bool = True
    options: Options = Field(default_factory=Options)


class GenerateRequest(OllamaRequest):
    prompt: str = ""
    system: str | None = None
    raw: Bool = False


class Message(_Body):
    role: str
    content: str = ""

    def text(self) -> str:
        return self.content


class ChatRequest(OllamaRequest):
    messages: list[Message] = Field(default_factory=list)


class ShowRequest(_Request):
    model: str = Field(validation_alias="model")
