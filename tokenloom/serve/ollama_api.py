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
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenloom import __version__
from tokenloom.errors import InvalidRequest
from tokenloom.outputs import RequestOutput, merge_delta
from tokenloom.serve.chat_output import ChoiceOutput, ToolMode
from tokenloom.serve.constraints import ollama_constraint
from tokenloom.serve.frontend import Frontend, chain, first
from tokenloom.serve.openai_api import client_gone, gather_or_abort
from tokenloom.serve.ollama_protocol import ChatRequest, GenerateRequest, OllamaRequest, ShowRequest

router = APIRouter()


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _frontend(request: Request) -> Frontend:
    return request.app.state.frontend


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


def _ollama_calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    """OpenAI-style tool calls as Ollama writes them: arguments as an object, not a JSON string."""
    calls = []
    for i, c in enumerate(message.get("tool_calls") or []):
        try:
            args = json.loads(c["function"]["arguments"])
        except ValueError:
            args = {}
        calls.append({"function": {"index": i, "name": c["function"]["name"], "arguments": args}})
    return calls


async def _respond(request: Request, body: OllamaRequest, ids: list[int], start: float, shape: str,
                   mode: ToolMode) -> Response:
    """Run one request; `shape` is "generate" (text in `response`) or "chat" (text in `message`).
    Thinking goes to `thinking` when the server has a reasoning parser and `think` is not false; tool
    calls (chat with `tools`) to `message.tool_calls`, parsed from the whole output."""
    fe = _frontend(request)
    reasoning = fe.reasoning_for(ids) if body.think is not False else None
    if body.think and reasoning is None:
        raise InvalidRequest("think: this server has no reasoning parser (start it with --reasoning-parser)",
                             "think")
    constraint = ollama_constraint(body.format)
    if constraint is not None and reasoning is not None:
        constraint = fe.thinking_first(constraint, reasoning)
    stream = fe.run([ids], [fe.ollama_params(body.options, len(ids), constraint)])
    submitted = time.monotonic()
    choice = ChoiceOutput(mode, reasoning)

    def piece(delta: dict[str, Any], done: bool) -> dict[str, Any]:
        base: dict[str, Any] = {"model": body.model, "created_at": _now()}
        text = delta.get("content") or ""
        if shape == "chat":
            msg: dict[str, Any] = {"role": "assistant", "content": text}
            if delta.get("reasoning_content"):
                msg["thinking"] = delta["reasoning_content"]
            if delta.get("tool_calls"):
                msg["tool_calls"] = _ollama_calls(delta)
            base["message"] = msg
        else:
            base["response"] = text
            if delta.get("reasoning_content"):
                base["thinking"] = delta["reasoning_content"]
        base["done"] = done
        return base

    def final(total: RequestOutput, delta: dict[str, Any]) -> dict[str, Any]:
        stats = _stats(total, start, submitted)
        request.state.usage.update(prompt_tokens=stats["prompt_eval_count"], completion_tokens=stats["eval_count"])
        return {**piece(delta, True), **stats}

    if not body.stream:
        whole = await gather_or_abort(request, stream, 1)
        if whole is None:
            return client_gone()
        (total,) = whole
        c = total.outputs[0] if total.outputs else None
        message, _ = choice.message(c.text if c else "", c.finish_reason if c else None)
        return JSONResponse(final(total, message))

    head = await first(stream)  # errors before the first token stay HTTP errors

    async def lines() -> AsyncIterator[str]:
        total: RequestOutput | None = None
        try:
            async for _, delta in chain(head, stream):
                total = merge_delta(total, delta)
                out = delta.outputs[0] if delta.outputs else None
                fields = choice.feed(out.text if out else "")
                # One line per token, as Ollama streams, even when the token completes no character yet.
                if fields or (out and out.token_ids):
                    yield json.dumps(piece(fields, False)) + "\n"
                if delta.finished:
                    last, _ = choice.finish(out.finish_reason if out else None)
                    yield json.dumps(final(total, last)) + "\n"
                    return
        except Exception as e:  # noqa: BLE001 - a started stream ends with an error line
            yield json.dumps({"error": str(e)}) + "\n"
        finally:
            await stream.aclose()

    return StreamingResponse(lines(), media_type="application/x-ndjson")


@router.post("/api/generate")
async def generate(body: GenerateRequest, request: Request) -> Any:
    start = time.monotonic()
    fe = _frontend(request)
    fe.check_model(body.model, latest_ok=True)
    if not body.prompt:  # Ollama answers an empty prompt by (pre)loading the model
        return JSONResponse({"model": body.model, "created_at": _now(), "response": "", "done": True,
                             "done_reason": "load"})
    kwargs = None if body.think is None else {"enable_thinking": body.think}
    ids = await fe.generate_ids_async(body.prompt, body.system, body.raw, kwargs)
    return await _respond(request, body, ids, start, "generate", ToolMode("none"))


@router.post("/api/chat")
async def chat(body: ChatRequest, request: Request) -> Any:
    start = time.monotonic()
    fe = _frontend(request)
    fe.check_model(body.model, latest_ok=True)
    if not body.messages:
        return JSONResponse({"model": body.model, "created_at": _now(), "message": {"role": "assistant", "content": ""},
                             "done": True, "done_reason": "load"})
    mode = ToolMode("none")
    if body.tools:
        if fe.tool_parser is None:
            raise InvalidRequest("tools: this model's tool-call format is unknown; start the server with "
                                 "--tool-call-parser (hermes, llama3_json, mistral)", "tools")
        mode = ToolMode("auto", parser=fe.tool_parser)
    kwargs = None if body.think is None else {"enable_thinking": body.think}
    ids = await fe.chat_ids_async(body.messages, True, body.tools, kwargs)
    return await _respond(request, body, ids, start, "chat", mode)


def _details(fe: Frontend) -> dict[str, Any]:
    info, cfg = fe.engine.model_info, fe.engine.model_config
    return {"format": "gguf" if info.path.suffix == ".gguf" else "safetensors", "family": cfg.family,
            "families": [cfg.family], "parameter_size": f"{info.num_parameters / 1e6:.0f}M",
            "quantization_level": info.dtype}


@router.get("/api/tags")
async def tags(request: Request) -> dict[str, Any]:
    fe = _frontend(request)
    name, path = fe.model_name, fe.engine.model_info.path
    size = path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.glob("*.safetensors"))
    modified = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).isoformat()
    return {"models": [{"name": name, "model": name, "modified_at": modified, "size": size,
                        "digest": "", "details": _details(fe)}]}


@router.post("/api/show")
async def show(body: ShowRequest, request: Request) -> dict[str, Any]:
    fe = _frontend(request)
    fe.check_model(body.model, latest_ok=True)
    cfg = fe.engine.model_config
    info = {f"{cfg.family}.{k}": v for k, v in {
        "context_length": fe.max_model_len, "embedding_length": cfg.hidden_size,
        "block_count": cfg.num_hidden_layers, "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": cfg.num_key_value_heads, "rope.freq_base": cfg.rope_theta}.items()}
    return {"modelfile": "", "parameters": "", "template": fe.tokenizer.chat_template or "",
            "details": _details(fe), "model_info": info}


@router.get("/api/version")
async def version() -> dict[str, str]:
    return {"version": __version__}
