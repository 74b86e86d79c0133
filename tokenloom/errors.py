"""The error hierarchy. The HTTP layer maps each class to one status code in one table.

Validation raises these, never ``assert``: a message always names the offending field or value.
"""

from __future__ import annotations


class TokenloomError(Exception):
    """Base class of every error tokenloom raises on purpose."""


class InvalidRequest(TokenloomError, ValueError):
    """A request (or a sampling parameter) is malformed. ``field`` names the culprit."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ContextTooLong(InvalidRequest):
    """Prompt (+ requested output) does not fit in ``max_model_len``."""


class Overloaded(TokenloomError):
    """Too many requests waiting; the caller should retry later."""


class EngineDead(TokenloomError):
    """The engine loop crashed or was shut down; no request can be served."""


class RequestFailed(TokenloomError):
    """Processing one request failed inside the engine (sampling, stop checks, detokenizing). That request
    ends with this error; the engine goes on serving the others."""


class ModelLoadError(TokenloomError):
    """A model folder or file could not be read (missing files, bad shapes, unknown tensor type)."""


class UnsupportedArchitecture(ModelLoadError):
    """The model's architecture has no implementation here. The message names it."""


class ConfigError(TokenloomError, ValueError):
    """An engine option (CLI flag / constructor argument) is out of range."""


class NoHealthyWorker(EngineDead):
    """The router has no healthy worker left to send a request to (or every try failed)."""


class AllWorkersBusy(Overloaded):
    """Every healthy worker answered 429 (queue full); the router answers 429 too."""
