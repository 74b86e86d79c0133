"""Answers the router gives itself, in the worker's formats: OpenAI-style error bodies, or Ollama's
{"error": "..."} on /api/*; and the error event that ends a stream a worker broke off."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse

from tokenloom.serve.errors import error_body, error_response

SSE = "text/event-stream"
NDJSON = "application/x-ndjson"


def error_reply(path: str, exc: Exception, retry_after: str | None = None) -> JSONResponse:
    resp = error_response(exc)
    headers = {"Retry-After": retry_after or resp.headers.get("retry-after", "1")} if resp.status_code == 429 else None
    if path.startswith("/api/"):
        return JSONResponse({"error": str(exc)}, status_code=resp.status_code, headers=headers)
    return JSONResponse(json.loads(resp.body), status_code=resp.status_code, headers=headers)


def stream_error(media_type: str, message: str) -> bytes:
    """The last bytes of a stream that broke off: an SSE error event and [DONE], or an NDJSON error line."""
    if media_type == SSE:
        event = json.dumps(error_body(message, "upstream_error", None, 502))
        return f"data: {event}\n\ndata: [DONE]\n\n".encode()
    return (json.dumps({"error": message}) + "\n").encode()
