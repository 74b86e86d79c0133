"""Output tokens/s of 32 concurrent streams through `tokenloom serve`, against the offline engine.

Shows that the HTTP layer does not starve the engine loop: both run the same 32 prompts of 128 tokens
generating 128 tokens each (greedy, ignore_eos) on the embedded model; median of --repeats runs.
    python benchmarks/serve_throughput.py [--streams 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

import httpx

from tokenloom import LLM, SamplingParams
from tokenloom.netutil import free_port, wait_until_healthy


def prompts(llm_tok: object, n: int, length: int) -> list[list[int]]:
    base = llm_tok.encode("The history of computing is a story of people who wanted answers faster. " * 40)  # type: ignore[attr-defined]
    return [[(t + i) % 49000 for t in base[:length]] for i in range(n)]


def offline(ps: list[list[int]], out_len: int, repeats: int) -> float:
    # Prefix caching off on both sides: every repeat sends the same prompts, and this script measures
    # the HTTP layer's cost, not cache hits.
    llm = LLM(kv_cache_memory="1GiB", max_model_len=1024, enable_prefix_caching=False)
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    llm.generate(ps[:2], sp)
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        outs = llm.generate(ps, sp)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
    return statistics.median(rates)


async def one(c: httpx.AsyncClient, ids: list[int], out_len: int) -> int:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": ids, "max_tokens": out_len, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    tokens = 0
    async with c.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            # The load generator shares the CPU with the server: decode only the usage chunk.
            if '"usage"' in line:
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    return tokens


def served(ps: list[list[int]], out_len: int, repeats: int) -> float:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tokenloom.cli", "serve", "--port", str(port),
                             "--kv-cache-memory", "1GiB", "--max-model-len", "1024", "--no-prefix-caching"])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, alive=lambda: proc.poll() is None)

        async def run() -> float:
            async with httpx.AsyncClient(base_url=url, timeout=600) as c:
                await asyncio.gather(*(one(c, p, 4) for p in ps[:2]))  # warm-up
                t = time.perf_counter()
                counts = await asyncio.gather(*(one(c, p, out_len) for p in ps))
                return sum(counts) / (time.perf_counter() - t)

        return statistics.median(asyncio.run(run()) for _ in range(repeats))
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    from tokenloom.models.gguf import load_gguf  # noqa: F401  (fail early if the model package is missing)

    tok_llm = LLM(kv_cache_memory="64MiB", max_model_len=512)
    ps = prompts(tok_llm.tokenizer, a.streams, a.input_len)
    del tok_llm
    off = offline(ps, a.output_len, a.repeats)
    srv = served(ps, a.output_len, a.repeats)
    print(f"| {a.streams} streams x {a.input_len}->{a.output_len} | offline LLM.generate | tokenloom serve (HTTP, SSE) | ratio |")
    print("|---|---:|---:|---:|")
    print(f"| output tok/s (median of {a.repeats}) | {off:.1f} | {srv:.1f} | {srv / off:.2f} |")


if __name__ == "__main__":
    main()
