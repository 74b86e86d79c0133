"""Disaggregated prefill/decode against colocated workers, the same total worker count, in one run.

Starts `tokenloom cluster` twice on the embedded model, each worker with --num-threads 1 so the two
workers share the machine's cores the same way in both set-ups:
  colocated: two `--role both` workers behind the router (least outstanding requests);
  split:     one `--role prefill` and one `--role decode` worker; the router has the prefill worker
             compute each prompt and ship its KV blocks to the decode worker, which streams the answer.
and runs the same mixed workload of long prompts and long generations against each (`tokenloom bench
serve --dataset random`: prompt and output lengths drawn in len * (1 +- ratio)).

    python benchmarks/disagg.py [--input-len 1024] [--output-len 128] [--ratio 0.8] [--concurrency 4]
                                [--num-prompts 24] [--runs 3] [--out results/disagg]

With --runs N the two set-ups take turns N times and the table shows each figure's median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from tokenloom.netutil import free_port, wait_until_healthy


def run(label: str, cluster_flags: list[str], a: argparse.Namespace) -> dict:
    port = free_port()
    out = a.out / label
    proc = subprocess.Popen([sys.executable, "-m", "tokenloom.cli", "cluster", "--port", str(port),
                             "--num-threads", "1", "--max-model-len", "4096", *cluster_flags])
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", timeout=600, alive=lambda: proc.poll() is None)
        subprocess.run([sys.executable, "-m", "tokenloom.cli", "bench", "serve", "--base-url",
                        f"http://127.0.0.1:{port}", "--backend", "openai", "--dataset", "random",
                        "--input-len", str(a.input_len), "--output-len", str(a.output_len),
                        "--random-range-ratio", str(a.ratio), "--num-prompts", str(a.num_prompts),
                        "--concurrency", str(a.concurrency), "--warmup", "2", "--seed", str(a.seed),
                        "--out", str(out)], check=True)
    finally:
        proc.terminate()
        proc.wait(120)
    return json.loads((out / "summary.json").read_text())["points"][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--ratio", type=float, default=0.8, help="lengths drawn in len * (1 +- ratio)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", type=int, default=1, help="turns of both set-ups; medians are shown")
    ap.add_argument("--out", type=Path, default=Path("results/disagg"))
    a = ap.parse_args()
    points: dict[str, list[dict]] = {"colocated": [], "split": []}
    for i in range(a.runs):
        points["colocated"].append(run(f"colocated-{i}", ["--workers", "2"], a))
        points["split"].append(run(f"split-{i}", ["--workers", "1", "--prefill-workers", "1"], a))

    def median(label: str, key: str) -> float | None:
        xs = [p[key] for p in points[label] if p.get(key) is not None]
        return statistics.median(xs) if xs else None

    print(f"\n{a.runs} run(s) each, medians:")
    print(f"\n| mixed: prompts {a.input_len} +- {a.ratio:.0%}, outputs {a.output_len} +- {a.ratio:.0%}, "
          f"concurrency {a.concurrency} | colocated (2 x both) | split (1 prefill + 1 decode) | split / colocated |")
    print("|---|---:|---:|---:|")
    rows = (("TTFT median (s)", "ttft_s_median"), ("TTFT p95 (s)", "ttft_s_p95"), ("TTFT p99 (s)", "ttft_s_p99"),
            ("TPOT median (s)", "tpot_s_median"), ("TPOT p95 (s)", "tpot_s_p95"), ("TPOT p99 (s)", "tpot_s_p99"),
            ("E2E p95 (s)", "e2el_s_p95"), ("output tok/s", "output_throughput"))
    for label, key in rows:
        x, y = median("colocated", key), median("split", key)
        if x is None or y is None:
            continue
        print(f"| {label} | {x:.3f} | {y:.3f} | {y / x:.2f}x |")


if __name__ == "__main__":
    main()
