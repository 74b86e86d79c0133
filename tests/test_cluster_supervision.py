"""`tokenloom cluster` supervises its workers: a dead worker is restarted on its port with back-off, a clean
shutdown restarts nothing, and the workers end with the cluster process even when it is killed -9."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tokenloom.netutil import free_port, wait_until_healthy
from tokenloom.router.cluster import LocalWorkers

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux only")


def alive(pid: int) -> bool:
    """The process runs (a zombie, dead but not yet reaped, counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry.name))
    return sorted(out)


def wait_for(check: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return check()


class SleepWorkers(LocalWorkers):
    """LocalWorkers whose "workers" only sleep: supervision without models."""

    def command(self, i: int) -> list[str]:
        return [sys.executable, "-c", "import time; time.sleep(300)"]


# --- supervision, without models ---------------------------------------------------------------------------


def test_a_dead_worker_is_restarted_with_doubling_backoff_reset_once_stable(caplog: pytest.LogCaptureFixture) -> None:
    w = SleepWorkers([free_port(), free_port()], "127.0.0.1", [], restart_backoff=1.0, max_backoff=4.0,
                     stable_after=100.0)
    w.launch()
    try:
        first, other = w.pids
        t = time.monotonic()
        with caplog.at_level(logging.INFO, logger="tokenloom.router"):
            os.kill(first, signal.SIGKILL)
            w.procs[0].wait(10)
            w.check_once(t)
            assert "killed by SIGKILL" in caplog.text and "restarting it in 1.0 s" in caplog.text
            assert not alive(first)  # reaped: no zombie left
            w.check_once(t + 0.5)
            assert w.pids[0] == first and w.restarts == [0, 0]  # back-off not over yet
            w.check_once(t + 1.0)
            assert w.pids[0] != first and w.pids[1] == other and w.restarts == [1, 0]
            assert alive(w.pids[0])
            # Dying again soon after: 2 s, then 4 s, then capped at 4 s.
            for n, delay in ((2, 2.0), (3, 4.0), (4, 4.0)):
                w.procs[0].kill()
                w.procs[0].wait(10)
                t += 10
                w.check_once(t)
                assert f"restarting it in {delay:.1f} s" in caplog.text
                w.check_once(t + delay - 0.1)
                assert w.restarts[0] == n - 1
                w.check_once(t + delay)
                assert w.restarts[0] == n
                t += delay
            # Up longer than stable_after: the back-off starts over.
            w.procs[0].kill()
            w.procs[0].wait(10)
            caplog.clear()
            w.check_once(t + 200)
            assert "restarting it in 1.0 s" in caplog.text
    finally:
        codes = w.stop(10)
    assert all(c is not None for c in codes)


def test_stop_restarts_nothing() -> None:
    w = SleepWorkers([free_port(), free_port()], "127.0.0.1", [], restart_backoff=0.0, poll_interval=0.05)
    w.launch()
    w.supervise()
    pids = w.pids
    if sys.platform.startswith("linux"):  # a terminal's Ctrl-C (SIGINT to the group) reaches only the cluster
        assert all(os.getsid(p) == p for p in pids)
    os.kill(pids[0], signal.SIGKILL)
    assert wait_for(lambda: w.restarts[0] == 1, 10)  # the supervisor restarts a dead worker
    w.stop(10)
    time.sleep(0.3)  # several supervisor rounds, had it survived
    assert w.restarts == [1, 0] and all(p.poll() is not None for p in w.procs)
    assert not any(alive(p) for p in [*pids, *w.pids])


@linux_only
def test_workers_die_with_a_killed_parent(tmp_path: Path) -> None:
    """kill -9 of the process that started them: the workers it started (main thread) and the one its
    supervisor restarted (another thread) get the parent-death signal."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_cluster_supervision import SleepWorkers
        w = SleepWorkers([1, 2], "127.0.0.1", [], restart_backoff=0.0, poll_interval=0.05)
        w.launch()
        w.supervise()
        os.kill(w.pids[0], signal.SIGKILL)
        while w.restarts[0] < 1:
            time.sleep(0.05)
        print(*w.pids, flush=True)
        time.sleep(300)
    """))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pids = [int(x) for x in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        parent.kill()
        parent.wait(10)
        assert wait_for(lambda: not any(alive(p) for p in pids), 10), [p for p in pids if alive(p)]
    finally:
        if parent.poll() is None:
            parent.kill()


# --- a real cluster ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen[bytes], str, list[str], Path]]:
    """`tokenloom cluster --workers 2` on the tiny model: (process, router URL, worker URLs, log)."""
    port, w1, w2 = free_port(), free_port(), free_port()
    folder = tmp_path_factory.mktemp("cluster")
    log = folder / "cluster.log"
    (folder / "traces").mkdir()
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tokenloom.cli", "cluster", "--workers", "2", "--port", str(port),
                                 "--worker-ports", str(w1), str(w2), "--model", str(tiny_llama), "--served-model-name",
                                 "tiny", "--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "256",
                                 "--num-threads", "1", "--health-interval", "0.2", "--policy", "round_robin",
                                 "--step-trace-dir", str(folder / "traces")],
                                stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_until_healthy(url, timeout=180, alive=lambda: proc.poll() is None)
        except TimeoutError as e:
            raise TimeoutError(f"{e}; log: {log.read_text()[-3000:]}") from e
        yield proc, url, [f"http://127.0.0.1:{w1}", f"http://127.0.0.1:{w2}"], log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def worker_pids(cluster_pid: int) -> list[int]:
    return children(cluster_pid)


def generate(url: str) -> httpx.Response:
    return httpx.post(url + "/api/generate", json={"model": "tiny", "prompt": "hello", "stream": False,
                                                   "options": {"num_predict": 2}}, timeout=60)


def router_view(url: str) -> dict[str, bool]:
    return {w["url"]: w["healthy"] for w in httpx.get(url + "/health").json()["workers"]}


@pytest.mark.cluster
def test_each_worker_writes_its_own_step_trace(cluster: tuple[subprocess.Popen[bytes], str, list[str], Path]) -> None:
    _, url, _, log = cluster
    assert all(generate(url).status_code == 200 for _ in range(2))  # round robin: one request each
    traces = [log.parent / "traces" / f"worker-{i}.csv" for i in range(2)]

    def steps(path: Path) -> int:  # step lines (the engine flushes its trace when it goes idle)
        return len(path.read_text().splitlines()) - 1 if path.exists() else 0

    # Each request: a prefill step, then one decode step per further token (num_predict 2).
    assert wait_for(lambda: all(steps(t) >= 2 for t in traces), 10), [steps(t) for t in traces]
    assert traces[0].read_text().splitlines()[0].startswith("loop_start,step_start")


@pytest.mark.cluster
def test_a_killed_worker_is_restarted_and_serves_again(cluster: tuple[subprocess.Popen[bytes], str, list[str], Path]) -> None:
    proc, url, workers, log = cluster
    pids = worker_pids(proc.pid)
    assert len(pids) == 2, pids
    assert wait_for(lambda: all(router_view(url).values()), 10), router_view(url)
    os.kill(pids[0], signal.SIGKILL)
    assert wait_for(lambda: not alive(pids[0]), 10)  # reaped by the cluster, not left a zombie
    assert wait_for(lambda: not all(router_view(url).values()), 10), "the router did not take the dead worker out"
    assert generate(url).status_code == 200  # the other worker serves meanwhile
    assert wait_for(lambda: len(worker_pids(proc.pid)) == 2 and pids[0] not in worker_pids(proc.pid), 15), log.read_text()[-3000:]
    for w in workers:
        wait_until_healthy(w, timeout=120)
    assert wait_for(lambda: all(router_view(url).values()), 10), router_view(url)
    assert all(generate(url).status_code == 200 for _ in range(4))  # round robin: both workers answer
    text = log.read_text()
    assert "killed by SIGKILL" in text and "started again" in text
    assert proc.poll() is None


@pytest.mark.cluster
@linux_only
def test_workers_end_when_the_cluster_is_killed(cluster: tuple[subprocess.Popen[bytes], str, list[str], Path]) -> None:
    proc, url, workers, _ = cluster
    pids = worker_pids(proc.pid)
    assert len(pids) == 2, pids
    proc.kill()
    proc.wait(10)
    assert wait_for(lambda: not any(alive(p) for p in pids), 30), [p for p in pids if alive(p)]
    for w in workers:
        with pytest.raises(httpx.HTTPError):
            httpx.get(w + "/health", timeout=2)
