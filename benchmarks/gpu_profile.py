"""Where a decode step's time goes on a GPU: torch.profiler over single-stream and 64-row decode steps.

    python benchmarks/gpu_profile.py --model DIR [--device cuda] [--steps 32]

Prints, per phase: wall time per step, the number of host<->device synchronisations and copies per step
(each one stalls the Python side until the GPU drains), kernel launches per step, GPU busy time per step,
and the top operators by host (CPU) time. A step far longer than its GPU busy time is launch- or
Python-bound, not compute-bound.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from tokenloom import LLM, SamplingParams

SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaMemcpy", "cudaEventSynchronize")


def _phase(llm: LLM, name: str, prompts: list[list[int]], steps: int, device: torch.device) -> None:
    sp = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    llm.reset_prefix_cache()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        llm.generate(prompts, sp)
        wall = time.perf_counter() - t
    events = prof.key_averages()
    per = 1.0 / steps
    syncs = {e.key: e.count for e in events if e.key in SYNC_EVENTS}
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") if device.type == "cuda" else 0
    print(f"\n== {name}: {len(prompts)} rows, {steps} steps (prefill included), {wall / steps * 1e3:.2f} ms per step wall")
    print(f"per step: {launches * per:.0f} kernel launches, GPU busy {gpu_us * per / 1e3:.2f} ms, "
          + ", ".join(f"{k} {v * per:.1f}" for k, v in sorted(syncs.items())))
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--kv-cache-memory", default="4GiB")
    args = p.parse_args(argv)
    llm = LLM(args.model, dtype="bfloat16", device=args.device, kv_cache_memory=args.kv_cache_memory)
    device = llm.engine.device
    ids = llm.tokenizer.encode("The history of computing is a story of people who wanted answers faster. " * 6)[:128]
    _phase(llm, "single-stream decode", [ids], args.steps, device)
    _phase(llm, "batched decode", [[(t + i) % 1000 for t in ids] for i in range(64)], args.steps, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
