"""Micro-benchmark of the weight-only quantized matmuls on SmolLM2-135M's shapes, M = 1 and 64 rows:
bf16 F.linear (oneDNN / the skinny kernel's baseline), torch's packed int8/int4 CPU kernels, and
tokenloom's kernels (int8 per channel, Q8_0-style int8 per 32, int4 with tokenloom's group size and
with GGUF's 32). Prints median microseconds and the speed-up over bf16. The weights of one layer stay
in cache between calls, so this measures the kernels' arithmetic.

`--decode-step` measures what a single-stream decode step pays instead: 30 layers' worth of SmolLM2's
four linears, each its own weights (too many for the caches), called once each with one row, as the
decode stack does; bf16 through the skinny kernel the engine uses. Prints ms per step and the weight
bytes read per second.

    python benchmarks/quant_kernels.py [--min-run-time 0.1] [--rows 1,64] [--decode-step]
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


def decode_step(repeats: int = 5, steps: int = 20) -> None:
    import statistics
    import time

    from tokenloom.kernels import load_cpu_kernels

    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("--decode-step needs the C++ kernels")
    torch.manual_seed(0)
    shapes = [SHAPES[name] for name in ("qkv", "o", "gate_up", "down")]
    xs = {k: torch.randn(1, k).bfloat16() for _, k in shapes}
    formats = {
        "bf16": lambda w: (lambda x, w=w.bfloat16(): kernels.skinny_linear(x, w, None), w.numel() * 2),
        "int8": lambda w: _sized(Int8Linear.from_codes(*quantize_int8(w))),
        "int4 g128": lambda w: _sized(Int4Linear.from_codes(*quantize_int4(w, int4_group_size(w.shape[1], 128)))),
        "int4 g32": lambda w: _sized(Int4Linear.from_codes(*quantize_int4(w, 32))),
    }
    for label, make in formats.items():
        layers = [make(torch.randn(n, k) * 0.05) for _ in range(30) for n, k in shapes]
        nbytes = sum(b for _, b in layers)
        calls = [(fn, xs[k]) for (fn, _), (_, k) in zip(layers, shapes * 30)]

        def step() -> None:
            for fn, x in calls:
                fn(x)

        for _ in range(3):
            step()
        runs = []
        for _ in range(repeats):
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                step()
                times.append(time.perf_counter() - t)
            runs.append(statistics.median(times))
        med = statistics.median(runs)
        print(f"{label:10s} {med * 1e3:6.3f} ms per step ({', '.join(f'{r * 1e3:.2f}' for r in runs)}), "
              f"{nbytes / 1e6:5.1f} MB -> {nbytes / med / 1e9:5.1f} GB/s")


def _sized(layer: Int8Linear | Int4Linear) -> tuple[object, int]:
    """The layer's kernel as the decode stack calls it (no nn.Module), and the bytes it reads."""
    kernels = layer.kernel_module()
    if kernels is None:
        raise SystemExit("--decode-step needs the quantized kernels (AVX512-BF16 and VNNI)")
    nbytes = sum(t.numel() * t.element_size() for t in (layer.codes, layer.scales, layer.mins) if t is not None)
    return (lambda x: kernels.quant_linear(x, layer.codes, layer.scales, layer.mins, layer.bits, None)), nbytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--min-run-time", type=float, default=0.1)
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--decode-step", action="store_true", help="time a decode step's worth of layers, out of cache")
    args = ap.parse_args()
    if args.decode_step:
        decode_step()
        return
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
