"""Extrapolation (analytic, not measured): the cheapest fleet for a model on a GPU at several request rates.

    python benchmarks/plan_extrapolate.py [--hardware H100] [--models smollm2-135m,llama-3.1-8b]
        [--rates 10,100,1000] [--slo-ttft-p99 1] [--slo-tpot-p99 0.05] [--input-len 512] [--output-len 128]

For each model, `tokenloom plan hardware` builds the roofline profile (bf16 weights and K/V, one device
per worker); `tokenloom plan search` then finds the fewest workers, colocated or split into prefill and
decode, that hold both p99 SLOs for Poisson arrivals at each rate. Nothing here was measured: the
numbers are only as good as the spec's peak figures, the assumed fractions of them (mfu, mbu) and the
per-step host overhead (hardware.py), and the simulator's validation on the CPU (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def tl(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokenloom.cli", *args]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hardware", default="H100")
    ap.add_argument("--models", default="smollm2-135m,llama-3.1-8b")
    ap.add_argument("--rates", default="10,100,1000")
    ap.add_argument("--slo-ttft-p99", type=float, default=1.0)
    ap.add_argument("--slo-tpot-p99", type=float, default=0.05)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds of arrivals simulated per rate")
    ap.add_argument("--min-requests", type=int, default=500)
    ap.add_argument("--prefill-shares", default="0,0.25,0.5")
    ap.add_argument("--max-workers", type=int, default=256)
    ap.add_argument("--out", type=Path, default=Path("results/plan_extrapolate"))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    lines = ["| model | rate req/s | fleet | p99 TTFT ms | p99 TPOT ms |", "|---|---|---|---|---|"]
    for model in a.models.split(","):
        prof = a.out / f"{a.hardware}-{model}.json"
        subprocess.run(tl("plan", "hardware", "--hardware", a.hardware, "--model", model, "--out", str(prof)), check=True)
        for rate in (float(r) for r in a.rates.split(",")):
            n = max(a.min_requests, int(rate * a.seconds))
            res = a.out / f"{a.hardware}-{model}-{rate:g}.json"
            subprocess.run(tl("plan", "search", "--profile", str(prof), "--rate", f"{rate:g}", "--num-requests", str(n),
                              "--input-len", str(a.input_len), "--output-len", str(a.output_len),
                              "--slo-ttft-p99", str(a.slo_ttft_p99), "--slo-tpot-p99", str(a.slo_tpot_p99),
                              "--prefill-shares", a.prefill_shares, "--max-workers", str(a.max_workers),
                              "--out", str(res)))
            best = json.loads(res.read_text())["answer"]
            if best is None:
                lines.append(f"| {model} | {rate:g} | none within {a.max_workers} workers | - | - |")
                continue
            fleet = (f"{best['prefill_workers']} prefill + {best['workers']} decode" if best["prefill_workers"]
                     else f"{best['workers']} colocated")
            lines.append(f"| {model} | {rate:g} | {fleet} (max-num-seqs {best['max_num_seqs']}, chunk {best['chunk']}) | "
                         f"{best['ttft_s_p99'] * 1e3:.0f} | {best['tpot_s_p99'] * 1e3:.1f} |")
    md = "\n".join(lines)
    (a.out / "table.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
