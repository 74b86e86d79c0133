"""A split fleet's KV handoff copies, offline: the engine-thread time to export a computed prompt's blocks
(disagg/blocks.py export_prefix, on the prefill worker) and to import them (import_prefix, on the decode
worker), per prompt length. Both hold their engine between steps, so every other request on that worker
waits for them.

    python benchmarks/kv_handoff.py [--model PATH] [--prompt-lens 128,512,2048] [--reps 9] [engine flags]

Each prompt is computed (max_tokens 1), its blocks exported, the prefix cache emptied and the blocks
imported into the same engine; the table gives the median of --reps prompts per length. The import is
checked: the blocks read back equal what was exported.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics

from tokenloom.disagg.blocks import KVLayout, export_prefix
from tokenloom.engine.engine import LLMEngine
from tokenloom.engine_args import add_engine_args, engine_config
from tokenloom.plan.profile import time_handoff


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(ap)
    ap.add_argument("--prompt-lens", default="128,512,2048", help="comma-separated prompt lengths (tokens)")
    ap.add_argument("--reps", type=int, default=9, help="prompts per length (the median is reported)")
    a = ap.parse_args()
    engine = LLMEngine(engine_config(a))
    layout = KVLayout.of(engine)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    cpu = platform.processor() or platform.machine()
    print(f"{engine.model_name}, KV {layout.cache_dtype}, {layout.block_nbytes} bytes per block; {cpu}")
    print("| prompt tokens | blocks | export ms | import ms |")
    print("|---:|---:|---:|---:|")
    for n in (int(x) for x in a.prompt_lens.split(",")):
        if n + 1 > engine.max_model_len:
            print(f"| {n} | - | (past --max-model-len {engine.max_model_len}) | |")
            continue
        out, into, blocks = [], [], 0
        for _ in range(a.reps):
            ids = [rng.randrange(vocab) for _ in range(n)]
            records, export_s, import_s = time_handoff(engine, layout, ids)
            if [r.payload for r in export_prefix(engine, ids)] != [r.payload for r in records]:
                raise SystemExit(f"{n}-token prompt: the imported blocks differ from the exported ones")
            engine.reset_prefix_cache()
            out.append(export_s)
            into.append(import_s)
            blocks = len(records)
        print(f"| {n} | {blocks} | {statistics.median(out) * 1e3:.2f} | {statistics.median(into) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
