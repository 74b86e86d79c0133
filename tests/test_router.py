"""The router: policies and routing keys (pure Python), and its behaviour against fake workers (429, 503,
4xx, dead ports, broken and hung streams, pass-through, auth)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fastapi import Request

from router_helpers import FakeWorker, router_metrics, start_router
from tokenloom.errors import ConfigError
from tokenloom.netutil import free_port
from tokenloom.router.config import RouterConfig
from tokenloom.router.policies import CacheAware, LeastOutstanding, RoundRobin
from tokenloom.router.prefix import prompt_text, routing_key
from tokenloom.router.workers import Worker, WorkerPool
from tokenloom.secrets_file import SecretFiles, read_secret


def workers(*outstanding: int) -> list[Worker]:
    return [Worker(f"http://w{i}", i, healthy=True, outstanding=n) for i, n in enumerate(outstanding)]


# --- policies and routing keys -------------------------------------------------------------------------


def test_round_robin_cycles() -> None:
    ws, rr = workers(5, 0, 0), RoundRobin()
    assert [rr.choose(ws, ()).url for _ in range(4)] == ["http://w0", "http://w1", "http://w2", "http://w0"]
    assert rr.choose([ws[0], ws[2]], ()).url == "http://w2"  # w1 is skipped, w2's turn is kept
    assert rr.choose(ws, ()).url == "http://w0"


def test_least_outstanding_picks_the_least_loaded_and_rotates_ties() -> None:
    lo = LeastOutstanding()
    assert lo.choose(workers(3, 1, 2), ()).url == "http://w1"
    idle = workers(0, 0, 0)
    assert {lo.choose(idle, ()).url for _ in range(3)} == {"http://w0", "http://w1", "http://w2"}


def key(text: str) -> tuple[bytes, ...]:
    return routing_key(text, 8, 100)


def test_cache_aware_follows_the_prefix_within_the_margin() -> None:
    ca = CacheAware(margin=2, table_size=1000)
    ws = workers(0, 0, 0)
    system = "You are a helpful assistant. " * 4
    first = ca.choose(ws, key(system + "Q1"))
    first.outstanding += 2  # busier than the others, but within the margin
    assert ca.choose(ws, key(system + "Q1 A1 Q2")) is first  # the conversation goes on where it started
    other = ca.choose(ws, key("a completely different prompt that shares nothing"))
    assert other is not first and other.outstanding == 0
    first.outstanding += 1  # now 3 above the least loaded: over the margin
    moved = ca.choose(ws, key(system + "Q3"))
    assert moved is not first
    assert ca.choose(ws, key(system + "Q4")) is moved  # the prefix now belongs to the new worker


def test_cache_aware_skips_an_owner_that_is_not_a_candidate_and_forgets_the_oldest() -> None:
    ca = CacheAware(margin=4, table_size=3)
    ws = workers(0, 0)
    owner = ca.choose(ws, key("shared prefix here"))
    rest = [w for w in ws if w is not owner]
    assert ca.choose(rest, key("shared prefix here")) is rest[0]  # e.g. the owner is down
    assert ca.owner(key("shared prefix here")) == rest[0].url
    ca.choose(ws, key("0123456789abcdefghijklmnopqrstuvwxyz"))  # 5 chunks: the table keeps 3
    assert ca.owner(key("shared prefix here")) is None


def test_routing_key_is_chained_over_the_prompt_prefix() -> None:
    short, longer = key("abcdefgh12345678"), key("abcdefgh12345678tail")
    assert longer[:2] == short and len(longer) == 3
    assert key("xbcdefgh12345678")[1] != short[1]  # chunk 2's hash covers chunk 1 too
    assert routing_key("", 8, 10) == () and len(routing_key("a" * 100, 8, 4)) == 4


def test_prompt_text_of_each_api() -> None:
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert prompt_text(json.dumps(chat).encode()) == "system\x1fS\x1euser\x1fhi\x1e"
    assert prompt_text(b'{"prompt": "p", "system": "s"}') == "sp"
    assert prompt_text(b'{"prompt": [[1, 2], [3]]}') == "1 2"
    assert prompt_text(b'{"prompt": [5, 6]}') == "5 6"
    assert prompt_text(b"not json") is None and prompt_text(b"[1]") is None


def test_config_validation() -> None:
    assert RouterConfig(workers=("http://a:1/",)).workers == ("http://a:1",)
    for bad in [dict(workers=()), dict(workers=("a:1",)), dict(workers=("http://a", "http://a/")),
                dict(workers=("http://a",), policy="random"), dict(workers=("http://a",), max_retries=-1),
                dict(workers=("http://a",), health_interval=0)]:
        with pytest.raises(ConfigError):
            RouterConfig(**bad)  # type: ignore[arg-type]


def test_worker_pool_takes_out_and_lets_back_in() -> None:
    changes: list[tuple[str, bool]] = []
    pool = WorkerPool(("http://a", "http://b"), unhealthy_after=2, on_change=lambda w: changes.append((w.url, w.healthy)))
    a, b = pool.workers
    pool.mark_up(a)
    pool.mark_up(b)
    pool.mark_failure(a, "timeout")
    assert a.healthy and pool.available() == [a, b]
    pool.mark_failure(a, "timeout")
    assert not a.healthy and pool.available() == [b] and pool.available({"http://b"}) == []
    pool.mark_up(a)
    assert a.healthy and a.consecutive_failures == 0 and changes[-1] == ("http://a", True)


def test_cluster_passes_engine_flags_to_workers() -> None:
    from tokenloom.cli import build_parser
    from tokenloom.router.cli import worker_argv

    args = build_parser().parse_args(["cluster", "--workers", "2", "--model", "m", "--kv-cache-memory", "1GiB",
                                      "--no-prefix-caching", "--api-key", "k", "--port", "9000"])
    argv = worker_argv(args)
    assert argv[:5] == ["--model", "m", "--kv-cache-memory", "1GiB", "--no-prefix-caching"]
    assert "--dtype" not in argv and argv[argv.index("--api-key") + 1] == "k"
    # What `tokenloom cluster` runs: the key goes through a private file, never the workers' command lines.
    files = SecretFiles()
    try:
        argv = worker_argv(args, files)
        assert "k" not in argv and "--api-key" not in argv
        path = Path(argv[argv.index("--api-key-file") + 1])
        assert path.read_text() == "k" and path.stat().st_mode & 0o777 == 0o600
        assert files.folder.stat().st_mode & 0o777 == 0o700
    finally:
        files.close()
    assert not path.exists()


def test_cluster_worker_ports_are_distinct_and_never_the_routers(monkeypatch: pytest.MonkeyPatch) -> None:
    import tokenloom.netutil as netutil

    # The OS hands out 8000 (the router's port, chosen but not yet bound) and 8001 twice.
    handed = iter([8000, 8001, 8001, 8000, 8002])
    monkeypatch.setattr(netutil, "free_port", lambda: next(handed))
    assert netutil.free_ports(2, {8000}) == [8001, 8002]


def test_cluster_refuses_a_missing_step_trace_dir(tmp_path: Path) -> None:
    from tokenloom.cli import build_parser

    args = build_parser().parse_args(["cluster", "--model", "m", "--step-trace-dir", str(tmp_path / "absent")])
    with pytest.raises(ConfigError, match="--step-trace-dir"):  # before any worker starts
        args.func(args)


def test_secret_files_are_read_and_checked(tmp_path: Path) -> None:
    f = tmp_path / "key"
    f.write_text("s3cret\n")
    assert read_secret(None, str(f), "api-key") == "s3cret" and read_secret("v", None, "api-key") == "v"
    assert read_secret(None, None, "api-key") is None
    for value, path in (("v", str(f)), (None, str(tmp_path / "missing")), (None, str(tmp_path / "empty"))):
        (tmp_path / "empty").write_text(" \n")
        with pytest.raises(ConfigError, match="api-key"):
            read_secret(value, path, "api-key")


# --- against fake workers ------------------------------------------------------------------------------


@pytest.fixture
def fakes() -> Iterator[list[FakeWorker]]:
    made: list[FakeWorker] = []
    yield made
    for f in made:
        f.close()


def fake(fakes: list[FakeWorker], mode: str = "ok") -> FakeWorker:
    f = FakeWorker(f"f{len(fakes)}", mode)
    fakes.append(f)
    return f


BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 4}


def test_round_robin_through_the_router(fakes: list[FakeWorker]) -> None:
    fs = [fake(fakes) for _ in range(3)]
    router = start_router([f.url for f in fs], policy="round_robin")
    try:
        got = [httpx.post(router.url + "/v1/completions", json=BODY).json()["worker"] for _ in range(6)]
        assert sorted(got) == ["f0", "f0", "f1", "f1", "f2", "f2"]
        assert all(f.hits == 2 for f in fs)
    finally:
        router.close()


def test_all_workers_full_is_429_with_retry_after(fakes: list[FakeWorker]) -> None:
    fs = [fake(fakes, "full") for _ in range(2)]
    router = start_router([f.url for f in fs])
    try:
        r = httpx.post(router.url + "/v1/completions", json=BODY)
        assert r.status_code == 429 and r.headers["retry-after"] == "7"
        assert r.json()["error"]["type"] == "rate_limit_exceeded"
        r = httpx.post(router.url + "/api/generate", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 429 and isinstance(r.json()["error"], str)
        assert all(f.hits == 2 for f in fs)
        m = router_metrics(router)
        assert m["tokenloom:router_responses_total{code=429}"] == 2
        assert m[f"tokenloom:router_errors_total{{kind=full,worker={fs[0].url}}}"] == 2
    finally:
        router.close()


def test_full_or_dead_worker_is_retried_on_another(fakes: list[FakeWorker]) -> None:
    full, dead, ok = fake(fakes, "full"), fake(fakes, "dead"), fake(fakes)
    # No periodic checks: the fakes' /health answers 200, and a check between the 503 and the metrics read
    # below would let `dead` back in (a flake on a loaded machine).
    router = start_router([full.url, dead.url, ok.url], policy="round_robin", max_retries=2, health_interval=60)
    try:
        r = httpx.post(router.url + "/v1/completions", json=BODY)  # full -> dead -> ok
        assert r.status_code == 200 and r.json() == {"worker": ok.name}
        m = router_metrics(router)
        assert m[f"tokenloom:router_retries_total{{worker={full.url}}}"] == 1
        assert m[f"tokenloom:router_retries_total{{worker={dead.url}}}"] == 1
        assert m[f"tokenloom:router_errors_total{{kind=http_5xx,worker={dead.url}}}"] == 1
        assert m[f"tokenloom:router_requests_total{{code=200,worker={ok.url}}}"] == 1
        assert m["tokenloom:router_responses_total{code=200}"] == 1
        assert m[f"tokenloom:router_worker_up{{worker={dead.url}}}"] == 0  # 503: out until /health says 200
    finally:
        router.close()


def test_max_retries_bounds_the_tries(fakes: list[FakeWorker]) -> None:
    fs = [fake(fakes, "dead") for _ in range(3)]
    router = start_router([f.url for f in fs], max_retries=1, health_interval=60)
    try:
        r = httpx.post(router.url + "/v1/completions", json=BODY)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert sum(f.hits for f in fs) == 2
    finally:
        router.close()


def test_client_errors_pass_through_unretried(fakes: list[FakeWorker]) -> None:
    bad, ok = fake(fakes, "bad"), fake(fakes)
    router = start_router([bad.url, ok.url], policy="round_robin")
    try:
        r = httpx.post(router.url + "/v1/completions", json=BODY)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        assert ok.hits == 0
    finally:
        router.close()


def test_no_listening_worker_is_503_and_a_refused_one_is_skipped(fakes: list[FakeWorker]) -> None:
    nobody = f"http://127.0.0.1:{free_port()}"
    router = start_router([nobody], ready_path="/metrics")
    try:
        assert httpx.get(router.url + "/health").status_code == 503
        r = httpx.post(router.url + "/v1/chat/completions", json={"model": "tiny", "messages": []})
        assert r.status_code == 503 and r.json()["error"]["message"] == "no healthy worker"
        assert router_metrics(router)["tokenloom:router_responses_total{code=503}"] == 1
    finally:
        router.close()
    ok = fake(fakes)
    # A long health interval: the refused worker is found out by the request itself.
    router = start_router([nobody, ok.url], policy="round_robin", health_interval=60)
    try:
        router.app.state.pool.workers[0].healthy = True  # as if it died after its last check
        assert [httpx.post(router.url + "/v1/completions", json=BODY).status_code for _ in range(2)] == [200, 200]
        m = router_metrics(router)
        assert m[f"tokenloom:router_errors_total{{kind=connect,worker={nobody}}}"] == 1
        assert m[f"tokenloom:router_worker_up{{worker={nobody}}}"] == 0 and ok.hits == 2
    finally:
        router.close()


def stream_lines(url: str, path: str, body: dict[str, object], **kw: object) -> list[str]:
    with httpx.stream("POST", url + path, json=body, timeout=60, **kw) as r:  # type: ignore[arg-type]
        assert r.status_code == 200
        return [line for line in r.iter_lines() if line]


def test_broken_stream_ends_with_an_error_event(fakes: list[FakeWorker]) -> None:
    f = fake(fakes, "break")
    router = start_router([f.url])
    try:
        lines = stream_lines(router.url, "/v1/completions", {**BODY, "stream": True})
        assert [json.loads(x[6:])["i"] for x in lines[:2]] == [0, 1]
        assert json.loads(lines[2][6:])["error"]["type"] == "upstream_error" and lines[3] == "data: [DONE]"
        assert len(lines) == 4
        lines = stream_lines(router.url, "/api/generate", {"model": "tiny", "prompt": "x"})
        assert [json.loads(x).get("i") for x in lines[:2]] == [0, 1] and "error" in json.loads(lines[2])
        m = router_metrics(router)
        assert m[f"tokenloom:router_errors_total{{kind=stream_broken,worker={f.url}}}"] == 2
    finally:
        router.close()


def test_a_worker_silent_mid_stream_times_out_with_an_error_event(fakes: list[FakeWorker]) -> None:
    f = fake(fakes, "hang")
    router = start_router([f.url], read_timeout=1.0)
    try:
        lines = stream_lines(router.url, "/v1/chat/completions", {"model": "tiny", "messages": [], "stream": True})
        assert json.loads(lines[0][6:])["i"] == 0
        assert "error" in json.loads(lines[1][6:]) and lines[-1] == "data: [DONE]"
        assert not f.released_by_test
    finally:
        router.close()


def test_streams_pass_through_chunk_by_chunk(fakes: list[FakeWorker]) -> None:
    f = fake(fakes, "step")
    router = start_router([f.url])
    try:
        with httpx.stream("POST", router.url + "/v1/completions", json={**BODY, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            assert json.loads(next(lines)[6:])["i"] == 0  # arrives while the worker still holds the rest
            f.release.set()
            rest = [x for x in lines if x]
        assert f.released_by_test and rest[-1] == "data: [DONE]" and len(rest) == 3
    finally:
        router.close()


def test_a_blocked_worker_does_not_hold_up_the_others_and_hangups_release(fakes: list[FakeWorker]) -> None:
    slow, fast = fake(fakes, "block"), fake(fakes)
    router = start_router([slow.url, fast.url], policy="least_outstanding")
    pool = router.app.state.pool
    try:
        with httpx.Client(base_url=router.url, timeout=60) as c:
            import threading

            stuck = threading.Thread(target=lambda: c.post("/v1/completions", json=BODY))
            stuck.start()
            deadline = time.monotonic() + 30
            while pool.workers[0].outstanding + pool.workers[1].outstanding == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            if pool.workers[1].outstanding:  # the first went to the fast one: the next one goes to the slow
                stuck2 = threading.Thread(target=lambda: c.post("/v1/completions", json=BODY))
                stuck2.start()
            while slow.hits == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            answers = [c.post("/v1/completions", json=BODY).json()["worker"] for _ in range(5)]
            assert answers == ["f1"] * 5 and not slow.release.is_set()  # all done while the slow one waits
            assert pool.workers[0].outstanding == 1
            slow.release.set()
            stuck.join(30)
        # A client that hangs up mid-stream frees its worker slot.
        slow.mode = "step"
        slow.release.clear()
        with httpx.stream("POST", router.url + "/v1/completions", json={**BODY, "stream": True}, timeout=60) as r:
            next(r.iter_lines())
        deadline = time.monotonic() + 30
        while any(w.outstanding for w in pool.workers) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [w.outstanding for w in pool.workers] == [0, 0]
    finally:
        router.close()


def test_router_api_key_and_forwarded_headers(fakes: list[FakeWorker]) -> None:
    f = fake(fakes)
    router = start_router([f.url], api_key="sekrit")
    try:
        r = httpx.post(router.url + "/v1/completions", json=BODY)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(router.url + "/api/chat", json={"model": "tiny", "messages": [], "stream": False})
        assert r.status_code == 401 and isinstance(r.json()["error"], str)
        assert httpx.get(router.url + "/metrics").status_code == 200 and f.hits == 0
        r = httpx.post(router.url + "/v1/completions?x=1", json=BODY,
                       headers={"Authorization": "Bearer sekrit", "x-request-id": "req-7"})
        assert r.status_code == 200
        assert f.seen_headers[-1]["authorization"] == "Bearer sekrit" and f.seen_headers[-1]["x-request-id"] == "req-7"
    finally:
        router.close()


def test_cache_aware_sends_a_conversation_back_to_its_worker(fakes: list[FakeWorker]) -> None:
    fs = [fake(fakes) for _ in range(3)]
    router = start_router([f.url for f in fs], policy="cache_aware")
    try:
        def ask(messages: list[dict[str, str]]) -> str:
            r = httpx.post(router.url + "/v1/chat/completions", json={"model": "tiny", "messages": messages})
            return str(r.json()["worker"])

        convo = [{"role": "system", "content": "You are a careful assistant who answers briefly. " * 3},
                 {"role": "user", "content": "Q1"}]
        first = ask(convo)
        for turn in range(2, 5):
            convo += [{"role": "assistant", "content": f"A{turn - 1}"}, {"role": "user", "content": f"Q{turn}"}]
            assert ask(convo) == first
        # Unrelated conversations on an idle cluster spread over every worker.
        assert {ask([{"role": "user", "content": f"conversation {i} " * 20}]) for i in range(3)} == {"f0", "f1", "f2"}
    finally:
        router.close()


def test_router_command_serves_and_exits_zero_on_sigterm(fakes: list[FakeWorker]) -> None:
    import signal
    import subprocess
    import sys

    from tokenloom.netutil import wait_until_healthy

    f = fake(fakes)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tokenloom.cli", "router", "--worker", f.url + "/", "--port", str(port),
                             "--policy", "round_robin", "--health-interval", "0.5"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, timeout=60, alive=lambda: proc.poll() is None)
        assert httpx.post(url + "/api/generate", json={"model": "tiny", "prompt": "x", "stream": False}).json() == {"worker": "f0"}
        assert httpx.get(url + "/health").json()["workers"] == [{"url": f.url, "healthy": True, "outstanding": 0}]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def _split_fakes() -> tuple[object, list[object], list[list[str]]]:
    """A fake decode worker (with a KV address) and two fake prefill workers that log the prompts sent."""
    from fastapi import FastAPI

    from router_helpers import ThreadServer

    decode = FastAPI()
    decode.get("/health")(lambda: {"status": "ok", "role": "decode", "kv_address": "tcp://127.0.0.1:1"})
    decode.post("/v1/completions")(lambda: {"choices": [{"text": "ok"}]})
    seen: list[list[str]] = [[], []]
    prefills = []
    for i in range(2):
        app = FastAPI()
        app.get("/health")(lambda: {"status": "ok", "role": "prefill"})

        def handler(log: list[str]):  # type: ignore[no-untyped-def]
            async def prefill(request: Request) -> dict[str, int]:
                body = await request.json()
                log.append(body["request"]["prompt"] if body["kv_target"] == "tcp://127.0.0.1:1" else "wrong target")
                return {"bytes": 100}
            return prefill

        app.post("/internal/kv/prefill")(handler(seen[i]))
        prefills.append(ThreadServer(app))
    return ThreadServer(decode), prefills, seen


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin"])
def test_prefill_worker_choice_follows_the_policy(policy: str) -> None:
    decode, prefills, seen = _split_fakes()
    router = start_router([decode.url], prefill_workers=tuple(p.url for p in prefills), policy=policy)  # type: ignore[attr-defined]
    try:
        prompts = ["A" * 300 + " first question", "B" * 300 + " other", "A" * 300 + " second question",
                   "A" * 300 + " third question"]
        for p in prompts:
            r = httpx.post(router.url + "/v1/completions", json={"model": "m", "prompt": p}, timeout=30)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
        assert sorted(len(s) for s in seen) == ([1, 3] if policy == "cache_aware" else [2, 2]), seen
        if policy == "cache_aware":  # every "A..." prompt went to the prefill worker that has its prefix
            assert all(p.startswith("A") for p in max(seen, key=len))
        m = router_metrics(router)
        assert sum(v for k, v in m.items() if k.startswith("tokenloom:router_kv_prefills_total") and "outcome=ok" in k) == 4
    finally:
        router.close()
        decode.close()  # type: ignore[attr-defined]
        for p in prefills:
            p.close()  # type: ignore[attr-defined]
