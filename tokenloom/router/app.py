"""The router's FastAPI app: the workers' OpenAI and Ollama endpoints, proxied; its own /health and /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenloom.router.config import RouterConfig
from tokenloom.router.discovery import Discovery, follow, parse_discovery, refresh
from tokenloom.router.disagg import PrefillStage
from tokenloom.router.metrics import RouterMetrics
from tokenloom.router.policies import make_policy
from tokenloom.router.proxy import Proxy
from tokenloom.router.replies import error_reply
from tokenloom.router.workers import WorkerPool
from tokenloom.serve.errors import Unauthorized

# Everything `tokenloom serve` answers besides /health and /metrics (serve/openai_api.py, serve/ollama_api.py).
PROXIED_ROUTES: tuple[tuple[str, str], ...] = (
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
    ("POST", "/tokenize"), ("POST", "/detokenize"),
    ("POST", "/api/generate"), ("POST", "/api/chat"), ("GET", "/api/tags"), ("POST", "/api/show"),
    ("GET", "/api/version"),
)


def build_router_app(config: RouterConfig, metrics: RouterMetrics | None = None,
                     discovery: Discovery | None = None, prefill_discovery: Discovery | None = None) -> FastAPI:
    """`discovery`: where the (decode) workers come from at run time; default: config.worker_discovery,
    else the fixed config.workers. `prefill_discovery`: the same for the prefill workers (split
    prefill/decode; default: the fixed config.prefill_workers)."""
    metrics = metrics or RouterMetrics()
    if discovery is None and config.worker_discovery is not None:
        discovery = parse_discovery(config.worker_discovery)
    pool = WorkerPool(config.workers, config.unhealthy_after, metrics.worker_changed)
    prefill_pool = WorkerPool(config.prefill_workers, config.unhealthy_after, metrics.worker_changed)
    for w in pool.workers + prefill_pool.workers:
        metrics.worker_changed(w)  # every worker has its series from the start, down until checked
    policy = make_policy(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        timeout = httpx.Timeout(connect=config.connect_timeout, read=config.read_timeout,
                                write=config.read_timeout, pool=None)
        # One client, one connection pool per worker, for every request and health check; no cap on
        # connections: each outstanding stream holds one, and the workers' own queues bound the load.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            prefill = (PrefillStage(prefill_pool, client, metrics, config.kv_transfer_timeout, make_policy(config))
                       if prefill_pool.workers or prefill_discovery is not None else None)
            app.state.proxy = Proxy(config, pool, policy, metrics, client, prefill)
            pools = (pool, prefill_pool)
            followed = [(p, d) for p, d in ((pool, discovery), (prefill_pool, prefill_discovery)) if d is not None]
            for p, d in followed:
                await refresh(p, d, client, config.health_timeout)
            await asyncio.gather(*(p.check_all(client, config.health_timeout) for p in pools))
            checks = [asyncio.create_task(p.run_health_checks(client, config.health_interval, config.health_timeout))
                      for p in pools]
            checks += [asyncio.create_task(follow(p, d, client, config.discovery_interval, config.health_timeout))
                       for p, d in followed]
            try:
                yield
            finally:
                for task in checks:
                    task.cancel()
                for task in checks:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task

    app = FastAPI(title="tokenloom router", version="0.1.0", lifespan=lifespan)
    app.state.config = config
    app.state.pool = pool
    app.state.prefill_pool = prefill_pool
    app.state.metrics = metrics
    app.state.policy = policy

    async def proxied(request: Request) -> Response:
        response = await _answer(request)
        metrics.responses.labels(str(response.status_code)).inc()
        return response

    async def _answer(request: Request) -> Response:
        if config.api_key is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {config.api_key}".encode()):
                return error_reply(request.url.path, Unauthorized("missing or wrong API key (Authorization: Bearer ...)"))
        proxy: Proxy = request.app.state.proxy
        return await proxy.forward(request)

    for method, path in PROXIED_ROUTES:
        app.add_api_route(path, proxied, methods=[method], name=f"{method} {path}", include_in_schema=False)

    @app.get("/health")
    async def health() -> Response:
        def listed(p: WorkerPool) -> list[dict[str, object]]:
            return [{"url": w.url, "healthy": w.healthy, "outstanding": w.outstanding} for w in p.workers]

        ok = any(w.healthy for w in pool.workers)  # prefill workers only speed things up
        body: dict[str, object] = {"status": "ok" if ok else "no healthy worker", "workers": listed(pool)}
        if prefill_pool.workers or prefill_discovery is not None:
            body["prefill_workers"] = listed(prefill_pool)
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
