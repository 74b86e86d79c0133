"""The FastAPI application: OpenAI and Ollama routes, API-key check, error mapping, health, metrics,
and one structured access-log line per request."""

from __future__ import annotations

import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import Callable

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenloom.config import Role
from tokenloom.engine.async_engine import AsyncLLMEngine
from tokenloom.errors import InvalidRequest, TokenloomError
from tokenloom.serve.errors import Unauthorized, error_body, error_response
from tokenloom.serve.frontend import Frontend
from tokenloom.serve.kv_api import router as kv_router
from tokenloom.serve.metrics import ServingMetrics
from tokenloom.serve.ollama_api import router as ollama_router
from tokenloom.serve.openapi import install_openapi
from tokenloom.serve.openai_api import router as openai_router

OPEN_PATHS = frozenset({"/health", "/metrics", "/docs", "/openapi.json"})
DEFAULT_MAX_REQUEST_BYTES = 8 << 20  # `tokenloom serve --max-request-bytes`
access_log = logging.getLogger("tokenloom.access")


class BodyTooLarge(StarletteHTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than the server's limit of {limit} bytes "
                              "(--max-request-bytes)")


class BodyLimit:
    """413 for a request body over `limit` bytes, never buffering it: answered at once from Content-Length,
    and for a chunked body raised from `receive` as soon as what was read passes the limit (the route's
    body read re-raises it as an HTTPException, which the app's handler answers in the route's error shape)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.limit <= 0:
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.limit:
            await _too_large(scope, self.limit)(scope, receive, send)
            return
        seen = 0
        started = False

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited, watch)
        except BodyTooLarge:  # read outside a route's own body parsing (no handler turned it into a response)
            if started:
                raise
            await _too_large(scope, self.limit)(scope, receive, send)


class OllamaBodiesAreJSON:
    """Ollama reads every /api/* body as JSON whatever its Content-Type, and its documented examples are
    `curl http://host/api/chat -d '{...}'` (sent as a form). Those bodies are declared JSON here, so they are
    parsed as Ollama parses them instead of failing validation."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and str(scope.get("path", "")).startswith("/api/"):
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


class AuthAndLog:
    """The API-key check (401 outside OPEN_PATHS) and one access-log line per request, written once the
    response (a whole SSE / NDJSON stream included) has been sent; every response gets `x-request-id`.
    Handlers count tokens into `request.state.usage`, which the line reports.

    A plain ASGI middleware, not `@app.middleware("http")`: Starlette's BaseHTTPMiddleware runs the route in
    a second task and hands every body chunk across a memory stream, two task switches per streamed token
    per request (docs/performance-notes.md, "Serving overhead")."""

    def __init__(self, app: ASGIApp, api_key: str | None,
                 fail: Callable[[Request, Exception], JSONResponse]) -> None:
        self.app, self.api_key, self.fail = app, api_key, fail

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        request = Request(scope)
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex[:16]
        # Handlers and their streams fill this in as tokens are counted; it is logged at the very end.
        request.state.usage = usage = {"prompt_tokens": 0, "completion_tokens": 0}
        status = 500  # what the client sees if the app fails before it starts a response
        rid_header = (b"x-request-id", rid.encode("latin-1"))

        async def tagged(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), rid_header]}
            await send(message)

        try:
            if self.api_key is not None and scope["path"] not in OPEN_PATHS:
                given = request.headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                    await self.fail(request, Unauthorized("missing or wrong API key (Authorization: Bearer ...)"))(
                        scope, receive, tagged)
                    return
            await self.app(scope, receive, tagged)
        finally:
            _log(rid, request, status, start, usage)


def _too_large(scope: Scope, limit: int) -> JSONResponse:
    exc = BodyTooLarge(limit)
    if str(scope.get("path", "")).startswith("/api/"):
        return JSONResponse({"error": exc.detail}, status_code=413)
    return JSONResponse(error_body(exc.detail, "request_too_large", None, 413), status_code=413)


def _ollama_style(request: Request) -> bool:
    return request.url.path.startswith("/api/")


def _to_ollama(resp: JSONResponse) -> JSONResponse:
    """Ollama clients expect {"error": "message"} with the same status code."""
    body = json.loads(resp.body)
    keep = {k: v for k, v in resp.headers.items() if k.lower() in ("retry-after", "allow")}
    return JSONResponse({"error": body["error"]["message"]}, status_code=resp.status_code, headers=keep)


def build_app(
    engine: AsyncLLMEngine, model_name: str, api_key: str | None = None, metrics: ServingMetrics | None = None,
    role: Role = "both", kv_address: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    tool_parser: str | None = None, reasoning_parser: str | None = None,
) -> FastAPI:
    """`role`: both (a whole server), prefill (also computes prompts for decode workers,
    /internal/kv/prefill) or decode (receives KV blocks at `kv_address`, which /health reports).
    `max_request_bytes`: larger request bodies get 413 (0: no limit). `tool_parser`, `reasoning_parser`:
    how the model writes tool calls and thinking (serve/tool_parsers.py, serve/reasoning.py)."""
    app = FastAPI(title="tokenloom", version="0.1.0")
    app.state.engine = engine
    app.state.model_name = model_name
    app.state.frontend = Frontend(engine, model_name, tool_parser, reasoning_parser)  # prompts, max_tokens and streams for every route
    app.state.metrics = metrics
    app.state.role = role
    app.include_router(openai_router)
    app.include_router(ollama_router)
    app.include_router(kv_router)
    install_openapi(app, OPEN_PATHS)  # documents the 400s (not 422s) and error bodies the routes answer
    # Added before AuthAndLog, so they run inside it: a 413 is logged, and an unauthorized client gets 401.
    app.add_middleware(BodyLimit, limit=max_request_bytes)
    app.add_middleware(OllamaBodiesAreJSON)

    def fail(request: Request, exc: Exception) -> JSONResponse:
        resp = error_response(exc)
        return _to_ollama(resp) if _ollama_style(request) else resp

    # Last added, so outermost: it sees (and logs) every answer, the 413s and 401s included.
    app.add_middleware(AuthAndLog, api_key=api_key, fail=fail)

    @app.exception_handler(TokenloomError)
    async def tokenloom_error(request: Request, exc: TokenloomError) -> JSONResponse:
        return fail(request, exc)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI says 422; the OpenAI API says 400 with the offending field in `param`.
        errs = exc.errors()
        # A value that fits no member of a union gets one error per member; the deepest one says most
        # (content.0.text: not a string, rather than content: not a string).
        first = max(errs, key=lambda e: len(_field_path(e.get("loc", ())))) if errs else {}
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, InvalidRequest):  # a body validator's own error names its field's whole path
            return fail(request, cause)
        if first.get("type") == "json_invalid":
            param, msg = None, f"the body is not valid JSON: {cause or 'decode error'}"
        else:
            param = ".".join(_field_path(first.get("loc", ()))) or None
            msg = f"{param or 'body'}: {first.get('msg', 'invalid request body')}"
            if first.get("type") == "extra_forbidden":  # nothing is ignored in silence (serve/protocol.py)
                msg = f"{param}: unknown or unsupported field (tokenloom does not implement it)"
            elif first.get("type") == "none_required":
                msg = f"{param} is not supported: only null is accepted"
        resp = JSONResponse(error_body(msg, "invalid_request_error", param, 400), status_code=400)
        return _to_ollama(resp) if _ollama_style(request) else resp

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # Starlette's own answers (unknown path 404, wrong method 405, an unreadable body 400: invalid UTF-8,
        # JSON nested too deep) in the same error shape as every other error, not {"detail": ...}.
        etype = {404: "not_found_error", 405: "method_not_allowed", 401: "authentication_error",
                 413: "request_too_large"}.get(exc.status_code, "invalid_request_error")
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404 and detail == "Not Found":
            detail = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            detail = f"method {request.method} is not allowed on {request.url.path}"
        resp = JSONResponse(error_body(detail, etype, None, exc.status_code), status_code=exc.status_code,
                            headers=exc.headers)
        return _to_ollama(resp) if _ollama_style(request) else resp

    @app.get("/health")
    async def health() -> Response:
        ok = engine.is_alive
        body: dict[str, str] = {"status": "ok" if ok else "dead", "role": role}
        if kv_address is not None:
            body["kv_address"] = kv_address
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        if metrics is None:
            return Response("", media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


# pydantic's location of an error inside a union names the member tried ("str", "list[TextPart]",
# "function-after[...]"): not part of the field's path.
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|dict|list|none|tuple|.*\[.*\])$")


def _field_path(loc: tuple[int | str, ...] | list[int | str]) -> list[str]:
    return [str(p) for p in loc if p != "body" and not (isinstance(p, str) and _UNION_MEMBER.match(p))]


def _log(rid: str, request: Request, status: int, start: float, usage: dict[str, int]) -> None:
    access_log.info(json.dumps({
        "request_id": rid, "method": request.method, "path": request.url.path, "status": status,
        "prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
        "latency_ms": round((time.monotonic() - start) * 1e3, 2),
        "client": request.client.host if request.client else None,
    }))
