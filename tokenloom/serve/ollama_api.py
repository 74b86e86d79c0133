"""The Ollama-compatible API: /api/generate, /api/chat (NDJSON streams or one object), /api/tags,
/api/show, /api/version. Errors answer `{"error": "..."}`, as Ollama does.

Durations in the final object are measured nanoseconds: prompt_eval_duration is the request's prefill
time, eval_duration its decode time, load_duration the set-up before the engine got the request
(template + tokenization: the model itself is loaded once at start-up), total_duration the whole call.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from tokenloom import __version__
from tokenloom.engine.async_engine import AsyncLLMEngine
from tokenloom.errors import ContextTooLong, InvalidRequest
from tokenloom.outputs import RequestOutput, merge_delta
from tokenloom.sampling_params import SamplingParams
from tokenloom.serve.errors import ModelNotFound

router = APIRouter()


class Options(BaseModel):
    model_config = ConfigDict(extra="ignore")
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


class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    stream: bool = True
    options: Options = Field(default_factory=Options)


class GenerateRequest(_Req):
    prompt: str = ""
    system: str | None = None
    raw: bool = False


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str = ""


class ChatRequest(_Req):
    messages: list[Message] = Field(default_factory=list)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _check_model(request: Request, name: str) -> str:
    served: str = request.app.state.model_name
    if name not in (served, f"{served}:latest"):
        raise ModelNotFound(name)
    return name


def _params(engine: AsyncLLMEngine, o: Options, prompt_len: int) -> SamplingParams:
    limit = engine.engine.max_model_len
    if o.num_ctx is not None:
        if o.num_ctx < 1:
            raise InvalidRequest(f"options.num_ctx must be positive, got {o.num_ctx}", "options.num_ctx")
        limit = min(limit, o.num_ctx)
    if prompt_len >= limit:
        raise ContextTooLong(f"the prompt has {prompt_len} tokens; the context is {limit}", "prompt")
    room = limit - prompt_len
    predict = o.num_predict
    max_tokens = room if predict is None or predict < 0 else min(predict, room)
    if max_tokens < 1:
        raise InvalidRequest(f"options.num_predict must be -1 or positive, got {predict}", "options.num_predict")
    return SamplingParams(
        temperature=0.8 if o.temperature is None else o.temperature,  # Ollama's default
        top_k=40 if o.top_k is None else o.top_k,
        top_p=0.9 if o.top_p is None else o.top_p,
        min_p=0.0 if o.min_p is None else o.min_p,
        seed=o.seed,
        max_tokens=max_tokens,
        stop=tuple(o.stop or ()),
        repetition_penalty=1.0 if o.repeat_penalty is None else o.repeat_penalty,
        presence_penalty=o.presence_penalty or 0.0,
        frequency_penalty=o.frequency_penalty or 0.0,
    )


def _stats(out: RequestOutput, start: float, submitted: float) -> dict[str, Any]:
    m = out.metrics
    c = out.outputs[0] if out.outputs else None
    ns = 1e9
    return {
        "done_reason": (c.finish_reason if c and c.finish_reason else "stop"),
        "total_duration": int((time.monotonic() - start) * ns),
        "load_duration": int((submitted - start) * ns),
        "prompt_eval_count": len(out.prompt_token_ids),
        "prompt_eval_duration": int((m.prefill_time if m else 0.0) * ns),
        "eval_count": len(c.token_ids) if c else 0,
        "eval_duration": int((m.decode_time if m else 0.0) * ns),
    }


async def _respond(
    request: Request, body: _Req, ids: list[int], start: float, shape: str
) -> StreamingResponse | JSONResponse:
    """Run one request; `shape` is "generate" (text in `response`) or "chat" (text in `message`)."""
    engine: AsyncLLMEngine = request.app.state.engine
    params = _params(engine, body.options, len(ids))
    stream = engine.generate(ids, params)
    submitted = time.monotonic()

    def piece(text: str, done: bool) -> dict[str, Any]:
        base: dict[str, Any] = {"model": body.model, "created_at": _now()}
        if shape == "chat":
            base["message"] = {"role": "assistant", "content": text}
        else:
            base["response"] = text
        base["done"] = done
        return base

    if not body.stream:
        total: RequestOutput | None = None
        async for delta in stream:
            total = merge_delta(total, delta)
        if total is None:
            raise InvalidRequest("the request produced no output", "prompt")
        text = total.outputs[0].text if total.outputs else ""
        stats = _stats(total, start, submitted)
        request.state.usage.update(prompt_tokens=stats["prompt_eval_count"], completion_tokens=stats["eval_count"])
        return JSONResponse({**piece(text, True), **stats})

    first = await stream.__anext__()  # errors before the first token stay HTTP errors

    async def lines() -> AsyncIterator[str]:
        total = merge_delta(None, first)
        try:
            delta = first
            while True:
                text = delta.outputs[0].text if delta.outputs else ""
                # One line per token, as Ollama streams, even when the token completes no character yet.
                has_token = bool(delta.outputs and delta.outputs[0].token_ids)
                if delta.finished:
                    if text or has_token:
                        yield json.dumps(piece(text, False)) + "\n"
                    stats = _stats(total, start, submitted)
                    request.state.usage.update(prompt_tokens=stats["prompt_eval_count"], completion_tokens=stats["eval_count"])
                    yield json.dumps({**piece("", True), **stats}) + "\n"
                    return
                if text or has_token:
                    yield json.dumps(piece(text, False)) + "\n"
                delta = await stream.__anext__()
                total = merge_delta(total, delta)
        except Exception as e:  # noqa: BLE001 - a started stream ends with an error line
            yield json.dumps({"error": str(e)}) + "\n"
        finally:
            await stream.aclose()

    return StreamingResponse(lines(), media_type="application/x-ndjson")


@router.post("/api/generate")
async def generate(body: GenerateRequest, request: Request) -> Any:
    start = time.monotonic()
    _check_model(request, body.model)
    tok = request.app.state.engine.engine.tokenizer
    if not body.prompt:  # Ollama answers an empty prompt by (pre)loading the model
        return JSONResponse({"model": body.model, "created_at": _now(), "response": "", "done": True,
                             "done_reason": "load"})
    if body.raw or not tok.chat_template:
        ids = tok.encode(body.prompt)
    else:
        msgs = ([{"role": "system", "content": body.system}] if body.system else []) + [
            {"role": "user", "content": body.prompt}]
        ids = tok.encode_chat(msgs)
    return await _respond(request, body, ids, start, "generate")


@router.post("/api/chat")
async def chat(body: ChatRequest, request: Request) -> Any:
    start = time.monotonic()
    _check_model(request, body.model)
    if not body.messages:
        return JSONResponse({"model": body.model, "created_at": _now(), "message": {"role": "assistant", "content": ""},
                             "done": True, "done_reason": "load"})
    tok = request.app.state.engine.engine.tokenizer
    ids = tok.encode_chat([{"role": m.role, "content": m.content} for m in body.messages])
    return await _respond(request, body, ids, start, "chat")


def _details(request: Request) -> dict[str, Any]:
    eng = request.app.state.engine.engine
    cfg = eng.model_config
    params = sum(p.numel() for p in eng.loaded.model.parameters())
    return {"format": "gguf" if eng.loaded.path.suffix == ".gguf" else "safetensors", "family": cfg.family,
            "families": [cfg.family], "parameter_size": f"{params / 1e6:.0f}M",
            "quantization_level": str(eng.loaded.dtype).removeprefix("torch.")}


@router.get("/api/tags")
async def tags(request: Request) -> dict[str, Any]:
    eng = request.app.state.engine.engine
    name = request.app.state.model_name
    path = eng.loaded.path
    size = path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.glob("*.safetensors"))
    modified = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).isoformat()
    return {"models": [{"name": name, "model": name, "modified_at": modified, "size": size,
                        "digest": "", "details": _details(request)}]}


class ShowRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = Field(validation_alias="model")


@router.post("/api/show")
async def show(body: ShowRequest, request: Request) -> dict[str, Any]:
    _check_model(request, body.model)
    eng = request.app.state.engine.engine
    cfg = eng.model_config
    info = {f"{cfg.family}.{k}": v for k, v in {
        "context_length": eng.max_model_len, "embedding_length": cfg.hidden_size,
        "block_count": cfg.num_hidden_layers, "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": cfg.num_key_value_heads, "rope.freq_base": cfg.rope_theta}.items()}
    return {"modelfile": "", "parameters": "", "template": eng.tokenizer.chat_template or "",
            "details": _details(request), "model_info": info}


@router.get("/api/version")
async def version() -> dict[str, str]:
    return {"version": __version__}
