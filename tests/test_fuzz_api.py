"""The standing adversarial suite: schemathesis generates requests from the served OpenAPI document (valid
ones, and ones that break the schema on purpose) against a live server, over every route.

Every answer must be documented (status code, content type, body schema), never a 5xx, and a request that
breaks the schema must be refused with a 4xx. Each request has a time limit (a hang fails the run).
Afterwards the engine is alive, serves a normal request, and holds no running or waiting sequence and no
KV block. Not checked: that every schema-valid request is accepted; some are refused for what a schema
cannot say (max_tokens past the context, token ids past the vocabulary, n past --max-n).

schemathesis runs as its own process (its command line, as a user would run it against a deployment), with
a fixed seed so a failure reproduces; FUZZ_EXAMPLES bounds the cases per route and phase.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import LiveServer

FUZZ_EXAMPLES = 100
SEED = 20261204
REQUEST_TIMEOUT_S = 30  # a request slower than this is a hang (the model is tiny, max_model_len 64)
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,"
          "response_headers_conformance,negative_data_rejection")
TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama: Path) -> Iterator[LiveServer]:
    # A small context and n bound every request's work, so thousands of them fit in the suite's time.
    srv = LiveServer(tiny_llama, max_model_len=64, max_n=4, max_waiting=64, max_request_bytes=1 << 20)
    yield srv
    srv.close()


def test_fuzz_every_route(fuzz_server: LiveServer, tmp_path: Path) -> None:
    cmd = [str(Path(sys.executable).parent / "schemathesis"), "run", fuzz_server.url + "/openapi.json",
           "--checks", CHECKS, "--max-examples", str(FUZZ_EXAMPLES), "--seed", str(SEED),
           "--request-timeout", str(REQUEST_TIMEOUT_S), "--generation-database", "none", "--no-color",
           "--report", "junit", "--report-dir", str(tmp_path)]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "fuzz_hooks",
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    engine = fuzz_server.engine.engine
    before = engine.get_stats()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    cases = re.search(r"(\d+) generated", out)
    after = engine.get_stats()
    generated = after["generated_tokens"] - before["generated_tokens"]
    print(f"\nschemathesis: {cases.group(0) if cases else '?'} test cases; exit {proc.returncode}; the engine "
          f"ran {after['steps'] - before['steps']} steps and generated {generated} tokens for them")
    assert proc.returncode == 0, out[-6000:]
    assert cases is not None and int(cases.group(1)) >= 500, out[-2000:]
    assert generated > 0, "no fuzzed request reached the engine (fuzz_hooks.py names the served model)"

    # The server came through whole: healthy, serving, nothing left running and no KV block held.
    assert httpx.get(fuzz_server.url + "/health", timeout=10).status_code == 200
    r = httpx.post(fuzz_server.url + "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 4,
                                                              "ignore_eos": True}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    deadline = time.monotonic() + 10
    # Streams the fuzzer left are aborted and reaped by the engine loop within a step or two.
    while (engine.scheduler.has_unfinished() or engine.kv.pool.num_used) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (engine.scheduler.num_running, engine.scheduler.num_waiting, engine.kv.pool.num_used) == (0, 0, 0)
