"""Token-budget continuous batching (one mechanism for prefill chunks and decodes, as in vLLM v1).

Each step gives every running sequence the tokens it needs next (1 for a decode, 1 + k when it verifies k
draft tokens, a chunk for a prefill)
within `max_num_batched_tokens`, then admits waiting sequences in (priority, arrival) order while budget,
`max_num_seqs` and free KV blocks allow. Decodes are served before prefill chunks so a long prompt never
stalls other sequences' decoding. The n sequences of one request share: the first computes their prompt
and the others then find it in the prefix cache, and together they hold at most half the running slots, so
one large-n request cannot shut everyone else out. When blocks run out, the running sequence with the lowest priority and
latest arrival is preempted: its blocks are freed and it is recomputed later (from its first block that
is no longer in the prefix cache).

After the model ran and the sampler picked tokens, `update` settles the step: how many tokens now have
K/V in the cache (all scheduled ones, less the rejected drafts), the new tokens (through the output
processor, which says when one ends its sequence), the blocks that filled up (indexed in the prefix
cache), were reserved for rejected drafts (returned) or fell out of every windowed layer's reach
(returned), and the finished sequences (freed).
`reserve_drafts` then picks the decoding sequences that may speculate next step and reserves their slots.
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass, field

from tokenloom.engine.kv_cache_manager import KVCacheManager
from tokenloom.engine.output_processor import OutputProcessor
from tokenloom.engine.sampler import SamplerOutput, Verified
from tokenloom.engine.sequence import Sequence, SequenceStatus
from tokenloom.outputs import TokenLogprob
from tokenloom.spec.verify import can_speculate

log = logging.getLogger("tokenloom.engine")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass
class ScheduledBatch:
    """What to compute this step: `seqs[i]` gets `num_new_tokens[i]` tokens, decodes first."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


@dataclass
class StepUpdate:
    """What `Scheduler.update` did with one step, for the engine's stats and outputs."""

    computed_prompt: list[bool]  # (S,) the row computed prompt tokens (a prefill chunk, or recomputation)
    sampled: list[Sequence] = field(default_factory=list)  # sequences that got new tokens, in batch order
    num_sampled: int = 0  # tokens appended, over all of them
    finished: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)  # of those, the ones whose processing raised
    drafts: list[tuple[int, int]] = field(default_factory=list)  # (drafted, accepted) per verifying sequence


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.running: list[Sequence] = []  # admission order
        # Heap of (priority, arrival_order, seq). A sequence finished while waiting (aborted) stays in it
        # until it reaches the top and is dropped there: aborting n waiting sequences is O(n), not
        # a heap rebuild each. Invariant: _num_waiting == entries whose seq is WAITING.
        self._waiting: list[tuple[int, int, Sequence]] = []
        self._num_waiting = 0
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.running or self._num_waiting)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        heapq.heappush(self._waiting, (seq.priority, seq.arrival_order, seq))
        self._num_waiting += 1

    def waiting(self) -> list[Sequence]:
        return [entry[2] for entry in sorted(self._waiting) if entry[2].status is SequenceStatus.WAITING]

    def _next_waiting(self) -> Sequence | None:
        """The first waiting sequence in (priority, arrival) order, dropping finished ones from the top."""
        while self._waiting and self._waiting[0][2].status is not SequenceStatus.WAITING:
            heapq.heappop(self._waiting)
        return self._waiting[0][2] if self._waiting else None

    def _sibling_computes_prompt(self, seq: Sequence) -> bool:
        """One of a request's n sequences waits while the first one computes their shared prompt: it then
        finds the prompt in the prefix cache instead of computing it again (n = 128 would otherwise compute
        a long prompt 128 times over, and everyone queued behind it would wait for all of that)."""
        leader = seq.leader
        return (leader is not None and self.kv.enable_prefix_caching and seq.num_computed_tokens == 0
                and not leader.status.finished and leader.num_computed_tokens < leader.prompt_len)

    def _request_share_full(self, seq: Sequence) -> bool:
        """A request's n sequences hold at most half the running slots (max_num_seqs // 2): the other half
        stays for other requests, so one request with a large n cannot fill every slot and make everyone
        queued behind it wait until its completions end. Its other sequences run as these finish."""
        if seq.leader is None and seq.params.n == 1:
            return False
        share = max(1, self.config.max_num_seqs // 2)
        return sum(1 for s in self.running if s.request_id == seq.request_id) >= share

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End a sequence (stopped, length, aborted), wherever it is, and free its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self._num_waiting -= 1  # its heap entry is dropped when it reaches the top
        self.kv.free(seq)
        seq.status = status

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.spec.draft_num_computed = 0
        seq.spec.clear()
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    # -- one step ---------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[int, tuple[Sequence, int]] = {}  # id(seq) -> (seq, tokens), insertion = batch order
        preempted: list[Sequence] = []

        # Running sequences: decodes first, then prefill chunks (each in admission order).
        for seq in sorted(self.running, key=lambda s: s.is_prefill):
            if budget <= 0:
                break
            if seq not in self.running:  # preempted earlier in this loop
                continue
            spec = len(seq.spec.token_ids)  # draft tokens to verify: 1 + k tokens for a decode
            n = min(seq.num_tokens - seq.num_computed_tokens + spec, budget)
            if spec and n < 1 + spec:  # the budget cuts the drafts short: verify fewer
                del seq.spec.token_ids[max(n - 1, 0):]
                if seq.spec.draft_probs is not None:
                    seq.spec.draft_probs = seq.spec.draft_probs[: len(seq.spec.token_ids)]
            while not self.kv.allocate_slots(seq, n):
                victim = max(self.running, key=Sequence.sort_key)
                self.running.remove(victim)
                if id(victim) in scheduled:
                    budget += scheduled.pop(id(victim))[1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled[id(seq)] = (seq, n)
                budget -= n

        # Waiting sequences, unless this step already had to preempt (no room to grow). Each starts
        # after the longest prefix of its tokens already in the cache.
        deferred: list[tuple[int, int, Sequence]] = []
        while not preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self._next_waiting()
            if seq is None:
                break
            if self._sibling_computes_prompt(seq) or self._request_share_full(seq):
                deferred.append(heapq.heappop(self._waiting))  # back in the queue after this step's admissions
                continue
            cached = self.kv.find_cached_prefix(seq)
            n = min(seq.num_tokens - cached.num_blocks * self.kv.block_size, budget)
            if not self.kv.allocate_slots(seq, n, cached):
                break
            heapq.heappop(self._waiting)
            self._num_waiting -= 1
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled[id(seq)] = (seq, n)
            budget -= n

        for entry in deferred:
            heapq.heappush(self._waiting, entry)

        batch = ScheduledBatch(preempted=preempted)
        # Decodes first in the flat batch lets attention treat them as one contiguous group.
        for seq, n in sorted(scheduled.values(), key=lambda sn: sn[1] > 1):
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
        return batch

    # -- after the model ran --------------------------------------------------------------------

    def update(self, batch: ScheduledBatch, sampled: SamplerOutput, output: OutputProcessor) -> StepUpdate:
        """Settle one executed step (see the module docstring); finished sequences are freed here."""
        result = StepUpdate([seq.num_computed_tokens < seq.prompt_len for seq in batch.seqs])
        finished: list[tuple[Sequence, SequenceStatus]] = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if i in sampled.failed:
                status: SequenceStatus | None = self._failed(seq, sampled.failed[i], result)
            else:
                try:
                    status = self._settle(seq, n, sampled.verified.get(i), sampled.token_ids[i], sampled.logprobs[i],
                                          output, result)
                except Exception as e:  # noqa: BLE001 - one sequence's fault (detokenizing, a stop check) is its own
                    log.exception("sequence %s failed; its request ends with an error", seq.seq_id)
                    status = self._failed(seq, f"{type(e).__name__}: {e}", result)
            if status is not None:
                finished.append((seq, status))
        for seq, status in finished:  # after the loop: no block is freed while others still cache theirs
            self.finish(seq, status)
            result.finished.append(seq)
        return result

    @staticmethod
    def _failed(seq: Sequence, why: str, result: StepUpdate) -> SequenceStatus:
        seq.output.finish_reason, seq.output.error = "error", why
        seq.spec.clear()
        result.failed.append(seq)
        return SequenceStatus.FINISHED_ERROR

    def _settle(self, seq: Sequence, n: int, run: Verified | None, token: int | None, logprob: TokenLogprob | None,
                output: OutputProcessor, result: StepUpdate) -> SequenceStatus | None:
        """One sequence's part of `update`; returns its finishing status, if it finished."""
        status = None
        if run is not None:  # verified k drafts: K/V is valid for the accepted ones and the last token
            seq.num_computed_tokens += 1 + run.num_accepted
            result.drafts.append((len(seq.spec.token_ids), run.num_accepted))
            for t, lp in zip(run.token_ids, run.logprobs):
                result.num_sampled += 1
                status = output.append(seq, t, lp)
                if status is not None:
                    break
            # A stop inside the accepted run leaves computed tokens past the end: never count those.
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
        else:
            seq.num_computed_tokens += n
            if token is not None:
                result.num_sampled += 1
                status = output.append(seq, token, logprob)
        if run is not None or token is not None:
            result.sampled.append(seq)
        # Drafts are verified or void after any step the sequence took part in (the scheduler may
        # have cut them to none); the draft model's cache is valid only up to what the target
        # computed, and slots reserved for drafts past the sequence's tokens go back to the pool.
        seq.spec.draft_num_computed = min(seq.spec.draft_num_computed, seq.num_computed_tokens)
        seq.spec.clear()
        self.kv.trim(seq)
        self.kv.cache_full_blocks(seq)
        self.kv.release(seq)  # windowed layers' blocks out of reach (after caching: they stay findable)
        return status

    def reserve_drafts(self, k_max: int) -> tuple[list[Sequence], list[int]]:
        """The decoding sequences that may speculate next step and how many draft tokens each (at most
        `k_max`), with KV slots reserved for them. Hand them to a proposer, then `release_drafts`."""
        # Drafts must not crowd decodes out of the next step's token budget: each running sequence
        # keeps one token of it.
        room = self.config.max_num_batched_tokens - self.num_running
        seqs, ks = [], []
        for seq in self.running:
            if seq.spec.token_ids or seq.num_computed_tokens != seq.num_tokens - 1 or not can_speculate(seq):
                continue  # drafts still unverified (not scheduled last step), prefilling, or penalties
            # Never draft past max_tokens: the verified run ends with one target token.
            k = min(k_max, seq.max_tokens - seq.num_output_tokens - 1, room)
            if k <= 0 or not self.kv.allocate_slots(seq, 1 + k):
                continue
            seqs.append(seq)
            ks.append(k)
            room -= k
        return seqs, ks

    def release_drafts(self, seqs: list[Sequence]) -> None:
        """After proposing: a sequence that got no draft (no n-gram match) gives its reserved slots back."""
        for seq in seqs:
            if not seq.spec.token_ids:
                self.kv.trim(seq)
