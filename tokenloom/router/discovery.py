"""Where the router's workers come from when they change at run time: `--worker-discovery dns:NAME:PORT`
(the A/AAAA records of a Kubernetes headless Service, one per ready pod) or a callable (`tokenloom
ray-serve`'s supervisor publishes its live Ray workers). `follow()` polls one and keeps the pool equal to it.

A failed lookup keeps the last answer: a DNS hiccup must not empty the pool (workers that really went away
fail their /health checks and leave routing meanwhile). An empty answer that did come back empties it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import httpx

from tokenloom.errors import ConfigError
from tokenloom.router.workers import WorkerPool

log = logging.getLogger("tokenloom.router")

# host, port -> the addresses it resolves to now (the default asks the system resolver, as getaddrinfo).
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]


class Discovery(Protocol):
    async def urls(self) -> tuple[str, ...]: ...


async def system_resolver(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def _url(scheme: str, address: str, port: int) -> str:
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    return f"{scheme}://{host}:{port}"


@dataclass(frozen=True)
class DnsDiscovery:
    """Every address `host` resolves to is one worker at `scheme://address:port`, in sorted order (so
    the pool's order, and round robin's, does not follow the resolver's shuffling)."""

    host: str
    port: int
    scheme: str = "http"
    resolve: Resolver = system_resolver

    async def urls(self) -> tuple[str, ...]:
        addresses = sorted(set(await self.resolve(self.host, self.port)),
                           key=lambda a: (ipaddress.ip_address(a).version, ipaddress.ip_address(a)))
        return tuple(_url(self.scheme, a, self.port) for a in addresses)


@dataclass(frozen=True)
class CallableDiscovery:
    """The URLs a function returns now (called on the event loop: it must not block)."""

    current: Callable[[], Sequence[str]]

    async def urls(self) -> tuple[str, ...]:
        return tuple(url.rstrip("/") for url in self.current())


# The spec of a router whose embedding program passes its Discovery to build_router_app (`ray-serve`).
EXTERNAL = "external"


def parse_discovery(spec: str) -> DnsDiscovery:
    """`dns:NAME:PORT` (or `dns+https:NAME:PORT`) -> DnsDiscovery; anything else is a ConfigError."""
    if spec == EXTERNAL:
        raise ConfigError(f"--worker-discovery {EXTERNAL}: only a program that embeds the router (tokenloom "
                          "ray-serve) supplies its workers this way")
    kind, _, rest = spec.partition(":")
    name, _, port = rest.rpartition(":")
    schemes = {"dns": "http", "dns+https": "https"}
    if kind not in schemes or not name or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--worker-discovery {spec!r}: expected dns:NAME:PORT, e.g. "
                          "dns:tokenloom-workers.default.svc.cluster.local:8000")
    return DnsDiscovery(name, int(port), schemes[kind])


async def refresh(pool: WorkerPool, discovery: Discovery, client: httpx.AsyncClient, timeout: float) -> None:
    """One poll: the pool follows the discovery's answer; new workers get their first /health check now."""
    try:
        urls = await discovery.urls()
    except (OSError, asyncio.TimeoutError) as e:  # socket.gaierror is an OSError
        log.warning("worker discovery failed (%s: %s); keeping the %d known worker(s)", type(e).__name__, e,
                    len(pool.workers))
        return
    added = pool.set_urls(urls)
    await asyncio.gather(*(pool.check(client, w, timeout) for w in added))


async def follow(pool: WorkerPool, discovery: Discovery, client: httpx.AsyncClient, interval: float,
                 timeout: float) -> None:
    """refresh() every `interval` seconds, for ever (cancel the task to stop)."""
    while True:
        await asyncio.sleep(interval)
        await refresh(pool, discovery, client, timeout)
