"""Warm-call TTFT of an agentic multi-turn workload with prefix caching on and off, in one run.

Starts `tokenloom serve` twice on the embedded model (default flags, then --no-prefix-caching) and runs
the lab's agentic workload against each: --sessions conversations of --turns calls, each call resending
the whole conversation after a shared --system-len-token system prompt. A warm call is any call after a
conversation's first; its TTFT is what prefix caching is for.

    python benchmarks/prefix_cache.py [--sessions 4] [--turns 10] [--system-len 2000] [--out results/prefix_cache]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from tokenloom.netutil import free_port, wait_until_healthy


def run(flags: list[str], out: Path, a: argparse.Namespace) -> dict:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tokenloom.cli", "serve", "--port", str(port),
                             "--max-model-len", "8192", *flags])
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", timeout=300, alive=lambda: proc.poll() is None)
        subprocess.run([sys.executable, "-m", "tokenloom.cli", "bench", "serve", "--base-url",
                        f"http://127.0.0.1:{port}", "--backend", "openai-chat", "--dataset", "agentic",
                        "--sessions", str(a.sessions), "--turns", str(a.turns), "--system-len", str(a.system_len),
                        "--input-len", str(a.input_len), "--output-len", str(a.output_len), "--concurrency",
                        str(a.concurrency), "--warmup", "1", "--seed", str(a.seed), "--out", str(out)], check=True)
    finally:
        proc.terminate()
        proc.wait(60)
    return json.loads((out / "summary.json").read_text())["points"][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--system-len", type=int, default=2000)
    ap.add_argument("--input-len", type=int, default=50, help="tokens of each new user message")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=1, help="conversations in flight")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("results/prefix_cache"))
    a = ap.parse_args()
    on = run([], a.out / "caching-on", a)
    off = run(["--no-prefix-caching"], a.out / "caching-off", a)
    print(f"\n| agentic: {a.sessions} sessions x {a.turns} calls, system prompt {a.system_len} tokens "
          f"| prefix caching on | off | off / on |")
    print("|---|---:|---:|---:|")
    for label, key in (("warm-call TTFT median (s)", "ttft_warm_s_median"), ("warm-call TTFT p95 (s)", "ttft_warm_s_p95"),
                       ("cold-call TTFT median (s)", "ttft_cold_s_median"), ("E2E latency median (s)", "e2el_s_median"),
                       ("output tok/s", "output_throughput")):
        x, y = on.get(key), off.get(key)
        ratio = f"{y / x:.1f}x" if x and y else "-"
        print(f"| {label} | {x:.3f} | {y:.3f} | {ratio} |")
    print(f"\nresults folders: {a.out / 'caching-on'}, {a.out / 'caching-off'} "
          f"(compare: tokenloom bench compare {a.out / 'caching-on'} {a.out / 'caching-off'})")


if __name__ == "__main__":
    main()
