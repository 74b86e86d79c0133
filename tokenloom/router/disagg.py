"""Disaggregated prefill/decode at the router: before an OpenAI completion or chat request goes to its
decode worker, a prefill worker computes the prompt and ships the prompt's KV blocks to that decode
worker (POST /internal/kv/prefill, serve/kv_api.py; the bytes travel worker to worker over ZeroMQ,
disagg/transfer.py). The decode worker then finds them in its prefix cache and computes only the last,
partial block before it streams.

A prefill that fails (the prefill worker is down, slow, or the transfer breaks) costs only speed: the
decode worker computes the whole prompt itself, so the client's answer is the same either way. Other
endpoints (Ollama's, /tokenize, ...) go straight to a decode worker, which prefills them itself.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping

import httpx

from tokenloom.router import metrics as m
from tokenloom.router.metrics import RouterMetrics
from tokenloom.router.policies import Policy
from tokenloom.router.prefix import RoutingKey
from tokenloom.router.workers import Worker, WorkerPool

log = logging.getLogger("tokenloom.router")

PD_ENDPOINTS = frozenset({"/v1/completions", "/v1/chat/completions"})

# prefills_total's `outcome` label.
OK, FAILED, REJECTED, SKIPPED = "ok", "failed", "rejected", "skipped"


class PrefillStage:
    """Chooses a prefill worker by the router's policy (its own instance: with cache_aware, a shared prompt
    prefix goes back to the prefill worker whose prefix cache holds it) and has it fill a decode worker's
    cache."""

    def __init__(self, pool: WorkerPool, client: httpx.AsyncClient, metrics: RouterMetrics, timeout: float,
                 policy: Policy) -> None:
        self.pool = pool
        self.client = client
        self.metrics = metrics
        self.timeout = timeout  # seconds the KV transfer itself may take (the prefill worker's ZeroMQ send)
        self.policy = policy

    async def run(self, endpoint: str, body: bytes, decode: Worker, headers: Mapping[str, str],
                  key: RoutingKey = ()) -> str:
        """Prefill `body` (the client's request to `endpoint`) into `decode`'s cache; returns the outcome.
        `key`: the request's routing key (prefix.py), when the policy uses one."""
        candidates = self.pool.available()
        if decode.kv_address is None or not candidates:
            # A `--role both` decode worker has no receiver, or no prefill worker is up: decode prefills.
            self.metrics.prefills.labels("none", SKIPPED).inc()
            return SKIPPED
        try:
            request = json.loads(body)
        except ValueError:
            return SKIPPED  # the decode worker answers the malformed body with its own 400
        if not isinstance(request, dict):
            return SKIPPED
        worker = self.policy.choose(candidates, key)
        payload = {"endpoint": endpoint, "request": request, "kv_target": decode.kv_address, "timeout": self.timeout}
        auth = {k: v for k, v in headers.items() if k.lower() in ("authorization", "x-request-id")}
        self.pool.acquire(worker)
        start = time.monotonic()
        try:
            r = await self.client.post(worker.url + "/internal/kv/prefill", json=payload, headers=auth)
        except httpx.HTTPError as e:
            if isinstance(e, httpx.ConnectError | httpx.ConnectTimeout):
                self.pool.mark_down(worker, f"prefill: {type(e).__name__}")
            else:
                self.pool.mark_failure(worker, f"prefill: {type(e).__name__}")
            return self._failed(worker, decode, f"{type(e).__name__}: {e}")
        finally:
            self.pool.release(worker)
        if r.status_code == 200:
            self.pool.succeeded(worker)
            shipped = r.json()
            self.metrics.prefill_seconds.labels(worker.url).observe(time.monotonic() - start)
            self.metrics.kv_bytes.labels(worker.url).inc(shipped.get("bytes", 0))
            self.metrics.prefills.labels(worker.url, OK).inc()
            return OK
        if 400 <= r.status_code < 500 and r.status_code != 429:
            # The request itself is bad (or names another model): the decode worker will say so to the client.
            self.metrics.prefills.labels(worker.url, REJECTED).inc()
            return REJECTED
        if r.status_code == 503:
            self.pool.mark_down(worker, "prefill answered 503")
        return self._failed(worker, decode, f"answered {r.status_code}: {r.text[:200]}")

    def _failed(self, worker: Worker, decode: Worker, why: str) -> str:
        log.warning("prefill on %s for %s failed (%s); the decode worker computes the prompt", worker.url,
                    decode.url, why)
        self.metrics.prefills.labels(worker.url, FAILED).inc()
        self.metrics.errors.labels(worker.url, m.PREFILL).inc()
        return FAILED
