"""The served step trace (`serve --step-trace`) and what the planner makes of it (`plan host`, calibration),
and the engine loop's one wake-up per event loop per step."""

from __future__ import annotations

import asyncio
import csv
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from conftest import PROMPTS
from tokenloom import SamplingParams
from tokenloom.config import EngineConfig
from tokenloom.engine.async_engine import AsyncLLMEngine
from tokenloom.engine.step_trace import COLUMNS, StepTrace, parse_rows
from tokenloom.engine.warmup import warm_up
from tokenloom.errors import ConfigError
from tokenloom.plan.cost_model import FEATURES, LinearStepCost
from tokenloom.plan.host import attribute, bucket_table, fit_overheads, load_trace
from tokenloom.plan.profile_file import MEASURED, Profile

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _engine(tiny_llama: Path, trace: StepTrace | None) -> AsyncLLMEngine:
    cfg = EngineConfig(model=str(tiny_llama), dtype="float32", kv_cache_memory="16MiB", max_model_len=256,
                       max_num_batched_tokens=64, max_num_seqs=16)
    return AsyncLLMEngine.from_config(cfg, step_trace=trace)


async def _run(eng: AsyncLLMEngine, prompts: list[list[int]]) -> list[int]:
    async def one(ids: list[int]) -> int:
        n = 0
        async for out in eng.generate(ids, GREEDY):
            n += sum(len(c.token_ids) for c in out.outputs)
        return n

    return list(await asyncio.gather(*(one(p) for p in prompts)))


def test_trace_records_every_served_step(tiny_llama: Path, tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    eng = _engine(tiny_llama, StepTrace(path))
    try:
        report = eng.call_soon(warm_up).result()  # steps a queued call runs are not the loop's own
        prompts = [eng.tokenizer.encode(PROMPTS[i % len(PROMPTS)] + f" {i}") for i in range(6)]
        got = asyncio.run(_run(eng, prompts))
        steps = eng.engine.stats.steps
        # The loop flushes its trace when it goes idle: a reader sees the finished run without a close.
        deadline = 50
        while deadline and len(path.read_text().splitlines()) < 2:
            asyncio.run(asyncio.sleep(0.02))
            deadline -= 1
        lines = list(csv.DictReader(path.open()))
    finally:
        eng.shutdown()
    assert got == [12] * 6
    assert list(lines[0]) == list(COLUMNS)
    # The warm-up ran steps (and reset the engine's counters): none of them is in the trace, every later one is.
    assert report.steps > 0 and len(lines) == steps
    prompt_tokens = sum(len(p) for p in prompts)
    rows = [parse_rows(r["rows"]) for r in lines]
    # Every prompt token and every decode token was computed in a traced step (the first output token
    # comes from the step that finishes the prompt, so 11 decode rows per request).
    assert sum(n for rs in rows for n, _ in rs) == prompt_tokens + 6 * 11
    assert sum(int(r["streamed"]) for r in lines) == 6 * 12
    assert all(int(r["num_rows"]) == len(rs) and int(r["num_tokens"]) == sum(n for n, _ in rs)
               for r, rs in zip(lines, rows))
    assert any(n > 1 for rs in rows for n, _ in rs) and any(n == 1 for rs in rows for n, _ in rs)
    for r in lines:  # the timestamps are in order within each step
        t = [float(r[c]) for c in COLUMNS[:6]]
        assert t == sorted(t)
    # chunked prefill: no step computes more than the 64-token budget
    assert max(int(r["num_tokens"]) for r in lines) <= 64


def test_one_wakeup_per_event_loop_per_step(tiny_llama: Path) -> None:
    eng = _engine(tiny_llama, None)
    calls: list[int] = []

    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counting(cb: Any, *args: Any, **kw: Any) -> Any:
            calls.append(len(args[0]) if args and isinstance(args[0], list) else 1)
            return real(cb, *args, **kw)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        prompts = [eng.tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(8)]
        return await _run(eng, prompts)

    try:
        before = eng.engine.stats.steps
        assert asyncio.run(main()) == [12] * 8
        steps = eng.engine.stats.steps - before
    finally:
        eng.shutdown()
    assert len(calls) <= steps  # one wake-up per step at most, however many streams it fed
    assert max(calls) > 1  # and a step's wake-up carried several streams' outputs


def _synthetic_trace(path: Path, cost: LinearStepCost, step_s: float, row_s: float,
                     steps: list[list[tuple[int, int]]] | None = None) -> None:
    """Steps whose served time is the profile's price + step_s + row_s x rows, the engine step the price.
    `steps`: their rows (default: 60 steps, 1 to 32 decode rows, every fifth a 64-token chunk beside one)."""
    if steps is None:
        steps = [[(1, 100 + j) for j in range(1 + i % 32)] if i % 5 else [(64, 0), (1, 10)] for i in range(60)]
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        t = 100.0
        for rows in steps:
            price = cost.step_time(rows)
            extra = step_s + row_s * len(rows)
            # loop_start, step_start, compute_start, compute_end, step_end, posted
            times = (t, t + extra / 2, t + extra / 2, t + extra / 2 + price * 0.9, t + extra / 2 + price,
                     t + extra + price)
            streamed = len(rows)
            w.writerow([f"{x:.6f}" for x in times] + [len(rows), sum(n for n, _ in rows), streamed,
                                                        " ".join(f"{n}:{c}" for n, c in rows)])
            t += extra + price + 0.001


def _profile(cost: LinearStepCost) -> Profile:
    return Profile(MEASURED, "synthetic", cost, block_size=16, num_blocks=4096, kv_bytes_per_token=1024.0,
                   max_num_seqs=64, max_num_batched_tokens=256, max_model_len=1024)


def _light_bench_folder(folder: Path) -> Path:
    """A `bench serve` results folder of one light point (concurrency 1, six requests): enough with a trace
    (the TPOT regression needs two)."""
    folder.mkdir()
    pd.DataFrame([{"input_len": 64, "input_tokens": 64, "output_len": 16, "output_tokens": 16, "concurrency": 1,
                   "start": i * 0.5, "ttft": 0.08, "e2el": 0.3, "itl_mean": 0.014} for i in range(6)]
                 ).to_csv(folder / "records.csv", index=False)
    (folder / "summary.json").write_text(json.dumps({"points": [
        {"input_len": 64, "concurrency": 1, "request_rate": None, "tpot_s_median": 0.014, "ttft_s_median": 0.08}]}))
    return folder


COST = LinearStepCost(tuple([5e-3, 1e-3, 2e-4, 1e-6, 2e-6, 4e-3, 1e-3, 1e-6, 5e-4, 2e-4, 1e-3][: len(FEATURES)]))


def test_host_fit_recovers_known_overheads(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    _synthetic_trace(path, COST, step_s=1.5e-3, row_s=0.25e-3)
    df = attribute(_profile(COST), load_trace([path]))
    fit = fit_overheads(df)
    assert fit.step_s == pytest.approx(1.5e-3, abs=2e-6)
    assert fit.row_s == pytest.approx(0.25e-3, abs=2e-7)
    assert fit.steps == 48  # the decode-only steps: 12 of the 60 carry a chunk
    assert fit.median_abs_error_s < 1e-5
    # The overhead sits half before the step and half after it (the synthetic trace's split).
    dec = df[df["decode_only"]]
    assert (dec["inside"].abs() < 1e-5).all()
    assert ((dec["outside"] - (1.5e-3 + 0.25e-3 * dec["num_rows"])).abs() < 1e-5).all()
    table = bucket_table(df)
    assert int(table["steps"].sum()) == 60


def test_host_fit_refuses_bad_traces(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ConfigError, match="missing"):
        load_trace([bad])
    empty = tmp_path / "empty.csv"
    empty.write_text(",".join(COLUMNS) + "\n")
    with pytest.raises(ConfigError, match="no steps"):
        load_trace([empty])
    with pytest.raises(ConfigError, match="cannot write"):
        StepTrace(tmp_path / "no" / "such" / "dir" / "t.csv")


def test_calibrate_takes_the_per_row_overhead_from_the_trace(tmp_path: Path) -> None:
    from tokenloom.plan.calibrate import calibrate
    from tokenloom.plan.simulator import FleetConfig

    trace = tmp_path / "t.csv"
    _synthetic_trace(trace, COST, step_s=1.0e-3, row_s=0.5e-3)
    # One light bench point (concurrency 1): enough with a trace (the TPOT regression needs two).
    folder = _light_bench_folder(tmp_path / "bench")
    prof = calibrate(_profile(COST), [folder], FleetConfig(workers=1), step_traces=[trace])
    assert prof.overhead_step_s == pytest.approx(1.0e-3, abs=2e-6)
    assert prof.overhead_row_s == pytest.approx(0.5e-3, abs=2e-7)
    assert prof.calibration["step_traces"] == [str(trace)]
    with pytest.raises(ConfigError, match="at least 2"):
        calibrate(_profile(COST), [folder], FleetConfig(workers=1))


def test_plan_host_cli(tmp_path: Path) -> None:
    trace, prof = tmp_path / "t.csv", tmp_path / "p.json"
    _synthetic_trace(trace, COST, step_s=2e-3, row_s=0.1e-3)
    _profile(COST).save(prof)
    out = subprocess.run([sys.executable, "-m", "tokenloom.cli", "plan", "host", "--profile", str(prof),
                          "--step-trace", str(trace)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "2.00 ms/step + 0.100 ms/row, from 48 served decode steps" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "tokenloom.cli", "plan", "host", "--profile", str(prof),
                          "--step-trace", str(tmp_path / "missing.csv")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "not a readable step trace" in bad.stderr


def test_serve_refuses_a_bad_switch_interval() -> None:
    out = subprocess.run([sys.executable, "-m", "tokenloom.cli", "serve", "--gil-switch-interval", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--gil-switch-interval" in out.stderr


def test_calibrate_refits_the_step_cost_with_the_served_steps(tmp_path: Path) -> None:
    from tokenloom.plan.calibrate import calibrate
    from tokenloom.plan.host import refit_cost
    from tokenloom.plan.simulator import FleetConfig

    # The profiling process found few-row steps 60% slower than the server does (a CPU cache state: on the
    # 2-core Xeon a 1-row step profiled 8.6 ms and served 5.2). The served steps (COST) correct the price.
    few = [[(1, c + i) for i in range(r)] for r in (1, 2, 4) for c in (128, 512, 1024) for _ in range(4)]
    many = [[(1, c + i) for i in range(r)] for r in (16, 64) for c in (128, 512, 1024) for _ in range(4)]
    lone = [[(n, 0)] for n in (16, 64, 128, 256, 512) for _ in range(3)]
    samples = ([(rows, 1.6 * COST.step_time(rows)) for rows in few]
               + [(rows, COST.step_time(rows)) for rows in many + lone])
    bare = LinearStepCost.fit(samples)
    prof = replace(_profile(bare), fit={"samples": [[list(map(list, r)), t] for r, t in samples],
                                        "kept": [True] * len(samples)})
    # Served at light load: mostly 1-4 rows, some more, a prompt's chunk now and then.
    served = [[(1, 100 + i % 60 + j) for j in range(r)] for i, r in enumerate([1] * 120 + [2] * 40 + [4] * 30
                                                                              + [8] * 20 + [16] * 10)]
    served += [[(128, 0), (1, 150)]] * 10
    trace = tmp_path / "t.csv"
    _synthetic_trace(trace, COST, step_s=1.0e-3, row_s=0.0, steps=served)
    one = [(1, 120)]
    assert bare.step_time(one) > 1.3 * COST.step_time(one)  # the bare profile prices it high
    refit, line = refit_cost(prof, load_trace([trace]))
    assert refit.cost.step_time(one) == pytest.approx(COST.step_time(one), rel=0.1)
    many_long = [(1, 1024)] * 64  # where only the profile reaches: still its price
    assert refit.cost.step_time(many_long) == pytest.approx(COST.step_time(many_long), rel=0.2)
    assert line.startswith(f"cost refitted on {len(samples)} profiled + {len(served)} served steps")
    # calibrate does it before the overhead fit, and says so.
    folder = _light_bench_folder(tmp_path / "bench")
    got = calibrate(prof, [folder], FleetConfig(workers=1), step_traces=[trace])
    assert got.cost == refit.cost and got.calibration["step_trace_cost"] == line
    # The per-step overhead is fitted against the refitted price (against the bare one, which prices the
    # served steps high, it would clip to 0).
    assert got.overhead_step_s == pytest.approx(fit_overheads(attribute(refit, load_trace([trace]))).step_s)
    assert got.overhead_step_s > 0 and fit_overheads(attribute(prof, load_trace([trace]))).step_s == 0
    # An analytic profile (no timed steps) keeps its cost.
    assert refit_cost(_profile(COST), load_trace([trace]))[0].cost == COST
