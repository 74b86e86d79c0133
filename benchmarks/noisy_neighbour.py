"""Short requests while the largest request the server allows runs, against the same requests alone.

Starts `tokenloom serve` on the embedded model with its default limits, then times short chat requests
(TTFT and end-to-end, streamed) in turns:
  alone:      nothing else runs;
  neighbour:  one "largest allowed" request runs beside them: n = --max-n completions of a prompt of half
              the context, each allowed to fill the context (max_tokens up to max_model_len); it is
              cancelled (client gone) once the short requests are done.
Each turn sends --requests short requests one after another; --rounds turns of each, alternating. The table
shows medians over all short requests of each condition and the ratio neighbour / alone.

    python benchmarks/noisy_neighbour.py [--requests 8] [--rounds 3] [--max-n 128] [--max-model-len 8192]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import threading
import time

import httpx

from tokenloom.netutil import free_port, wait_until_healthy

SHORT = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 16, "temperature": 0,
         "ignore_eos": True, "stream": True}


def short_request(url: str, model: str) -> tuple[float, float]:
    """(TTFT, end-to-end) seconds of one streamed short chat request."""
    start = time.perf_counter()
    ttft = None
    with httpx.stream("POST", url + "/v1/chat/completions", json={**SHORT, "model": model}, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and ttft is None:
                if json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    ttft = time.perf_counter() - start
    return (ttft if ttft is not None else float("nan")), time.perf_counter() - start


def neighbour(url: str, model: str, n: int, prompt_tokens: int, stop: threading.Event) -> None:
    """The largest request: n completions of a long prompt, read until `stop`, then the client leaves."""
    body = {"model": model, "prompt": [17] * prompt_tokens, "n": n, "max_tokens": prompt_tokens - 1,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for _ in r.iter_lines():
            if stop.is_set():
                return  # closing the stream aborts the request in the engine


def cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        name = platform.processor()
    amx = "amx_tile" in open("/proc/cpuinfo").read()
    return f"{name} ({'AMX' if amx else 'no AMX'})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8, help="short requests per turn")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-n", type=int, default=128, help="the server's --max-n (its default)")
    ap.add_argument("--max-model-len", type=int, default=8192)
    a = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "tokenloom.cli", "serve", "--port", str(port),
                             "--max-n", str(a.max_n), "--max-model-len", str(a.max_model_len)],
                            stderr=subprocess.DEVNULL)
    try:
        wait_until_healthy(url, timeout=900, alive=lambda: proc.poll() is None)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        short_request(url, model)  # warm-up
        got: dict[str, list[tuple[float, float]]] = {"alone": [], "neighbour": []}
        for _ in range(a.rounds):
            got["alone"] += [short_request(url, model) for _ in range(a.requests)]
            stop = threading.Event()
            t = threading.Thread(target=neighbour, args=(url, model, a.max_n, a.max_model_len // 2, stop))
            t.start()
            time.sleep(2.0)  # the large request is admitted and under way
            got["neighbour"] += [short_request(url, model) for _ in range(a.requests)]
            stop.set()
            t.join(600)
            time.sleep(1.0)  # its abort settles
    finally:
        proc.terminate()
        proc.wait(120)
    med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for k, v in got.items()}
    print(f"CPU: {cpu()}; largest request: n={a.max_n}, prompt {a.max_model_len // 2} tokens; "
          f"{a.rounds} rounds x {a.requests} short requests (16 tokens)")
    print("| condition | TTFT p50 (s) | end-to-end p50 (s) |")
    print("|---|---|---|")
    for k, (ttft, e2e) in med.items():
        print(f"| {k} | {ttft:.3f} | {e2e:.3f} |")
    print(f"| ratio neighbour / alone | {med['neighbour'][0] / med['alone'][0]:.2f} | "
          f"{med['neighbour'][1] / med['alone'][1]:.2f} |")


if __name__ == "__main__":
    main()
