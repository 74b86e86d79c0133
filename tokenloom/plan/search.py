"""`tokenloom plan search`: the cheapest fleet that meets the SLOs at a request rate.

Cost is devices (workers x tensor-parallel degree; a prefill worker costs as much as a decode worker).
For each shape of fleet (the prefill share of its workers, max-num-seqs, chunk size) the smallest
worker count that meets the SLOs is found by doubling and then bisecting: more workers of the same shape
never make a fleet slower under the same arrivals (each gets a share of them), so meeting the SLOs is
monotone in the count. The cheapest shape wins; ties go to the lower p99 TTFT. A fleet meets the SLOs
when every request finished and p99 TTFT and p99 TPOT are within them.

The verdict holds for the simulated window only: a fleet slightly short of capacity builds its queue
slowly and can still meet a TTFT SLO over a few seconds of arrivals. Give --num-requests for a window
many times the requests' end-to-end latency before trusting an answer near capacity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from tokenloom.errors import ConfigError
from tokenloom.plan.metrics import fleet_summary
from tokenloom.plan.profile_file import Profile
from tokenloom.plan.simulator import FleetConfig, simulate
from tokenloom.plan.workload import SimRequest


@dataclass(frozen=True)
class SLO:
    ttft_p99: float
    tpot_p99: float

    def __post_init__(self) -> None:
        if not (self.ttft_p99 > 0 and self.tpot_p99 > 0):
            raise ConfigError("--slo-ttft-p99 and --slo-tpot-p99 must be > 0 seconds")

    def met(self, s: dict[str, Any]) -> bool:
        return (s["failed"] == 0 and s["ttft_s_p99"] is not None and s["ttft_s_p99"] <= self.ttft_p99
                and (s["tpot_s_p99"] is None or s["tpot_s_p99"] <= self.tpot_p99))


@dataclass(frozen=True)
class Candidate:
    fleet: FleetConfig
    summary: dict[str, Any]
    meets: bool

    @property
    def devices(self) -> int:
        return self.fleet.num_devices


def split(total: int, prefill_share: float) -> tuple[int, int] | None:
    """(decode, prefill) workers of a `total`-worker fleet with that prefill share; None if it cannot be
    split (a split fleet needs at least one of each)."""
    if prefill_share <= 0:
        return total, 0
    p = max(1, round(total * prefill_share))
    return (total - p, p) if total - p >= 1 else None


def search(profile: Profile, requests: list[SimRequest], slo: SLO, base: FleetConfig,
           prefill_shares: Sequence[float] = (0.0,), max_num_seqs: Sequence[int | None] = (None,),
           chunk_sizes: Sequence[int | None] = (None,), max_workers: int = 64, seed: int = 0,
           log: Any = None) -> tuple[Candidate | None, list[Candidate]]:
    """(the cheapest fleet meeting `slo`, or None within max_workers; every fleet simulated)."""
    if max_workers < 1:
        raise ConfigError(f"--max-workers must be >= 1, got {max_workers}")
    if any(not 0 <= s < 1 for s in prefill_shares):
        raise ConfigError("--prefill-shares must be in [0, 1)")
    tried: list[Candidate] = []
    cache: dict[FleetConfig, Candidate] = {}

    def run(fleet: FleetConfig) -> Candidate:
        if fleet not in cache:
            s = fleet_summary(simulate(profile, fleet, requests, seed), slo.ttft_p99, slo.tpot_p99)
            cache[fleet] = Candidate(fleet, s, slo.met(s))
            tried.append(cache[fleet])
            if log is not None:
                c = cache[fleet]
                log(f"{c.fleet.workers} decode/colocated + {c.fleet.prefill_workers} prefill, seqs "
                    f"{fleet.max_num_seqs or profile.max_num_seqs}, chunk {fleet.max_num_batched_tokens or profile.max_num_batched_tokens}: "
                    f"TTFT p99 {_fmt(s['ttft_s_p99'])}, TPOT p99 {_fmt(s['tpot_s_p99'])} -> {'meets' if c.meets else 'misses'}")
        return cache[fleet]

    def at(total: int, share: float, seqs: int | None, chunk: int | None) -> Candidate | None:
        parts = split(total, share)
        if parts is None:
            return None
        return run(replace(base, workers=parts[0], prefill_workers=parts[1], max_num_seqs=seqs,
                           max_num_batched_tokens=chunk))

    best: Candidate | None = None
    for share in prefill_shares:
        for seqs in max_num_seqs:
            for chunk in chunk_sizes:
                lo_bad, hi = 0, 1 if share == 0 else 2  # lo_bad: largest count known to miss
                found: Candidate | None = None
                while hi <= max_workers:  # doubling
                    c = at(hi, share, seqs, chunk)
                    if c is not None and c.meets:
                        found = c
                        break
                    lo_bad, hi = hi, hi * 2
                if found is None and lo_bad < max_workers:
                    c = at(max_workers, share, seqs, chunk)
                    if c is not None and c.meets:
                        found, hi = c, max_workers
                if found is None:
                    continue
                while hi - lo_bad > 1:  # bisect between a miss and a hit
                    mid = (lo_bad + hi) // 2
                    c = at(mid, share, seqs, chunk)
                    if c is not None and c.meets:
                        found, hi = c, mid
                    else:
                        lo_bad = mid
                if best is None or (found.devices, found.summary["ttft_s_p99"]) < (best.devices, best.summary["ttft_s_p99"]):
                    best = found
    return best, tried


def _fmt(v: float | None) -> str:
    return "-" if v is None or math.isnan(v) else f"{v * 1e3:.0f} ms"
