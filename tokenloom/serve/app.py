"""The FastAPI application: routes, API-key check, error mapping, health."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from tokenloom.engine.async_engine import AsyncLLMEngine
from tokenloom.errors import TokenloomError
from tokenloom.serve.errors import Unauthorized, error_body, error_response
from tokenloom.serve.openai_api import router as openai_router

OPEN_PATHS = frozenset({"/health", "/docs", "/openapi.json"})


def build_app(engine: AsyncLLMEngine, model_name: str, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="tokenloom", version="0.1.0")
    app.state.engine = engine
    app.state.model_name = model_name
    app.include_router(openai_router)

    @app.middleware("http")
    async def check_api_key(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if api_key is not None and request.url.path not in OPEN_PATHS:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return error_response(Unauthorized("missing or wrong API key (Authorization: Bearer ...)"))
        return await call_next(request)

    @app.exception_handler(TokenloomError)
    async def tokenloom_error(_: Request, exc: TokenloomError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def bad_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI says 422; the OpenAI API says 400 with the offending field in `param`.
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        msg = f"{param or 'body'}: {first.get('msg', 'invalid request body')}"
        return JSONResponse(error_body(msg, "invalid_request_error", param, 400), status_code=400)

    @app.get("/health")
    async def health() -> Response:
        ok = engine.is_alive
        return JSONResponse({"status": "ok" if ok else "dead"}, status_code=200 if ok else 503)

    return app
