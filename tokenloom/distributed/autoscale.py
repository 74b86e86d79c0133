"""How many workers the measured load asks for: the workers' queue depth and KV usage, read from their
/metrics (tokenloom:num_requests_waiting, tokenloom:num_requests_running, tokenloom:kv_cache_usage_perc,
serve/metrics.py), turned into "one more", "one fewer" or "as many as now". Pure: no Ray, no I/O, no clock
(the supervisor calls observe() every AutoscaleConfig.interval seconds).

One step at a time, each needing its condition on several checks in a row (hysteresis: a burst of a few
seconds does not start a worker that takes longer than that to load; one quiet check does not stop one),
and the count starts over after every change, so that the new worker's effect is measured before the next.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from tokenloom.distributed.config import AutoscaleConfig

_WAITING, _RUNNING, _KV = "tokenloom:num_requests_waiting", "tokenloom:num_requests_running", \
    "tokenloom:kv_cache_usage_perc"


@dataclass(frozen=True)
class Load:
    waiting: float  # requests queued, not yet scheduled
    running: float  # sequences being computed
    kv_usage: float  # fraction of KV blocks in use, 0..1


def parse_load(prometheus_text: str) -> Load:
    """A worker's Load from its /metrics text (summed over models: one per worker today)."""
    found = {_WAITING: 0.0, _RUNNING: 0.0, _KV: 0.0}
    for family in text_string_to_metric_families(prometheus_text):
        for sample in family.samples:
            if sample.name in found:
                found[sample.name] += sample.value
    return Load(waiting=found[_WAITING], running=found[_RUNNING], kv_usage=found[_KV])


class Autoscaler:
    def __init__(self, config: AutoscaleConfig) -> None:
        self.config = config
        self._high = 0  # checks in a row the load asked for one more worker
        self._low = 0  # checks in a row it would fit on one fewer

    def observe(self, loads: Sequence[Load], workers: int) -> int:
        """The worker count to have, given the loads of the `workers` live ones (those that answered)."""
        c = self.config
        if workers < c.min_workers:  # below the floor (a worker died): back up, whatever the load
            return c.min_workers
        if not loads:
            return workers
        waiting = sum(x.waiting for x in loads)
        running = sum(x.running for x in loads)
        high = waiting / len(loads) >= c.up_waiting > 0 or max(x.kv_usage for x in loads) >= c.up_kv
        low = waiting == 0 and running <= c.down_running * (workers - 1)
        self._high = self._high + 1 if high else 0
        self._low = self._low + 1 if low and not high else 0
        if self._high >= c.up_after and workers < c.max_workers:
            self._high = self._low = 0
            return workers + 1
        if self._low >= c.down_after and workers > c.min_workers:
            self._high = self._low = 0
            return workers - 1
        return workers
