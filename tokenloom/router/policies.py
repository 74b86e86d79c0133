"""Which worker gets a request: round robin, least outstanding requests, or cache-aware.

Each policy picks from a non-empty list of candidates (healthy workers not tried yet for this request)
and may use the request's routing key (prefix.py). Pure Python: no I/O, no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from tokenloom.errors import ConfigError
from tokenloom.router.config import RouterConfig
from tokenloom.router.prefix import RoutingKey
from tokenloom.router.workers import Worker


_CYCLE = 1 << 32  # larger than any pool: (index - last - 1) % _CYCLE orders the indices after `last` first


class Policy(Protocol):
    uses_key: bool  # whether choose() looks at the routing key (the proxy skips hashing otherwise)

    def choose(self, candidates: Sequence[Worker], key: RoutingKey) -> Worker: ...


class RoundRobin:
    """Each worker in pool order, in turn; workers not among the candidates (down, or already tried by this
    request) are skipped without losing the turn of the ones after them."""

    uses_key = False

    def __init__(self) -> None:
        self._last = -1  # pool index of the worker chosen last

    def choose(self, candidates: Sequence[Worker], key: RoutingKey) -> Worker:
        worker = min(candidates, key=lambda w: (w.index - self._last - 1) % _CYCLE)
        self._last = worker.index
        return worker


class LeastOutstanding:
    """The worker with the fewest requests in flight; ties rotate, so an idle cluster still spreads load."""

    uses_key = False

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, candidates: Sequence[Worker], key: RoutingKey) -> Worker:
        n = len(candidates)
        start = self._turn % n
        self._turn += 1
        best = min(range(n), key=lambda i: (candidates[i].outstanding, (i - start) % n))
        return candidates[best]


class CacheAware:
    """Send a prompt to the worker that served its longest known prefix, unless that worker has more than
    `margin` requests in flight above the least loaded candidate; otherwise (and for new prefixes) the
    least loaded. The chosen worker becomes the owner of every chunk of the prompt."""

    uses_key = True

    def __init__(self, margin: int, table_size: int) -> None:
        self.margin = margin
        self._table_size = table_size
        self._owner: OrderedDict[bytes, str] = OrderedDict()  # chunk hash -> worker URL, LRU order
        self._least = LeastOutstanding()

    def owner(self, key: RoutingKey) -> str | None:
        """The worker URL remembered for the longest prefix of `key`, if any."""
        for h in reversed(key):
            url = self._owner.get(h)
            if url is not None:
                return url
        return None

    def choose(self, candidates: Sequence[Worker], key: RoutingKey) -> Worker:
        least = self._least.choose(candidates, key)
        url = self.owner(key)
        holder = next((w for w in candidates if w.url == url), None)
        chosen = holder if holder is not None and holder.outstanding - least.outstanding <= self.margin else least
        for h in key:
            self._owner[h] = chosen.url
            self._owner.move_to_end(h)
        while len(self._owner) > self._table_size:
            self._owner.popitem(last=False)
        return chosen


def make_policy(config: RouterConfig) -> Policy:
    if config.policy == "round_robin":
        return RoundRobin()
    if config.policy == "least_outstanding":
        return LeastOutstanding()
    if config.policy == "cache_aware":
        return CacheAware(config.cache_aware_margin, config.prefix_table_size)
    raise ConfigError(f"unknown routing policy {config.policy!r}")
