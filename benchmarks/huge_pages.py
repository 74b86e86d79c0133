"""Weights on 2 MiB pages against 4 KiB pages: engine decode speed, the same model loaded twice in one process.

Offline (LLM.generate, no HTTP). For each engine (the embedded Q4_1 model kept quantized, and the same
weights expanded to bf16), one instance with `huge_pages=True` and one with `huge_pages=False` are loaded;
then each repeat runs every (users, engine, pages) case in turn, so that a noisy neighbour slows them
alike: `users` sequences of a --input-len-token prompt each generating --output-len tokens (ignore_eos).
Prints the decode time per token (the time after the first token over the tokens after it, median over
--repeats) and the 4 KiB / 2 MiB ratio for each pair.

    python benchmarks/huge_pages.py [--users 1,4] [--repeats 7] [--output-len 128]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

from tokenloom import LLM, SamplingParams
from tokenloom.engine.huge_pages import huge_pages_usable, thp_mode
from tokenloom.models.default import default_model_path

ENGINES = {"Q4_1": {}, "bf16": {"gguf_weights": "dequantize"}}


def decode_s_per_token(llm: LLM, users: int, input_len: int, output_len: int) -> float:
    """Seconds per decode step: from the first token of every sequence to the last, over the steps between."""
    prompts = [[100 + (7 * u + j) % 30000 for j in range(input_len)] for u in range(users)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"hp-{i}")
    first = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        if first is None and len(outs) == users and all(o.outputs and o.outputs[0].token_ids for o in outs):
            first = time.perf_counter()
    if first is None:
        raise RuntimeError("the requests did not all produce a first token in one step")
    return (time.perf_counter() - first) / (output_len - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--users", default="1,4")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--engines", default=",".join(ENGINES))
    args = ap.parse_args()
    why = huge_pages_usable()
    if why is not None:
        raise SystemExit(f"huge pages are not usable here: {why}")
    users = [int(u) for u in args.users.split(",")]
    names = args.engines.split(",")
    model = str(default_model_path())
    llms = {(n, hp): LLM(model=model, huge_pages=hp, enable_prefix_caching=False, max_model_len=1024,
                         kv_cache_memory="256MiB", **ENGINES[n])
            for n in names for hp in (True, False)}
    for llm in llms.values():  # first calls pay one-off costs (kernel dispatch, allocator growth)
        decode_s_per_token(llm, max(users), args.input_len, 8)
    times: dict[tuple[int, str, bool], list[float]] = {}
    for _ in range(args.repeats):
        for u in users:
            for (n, hp), llm in llms.items():
                times.setdefault((u, n, hp), []).append(decode_s_per_token(llm, u, args.input_len, args.output_len))
    print(f"{platform.processor() or platform.machine()}; THP mode {thp_mode()}; {args.input_len}-token prompts, "
          f"{args.output_len} output tokens; ms per decode step, median of {args.repeats}")
    print(f"{'users':>5} {'engine':>6} {'4 KiB pages':>12} {'2 MiB pages':>12} {'4K / 2M':>8}")
    for u in users:
        for n in names:
            small = statistics.median(times[(u, n, False)]) * 1e3
            huge = statistics.median(times[(u, n, True)]) * 1e3
            print(f"{u:>5} {n:>6} {small:>12.2f} {huge:>12.2f} {small / huge:>7.2f}x")


if __name__ == "__main__":
    main()
