"""The agentic workload with every call carrying tools and a JSON schema, against the same workload without.

Starts `tokenloom serve` on the embedded model and runs the bench lab's agentic sessions (`tokenloom bench
serve --dataset agentic`: --sessions conversations of --turns calls after a shared --system-len-token system
prompt, each call resending the growing conversation) twice per round:
  plain:       the calls as they are;
  structured:  every call also sends `tools` (two functions, rendered by the chat template when it renders
               tools) and a `response_format` JSON schema (an action object), with tool_choice none.
The two alternate over --rounds rounds, each on a freshly started server (a cold prefix cache). The table gives per-call TTFT and end-to-end latency (medians over all rounds' calls) for three kinds of
call: a server's very first call (cold: nothing cached), the other sessions' first calls (the system
prompt cached), and the later calls of each session (warm: the conversation so far cached).

    python benchmarks/agentic_structured.py [--sessions 4] [--turns 10] [--system-len 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pandas as pd

from tokenloom.netutil import free_port, wait_until_healthy

TOOLS = [
    {"type": "function", "function": {"name": "search_docs", "description": "Search the documentation.",
                                      "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                                     "required": ["query"]}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run the test suite.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}},
]
ACTION = {"type": "object", "additionalProperties": False, "required": ["thought", "action", "confidence"],
          "properties": {"thought": {"type": "string", "maxLength": 120},
                         "action": {"type": "string", "enum": ["search_docs", "run_tests", "answer"]},
                         "confidence": {"type": "integer", "minimum": 0, "maximum": 100}}}
STRUCTURED = {"tools": TOOLS, "tool_choice": "none", "ignore_eos": False, "min_tokens": 0,
              "response_format": {"type": "json_schema", "json_schema": {"name": "action", "schema": ACTION}}}


def bench(url: str, a: argparse.Namespace, out: Path, extra: dict | None) -> pd.DataFrame:
    cmd = [sys.executable, "-m", "tokenloom.cli", "bench", "serve", "--base-url", url, "--backend", "openai-chat",
           "--dataset", "agentic", "--tokenizer", "server", "--sessions", str(a.sessions), "--turns", str(a.turns),
           "--system-len", str(a.system_len), "--input-len", str(a.input_len), "--output-len", str(a.output_len),
           "--concurrency", "1", "--warmup", "0", "--out", str(out)]
    if extra is not None:
        cmd += ["--extra-body", json.dumps(extra)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return pd.read_csv(out / "records.csv")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--system-len", type=int, default=2000)
    ap.add_argument("--input-len", type=int, default=64, help="tokens of each user turn")
    ap.add_argument("--output-len", type=int, default=64, help="max tokens of each answer")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("results/agentic_structured"))
    ap.add_argument("--report-only", action="store_true", help="print the table from the records in --out")
    a = ap.parse_args()
    frames: dict[str, list[pd.DataFrame]] = {"plain": [], "structured": []}
    for r in range(a.rounds):
        if a.report_only:  # the table again from a finished run's records
            for label in frames:
                frames[label].append(pd.read_csv(a.out / f"{label}-{r}" / "records.csv"))
            continue
        for label in (["plain", "structured"] if r % 2 == 0 else ["structured", "plain"]):
            port = free_port()  # a fresh server per run: a cold prefix cache, nothing left from the other run
            url = f"http://127.0.0.1:{port}"
            proc = subprocess.Popen([sys.executable, "-m", "tokenloom.cli", "serve", "--port", str(port)],
                                    stderr=subprocess.DEVNULL)
            try:
                wait_until_healthy(url, timeout=900, alive=lambda: proc.poll() is None)
                df = bench(url, a, a.out / f"{label}-{r}", STRUCTURED if label == "structured" else None)
            finally:
                proc.terminate()
                proc.wait(120)
            if not df["success"].all():
                raise SystemExit(f"{label} round {r}: {int((~df['success']).sum())} calls failed")
            frames[label].append(df)
    print(f"agentic: {a.sessions} sessions x {a.turns} calls, {a.system_len}-token system prompt, "
          f"{a.input_len}-token user turns, up to {a.output_len} output tokens; {a.rounds} rounds")
    print("| workload | first call: TTFT / E2E (s) | other sessions' first calls: TTFT / E2E (s) "
          "| later calls: TTFT / E2E (s) | output tokens mean |")
    print("|---|---|---|---|---|")
    for label, dfs in frames.items():
        df = pd.concat(dfs)
        # Sessions run one after another: only each server's very first call finds the system prompt uncached.
        first = df[(df["session"] == 0) & (df["turn"] == 0)]
        cached_first = df[(df["session"] > 0) & (df["turn"] == 0)]
        later = df[df["turn"] > 0]
        cells = [f"{statistics.median(g['ttft']):.3f} / {statistics.median(g['e2el']):.3f}"
                 for g in (first, cached_first, later)]
        print(f"| {label} | {' | '.join(cells)} | {df['output_tokens'].mean():.1f} |")


if __name__ == "__main__":
    main()
