"""Micro-benchmark of the weight-only quantized matmuls on SmolLM2-135M's shapes, M = 1 and 64 rows:
bf16 F.linear (oneDNN / the skinny kernel's baseline), torch's packed int8/int4 CPU kernels, and
tokenloom's kernels (int8 per channel, Q8_0-style int8 per 32, int4 with tokenloom's group size and
with GGUF's 32). Prints median microseconds and the speed-up over bf16.

    python benchmarks/quant_kernels.py [--min-run-time 0.1] [--rows 1,64]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.utils import benchmark

from tokenloom.quant.linear import Int4Linear, Int8Linear
from tokenloom.quant.weight_only import int4_group_size, quantize_int4, quantize_int8

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def torch_int4(w: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's packed int4 layout: w ~= (q - 8) s + z."""
    q, d, m = quantize_int4(w, g)
    sz = torch.stack([d.float(), m.float() + 8 * d.float()], dim=-1).transpose(0, 1).contiguous().bfloat16()
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 2), sz


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--min-run-time", type=float, default=0.1)
    ap.add_argument("--rows", default="1,64")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}; median us (speed-up vs bf16)")
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k) * 0.05).bfloat16()
        g = int4_group_size(k, 128)
        q8, s8 = quantize_int8(w)
        q4 = quantize_int4(w, g)
        q32 = quantize_int4(w, 32)
        qg8 = torch.round(w.float().reshape(n, k // 32, 32) / (w.float().reshape(n, k // 32, 32).abs().amax(-1, keepdim=True) / 127)).clamp(-127, 127).to(torch.int8).reshape(n, k)
        sg8 = (w.float().reshape(n, k // 32, 32).abs().amax(-1) / 127).half()
        t4, sz = torch_int4(w, g)
        layers = {
            "int8": Int8Linear.from_codes(q8, s8), "q8_0": Int8Linear.from_codes(qg8, sg8),
            f"int4g{g}": Int4Linear.from_codes(*q4), "int4g32": Int4Linear.from_codes(*q32),
        }
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k).bfloat16()
            fns = {
                "bf16": lambda: F.linear(x, w),
                "torch_int8": lambda: torch.ops.aten._weight_int8pack_mm(x, q8, s8.view(-1).bfloat16()),
                "torch_int4": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, t4, g, sz),
                **{k_: (lambda lay=lay: lay(x)) for k_, lay in layers.items()},
            }
            times = {}
            for label, fn in fns.items():
                fn()
                t = benchmark.Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=args.min_run_time)
                times[label] = t.median * 1e6
            base = times["bf16"]
            cells = "  ".join(f"{lbl} {us:8.1f} ({base / us:4.2f}x)" for lbl, us in times.items())
            print(f"{name:8s} {n:5d}x{k:<5d} M={m:<3d} {cells}")


if __name__ == "__main__":
    main()
