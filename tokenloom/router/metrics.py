"""The router's own Prometheus metrics, in their own registry, named `tokenloom:router_*` like the
workers' `tokenloom:*` and labelled with the worker's URL (`worker`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tokenloom.router.workers import Worker

# From a fast GPU worker's first byte (ms) to a long CPU generation (minutes).
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)

# errors_total's `kind` label.
CONNECT, TIMEOUT, DISCONNECT, HTTP_5XX, FULL, STREAM_BROKEN, PREFILL = (
    "connect", "timeout", "disconnect", "http_5xx", "full", "stream_broken", "prefill")


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.requests = Counter("tokenloom:router_requests", "Responses of workers passed on, by worker and HTTP status",
                                ["worker", "code"], registry=r)
        self.errors = Counter("tokenloom:router_errors", "Failed tries of a worker, by kind (connect, timeout, "
                              "disconnect, http_5xx, full, stream_broken, prefill)", ["worker", "kind"], registry=r)
        self.retries = Counter("tokenloom:router_retries", "Requests sent on to another worker after this one failed",
                               ["worker"], registry=r)
        # What clients got, the router's own 429 (every worker full) and 503 (no worker could take it) included:
        # the denominator of an error rate. A stream that broke after its 200 also counts in errors{stream_broken}.
        self.responses = Counter("tokenloom:router_responses", "Responses to clients, by HTTP status", ["code"],
                                 registry=r)
        self.up = Gauge("tokenloom:router_worker_up", "1 while the worker is healthy and gets requests", ["worker"],
                        registry=r)
        self.outstanding = Gauge("tokenloom:router_outstanding_requests", "Requests in flight at the worker",
                                 ["worker"], registry=r)
        self.latency = Histogram("tokenloom:router_request_latency_seconds", "Router-measured latency to the last "
                                 "byte of a worker's response", ["worker"], buckets=_LATENCY, registry=r)
        self.ttfb = Histogram("tokenloom:router_time_to_first_byte_seconds", "Router-measured time to the first byte "
                              "of a worker's response body", ["worker"], buckets=_LATENCY, registry=r)

        # Disaggregated prefill/decode (router/disagg.py); `worker` is the prefill worker ("none": skipped).
        self.prefills = Counter("tokenloom:router_kv_prefills", "Prompts sent to a prefill worker to fill a decode "
                                "worker's KV cache, by outcome (ok, failed, rejected, skipped)", ["worker", "outcome"],
                                registry=r)
        self.prefill_seconds = Histogram("tokenloom:router_kv_prefill_seconds", "Prefill on the prefill worker plus "
                                         "the KV transfer to the decode worker", ["worker"], buckets=_LATENCY,
                                         registry=r)
        self.kv_bytes = Counter("tokenloom:router_kv_transfer_bytes", "KV block bytes prefill workers shipped to "
                                "decode workers", ["worker"], registry=r)

    def worker_changed(self, worker: Worker) -> None:
        self.up.labels(worker.url).set(1 if worker.healthy else 0)
        self.outstanding.labels(worker.url).set(worker.outstanding)
