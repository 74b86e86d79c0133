"""The served OpenAPI document, made to say what the server answers.

FastAPI documents a 422 `HTTPValidationError` for every route with a body; tokenloom answers a bad body with
400 in the OpenAI error shape (`{"error": {"message", "type", "param", "code"}}`, or Ollama's `{"error": str}`
on /api/*). This rewrites every operation's responses from the routes' real behaviour: the error codes each
route can answer with their body schema, and the streaming media types beside JSON. The adversarial suite
(tests/test_fuzz_api.py) checks the server against this document.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

OPENAI_ERROR: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "integer", "null"]},
        },
    }},
}
OLLAMA_ERROR: dict[str, Any] = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}

# Why each status happens; which of them a route can answer is decided in `_codes`.
REASONS = {
    "400": "invalid request: a field of the wrong type or out of range, named in `param`",
    "401": "missing or wrong API key (only when the server runs with --api-key)",
    "403": "this server's role does not serve the route",
    "404": "the model named in the request is not served here",
    "413": "the request body is larger than --max-request-bytes",
    "429": "the server's queue is full (--max-waiting); retry after Retry-After seconds",
    "502": "the KV transfer to the decode worker failed",
    "503": "the engine is not running",
}
GENERATE = {"/v1/completions", "/v1/chat/completions", "/api/generate", "/api/chat"}
STREAM_TYPES = {"/v1/completions": "text/event-stream", "/v1/chat/completions": "text/event-stream",
                "/api/generate": "application/x-ndjson", "/api/chat": "application/x-ndjson"}


def _codes(path: str, has_body: bool, open_paths: frozenset[str]) -> list[str]:
    codes = [] if path in open_paths else ["401"]
    if has_body:
        codes += ["400", "413"]
    if path in GENERATE or path in ("/api/show", "/tokenize", "/detokenize"):  # a "model" that is not served
        codes.append("404")
    if path in GENERATE or path == "/internal/kv/prefill":
        codes += ["429", "503"]
    if path == "/internal/kv/prefill":
        codes += ["403", "502"]
    if path == "/health":
        codes.append("503")
    return codes


def build_openapi(app: FastAPI, open_paths: frozenset[str]) -> dict[str, Any]:
    """`open_paths`: the routes served without the API key (no 401)."""
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    components["OpenAIError"] = OPENAI_ERROR
    components["OllamaError"] = OLLAMA_ERROR
    for path, operations in schema["paths"].items():
        ref = {"$ref": "#/components/schemas/" + ("OllamaError" if path.startswith("/api/") else "OpenAIError")}
        for op in operations.values():
            responses: dict[str, Any] = op.setdefault("responses", {})
            responses.pop("422", None)
            for code in _codes(path, "requestBody" in op, open_paths):
                responses[code] = {"description": REASONS[code], "content": {"application/json": {"schema": ref}}}
            if path in STREAM_TYPES:  # "stream": true answers with a stream instead of one JSON object
                ok = responses.setdefault("200", {"description": "Successful Response"})
                ok.setdefault("content", {})[STREAM_TYPES[path]] = {"schema": {"type": "string"}}
            if path == "/metrics":
                responses["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
    return schema


def install_openapi(app: FastAPI, open_paths: frozenset[str]) -> None:
    """Serve `build_openapi(app, open_paths)` at /openapi.json, computed once on first use."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app, open_paths)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
