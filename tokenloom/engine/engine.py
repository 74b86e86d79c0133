"""LLMEngine: requests in, one step at a time: schedule -> execute -> sample -> update -> collect.

Synchronous and single-threaded; the offline `LLM` drives it in a loop and the HTTP server runs the
same loop in its own thread. Construction is engine/builder.py's; what a step does to sequences and
blocks is the scheduler's (`schedule`, then `update`); counters and timings are engine/stats.py's.
"""

from __future__ import annotations

import gc
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tokenloom.config import EngineConfig
from tokenloom.engine.builder import build_engine_parts
from tokenloom.engine.output_processor import OutputProcessor, take_delta
from tokenloom.engine.sampler import SamplerOutput
from tokenloom.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from tokenloom.engine.sequence import Request, Sequence, SequenceStatus
from tokenloom.engine.stats import EngineStats, SpecDecodeStats, request_metrics
from tokenloom.errors import ContextTooLong, InvalidRequest
from tokenloom.outputs import CompletionOutput, RequestOutput
from tokenloom.sampling_params import SamplingParams
from tokenloom.spec.verify import verify_batch

if TYPE_CHECKING:
    from tokenloom.structured import GrammarBackend

log = logging.getLogger("tokenloom.engine")
# (rows as (new tokens, computed before), sequences that sampled, compute start, compute end, step end)
StepListener = Callable[[list[tuple[int, int]], int, float, float, float], None]


def freeze_gc() -> None:
    """For a process that holds its engine for life (serve, benchmarks): moves every object alive now
    (~300k: torch's modules, the model, the tokenizer) out of the cyclic collector's sight. Decoding
    makes garbage steadily, and each full collection it triggers would walk them all again (a few
    percent of single-stream decode). Not done by LLMEngine itself: an engine is part of reference
    cycles, so a frozen engine that is dropped would never be freed."""
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
        self.quant_routing, self.dense_routing = parts.quant_routing, parts.dense_routing
        self.huge_pages = parts.huge_pages  # the weights moved onto 2 MiB pages (None: not moved)
        self.sampler, self.proposer = parts.sampler, parts.proposer
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len), self.kv
        )
        self.output = OutputProcessor(self.tokenizer)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._arrivals = itertools.count()
        self._ids = itertools.count()
        self._stop_ids = frozenset(self.tokenizer.stop_token_ids)
        self._grammar: GrammarBackend | None = None  # built on the first constrained request
        self._grammar_lock = threading.Lock()
        # Called after every step with (rows, streamed, compute_start, compute_end, step_end) when set: the
        # served step trace (engine/step_trace.py). rows: (new tokens, tokens computed before) per sequence.
        self.step_listener: StepListener | None = None

    @property
    def model_name(self) -> str:
        return self.loaded.name

    @property
    def spec_stats(self) -> SpecDecodeStats:
        return self.stats.spec

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

    @property
    def grammar(self) -> GrammarBackend:
        """The grammar engine (xgrammar) for output constraints: compiles off the engine thread, with a
        cache keyed by the constraint. Built on first use (any thread), since importing it costs seconds."""
        with self._grammar_lock:
            if self._grammar is None:
                from tokenloom.structured import GrammarBackend

                self._grammar = GrammarBackend(self.tokenizer, self.model_config.vocab_size,
                                               sorted(self._stop_ids))
            return self._grammar

    def process_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        prompt: str | None = None,
        priority: int = 0,
    ) -> Request:
        """Validate a request and build its sequences. Reads no state a step changes, so any thread may
        call it (the async engine does, to answer a bad request before it is queued); `add` queues it."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequest(f"priority must be an integer, got {priority!r}", "priority")
        max_tokens = self.validate_prompt(prompt_token_ids, params)
        vocab = self.model_config.vocab_size
        bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"stop token id {bad} is outside the vocabulary [0, {vocab})", "stop_token_ids")
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                          ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("bad_words", [t for w in params.bad_words_token_ids for t in w])):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequest(f"{name}: token id {bad} is outside the vocabulary [0, {vocab})", name)
        compiled = None
        if params.structured is not None:
            if params.min_tokens:
                raise InvalidRequest("min_tokens cannot be combined with an output constraint (the grammar "
                                     "decides when the output may end)", "min_tokens")
            compiled = self.grammar.compile(params.structured)  # cached: the async engine compiled it already
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        prompt_ids = list(prompt_token_ids)  # the engine's one copy, shared by the n sequences
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
                prompt_token_ids=prompt_ids,
                params=params,
                max_tokens=max_tokens,
                stop_token_ids=stop_ids,
                arrival_order=next(self._arrivals),
                priority=priority,
                generator=gen,
            )
            if compiled is not None and params.structured is not None:
                from tokenloom.engine.constraint import SequenceConstraint

                seq.constraint = SequenceConstraint(params.structured, compiled, sorted(stop_ids))
            seq.leader = seqs[0] if seqs else None
            seq.times.arrival = now
            seqs.append(seq)
        return Request(request_id, prompt, prompt_ids, params, seqs, now)

    def add(self, req: Request) -> str:
        """Queue a request made by `process_request`."""
        if req.request_id in self.requests:
            raise InvalidRequest(f"request id {req.request_id!r} is already in use", "request_id")
        self.requests[req.request_id] = req
        for seq in req.seqs:
            self.scheduler.add(seq)
        return req.request_id

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        prompt: str | None = None,
        priority: int = 0,
    ) -> str:
        return self.add(self.process_request(prompt_token_ids, params, request_id, prompt, priority))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks. Returns its final (delta) output, None if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self._abort_seqs(req)
        outs = []
        for seq in req.seqs:
            delta = take_delta(seq, True)
            if delta is not None:
                outs.append(delta)
        return self._request_output(req, outs, finished=True)

    def _abort_seqs(self, req: Request) -> None:
        """Finish every unfinished sequence of `req` as aborted and free its blocks."""
        for seq in req.seqs:
            if not seq.status.finished:
                seq.output.finish_reason = "abort"
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
                self.stats.record_finished(seq)

    def get_stats(self) -> dict[str, float]:
        """Counters since start: steps, tokens, preemptions, prefix cache (tokens) and KV blocks."""
        return self.stats.counters(self.scheduler, self.kv)

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
        listener = self.step_listener
        # Read before update() moves num_computed_tokens on.
        trace_rows = ([(n, s.num_computed_tokens) for s, n in zip(batch.seqs, batch.num_new_tokens)]
                      if listener is not None else [])
        t0 = time.monotonic()
        rows, logits = self.runner.execute(batch)
        sampled = self._sample(batch, rows, logits)
        t1 = time.monotonic()
        update = self.scheduler.update(batch, sampled, self.output)
        self.stats.record_step(batch, update, t0, t1)
        if self.proposer is not None:
            seqs, ks = self.scheduler.reserve_drafts(self.config.num_speculative_tokens)
            if seqs:
                self.proposer.propose(seqs, ks)
                self.scheduler.release_drafts(seqs)
        for seq in update.failed:  # a request fails whole: its other sequences stop too
            self._abort_seqs(self.requests[seq.request_id])
        # Requests with news, in batch order, once each.
        touched = dict.fromkeys(seq.request_id for seq in update.sampled + update.failed)
        outputs = [o for o in (self._collect(self.requests[rid]) for rid in touched) if o is not None]
        if listener is not None:
            listener(trace_rows, len(update.sampled), t0, t1, time.monotonic())
        return outputs

    def _sample(self, batch: ScheduledBatch, rows: list[int], logits: torch.Tensor | None) -> SamplerOutput:
        """Batch row -> its new tokens: one sampled token, or the verified run of a speculating sequence."""
        if logits is None:
            return SamplerOutput([None] * len(batch.seqs), [None] * len(batch.seqs))
        try:
            args = self.sampler.prepare(batch.seqs, rows)
            out = self.sampler.sample(args, logits)
            out.verified = verify_batch(args, logits, self.sampler)
            return out
        except Exception:  # noqa: BLE001 - find the sequence(s) at fault; the others keep their tokens
            log.exception("sampling a batch failed; sampling its sequences one by one")
            return self._sample_each(batch, rows, logits)

    def _sample_each(self, batch: ScheduledBatch, rows: list[int], logits: torch.Tensor) -> SamplerOutput:
        """Sample each sequence alone (its own logits rows): one whose sampling raises fails alone."""
        out = SamplerOutput([None] * len(batch.seqs), [None] * len(batch.seqs))
        spans: dict[int, list[int]] = {}  # batch row -> its logits rows (consecutive)
        for r, b in enumerate(rows):
            spans.setdefault(b, []).append(r)
        for b, rs in spans.items():
            try:
                one = self.sampler.prepare(batch.seqs, [b] * len(rs))
                part = logits[rs[0] : rs[-1] + 1]
                got = self.sampler.sample(one, part)
                got.verified = verify_batch(one, part, self.sampler)
                out.merge(got)
            except Exception as e:  # noqa: BLE001 - this sequence's own fault
                log.exception("sampling sequence %s failed; its request ends with an error", batch.seqs[b].seq_id)
                out.failed[b] = f"{type(e).__name__}: {e}"
        return out

    def _collect(self, req: Request) -> RequestOutput | None:
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

    def _request_output(self, req: Request, outs: list[CompletionOutput], finished: bool) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=outs,
            finished=finished,
            metrics=request_metrics(req),
            num_cached_tokens=req.seqs[0].num_cached_tokens or 0,
            error=next((s.output.error for s in req.seqs if s.output.error is not None), None),
        )
