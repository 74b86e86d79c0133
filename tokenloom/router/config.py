"""The router's settings: one frozen dataclass, built from the CLI flags in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from tokenloom.errors import ConfigError

RoutingPolicy = Literal["round_robin", "least_outstanding", "cache_aware"]  # --policy
POLICIES: tuple[RoutingPolicy, ...] = get_args(RoutingPolicy)


@dataclass(frozen=True)
class RouterConfig:
    workers: tuple[str, ...]  # base URLs, e.g. http://10.0.0.5:8000
    policy: RoutingPolicy = "least_outstanding"
    # Disaggregated prefill/decode: prefill workers (`serve --role prefill`) compute the prompts of OpenAI
    # completion and chat requests and ship their KV blocks to the decode worker chosen from `workers`.
    prefill_workers: tuple[str, ...] = ()
    kv_transfer_timeout: float = 30.0  # seconds a prefill worker's KV send to a decode worker may take
    health_interval: float = 2.0  # seconds between /health checks of every worker
    health_timeout: float = 2.0
    # Health-check timeouts in a row that take a worker out (a refused connection or a non-200 answer
    # takes it out at once: those are definite, a timeout may be a busy machine).
    unhealthy_after: int = 2
    max_retries: int = 2  # further workers a request that has not started may be sent to
    api_key: str | None = None
    cache_aware_margin: int = 4  # outstanding requests the prefix's worker may have above the least loaded
    prefix_chunk_chars: int = 64  # cache_aware: characters per hashed prefix chunk (about one 16-token block)
    prefix_max_chunks: int = 128  # cache_aware: chunks of a prompt that are hashed (longer prefixes share these)
    prefix_table_size: int = 200_000  # cache_aware: remembered prefix chunks (least recently used go first)
    connect_timeout: float = 2.0
    # Longest silence of a worker mid-response; a non-streaming request sends nothing until it is done,
    # so this bounds its generation time too.
    read_timeout: float = 600.0
    # Workers found at run time instead of listed (router/discovery.py): `dns:NAME:PORT`, polled every
    # `discovery_interval` seconds. `tokenloom ray-serve` passes its own discovery to build_router_app.
    worker_discovery: str | None = None
    discovery_interval: float = 5.0

    def __post_init__(self) -> None:
        # "http://host:8001/" and "http://host:8001" are one worker: paths are appended to the URL.
        object.__setattr__(self, "workers", tuple(url.rstrip("/") for url in self.workers))
        object.__setattr__(self, "prefill_workers", tuple(url.rstrip("/") for url in self.prefill_workers))
        if self.worker_discovery is not None:
            from tokenloom.router.discovery import EXTERNAL, parse_discovery  # late: discovery imports the pool

            if self.worker_discovery != EXTERNAL:
                parse_discovery(self.worker_discovery)  # a bad spec fails here, before anything starts
            if self.workers:
                raise ConfigError("--worker and --worker-discovery: give one or the other")
        if not self.workers and self.worker_discovery is None:
            raise ConfigError("the router needs at least one worker (--worker URL or --worker-discovery)")
        for flag, urls in (("--worker", self.workers), ("--prefill-worker", self.prefill_workers)):
            for url in urls:
                if not url.startswith(("http://", "https://")):
                    raise ConfigError(f"{flag} {url!r}: expected a base URL such as http://127.0.0.1:8001")
        every = self.workers + self.prefill_workers
        if len(set(every)) != len(every):
            raise ConfigError(f"--worker / --prefill-worker: a URL is given twice: {', '.join(every)}")
        if self.policy not in POLICIES:
            raise ConfigError(f"--policy {self.policy!r}: expected one of {', '.join(POLICIES)}")
        positive = {"health_interval": self.health_interval, "health_timeout": self.health_timeout,
                    "connect_timeout": self.connect_timeout, "read_timeout": self.read_timeout,
                    "kv_transfer_timeout": self.kv_transfer_timeout,
                    "discovery_interval": self.discovery_interval}
        for name, value in positive.items():
            if not value > 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0 (got {value})")
        counts = {"max_retries": (self.max_retries, 0), "cache_aware_margin": (self.cache_aware_margin, 0),
                  "unhealthy_after": (self.unhealthy_after, 1), "prefix_chunk_chars": (self.prefix_chunk_chars, 1),
                  "prefix_max_chunks": (self.prefix_max_chunks, 1), "prefix_table_size": (self.prefix_table_size, 1)}
        for name, (value, least) in counts.items():
            if value < least:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= {least} (got {value})")
