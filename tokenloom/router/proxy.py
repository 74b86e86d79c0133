"""Forwarding one request: pick a worker, try again elsewhere until a response starts, then pass its body
on chunk by chunk.

A try fails, and the request goes to another healthy worker (at most `max_retries` more), when the worker
refuses the connection, times out, drops the connection before its first body byte, answers 5xx, or
answers 429 (its queue is full). Nothing has reached the client by then, so a retry is invisible to it.
Other answers (2xx, 4xx) are passed on as they are. A stream that breaks after its first bytes were
sent ends with an error event (replies.stream_error), never a hang: every read has a timeout.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import anyio
import httpx
from fastapi import Request, Response
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenloom.errors import AllWorkersBusy, NoHealthyWorker
from tokenloom.router import metrics as m
from tokenloom.router.config import RouterConfig
from tokenloom.router.disagg import PD_ENDPOINTS, PrefillStage
from tokenloom.router.metrics import RouterMetrics
from tokenloom.router.policies import Policy
from tokenloom.router.prefix import RoutingKey, prompt_text, routing_key
from tokenloom.router.replies import NDJSON, SSE, error_reply, stream_error
from tokenloom.router.workers import Worker, WorkerPool
from tokenloom.serve.errors import REQUEST_FAILED_HEADER

# Streamed media types and the delimiter after which an event (SSE) or a line (NDJSON) is whole.
_STREAMS = {SSE: b"\n\n", NDJSON: b"\n"}
# Request headers that describe the client's connection to the router, not the router's to the worker.
_HOP_BY_HOP = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer",
                         "upgrade", "proxy-authorization", "proxy-connection", "accept-encoding"})
# Worker response headers passed back (the rest describe the worker's connection or are set anew).
_PASS_BACK = ("content-type", "retry-after", "x-request-id", "cache-control")


@dataclass(frozen=True)
class Failure:
    kind: str  # one of metrics' error kinds
    message: str
    retry_after: str | None = None


class ProxiedStream(StreamingResponse):
    """A StreamingResponse that always closes its relay and runs `on_close` (which releases the worker and
    closes its response), also when the client hangs up mid-stream (Starlette then just stops iterating)
    or before the relay ever started (a generator that never ran has no `finally` to run)."""

    def __init__(self, relay: AsyncGenerator[bytes, None], on_close: Callable[[], Awaitable[None]], status_code: int,
                 headers: dict[str, str], media_type: str) -> None:
        super().__init__(relay, status_code=status_code, headers=headers, media_type=media_type)
        self._relay = relay
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):  # a client that went away cancels this task's scope
                await self._relay.aclose()
                await self._on_close()


class Proxy:
    def __init__(self, config: RouterConfig, pool: WorkerPool, policy: Policy, metrics: RouterMetrics,
                 client: httpx.AsyncClient, prefill: PrefillStage | None = None) -> None:
        self.config = config
        self.pool = pool  # the workers that answer clients (decode workers, with prefill workers set up)
        self.policy = policy
        self.metrics = metrics
        self.client = client
        self.prefill = prefill  # disaggregated prefill/decode, when the router has prefill workers

    async def forward(self, request: Request) -> Response:
        body = await request.body()
        key = (routing_key(prompt_text(body), self.config.prefix_chunk_chars, self.config.prefix_max_chunks)
               if self.policy.uses_key else ())
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        # The worker logs the same id as the router, and echoes it back to the client.
        headers.setdefault("x-request-id", uuid.uuid4().hex[:16])
        headers["accept-encoding"] = "identity"  # bytes pass through as they are
        split = self.prefill is not None and request.method == "POST" and request.url.path in PD_ENDPOINTS
        tried: set[str] = set()
        failures: list[Failure] = []
        previous: Worker | None = None
        for _ in range(self.config.max_retries + 1):
            candidates = self.pool.available(tried)
            if not candidates:
                break
            if previous is not None:
                self.metrics.retries.labels(previous.url).inc()
            worker = self.policy.choose(candidates, key)
            tried.add(worker.url)
            outcome = await self._try(worker, request.method, path, body, headers, split, key)
            if isinstance(outcome, Response):
                return outcome
            failures.append(outcome)
            previous = worker
        return self._give_up(request.url.path, failures)

    def _give_up(self, path: str, failures: list[Failure]) -> Response:
        full = [f for f in failures if f.kind == m.FULL]
        if full:
            # Only full (or failing) workers are left: the client should come back shortly.
            retry_after = max((f.retry_after for f in full if f.retry_after and f.retry_after.isdigit()),
                              key=int, default="1")
            return error_reply(path, AllWorkersBusy(f"all {len(full)} workers tried are full; retry later"), retry_after)
        if failures:
            detail = "; ".join(f.message for f in failures)
            return error_reply(path, NoHealthyWorker(f"no worker could take the request ({detail})"))
        return error_reply(path, NoHealthyWorker("no healthy worker"))

    async def _try(self, worker: Worker, method: str, path: str, body: bytes,
                   headers: dict[str, str], split: bool, key: RoutingKey) -> Response | Failure:
        self.pool.acquire(worker)
        handed_off = False
        try:
            if split and self.prefill is not None:
                # Whatever the outcome, the decode worker answers: a failed prefill only costs it the prompt.
                await self.prefill.run(path, body, worker, headers, key)
            outcome = await self._send(worker, method, path, body, headers, time.monotonic())
            handed_off = isinstance(outcome, ProxiedStream)  # the stream releases the worker when it ends
            return outcome
        finally:
            if not handed_off:
                self.pool.release(worker)

    async def _send(self, worker: Worker, method: str, path: str, body: bytes, headers: dict[str, str],
                    start: float) -> Response | Failure:
        url = worker.url
        try:
            resp = await self.client.send(self.client.build_request(method, url + path, content=body, headers=headers),
                                          stream=True)
        except httpx.HTTPError as e:
            return self._transport_failure(worker, e)
        try:
            status = resp.status_code
            own_fault = resp.headers.get(REQUEST_FAILED_HEADER) == "1"  # the request failed, the worker serves on
            if (status == 429 or status >= 500) and not own_fault:
                await _drain(resp)
                self.metrics.requests.labels(url, str(status)).inc()
                if status == 429:
                    self.metrics.errors.labels(url, m.FULL).inc()
                    return Failure(m.FULL, f"{url} is full (429)", resp.headers.get("retry-after"))
                self.metrics.errors.labels(url, m.HTTP_5XX).inc()
                if status == 503:  # the worker's engine is dead, or it is shutting down
                    self.pool.mark_down(worker, "answered 503")
                else:
                    self.pool.mark_failure(worker, f"answered {status}")
                return Failure(m.HTTP_5XX, f"{url} answered {status}")
            media_type = resp.headers.get("content-type", "").split(";")[0].strip()
            out_headers = {k: resp.headers[k] for k in _PASS_BACK if k in resp.headers}
            if media_type not in _STREAMS:
                content = await resp.aread()  # a whole JSON answer: small, and retryable until read
                self._finished(worker, status, start)
                self.metrics.ttfb.labels(url).observe(time.monotonic() - start)
                return Response(content, status_code=status, headers=out_headers)
            chunks = resp.aiter_bytes()
            # The first chunk is read before anything is sent: a worker that dies right after its
            # headers still leaves the request retryable.
            first = await anext(chunks, b"")
            self.metrics.ttfb.labels(url).observe(time.monotonic() - start)
        except httpx.HTTPError as e:
            await resp.aclose()
            return self._transport_failure(worker, e)
        except BaseException:
            await resp.aclose()
            raise
        self.pool.succeeded(worker)
        closed = False

        async def close() -> None:
            nonlocal closed
            if closed:
                return
            closed = True
            # Bookkeeping first: under a cancelled scope the await below may not get to run.
            self.pool.release(worker)
            self.metrics.requests.labels(url, str(status)).inc()
            self.metrics.latency.labels(url).observe(time.monotonic() - start)
            with anyio.CancelScope(shield=True):
                await resp.aclose()

        relay = self._relay(worker, chunks, first, media_type, close)
        return ProxiedStream(relay, close, status, out_headers, media_type)

    def _transport_failure(self, worker: Worker, e: httpx.HTTPError) -> Failure:
        message = f"{worker.url}: {type(e).__name__}: {e}".rstrip(": ")
        if isinstance(e, httpx.ConnectError | httpx.ConnectTimeout):
            # Nothing listens there (or the host is unreachable): take it out until /health answers.
            self.metrics.errors.labels(worker.url, m.CONNECT).inc()
            self.pool.mark_down(worker, message)
            return Failure(m.CONNECT, message)
        kind = m.TIMEOUT if isinstance(e, httpx.TimeoutException) else m.DISCONNECT
        self.metrics.errors.labels(worker.url, kind).inc()
        self.pool.mark_failure(worker, message)
        return Failure(kind, message)

    def _finished(self, worker: Worker, status: int, start: float) -> None:
        self.pool.succeeded(worker)
        self.metrics.requests.labels(worker.url, str(status)).inc()
        self.metrics.latency.labels(worker.url).observe(time.monotonic() - start)

    async def _relay(self, worker: Worker, chunks: AsyncIterator[bytes], first: bytes, media_type: str,
                     close: Callable[[], Awaitable[None]]) -> AsyncGenerator[bytes, None]:
        """The worker's stream, passed on as it arrives; only whole events / lines go out, so that an
        error event after a break is never glued to half an event."""
        delimiter = _STREAMS[media_type]
        pending = first
        try:
            try:
                while True:
                    cut = pending.rfind(delimiter)
                    if cut >= 0:
                        yield pending[:cut + len(delimiter)]
                        pending = pending[cut + len(delimiter):]
                    chunk = await anext(chunks, None)
                    if chunk is None:
                        break
                    pending += chunk
                if pending:
                    yield pending
            except httpx.HTTPError as e:
                self.metrics.errors.labels(worker.url, m.STREAM_BROKEN).inc()
                self.pool.mark_failure(worker, f"stream broke off: {type(e).__name__}")
                yield stream_error(media_type, f"the worker serving this request failed mid-stream "
                                               f"({type(e).__name__}); the response is incomplete")
        finally:
            await close()


async def _drain(resp: httpx.Response) -> None:
    """Read and close a response whose body is not passed on (keeps the connection reusable)."""
    try:
        await resp.aread()
    except httpx.HTTPError:
        pass
    finally:
        await resp.aclose()
