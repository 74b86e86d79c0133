"""Running an ASGI app (a worker's or the router's) under uvicorn until SIGTERM / SIGINT, with a graceful
drain and exit status 0."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Callable, Iterator

import uvicorn
from fastapi import FastAPI


# After `graceful_timeout`, how long the streams the engine has just ended get to write their error event
# and [DONE] before uvicorn cancels whatever still runs.
FAREWELL_S = 2.0


class _Server(uvicorn.Server):
    """uvicorn, but at `graceful_timeout` a worker first stops its engine: every in-flight request fails
    with EngineDead, which its stream turns into an error event + [DONE] (SSE) or an error line (NDJSON)
    and a non-streaming call into a 503. uvicorn's own expiry only cancels the tasks: a cancelled stream is
    cut short with neither. uvicorn's cancellation stays, FAREWELL_S later, as the backstop."""

    def __init__(self, config: uvicorn.Config, graceful_timeout: float, on_expiry: Callable[[], None]) -> None:
        super().__init__(config)
        self.graceful_timeout = graceful_timeout
        self.on_expiry = on_expiry

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self.graceful_timeout, self._expire)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _expire(self) -> None:
        if self.server_state.tasks:
            logging.getLogger("tokenloom.serve").warning(
                "graceful timeout: aborting %d in-flight request(s)", len(self.server_state.tasks))
        self.on_expiry()


def build_server(app: FastAPI, host: str, port: int, graceful_timeout: float, verbose: bool = False) -> uvicorn.Server:
    """uvicorn for `app`; a worker app (one with `app.state.engine`) gets `_Server`'s clean stream ends."""
    engine = getattr(app.state, "engine", None)
    farewell = FAREWELL_S if engine is not None else 0.0
    # loop/http named, not "auto": with uvloop or httptools installed (Ray Serve brings both) "auto" would
    # switch the event loop policy of the whole process; the stdlib loop and h11 are what we test and ship.
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=graceful_timeout + farewell,
                            log_level="info" if verbose else "warning", loop="asyncio", http="h11")
    if engine is None:
        return uvicorn.Server(config)
    # shutdown() only queues the stop for the engine thread (join(0)): the event loop must not block.
    return _Server(config, graceful_timeout, lambda: engine.shutdown(timeout=0))


def run_app(app: FastAPI, host: str, port: int, graceful_timeout: float, verbose: bool = False) -> None:
    server = build_server(app, host, port, graceful_timeout, verbose)

    @contextlib.contextmanager
    def graceful_signals() -> Iterator[None]:
        # SIGTERM / SIGINT: stop accepting, let in-flight responses finish (requests past
        # `graceful_timeout` are aborted and end with an error, see _Server), then return. uvicorn's own
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
