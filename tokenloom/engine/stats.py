"""Engine counters and per-request timings: what each step did, recorded after `Scheduler.update`.

Times are on the monotonic clock. A sequence's step time counts as prefill while the step computed its
prompt (or recomputed it after preemption), as decode otherwise; a request's metrics are built from its
sequences' times when its outputs are collected.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenloom.engine.kv_cache_manager import KVCacheManager
from tokenloom.engine.scheduler import ScheduledBatch, Scheduler, StepUpdate
from tokenloom.engine.sequence import Request, Sequence
from tokenloom.outputs import RequestMetrics


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verification steps of speculating sequences
    draft_tokens: int = 0  # draft tokens proposed and verified
    accepted_tokens: int = 0  # of those, accepted

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification step: accepted drafts + the target's own token."""
        return 1.0 + self.accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens computed (recomputation after preemption included)
    generated_tokens: int = 0
    finished_requests: dict[str, int] = field(default_factory=dict)  # by finish reason
    spec: SpecDecodeStats = field(default_factory=SpecDecodeStats)

    def record_step(self, batch: ScheduledBatch, update: StepUpdate, t0: float, t1: float) -> None:
        """One step that started computing at t0 and had its tokens sampled at t1."""
        self.steps += 1
        for seq, n, prompt in zip(batch.seqs, batch.num_new_tokens, update.computed_prompt):
            if seq.times.first_scheduled is None:
                seq.times.first_scheduled = t0
            if prompt:
                self.prompt_tokens += n
                seq.times.prefill_seconds += t1 - t0
            else:
                seq.times.decode_seconds += t1 - t0
        self.generated_tokens += update.num_sampled
        for seq in update.sampled:
            if seq.times.first_token is None:
                seq.times.first_token = t1
            seq.times.last_token = t1
        for drafted, accepted in update.drafts:
            self.spec.record(drafted, accepted)
        for seq in update.finished:
            self.record_finished(seq)

    def record_finished(self, seq: Sequence) -> None:
        seq.times.finished = time.monotonic()
        reason = seq.output.finish_reason or seq.status.value
        self.finished_requests[reason] = self.finished_requests.get(reason, 0) + 1

    def counters(self, scheduler: Scheduler, kv: KVCacheManager) -> dict[str, float]:
        """Counters since start: steps, tokens, preemptions, prefix cache (tokens) and KV blocks."""
        pc, pool, sd = kv.stats, kv.pool, self.spec
        return {
            "steps": self.steps,
            "prompt_tokens_computed": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "preemptions": scheduler.num_preemptions,
            "prefix_cache_queries": pc.queries,
            "prefix_cache_hits": pc.hits,
            "prefix_cache_hit_rate": pc.hit_rate,
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_used": pool.num_used,
            "kv_blocks_cached": pool.num_cached,
            "kv_blocks_evicted": pool.num_evictions,
            "kv_blocks_released_by_window": kv.num_released,  # windowed layers' blocks out of reach
            "spec_decode_num_drafts": sd.num_drafts,
            "spec_decode_draft_tokens": sd.draft_tokens,
            "spec_decode_accepted_tokens": sd.accepted_tokens,
            "spec_decode_acceptance_rate": sd.acceptance_rate,
            "spec_decode_mean_accepted_length": sd.mean_accepted_length,
        }


def request_metrics(req: Request) -> RequestMetrics:
    """A request's timings from its sequences': the first to start, the longest to finish."""
    first = req.seqs[0].times
    firsts = [s.times.first_scheduled for s in req.seqs if s.times.first_scheduled is not None]
    tokens = [s.times.first_token for s in req.seqs if s.times.first_token is not None]
    ends = [s.times.finished for s in req.seqs]
    return RequestMetrics(
        arrival_time=first.arrival,
        queue_time=(min(firsts) - req.arrival) if firsts else None,
        time_to_first_token=(min(tokens) - req.arrival) if tokens else None,
        prefill_time=max(s.times.prefill_seconds for s in req.seqs),
        decode_time=max(s.times.decode_seconds for s in req.seqs),
        e2e_latency=(max(e for e in ends if e is not None) - req.arrival) if all(e is not None for e in ends) else None,
        num_preemptions=sum(s.num_preemptions for s in req.seqs),
        num_output_tokens=max(s.num_output_tokens for s in req.seqs),
    )
