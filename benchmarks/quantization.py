"""bf16 against weight-only int8 and int4, an INT8 KV cache and the GGUF's own Q4_1 tensors, on the
embedded model, in one run: weight memory, KV capacity of a 2 GiB budget, single-stream decode tok/s,
64-stream output throughput and perplexity on the Shakespeare texts, twice: with each 1,024-token window
as one prefill, and (over the first 2,048 tokens) token by token as decode runs (the few-row kernels;
int8 weights quantize activations to int8 there); and bf16 with the decode step run layer by layer
from Python (--no-fused-decode), to show what the fused C++ decode step is worth.

    python benchmarks/quantization.py [--repeats 3] [--streams 64] [--ppl-tokens 4096]
"""

from __future__ import annotations

import argparse
import statistics

from tokenloom import LLM
from tokenloom.bench.offline import decode_rate, exact_prompts, output_throughput
from tokenloom.bench.perplexity import default_text, perplexity
from tokenloom.engine.engine import freeze_gc
from tokenloom.engine.kv_cache import KVCacheSpec, plan_capacity
from tokenloom.quant.weight_only import weight_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--decode-ppl-tokens", type=int, default=2048,
                    help="tokens scored with one forward pass per token (overlapping windows: each runs twice)")
    a = ap.parse_args()
    text = default_text()
    # The embedded model ships as a Q4_1 GGUF: every row but the last expands it to bf16 first
    # (--gguf-weights dequantize), the baseline and the input of --quantization; the last row runs its
    # Q4_1 tensors as they are (the default). int4 at the default group size 128 (64 where a layer's
    # input size is 576), and at 32: the GGUF's block size, which int4 g32 reproduces almost exactly.
    dense = {"gguf_weights": "dequantize"}
    runs: list[tuple[str, dict[str, object]]] = [
        ("bf16", dense),
        ("int8", {**dense, "quantization": "int8"}),
        ("int4 g128", {**dense, "quantization": "int4", "quant_group_size": 128}),
        ("int4 g32", {**dense, "quantization": "int4", "quant_group_size": 32}),
        ("bf16 + int8 KV (per-head scales)", {**dense, "kv_cache_dtype": "int8"}),
        ("bf16 + int8 KV (per-token scales)", {**dense, "kv_cache_dtype": "int8", "kv_cache_scales": "token"}),
        ("GGUF Q4_1 kept (default)", {"gguf_weights": "keep"}),
        # The same bf16 model with each decode step layer by layer from Python (engine/fused_decode.py off).
        ("bf16, --no-fused-decode", {**dense, "fused_decode": False}),
    ]
    # All engines stay loaded and take turns, repeat by repeat: this VM's speed drifts over minutes,
    # and turns put every configuration in the same minutes as its baseline.
    llms = {name: LLM(kv_cache_memory="512MiB", max_model_len=2048, **kw) for name, kw in runs}  # type: ignore[arg-type]
    freeze_gc()  # as `tokenloom serve` does
    first = next(iter(llms.values()))
    vocab = first.engine.model_config.vocab_size
    short = exact_prompts(first.tokenizer, 1, 16, vocab)[0]
    batch = exact_prompts(first.tokenizer, a.streams, 128, vocab)
    ids = first.tokenizer.encode(text[: a.ppl_tokens * 12], add_special_tokens=False)[: a.ppl_tokens]
    dec: dict[str, list[float]] = {name: [] for name in llms}
    thr: dict[str, list[float]] = {name: [] for name in llms}
    for llm in llms.values():
        decode_rate(llm, short, 16)  # warm-up
    # Decode first, all repeats, then throughput: a 64-stream run leaves this VM faster at single-stream
    # bf16 decode for a while (by ~15%, less for the quantized formats), which would tilt the ratios.
    for _ in range(a.repeats):
        for name, llm in llms.items():
            dec[name].append(decode_rate(llm, short, a.decode_tokens))
    for _ in range(a.repeats):
        for name, llm in llms.items():
            thr[name].append(output_throughput(llm, batch, 128))
    rows = []
    for name, llm in llms.items():
        eng = llm.engine
        # Sequences of 2,048 tokens a 2 GiB KV budget holds, from the engine's own sizing rule.
        spec = KVCacheSpec.for_model(eng.model_config, eng.config.block_size, eng.loaded.dtype, eng.config.kv_format)
        conc = plan_capacity(spec, "2GiB", eng.device, 2048).max_concurrency
        ppl, n = perplexity(eng, ids, 1024, 512)
        ppl_decode, n_decode = perplexity(eng, ids[: a.decode_ppl_tokens], 1024, 512, chunk=1)
        rows.append((name, weight_bytes(eng.loaded.model) / 1e6, conc, statistics.median(dec[name]),
                     statistics.median(thr[name]), ppl, ppl_decode))
    base = rows[0]
    print(f"\n| model | weights (MB) | sequences of 2048 in 2 GiB KV | decode tok/s | vs bf16 | "
          f"{a.streams} streams out tok/s | vs bf16 | perplexity ({n} tokens) | vs bf16 | "
          f"perplexity token by token ({n_decode} tokens) | vs bf16 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, mb, conc, d, t, ppl, ppl_d in rows:
        print(f"| {name} | {mb:.0f} | {conc:.1f} ({conc / base[2]:.2f}x) | {d:.1f} | {d / base[3]:.2f}x | "
              f"{t:.1f} | {t / base[4]:.2f}x | {ppl:.3f} | {100 * (ppl / base[5] - 1):+.2f}% | "
              f"{ppl_d:.3f} | {100 * (ppl_d / base[6] - 1):+.2f}% |")
    print("\nper repeat, decode tok/s: " + "; ".join(f"{k} {', '.join(f'{x:.1f}' for x in v)}" for k, v in dec.items()))


if __name__ == "__main__":
    main()
