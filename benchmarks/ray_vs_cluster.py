"""`tokenloom ray-serve` on a two-node Ray cluster on this machine against `tokenloom cluster`, the same two
workers (embedded model, --num-threads 1 each), taking turns --runs times; medians.

For each set-up: output tokens/s of --concurrency streamed completions (--output-len tokens each, greedy,
ignore_eos), and the router's overhead per request: the median latency of --probes sequential one-token
completions through the router minus the same sent straight to one of its workers.

    python benchmarks/ray_vs_cluster.py [--runs 3] [--concurrency 16] [--output-len 64] [--probes 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tokenloom.distributed.local import LocalRayCluster, NodeSpec
from tokenloom.netutil import free_port, wait_until_healthy

REPO = Path(__file__).resolve().parents[1]
WORKER = ["--num-threads", "1", "--max-model-len", "2048", "--served-model-name", "m"]


async def _stream(c: httpx.AsyncClient, i: int, n: int) -> int:
    body = {"model": "m", "prompt": f"Tell me a story about number {i}.", "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    tokens = 0
    async with c.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"usage": {' in line:
                usage = json.loads(line[6:]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
    return tokens


def throughput(url: str, concurrency: int, n: int) -> float:
    async def go() -> float:
        async with httpx.AsyncClient(base_url=url, timeout=600) as c:
            await _stream(c, -1, 4)  # warm the connection
            t = time.perf_counter()
            tokens = await asyncio.gather(*(_stream(c, i, n) for i in range(concurrency)))
            return sum(tokens) / (time.perf_counter() - t)
    return asyncio.run(go())


def latency(url: str, probes: int) -> float:
    body = {"model": "m", "prompt": "Hi", "max_tokens": 1, "temperature": 0}
    times = []
    with httpx.Client(base_url=url, timeout=60) as c:
        c.post("/v1/completions", json=body)
        for _ in range(probes):
            t = time.perf_counter()
            c.post("/v1/completions", json=body).raise_for_status()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(router: str, worker: str, a: argparse.Namespace) -> dict[str, float]:
    return {"tok_s": throughput(router, a.concurrency, a.output_len),
            "overhead_ms": 1000 * (latency(router, a.probes) - latency(worker, a.probes))}


def run_cluster(a: argparse.Namespace) -> dict[str, float]:
    port, w = free_port(), [free_port(), free_port()]
    proc = subprocess.Popen([sys.executable, "-m", "tokenloom.cli", "cluster", "--workers", "2", "--port", str(port),
                             "--worker-ports", *map(str, w), *WORKER])
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", timeout=600, alive=lambda: proc.poll() is None)
        for p in w:
            wait_until_healthy(f"http://127.0.0.1:{p}", timeout=600)
        return measure(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{w[0]}", a)
    finally:
        proc.terminate()
        proc.wait(120)


def run_ray(a: argparse.Namespace) -> dict[str, float]:
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cluster = LocalRayCluster([NodeSpec(1), NodeSpec(1, {"node2": 1})], env=env)
    cluster.start()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tokenloom.cli", "ray-serve", "--address", cluster.address,
                             "--port", str(port), "--min-workers", "2", "--num-cpus-per-worker", "1",
                             "--worker-host", "127.0.0.1", *WORKER],
                            env=cluster.env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(url, timeout=600, path="/admin/workers", alive=lambda: proc.poll() is None)
        while len([w for w in httpx.get(url + "/health").json()["workers"] if w["healthy"]]) < 2:
            time.sleep(0.2)
        worker = httpx.get(url + "/admin/workers").json()["workers"][0]["url"]
        return measure(url, worker, a)
    finally:
        proc.terminate()
        proc.wait(120)
        cluster.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--probes", type=int, default=30)
    a = p.parse_args()
    results: dict[str, list[dict[str, float]]] = {"cluster": [], "ray-serve": []}
    for i in range(a.runs):
        for name, fn in (("cluster", run_cluster), ("ray-serve", run_ray)):
            results[name].append(fn(a))
            print(f"run {i + 1} {name}: {results[name][-1]}", flush=True)
    print("| set-up | output tok/s (median) | router overhead per request, ms (median) | runs |")
    print("|---|---|---|---|")
    for name, rs in results.items():
        print(f"| {name} | {statistics.median(r['tok_s'] for r in rs):.1f} | "
              f"{statistics.median(r['overhead_ms'] for r in rs):.2f} | {len(rs)} |")


if __name__ == "__main__":
    main()
