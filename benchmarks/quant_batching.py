"""Quantized weights under load: engine output tokens/s at 1..64 concurrent sequences, bf16 against the
default model's Q4_1 (kept quantized) and --quantization int8, each quantized format twice: with the
start-up routing (int8-activation VNNI kernels up to the measured crossover, quant/routing.py) and with
`--quant-tile-max-rows 8` (the weight expanded to bf16 for oneDNN from 9 rows, tokenloom before the tiles);
"Q4_1 vnni" / "Q4_1 amx-int8" / "Q4_1 amx-bf16": the start-up routing with the tiles' dot forced (AMX CPUs).

Offline (LLM.generate, no HTTP): every sequence has a --input-len-token prompt and generates --output-len
tokens (ignore_eos). All engines are loaded first; then each repeat measures every (users, engine) pair
in turn, so a noisy neighbour slows all of them alike; the median over --repeats is printed with the
ratio to bf16 at the same load.

    python benchmarks/quant_batching.py [--users 1,4,16,32,64] [--repeats 3] [--output-len 64]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from dataclasses import replace

from tokenloom import LLM, SamplingParams
from tokenloom.models.default import default_model_path

ENGINES = {
    "bf16": dict(gguf_weights="dequantize"),
    "Q4_1": dict(),
    # the start-up routing with the tiles' dot forced ("Q4_1 <dot>", a dot of quant/routing.py DOTS), for an AMX CPU
    "Q4_1 vnni": dict(),
    "Q4_1 amx-int8": dict(),
    "Q4_1 amx-bf16": dict(),
    "Q4_1 expand": dict(quant_tile_max_rows=8),
    "int8": dict(gguf_weights="dequantize", quantization="int8"),
    "int8 expand": dict(gguf_weights="dequantize", quantization="int8", quant_tile_max_rows=8),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--users", default="1,4,16,32,64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--engines", default=",".join(ENGINES))
    args = ap.parse_args()
    users = [int(u) for u in args.users.split(",")]
    names = args.engines.split(",")
    path = str(default_model_path())
    llms = {}
    for name in names:
        # The routing is process-wide (the kernel module's): each engine's own value is set again before it runs.
        llms[name] = LLM(path, kv_cache_memory="1GiB", max_model_len=1024, max_num_seqs=max(users), **ENGINES[name])
    base = [t % 1000 + 100 for t in range(args.input_len)]
    results: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.repeats):
        for u in users:
            prompts = [[(t + 7 * i) % 30000 + 100 for t in base] for i in range(u)]
            sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
            for name in names:
                _route(name)
                start = time.perf_counter()
                llms[name].generate(prompts, sp)
                results.setdefault((name, u), []).append(u * args.output_len / (time.perf_counter() - start))
    print(f"{platform.processor() or platform.machine()}; {args.input_len}-token prompts, {args.output_len} output "
          f"tokens each; output tok/s, median of {args.repeats} (ratio to bf16)")
    print("users " + "".join(f"{n:>22s}" for n in names))
    for u in users:
        base_tps = statistics.median(results[("bf16", u)]) if "bf16" in names else None
        cells = []
        for name in names:
            tps = statistics.median(results[(name, u)])
            cells.append(f"{tps:10.1f}" + (f" ({tps / base_tps:4.2f}x)" if base_tps else "") + " " * 4)
        print(f"{u:5d} " + "".join(f"{c:>22s}" for c in cells))


def _tile_max(name: str) -> int | None:
    return ENGINES[name].get("quant_tile_max_rows")


def _route(name: str) -> None:
    """Set the process-wide crossover this engine was built with (engines built later overwrote it)."""
    from tokenloom.config import EngineConfig
    from tokenloom.kernels import load_cpu_kernels
    from tokenloom.quant.routing import DOTS, apply, measured

    kernels = load_cpu_kernels()
    if kernels is None or name == "bf16":
        return
    rows = _tile_max(name)
    budget = EngineConfig.__dataclass_fields__["max_num_batched_tokens"].default  # the engines' (default) budget
    chosen = measured(kernels, budget)
    forced = name.removeprefix("Q4_1 ")  # "Q4_1 <dot>": the tiles' dot forced
    apply(kernels, replace(chosen, tile_max_rows=rows if rows is not None else chosen.tile_max_rows,
                           tile_dot=forced if forced in DOTS else chosen.tile_dot))


if __name__ == "__main__":
    main()
