"""The capacity planner against reality: measure real servers with `tokenloom bench serve`, simulate the
same workloads with `tokenloom plan` from a profile taken in the same run, and compare.

    python benchmarks/plan_validate.py [--input-len 128] [--output-len 64] [--num-prompts 40]
                                       [--rates 1,2,4] [--out results/plan_validate]

1. `tokenloom plan profile` of the embedded model with --num-threads 1 (the engine flags every server
   below gets, so two workers share the two cores the same way as one worker uses one).
2. For each set-up, a real run: one `tokenloom serve`; a 2-worker `tokenloom cluster`; a 1 prefill +
   1 decode `tokenloom cluster --prefill-workers 1`. Each is loaded by `bench serve` at Poisson rates:
   by default 1/8, 1/4, 1/2, 1 and 2 x the knee the planner predicts for that fleet (a sweep of
   simulated rates), so that the real knee falls inside the sweep even where the prediction is off;
   or --rates for all.
   Before them, the single server is also run at concurrency 1 and 8 (--calibration-prompts each) and
   `plan calibrate` fits the serving time outside engine steps (HTTP streaming, the async loop, the load
   generator on the same cores) to those two points; the rate points below are not used for it.
   --no-calibrate compares the bare engine-step profile instead.
3. The simulation replays each measured point's records (its very arrival times and lengths) on the
   matching simulated fleet, and the table compares p50/p99 TTFT and TPOT, with the relative error, and
   the knee (bench's definition) of the measured and of the simulated sweep.
Results: profile.json, one bench folder per set-up, validation.json and table.md in --out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd

from tokenloom.bench.stats import SweepPoint, knee
from tokenloom.netutil import free_port, wait_until_healthy
from tokenloom.plan.calibrate import calibrate
from tokenloom.plan.metrics import fleet_summary
from tokenloom.plan.profile_file import Profile
from tokenloom.plan.simulator import FleetConfig, simulate
from tokenloom.plan.workload import poisson, replay

ENGINE = ["--num-threads", "1", "--max-model-len", "4096"]
SETUPS: dict[str, tuple[list[str], FleetConfig]] = {
    "single": (["serve"], FleetConfig(workers=1)),
    "cluster-2": (["cluster", "--workers", "2"], FleetConfig(workers=2)),
    # Loopback ZeroMQ: ~1 GB/s and a few ms per transfer (signing, import, the router's extra HTTP hop).
    "split-1P1D": (["cluster", "--workers", "1", "--prefill-workers", "1"],
                   FleetConfig(workers=1, prefill_workers=1, link_bandwidth=1e9, link_latency_s=5e-3)),
}
METRICS = ("ttft_s_median", "ttft_s_p99", "tpot_s_median", "tpot_s_p99")


def tl(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokenloom.cli", *args]


def predicted_rates(prof: Profile, fleet: FleetConfig, a: argparse.Namespace) -> list[float]:
    """1/8 .. 2 x the simulated knee of `fleet` over a sweep of rates."""
    grid = [0.25, 0.5, 0.75, 1, 1.5, 2, 3, 4, 6, 8, 12, 16]
    pts = []
    for r in grid:
        s = fleet_summary(simulate(prof, fleet, poisson(r, a.num_prompts, a.input_len, a.output_len, a.seed)))
        pts.append(SweepPoint(r, s["output_throughput"], s["e2el_s_p95"]))
    k = knee(pts, a.knee_efficiency) or grid[0]
    return [k / 8, k / 4, k / 2, k, k * 2]


def measure(name: str, cmd: list[str], rates: list[float] | None, a: argparse.Namespace) -> Path:
    """Start the set-up, load it at `rates` (None: concurrency 1 and 8, the calibration runs), stop it."""
    port = free_port()
    out = a.out / name
    load = (["--request-rate", ",".join(f"{r:g}" for r in rates), "--num-prompts", str(a.num_prompts)] if rates
            else ["--concurrency", "1,8", "--num-prompts", str(a.calibration_prompts)])
    proc = subprocess.Popen(tl(*cmd, "--port", str(port), *ENGINE))
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", timeout=900, alive=lambda: proc.poll() is None)
        subprocess.run(tl("bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--dataset", "fixed",
                          "--input-len", str(a.input_len), "--output-len", str(a.output_len),
                          *load, "--warmup", "2", "--seed", str(a.seed), "--knee-efficiency", str(a.knee_efficiency),
                          "--out", str(out)), check=True)
    finally:
        proc.terminate()
        proc.wait(180)
    return out


def compare(name: str, fleet: FleetConfig, prof: Profile, folder: Path, a: argparse.Namespace) -> list[dict[str, Any]]:
    measured = json.loads((folder / "summary.json").read_text())["points"]
    records = pd.read_csv(folder / "records.csv")
    rows = []
    for m in measured:
        rate = m["request_rate"]
        trace = a.out / f"{name}-{rate:g}.csv"
        records[records["request_rate"] == rate].to_csv(trace, index=False)
        s = fleet_summary(simulate(prof, fleet, replay(trace, seed=a.seed), a.seed))
        row: dict[str, Any] = {"setup": name, "rate": rate, "measured_completed": m["completed"],
                               "measured_out_tok_s": m["output_throughput"], "sim_out_tok_s": s["output_throughput"],
                               "measured_e2el_p95": m["e2el_s_p95"], "sim_e2el_p95": s["e2el_s_p95"]}
        for k in METRICS:
            row[f"measured_{k}"], row[f"sim_{k}"] = m[k], s[k]
            row[f"err_{k}"] = None if not m[k] or s[k] is None else (s[k] - m[k]) / m[k]
        rows.append(row)
    for side in ("measured", "sim"):
        k = knee([SweepPoint(r["rate"], r[f"{side}_out_tok_s"], r[f"{side}_e2el_p95"]) for r in rows
                  if r[f"{side}_e2el_p95"] is not None], a.knee_efficiency)
        for r in rows:
            r[f"{side}_knee"] = k
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.0f}"

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v:+.0%}"

    head = ("| set-up | rate req/s | TTFT p50 meas / sim ms (err) | TTFT p99 meas / sim ms (err) | "
            "TPOT p50 meas / sim ms (err) | TPOT p99 meas / sim ms (err) | knee meas / sim |\n|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        cells = [f"{ms(r['measured_' + k])} / {ms(r['sim_' + k])} ({pct(r['err_' + k])})" for k in METRICS]
        lines.append(f"| {r['setup']} | {r['rate']:.2g} | {' | '.join(cells)} | {r['measured_knee']:.2g} / {r['sim_knee']:.2g} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=40, help="measured requests per rate")
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=None,
                    help="the same rates for every set-up (default: 1/8 .. 2 x each fleet's predicted knee)")
    ap.add_argument("--setups", type=lambda s: s.split(","), default=list(SETUPS))
    ap.add_argument("--knee-efficiency", type=float, default=0.5)
    ap.add_argument("--profile", type=Path, default=None, help="reuse this profile instead of taking one")
    ap.add_argument("--profile-args", default="--decode-rows 1,4,16,64 --context-lens 128,512,1024",
                    help="grid flags for `plan profile`")
    ap.add_argument("--no-calibrate", action="store_true", help="simulate with the bare engine-step profile")
    ap.add_argument("--calibration-prompts", type=int, default=16, help="requests per calibration point")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("results/plan_validate"))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    prof_path = a.profile or a.out / "profile.json"
    if a.profile is None:
        subprocess.run(tl("plan", "profile", "--out", str(prof_path), *ENGINE, *a.profile_args.split()), check=True)
    prof = Profile.load(prof_path)
    if not a.no_calibrate:
        prof = calibrate(prof, [measure("calibration", SETUPS["single"][0], None, a)], FleetConfig(workers=1), a.seed)
        prof.save(a.out / "profile-calibrated.json")
        print(f"calibrated serving overhead: {prof.overhead_step_s * 1e3:.2f} ms/step + "
              f"{prof.overhead_row_s * 1e3:.3f} ms/row", flush=True)
    rows: list[dict[str, Any]] = []
    for name in a.setups:
        cmd, fleet = SETUPS[name]
        rates = a.rates or predicted_rates(prof, fleet, a)
        print(f"== {name}: rates {', '.join(f'{r:.2g}' for r in rates)} req/s", flush=True)
        folder = measure(name, cmd, [round(r, 2) for r in rates], a)
        rows += compare(name, fleet, prof, folder, a)
        (a.out / "validation.json").write_text(json.dumps(rows, indent=1))
    md = table(rows)
    (a.out / "table.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
