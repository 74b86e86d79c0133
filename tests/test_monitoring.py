"""The monitoring stack: every metric the dashboard and the alert rules name is one the code exports;
promtool accepts the config and rules and their unit tests pass; a real Prometheus scrapes a running
`tokenloom cluster` under load and answers TTFT's p99; the cluster stops its workers on SIGTERM."""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from prometheus_helpers import ensure_prometheus
from tokenloom.netutil import free_port, wait_until_healthy
from tokenloom.router.metrics import RouterMetrics
from tokenloom.serve.metrics import ServingMetrics

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
METRIC_NAME = re.compile(r"tokenloom:[A-Za-z0-9_:]+")
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",)}


def exported_names() -> set[str]:
    """Every sample name the workers' and the router's /metrics can carry."""
    names: set[str] = set()
    for registry in (ServingMetrics("m").registry, RouterMetrics().registry):
        for family in registry.collect():
            names |= {family.name + s for s in SUFFIXES[family.type]}
    return names


def dashboard() -> dict[str, object]:
    return json.loads((DEPLOY / "grafana" / "tokenloom.json").read_text())


def dashboard_exprs() -> list[str]:
    d = dashboard()
    exprs = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]  # type: ignore[attr-defined]
    exprs += [v["definition"] for v in d["templating"]["list"] if v["type"] == "query"]  # type: ignore[index]
    return exprs


def alert_exprs() -> list[str]:
    rules = yaml.safe_load((DEPLOY / "alerts.yml").read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def test_every_metric_the_dashboard_and_alerts_name_is_exported() -> None:
    exported = exported_names()
    assert {"tokenloom:time_to_first_token_seconds_bucket", "tokenloom:generation_tokens_total",
            "tokenloom:router_requests_total", "tokenloom:router_worker_up"} <= exported
    for source, exprs in (("dashboard", dashboard_exprs()), ("alerts.yml", alert_exprs())):
        used = {name for e in exprs for name in METRIC_NAME.findall(e)}
        assert used, f"{source} names no tokenloom metric"
        assert used <= exported, f"{source} names metrics the code does not export: {sorted(used - exported)}"


def test_dashboard_shows_latency_percentiles_throughput_queue_and_kv_per_worker_and_in_total() -> None:
    exprs = dashboard_exprs()
    for metric in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        for q in ("0.5", "0.95", "0.99"):
            assert any(f"histogram_quantile({q}, sum by (le) (rate(tokenloom:{metric}_bucket" in e for e in exprs), (metric, q)
        assert any(f"sum by (le, instance) (rate(tokenloom:{metric}_bucket" in e for e in exprs), metric
    for metric in ("generation_tokens_total", "num_requests_waiting", "kv_cache_usage_perc"):
        assert any(f"tokenloom:{metric}" in e and "by (instance)" in e for e in exprs), metric
        assert any(f"tokenloom:{metric}" in e and "by (instance)" not in e for e in exprs), metric
    assert all(p.get("targets") for p in dashboard()["panels"] if p["type"] != "row")  # type: ignore[attr-defined]


def test_promtool_accepts_config_and_rules_and_the_rule_tests_pass() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        ensure_prometheus()  # Debian's package brings promtool along
        promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed and could not be installed")
    for args in (["check", "config", "prometheus.yml"], ["check", "rules", "alerts.yml"],
                 ["test", "rules", "alerts_test.yml"]):
        done = subprocess.run([promtool, *args], cwd=DEPLOY, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"promtool {' '.join(args)}: {done.stdout}{done.stderr}"


# --- a real cluster, scraped by a real Prometheus -------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen[bytes], str, list[str]]]:
    """`tokenloom cluster --workers 2` on the tiny model: (process, router URL, worker URLs)."""
    port, w1, w2 = free_port(), free_port(), free_port()
    log = tmp_path_factory.mktemp("cluster") / "cluster.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tokenloom.cli", "cluster", "--workers", "2", "--port", str(port),
                                 "--worker-ports", str(w1), str(w2), "--model", str(tiny_llama), "--served-model-name",
                                 "tiny", "--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "256",
                                 "--num-threads", "1", "--health-interval", "0.5"], stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_until_healthy(url, timeout=180, alive=lambda: proc.poll() is None)
        except TimeoutError as e:
            raise TimeoutError(f"{e}; log: {log.read_text()[-3000:]}") from e
        yield proc, url, [f"http://127.0.0.1:{w1}", f"http://127.0.0.1:{w2}"]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def query(prom: str, expr: str) -> list[dict[str, object]]:
    r = httpx.get(prom + "/api/v1/query", params={"query": expr}, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    return body["data"]["result"]  # type: ignore[no-any-return]


def values(result: list[dict[str, object]]) -> list[float]:
    return [float(s["value"][1]) for s in result]  # type: ignore[index]


def wait_for(check: "object", timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.5)
    return False


@pytest.mark.cluster
def test_prometheus_scrapes_the_cluster_and_answers_ttft_p99(
        cluster: tuple[subprocess.Popen[bytes], str, list[str]], tmp_path: Path) -> None:
    binary, why = ensure_prometheus()
    if binary is None:
        pytest.skip(f"no Prometheus: {why}")
    _, router, workers = cluster
    host = lambda u: u.removeprefix("http://")  # noqa: E731
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "rule_files": [str(DEPLOY / "alerts.yml")],
              "scrape_configs": [{"job_name": "tokenloom-router", "static_configs": [{"targets": [host(router)]}]},
                                 {"job_name": "tokenloom-worker", "static_configs": [{"targets": [host(w) for w in workers]}]}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    prom = f"http://127.0.0.1:{free_port()}"
    with (tmp_path / "prometheus.log").open("wb") as log:
        proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address={host(prom)}"],
                                stdout=log, stderr=log)
    try:
        wait_until_healthy(prom, timeout=60, path="/-/ready", alive=lambda: proc.poll() is None)
        # Load only after a first scrape, so that the counters' increase falls inside Prometheus's window.
        assert wait_for(lambda: values(query(prom, "up")) == [1.0, 1.0, 1.0]), query(prom, "up")

        def one(i: int) -> int:
            body = {"model": "tiny", "prompt": f"load {i}", "max_tokens": 16, "ignore_eos": True, "stream": i % 2 == 0}
            return httpx.post(router + "/v1/completions", json=body, timeout=120).status_code

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(one, range(24))) == [200] * 24

        p99 = 'histogram_quantile(0.99, sum(rate(tokenloom:time_to_first_token_seconds_bucket[1m])) by (le))'
        assert wait_for(lambda: [v for v in values(query(prom, p99)) if math.isfinite(v) and v > 0]), query(prom, p99)
        by_worker = 'histogram_quantile(0.99, sum by (le, instance) (rate(tokenloom:time_to_first_token_seconds_bucket[1m])))'
        # Both workers got load (each is scraped on its own schedule: wait for both).
        assert wait_for(lambda: len([v for v in values(query(prom, by_worker)) if math.isfinite(v) and v > 0]) == 2), \
            query(prom, by_worker)
        # The router's series appear with their first request: their raw values, not a rate, show the load.
        routed = 'sum(tokenloom:router_responses_total{job="tokenloom-router", code="200"})'
        assert wait_for(lambda: sum(values(query(prom, routed))) >= 24), query(prom, routed)
        # Every dashboard query is valid PromQL against the live metrics.
        for expr in dashboard_exprs():
            if expr.startswith("label_values"):
                continue
            query(prom, expr.replace("$__rate_interval", "1m").replace("$instance", ".*"))
        rules = httpx.get(prom + "/api/v1/rules").json()["data"]["groups"]
        assert sorted(r["name"] for g in rules for r in g["rules"]) == [
            "TokenloomErrorRateHigh", "TokenloomTTFTP99High", "TokenloomWorkerDown"]
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.cluster
def test_cluster_stops_its_workers_on_sigterm(cluster: tuple[subprocess.Popen[bytes], str, list[str]]) -> None:
    proc, router, workers = cluster
    r = httpx.post(router + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert [w["url"] for w in httpx.get(router + "/health").json()["workers"]] == workers
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    for url in [router, *workers]:
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=5)
