"""Workers found at run time: the pool following a changing set (added, removed with requests in flight),
`--worker-discovery dns:NAME:PORT` against fake DNS answers (also through a running router), and the
autoscaling decisions of `tokenloom ray-serve` on given loads. No model, no Ray."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest

from router_helpers import FakeWorker, ThreadServer
from tokenloom.distributed.autoscale import Autoscaler, Load, parse_load
from tokenloom.distributed.config import AutoscaleConfig, RayServeConfig
from tokenloom.errors import ConfigError
from tokenloom.netutil import free_port
from tokenloom.router.app import build_router_app
from tokenloom.router.config import RouterConfig
from tokenloom.router.discovery import CallableDiscovery, DnsDiscovery, parse_discovery
from tokenloom.router.workers import WorkerPool


class FakeDns:
    """A resolver whose answer a test sets: a list of addresses, or an OSError to raise."""

    def __init__(self, answer: list[str] | OSError) -> None:
        self.answer = answer
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        if isinstance(self.answer, OSError):
            raise self.answer
        return list(self.answer)


def test_dns_answers_become_sorted_unique_urls() -> None:
    dns = FakeDns(["10.0.0.12", "10.0.0.3", "10.0.0.12", "fd00::5"])
    d = DnsDiscovery("workers.ns.svc.cluster.local", 8000, resolve=dns)
    assert asyncio.run(d.urls()) == ("http://10.0.0.3:8000", "http://10.0.0.12:8000", "http://[fd00::5]:8000")
    assert dns.asked == [("workers.ns.svc.cluster.local", 8000)]
    assert parse_discovery("dns:w.default.svc:8001") == DnsDiscovery("w.default.svc", 8001)
    assert parse_discovery("dns+https:w:443").scheme == "https"
    for bad in ("dns:w", "dns::8000", "srv:w:8000", "dns:w:0", "dns:w:http", "w:8000"):
        with pytest.raises(ConfigError, match="expected dns:NAME:PORT"):
            parse_discovery(bad)
    with pytest.raises(ConfigError, match="one or the other"):
        RouterConfig(workers=("http://a:1",), worker_discovery="dns:w:8000")
    with pytest.raises(ConfigError, match="--worker-discovery"):
        RouterConfig(workers=(), worker_discovery="dns:w")
    with pytest.raises(ConfigError, match="discovery-interval"):
        RouterConfig(workers=(), worker_discovery="dns:w:8000", discovery_interval=0)


def test_the_pool_follows_a_changing_set_and_counts_removed_workers_in_flight() -> None:
    pool = WorkerPool(("http://a:1",), unhealthy_after=2)
    a = pool.workers[0]
    pool.mark_up(a)
    pool.acquire(a)
    added = pool.set_urls(("http://b:1", "http://c:1"))
    assert [w.url for w in added] == ["http://b:1", "http://c:1"] and [w.index for w in added] == [1, 2]
    assert not any(w.healthy for w in added)  # in routing only after their first check
    assert not pool.routes_to("http://a:1") and pool.available() == []
    assert pool.outstanding_of("http://a:1") == 1 and "http://a:1" in pool.retired  # still streaming
    pool.mark_up(a)  # a check that was in flight when it was removed: it stays out
    assert pool.available() == [] and not a.healthy
    pool.release(a)
    assert pool.outstanding_of("http://a:1") == 0 and pool.retired == {}
    assert pool.set_urls(("http://b:1", "http://c:1")) == []  # no change: nothing added
    pool.set_urls(("http://c:1", "http://a:1"))
    assert [(w.url, w.index) for w in pool.workers] == [("http://c:1", 2), ("http://a:1", 3)]


def _fake_worker_on(host: str, port: int, name: str) -> FakeWorker | None:
    try:
        return FakeWorker(name, host=host, port=port)
    except (OSError, SystemExit, TimeoutError):  # uvicorn exits when it cannot bind
        return None


def test_the_router_follows_dns_answers() -> None:
    port = free_port()
    # Two "pods" with one port, on two loopback addresses (all of 127/8 is loopback on Linux).
    w1 = FakeWorker("one", host="127.0.0.1", port=port)
    w2 = _fake_worker_on("127.0.0.2", port, "two")
    if w2 is None:
        w1.close()
        pytest.skip("127.0.0.2 is not a loopback address here")
    dns = FakeDns(["127.0.0.1"])
    config = RouterConfig(workers=(), worker_discovery=f"dns:workers.test:{port}", discovery_interval=0.05,
                          health_interval=0.05, policy="round_robin")
    router = ThreadServer(build_router_app(config, discovery=DnsDiscovery("workers.test", port, resolve=dns)))
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}

    def served_by(n: int) -> list[str]:
        return [httpx.post(router.url + "/v1/completions", json=body).json()["model"] for _ in range(n)]

    def wait_routed(urls: set[str]) -> None:
        deadline = time.monotonic() + 30
        while {w["url"] for w in httpx.get(router.url + "/health").json()["workers"] if w["healthy"]} != urls:
            assert time.monotonic() < deadline, httpx.get(router.url + "/health").json()
            time.sleep(0.02)

    try:
        hits = (w1.hits, w2.hits)
        for _ in range(4):
            assert httpx.post(router.url + "/v1/completions", json=body).status_code == 200
        assert (w1.hits - hits[0], w2.hits - hits[1]) == (4, 0)
        dns.answer = ["127.0.0.2", "127.0.0.1"]  # scaled up: a second pod is ready
        wait_routed({w1.url, w2.url})
        hits = (w1.hits, w2.hits)
        for _ in range(4):
            assert httpx.post(router.url + "/v1/completions", json=body).status_code == 200
        assert (w1.hits - hits[0], w2.hits - hits[1]) == (2, 2)  # round robin over both
        dns.answer = socket.gaierror(socket.EAI_NONAME, "Name or service not known")  # a DNS hiccup
        time.sleep(0.3)
        wait_routed({w1.url, w2.url})  # the last answer is kept
        dns.answer = ["127.0.0.2"]  # the first pod went away
        wait_routed({w2.url})
        hits = (w1.hits, w2.hits)
        for _ in range(3):
            assert httpx.post(router.url + "/v1/completions", json=body).status_code == 200
        assert (w1.hits - hits[0], w2.hits - hits[1]) == (0, 3)
        m = httpx.get(router.url + "/metrics").text
        assert f'tokenloom:router_worker_up{{worker="{w1.url}"}} 0.0' in m
        assert all(h == ("workers.test", port) for h in dns.asked)
    finally:
        router.close()
        w1.close()
        w2.close()


def test_a_router_with_no_worker_found_yet_answers_503_then_serves() -> None:
    w = FakeWorker("one")
    found: list[str] = []
    config = RouterConfig(workers=(), worker_discovery="external", discovery_interval=0.05, health_interval=0.05)
    router = ThreadServer(build_router_app(config, discovery=CallableDiscovery(lambda: found)), ready_path="/metrics")
    try:
        r = httpx.post(router.url + "/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["message"]
        found.append(w.url + "/")
        deadline = time.monotonic() + 30
        while httpx.get(router.url + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert httpx.post(router.url + "/v1/completions", json={"model": "m", "prompt": "x"}).status_code == 200
    finally:
        router.close()
        w.close()
    with pytest.raises(ConfigError, match="only a program that embeds the router"):
        build_router_app(RouterConfig(workers=(), worker_discovery="external"))


def test_autoscaling_decisions_follow_the_measured_load() -> None:
    idle, busy, full_kv = Load(0, 0, 0.1), Load(3, 4, 0.5), Load(0, 4, 0.95)
    a = Autoscaler(AutoscaleConfig(min_workers=1, max_workers=3, up_waiting=2, up_kv=0.9, up_after=2, down_after=3))
    assert a.observe([busy], 1) == 1  # one high check is not enough
    assert a.observe([busy], 1) == 2  # two in a row: one more
    assert a.observe([busy, idle], 2) == 2  # counting starts over after a change; mean waiting 1.5 < 2
    assert a.observe([full_kv, idle], 2) == 2
    assert a.observe([full_kv, idle], 2) == 3  # one worker's KV cache nearly full
    assert a.observe([busy] * 3, 3) == 3 and a.observe([busy] * 3, 3) == 3  # at the max
    assert [a.observe([idle] * 3, 3) for _ in range(3)] == [3, 3, 2]  # down after three quiet checks
    assert a.observe([idle, busy], 2) == 2 and a.observe([idle], 2) == 2  # the quiet count started over
    assert [a.observe([idle], 1) for _ in range(5)] == [1] * 5  # never below the min
    assert a.observe([], 0) == 1  # below the min (workers died): back up at once
    # Running sequences that fit one fewer worker at 2 each count as quiet with down_running=2.
    b = Autoscaler(AutoscaleConfig(min_workers=1, max_workers=2, down_running=2, down_after=1))
    assert b.observe([Load(0, 2, 0.2), Load(0, 1, 0.1)], 2) == 2 and b.observe([Load(0, 2, 0.2), Load(0, 0, 0)], 2) == 1
    text = ('tokenloom:num_requests_waiting{model_name="m"} 3.0\ntokenloom:num_requests_running{model_name="m"} 2.0\n'
            'tokenloom:kv_cache_usage_perc{model_name="m"} 0.25\ntokenloom:num_preemptions_total{model_name="m"} 7.0\n')
    assert parse_load(text) == Load(3.0, 2.0, 0.25)


def test_ray_serve_settings_are_checked() -> None:
    for bad, match in ((dict(min_workers=0), "min-workers"), (dict(min_workers=3, max_workers=2), "max-workers"),
                       (dict(up_after=0), "scale-up-after"), (dict(up_kv=1.5), "scale-up-kv"),
                       (dict(interval=-1), "interval")):
        with pytest.raises(ConfigError, match=match):
            AutoscaleConfig(**bad)  # type: ignore[arg-type]
    ok = AutoscaleConfig(min_workers=1, max_workers=2)
    with pytest.raises(ConfigError, match="initial-workers 3"):
        RayServeConfig(serve_argv=(), autoscale=ok, initial_workers=3)
    with pytest.raises(ConfigError, match="must be >= 0"):
        RayServeConfig(serve_argv=(), autoscale=ok, num_gpus=-1)
    assert RayServeConfig(serve_argv=(), autoscale=ok).first_workers == 1
    with pytest.raises(ConfigError, match="--prefill-workers must be >= 0"):
        RayServeConfig(serve_argv=(), autoscale=ok, prefill_workers=-1)
    # Split prefill/decode: a fixed group of prefill workers beside the autoscaled decode workers.
    prefill = RayServeConfig(serve_argv=("--x",), autoscale=ok, initial_workers=2, prefill_workers=3).prefill_group()
    assert (prefill.autoscale.min_workers, prefill.autoscale.max_workers, prefill.autoscale.interval) == (3, 3, 0.0)
    assert prefill.first_workers == 3 and prefill.prefill_workers == 0 and prefill.serve_argv == ("--x",)


def test_bad_flags_fail_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    from tokenloom.cli import main

    assert main(["ray-serve", "--worker-resources", "[1]"]) == 2
    assert "--worker-resources: expected a JSON object" in capsys.readouterr().err
    assert main(["ray-serve", "--min-workers", "2", "--max-workers", "1"]) == 2
    assert "--max-workers (1) must be >= --min-workers (2)" in capsys.readouterr().err
    assert main(["router"]) == 2
    assert "at least one worker (--worker URL or --worker-discovery)" in capsys.readouterr().err
    assert main(["router", "--worker-discovery", "dns:workers"]) == 2
    assert "expected dns:NAME:PORT" in capsys.readouterr().err
