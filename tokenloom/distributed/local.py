"""A Ray cluster of several nodes on this machine, for the tests and the benchmark scripts: a head node and
more worker nodes, each a `ray start --block` child of ours (so that ending that child ends exactly the Ray
processes it started: no `ray stop`, which would end every Ray process of the machine), the head's GCS on
127.0.0.1 (Ray registers the nodes under the address it picks for this machine; workers meant to stay on
loopback are given `--worker-host 127.0.0.1`), without the dashboard, with small object stores, under a
temp dir of their own.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tokenloom.errors import ConfigError
from tokenloom.netutil import free_port


_MARKER = "TOKENLOOM_LOCAL_RAY_CLUSTER"
# A `ray status` usage line for CPUs (ray/autoscaler/_private/util.py's format).
_CPU_USAGE = re.compile(r"^\s*(?P<used>[\d.]+)/(?P<total>[\d.]+) CPU"
                        r"(?: \((?P<pg_used>[\d.]+) used of (?P<reserved>[\d.]+) reserved in placement groups\))?\s*$")


def marked_pids(marker: str) -> list[int]:
    """The processes whose environment holds _MARKER=marker (Linux /proc; an empty list elsewhere)."""
    needle = f"{_MARKER}={marker}".encode()
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return pids


@dataclass(frozen=True)
class NodeSpec:
    num_cpus: float
    resources: Mapping[str, float] = field(default_factory=dict)  # custom Ray resources, e.g. {"node2": 1}


class LocalRayCluster:
    """start() the nodes (head first), then ray.init(address=cluster.address); stop() in a finally."""

    def __init__(self, nodes: Sequence[NodeSpec], object_store_bytes: int = 80 * 1024 * 1024,
                 env: Mapping[str, str] | None = None) -> None:
        if not nodes:
            raise ConfigError("a Ray cluster needs at least a head node")
        self.nodes = list(nodes)
        self.object_store_bytes = object_store_bytes
        # Every process of this cluster (Ray's workers too, which leave our process groups) inherits this
        # marker, by which stop() finds the ones still running: ours, and only ours.
        self.marker = f"tokenloom-{os.getpid()}-{time.monotonic_ns()}"
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", _MARKER: self.marker, **(env or {})}
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        # Ray's socket paths must stay short (AF_UNIX: 107 bytes): a short temp dir, not pytest's deep one.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="tlray-"))
        self.procs: list[subprocess.Popen[bytes]] = []

    def _ray(self) -> str:
        return str(Path(sys.executable).with_name("ray"))

    def _start_node(self, i: int, spec: NodeSpec) -> subprocess.Popen[bytes]:
        common = ["--block", "--node-ip-address", "127.0.0.1", "--num-cpus", str(spec.num_cpus),
                  "--resources", json.dumps(dict(spec.resources)), "--object-store-memory",
                  str(self.object_store_bytes), "--disable-usage-stats",
                  "--min-worker-port", "0", "--max-worker-port", "0"]
        if i == 0:
            cmd = [self._ray(), "start", "--head", "--port", str(self.port), "--include-dashboard", "false",
                   "--temp-dir", str(self.temp_dir), "--dashboard-agent-listen-port", str(free_port()), *common]
        else:
            cmd = [self._ray(), "start", "--address", self.address, *common]
        log = (self.temp_dir / f"node{i}.log").open("ab")
        # A session of its own: stop() signals the whole group, the raylet and friends included.
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)

    def start(self, timeout: float = 120.0) -> None:
        """Start every node and wait until Ray counts them all alive."""
        try:
            for i, spec in enumerate(self.nodes):
                self.procs.append(self._start_node(i, spec))
                if i == 0:
                    self._wait(lambda: self._alive_nodes() >= 1, timeout, "the head node")
            self._wait(lambda: self._alive_nodes() >= len(self.nodes), timeout, f"{len(self.nodes)} nodes")
        except BaseException:
            self.stop()
            raise

    def _alive_nodes(self) -> int:
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"a `ray start` exited with {p.returncode}: {self.log_tail()}")
        out = self.status()
        if "Active:" not in out:
            return 0
        active = out.split("Active:", 1)[-1].split("Pending:", 1)[0]
        return sum(1 for line in active.splitlines() if line.strip().startswith("1 node_"))

    def status(self) -> str:
        """`ray status` of this cluster (its nodes, resource usage and pending demands)."""
        r = subprocess.run([self._ray(), "status", "--address", self.address], capture_output=True, text=True,
                           env=self.env, timeout=60)
        return r.stdout if r.returncode == 0 else f"`ray status` failed: {r.stderr[-1000:]}"

    def cpus_in_use(self) -> float | None:
        """The CPUs Ray's actors, tasks and placement groups hold now, None if `ray status` does not say.
        Its usage line reads "1.0/2.0 CPU", or with placement groups "1.0/2.0 CPU (1.0 used of 2.0 reserved in
        placement groups)", where the first figure counts only what is used of a reservation: a group's
        unused reservation still blocks other actors, so it is added back."""
        usage = self.status().split("Usage:", 1)[-1]
        for line in usage.splitlines():
            m = _CPU_USAGE.match(line)
            if m:
                used = float(m["used"])
                if m["reserved"] is not None:
                    used += float(m["reserved"]) - float(m["pg_used"])
                return used
        return None

    def wait_idle(self, timeout: float = 120.0) -> None:
        """Wait until no actor holds a CPU: what an earlier deployment started has been released (Ray frees
        an actor's resources some time after its owner dies). TimeoutError with `ray status` otherwise."""
        deadline = time.monotonic() + timeout
        while (used := self.cpus_in_use()) != 0.0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"Ray: {used} CPU(s) still held after {timeout:.0f} s: {self.status()}")
            time.sleep(0.5)

    def _wait(self, done: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"Ray: {what} not up after {timeout:.0f} s: {self.log_tail()}")
            time.sleep(0.5)

    def log_tail(self, chars: int = 3000) -> str:
        return "".join(p.read_text(errors="replace")[-chars:] for p in sorted(self.temp_dir.glob("node*.log")))

    def stop(self, timeout: float = 3.0) -> None:
        """End the nodes: SIGTERM to each `ray start --block` group, then SIGKILL to every process of this
        cluster still running after `timeout` s (Ray's worker processes included)."""
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for pid in marked_pids(self.marker):
            if pid != os.getpid():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            p.wait()
        self.procs = []
        shutil.rmtree(self.temp_dir, ignore_errors=True)
