"""bf16 against weight-only int8 and int4 on the embedded model, in one run: weight memory, single-stream
decode tok/s, 64-stream output throughput and perplexity on the Shakespeare texts.

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
    # int4 at the default group size 128 (64 where a layer's input size is 576), and at 32: the block
    # size of the Q4_1 GGUF the embedded model ships as, which int4 g32 reproduces almost exactly.
    for q, group in ((None, 128), ("int8", 128), ("int4", 128), ("int4", 32)):
        llm = LLM(quantization=q, quant_group_size=group, kv_cache_memory="2GiB", max_model_len=2048)
        eng = llm.engine
        ids = eng.tokenizer.encode(text[: a.ppl_tokens * 12], add_special_tokens=False)[: a.ppl_tokens]
        short = exact_prompts(llm.tokenizer, 1, 16, eng.model_config.vocab_size)[0]
        batch = exact_prompts(llm.tokenizer, a.streams, 128, eng.model_config.vocab_size)
        decode_rate(llm, short, 16)  # warm-up
        dec = statistics.median(decode_rate(llm, short, a.decode_tokens) for _ in range(a.repeats))
        thr = statistics.median(output_throughput(llm, batch, 128) for _ in range(a.repeats))
        ppl, n = perplexity(eng, ids, 1024, 512)
        name = f"int4 g{group}" if q == "int4" else (q or "bf16")
        rows.append((name, weight_bytes(eng.loaded.model) / 1e6, dec, thr, ppl))
        del llm, eng
    base = rows[0]
    print(f"\n| weights | memory (MB) | decode tok/s | vs bf16 | {a.streams} streams out tok/s | vs bf16 | "
          f"perplexity ({n} tokens) | vs bf16 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, mb, dec, thr, ppl in rows:
        print(f"| {name} | {mb:.0f} | {dec:.1f} | {dec / base[2]:.2f}x | {thr:.1f} | {thr / base[3]:.2f}x | "
              f"{ppl:.3f} | {100 * (ppl / base[4] - 1):+.2f}% |")


if __name__ == "__main__":
    main()
