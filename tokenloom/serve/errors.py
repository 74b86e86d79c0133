"""One table from tokenloom's errors to HTTP status codes, and the OpenAI-style error body."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from tokenloom.errors import ContextTooLong, EngineDead, InvalidRequest, Overloaded, RequestFailed, TokenloomError

REQUEST_FAILED_HEADER = "x-tokenloom-request-failed"  # on a 500 that is the request's own fault, not the server's

STATUS: list[tuple[type[Exception], int, str]] = [
    (ContextTooLong, 400, "invalid_request_error"),
    (InvalidRequest, 400, "invalid_request_error"),
    (Overloaded, 429, "rate_limit_exceeded"),
    (EngineDead, 503, "service_unavailable"),
]


class ModelNotFound(TokenloomError):
    def __init__(self, name: str) -> None:
        super().__init__(f"the model {name!r} does not exist")


class Unauthorized(TokenloomError):
    pass


def error_body(message: str, etype: str, param: str | None = None, code: str | int | None = None) -> dict[str, object]:
    # A message or field path may quote the client's own text, lone surrogates included (an unknown field
    # named "\ud800"): written as escapes, so the answer can always be encoded.
    return {"error": {"message": _printable(message), "type": etype,
                      "param": None if param is None else _printable(param), "code": code}}


def _printable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(exc: Exception) -> JSONResponse:
    if isinstance(exc, ModelNotFound):
        return JSONResponse(error_body(str(exc), "not_found_error", "model", "model_not_found"), status_code=404)
    if isinstance(exc, Unauthorized):
        return JSONResponse(error_body(str(exc), "authentication_error", None, "invalid_api_key"), status_code=401)
    for cls, status, etype in STATUS:
        if isinstance(exc, cls):
            headers = {"Retry-After": "1"} if status == 429 else None
            param = getattr(exc, "field", None)
            return JSONResponse(error_body(str(exc), etype, param, status), status_code=status, headers=headers)
    if isinstance(exc, RequestFailed):
        # This request's own failure inside the engine (the engine serves on): the header tells a router not
        # to count it against the worker.
        return JSONResponse(error_body(f"the request failed: {exc}", "request_failed", None, 500), status_code=500,
                            headers={REQUEST_FAILED_HEADER: "1"})
    return JSONResponse(error_body("internal error", "internal_error", None, 500), status_code=500)
