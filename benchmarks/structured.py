"""What a JSON-schema constraint costs: decode throughput with and without it, and grammar compile time.

(a) Chat requests asking for a JSON object (a person's profile), greedy, --max-tokens each, run at each
    stream count in --streams twice: every request constrained by a realistic JSON schema (8 properties:
    strings with maxLength, an integer with minimum/maximum, an enum, a boolean, an array of strings with
    maxItems, a nested object), and unconstrained (same prompts, same parameters, no schema). A
    constrained request ends when its grammar completes, so the two produce different lengths: the
    figure compared is generated tokens per second (sum of generated tokens / wall time of the generate
    call, prefill included), alongside each condition's mean output length, mean TPOT (a request's decode
    time over its tokens after the first, from the engine's per-request metrics: decode steps only),
    and the share of outputs that parse as JSON. The two conditions alternate (the first of the pair
    swaps each round) over --rounds rounds; the median of each is reported with the ratio
    constrained / unconstrained. One short generate of each kind at each stream count runs first, so
    kernel builds and the schema's compile are not timed. The prefix cache is reset before every timed call.
(b) Grammar compile time for the same schema: first compile (a schema differing only in a unique "title",
    which misses the cache and compiles the same grammar) and cached compile, median of --compile-repeats
    each, on a freshly built GrammarBackend; and that backend's construction (xgrammar's TokenizerInfo for the
    vocabulary) once (xgrammar already imported).

    Also at equal lengths ("fixed length" rows): a schema that cannot be complete within max_tokens
    against unconstrained requests with ignore_eos, so both decode exactly max_tokens tokens per request.

    python benchmarks/structured.py [--model PATH] [--streams 1 32] [--max-tokens 128] [--rounds 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from tokenloom import LLM, SamplingParams
from tokenloom.sampling_params import StructuredOutput

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "occupation": {"type": "string", "maxLength": 40},
        "department": {"type": "string", "enum": ["engineering", "sales", "marketing", "support", "research"]},
        "active": {"type": "boolean"},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 48},
                "city": {"type": "string", "maxLength": 32},
                "country": {"type": "string", "maxLength": 32},
            },
            "required": ["street", "city", "country"],
            "additionalProperties": False,
        },
        "bio": {"type": "string", "maxLength": 200},
    },
    "required": ["name", "age", "occupation", "department", "active", "skills", "address", "bio"],
    "additionalProperties": False,
}

# The same comparison at equal output lengths: a schema that cannot be complete within max_tokens (at least
# 64 list items) against unconstrained requests that ignore EOS, so every request of both decodes exactly
# max_tokens tokens in batches of the same size: the per-token cost of the grammar alone.
FIXED_LENGTH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 64}},
    "required": ["notes"],
    "additionalProperties": False,
}

NAMES = ["Alice Martin", "Bruno Silva", "Chen Wei", "Dana Okafor", "Elena Petrova", "Farid Haddad", "Grace Kim",
         "Hugo Laurent"]
JOBS = ["software engineer", "sales manager", "data scientist", "support technician"]
CITIES = ["Lisbon", "Toronto", "Osaka", "Nairobi"]


def prompts(llm: LLM, n: int) -> list[list[int]]:
    """n distinct chat prompts (token ids, chat template applied) asking for a profile as a JSON object."""
    out = []
    for i in range(n):
        name, job, city = NAMES[i % len(NAMES)], JOBS[(i // len(NAMES)) % len(JOBS)], CITIES[i % len(CITIES)]
        msg = (f"Write a JSON object describing an employee: {name}, a {job} living in {city}. Use the keys "
               "name, age, occupation, department (engineering, sales, marketing, support or research), active "
               "(true or false), skills (a list of up to five), address (an object with street, city and "
               "country) and bio (one sentence). Reply with the JSON object only.")
        out.append(llm.tokenizer.encode_chat([{"role": "user", "content": msg}]))
    return out


def cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or platform.machine()


def has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def timed_generate(llm: LLM, ps: list[list[int]], sp: SamplingParams) -> dict[str, Any]:
    """One generate call for all of `ps`: tokens/s, mean output length, mean TPOT, steps, JSON validity."""
    llm.reset_prefix_cache()  # every call computes its prompts
    steps0 = llm.stats()["steps"]
    t = time.perf_counter()
    outs = llm.generate(ps, sp)
    wall = time.perf_counter() - t
    steps = llm.stats()["steps"] - steps0
    errors = [o.error for o in outs if o.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed: {errors[0]}")
    lens = [len(o.outputs[0].token_ids) for o in outs]
    tpots = [o.metrics.decode_time / (n - 1) for o, n in zip(outs, lens) if o.metrics is not None and n > 1]
    valid = 0
    for o in outs:
        try:
            valid += isinstance(json.loads(o.outputs[0].text), dict)
        except ValueError:
            pass
    return {
        "tok_s": sum(lens) / wall,
        "wall_s": wall,
        "tokens": sum(lens),
        "mean_len": sum(lens) / len(lens),
        "tpot_ms": 1e3 * statistics.mean(tpots) if tpots else float("nan"),
        "steps": steps,
        "valid_json": valid / len(outs),
        "finish_length": sum(o.outputs[0].finish_reason == "length" for o in outs) / len(outs),
        "sample": outs[0].outputs[0].text,  # the first request's output, for a look (--json)
    }


def measure_decode(llm: LLM, a: argparse.Namespace, structured: StructuredOutput,
                   fixed: StructuredOutput) -> dict[int, dict[str, Any]]:
    conds = {
        "unconstrained": SamplingParams(temperature=0.0, max_tokens=a.max_tokens),
        "constrained": SamplingParams(temperature=0.0, max_tokens=a.max_tokens, structured=structured),
        "unconstrained_fixed": SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True),
        "constrained_fixed": SamplingParams(temperature=0.0, max_tokens=a.max_tokens, structured=fixed),
    }
    ps = {n: prompts(llm, n) for n in a.streams}
    for n in a.streams:  # warm-up: kernel builds for each batch shape, the grammar backend and the compile
        for sp in conds.values():
            llm.generate(ps[n], SamplingParams(temperature=0.0, max_tokens=8, structured=sp.structured))
    res: dict[int, dict[str, Any]] = {n: {c: [] for c in conds} for n in a.streams}
    for r in range(a.rounds):
        order = list(conds) if r % 2 == 0 else list(reversed(conds))
        for n in a.streams:
            for c in order:
                m = timed_generate(llm, ps[n], conds[c])
                res[n][c].append(m)
                print(f"round {r + 1}/{a.rounds} streams={n:<3} {c:<19} {m['tok_s']:8.1f} tok/s  "
                      f"mean len {m['mean_len']:6.1f}  TPOT {m['tpot_ms']:6.2f} ms  valid JSON {m['valid_json']:.0%}",
                      file=sys.stderr, flush=True)
    return res


def measure_compile(llm: LLM, repeats: int) -> dict[str, Any]:
    eng = llm.engine
    from tokenloom.structured import GrammarBackend  # imported by (a)'s constrained requests already

    t = time.perf_counter()
    backend = GrammarBackend(eng.tokenizer, eng.model_config.vocab_size, sorted(eng.tokenizer.stop_token_ids))
    build_s = time.perf_counter() - t
    try:
        first, cached = [], []
        for _ in range(repeats):
            spec = json.dumps({**SCHEMA, "title": f"bench-{uuid.uuid4().hex}"})
            so = StructuredOutput(kind="json_schema", spec=spec, field="bench")
            t = time.perf_counter()
            backend.compile(so)
            first.append(time.perf_counter() - t)
        so = StructuredOutput(kind="json_schema", spec=json.dumps(SCHEMA), field="bench")
        backend.compile(so)  # the entry the cached compiles hit
        for _ in range(repeats):
            t = time.perf_counter()
            backend.compile(so)
            cached.append(time.perf_counter() - t)
        st = backend.stats
    finally:
        backend.shutdown()
    return {
        "backend_build_ms": 1e3 * build_s,
        "first_compile_ms": [1e3 * x for x in first],
        "cached_compile_ms": [1e3 * x for x in cached],
        "first_compile_ms_median": 1e3 * statistics.median(first),
        "cached_compile_ms_median": 1e3 * statistics.median(cached),
        "backend_stats": {"hits": st.hits, "misses": st.misses, "errors": st.errors,
                          "compile_seconds": st.compile_seconds},
    }


def med(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(m[key] for m in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 32], help="concurrent requests per generate call")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of both conditions; medians reported")
    ap.add_argument("--compile-repeats", type=int, default=5, help="compiles per figure in (b); median reported")
    ap.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the raw numbers here")
    a = ap.parse_args()
    if min(a.streams) < 1 or a.rounds < 1 or a.max_tokens < 2 or a.compile_repeats < 1:
        ap.error("--streams, --rounds, --compile-repeats must be >= 1 and --max-tokens >= 2")

    from tokenloom.engine.engine import freeze_gc

    llm = LLM(a.model, num_threads=a.num_threads, kv_cache_memory=a.kv_cache_memory,
              max_num_seqs=max(128, max(a.streams)), max_num_batched_tokens=max(512, max(a.streams)))
    freeze_gc()  # as `tokenloom serve` and `bench offline` do
    structured = StructuredOutput(kind="json_schema", spec=json.dumps(SCHEMA), field="bench")
    fixed = StructuredOutput(kind="json_schema", spec=json.dumps(FIXED_LENGTH_SCHEMA), field="bench")
    decode = measure_decode(llm, a, structured, fixed)
    comp = measure_compile(llm, a.compile_repeats)

    meta = {
        "model": llm.engine.model_name,
        "cpu": cpu_model(),
        "amx": has_amx(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": str(llm.engine.device),
        "max_tokens": a.max_tokens,
        "rounds": a.rounds,
        "date": time.strftime("%Y-%m-%d"),
    }
    print(f"\nmodel {meta['model']} on {meta['device']}; CPU {meta['cpu']} (AMX: {'yes' if meta['amx'] else 'no'}), "
          f"torch {meta['torch']}, {meta['threads']} threads; greedy, max_tokens {a.max_tokens}, "
          f"median of {a.rounds} rounds\n")
    print("| streams | schema | unconstrained tok/s | constrained tok/s | constrained / unconstrained "
          "| mean output len (unc / con) | mean TPOT ms (unc / con) | valid JSON (unc / con) |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    summary = {}
    for n, (label, suffix) in [(n, x) for n in a.streams for x in (("profile", ""), ("fixed length", "_fixed"))]:
        u, c = decode[n]["unconstrained" + suffix], decode[n]["constrained" + suffix]
        row = {k: (med(u, k), med(c, k)) for k in ("tok_s", "mean_len", "tpot_ms", "valid_json")}
        ratio = row["tok_s"][1] / row["tok_s"][0]
        summary[f"{n}{suffix}"] = {**{f"{k}_{s}": v[i] for k, v in row.items() for i, s in enumerate(("unc", "con"))},
                                   "ratio": ratio}
        print(f"| {n} | {label} | {row['tok_s'][0]:.1f} | {row['tok_s'][1]:.1f} | {ratio:.2f}x "
              f"| {row['mean_len'][0]:.1f} / {row['mean_len'][1]:.1f} | {row['tpot_ms'][0]:.2f} / {row['tpot_ms'][1]:.2f} "
              f"| {row['valid_json'][0]:.0%} / {row['valid_json'][1]:.0%} |")
    print(f"\n| grammar (schema: {len(SCHEMA['properties'])} properties, nested object) | ms |")
    print("|---|---:|")
    print(f"| GrammarBackend construction (TokenizerInfo, vocab {llm.engine.model_config.vocab_size}), once "
          f"| {comp['backend_build_ms']:.1f} |")
    print(f"| first compile (cache miss), median of {a.compile_repeats} | {comp['first_compile_ms_median']:.2f} |")
    print(f"| cached compile, median of {a.compile_repeats} | {comp['cached_compile_ms_median']:.4f} |")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"meta": meta, "schema": SCHEMA, "summary": summary,
                                      "decode": {str(n): v for n, v in decode.items()}, "compile": comp}, indent=2))
        print(f"\nraw numbers: {a.json}")


if __name__ == "__main__":
    main()
