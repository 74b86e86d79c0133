"""The router in front of real `tokenloom serve` workers (tiny model, child processes): streams pass through
unchanged; kill -9 of one of three workers under load; a slow worker does not hold up the others."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import pytest

from router_helpers import FakeWorker, WorkerProcess, long_tiny_model, router_metrics, start_router

pytestmark = pytest.mark.cluster  # real worker processes


@pytest.fixture(scope="module")
def three_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[WorkerProcess]]:
    model = long_tiny_model(tmp_path_factory.mktemp("tiny-2k"))
    logs = tmp_path_factory.mktemp("worker-logs")
    ws = [WorkerProcess(model, logs).start() for _ in range(3)]  # they load in parallel
    try:
        for w in ws:
            w.wait()
        yield ws
    finally:
        for w in ws:
            w.stop()


def sse_events(url: str, path: str, body: dict[str, object]) -> list[dict[str, object]]:
    """The stream's events with what differs between two runs (ids, times) left out."""
    with httpx.stream("POST", url + path, json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [x for x in r.iter_lines() if x]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(x[6:]) for x in lines[:-1]]
    return [{"choices": e["choices"], "usage": e.get("usage")} for e in events]


def ndjson_pieces(url: str, body: dict[str, object]) -> list[tuple[str, bool, object]]:
    with httpx.stream("POST", url + "/api/generate", json=body, timeout=120) as r:
        assert r.status_code == 200
        objs = [json.loads(x) for x in r.iter_lines() if x]
    return [(o["response"], o["done"], o.get("eval_count")) for o in objs]


def test_streams_through_the_router_equal_a_direct_worker(three_workers: list[WorkerProcess]) -> None:
    direct = three_workers[0].url
    router = start_router([w.url for w in three_workers], policy="round_robin")
    try:
        comp = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0, "stream": True,
                "ignore_eos": True, "logprobs": 1, "stream_options": {"include_usage": True}}
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 16, "temperature": 0, "stream": True, "ignore_eos": True}
        gen = {"model": "tiny", "prompt": "Once upon a time", "raw": True, "options": {"num_predict": 12, "temperature": 0}}
        want_comp = sse_events(direct, "/v1/completions", comp)
        want_chat = sse_events(direct, "/v1/chat/completions", chat)
        want_gen = ndjson_pieces(direct, gen)
        for _ in range(3):  # round robin: each worker once
            assert sse_events(router.url, "/v1/completions", comp) == want_comp
            assert sse_events(router.url, "/v1/chat/completions", chat) == want_chat
            assert ndjson_pieces(router.url, gen) == want_gen
        assert len(want_comp) == 25 and want_comp[-1]["usage"]["completion_tokens"] == 24  # type: ignore[index]
        for path in ("/v1/models", "/api/tags", "/api/version"):
            assert httpx.get(router.url + path).json() == httpx.get(direct + path).json()
        tok = {"model": "tiny", "prompt": "hello there"}
        assert httpx.post(router.url + "/tokenize", json=tok).json() == httpx.post(direct + "/tokenize", json=tok).json()
        m = router_metrics(router)
        for w in three_workers:
            assert m[f"tokenloom:router_requests_total{{code=200,worker={w.url}}}"] >= 3
            assert m[f"tokenloom:router_time_to_first_byte_seconds_count{{worker={w.url}}}"] >= 3
    finally:
        router.close()


async def _long_stream(c: httpx.AsyncClient, i: int, started: asyncio.Event) -> list[str]:
    body = {"model": "tiny", "prompt": f"stream number {i}", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    lines: list[str] = []
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line:
                lines.append(line)
                started.set()
    return lines


async def _whole(c: httpx.AsyncClient, i: int, max_tokens: int) -> httpx.Response:
    body = {"model": "tiny", "prompt": f"request number {i}", "max_tokens": max_tokens, "ignore_eos": True}
    return await c.post("/v1/completions", json=body)


def test_kill_one_of_three_under_load(three_workers: list[WorkerProcess]) -> None:
    victim = three_workers[0]
    router = start_router([w.url for w in three_workers], policy="round_robin", health_interval=0.25)
    pool = router.app.state.pool
    try:
        async def under_load() -> tuple[list[list[str]], list[httpx.Response], list[httpx.Response]]:
            async with httpx.AsyncClient(base_url=router.url, timeout=120) as c:
                started = [asyncio.Event() for _ in range(6)]
                streams = [asyncio.create_task(_long_stream(c, i, started[i])) for i in range(6)]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
                # Long non-streaming requests: they send nothing until done, so a kill leaves them unstarted.
                whole = [asyncio.create_task(_whole(c, i, 600)) for i in range(6)]
                deadline = time.monotonic() + 60
                # Until every request reached its worker (the tasks start in turn, not at once).
                while sum(w.outstanding for w in pool.workers) < 12 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert [w.outstanding for w in pool.workers] == [4, 4, 4]  # round robin: 2 + 2 each
                victim.kill()
                after = [asyncio.create_task(_whole(c, 100 + i, 8)) for i in range(6)]
                # No hang: everything returns (the generous bound only turns a hang into a failure).
                return await asyncio.wait_for(asyncio.gather(asyncio.gather(*streams), asyncio.gather(*whole),
                                                             asyncio.gather(*after)), 300)

        streams, whole, after = asyncio.run(under_load())
        broken = [s for s in streams if any('"error"' in x for x in s)]
        assert len(broken) == 2  # the victim's two started streams end with an error event ...
        for s in broken:
            assert json.loads(s[-2][6:])["error"]["type"] == "upstream_error" and s[-1] == "data: [DONE]"
        for s in streams:
            if s not in broken:  # ... the others run to their end
                assert s[-1] == "data: [DONE]" and json.loads(s[-2][6:])["choices"][0]["finish_reason"] == "length"
        for r in whole + after:  # unstarted requests were retried elsewhere and succeeded
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        assert [r.json()["usage"]["completion_tokens"] for r in whole] == [600] * 6
        m = router_metrics(router)
        assert m[f"tokenloom:router_retries_total{{worker={victim.url}}}"] >= 2
        assert m[f"tokenloom:router_errors_total{{kind=stream_broken,worker={victim.url}}}"] == 2
        assert m[f"tokenloom:router_errors_total{{kind=disconnect,worker={victim.url}}}"] >= 2
        deadline = time.monotonic() + 30
        while pool.workers[0].healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        assert router_metrics(router)[f"tokenloom:router_worker_up{{worker={victim.url}}}"] == 0
        assert httpx.get(router.url + "/health").json()["workers"][0]["healthy"] is False

        victim.start().wait()  # the same port again
        deadline = time.monotonic() + 30
        while not pool.workers[0].healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        before = router_metrics(router).get(f"tokenloom:router_requests_total{{code=200,worker={victim.url}}}", 0)
        assert all(httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                              timeout=60).status_code == 200 for _ in range(3))
        m = router_metrics(router)
        assert m[f"tokenloom:router_worker_up{{worker={victim.url}}}"] == 1
        assert m[f"tokenloom:router_requests_total{{code=200,worker={victim.url}}}"] == before + 1  # back in turn
    finally:
        router.close()
        victim.start().wait() if victim.proc is not None and victim.proc.poll() is not None else None


def test_a_slow_worker_does_not_hold_up_the_others(three_workers: list[WorkerProcess]) -> None:
    slow = FakeWorker("slow", "block")
    router = start_router([slow.url, three_workers[1].url, three_workers[2].url], policy="least_outstanding")
    try:
        async def load() -> tuple[list[httpx.Response], int]:
            async with httpx.AsyncClient(base_url=router.url, timeout=120) as c:
                tasks = [asyncio.create_task(_whole(c, i, 16)) for i in range(9)]
                deadline = time.monotonic() + 60
                # Until every request not held by the slow worker has its answer.
                while (slow.hits == 0 or sum(t.done() for t in tasks) < len(tasks) - slow.hits) and \
                        time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                held = slow.hits
                done_while_held = [t.result() for t in tasks if t.done()]
                assert not slow.release.is_set() and len(done_while_held) == len(tasks) - held
                slow.release.set()
                await asyncio.wait_for(asyncio.gather(*tasks), 60)
                return done_while_held, held

        done, held = asyncio.run(load())
        assert 1 <= held <= 3 and all(r.status_code == 200 and "choices" in r.json() for r in done)
    finally:
        router.close()
        slow.close()
