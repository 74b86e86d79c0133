"""Request bodies of the Ollama API (/api/generate, /api/chat, /api/show), with protocol.py's rules: unknown
fields are 400s, types are strict, ranges are declared.

Ollama's options mix sampling with model-loading settings. The loading ones (GPU layers, threads, mmap, ...)
are fixed when tokenloom starts, as Ollama fixes them when it loads a model; they are accepted per request and
have no effect (LOAD_OPTIONS, documented in the README). Sampling options tokenloom does not implement
(mirostat, tail-free sampling) are 400s unless they ask for the default (off).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from tokenloom.serve.protocol import Body, Bool, Float, Int, Penalty, Request, Seed, unsupported

LOAD_OPTIONS = ("num_keep", "num_batch", "num_gpu", "main_gpu", "use_mmap", "use_mlock", "numa", "num_thread",
                "low_vram", "f16_kv", "vocab_only", "penalize_newline", "mirostat_tau", "mirostat_eta")
Format = Literal["json", ""] | dict[str, Any]  # "json": any JSON value; an object: a JSON schema


class Options(Body):
    temperature: Annotated[Float, Field(ge=0)] | None = None
    top_k: Int | None = Field(None, ge=-1)
    top_p: Annotated[Float, Field(gt=0, le=1)] | None = None
    min_p: Annotated[Float, Field(ge=0, le=1)] | None = None
    typical_p: Annotated[Float, Field(gt=0, le=1)] | None = None
    seed: Seed | None = None
    num_predict: Int | None = None  # -1 (or any negative): until the context is full
    num_ctx: Int | None = Field(None, ge=1)
    stop: list[str] | None = None
    repeat_penalty: Annotated[Float, Field(gt=0)] | None = None
    repeat_last_n: Int | None = Field(None, ge=-1)  # -1: the whole context, 0: no repeat penalty
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    mirostat: Int | None = None
    tfs_z: Float | None = None
    # Model-loading options: accepted, no effect (LOAD_OPTIONS).
    num_keep: Int | None = None
    num_batch: Int | None = None
    num_gpu: Int | None = None
    main_gpu: Int | None = None
    use_mmap: Bool | None = None
    use_mlock: Bool | None = None
    numa: Bool | None = None
    num_thread: Int | None = None
    low_vram: Bool | None = None
    f16_kv: Bool | None = None
    vocab_only: Bool | None = None
    penalize_newline: Bool | None = None
    mirostat_tau: Float | None = None
    mirostat_eta: Float | None = None

    @model_validator(mode="after")
    def _unimplemented(self) -> "Options":
        if self.mirostat not in (None, 0):
            raise unsupported("options.mirostat", "only 0 (off)")
        if self.tfs_z not in (None, 1, 1.0):
            raise unsupported("options.tfs_z", "only 1 (tail-free sampling off)")
        return self


def _no_images(images: list[str] | None) -> list[str] | None:
    if images:
        raise ValueError("this model takes text only")
    return images


class ToolFunctionCall(Body):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    index: Int | None = None


class ToolCall(Body):
    function: ToolFunctionCall


class Message(Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    thinking: str | None = None
    tool_name: str | None = None

    @field_validator("images")
    @classmethod
    def _text_only(cls, images: list[str] | None) -> list[str] | None:
        return _no_images(images)

    def text(self) -> str:
        return self.content

    def template_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [{"type": "function", "function": {"name": c.function.name,
                                                                    "arguments": c.function.arguments}}
                                 for c in self.tool_calls]
        if self.tool_name is not None:
            out["name"] = self.tool_name
        if self.thinking is not None:
            out["reasoning_content"] = self.thinking
        return out


class FunctionSpec(Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(Body):
    type: Literal["function"] = "function"
    function: FunctionSpec


class OllamaRequest(Request):
    model: str
    stream: Bool = True
    options: Options = Field(default_factory=Options)
    format: Format | None = None
    think: Bool | None = None
    keep_alive: str | Int | Float | None = None  # no effect: the model stays loaded while tokenloom runs


class GenerateRequest(OllamaRequest):
    prompt: str = ""
    system: str | None = None
    raw: Bool = False
    images: list[str] | None = None
    suffix: None = None  # fill-in-the-middle is not supported: only null is accepted
    template: None = None  # the model's own chat template is used: only null is accepted
    context: None = None  # deprecated in Ollama; send the history to /api/chat instead

    @field_validator("images")
    @classmethod
    def _text_only(cls, images: list[str] | None) -> list[str] | None:
        return _no_images(images)


class ChatRequest(OllamaRequest):
    messages: list[Message] = Field(default_factory=list)
    tools: list[Tool] | None = None


class ShowRequest(Request):
    model: str
    verbose: Bool = False
