"""What Gemma 2's attention logit soft-capping costs in the C++ paged attention kernels: one layer's decode
and prefill attention with softcap 0 (off: the kernels' unchanged fast paths) and 50 (Gemma 2's cap),
alternating, on Gemma 2 2B's heads (8 query / 4 KV heads of 256, bf16 cache, block size 16).

    python benchmarks/softcap_attention.py [--ctx 1024 4096] [--batch 1 16] [--chunk 512] [--repeats 20] [--threads N]

Decode: `--batch` sequences of `--ctx` tokens, one query each. Prefill: one `--chunk`-token chunk at the end of
a `--ctx`-token context. Prints the median ms of each and the capped / uncapped ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from tokenloom.attention.paged_kv import LayerKVCache
from tokenloom.config import KVCacheFormat
from tokenloom.errors import ConfigError
from tokenloom.kernels import load_cpu_kernels

BLOCK, HQ, HKV, D = 16, 8, 4, 256
CAP = 50.0


def median_ms(fns: dict[float, Callable[[], object]], repeats: int) -> dict[float, float]:
    """Median wall time of each function, the functions alternating so that noise hits them alike."""
    times: dict[float, list[float]] = {cap: [] for cap in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for cap, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[cap].append((time.perf_counter() - t) * 1e3)
    return {cap: statistics.median(ts) for cap, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctx", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = load_cpu_kernels()
    if kernels is None:
        raise ConfigError("the CPU kernels could not be built")
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}, heads {HQ}/{HKV} x {D}, bf16, median ms of {args.repeats}")
    print(f"{'case':<32} {'cap 0':>9} {'cap 50':>9} {'ratio':>7}")
    for ctx in args.ctx:
        blocks = (ctx + BLOCK - 1) // BLOCK
        for batch in args.batch:
            kv = LayerKVCache.allocate(batch * blocks, BLOCK, HKV, D, torch.bfloat16, KVCacheFormat.MODEL_DTYPE,
                                       torch.device("cpu"))
            kv.k.normal_()
            kv.v.normal_()
            tables = torch.arange(batch * blocks).view(batch, blocks)
            lens = torch.full((batch,), ctx)
            q = torch.randn(batch, HQ, D).to(torch.bfloat16)
            ms = median_ms({cap: (lambda cap=cap: kernels.paged_decode(q, kv.k, kv.v, None, None, tables, lens,
                                                                      D**-0.5, 0, cap)) for cap in (0.0, CAP)},
                           args.repeats)
            print(f"{f'decode {batch} x {ctx}':<32} {ms[0.0]:>9.3f} {ms[CAP]:>9.3f} {ms[CAP] / ms[0.0]:>7.2f}")
        kv = LayerKVCache.allocate(blocks, BLOCK, HKV, D, torch.bfloat16, KVCacheFormat.MODEL_DTYPE, torch.device("cpu"))
        kv.k.normal_()
        kv.v.normal_()
        n = min(args.chunk, ctx)
        q = torch.randn(n, HQ, D).to(torch.bfloat16)
        out = torch.empty_like(q)
        table = torch.arange(blocks).view(1, -1)
        ms = median_ms({cap: (lambda cap=cap: kernels.paged_prefill(
            q, kv.k, kv.v, None, None, table, torch.tensor([0]), torch.tensor([n]), torch.tensor([ctx]), D**-0.5, 0,
            out, cap)) for cap in (0.0, CAP)}, max(3, args.repeats // 4))
        print(f"{f'prefill {n} over {ctx}':<32} {ms[0.0]:>9.3f} {ms[CAP]:>9.3f} {ms[CAP] / ms[0.0]:>7.2f}")


if __name__ == "__main__":
    main()
