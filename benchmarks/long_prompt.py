"""TTFT of long prompts: chunked prefill attention through the paged prefill kernel against the old SDPA
path (each chunk gathers its whole prefix from the cache), in one run on the same engine.

Loads the embedded default model once, then for each prompt length times one request generating one
token (prefix cache reset before each run, so every run computes its whole prompt), --repeats times per
path, alternating, and prints the median TTFT and prefill tok/s of each path and their ratio.

    python benchmarks/long_prompt.py [--lengths 1000 4000] [--repeats 3] [--max-num-batched-tokens 512]

--attention-only times one layer's attention call instead (SmolLM2-135M's 9 query / 3 KV heads of 64,
bf16 cache, block size 16) for the last chunk of each prompt length: the kernel against SDPA's gather.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenloom import LLM, SamplingParams
from tokenloom.attention.base import AttentionMetadata
from tokenloom.attention.cpu import CPUBackend
from tokenloom.attention.paged_kv import LayerKVCache
from tokenloom.config import KVCacheFormat
from tokenloom.bench.offline import exact_prompts
from tokenloom.errors import ConfigError


def ttft_s(llm: LLM, prompt: list[int]) -> float:
    llm.reset_prefix_cache()  # every run computes its whole prompt
    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    return time.perf_counter() - t


def attention_only(lengths: list[int], chunk: int, repeats: int) -> None:
    from tokenloom.kernels import load_cpu_kernels

    kernels = load_cpu_kernels()
    if kernels is None:
        raise ConfigError("the CPU kernels could not be built")
    bs, hq, hkv, d = 16, 9, 3, 64
    print(f"one layer's attention for the last {chunk}-token chunk, median of {repeats} (alternating)")
    for ctx in lengths:
        n = min(chunk, ctx)
        blocks = (ctx + bs - 1) // bs
        kv = LayerKVCache.allocate(blocks + 1, bs, hkv, d, torch.bfloat16, KVCacheFormat.MODEL_DTYPE, torch.device("cpu"))
        kv.k.normal_()
        kv.v.normal_()
        table = torch.randperm(blocks)[None] + 1  # scattered blocks, as a running pool hands them out
        pos = torch.arange(ctx - n, ctx)
        meta = AttentionMetadata([0, n], [ctx], table, table[0, pos // bs] * bs + pos % bs, bs)
        q = torch.randn(n, hq, d).bfloat16()
        k, v = torch.randn(n, hkv, d).bfloat16(), torch.randn(n, hkv, d).bfloat16()
        runs: dict[bool, list[float]] = {False: [], True: []}
        for i in range(repeats + 1):
            for paged in (False, True):
                meta.plans.clear()
                t = time.perf_counter()
                CPUBackend(kernels, paged_prefill=paged).forward(q, k, v, kv, meta, d**-0.5, None)
                if i:
                    runs[paged].append(time.perf_counter() - t)
        sdpa, kern = (statistics.median(runs[p]) * 1e3 for p in (False, True))
        print(f"context {ctx:>5}: SDPA gather {sdpa:7.1f} ms, paged kernel {kern:7.1f} ms, {sdpa / kern:.2f}x")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1000, 4000])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="the prefill chunk size")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--attention-only", action="store_true", help="time one layer's attention call, no model")
    a = p.parse_args()
    if a.attention_only:
        attention_only(a.lengths, a.max_num_batched_tokens, a.repeats)
        return 0
    llm = LLM(max_model_len=max(a.lengths) + 16, max_num_batched_tokens=a.max_num_batched_tokens, dtype=a.dtype)
    backend = llm.engine.backend
    if not isinstance(backend, CPUBackend):
        raise ConfigError(f"the paged prefill kernel is the CPU backend's; this engine runs {backend.name!r}")
    vocab = llm.engine.model_config.vocab_size
    ttft_s(llm, exact_prompts(llm.tokenizer, 1, 64, vocab)[0])  # warm-up
    print(f"chunk size {a.max_num_batched_tokens}, median of {a.repeats} runs per point")
    print(f"{'prompt':>7} {'SDPA gather TTFT':>17} {'paged kernel TTFT':>18} {'SDPA tok/s':>11} {'kernel tok/s':>13} {'speed-up':>9}")
    for n in a.lengths:
        prompt = exact_prompts(llm.tokenizer, 1, n, vocab)[0]
        runs: dict[bool, list[float]] = {False: [], True: []}
        # The two paths alternate run by run, so a shared machine's load drifts over both alike.
        for i in range(a.repeats + 1):
            for paged in (False, True):
                backend.paged_prefill = paged
                t = ttft_s(llm, prompt)
                if i:  # the first round warms both paths at this length
                    runs[paged].append(t)
        med = {paged: statistics.median(ts) for paged, ts in runs.items()}
        print(f"{n:>7} {med[False]:>16.2f}s {med[True]:>17.2f}s {n / med[False]:>11.0f} {n / med[True]:>13.0f} "
              f"{med[False] / med[True]:>8.2f}x")
    backend.paged_prefill = True
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
