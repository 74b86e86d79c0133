"""One sequence's state as it moves waiting -> running -> finished (and back to waiting when preempted),
and the request that groups a prompt's n sequences.

A Sequence holds what the scheduler and the KV cache manager work with (tokens, computed tokens, block
table, prefix-cache hashes). Parts live beside it, each changed by one owner: `spec` (draft tokens
waiting for verification: the proposers write it, the scheduler settles it after each step), `output`
(detokenized text, stop state and what has been streamed) and `constraint` (the grammar matcher: the
sampler reads its mask, the output processor advances it).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from tokenizers.decoders import DecodeStream

from tokenloom.outputs import TokenLogprob
from tokenloom.sampling_params import SamplingParams

if TYPE_CHECKING:  # engine/constraint.py imports the grammar engine, loaded only when a request needs it
    from tokenloom.engine.constraint import SequenceConstraint


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # processing this sequence raised; its request fails alone

    @property
    def finished(self) -> bool:
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)


@dataclass
class SequenceTimes:
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    prefill_seconds: float = 0.0  # wall time of the steps that computed this sequence's prompt
    decode_seconds: float = 0.0  # wall time of the steps that produced its later tokens


@dataclass
class SpecState:
    """Speculative decoding: draft tokens to verify next step (they follow the sequence's token_ids),
    the draft model's probabilities for them when it sampled them ((k, vocab); None for greedy or n-gram
    drafts), and how many tokens the draft model's own KV cache holds."""

    token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    draft_num_computed: int = 0

    def clear(self) -> None:
        self.token_ids, self.draft_probs = [], None


@dataclass
class OutputState:
    """What the output processor (engine/output_processor.py) made of the sequence's tokens."""

    decoder: DecodeStream | None = None
    text: str = ""
    num_emitted_chars: int = 0  # chars of text already returned to a streaming caller
    num_emitted_tokens: int = 0
    final_emitted: bool = False  # the delta carrying finish_reason has been handed out
    logprobs: list[TokenLogprob] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None  # why processing failed (FINISHED_ERROR)


@dataclass(eq=False)  # identity semantics: the scheduler looks sequences up in its queues
class Sequence:
    seq_id: str  # unique in the engine: request_id, or "request_id#i" for the i-th of n
    request_id: str
    index: int  # which of the request's n completions
    prompt_token_ids: list[int]  # shared by the request's n sequences: never mutated
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens capped by max_model_len - prompt length
    stop_token_ids: frozenset[int]  # eos ids (unless ignore_eos) + params.stop_token_ids
    arrival_order: int  # tie-breaker for FCFS within a priority
    priority: int = 0  # lower runs first
    generator: torch.Generator | None = None  # per-request RNG when params.seed is set
    status: SequenceStatus = SequenceStatus.WAITING
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    # One block table per KV group (engine/kv_cache.py; one group unless windowed layers release blocks).
    # A windowed group's first num_released[g] entries are NULL_BLOCK: blocks out of every query's reach,
    # gone back to the pool (engine/kv_cache_manager.py).
    block_tables: list[list[int]] = field(default_factory=lambda: [[]])
    num_released: list[int] = field(default_factory=lambda: [0])
    # Prefix caching: chained hashes of the full blocks of token_ids (memoized), how many of each
    # table's blocks are indexed in the cache, and how many prompt tokens the first admission found cached.
    block_hashes: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    times: SequenceTimes = field(default_factory=SequenceTimes)
    spec: SpecState = field(default_factory=SpecState)
    output: OutputState = field(default_factory=OutputState)
    constraint: SequenceConstraint | None = None  # the grammar its output must follow (params.structured)
    # The request's first sequence, for the others of n > 1: they are admitted once it has computed their
    # shared prompt, and find it in the prefix cache (Scheduler._sibling_computes_prompt).
    leader: Sequence | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def block_ids(self) -> list[int]:
        """The first KV group's block table (the only one of a model whose layers all keep every block)."""
        return self.block_tables[0]

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def is_prefill(self) -> bool:
        """Still computing tokens it already knows (prompt, or prompt + output after preemption)."""
        return self.num_computed_tokens < self.num_tokens - 1

    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival_order)


@dataclass(eq=False)
class Request:
    """A validated request: its prompt (one copy, shared by its sequences) and its n sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival: float
