"""Warm-up before health (engine/warmup.py): which shapes run, that the engine is left clean, and that a server
does not answer /health before warm-up ends. How much sooner the first request answers is a timing:
benchmarks/warmup_ttft.py measures it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from router_helpers import samples

from tokenloom.config import EngineConfig
from tokenloom.engine.engine import LLMEngine
from tokenloom.engine.huge_pages import huge_pages_usable
from tokenloom.engine.warmup import decode_batch_sizes, warm_up
from tokenloom.netutil import free_port


def test_warm_up_runs_a_full_prefill_and_the_decode_batch_sizes_then_leaves_the_engine_clean(tiny_llama: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), dtype="float32", kv_cache_memory="16MiB", max_model_len=256,
                                    max_num_seqs=12, max_num_batched_tokens=96))
    seen: list[tuple[int, int]] = []  # (sequences, tokens) of each step
    execute = engine.runner.execute

    def spy(batch):  # type: ignore[no-untyped-def]
        seen.append((len(batch.seqs), sum(batch.num_new_tokens)))
        return execute(batch)

    engine.runner.execute = spy  # type: ignore[method-assign]
    report = warm_up(engine)
    assert report.prefill_tokens == 96 and report.decode_batch_sizes == 12
    assert report.steps == len(seen)
    assert seen[0] == (1, 96)  # the whole step budget as one prefill chunk
    decode_sizes = {seqs for seqs, tokens in seen if seqs == tokens}  # steps where every sequence decoded one token
    assert decode_sizes == set(decode_batch_sizes(12)) == {1, 2, 3, 4, 5, 6, 7, 8, 12}
    assert not engine.has_unfinished_requests()
    assert engine.kv.usage == 0.0
    assert engine.get_stats()["steps"] == 0  # users' counters start at zero
    assert engine.kv.stats.queries == 0 and engine.kv.stats.hits == 0
    assert engine.reset_prefix_cache() == 0  # the warm-up prompts were dropped from the prefix cache


def test_health_waits_for_warm_up_and_then_requests_are_served(tiny_llama: Path, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tokenloom.cli", "serve", "--model", str(tiny_llama), "--port",
                                 str(port), "--served-model-name", "tiny", "--dtype", "bfloat16", "--kv-cache-memory", "16MiB", "--max-model-len", "512"],
                                stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited: {log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                pytest.fail(f"never healthy: {log_path.read_text()[-2000:]}")
            time.sleep(0.05)
        # The server listens only after warm-up, the engine's and one request through the app (serve/warmup.py):
        # their lines are already in the log when /health first answers.
        log_text = log_path.read_text()
        assert "warm-up: " in log_text and "warm-up: one request through the app" in log_text
        # The start-up report says where the weights went (engine/huge_pages.py), as it does the routing
        assert ("weights on huge pages: " in log_text) is (huge_pages_usable() is None), log_text[-2000:]
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4,
                                                      "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                                     "prompt_tokens_details": {"cached_tokens": 0}}
        # The app's warm-up request left no access-log line: this request's is the only one. The server writes it
        # once the response has gone out (serve/app.py AuthAndLog, in a `finally`), which can be after the
        # client has read the body: wait for it to reach the file.
        deadline = time.monotonic() + 10
        while '"path": "/v1/completions"' not in log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert log_path.read_text().count('"path": "/v1/completions"') == 1, log_path.read_text()[-2000:]
        # Warm-up's counters were reset: the metrics count this one request's prompt, not warm-up's.
        metrics = samples(httpx.get(f"{url}/metrics", timeout=10).text)
        assert metrics["tokenloom:prompt_tokens_total{model_name=tiny}"] == 3, metrics
        assert metrics["tokenloom:prefix_cache_queries_total{model_name=tiny}"] <= 3, metrics
        assert metrics["tokenloom:prefix_cache_hits_total{model_name=tiny}"] == 0, metrics
    finally:
        proc.terminate()
        proc.wait(30)
