"""The router's view of its workers: health, outstanding requests, failures; periodic /health checks.

A worker is taken out when it refuses connections, answers /health with anything but 200, or times out
`unhealthy_after` checks in a row; the first 200 from /health lets it back in.

The set of workers may change at run time (set_urls, fed by router/discovery.py: DNS, Ray): a new worker
enters unhealthy until its first check answers 200; a removed one leaves routing at once, and its requests
still in flight finish (the proxy holds its Worker) and are counted by outstanding_of() until done, which
is what a graceful scale-down waits for before it stops the worker.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import httpx

log = logging.getLogger("tokenloom.router")


@dataclass
class Worker:
    url: str
    index: int = 0  # position in the pool (round robin's order)
    healthy: bool = False  # unknown until the first check answers
    outstanding: int = 0  # requests sent and not yet finished (their responses still streaming)
    consecutive_failures: int = 0
    kv_address: str | None = None  # a `--role decode` worker's KV receiver (tcp://host:port), from /health


class WorkerPool:
    def __init__(self, urls: tuple[str, ...], unhealthy_after: int,
                 on_change: Callable[[Worker], None] | None = None) -> None:
        self.workers = [Worker(url, i) for i, url in enumerate(urls)]
        self._unhealthy_after = unhealthy_after
        self._on_change = on_change  # metrics: up/outstanding gauges follow every change
        self._next_index = len(self.workers)  # new workers come after every index ever given (round robin)
        self.retired: dict[str, Worker] = {}  # removed workers whose requests are still in flight

    def set_urls(self, urls: tuple[str, ...]) -> list[Worker]:
        """Make the pool exactly `urls` (kept in their order of arrival); the workers added, for a first check."""
        wanted = set(urls)
        for w in [w for w in self.workers if w.url not in wanted]:
            log.info("worker %s removed from the pool (%d request(s) still in flight)", w.url, w.outstanding)
            w.healthy = False
            self.workers.remove(w)
            if w.outstanding > 0:
                self.retired[w.url] = w
            self._changed(w)
        known = {w.url for w in self.workers}
        added = []
        for url in urls:
            if url in known:
                continue
            # A URL that comes back (a restarted worker on the same address) takes its in-flight count along.
            w = self.retired.pop(url, None) or Worker(url)
            w.index, w.healthy, w.consecutive_failures = self._next_index, False, 0
            self._next_index += 1
            self.workers.append(w)
            known.add(url)
            added.append(w)
            log.info("worker %s added to the pool", url)
            self._changed(w)
        return added

    def routes_to(self, url: str) -> bool:
        """Whether `url` is in the pool (healthy or not): a worker not in it gets no new requests."""
        return any(w.url == url for w in self.workers)

    def outstanding_of(self, url: str) -> int:
        """Requests in flight at `url`, whether it is still in the pool or was removed."""
        for w in self.workers:
            if w.url == url:
                return w.outstanding
        w = self.retired.get(url)
        return w.outstanding if w is not None else 0

    def available(self, exclude: set[str] | frozenset[str] = frozenset()) -> list[Worker]:
        return [w for w in self.workers if w.healthy and w.url not in exclude]

    def acquire(self, worker: Worker) -> None:
        worker.outstanding += 1
        self._changed(worker)

    def release(self, worker: Worker) -> None:
        worker.outstanding -= 1
        if worker.outstanding == 0 and self.retired.get(worker.url) is worker:
            del self.retired[worker.url]
        self._changed(worker)

    def mark_down(self, worker: Worker, reason: str) -> None:
        worker.consecutive_failures += 1
        if worker.healthy:
            log.warning("worker %s taken out: %s", worker.url, reason)
        worker.healthy = False
        self._changed(worker)

    def mark_failure(self, worker: Worker, reason: str) -> None:
        """A failure that alone does not prove the worker dead (a timeout, a dropped connection)."""
        worker.consecutive_failures += 1
        if worker.consecutive_failures >= self._unhealthy_after:
            self.mark_down(worker, f"{reason} ({worker.consecutive_failures} failures in a row)")

    def succeeded(self, worker: Worker) -> None:
        """A response started: the failures before it were not in a row."""
        worker.consecutive_failures = 0

    def mark_up(self, worker: Worker) -> None:
        if worker not in self.workers:  # removed while its check was in flight: it stays out
            return
        if not worker.healthy:
            log.info("worker %s is healthy", worker.url)
        worker.healthy = True
        worker.consecutive_failures = 0
        self._changed(worker)

    async def check(self, client: httpx.AsyncClient, worker: Worker, timeout: float) -> None:
        try:
            r = await client.get(worker.url + "/health", timeout=timeout)
        except httpx.TimeoutException as e:
            self.mark_failure(worker, f"/health timed out ({type(e).__name__})")
            return
        except httpx.HTTPError as e:
            self.mark_down(worker, f"/health failed: {type(e).__name__}: {e}")
            return
        if r.status_code == 200:
            try:
                kv = r.json().get("kv_address")
            except (ValueError, AttributeError):
                kv = None
            worker.kv_address = kv if isinstance(kv, str) else None
            self.mark_up(worker)
        else:
            self.mark_down(worker, f"/health answered {r.status_code}")

    async def check_all(self, client: httpx.AsyncClient, timeout: float) -> None:
        await asyncio.gather(*(self.check(client, w, timeout) for w in self.workers))

    async def run_health_checks(self, client: httpx.AsyncClient, interval: float, timeout: float) -> None:
        """Check every worker every `interval` seconds, for ever (cancel the task to stop)."""
        while True:
            await self.check_all(client, timeout)
            await asyncio.sleep(interval)

    def _changed(self, worker: Worker) -> None:
        if self._on_change is not None:
            self._on_change(worker)
