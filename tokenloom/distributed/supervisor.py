"""The set of worker actors of `tokenloom ray-serve`: how many there should be, which of them the router
may use, and the replacing, adding and draining that keeps it so.

Every `check_interval` seconds (its own thread) each actor is asked for its WorkerInfo; the ready ones
(their server answered /health) that are not draining are *published*: the router's discovery reads
urls() and follows it. An actor that Ray restarted (its process or its server was killed) comes back with
a new URL and is published again once ready; one that answers nothing for `startup_timeout` seconds is
killed and replaced. Scaling down is graceful: the worker leaves the published set first, and is stopped
(SIGTERM: its own drain, then the actor is killed) only once the router routes nothing more to it and
nothing it sent is still in flight, or after `drain_timeout`.

Ray is imported by the methods that use it, not at import time (tokenloom runs without Ray installed).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from tokenloom.distributed.actor import ServeWorker, WorkerInfo
from tokenloom.distributed.autoscale import Autoscaler, Load, parse_load
from tokenloom.distributed.config import RayServeConfig
from tokenloom.errors import InvalidRequest

log = logging.getLogger("tokenloom.distributed")


class RoutingView(Protocol):
    """What the supervisor asks the router (router/workers.WorkerPool answers it)."""

    def routes_to(self, url: str) -> bool: ...

    def outstanding_of(self, url: str) -> int: ...


@dataclass
class Member:
    actor: Any  # a Ray ActorHandle of ServeWorker
    number: int  # 0, 1, 2 ... in order of creation (logs and /admin/workers)
    since: float  # created, or last seen ready: the clock of `startup_timeout`
    info: WorkerInfo | None = None  # the last answer (None after a failed call: its URL may be gone)
    pending: Any = None  # the info() call in flight (ObjectRef)
    pending_since: float = 0.0
    draining_since: float | None = None
    stopping: Any = None  # the stop() call in flight (ObjectRef)

    def published(self, now: float, check_timeout: float) -> bool:
        answering = self.pending is None or now - self.pending_since < check_timeout
        return self.info is not None and self.info.ready and answering and self.draining_since is None


class RayWorkers:
    def __init__(self, config: RayServeConfig, routing: RoutingView, api_key: str | None = None,
                 clock: Callable[[], float] = time.monotonic, role: str = "both", kv_secret: str | None = None) -> None:
        """`role`: the workers' `serve --role` (one RayWorkers per role in a split prefill/decode deployment)."""
        self.config = config
        self.role = role
        self._kv_secret = kv_secret
        self._api_key = api_key  # the workers require it too (passed to each actor, never on a command line)
        self.routing = routing
        self.clock = clock
        self.autoscaler = Autoscaler(config.autoscale)
        self.target = config.first_workers
        self.members: list[Member] = []
        self.replaced = 0  # actors killed and created anew for answering nothing (Ray's own restarts not counted)
        self.scaled = {"up": 0, "down": 0}  # the autoscaler's decisions (set_target's by hand not counted)
        self._numbers = itertools.count()
        self._published: tuple[str, ...] = ()
        self._lock = threading.Lock()  # members and target, between the supervisor thread and the HTTP API
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._actor_class: Any = None

    # --- the router's side ---------------------------------------------------------------------------------

    def urls(self) -> tuple[str, ...]:
        """The workers the router may use now (read from the event loop: no lock, a tuple swapped whole)."""
        return self._published

    def set_target(self, n: int) -> None:
        a = self.config.autoscale
        if not a.min_workers <= n <= a.max_workers:
            raise InvalidRequest(f"workers: {n} is outside --min-workers {a.min_workers} .. --max-workers "
                                 f"{a.max_workers}")
        with self._lock:
            if n != self.target:
                log.info("target: %d -> %d workers (set by hand)", self.target, n)
            self.target = n

    def describe(self) -> dict[str, object]:
        now = self.clock()
        with self._lock:
            return {"target": self.target, "replaced": self.replaced, "autoscaled": dict(self.scaled), "workers": [
                {"number": m.number, "url": m.info.url if m.info else None, "pid": m.info.pid if m.info else None,
                 "actor_pid": m.info.actor_pid if m.info else None, "node_id": m.info.node_id if m.info else None,
                 "ready": bool(m.info and m.info.ready), "draining": m.draining_since is not None,
                 "published": m.published(now, self.config.check_timeout)} for m in self.members]}

    # --- the actors ----------------------------------------------------------------------------------------

    def _create(self) -> Member:
        import ray

        if self._actor_class is None:
            c = self.config
            self._actor_class = ray.remote(ServeWorker).options(
                num_cpus=c.num_cpus, num_gpus=c.num_gpus, resources=dict(c.resources) or None,
                # Ray restarts a crashed actor (its server killed: actor.py) for ever; calls in flight at the
                # crash fail (they are info() and stop(), both safe to ask again).
                max_restarts=-1, max_task_retries=0,
                max_concurrency=4,  # info() while a slow stop() runs
                scheduling_strategy="SPREAD" if c.placement == "spread" else "DEFAULT")
        actor = self._actor_class.remote(list(self.config.serve_argv), self.config.worker_host,
                                         self.config.check_timeout, self._api_key, self.role, self._kv_secret)
        member = Member(actor, next(self._numbers), self.clock())
        log.info("%sworker actor %d created", "" if self.role == "both" else self.role + " ", member.number)
        return member

    def start(self) -> None:
        """Create the first workers and start supervising (a thread of its own, until close())."""
        with self._lock:
            self.members = [self._create() for _ in range(self.target)]
        self._thread = threading.Thread(target=self._run, name="tokenloom-ray-supervisor", daemon=True)
        self._thread.start()

    def supervising(self) -> bool:
        """The supervisor thread runs (started and not closed): what a health check of its host asks."""
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def wait_ready(self, n: int, timeout: float) -> None:
        """Block until `n` workers are published (TimeoutError after `timeout` s)."""
        deadline = time.monotonic() + timeout
        while len(self._published) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self._published)} of {n} Ray workers ready after {timeout:.0f} s: "
                                   f"{self.describe()}")
            time.sleep(0.1)

    def _run(self) -> None:
        next_scale = self.clock()
        while not self._stop.wait(self.config.check_interval):
            try:
                self.check_once()
                interval = self.config.autoscale.interval
                if interval > 0 and self.clock() >= next_scale:
                    next_scale = self.clock() + interval
                    self.autoscale_once()
            except Exception:  # noqa: BLE001 - the supervisor must outlive any one failure
                log.exception("ray worker supervisor: unexpected error")

    def check_once(self) -> None:
        import ray

        c = self.config
        with self._lock:
            for m in self.members:
                if m.pending is None and m.stopping is None:
                    m.pending, m.pending_since = m.actor.info.remote(), self.clock()
            refs = [m.pending for m in self.members if m.pending is not None]
        done = set(ray.wait(refs, num_returns=len(refs), timeout=c.check_interval)[0]) if refs else set()
        with self._lock:
            now = self.clock()
            for m in self.members:
                if m.pending is None or m.pending not in done:
                    continue
                try:
                    info: WorkerInfo | None = ray.get(m.pending)
                except ray.exceptions.RayError as e:  # the actor died (Ray restarts it) or is restarting
                    if m.info is not None:
                        log.warning("worker actor %d (%s) failed: %s", m.number, m.info.url, type(e).__name__)
                    info = None
                m.pending = None
                if info is not None and info.ready and (m.info is None or not m.info.ready or m.info.url != info.url):
                    log.info("worker actor %d ready at %s (node %s)", m.number, info.url, info.node_id[:12])
                m.info = info
                if info is not None and info.ready:
                    m.since = now
            self._retire_silent(now)
            self._reconcile(now)
            self._drain(now)
            self._published = tuple(m.info.url for m in self.members  # type: ignore[union-attr]
                                    if m.published(now, c.check_timeout))

    def _retire_silent(self, now: float) -> None:
        """Replace the actors not ready for `startup_timeout` s (Ray cannot restart them: no room, a lost node)."""
        import ray

        for m in [m for m in self.members if m.draining_since is None and now - m.since > self.config.startup_timeout]:
            log.error("worker actor %d not ready for %.0f s: replacing it", m.number, now - m.since)
            ray.kill(m.actor, no_restart=True)
            self.members.remove(m)
            self.replaced += 1

    def _reconcile(self, now: float) -> None:
        live = [m for m in self.members if m.draining_since is None]
        for _ in range(self.target - len(live)):
            self.members.append(self._create())
        if len(live) > self.target:
            # The cheapest to lose first: not ready yet, then the fewest requests in flight, then the newest.
            def cost(m: Member) -> tuple[bool, int, int]:
                ready = m.info is not None and m.info.ready
                return ready, self.routing.outstanding_of(m.info.url) if m.info else 0, -m.number

            for m in sorted(live, key=cost)[:len(live) - self.target]:
                log.info("worker actor %d (%s) draining", m.number, m.info.url if m.info else "not ready")
                m.draining_since = now

    def _drain(self, now: float) -> None:
        import ray

        for m in [m for m in self.members if m.draining_since is not None]:
            if m.stopping is None:
                url = m.info.url if m.info is not None else None
                idle = url is None or (not self.routing.routes_to(url) and self.routing.outstanding_of(url) == 0)
                if idle or now - m.draining_since > self.config.drain_timeout:
                    m.stopping = m.actor.stop.remote(self.config.graceful_timeout)
                continue
            if ray.wait([m.stopping], timeout=0)[0]:
                ray.kill(m.actor, no_restart=True)
                self.members.remove(m)
                log.info("worker actor %d stopped", m.number)

    # --- autoscaling ---------------------------------------------------------------------------------------

    def loads(self) -> list[Load]:
        out = []
        for url in self._published:
            try:
                out.append(parse_load(httpx.get(url + "/metrics", timeout=self.config.check_timeout).text))
            except httpx.HTTPError:
                continue  # a worker going away: the next check publishes without it
        return out

    def autoscale_once(self) -> None:
        loads = self.loads()
        with self._lock:
            live = len([m for m in self.members if m.draining_since is None])
            want = self.autoscaler.observe(loads, live)
            if want != self.target:
                log.info("autoscale: %d -> %d workers (waiting %s, running %s, kv %s)", self.target, want,
                         [x.waiting for x in loads], [x.running for x in loads], [x.kv_usage for x in loads])
                self.scaled["up" if want > self.target else "down"] += 1
                self.target = want

    def close(self) -> None:
        """Stop supervising and stop every worker (each drains for up to `graceful_timeout` s)."""
        import ray

        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.config.check_interval + self.config.check_timeout + 5.0)
        with self._lock:
            members, self.members = self.members, []
            self._published = ()
        stops = [m.actor.stop.remote(self.config.graceful_timeout) for m in members]
        try:
            if stops:  # none on a second close()
                ray.wait(stops, num_returns=len(stops), timeout=self.config.graceful_timeout + 10.0)
        finally:
            for m in members:
                ray.kill(m.actor, no_restart=True)
