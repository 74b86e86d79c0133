"""Benchmark metric maths, with the definitions vLLM's `vllm bench serve` uses so figures compare.

Per request: TTFT = first token time - send time; E2EL = last byte time - send time;
TPOT = (E2EL - TTFT) / (output_tokens - 1), for requests with more than one output token;
ITL = the gaps between consecutive token-bearing chunks (all requests' gaps pooled).
Per run: request, output-token and total-token throughput over the benchmark's wall duration;
goodput = requests meeting every given SLO per second. Failed requests are counted, never dropped.
Percentiles are numpy's linear interpolation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 95, 99)


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds on the client's monotonic clock."""

    start: float
    input_tokens: int
    output_tokens: int = 0
    first_token: float | None = None  # arrival of the first chunk that carried text
    end: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of every text-bearing chunk
    success: bool = False
    error: str = ""
    concurrency: int | None = None  # the sweep point it belonged to
    server_prefill_s: float | None = None  # Ollama's prompt_eval_duration, when the server reports it
    server_decode_s: float | None = None  # Ollama's eval_duration
    session: int | None = None  # multi-turn workloads: which conversation ...
    turn: int | None = None  # ... and which call of it (0 = the first, cold one)
    text: str = ""  # the generated text (feeds the next turn; not written to the records file)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def e2el(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2el is None or self.output_tokens <= 1:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    def to_row(self) -> dict[str, Any]:
        row = asdict(self)
        row.pop("chunk_times")
        row.pop("text")
        row.update(ttft=self.ttft, tpot=self.tpot, e2el=self.e2el, itl_mean=_mean(self.itls))
        return row


def _mean(xs: Sequence[float]) -> float | None:
    return float(np.mean(xs)) if xs else None


def distribution(values: Sequence[float], prefix: str) -> dict[str, float | None]:
    """mean, median, p90, p95, p99 (and std) of `values`, keyed `{prefix}_{stat}`; None when empty."""
    out: dict[str, float | None] = {}
    arr = np.asarray(values, dtype=float)
    out[f"{prefix}_mean"] = float(arr.mean()) if arr.size else None
    out[f"{prefix}_std"] = float(arr.std()) if arr.size else None
    for p in PERCENTILES:
        name = "median" if p == 50 else f"p{p}"
        out[f"{prefix}_{name}"] = float(np.percentile(arr, p)) if arr.size else None
    return out


def summarize(
    records: Sequence[RequestRecord],
    duration: float,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    slo_e2el: float | None = None,
) -> dict[str, Any]:
    """The run's figures from its raw records; `duration` is the wall time of the measured requests."""
    ok = [r for r in records if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.input_tokens for r in ok)
    s: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else 0.0,
    }
    s.update(distribution([r.ttft for r in ok if r.ttft is not None], "ttft_s"))
    s.update(distribution([r.tpot for r in ok if r.tpot is not None], "tpot_s"))
    s.update(distribution([x for r in ok for x in r.itls], "itl_s"))
    s.update(distribution([r.e2el for r in ok if r.e2el is not None], "e2el_s"))
    if any(r.server_prefill_s is not None for r in ok):
        s.update(distribution([r.server_prefill_s for r in ok if r.server_prefill_s is not None], "server_prefill_s"))
        s.update(distribution([r.server_decode_s for r in ok if r.server_decode_s is not None], "server_decode_s"))
    if slo_ttft is not None or slo_tpot is not None or slo_e2el is not None:
        good = [r for r in ok if _meets(r, slo_ttft, slo_tpot, slo_e2el)]
        s["good_requests"] = len(good)
        s["goodput"] = len(good) / duration if duration > 0 else 0.0
    return s


def _meets(r: RequestRecord, ttft: float | None, tpot: float | None, e2el: float | None) -> bool:
    # A request with a single output token has no TPOT; it meets a TPOT SLO trivially, as in vLLM.
    return (
        (ttft is None or (r.ttft is not None and r.ttft <= ttft))
        and (tpot is None or r.tpot is None or r.tpot <= tpot)
        and (e2el is None or (r.e2el is not None and r.e2el <= e2el))
    )


@dataclass(frozen=True)
class SweepPoint:
    load: float  # concurrency (or request rate) of this run
    throughput: float  # output tokens/s
    latency: float  # the latency the knee watches, e.g. p95 end-to-end seconds


def knee(points: Sequence[SweepPoint], min_efficiency: float = 0.5) -> float | None:
    """The highest load up to which adding load still pays.

    Going from one sweep point to the next, efficiency = (relative throughput gain) / (relative latency
    increase). While it stays >= `min_efficiency` (say 0.5: throughput grows at least half as fast as
    latency), more users are worth it; the knee is the last load before the first step that falls below.
    A step whose latency does not grow counts as efficient. None for an empty sweep.
    """
    pts = sorted(points, key=lambda p: p.load)
    if not pts:
        return None
    best = pts[0].load
    for cur, eff in zip(pts[1:], step_efficiencies(pts)):
        if eff is not None and eff < min_efficiency:
            break
        best = cur.load
    return best


def step_efficiencies(points: Sequence[SweepPoint]) -> list[float | None]:
    """Per step from one sweep point to the next (by load): relative throughput gain / relative latency
    increase, None where latency did not grow (such a step always counts as efficient). What `knee` compares
    with its threshold: a knee decided by a step near it is a coin toss between two close sweeps."""
    pts = sorted(points, key=lambda p: p.load)
    out: list[float | None] = []
    for prev, cur in zip(pts, pts[1:]):
        d_lat = (cur.latency - prev.latency) / prev.latency if prev.latency > 0 else 0.0
        d_thr = (cur.throughput - prev.throughput) / prev.throughput if prev.throughput > 0 else 0.0
        out.append(d_thr / d_lat if d_lat > 0 else None)
    return out
