"""LLMEngine: requests in, one step at a time: schedule -> run the model -> sample -> stream deltas out.

Synchronous and single-threaded; the offline `LLM` drives it in a loop and the HTTP server runs the
same loop in its own thread.
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from tokenloom.config import EngineConfig
from tokenloom.engine.builder import build_engine_parts
from tokenloom.engine.output_processor import append_tokens, take_delta
from tokenloom.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from tokenloom.engine.sequence import Sequence, SequenceStatus
from tokenloom.errors import ContextTooLong, InvalidRequest
from tokenloom.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenloom.sampling_params import SamplingParams
from tokenloom.spec.verify import Verified, can_speculate, verify

log = logging.getLogger("tokenloom.engine")


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival: float


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


def freeze_gc() -> None:
    """For a process that holds its engine for life (serve, benchmarks): moves every object alive now
    (~300k: torch's modules, the model, the tokenizer) out of the cyclic collector's sight. Decoding
    makes garbage steadily, and each full collection it triggers would walk them all again (~5% of
    single-stream int4 decode). Not done by LLMEngine itself: an engine is part of reference cycles,
    so a frozen engine that is dropped would never be freed."""
    gc.collect()
    gc.freeze()


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        parts = build_engine_parts(config)
        self.device, self.backend, self.loaded = parts.device, parts.backend, parts.loaded
        self.model_config = parts.loaded.config
        self.tokenizer = parts.loaded.tokenizer
        self.max_model_len = parts.max_model_len
        self.capacity, self.kv, self.runner = parts.capacity, parts.kv, parts.runner
        self.sampler, self.proposer = parts.sampler, parts.proposer
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len), self.kv
        )
        self.spec_stats = SpecDecodeStats()
        self.requests: dict[str, _Request] = {}
        self.stats = EngineStats()
        self._arrivals = itertools.count()
        self._ids = itertools.count()
        self._stop_ids = frozenset(self.tokenizer.stop_token_ids)

    @property
    def model_name(self) -> str:
        return self.loaded.name

    # -- requests ---------------------------------------------------------------------------

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Checks the prompt against the model; returns the resolved max_tokens."""
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequest("prompt must not be empty", "prompt")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})", "prompt")
        if n >= self.max_model_len:
            raise ContextTooLong(
                f"prompt has {n} tokens; max_model_len is {self.max_model_len} and at least one token must be "
                f"generated", "prompt",
            )
        room = self.max_model_len - n
        return room if params.max_tokens is None else min(params.max_tokens, room)

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        prompt: str | None = None,
        priority: int = 0,
    ) -> str:
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use", "request_id")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequest(f"priority must be an integer, got {priority!r}", "priority")
        max_tokens = self.validate_prompt(prompt_token_ids, params)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self._stop_ids)
        now = time.monotonic()
        seqs = []
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(params.seed + i)  # the i-th completion of n gets its own stream
            seq = Sequence(
                seq_id=request_id if params.n == 1 else f"{request_id}#{i}",
                request_id=request_id,
                index=i,
                prompt_token_ids=list(prompt_token_ids),
                params=params,
                max_tokens=max_tokens,
                stop_token_ids=stop_ids,
                arrival_order=next(self._arrivals),
                priority=priority,
                generator=gen,
            )
            seq.times.arrival = now
            seqs.append(seq)
        self.requests[request_id] = _Request(request_id, prompt, list(prompt_token_ids), params, seqs, now)
        for seq in seqs:
            self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks. Returns its final (delta) output, None if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        outs = []
        for seq in req.seqs:
            if not seq.status.finished:
                seq.finish_reason = "abort"
                self._finish(seq, SequenceStatus.FINISHED_ABORTED)
            delta = take_delta(seq, True)
            if delta is not None:
                outs.append(delta)
        return self._request_output(req, outs, finished=True)

    def get_stats(self) -> dict[str, float]:
        """Counters since start: steps, tokens, preemptions, prefix cache (tokens) and KV blocks."""
        pc, pool = self.kv.stats, self.kv.pool
        return {
            "steps": self.stats.steps,
            "prompt_tokens_computed": self.stats.prompt_tokens,
            "generated_tokens": self.stats.generated_tokens,
            "preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": pc.queries,
            "prefix_cache_hits": pc.hits,
            "prefix_cache_hit_rate": pc.hit_rate,
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_used": pool.num_used,
            "kv_blocks_cached": pool.num_cached,
            "kv_blocks_evicted": pool.num_evictions,
            "spec_decode_num_drafts": self.spec_stats.num_drafts,
            "spec_decode_draft_tokens": self.spec_stats.draft_tokens,
            "spec_decode_accepted_tokens": self.spec_stats.accepted_tokens,
            "spec_decode_acceptance_rate": self.spec_stats.acceptance_rate,
            "spec_decode_mean_accepted_length": self.spec_stats.mean_accepted_length,
        }

    def reset_prefix_cache(self) -> int:
        """Drop every cached block nobody is using (e.g. between benchmark runs); returns how many."""
        return self.kv.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns delta outputs of every request that produced something."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        t0 = time.monotonic()
        for seq in batch.seqs:
            if seq.times.first_scheduled is None:
                seq.times.first_scheduled = t0
        rows, logits = self.runner.execute(batch)
        sampled = self._sample(batch, rows, logits)
        self.stats.steps += 1
        touched: dict[str, _Request] = {}
        finished: list[tuple[Sequence, SequenceStatus]] = []
        t1 = time.monotonic()
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if seq.num_computed_tokens < seq.prompt_len:
                self.stats.prompt_tokens += n
                seq.times.prefill_seconds += t1 - t0
            else:
                seq.times.decode_seconds += t1 - t0
            out = sampled.get(i)
            speculated = bool(seq.spec_token_ids)
            # K/V is now valid for the scheduled tokens, except draft tokens the target rejected.
            seq.num_computed_tokens += n if out is None or not speculated else 1 + out.num_accepted
            status = None
            if out is not None:
                status = append_tokens(seq, out.token_ids, out.logprobs, self.tokenizer)
                self.stats.generated_tokens += len(out.token_ids)
                if seq.times.first_token is None:
                    seq.times.first_token = t1
                seq.times.last_token = t1
                touched[seq.request_id] = self.requests[seq.request_id]
            if speculated:
                self.spec_stats.record(len(seq.spec_token_ids), out.num_accepted if out else 0)
                # A stop inside the accepted run leaves computed tokens past the end: never count those.
                seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
            # Drafts are verified or void after any step the sequence took part in (the scheduler may
            # have cut them to none); the draft model's cache is valid only up to what the target
            # computed, and slots reserved for drafts past the sequence's tokens go back to the pool.
            seq.draft_num_computed = min(seq.draft_num_computed, seq.num_computed_tokens)
            seq.spec_token_ids, seq.spec_draft_probs = [], None
            self.kv.trim(seq)
            self.kv.cache_full_blocks(seq)
            if status is not None:
                finished.append((seq, status))
        for seq, status in finished:
            self._finish(seq, status)
        if self.proposer is not None:
            self._propose()
        return [o for o in (self._collect(req) for req in touched.values()) if o is not None]

    def _sample(self, batch: ScheduledBatch, rows: list[int], logits: torch.Tensor | None) -> dict[int, Verified]:
        """Batch row -> its new tokens: one sampled token, or the verified run of a speculating sequence."""
        if logits is None:
            return {}
        if not any(seq.spec_token_ids for seq in batch.seqs):  # one row per sampling sequence, in order
            results = self.sampler(logits, [batch.seqs[b] for b in rows])
            return {b: Verified([res.token_id], [res.logprob], 0) for b, res in zip(rows, results)}
        by_row: dict[int, list[int]] = {}
        for r, b in enumerate(rows):
            by_row.setdefault(b, []).append(r)
        plain = [b for b in by_row if not batch.seqs[b].spec_token_ids]
        out: dict[int, Verified] = {}
        if plain:
            idx = [by_row[b][0] for b in plain]
            results = self.sampler(logits[idx], [batch.seqs[b] for b in plain])
            for b, res in zip(plain, results):
                out[b] = Verified([res.token_id], [res.logprob], 0)
        for b, rs in by_row.items():
            if b not in out:
                out[b] = verify(batch.seqs[b], logits[rs[0] : rs[-1] + 1], self.sampler)
        return out

    def _propose(self) -> None:
        """Draft tokens for the next step of every decoding sequence that may speculate."""
        k_max = self.config.num_speculative_tokens
        # Drafts must not crowd decodes out of the next step's token budget: each running sequence
        # keeps one token of it.
        room = self.config.max_num_batched_tokens - self.scheduler.num_running
        seqs, ks = [], []
        for seq in self.scheduler.running:
            if seq.spec_token_ids or seq.num_computed_tokens != seq.num_tokens - 1 or not can_speculate(seq):
                continue  # drafts still unverified (not scheduled last step), prefilling, or penalties
            # Never draft past max_tokens: the verified run ends with one target token.
            k = min(k_max, seq.max_tokens - seq.num_output_tokens - 1, room)
            if k <= 0 or not self.kv.allocate_slots(seq, 1 + k):
                continue
            seqs.append(seq)
            ks.append(k)
            room -= k
        if not seqs:
            return
        self.proposer.propose(seqs, ks)
        for seq in seqs:
            if not seq.spec_token_ids:
                self.kv.trim(seq)  # no match: give the reserved slots back

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        self.scheduler.finish(seq, status)
        seq.times.finished = time.monotonic()
        reason = seq.finish_reason or status.value
        self.stats.finished_requests[reason] = self.stats.finished_requests.get(reason, 0) + 1

    def _collect(self, req: _Request) -> RequestOutput | None:
        outs: list[CompletionOutput] = []
        for seq in req.seqs:
            delta = take_delta(seq, seq.status.finished)
            if delta is not None:
                outs.append(delta)
        finished = all(s.status.finished for s in req.seqs)
        if finished:
            del self.requests[req.request_id]
        if not outs and not finished:
            return None
        return self._request_output(req, outs, finished)

    def _request_output(self, req: _Request, outs: list[CompletionOutput], finished: bool) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=outs,
            finished=finished,
            metrics=_metrics(req),
            num_cached_tokens=req.seqs[0].num_cached_tokens or 0,
        )


def _metrics(req: _Request) -> RequestMetrics:
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
