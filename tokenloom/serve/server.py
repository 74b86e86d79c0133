"""Running an ASGI app (a worker's or the router's) under uvicorn until SIGTERM / SIGINT, with a graceful
drain and exit status 0."""

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
        # SIGTERM / SIGINT: stop accepting, let in-flight responses finish (streams past
        # `graceful_timeout` are cancelled, which aborts their requests), then return. uvicorn's own
        # handler would re-raise the signal after shutdown, ending the process before the caller's
        # clean-up (a KV receiver, `tokenloom cluster`'s workers) and with status -15.
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
