"""`tokenloom plan profile`: time real engine steps on this machine and fit the step-cost model.

Every step is a real `LLMEngine.step()` of the engine built from the given flags (model, dtype, threads,
chunk size, ...): its wall time is measured around the call, and its rows (num_new_tokens,
num_computed_tokens) are read from the batch the engine's own scheduler made, through a recorder wrapped
around that one engine instance's `schedule` (nothing in the engine changes). The grid:
- decode: R rows at context L for each R in --decode-rows (fewest first) and L in --context-lens, each row
  its own prompt of L tokens computed in full (prefill chunks of up to max_num_batched_tokens at growing
  offsets: these are timed too), so that R rows read R contexts' K/V as served requests do (until
  2026-12-05 the R - 1 other rows were prefix hits of the first one's prompt and read its K/V blocks,
  which stayed in the CPU's cache: 16-64-row steps were priced ~35% low on a 2-core Xeon with slow memory,
  docs/benchmarks.md, run 10); then --settle-steps decode steps untimed and --decode-steps timed.
  Settling and the order are for the CPU's cache: on the 2-core Xeon (480 MiB of shared L3) a 1-row step
  of the Q4_1 SmolLM2 takes ~9 ms right after a prefill and ~5 ms from about the 8th step on (the fused
  decode and the LM head alike; by steps, not time: a pause does not shorten it), and after a point of
  many rows at long contexts (GBs of K/V) 9 ms for 60 steps and more. Served at light load most decode
  steps are settled ones (run 11's server: 5.2 ms), and its profile, which timed the first four steps of
  each point with contexts outermost, priced 1-4-row steps 20-55% high. Even settled, a profiling process
  can find the shared cache in another state than a server minutes later (8.6 ms against 5.2 on another
  day): `plan calibrate` with a step trace fits the cost again with the served steps (plan/host.py
  refit_cost; docs/benchmarks.md, plan validation run 12);
- mixed: while the R rows decode, one fresh prompt of --mixed-prompt-len tokens joins (a step with decodes
  and a prefill chunk), then the same prompt again (a prefix hit but for its last block: a short chunk at
  a long context beside the decodes, a split fleet's decode worker's first step for each request);
- lone prefills (--prefill-lens x --prefill-repeats): a fresh prompt of each length alone on the idle engine
  (chunks at zero context, sizes interleaved so that drift spreads over them), and once per context length
  a prompt that extends the cached context by each length (chunks at large context). Without them the
  general path's fixed cost (`has_chunk`) and per-chunk-token slope were fitted mostly from 16-token
  last-block chunks of prefix hits and a few full-budget chunks, and a lone 128-token prompt, the commonest
  step at light load, was an extrapolation.
Speculative verification widths are not profiled: a verification row is costed as a chunk of 1 + k
tokens (the same feature as a prefill chunk), which the simulator does not produce anyway.
"""

from __future__ import annotations

import os
import platform
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenloom.config import EngineConfig
from tokenloom.errors import ConfigError
from tokenloom.plan.cost_model import LinearStepCost, Row, relative_errors
from tokenloom.plan.profile_file import MEASURED, Profile
from tokenloom.sampling_params import SamplingParams


@dataclass(frozen=True)
class ProfileGrid:
    decode_rows: tuple[int, ...] = (1, 4, 16, 64, 128)
    context_lens: tuple[int, ...] = (128, 512, 2048)
    decode_steps: int = 4  # timed decode steps per (rows, context) point
    settle_steps: int = 8  # untimed decode steps before them (see the module docstring)
    mixed_prompt_len: int = 256
    warmup_steps: int = 8  # untimed steps first (kernel JIT, allocator, caches)
    prefill_lens: tuple[int, ...] = (16, 64, 128, 256, 512)  # lone prefills, at zero and at each context length
    prefill_repeats: int = 3  # timed lone prefills per length at zero context

    def __post_init__(self) -> None:
        if not self.decode_rows or not self.context_lens or min(self.decode_rows) < 1 or min(self.context_lens) < 1:
            raise ConfigError("--decode-rows and --context-lens need positive values")
        if self.decode_steps < 1 or self.mixed_prompt_len < 1 or self.warmup_steps < 0 or self.settle_steps < 0:
            raise ConfigError("--decode-steps and --mixed-prompt-len must be >= 1, --warmup-steps and "
                              "--settle-steps >= 0")
        if (self.prefill_lens and min(self.prefill_lens) < 1) or self.prefill_repeats < 0:
            raise ConfigError("--prefill-lens need positive values, --prefill-repeats >= 0")


def machine_description(config: EngineConfig) -> dict[str, Any]:
    import torch

    cpu, flags = platform.processor(), []
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    flags = sorted(f for f in have if f.startswith(("avx512", "amx", "avx2", "fma")))
                    break
    except OSError:  # not Linux: the platform string is all there is
        pass
    return {"cpu": cpu, "cpu_flags": flags, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "engine_config": {k: v for k, v in vars(config).items()}}


class _Recorder:
    """Wraps one engine's `scheduler.schedule` to keep the rows of the batch it just made."""

    def __init__(self, scheduler: Any) -> None:
        self.rows: list[Row] = []
        self._schedule = scheduler.schedule

        def schedule() -> Any:
            batch = self._schedule()
            self.rows = [(n, s.num_computed_tokens) for s, n in zip(batch.seqs, batch.num_new_tokens)]
            return batch

        scheduler.schedule = schedule


def run_grid(engine: Any, grid: ProfileGrid, seed: int = 0,
             log: Any = None) -> list[tuple[list[Row], float]]:
    """Drive `engine` (an LLMEngine) over the grid; returns (rows, seconds) of every step it took."""
    rec = _Recorder(engine.scheduler)
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    samples: list[tuple[list[Row], float]] = []
    max_rows = engine.config.max_num_seqs
    budget = engine.max_model_len - grid.settle_steps - grid.decode_steps - 8

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    def step(timed: bool = True) -> None:
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        if timed and rec.rows:
            samples.append((list(rec.rows), dt))

    def add(ids: list[int], max_tokens: int) -> str:
        return engine.add_request(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))

    def prefilling() -> bool:
        return any(s.is_prefill or s.status.value == "waiting" for r in engine.requests.values() for s in r.seqs)

    warm = add(prompt(min(64, budget)), max(1, grid.warmup_steps))
    for _ in range(grid.warmup_steps + 8):
        if not engine.has_unfinished_requests():
            break
        step(timed=False)
    engine.abort_request(warm)

    def lone(ids: list[int]) -> None:
        add(ids, 1)  # one output token: the request ends with its last prefill chunk
        while engine.has_unfinished_requests():
            step()

    for _ in range(grid.prefill_repeats):
        for n in grid.prefill_lens:
            if n <= budget:
                lone(prompt(n))
    engine.reset_prefix_cache()
    if log is not None and grid.prefill_repeats:
        log(f"lone prefills {', '.join(map(str, grid.prefill_lens))}: {len(samples)} steps timed")
    contexts = [ctx for ctx in grid.context_lens if ctx <= budget - grid.mixed_prompt_len]
    for ctx in contexts:  # lone chunks after a cached context of ctx
        ids = prompt(ctx)
        lone(ids)
        for n in grid.prefill_lens:
            if ctx + n <= budget:
                lone(ids + prompt(n))
        engine.reset_prefix_cache()
    # Fewest rows first, every context length for each: a few-row step reads little K/V, so the model's
    # weights stay in a large CPU cache from one point to the next as they do in a lightly loaded server;
    # after a point of many rows x long contexts (GBs of K/V) a 1-row step on the 2-core Xeon took 9 ms for
    # 60 steps and more instead of the 5 ms served (the settling steps alone do not bring it back).
    for rows in sorted(set(grid.decode_rows)):
        if rows > max_rows - 1 and rows > 1:
            rows = max_rows - 1  # leave a slot for the mixed step's prompt
        for ctx in contexts:
            room = (grid.settle_steps + grid.decode_steps + 6
                    + grid.mixed_prompt_len // max(engine.config.max_num_batched_tokens, 1) + 2)
            # Every row its own context, as served requests have: rows sharing one cached prompt would read
            # the same K/V blocks, which then stay in cache, and their steps priced ~35% low at 16-64 rows on
            # a 2-core Xeon whose memory is slow (docs/benchmarks.md, plan validation run 10).
            ids_all = [add(prompt(ctx), room) for _ in range(rows)]
            while prefilling():
                step()
            for _ in range(grid.settle_steps):
                step(timed=False)
            for _ in range(grid.decode_steps):
                step()
            mixed = prompt(grid.mixed_prompt_len)
            ids_all.append(add(mixed, 1))
            step()  # decodes + the new prompt's first chunk
            while ids_all[-1] in engine.requests:
                step()  # its further chunks, if the budget split it
            # The same prompt again: a prefix hit up to its last block, so a short chunk at a long context
            # joins the decodes. It is the first step of every request on a split fleet's decode worker
            # (the imported prompt's last block) and of an agent's next turn, which the profile had only
            # alone: against a served decode worker's steps on the 2-core Xeon those with 0-7 decode rows
            # went from -10% to -1..-3% with it (8-31 rows stayed ~20% short; docs/benchmarks.md, "What a
            # split fleet's TTFT is made of").
            ids_all.append(add(mixed, 1))
            step()
            for rid in ids_all:
                engine.abort_request(rid)
            engine.reset_prefix_cache()
            if log is not None:
                log(f"rows {rows:4d} x context {ctx:5d}: {len(samples)} steps timed")
    if len(samples) < 5:
        raise ConfigError("the profile grid produced fewer than 5 timed steps; widen --decode-rows / --context-lens "
                          "or raise --max-model-len")
    return samples


def time_handoff(engine: Any, layout: Any, ids: list[int]) -> tuple[list[Any], float, float]:
    """A split fleet's KV handoff once, on one engine: `ids` computed (max_tokens 1), its blocks exported
    (disagg/blocks.py export_prefix), the prefix cache emptied and the blocks imported again
    (import_prefix). Returns (records, export seconds, import seconds); the imported blocks stay cached."""
    from tokenloom.disagg.blocks import export_prefix, import_prefix

    engine.add_request(ids, SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    t0 = time.perf_counter()
    records = export_prefix(engine, ids)
    t1 = time.perf_counter()
    engine.reset_prefix_cache()
    t2 = time.perf_counter()
    import_prefix(engine, layout, records)
    t3 = time.perf_counter()
    return records, t1 - t0, t3 - t2


def time_kv_moves(engine: Any, seed: int = 0, reps: int = 5) -> tuple[float, float]:
    """(export, import) seconds per KV block of a split fleet's handoff on this engine (`time_handoff`
    on prompts of 8 and of 32 full blocks, fewer where the context is shorter), the median of `reps`
    each, fitted through the origin. (0, 0) where the engine cannot hand off (no prefix caching, several
    KV groups) or its context holds no full block. On the 2-core Xeon a 128-token prompt of the Q4_1
    SmolLM2 took 1.6 ms to export and 1.4 ms to import (benchmarks/kv_handoff.py)."""
    from tokenloom.disagg.blocks import KVLayout

    bs = engine.kv.block_size
    if not engine.kv.enable_prefix_caching:
        return 0.0, 0.0
    try:
        layout = KVLayout.of(engine)
    except ConfigError:
        return 0.0, 0.0
    rng = random.Random(seed + 1)
    blocks, out, into = [], [], []
    fits = (engine.max_model_len - 1) // bs  # full blocks of the longest prompt that leaves room for a token
    for n in sorted({min(n, fits) for n in (8, 32)} - {0}):
        ex, im = [], []
        for _ in range(reps):
            _, export_s, import_s = time_handoff(engine, layout, [rng.randrange(engine.model_config.vocab_size)
                                                                   for _ in range(n * bs)])
            engine.reset_prefix_cache()
            ex.append(export_s)
            im.append(import_s)
        blocks.append(n)
        out.append(float(np.median(ex)))
        into.append(float(np.median(im)))
    if not blocks:
        return 0.0, 0.0
    b = np.array(blocks, dtype=float)
    return float(b @ np.array(out) / (b @ b)), float(b @ np.array(into) / (b @ b))


def fit_profile(config: EngineConfig, engine: Any, samples: Sequence[tuple[list[Row], float]],
                model_name: str, kv_moves: tuple[float, float] = (0.0, 0.0)) -> Profile:
    cost, keep = LinearStepCost.fit_robust(samples)
    errs = relative_errors(cost, [s for s, k in zip(samples, keep) if k])
    from tokenloom.disagg.blocks import KVLayout

    try:
        kv_per_token = KVLayout.of(engine).block_nbytes / config.block_size
    except ConfigError:  # several KV groups (windowed layers): what one token's K/V takes over all layers
        kv_per_token = engine.capacity.bytes_total / engine.capacity.num_tokens
    fit = {"samples": [[list(map(list, rows)), t] for rows, t in samples], "kept": keep,
           "left_out": len(samples) - sum(keep),
           "rel_errors": relative_errors(cost, samples),  # every sample's, the left-out ones too
           "median_rel_error": float(np.median(errs)), "p90_rel_error": float(np.percentile(errs, 90)),
           "max_rel_error": float(np.max(errs))}
    return Profile(MEASURED, model_name, cost, config.block_size, engine.capacity.num_blocks, float(kv_per_token),
                   config.max_num_seqs, config.max_num_batched_tokens, engine.max_model_len,
                   tuple(engine.kv.windows), machine_description(config), fit,
                   kv_export_s_per_block=kv_moves[0], kv_import_s_per_block=kv_moves[1])


def profile_engine(config: EngineConfig, grid: ProfileGrid, seed: int = 0, log: Any = None) -> Profile:
    """Build the engine of `config`, time it over `grid` and fit its profile."""
    if config.speculative is not None:
        raise ConfigError("plan profile does not time speculative decoding; profile without --speculative")
    from tokenloom.engine.engine import LLMEngine

    engine = LLMEngine(config)
    samples = run_grid(engine, grid, seed, log)
    moves = time_kv_moves(engine, seed)
    if log is not None:
        log(f"KV handoff: export {moves[0] * 1e3:.3f} ms, import {moves[1] * 1e3:.3f} ms per block")
    return fit_profile(config, engine, samples, engine.model_name, moves)
