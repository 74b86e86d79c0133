"""Warm-up: run the shapes a server will see before it says it is healthy, so the first user waits no longer
than the tenth.

The first pass over a shape pays one-off costs that later passes do not: oneDNN builds (JITs) a matmul
primitive per row count, the C++ kernels and torch's allocator touch their buffers for the first time, the
sampler's and the grammar's lazy tables are built. Before warm-up existed the first request after start-up
took 8.7 s on SmolLM2 (the issue that asked for this), against about 0.1 s for later ones.

What runs, through the engine's own `add_request` / `step` (so every path a user takes is the one warmed):
- one prompt of a full step's token budget (`max_num_batched_tokens`, capped by the model length): the
  largest prefill chunk, then its decode;
- for each decode batch size of `decode_batch_sizes` (every size the few-row C++ kernels serve, then powers
  of two up to `min(max_num_seqs, PACKED_MAX_ROWS)`), that many short requests admitted together: their
  prompts in one step, then one decode step of exactly that many rows. Sizes in between reuse the kernels
  and oneDNN's JIT code of their neighbours; running every size (128 decode steps) took 10.8 s on
  SmolLM2 Q4_1 for no measurable gain.
Afterwards the prefix cache is emptied of the warm-up prompts and the engine's counters start from zero.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from tokenloom.engine.engine import LLMEngine
from tokenloom.engine.kv_cache_manager import PrefixCacheStats
from tokenloom.engine.stats import EngineStats
from tokenloom.kernels.limits import PACKED_MAX_ROWS, SKINNY_MAX_ROWS
from tokenloom.sampling_params import SamplingParams

log = logging.getLogger("tokenloom.warmup")

# Plain text whose tokens make the warm-up prompts: any model's tokenizer encodes it to ordinary ids.
_TEXT = "The quick brown fox jumps over the lazy dog while the engine warms its kernels. "


@dataclass(frozen=True)
class WarmupReport:
    seconds: float
    prefill_tokens: int  # the longest prompt run (one step's budget)
    decode_batch_sizes: int  # the largest decode batch run (decode_batch_sizes(this) were all run)
    steps: int

    def describe(self) -> str:
        return (f"warm-up: {self.seconds:.2f} s ({self.steps} steps: a {self.prefill_tokens}-token prefill, "
                f"decode batches of {', '.join(map(str, decode_batch_sizes(self.decode_batch_sizes)))})")


def warm_up(engine: LLMEngine) -> WarmupReport:
    """Run the warm-up passes on `engine` (which must be idle); returns what ran and how long it took."""
    if engine.has_unfinished_requests():
        raise RuntimeError("warm-up needs an idle engine")  # a programming error: callers warm up at start
    start = time.monotonic()
    config = engine.config
    base = engine.tokenizer.encode(_TEXT, add_special_tokens=False) or [0]
    # Leave room for one output token: the prompt plus its output must fit the model length.
    prefill = max(1, min(config.max_num_batched_tokens, engine.max_model_len - 1))
    batch = max(1, min(config.max_num_seqs, PACKED_MAX_ROWS, engine.max_model_len // 2))

    def tokens(n: int, shift: int) -> list[int]:
        ids = base[shift % len(base):] + base * (n // len(base) + 1)
        return ids[:n]

    def greedy(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    engine.add_request(tokens(prefill, 0), greedy(2), request_id="warmup-prefill")
    steps = _drain(engine)
    for rows in decode_batch_sizes(batch):
        # Prompts short enough to fit one step together (max_num_batched_tokens >= max_num_seqs), so that
        # the next step decodes all `rows` at once; distinct (shifted text), so no prefix-cache hit.
        prompt_len = max(1, min(8, config.max_num_batched_tokens // rows, engine.max_model_len - 2))
        for i in range(rows):
            engine.add_request(tokens(prompt_len, i + 1), greedy(2), request_id=f"warmup-decode-{rows}-{i}")
        steps += _drain(engine)
    reset_counters(engine)
    return WarmupReport(time.monotonic() - start, prefill, batch, steps)


def reset_counters(engine: LLMEngine) -> None:
    """Empty the prefix cache of warm-up's prompts and start users' counters at zero: the engine's, the
    prefix cache's (else /metrics' hit rate would count warm-up's thousands of looked-up prompt tokens) and
    the scheduler's preemptions. On the engine's thread, with the engine idle."""
    engine.reset_prefix_cache()
    engine.stats = EngineStats()
    engine.kv.stats = PrefixCacheStats()
    engine.scheduler.num_preemptions = 0


def decode_batch_sizes(largest: int) -> list[int]:
    """1 .. SKINNY_MAX_ROWS (each its own few-row kernel call), then powers of two, then `largest`."""
    sizes = set(range(1, min(largest, SKINNY_MAX_ROWS) + 1))
    p = 2 * SKINNY_MAX_ROWS
    while p < largest:
        sizes.add(p)
        p *= 2
    sizes.add(largest)
    return sorted(sizes)


def _drain(engine: LLMEngine) -> int:
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.error is not None:
                raise RuntimeError(f"warm-up request {out.request_id} failed: {out.error}")
        steps += 1
    return steps
