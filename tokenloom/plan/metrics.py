"""A simulation's figures, with the bench lab's definitions (tokenloom/bench/stats.py): simulated requests
become the bench's RequestRecords (send = arrival, a chunk per token), so TTFT/TPOT/E2E, throughput and
goodput mean the same thing in `plan simulate` as in `bench serve`. Added: queue lengths, running
sequences and KV usage per worker (sampled at every step), prefix-cache hits, preemptions, KV transfers."""

from __future__ import annotations

from typing import Any

import numpy as np

from tokenloom.bench.stats import RequestRecord, summarize
from tokenloom.plan.simulator import SimRecord, SimResult


def to_bench_record(rec: SimRecord) -> RequestRecord:
    done = rec.end is not None
    return RequestRecord(start=rec.request.arrival, input_tokens=rec.request.input_len,
                         output_tokens=len(rec.token_times), first_token=rec.first_token, end=rec.end,
                         chunk_times=list(rec.token_times), success=done,
                         error="" if done else "not finished", session=rec.request.session, turn=rec.request.turn)


def fleet_summary(result: SimResult, slo_ttft: float | None = None, slo_tpot: float | None = None) -> dict[str, Any]:
    s = summarize([to_bench_record(r) for r in result.records], result.duration, slo_ttft, slo_tpot)
    samples = [x for w in result.workers for x in w.samples]
    waiting = np.array([x[0] for x in samples] or [0])
    running = np.array([x[1] for x in samples] or [0])
    usage = np.array([x[2] for x in samples] or [0.0])
    prompt = sum(r.request.input_len for r in result.records)
    s.update({
        "workers": result.fleet.workers, "prefill_workers": result.fleet.prefill_workers,
        "queue_mean": float(waiting.mean()), "queue_max": int(waiting.max()),
        "running_mean": float(running.mean()), "running_max": int(running.max()),
        "kv_usage_mean": float(usage.mean()), "kv_usage_max": float(usage.max()),
        "prefix_hit_rate": sum(r.cached_tokens for r in result.records) / prompt if prompt else 0.0,
        "preemptions": sum(r.preemptions for r in result.records),
        "kv_transfer_s_mean": float(np.mean([r.kv_transfer_s for r in result.records])),
        "worker_busy": [w.busy_s / result.duration for w in result.workers],
        "steps": sum(w.steps for w in result.workers),
    })
    return s


def format_summary(s: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.1f}"

    lines = [f"requests: {s['completed']} completed, {s['failed']} unfinished; simulated {s['duration_s']:.2f} s",
             f"throughput: {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s"
             + (f", goodput {s['goodput']:.2f} req/s ({s['good_requests']} meet the SLOs)" if "goodput" in s else ""),
             "            p50      p95      p99   (ms)"]
    for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("E2E", "e2el_s")):
        lines.append(f"{name:<6} {ms(s[key + '_median']):>8} {ms(s[key + '_p95']):>8} {ms(s[key + '_p99']):>8}")
    lines.append(f"queue (waiting per worker) mean {s['queue_mean']:.1f}, max {s['queue_max']}; running mean "
                 f"{s['running_mean']:.1f}, max {s['running_max']}")
    lines.append(f"KV usage mean {s['kv_usage_mean']:.1%}, max {s['kv_usage_max']:.1%}; prefix hits "
                 f"{s['prefix_hit_rate']:.1%} of prompt tokens; preemptions {s['preemptions']}")
    lines.append("worker busy: " + ", ".join(f"{b:.0%}" for b in s["worker_busy"]))
    return "\n".join(lines)
