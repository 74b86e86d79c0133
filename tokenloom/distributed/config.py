"""`tokenloom ray-serve`'s settings: one frozen dataclass, built from the CLI flags in one place."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, get_args

from tokenloom.errors import ConfigError

Placement = Literal["spread", "pack"]  # --placement: Ray's SPREAD or DEFAULT (packing) scheduling strategy
PLACEMENTS: tuple[Placement, ...] = get_args(Placement)


@dataclass(frozen=True)
class AutoscaleConfig:
    min_workers: int = 1
    max_workers: int = 1
    # Up one worker when, for `up_after` checks in a row, the workers' mean waiting queue is at least
    # `up_waiting` (0: this trigger off) or one worker's KV cache is at least `up_kv` full
    # (tokenloom:num_requests_waiting, tokenloom:kv_cache_usage_perc).
    up_waiting: float = 1.0
    up_kv: float = 0.9
    up_after: int = 2
    # Down one worker when, for `down_after` checks in a row, nothing waits and the running sequences
    # would fit on one worker less at `down_running` sequences each (0: only when all are idle).
    down_running: float = 0.0
    down_after: int = 15
    interval: float = 2.0  # seconds between checks; 0 turns autoscaling off (POST /admin/workers still scales)

    def __post_init__(self) -> None:
        if self.min_workers < 1:
            raise ConfigError(f"--min-workers must be >= 1 (got {self.min_workers})")
        if self.max_workers < self.min_workers:
            raise ConfigError(f"--max-workers ({self.max_workers}) must be >= --min-workers ({self.min_workers})")
        for name, value in (("up_after", self.up_after), ("down_after", self.down_after)):
            if value < 1:
                raise ConfigError(f"--scale-{name.replace('_', '-')} must be >= 1 (got {value})")
        for name, value in (("up_waiting", self.up_waiting), ("down_running", self.down_running),
                            ("interval", self.interval)):
            if value < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0 (got {value})")
        if not 0 < self.up_kv <= 1:
            raise ConfigError(f"--scale-up-kv must be in (0, 1] (got {self.up_kv})")


@dataclass(frozen=True)
class RayServeConfig:
    serve_argv: tuple[str, ...]  # the `tokenloom serve` flags of every worker (model, engine, serving)
    autoscale: AutoscaleConfig
    address: str | None = None  # the Ray cluster (ray.init's address; None: RAY_ADDRESS or a local one)
    initial_workers: int | None = None  # None: min_workers
    num_cpus: float = 1.0  # Ray resources each worker actor holds: the scheduler places workers by these
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources, e.g. {"node2": 1}
    placement: Placement = "spread"
    worker_host: str | None = None  # the workers' bind address (None: their node's IP, which is also advertised)
    startup_timeout: float = 600.0  # seconds a new worker gets to answer /health (model load and warm-up)
    check_interval: float = 0.5  # seconds between the supervisor's looks at its actors
    check_timeout: float = 5.0  # seconds an actor gets to answer; silence: out of routing until it does
    drain_timeout: float = 600.0  # seconds a worker being scaled down gets for its in-flight requests
    graceful_timeout: float = 30.0  # the worker's own drain after SIGTERM (its --graceful-timeout)
    # Split prefill/decode: this many `serve --role prefill` workers too (a fixed number); the autoscaled
    # workers above then run `--role decode`. 0: every worker does both.
    prefill_workers: int = 0

    def __post_init__(self) -> None:
        a = self.autoscale
        n = a.min_workers if self.initial_workers is None else self.initial_workers
        if not a.min_workers <= n <= a.max_workers:
            raise ConfigError(f"--initial-workers {n}: must be within --min-workers {a.min_workers} .. "
                              f"--max-workers {a.max_workers}")
        if self.prefill_workers < 0:
            raise ConfigError(f"--prefill-workers must be >= 0 (got {self.prefill_workers})")
        if self.num_cpus < 0 or self.num_gpus < 0 or any(v < 0 for v in self.resources.values()):
            raise ConfigError("--num-cpus-per-worker, --num-gpus-per-worker and --worker-resources must be >= 0")
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"--placement {self.placement!r}: expected one of {', '.join(PLACEMENTS)}")
        for name in ("startup_timeout", "check_interval", "check_timeout", "drain_timeout", "graceful_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name.replace('_', '-')} must be > 0 (got {getattr(self, name)})")

    def prefill_group(self) -> RayServeConfig:
        """The prefill workers' settings: the same workers, `prefill_workers` of them, never autoscaled."""
        n = self.prefill_workers
        return replace(self, autoscale=AutoscaleConfig(min_workers=n, max_workers=n, interval=0.0),
                       initial_workers=None, prefill_workers=0)

    @property
    def first_workers(self) -> int:
        return self.autoscale.min_workers if self.initial_workers is None else self.initial_workers
