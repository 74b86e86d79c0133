"""Prometheus metrics of the serving engine, all prefixed `tokenloom:` and labelled with the model name.

Recorded from the engine loop thread after every step (`ServingMetrics.on_step`): token counters and
gauges each step, latency histograms when a request finishes. Latencies are seconds.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tokenloom.engine.engine import LLMEngine
from tokenloom.outputs import RequestOutput

# Buckets spanning a fast GPU token (ms) to a long CPU prefill (minutes).
_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
            40.0, 80.0, 160.0, 640.0)
_TOKEN = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


class ServingMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r, lbl = self.registry, ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"tokenloom:{name}", doc, lbl, buckets=buckets, registry=r).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token", _LATENCY)
        self.tpot = hist("time_per_output_token_seconds", "Mean time per output token after the first", _TOKEN)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens", _TOKEN)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency", _LATENCY)
        self.queue = hist("request_queue_time_seconds", "Time from arrival to first scheduling", _LATENCY)
        self.prefill = hist("request_prefill_time_seconds", "Time spent computing the prompt", _LATENCY)
        self.decode = hist("request_decode_time_seconds", "Time spent producing tokens after the first", _LATENCY)
        self.prompt_tokens = Counter("tokenloom:prompt_tokens", "Prompt tokens of finished requests", lbl,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("tokenloom:generation_tokens", "Generated tokens", lbl,
                                         registry=r).labels(model_name)
        self.requests = Counter("tokenloom:request_success", "Finished requests by finish reason",
                                [*lbl, "finished_reason"], registry=r)
        self.preemptions = Counter("tokenloom:num_preemptions", "Preempted sequences", lbl, registry=r).labels(model_name)
        self.running = Gauge("tokenloom:num_requests_running", "Sequences running", lbl, registry=r).labels(model_name)
        self.waiting = Gauge("tokenloom:num_requests_waiting", "Sequences waiting", lbl, registry=r).labels(model_name)
        self.kv_usage = Gauge("tokenloom:kv_cache_usage_perc", "Fraction of KV blocks in use", lbl,
                              registry=r).labels(model_name)
        self.prefix_queries = Counter("tokenloom:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      lbl, registry=r).labels(model_name)
        self.prefix_hits = Counter("tokenloom:prefix_cache_hits", "Prompt tokens served from the prefix cache", lbl,
                                   registry=r).labels(model_name)
        self.spec_drafts = Counter("tokenloom:spec_decode_num_drafts", "Verification steps of speculating sequences",
                                   lbl, registry=r).labels(model_name)
        self.spec_draft_tokens = Counter("tokenloom:spec_decode_draft_tokens", "Draft tokens proposed and verified",
                                         lbl, registry=r).labels(model_name)
        self.spec_accepted = Counter("tokenloom:spec_decode_accepted_tokens", "Draft tokens accepted", lbl,
                                     registry=r).labels(model_name)
        self.spec_acceptance = Gauge("tokenloom:spec_decode_acceptance_rate", "Accepted / draft tokens since start",
                                     lbl, registry=r).labels(model_name)
        self.spec_mean_len = Gauge("tokenloom:spec_decode_mean_accepted_length",
                                   "Tokens emitted per verification step since start (1 + accepted / drafts)", lbl,
                                   registry=r).labels(model_name)
        self.model_name = model_name
        self._last_token: dict[str, float] = {}
        self._preemptions_seen = 0
        self._prefix_seen = (0, 0)  # (queries, hits) already counted
        self._spec_seen = (0, 0, 0)  # (drafts, draft tokens, accepted tokens) already counted

    def on_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        total = 0
        for out in outputs:
            new = sum(len(c.token_ids) for c in out.outputs)
            total += new
            last = self._last_token.get(out.request_id)
            if last is not None and new:
                self.itl.observe(now - last)
            self._last_token[out.request_id] = now
            if out.finished:
                self._finished(out)
        if total:  # one locked increment a step, not one a request
            self.generation_tokens.inc(total)
        self.update_gauges(engine)

    def update_gauges(self, engine: LLMEngine) -> None:
        sched = engine.scheduler
        self.running.set(sched.num_running)
        self.waiting.set(sched.num_waiting)
        self.kv_usage.set(engine.kv.usage)
        self.preemptions.inc(sched.num_preemptions - self._preemptions_seen)
        self._preemptions_seen = sched.num_preemptions
        pc = engine.kv.stats
        self.prefix_queries.inc(pc.queries - self._prefix_seen[0])
        self.prefix_hits.inc(pc.hits - self._prefix_seen[1])
        self._prefix_seen = (pc.queries, pc.hits)
        sd = engine.spec_stats
        self.spec_drafts.inc(sd.num_drafts - self._spec_seen[0])
        self.spec_draft_tokens.inc(sd.draft_tokens - self._spec_seen[1])
        self.spec_accepted.inc(sd.accepted_tokens - self._spec_seen[2])
        self._spec_seen = (sd.num_drafts, sd.draft_tokens, sd.accepted_tokens)
        self.spec_acceptance.set(sd.acceptance_rate)
        self.spec_mean_len.set(sd.mean_accepted_length)

    def _finished(self, out: RequestOutput) -> None:
        self._last_token.pop(out.request_id, None)
        reasons = {c.finish_reason for c in out.outputs if c.finish_reason} or {"stop"}
        for reason in reasons:
            self.requests.labels(self.model_name, reason).inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        m = out.metrics
        if m is None:
            return
        if m.time_to_first_token is not None:
            self.ttft.observe(m.time_to_first_token)
        if m.e2e_latency is not None:
            self.e2e.observe(m.e2e_latency)
        if m.queue_time is not None:
            self.queue.observe(m.queue_time)
        self.prefill.observe(m.prefill_time)
        self.decode.observe(m.decode_time)
        if m.e2e_latency is not None and m.time_to_first_token is not None and m.num_output_tokens > 1:
            self.tpot.observe((m.e2e_latency - m.time_to_first_token) / (m.num_output_tokens - 1))
