"""Requests whose client is gone, and streams cut by the graceful-shutdown timeout.

A non-streaming request whose client hangs up is aborted in the engine (it used to run to max_tokens for
nobody). At `--graceful-timeout` expiry every in-flight stream ends with an error event and `[DONE]` (SSE)
or an error line (NDJSON), instead of being cut mid-stream.

The engine's steps are slowed (or held) here, so that each request would take far longer than the waits:
the assertions are about what happened (aborted, error event written), never about how fast.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import LiveServer
from tokenloom.netutil import free_port, wait_until_healthy

MAX_TOKENS = 200  # with STEP_DELAY_S a request would run for about 20 s
STEP_DELAY_S = 0.1
PROMPT = "Hello"


def slow_steps(engine: Any, delay: float = STEP_DELAY_S, paused: threading.Event | None = None) -> list[int]:
    """Make every engine step sleep first, and do nothing while `paused` is set (the loop still applies
    adds and aborts between them); returns a one-item list counting the steps taken."""
    core = engine.engine
    step = core.step
    count = [0]

    def slow() -> Any:
        time.sleep(delay)
        if paused is not None and paused.is_set():
            return []
        count[0] += 1
        return step()

    core.step = slow  # the loop thread calls self.engine.step()
    return count


def wait_for(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(0.05)


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


ABORTED = "tokenloom:request_success_total{finished_reason=abort}"

# (path, body): each would generate MAX_TOKENS tokens (Ollama has no ignore_eos: greedy on this prompt
# does not meet EOS within MAX_TOKENS with the tiny model, which test_ollama_prompt_runs_to_length checks).
NON_STREAMING = [
    ("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}],
                              "max_tokens": MAX_TOKENS, "ignore_eos": True}),
    ("/api/generate", {"model": "tiny", "prompt": PROMPT, "stream": False, "raw": True,
                       "options": {"temperature": 0, "num_predict": MAX_TOKENS}}),
    ("/api/chat", {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "stream": False,
                   "options": {"temperature": 0, "num_predict": MAX_TOKENS}}),
]


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[LiveServer]:
    srv = LiveServer(tiny_llama)
    yield srv
    srv.close()


def test_ollama_prompt_runs_to_length(server: LiveServer) -> None:
    """The premise of the Ollama cases below: undisturbed, these requests do run to num_predict."""
    for path, body in NON_STREAMING[2:]:
        r = httpx.post(server.url + path, json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["done_reason"] == "length"
        assert r.json()["eval_count"] == MAX_TOKENS


async def post_and_hang_up(url: str, path: str, body: dict[str, Any], after: float) -> bytes:
    """POST over a raw connection and close it after `after` seconds; returns whatever came back."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    data = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), after)
    except asyncio.TimeoutError:
        return b""
    finally:
        writer.close()


@pytest.mark.parametrize(("path", "body"), NON_STREAMING, ids=[p for p, _ in NON_STREAMING])
def test_non_streaming_request_aborted_when_client_disconnects(server: LiveServer, path: str,
                                                               body: dict[str, Any]) -> None:
    before = scrape(server.url).get(ABORTED, 0.0)
    steps = slow_steps(server.engine)
    try:
        got = asyncio.run(post_and_hang_up(server.url, path, body, after=1.5))
        assert got == b""  # nothing came back: the client left mid-request
        # The request leaves the engine: no stream, nothing running or waiting, finished as "abort".
        wait_for(lambda: server.engine.num_unfinished == 0)
        wait_for(lambda: not server.engine.call_soon(lambda e: e.has_unfinished_requests()).result(10))
        after = scrape(server.url)
        assert after[ABORTED] - before == 1
        assert after["tokenloom:num_requests_running{}"] == 0
        assert after["tokenloom:num_requests_waiting{}"] == 0
        assert steps[0] < MAX_TOKENS  # it never generated all its tokens
    finally:
        server.engine.engine.__dict__.pop("step", None)


def test_non_streaming_completion_unaffected(server: LiveServer) -> None:
    """The disconnect watch leaves a request whose client waits alone (it outlives several polls)."""
    slow_steps(server.engine, 0.02)
    try:
        r = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"model": "tiny", "prompt": PROMPT, "max_tokens": 60, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == 60
    finally:
        server.engine.engine.__dict__.pop("step", None)


# -- graceful-timeout expiry ------------------------------------------------------------------------

class GracefulServer:
    """`tokenloom serve`'s uvicorn (serve.server.build_server) in a thread; stop() is what SIGTERM does."""

    def __init__(self, model_dir: Path, graceful_timeout: float) -> None:
        from tokenloom.config import EngineConfig
        from tokenloom.engine.async_engine import AsyncLLMEngine
        from tokenloom.serve.app import build_app
        from tokenloom.serve.server import build_server

        self.engine = AsyncLLMEngine.from_config(EngineConfig(model=str(model_dir), dtype="float32",
                                                              kv_cache_memory="16MiB", max_model_len=256))
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = build_server(build_app(self.engine, "tiny"), "127.0.0.1", port, graceful_timeout)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until_healthy(self.url, timeout=30)

    def stop(self) -> None:
        self.server.should_exit = True

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.engine.shutdown()


async def read_stream(client: httpx.AsyncClient, path: str, body: dict[str, Any], started: asyncio.Event,
                      n_started: list[int], total: int) -> list[str]:
    lines: list[str] = []
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line:
                continue
            lines.append(line)
            if len(lines) == 2:  # tokens are flowing
                n_started[0] += 1
                if n_started[0] == total:
                    started.set()
    return lines


def test_graceful_timeout_ends_streams_with_error_event(tiny_llama: Path) -> None:
    srv = GracefulServer(tiny_llama, graceful_timeout=1.0)
    paused = threading.Event()  # set once every stream has started: none can finish before the timeout
    slow_steps(srv.engine, paused=paused)
    streams = [
        ("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                             "stream": True}),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}],
                                  "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}),
        ("/api/generate", {"model": "tiny", "prompt": PROMPT, "raw": True,
                           "options": {"temperature": 0, "num_predict": MAX_TOKENS}}),
        ("/api/chat", {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}],
                       "options": {"temperature": 0, "num_predict": MAX_TOKENS}}),
    ]

    async def main() -> tuple[list[list[str]], httpx.Response]:
        started, n_started = asyncio.Event(), [0]
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
            tasks = [asyncio.create_task(read_stream(c, p, b, started, n_started, len(streams))) for p, b in streams]
            whole = asyncio.create_task(c.post("/v1/completions", json={
                "model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True}))
            await asyncio.wait_for(started.wait(), 60)
            paused.set()
            srv.stop()  # SIGTERM: drain for 1 s, then the graceful timeout expires mid-stream
            return await asyncio.gather(*tasks), await whole

    try:
        (cmpl, chat, gen, ochat), whole = asyncio.run(main())
    finally:
        srv.close()
    for lines in (cmpl, chat):
        assert lines[-1] == "data: [DONE]"
        err = json.loads(lines[-2].removeprefix("data: "))
        assert err["error"]["code"] == 503 and err["error"]["type"] == "service_unavailable", err
        assert not any('"finish_reason": "length"' in line for line in lines)  # it really was cut short
    for lines in (gen, ochat):
        last = json.loads(lines[-1])
        assert set(last) == {"error"} and last["error"], last
        assert all(not json.loads(line).get("done") for line in lines[:-1])
    assert whole.status_code == 503
    assert whole.json()["error"]["type"] == "service_unavailable"
