"""The OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions (JSON or SSE streams),
and vLLM's /tokenize and /detokenize (the benchmark lab counts prompt tokens with them)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from tokenloom.engine.async_engine import AsyncLLMEngine
from tokenloom.errors import ContextTooLong, InvalidRequest
from tokenloom.outputs import RequestMetrics, RequestOutput, merge_delta
from tokenloom.sampling_params import SamplingParams
from tokenloom.serve.errors import ModelNotFound, error_response
from tokenloom.serve.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

router = APIRouter()


def _state(request: Request) -> tuple[AsyncLLMEngine, str]:
    return request.app.state.engine, request.app.state.model_name


def _check_model(name: str, served: str) -> None:
    if name != served:
        raise ModelNotFound(name)


def _resolve_max_tokens(engine: AsyncLLMEngine, prompt_len: int, asked: int | None) -> int:
    limit = engine.engine.max_model_len
    if prompt_len >= limit:
        raise ContextTooLong(f"the prompt has {prompt_len} tokens; max_model_len is {limit}", "prompt")
    if asked is None:
        return limit - prompt_len
    if prompt_len + asked > limit:
        raise ContextTooLong(
            f"prompt ({prompt_len} tokens) + max_tokens ({asked}) = {prompt_len + asked} exceeds "
            f"max_model_len ({limit})", "max_tokens",
        )
    return asked


def _timing(m: RequestMetrics | None) -> dict[str, float | None] | None:
    if m is None:
        return None
    return {"queue_time": m.queue_time, "time_to_first_token": m.time_to_first_token,
            "prefill_time": m.prefill_time, "decode_time": m.decode_time, "e2e_latency": m.e2e_latency}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    _, name = _state(request)
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "tokenloom"}]}


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    engine, served = _state(request)
    if body.model is not None:
        _check_model(body.model, served)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequest("give exactly one of prompt and messages", "prompt")
    tok = engine.engine.tokenizer
    if body.prompt is not None:
        ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        msgs = [{"role": m.role, "content": m.text()} for m in body.messages or []]
        ids = tok.encode_chat(msgs, body.add_generation_prompt)
    return {"count": len(ids), "max_model_len": engine.engine.max_model_len, "tokens": ids}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    engine, served = _state(request)
    if body.model is not None:
        _check_model(body.model, served)
    vocab = engine.engine.model_config.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
    return {"prompt": engine.engine.tokenizer.decode(body.tokens)}


async def _run(
    engine: AsyncLLMEngine, prompts: list[list[int]], params: list[SamplingParams], texts: list[str | None]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Merge the delta streams of several prompts: yields (prompt index, delta)."""
    if len(prompts) == 1:  # the common case: no pump task, no second queue
        async for out in engine.generate(prompts[0], params[0], prompt=texts[0]):
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for out in engine.generate(prompts[i], params[i], prompt=texts[i]):
                await queue.put((i, out))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, e))
            return
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(prompts))]
    try:
        remaining = len(prompts)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _gather(stream: AsyncIterator[tuple[int, RequestOutput]], n_prompts: int) -> list[RequestOutput]:
    """Fold every prompt's deltas into its complete output (the non-streaming responses)."""
    acc: dict[int, RequestOutput] = {}
    async for i, delta in stream:
        acc[i] = merge_delta(acc.get(i), delta)
    return [acc[i] for i in range(n_prompts)]


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def completion_prompt_ids(tok: Any, body: CompletionRequest) -> tuple[list[str | None], list[list[int]]]:
    """The prompts of a completion request (a string, token ids, or a list of either): their texts
    (None for token ids) and token ids."""
    p = body.prompt
    if isinstance(p, str):
        raw: list[str | list[int]] = [p]
    elif p and all(isinstance(t, int) for t in p):
        raw = [p]  # type: ignore[list-item]
    else:
        raw = list(p)  # type: ignore[arg-type]
    if not raw:
        raise InvalidRequest("prompt must not be empty", "prompt")
    texts = [r if isinstance(r, str) else None for r in raw]
    return texts, [tok.encode(r) if isinstance(r, str) else list(r) for r in raw]


def chat_prompt_ids(tok: Any, body: ChatCompletionRequest) -> list[int]:
    """The chat request's messages through the model's chat template, as token ids."""
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    return tok.encode_chat(messages, body.add_generation_prompt)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    engine, served = _state(request)
    _check_model(body.model, served)
    tok = engine.engine.tokenizer
    texts, prompts = completion_prompt_ids(tok, body)
    params = []
    for ids in prompts:
        if not ids:
            raise InvalidRequest("prompt must not be empty", "prompt")
        params.append(body.sampling_params(_resolve_max_tokens(engine, len(ids), body.max_tokens), body.logprobs))
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    n = body.n
    base = {"id": rid, "object": "text_completion", "created": created, "model": served}
    stream = _run(engine, prompts, params, texts)
    if body.stream:
        first = await _first(stream)  # errors before the first token become HTTP errors
        sse = _completion_sse(first, stream, base, body, prompts, n, tok, request.state.usage)
        return StreamingResponse(sse, media_type="text/event-stream")
    merged = await _gather(stream, len(prompts))
    result = []
    for i, out in enumerate(merged):
        for c in out.outputs:
            text = (texts[i] or "") + c.text if body.echo else c.text
            lp = _completion_logprobs(c.logprobs or [], tok) if body.logprobs is not None else None
            result.append({"index": i * n + c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
    usage_out = sum(len(c.token_ids) for out in merged for c in out.outputs)
    timing = _timing(merged[-1].metrics)
    prompt_tokens = sum(len(ids) for ids in prompts)
    request.state.usage.update(prompt_tokens=prompt_tokens, completion_tokens=usage_out)
    cached = sum(out.num_cached_tokens for out in merged)
    return {**base, "choices": result, "metrics": timing, "usage": _usage(prompt_tokens, usage_out, cached)}


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object; cached_tokens: prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _completion_logprobs(lps: list[Any], tok: Any) -> dict[str, Any]:
    return {
        "tokens": [tok.decode([lp.token_id], skip_special_tokens=False) for lp in lps],
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{tok.decode([t], skip_special_tokens=False): v for t, v in lp.top.items()} for lp in lps],
        "text_offset": [],
    }


async def _first(stream: AsyncIterator[tuple[int, RequestOutput]]) -> tuple[int, RequestOutput] | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


async def _chain(
    first: tuple[int, RequestOutput] | None, stream: AsyncIterator[tuple[int, RequestOutput]]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The stream again, with its already-awaited first item put back in front."""
    if first is not None:
        yield first
    async for x in stream:
        yield x


async def _completion_sse(first: Any, stream: AsyncIterator[tuple[int, RequestOutput]], base: dict[str, Any],
                          body: CompletionRequest, prompts: list[list[int]], n: int, tok: Any,
                          usage: dict[str, int]) -> AsyncIterator[str]:
    completion_tokens = 0
    usage["prompt_tokens"] = sum(len(p) for p in prompts)
    cached: dict[int, int] = {}  # prompt index -> its cached tokens

    try:
        async for i, out in _chain(first, stream):
            cached[i] = out.num_cached_tokens
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                usage["completion_tokens"] = completion_tokens
                lp = _completion_logprobs(c.logprobs, tok) if body.logprobs is not None and c.logprobs else None
                piece = {**base, "choices": [{"index": i * n + c.index, "text": c.text, "logprobs": lp,
                                              "finish_reason": c.finish_reason}]}
                if out.finished:  # the request's timing rides on its last chunk
                    piece["metrics"] = _timing(out.metrics)
                yield _sse(piece)
        if body.stream_options and body.stream_options.include_usage:
            pt = sum(len(p) for p in prompts)
            yield _sse({**base, "choices": [], "usage": _usage(pt, completion_tokens, sum(cached.values()))})
    except Exception as e:  # noqa: BLE001 - a stream that has started ends with an error event
        yield _sse(json.loads(error_response(e).body))
    yield "data: [DONE]\n\n"


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    engine, served = _state(request)
    _check_model(body.model, served)
    tok = engine.engine.tokenizer
    ids = chat_prompt_ids(tok, body)
    asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    top = body.top_logprobs if body.logprobs else None
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs to be true", "top_logprobs")
    params = body.sampling_params(_resolve_max_tokens(engine, len(ids), asked), (top or 0) if body.logprobs else None)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    base = {"id": rid, "created": created, "model": served}
    stream = _run(engine, [ids], [params], [None])
    if body.stream:
        first = await _first(stream)
        sse = _chat_sse(first, stream, base, body, len(ids), tok, request.state.usage)
        return StreamingResponse(sse, media_type="text/event-stream")
    (out,) = await _gather(stream, 1)
    result = []
    for c in out.outputs:
        lp = {"content": _chat_logprobs(c.logprobs or [], tok)} if body.logprobs else None
        result.append({"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": lp,
                       "finish_reason": c.finish_reason})
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    request.state.usage.update(prompt_tokens=len(ids), completion_tokens=completion_tokens)
    timing = _timing(out.metrics)
    return {**base, "object": "chat.completion", "choices": result, "metrics": timing,
            "usage": _usage(len(ids), completion_tokens, out.num_cached_tokens)}


def _chat_logprobs(lps: list[Any], tok: Any) -> list[dict[str, Any]]:
    def entry(t: int, v: float) -> dict[str, Any]:
        s = tok.decode([t], skip_special_tokens=False)
        return {"token": s, "logprob": v, "bytes": list(s.encode())}

    return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top.items()]} for lp in lps]


async def _chat_sse(first: Any, stream: AsyncIterator[tuple[int, RequestOutput]], base: dict[str, Any],
                    body: ChatCompletionRequest, prompt_tokens: int, tok: Any,
                    usage: dict[str, int]) -> AsyncIterator[str]:
    chunk = {**base, "object": "chat.completion.chunk"}
    completion_tokens = cached = 0
    usage["prompt_tokens"] = prompt_tokens
    for i in range(body.n):
        yield _sse({**chunk, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]})

    try:
        async for _, out in _chain(first, stream):
            cached = out.num_cached_tokens
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                usage["completion_tokens"] = completion_tokens
                lp = {"content": _chat_logprobs(c.logprobs, tok)} if body.logprobs and c.logprobs else None
                delta = {"content": c.text} if c.text or not c.finish_reason else {}
                piece = {**chunk, "choices": [{"index": c.index, "delta": delta, "logprobs": lp,
                                               "finish_reason": c.finish_reason}]}
                if out.finished:
                    piece["metrics"] = _timing(out.metrics)
                yield _sse(piece)
        if body.stream_options and body.stream_options.include_usage:
            yield _sse({**chunk, "choices": [], "usage": _usage(prompt_tokens, completion_tokens, cached)})
    except Exception as e:  # noqa: BLE001
        yield _sse(json.loads(error_response(e).body))
    yield "data: [DONE]\n\n"

