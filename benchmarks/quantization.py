"""bf16 against weight-only int8 and int4, and against an INT8 KV cache, on the embedded model, in one
run: weight memory, KV capacity of a 2 GiB budget, single-stream decode tok/s, 64-stream output
throughput and perplexity on the Shakespeare texts.

    python benchmarks/quantization.py [--repeats 3] [--streams 64] [--ppl-tokens 4096]
"""

from __future__ import annotations

import argparse
import statistics

from tokenloom import LLM
from tokenloom.bench.offline import decode_rate, exact_prompts, output_throughput
from tokenloom.bench.perplexity import default_text, perplexity
from tokenloom.quant.weight_only import weight_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    a = ap.parse_args()
    text = default_text()
    rows = []
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
        ("bf16 + int8 KV", {**dense, "kv_cache_dtype": "int8"}),
        ("GGUF Q4_1 kept (default)", {"gguf_weights": "keep"}),
    ]
    for name, kw in runs:
        llm = LLM(kv_cache_memory="2GiB", max_model_len=2048, **kw)  # type: ignore[arg-type]
        eng = llm.engine
        ids = eng.tokenizer.encode(text[: a.ppl_tokens * 12], add_special_tokens=False)[: a.ppl_tokens]
        short = exact_prompts(llm.tokenizer, 1, 16, eng.model_config.vocab_size)[0]
        batch = exact_prompts(llm.tokenizer, a.streams, 128, eng.model_config.vocab_size)
        decode_rate(llm, short, 16)  # warm-up
        dec = statistics.median(decode_rate(llm, short, a.decode_tokens) for _ in range(a.repeats))
        thr = statistics.median(output_throughput(llm, batch, 128) for _ in range(a.repeats))
        ppl, n = perplexity(eng, ids, 1024, 512)
        rows.append((name, weight_bytes(eng.loaded.model) / 1e6, eng.capacity.max_concurrency, dec, thr, ppl))
        del llm, eng
    base = rows[0]
    print(f"\n| model | weights (MB) | sequences of 2048 in 2 GiB KV | decode tok/s | vs bf16 | "
          f"{a.streams} streams out tok/s | vs bf16 | perplexity ({n} tokens) | vs bf16 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, mb, conc, dec, thr, ppl in rows:
        print(f"| {name} | {mb:.0f} | {conc:.1f} ({conc / base[2]:.2f}x) | {dec:.1f} | {dec / base[3]:.2f}x | "
              f"{thr:.1f} | {thr / base[4]:.2f}x | {ppl:.3f} | {100 * (ppl / base[5] - 1):+.2f}% |")


if __name__ == "__main__":
    main()
