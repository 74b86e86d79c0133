"""The MoE block's batched expert path against the alternatives, on a Mixtral-8x7B-shaped layer in bfloat16
(hidden 4096, 8 experts of width 14336, top-2: 2.8 GB of expert weights, far more than the caches).

- batched: tokenloom's SparseMoE.forward (tokens grouped by expert, one matmul pair per active expert), with
  the C++ kernels (skinny_linear for a few rows, silu_and_mul) when they build, and without them (torch ops);
- transformers: transformers' own MixtralSparseMoeBlock over the same weight tensors (a one-hot mask loop over
  the hit experts);
- dense: every expert over every token, outputs weighted by the (mostly zero) routing weights: what a MoE
  costs when it is run like a dense model;
- reference: SparseMoE.reference (per token, float32), the test oracle; 1 token only, it is very slow.

Prints the median milliseconds of `--repeats` calls (after one warm-up) for each token count.

    python benchmarks/moe.py [--tokens 1,16,256] [--repeats 5] [--threads N]
                             [--hidden 4096 --inter 14336 --experts 8 --top-k 2]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenloom.kernels import load_cpu_kernels
from tokenloom.models.config import ModelConfig
from tokenloom.models.moe import SparseMoE, route


def build(hidden: int, inter: int, experts: int, k: int) -> SparseMoE:
    cfg = ModelConfig(architecture="MixtralForCausalLM", vocab_size=32000, hidden_size=hidden,
                      intermediate_size=inter, num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=hidden // 32, max_position_embeddings=4096, num_experts=experts,
                      num_experts_per_tok=k, moe_intermediate_size=inter, router="topk_softmax")
    with torch.device("meta"):
        block = SparseMoE(cfg)
    block = block.to_empty(device="cpu").to(torch.bfloat16).requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        block.gate.weight.normal_(0, 0.02, generator=g)
        for e in range(experts):  # one expert at a time: no float32 copy of the whole stack
            block.experts_gate_up[e].copy_(torch.randn(2 * inter, hidden, generator=g) * 0.02)
            block.experts_down[e].copy_(torch.randn(hidden, inter, generator=g) * 0.02)
    return block


def dense(block: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Every expert over every token; the routing weights zero the unchosen ones' contributions."""
    weights, experts = route(block.gate(x), block.top_k, block.router, block.norm_topk_prob)
    full = torch.zeros(x.shape[0], block.num_experts, dtype=torch.float32).scatter_(1, experts, weights)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(block.num_experts):
        gate, up = F.linear(x, block.experts_gate_up[e]).split(block.intermediate_size, dim=-1)
        out += full[:, e : e + 1] * F.linear(F.silu(gate) * up, block.experts_down[e]).float()
    return out.to(x.dtype)


def transformers_block(block: SparseMoE) -> torch.nn.Module | None:
    try:
        import transformers
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    except ImportError:
        return None
    h, i = block.experts_gate_up.shape[2], block.intermediate_size
    cfg = transformers.MixtralConfig(hidden_size=h, intermediate_size=i, num_local_experts=block.num_experts,
                                     num_experts_per_tok=block.top_k)
    with torch.device("meta"):
        hf = MixtralSparseMoeBlock(cfg)
    # the same tensors, not copies
    hf.gate.weight = torch.nn.Parameter(block.gate.weight, requires_grad=False)
    hf.experts.gate_up_proj = torch.nn.Parameter(block.experts_gate_up, requires_grad=False)
    hf.experts.down_proj = torch.nn.Parameter(block.experts_down, requires_grad=False)
    return hf.eval()


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,16,256")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=14336)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    block = build(args.hidden, args.inter, args.experts, args.top_k)
    kernels = load_cpu_kernels()
    hf = transformers_block(block)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor() or platform.machine()) if platform.system() == "Linux" else platform.processor()
    print(f"CPU: {cpu}, {torch.get_num_threads()} threads; torch {torch.__version__}")
    print(f"layer: hidden {args.hidden}, {args.experts} experts of width {args.inter}, top-{args.top_k}, bfloat16; "
          f"C++ kernels: {'yes' if kernels is not None else 'no'}; median ms of {args.repeats}")
    with torch.inference_mode():
        for t in (int(s) for s in args.tokens.split(",")):
            x = torch.randn(t, args.hidden).bfloat16()
            chosen = route(block.gate(x), block.top_k, block.router, block.norm_topk_prob)[1]
            active = len(set(chosen.flatten().tolist()))
            row: dict[str, float] = {}
            block.kernels = kernels
            if kernels is not None:
                row["batched (C++ kernels)"] = median_ms(lambda: block(x), args.repeats)
            block.kernels = None
            row["batched (torch ops)"] = median_ms(lambda: block(x), args.repeats)
            if hf is not None:
                row["transformers"] = median_ms(lambda: hf(x.unsqueeze(0)), args.repeats)
            row["dense (all experts)"] = median_ms(lambda: dense(block, x), args.repeats)
            if t == 1:
                row["reference (float32, per token)"] = median_ms(lambda: block.reference(x), min(args.repeats, 3))
            print(f"\n{t} tokens, {active} of {args.experts} experts active:")
            for name, ms in row.items():
                print(f"  {name:32s} {ms:10.1f} ms")


if __name__ == "__main__":
    main()
