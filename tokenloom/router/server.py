"""Running an ASGI app under uvicorn until SIGTERM / SIGINT, with a graceful drain and exit status 0."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI


def run_app(app: FastAPI, host: str, port: int, graceful_timeout: float, verbose: bool = False) -> None:
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=graceful_timeout,
                                           log_level="info" if verbose else "warning"))

    @contextlib.contextmanager
    def graceful_signals() -> Iterator[None]:
        # uvicorn's own handler re-raises the signal after shutdown, which would end the process before
        # the caller's clean-up (`tokenloom cluster` stopping its workers) and with status -15.
        def stop(signum: int, frame: object) -> None:
            server.force_exit = server.should_exit  # a second signal skips the drain
            server.should_exit = True

        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    server.capture_signals = graceful_signals  # type: ignore[method-assign]
    server.run()
