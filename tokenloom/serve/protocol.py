"""Request bodies (pydantic) of the OpenAI and Ollama APIs; serve/frontend.py turns them into prompts and
SamplingParams."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown OpenAI fields (user, logit_bias, ...) are accepted


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float = 1.0
    top_k: int = 0  # extension, as in vLLM
    min_p: float = 0.0  # extension
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension
    min_tokens: int = 0  # extension


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """Content as plain text; multi-part content keeps its text parts."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # extension


class TokenizeRequest(_Body):
    """vLLM's /tokenize body: a prompt, or chat messages rendered through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


# -- Ollama ------------------------------------------------------------------------------------------


class Options(_Body):
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    num_predict: int | None = None  # -1: until the context is full
    num_ctx: int | None = None
    stop: list[str] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class OllamaRequest(_Body):
    model: str
    stream: bool = True
    options: Options = Field(default_factory=Options)


class GenerateRequest(OllamaRequest):
    prompt: str = ""
    system: str | None = None
    raw: bool = False


class Message(_Body):
    role: str
    content: str = ""

    def text(self) -> str:
        return self.content


class ChatRequest(OllamaRequest):
    messages: list[Message] = Field(default_factory=list)


class ShowRequest(_Body):
    model: str = Field(validation_alias="model")
