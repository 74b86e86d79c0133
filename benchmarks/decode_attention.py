"""The paged decode attention kernel alone: one decode step's attention over every layer's cache, as a
64-user step of SmolLM2 sees it (30 layers, 9 query heads over 3 KV heads of 64, bfloat16 or INT8 cache,
16-token blocks), with the blocks of each sequence scattered over the cache (a server after churn) or in
order (fresh sequences); `--long-len` gives the first `--long-seqs` sequences a long context among the
short ones (an agent's session beside chats: how evenly the two threads share the step). Prints the
step's milliseconds and the K/V bytes it read per second.

Every layer has its own cache, so the step reads memory as the engine's does (30 x 9 MB at 64 sequences of
~190 tokens: out of cache), not one layer again and again. Compare two builds by running this at two
checkouts, alternating (`--rounds` repeats in one process; the machine's noise between processes is as
large as the effects measured: docs/performance-notes.md#paged-decode-attention).

    python benchmarks/decode_attention.py [--users 64] [--layout scattered|ordered] [--cache bf16|int8]
                                          [--long-len 4000 --long-seqs 1]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from tokenloom.kernels import load_cpu_kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--users", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=150, help="context tokens per sequence, drawn in [min, max]")
    ap.add_argument("--max-len", type=int, default=230)
    ap.add_argument("--long-len", type=int, default=0, help="context tokens of the first --long-seqs sequences")
    ap.add_argument("--long-seqs", type=int, default=1)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--layout", choices=["scattered", "ordered"], default="scattered")
    ap.add_argument("--cache", choices=["bf16", "int8"], default="bf16")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    if min(args.users, args.layers, args.rounds) < 1:
        ap.error("--users, --layers and --rounds must be at least 1")
    if not 0 < args.min_len <= args.max_len:
        ap.error("--min-len must be positive and at most --max-len")
    if args.long_len < 0 or not 0 <= args.long_seqs <= args.users:
        ap.error("--long-len must be >= 0 and --long-seqs between 0 and --users")
    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("the CPU kernels could not be built (a C++ compiler and torch's headers are needed)")

    torch.manual_seed(0)
    hq, hkv, d, bs = 9, 3, 64, 16
    lens = torch.randint(args.min_len, args.max_len + 1, (args.users,), dtype=torch.long)
    if args.long_len:
        lens[: args.long_seqs] = args.long_len
    # Each sequence's blocks: the next ones of `order` (a permutation of the cache's blocks, or in order).
    per_seq = [-(-int(n) // bs) for n in lens]
    num_blocks = sum(per_seq)
    order = (torch.randperm(num_blocks) if args.layout == "scattered" else torch.arange(num_blocks)).tolist()
    tables = torch.zeros(args.users, max(per_seq), dtype=torch.long)
    start = 0
    for i, nb in enumerate(per_seq):
        tables[i, :nb] = torch.tensor(order[start : start + nb])
        start += nb
    shape = (num_blocks, bs, hkv, d)
    if args.cache == "bf16":
        caches = [(torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16(), None, None)
                  for _ in range(args.layers)]
    else:
        caches = [(torch.randint(-127, 128, shape, dtype=torch.int8), torch.randint(-127, 128, shape, dtype=torch.int8),
                   torch.rand(shape[:3]).half() * 0.01, torch.rand(shape[:3]).half() * 0.01)
                  for _ in range(args.layers)]
    q = torch.randn(args.users, hq, d).bfloat16()

    def step() -> float:
        t = time.perf_counter()
        for k, v, ks, vs in caches:
            kernels.paged_decode(q, k, v, ks, vs, tables, lens, d**-0.5, 0, 0.0)
        return (time.perf_counter() - t) * 1e3

    step()
    ms = statistics.median(step() for _ in range(args.rounds))
    row_bytes = d * (2 if args.cache == "bf16" else 1) + (0 if args.cache == "bf16" else 2)
    read = int(lens.sum()) * hkv * 2 * row_bytes * args.layers  # K and V rows (and their scales)
    long = f" ({args.long_seqs} of {args.long_len})" if args.long_len else ""
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; {args.users} sequences of "
          f"{args.min_len}-{args.max_len} tokens{long}, {args.layers} layers, {args.cache} cache, {args.layout} blocks")
    print(f"decode attention step: {ms:.2f} ms (median of {args.rounds}), K/V {read / 1e6:.0f} MB, "
          f"{read / ms / 1e6:.1f} GB/s")


if __name__ == "__main__":
    main()
