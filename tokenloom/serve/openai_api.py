"""The OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions (JSON or SSE streams),
and vLLM's /tokenize and /detokenize (the benchmark lab counts prompt tokens with them)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from tokenloom.errors import InvalidRequest
from tokenloom.outputs import RequestMetrics, RequestOutput
from tokenloom.serve.chat_output import ChoiceOutput, tool_mode
from tokenloom.serve.errors import error_response
from tokenloom.serve.frontend import Frontend, Indexed, chain, first, gather
from tokenloom.serve.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

router = APIRouter()


def _frontend(request: Request) -> Frontend:
    return request.app.state.frontend


def _timing(m: RequestMetrics | None) -> dict[str, float | None] | None:
    if m is None:
        return None
    return {"queue_time": m.queue_time, "time_to_first_token": m.time_to_first_token,
            "prefill_time": m.prefill_time, "decode_time": m.decode_time, "e2e_latency": m.e2e_latency}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    name = _frontend(request).model_name
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "tokenloom"}]}


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    fe = _frontend(request)
    if body.model is not None:
        fe.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequest("give exactly one of prompt and messages", "prompt")
    if body.prompt is not None:
        ids = await fe.encode_async(body.prompt, body.add_special_tokens)
    else:
        ids = await fe.chat_ids_async(body.messages or [], body.add_generation_prompt, body.tools,
                                      body.chat_template_kwargs)
    return {"count": len(ids), "max_model_len": fe.max_model_len, "tokens": ids}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    fe = _frontend(request)
    if body.model is not None:
        fe.check_model(body.model)
    return {"prompt": await fe.detokenize_async(body.tokens)}


CLIENT_GONE = 499  # nginx's "client closed request": the status logged for a non-streaming call its client left


async def _disconnected(request: Request) -> None:
    """Returns once the client has hung up. The body is read by now, so the next ASGI message is the
    disconnect (as StreamingResponse listens for it). Not `request.is_disconnected()`: that only polls, with
    a zero-timeout receive (under the BaseHTTPMiddleware the app had until 2026-12-05 the poll even lost the
    message and never said True); this waits."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def gather_or_abort(request: Request, stream: AsyncGenerator[Indexed, None],
                          n_prompts: int) -> list[RequestOutput] | None:
    """`gather` for the non-streaming routes, raced against the client hanging up: if it leaves first,
    the stream is closed (which aborts its requests in the engine) and None is returned, for the caller
    to answer `client_gone()`. Without this a request runs to max_tokens for nobody."""
    task = asyncio.ensure_future(gather(stream, n_prompts))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        return task.result() if task.done() else None
    finally:
        for t in (task, gone):
            if not t.done():
                t.cancel()  # for `task`: thrown into the stream, whose generators close and abort
        await asyncio.wait({task, gone})
        for t in (task, gone):
            if not t.cancelled():
                t.exception()  # retrieved: raised above where it mattered
        await stream.aclose()


def client_gone() -> Response:
    return Response(status_code=CLIENT_GONE)


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    fe = _frontend(request)
    fe.check_model(body.model)
    served, tok = fe.model_name, fe.tokenizer
    texts, prompts = await fe.completion_prompts_async(body.prompt)
    params = [fe.completion_params(body, len(ids)) for ids in prompts]
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    n = body.n
    base = {"id": rid, "object": "text_completion", "created": created, "model": served}
    stream = fe.run(prompts, params, texts)
    if body.stream:
        head = await first(stream)  # errors before the first token become HTTP errors
        sse = _completion_sse(head, stream, base, body, prompts, n, tok, request.state.usage)
        return StreamingResponse(sse, media_type="text/event-stream")
    merged = await gather_or_abort(request, stream, len(prompts))
    if merged is None:
        return client_gone()
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


async def _completion_sse(head: Any, stream: AsyncIterator[tuple[int, RequestOutput]], base: dict[str, Any],
                          body: CompletionRequest, prompts: list[list[int]], n: int, tok: Any,
                          usage: dict[str, int]) -> AsyncIterator[str]:
    completion_tokens = 0
    usage["prompt_tokens"] = sum(len(p) for p in prompts)
    cached: dict[int, int] = {}  # prompt index -> its cached tokens

    try:
        async for i, out in chain(head, stream):
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
    fe = _frontend(request)
    fe.check_model(body.model)
    served, tok = fe.model_name, fe.tokenizer
    mode = tool_mode(body, fe.tool_parser)
    ids = await fe.chat_ids_async(body.messages, body.add_generation_prompt, body.tools, body.chat_template_kwargs,
                                  body.continue_final_message)
    reasoning = fe.reasoning_for(ids)
    params = fe.chat_params(body, len(ids), fe.chat_constraint(body, mode, reasoning))
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    base = {"id": rid, "created": created, "model": served}
    stream = fe.run([ids], [params])
    if body.stream:
        head = await first(stream)
        choices = [ChoiceOutput(mode, reasoning) for _ in range(body.n)]
        sse = _chat_sse(head, stream, base, body, len(ids), tok, request.state.usage, choices)
        return StreamingResponse(sse, media_type="text/event-stream")
    whole = await gather_or_abort(request, stream, 1)
    if whole is None:
        return client_gone()
    (out,) = whole
    result = []
    for c in out.outputs:
        lp = {"content": _chat_logprobs(c.logprobs or [], tok)} if body.logprobs else None
        message, finish = ChoiceOutput(mode, reasoning).message(c.text, c.finish_reason)
        result.append({"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish})
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    request.state.usage.update(prompt_tokens=len(ids), completion_tokens=completion_tokens)
    timing = _timing(out.metrics)
    return {**base, "object": "chat.completion", "choices": result, "metrics": timing,
            "usage": _usage(len(ids), completion_tokens, out.num_cached_tokens)}


def _extend(delta: dict[str, Any], more: dict[str, Any]) -> None:
    """Add `more`'s fields to a chat delta (text fields concatenated, tool-call pieces appended)."""
    for k, v in more.items():
        delta[k] = delta[k] + v if k in delta else v


def _chat_logprobs(lps: list[Any], tok: Any) -> list[dict[str, Any]]:
    def entry(t: int, v: float) -> dict[str, Any]:
        s = tok.decode([t], skip_special_tokens=False)
        return {"token": s, "logprob": v, "bytes": list(s.encode())}

    return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top.items()]} for lp in lps]


async def _chat_sse(head: Any, stream: AsyncIterator[tuple[int, RequestOutput]], base: dict[str, Any],
                    body: ChatCompletionRequest, prompt_tokens: int, tok: Any,
                    usage: dict[str, int], choices: list[ChoiceOutput]) -> AsyncIterator[str]:
    chunk = {**base, "object": "chat.completion.chunk"}
    completion_tokens = cached = 0
    usage["prompt_tokens"] = prompt_tokens
    for i in range(body.n):
        yield _sse({**chunk, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]})

    try:
        async for _, out in chain(head, stream):
            cached = out.num_cached_tokens
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                usage["completion_tokens"] = completion_tokens
                lp = {"content": _chat_logprobs(c.logprobs, tok)} if body.logprobs and c.logprobs else None
                delta = choices[c.index].feed(c.text)
                finish = None
                if c.finish_reason:
                    last, finish = choices[c.index].finish(c.finish_reason)
                    _extend(delta, last)
                if not delta and not finish and lp is None:
                    continue  # held back by a parser (a tag that may be starting); nothing to send yet
                piece = {**chunk, "choices": [{"index": c.index, "delta": delta, "logprobs": lp,
                                               "finish_reason": finish}]}
                if out.finished:
                    piece["metrics"] = _timing(out.metrics)
                yield _sse(piece)
        if body.stream_options and body.stream_options.include_usage:
            yield _sse({**chunk, "choices": [], "usage": _usage(prompt_tokens, completion_tokens, cached)})
    except Exception as e:  # noqa: BLE001
        yield _sse(json.loads(error_response(e).body))
    yield "data: [DONE]\n\n"

