"""`tokenloom ray-serve` on a real two-node Ray cluster on this machine (tiny model): streams through the
router equal a direct worker's; kill -9 of a worker under load (started streams end with an error event,
unstarted requests succeed, none hangs) and Ray's replacement back in routing; scaling 2 -> 1 -> 2 -> 1 by
the admin endpoint under continuous streaming load without losing a stream; and, on a second `ray-serve`
with its autoscaler on, 1 -> 2 workers set off by the queue the workers' /metrics report under load and
back to 1 as the load falls, the drained worker finishing its streams; split prefill/decode over the two
nodes (a prefill worker on one, a decode worker on the other) answering as one worker does; the KubeRay
RayService's Serve application under `serve run` (where Ray Serve is installed).

The time bounds below only turn a hang into a failure; the times measured are in docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from router_helpers import WORKER_FLAGS, long_tiny_model, samples
from tokenloom.netutil import free_port, stop_process_group, wait_until_healthy

ray = pytest.importorskip("ray", reason="Ray is not installed (make test installs it: pyproject's test extras)")

from tokenloom.distributed.local import LocalRayCluster, NodeSpec  # noqa: E402 - after the skip

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[1]
AUTH = {"Authorization": "Bearer ray-test-key"}  # the router and the Ray workers both require it
REPLACEMENT_BOUND_S = 120.0  # Ray restarts a killed worker and the router routes to it again within this


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[LocalRayCluster]:
    # Two nodes of one CPU each; the second has a resource of its own, as a GPU node would.
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cluster = LocalRayCluster([NodeSpec(1), NodeSpec(1, {"node2": 1})], env=env)
    try:
        cluster.start()
    except (OSError, RuntimeError, TimeoutError) as e:
        cluster.stop()
        pytest.skip(f"Ray cannot start on this machine: {e}")
    try:
        yield cluster
    finally:
        cluster.stop()


# The `served` deployment's scaling: two workers, changed only by POST /admin/workers.
BY_HAND = ("--min-workers", "1", "--max-workers", "2", "--initial-workers", "2", "--autoscale-interval", "0")
_RUNNING: list[RayServe] = []  # the cluster's two CPUs hold one deployment's two workers at a time


class RayServe:
    def __init__(self, cluster: LocalRayCluster, model: Path, log: Path, scaling: tuple[str, ...] = BY_HAND,
                 worker_flags: tuple[str, ...] = ()) -> None:
        for other in _RUNNING:
            other.stop()
        # The cluster's two CPUs hold one deployment's workers: start only once the last one's are released
        # (else these workers wait, unplaced, until the health timeout).
        cluster.wait_idle()
        key_file = log.with_name("api-key")
        key_file.write_text(AUTH["Authorization"].split()[1])
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "tokenloom.cli", "ray-serve", "--address", cluster.address, "--port",
               str(self.port), "--model", str(model), "--served-model-name", "tiny", *WORKER_FLAGS,
               *worker_flags, *scaling, "--num-cpus-per-worker", "1", "--placement", "spread", "--check-interval", "0.25",
               "--worker-host", "127.0.0.1",  # every "node" is this machine: the workers stay on loopback
               "--health-interval", "0.25", "--graceful-timeout", "20", "--startup-timeout", "300",
               "--api-key-file", str(key_file), "--worker-logs-to-driver"]  # the workers' logs in this log too
        with log.open("ab") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=f, env=cluster.env, start_new_session=True)
        _RUNNING.append(self)

    def wait(self) -> None:
        try:
            wait_until_healthy(self.url, timeout=300, path="/metrics", alive=lambda: self.proc.poll() is None)
        except TimeoutError as e:
            raise TimeoutError(f"{e}; its log ends: {self.log.read_text()[-3000:]}") from e

    def workers(self) -> dict:
        return httpx.get(self.url + "/admin/workers", headers=AUTH, timeout=10).json()

    def published(self) -> list[dict]:
        return [w for w in self.workers()["workers"] if w["published"]]

    def routed(self) -> set[str]:
        return {w["url"] for w in httpx.get(self.url + "/health", timeout=10).json()["workers"] if w["healthy"]}

    def wait_for(self, what: str, check: object, bound: float = REPLACEMENT_BOUND_S) -> float:
        t = time.monotonic()
        while not check():  # type: ignore[operator]
            if time.monotonic() - t > bound:
                raise AssertionError(f"{what}: not within {bound:.0f} s: {self.workers()}; log: "
                                     f"{self.log.read_text()[-3000:]}")
            time.sleep(0.1)
        return time.monotonic() - t

    def scale(self, n: int) -> None:
        r = httpx.post(self.url + "/admin/workers", json={"workers": n}, headers=AUTH, timeout=10)
        assert r.status_code == 200, r.text

    def stop(self) -> None:
        stop_process_group(self.proc)


@pytest.fixture(scope="module")
def served(ray_cluster: LocalRayCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayServe]:
    model = long_tiny_model(tmp_path_factory.mktemp("tiny-ray"))
    s = RayServe(ray_cluster, model, tmp_path_factory.mktemp("ray-serve") / "ray-serve.log")
    try:
        s.wait()
        s.wait_for("two workers published", lambda: len(s.published()) == 2, 300)
        s.wait_for("both in routing", lambda: len(s.routed()) == 2, 60)
        yield s
    finally:
        s.stop()


async def _stream(c: httpx.AsyncClient, prompt: str, max_tokens: int, started: asyncio.Event | None = None) -> list[str]:
    """The SSE lines of one streamed completion (greedy)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    lines: list[str] = []
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line:
                lines.append(line)
                if started is not None:
                    started.set()
    return lines


def _text(lines: list[str]) -> str:
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(x[6:]) for x in lines[:-1]]
    assert events[-1]["choices"][0]["finish_reason"] == "length", events[-1]
    return "".join(e["choices"][0]["text"] for e in events)


def _choices(lines: list[str]) -> list[object]:
    """The events with what differs between two runs (ids, times) left out."""
    return [json.loads(x[6:])["choices"] for x in lines[:-1]]


def test_workers_on_both_nodes_and_streams_equal_a_direct_worker(served: RayServe) -> None:
    workers = served.published()
    assert len({w["node_id"] for w in workers}) == 2  # --placement spread, one CPU per node: one on each
    prompts = [f"prompt number {i % 4} of the ray test" for i in range(16)]

    async def run() -> tuple[list[list[str]], list[list[str]]]:
        async with httpx.AsyncClient(base_url=workers[0]["url"], headers=AUTH, timeout=120) as direct:
            want = [await _stream(direct, p, 32) for p in prompts[:4]]
        async with httpx.AsyncClient(base_url=served.url, headers=AUTH, timeout=120) as c:
            got = await asyncio.wait_for(asyncio.gather(*(_stream(c, p, 32) for p in prompts)), 300)
        return want, got

    want, got = asyncio.run(run())
    for url in (served.url, workers[0]["url"]):  # the key is required by the router and by the Ray workers
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}, timeout=30)
        assert r.status_code == 401, r.text
    for i, lines in enumerate(got):
        assert _text(lines) == _text(want[i % 4]) and _choices(lines) == _choices(want[i % 4])


def test_a_killed_worker_is_replaced_by_ray_and_routed_to_again(served: RayServe) -> None:
    before = {w["number"]: w for w in served.published()}
    victim = before[min(before)]

    async def under_load() -> tuple[list[list[str]], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=served.url, headers=AUTH, timeout=120) as c:
            started = [asyncio.Event() for _ in range(4)]
            streams = [asyncio.create_task(_stream(c, f"long stream {i}", 1500, started[i])) for i in range(4)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
            os.kill(victim["pid"], signal.SIGKILL)  # the victim's `tokenloom serve` process, mid-stream
            body = {"model": "tiny", "prompt": "after the kill", "max_tokens": 8, "ignore_eos": True}
            after = [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(6)]
            # No hang: everything returns (the bound only turns a hang into a failure).
            done = await asyncio.wait_for(asyncio.gather(asyncio.gather(*streams), asyncio.gather(*after)), 300)
            return done[0], done[1]

    t = time.monotonic()
    streams, after = asyncio.run(under_load())
    broken = [s for s in streams if any('"error"' in x for x in s)]
    assert 1 <= len(broken) < len(streams)  # least outstanding: the victim had some of the four, not all
    for s in broken:
        assert json.loads(s[-2][6:])["error"]["type"] == "upstream_error" and s[-1] == "data: [DONE]"
    for s in streams:
        if s not in broken:
            _text(s)  # ran to its end
    for r in after:  # not started at the kill: retried elsewhere or sent to the survivor, all succeed
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"

    def replaced() -> bool:
        now = {w["number"]: w for w in served.published()}
        new = now.get(victim["number"])
        return len(now) == 2 and new is not None and new["pid"] != victim["pid"] and new["url"] in served.routed()

    served.wait_for("the killed worker back in routing", replaced)
    print(f"replacement routed {time.monotonic() - t:.1f} s after the kill")
    new_url = next(w["url"] for w in served.published() if w["number"] == victim["number"])
    async def spread() -> list[str]:
        async with httpx.AsyncClient(base_url=served.url, headers=AUTH, timeout=120) as c:
            return [_text(x) for x in await asyncio.gather(*(_stream(c, "x", 4) for _ in range(4)))]
    assert len(asyncio.run(spread())) == 4
    m = httpx.get(served.url + "/metrics").text
    assert f'tokenloom:router_requests_total{{code="200",worker="{new_url}"}}' in m  # the replacement serves


class Load:
    """`clients` streams in a loop (each `max_tokens` long) from a thread of its own until stop()."""

    def __init__(self, url: str, clients: int, max_tokens: int) -> None:
        self.url, self.clients, self.max_tokens = url, clients, max_tokens
        self.results: list[list[str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    async def _client(self, c: httpx.AsyncClient, k: int) -> None:
        n = 0
        while not self._stop.is_set():
            self.results.append(await _stream(c, f"client {k} stream {n}", self.max_tokens))
            n += 1

    async def _run(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, headers=AUTH, timeout=120) as c:
            await asyncio.gather(*(self._client(c, k) for k in range(self.clients)))

    def stop(self) -> list[list[str]]:
        self._stop.set()
        self._thread.join(300)
        assert not self._thread.is_alive()
        return self.results


def test_scale_down_and_up_under_load_loses_no_stream(served: RayServe) -> None:
    served.wait_for("two workers", lambda: len(served.published()) == 2)
    for bad, message in (({"workers": 3}, "outside --min-workers 1 .. --max-workers 2"),
                         ({"workers": "2"}, "integer N"), ([2], "integer N")):
        r = httpx.post(served.url + "/admin/workers", json=bad, headers=AUTH, timeout=10)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert httpx.post(served.url + "/admin/workers", content=b"{", headers=AUTH, timeout=10).status_code == 400
    assert httpx.post(served.url + "/admin/workers", json={"workers": 1}, timeout=10).status_code == 401
    assert served.workers()["target"] == 2
    load = Load(served.url, clients=4, max_tokens=200)
    try:
        for n in (1, 2, 1):
            served.scale(n)
            served.wait_for(f"{n} worker(s) published and routed",
                            lambda n=n: len(served.published()) == n and len(served.routed()) == n
                            and len(served.workers()["workers"]) == n)  # the drained one stopped
            done = len(load.results)
            served.wait_for("streams going on", lambda done=done: len(load.results) >= done + 4, 120)
    finally:
        results = load.stop()
    assert len(results) >= 12
    for lines in results:  # every stream ran to its end: none broken by a drain
        assert not any('"error"' in x for x in lines)
        _text(lines)


# The second deployment: one worker to start, its autoscaler on, every half second. A worker runs two
# sequences at most, so six streams leave four waiting (up after two checks at a mean of one or more
# waiting); two streams over two workers fit on one at two sequences each (down after four such checks).
AUTOSCALED = ("--min-workers", "1", "--max-workers", "2", "--initial-workers", "1", "--autoscale-interval", "0.5",
              "--scale-up-waiting", "1", "--scale-up-after", "2", "--scale-down-running", "2",
              "--scale-down-after", "4")


def test_load_scales_1_to_2_and_back_without_losing_a_stream(ray_cluster: LocalRayCluster,
                                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    model = long_tiny_model(tmp_path_factory.mktemp("tiny-ray-autoscale"))
    s = RayServe(ray_cluster, model, tmp_path_factory.mktemp("ray-autoscale") / "ray-serve.log", AUTOSCALED,
                 ("--max-num-seqs", "2"))
    light: Load | None = None
    heavy: Load | None = None
    try:
        s.wait()
        s.wait_for("one worker routed", lambda: len(s.published()) == 1 and len(s.routed()) == 1, 300)
        assert s.workers()["autoscaled"] == {"up": 0, "down": 0} and s.workers()["target"] == 1
        light = Load(s.url, clients=2, max_tokens=200)
        heavy = Load(s.url, clients=4, max_tokens=200)
        # Nothing but the measured queue asks for the second worker (no POST /admin/workers here).
        s.wait_for("a second worker, added on the queue, routed",
                   lambda: len(s.published()) == 2 and len(s.routed()) == 2, 300)
        assert s.workers()["autoscaled"] == {"up": 1, "down": 0}
        new_url = next(w["url"] for w in s.published() if w["number"] == 1)
        s.wait_for("the new worker serving", lambda: f'worker="{new_url}"' in httpx.get(s.url + "/metrics").text, 120)
        heavy_results = heavy.stop()  # the queue drains; the two light streams stay in flight
        heavy = None
        s.wait_for("back to one worker, the drained one stopped",
                   lambda: len(s.workers()["workers"]) == 1 and len(s.routed()) == 1)
        described = s.workers()
        assert described["autoscaled"] == {"up": 1, "down": 1} and described["target"] == 1
        done = len(light.results)
        s.wait_for("streams going on on one worker", lambda: len(light.results) >= done + 2, 120)
        light_results = light.stop()
        light = None
    finally:
        for load in (light, heavy):
            if load is not None:
                load.stop()
        s.stop()
    assert heavy_results and len(light_results) >= 4
    for lines in heavy_results + light_results:  # every stream ran to its end: none lost to a drain
        assert not any('"error"' in x for x in lines)
        _text(lines)


def test_the_rayservice_application_under_serve_run(ray_cluster: LocalRayCluster,
                                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    """deploy/kubernetes/ray/rayservice.yaml's serveConfigV2, its argv swapped for the tiny model's, under
    `serve run` on the two nodes: Serve's proxy streams the router's completions, equal to a direct worker's."""
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'tokenloom[kuberay]')")
    import shlex

    import yaml

    for other in _RUNNING:
        other.stop()
    ray_cluster.wait_idle()
    folder = tmp_path_factory.mktemp("ray-serve-app")
    model = long_tiny_model(folder)
    manifest = yaml.safe_load((REPO / "deploy/kubernetes/ray/rayservice.yaml").read_text())
    config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    (app,) = config["applications"]
    (folder / "api-key").write_text(AUTH["Authorization"].split()[1])
    app["args"]["argv"] = shlex.join([
        "--model", str(model), "--served-model-name", "tiny", *WORKER_FLAGS, *BY_HAND, "--num-cpus-per-worker",
        "1", "--worker-host", "127.0.0.1", "--check-interval", "0.25", "--startup-timeout", "300",
        "--api-key-file", str(folder / "api-key")])
    port = free_port()
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    (folder / "serve.yaml").write_text(yaml.safe_dump(config))
    log = folder / "serve-run.log"
    # SIGINT is what makes `serve run` shut the application down; a child inherits an ignored SIGINT (pytest run
    # as a background job of a shell), and Python then installs no KeyboardInterrupt handler: `serve run` sat out
    # stop_process_group's 60 s before its SIGKILL. So the handler is set here whatever was inherited.
    cmd = [sys.executable, "-c", "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
           "from ray.serve.scripts import cli; cli()", "run", "--address", ray_cluster.address, str(folder / "serve.yaml")]
    with log.open("ab") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=f, env=ray_cluster.env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, timeout=300, path="/metrics", alive=lambda: proc.poll() is None)

        def workers() -> list[dict]:
            return httpx.get(url + "/admin/workers", headers=AUTH, timeout=10).json()["workers"]

        t = time.monotonic()
        while not (len(ws := workers()) == 2 and all(w["published"] for w in ws)):
            assert time.monotonic() - t < 300 and proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.25)
        assert len({w["node_id"] for w in ws}) == 2

        async def run() -> tuple[list[list[str]], list[list[str]]]:
            prompts = [f"serve app prompt {i}" for i in range(2)]
            async with httpx.AsyncClient(base_url=ws[0]["url"], headers=AUTH, timeout=120) as direct:
                want = [await _stream(direct, p, 24) for p in prompts]
            async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120) as c:
                got = await asyncio.wait_for(asyncio.gather(*(_stream(c, prompts[i % 2], 24) for i in range(6))), 300)
            return want, got

        want, got = asyncio.run(run())
        for i, lines in enumerate(got):
            assert _text(lines) == _text(want[i % 2]) and _choices(lines) == _choices(want[i % 2])
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}, timeout=30)
        assert r.status_code == 401, r.text
    finally:
        # SIGINT: `serve run` shuts the application down, and the workers stop with it
        stop_process_group(proc, sig=signal.SIGINT)
        # Serve's controller is a detached actor: where `serve run` was killed before it finished shutting
        # down (a slow machine), the application and its workers outlive it and hold the cluster's CPUs.
        subprocess.run([sys.executable, "-c", "import ray; from ray import serve; "
                        f"ray.init(address={ray_cluster.address!r}); serve.shutdown()"],
                       env=ray_cluster.env, capture_output=True, timeout=180)


def test_split_prefill_decode_across_the_two_nodes_equals_one_worker(
        ray_cluster: LocalRayCluster, tmp_path_factory: pytest.TempPathFactory) -> None:
    model = long_tiny_model(tmp_path_factory.mktemp("tiny-ray-split"))
    s = RayServe(ray_cluster, model, tmp_path_factory.mktemp("ray-split") / "ray-serve.log",
                 ("--min-workers", "1", "--prefill-workers", "1", "--autoscale-interval", "0"))
    try:
        s.wait()
        s.wait_for("a decode and a prefill worker routed", lambda: len(s.routed()) == 1 and all(
            w["healthy"] for w in httpx.get(s.url + "/health", timeout=10).json()["prefill_workers"]) and len(
            httpx.get(s.url + "/health", timeout=10).json()["prefill_workers"]) == 1, 300)
        described = s.workers()
        (decode,), (prefill,) = described["workers"], described["prefill"]["workers"]
        assert decode["node_id"] != prefill["node_id"]  # the KV blocks cross from one Ray node to the other
        prompts = [f"a longer prompt for the split ray deployment, number {i}, " * 3 for i in range(3)]

        async def run() -> tuple[list[list[str]], list[list[str]]]:
            async with httpx.AsyncClient(base_url=s.url, headers=AUTH, timeout=120) as c:
                got = await asyncio.wait_for(asyncio.gather(*(_stream(c, p, 24) for p in prompts)), 300)
            # The oracle: one worker computing everything (the prefill worker serves whole requests too).
            async with httpx.AsyncClient(base_url=prefill["url"], headers=AUTH, timeout=120) as one:
                want = [await _stream(one, p, 24) for p in prompts]
            return want, got

        want, got = asyncio.run(run())
        for w, g in zip(want, got):
            assert _text(g) == _text(w) and _choices(g) == _choices(w)
        m = samples(httpx.get(s.url + "/metrics").text)
        assert m[f"tokenloom:router_kv_prefills_total{{outcome=ok,worker={prefill['url']}}}"] == len(prompts)
        assert m[f"tokenloom:router_kv_transfer_bytes_total{{worker={prefill['url']}}}"] > 0
    finally:
        s.stop()


def test_cpus_in_use_reads_ray_status(monkeypatch: pytest.MonkeyPatch) -> None:
    """What wait_idle() waits on: the CPUs `ray status` reports held (no Ray needed)."""
    cluster = LocalRayCluster([NodeSpec(1)])  # never started: stop() only removes its temp dir
    report = ("Node status\n---\nActive:\n 1 node_a\n 1 node_b\nPending:\n (no pending nodes)\n\nResources\n---\n"
              "Usage:\n {used}/2.0 CPU\n 0.0/1.0 node2\n 0B/160.00MiB object_store_memory\n\nDemands:\n"
              " (no resource demands)\n")
    monkeypatch.setattr(cluster, "status", lambda: report.format(used="1.0"))
    try:
        assert cluster.cpus_in_use() == 1.0
        with pytest.raises(TimeoutError, match="1.0 CPU"):
            cluster.wait_idle(timeout=0.0)
        monkeypatch.setattr(cluster, "status", lambda: report.format(used="0.0"))
        assert cluster.cpus_in_use() == 0.0
        cluster.wait_idle(timeout=0.0)
        # A placement group's reservation holds its CPUs whether its actors use them or not.
        monkeypatch.setattr(cluster, "status", lambda: report.format(
            used="0.0").replace("0.0/2.0 CPU", "0.0/2.0 CPU (0.0 used of 2.0 reserved in placement groups)"))
        assert cluster.cpus_in_use() == 2.0
        monkeypatch.setattr(cluster, "status", lambda: "`ray status` failed: no cluster")
        assert cluster.cpus_in_use() is None
        assert cluster._alive_nodes() == 0
    finally:
        cluster.stop()
