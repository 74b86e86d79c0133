"""Benchmark maths on synthetic timelines with known answers."""

from __future__ import annotations

import pytest

from tokenloom.bench.stats import RequestRecord, SweepPoint, distribution, knee, summarize


def rec(start: float, first: float, gaps: list[float], inp: int = 10, ok: bool = True) -> RequestRecord:
    times = [first]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestRecord(start=start, input_tokens=inp, output_tokens=len(times), first_token=first,
                         end=times[-1], chunk_times=times, success=ok, error="" if ok else "boom")


def test_per_request_definitions() -> None:
    r = rec(start=1.0, first=1.5, gaps=[0.1, 0.1, 0.2])  # 4 tokens, last at 1.9
    assert r.ttft == pytest.approx(0.5)
    assert r.e2el == pytest.approx(0.9)
    assert r.tpot == pytest.approx((0.9 - 0.5) / 3)
    assert r.itls == pytest.approx([0.1, 0.1, 0.2])
    single = rec(start=0.0, first=0.3, gaps=[])
    assert single.tpot is None and single.itls == []


def test_summary_throughputs_percentiles_and_failures() -> None:
    records = [rec(0.0, 0.1 * (i + 1), [0.05] * 9) for i in range(10)]  # TTFT 0.1 .. 1.0, 10 tokens each
    records.append(RequestRecord(start=0.0, input_tokens=10, success=False, error="HTTP 500"))
    s = summarize(records, duration=2.0)
    assert s["completed"] == 10 and s["failed"] == 1
    assert s["total_output_tokens"] == 100 and s["total_input_tokens"] == 100
    assert s["request_throughput"] == pytest.approx(5.0)
    assert s["output_throughput"] == pytest.approx(50.0)
    assert s["total_token_throughput"] == pytest.approx(100.0)
    assert s["ttft_s_mean"] == pytest.approx(0.55)
    assert s["ttft_s_median"] == pytest.approx(0.55)
    assert s["ttft_s_p90"] == pytest.approx(0.91)  # linear interpolation between 0.9 and 1.0
    assert s["tpot_s_mean"] == pytest.approx(0.05)
    assert s["itl_s_p99"] == pytest.approx(0.05)
    assert s["e2el_s_median"] == pytest.approx(0.55 + 0.45)


def test_goodput() -> None:
    fast = [rec(0.0, 0.1, [0.01] * 4) for _ in range(3)]
    slow_first = [rec(0.0, 2.0, [0.01] * 4) for _ in range(2)]
    slow_tokens = [rec(0.0, 0.1, [0.5] * 4)]
    s = summarize(fast + slow_first + slow_tokens, duration=1.0, slo_ttft=0.5, slo_tpot=0.1)
    assert s["good_requests"] == 3 and s["goodput"] == pytest.approx(3.0)
    assert "goodput" not in summarize(fast, duration=1.0)


def test_distribution_empty() -> None:
    d = distribution([], "x")
    assert d["x_mean"] is None and d["x_p99"] is None


def test_knee_on_a_known_curve() -> None:
    # Throughput doubles with users up to 8 while latency creeps; at 16 throughput +10%, latency +90%.
    pts = [SweepPoint(1, 100, 1.0), SweepPoint(2, 200, 1.05), SweepPoint(4, 390, 1.1), SweepPoint(8, 700, 1.3),
           SweepPoint(16, 770, 2.47), SweepPoint(32, 780, 5.0)]
    assert knee(pts) == 8
    assert knee(pts, min_efficiency=0.01) == 32  # a lax threshold accepts every step
    assert knee(list(reversed(pts))) == 8  # order does not matter
    assert knee([SweepPoint(4, 10, 1.0)]) == 4
    assert knee([]) is None
    flat_latency = [SweepPoint(1, 10, 1.0), SweepPoint(2, 11, 1.0), SweepPoint(4, 11, 0.9)]
    assert knee(flat_latency) == 4
