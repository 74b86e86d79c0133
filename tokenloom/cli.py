"""The `tokenloom` command: generate (stream one answer), bench offline (engine vs transformers)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import get_args

from tokenloom.bench.offline import add_offline_args, run_offline_bench
from tokenloom.bench.perplexity import add_perplexity_args, run_perplexity
from tokenloom.bench.serve import add_serve_args, run_bench_serve
from tokenloom.config import EngineConfig, GgufWeights, Role
from tokenloom.distributed.cli import add_ray_serve_parser
from tokenloom.engine.async_engine import AsyncLLMEngine
from tokenloom.engine.engine import LLMEngine, freeze_gc
from tokenloom.engine.step_trace import StepTrace
from tokenloom.engine.warmup import warm_up
from tokenloom.engine_args import add_engine_args, engine_config
from tokenloom.errors import ConfigError, TokenloomError
from tokenloom.llm import LLM
from tokenloom.plan.cli import add_plan_parser
from tokenloom.quant.write_checkpoint import quantize_checkpoint
from tokenloom.router.cli import add_cluster_parser, add_router_parser
from tokenloom.sampling_params import SamplingParams
from tokenloom.secrets_file import read_secret
from tokenloom.serve.app import build_app
from tokenloom.serve.reasoning import REASONING_PARSERS
from tokenloom.serve.tool_parsers import TOOL_PARSERS
from tokenloom.serve.metrics import ServingMetrics
from tokenloom.serve.server import run_app
from tokenloom.serve.warmup import warm_up_app

__all__ = ["add_engine_args", "build_parser", "engine_config", "main"]


def _generate(args: argparse.Namespace) -> int:
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed_request,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop or ()),
    )
    llm = LLM(**engine_config(args).__dict__)
    print(llm.engine.capacity.describe(), file=sys.stderr)
    if args.raw:
        stream = llm.stream(args.prompt, params)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        stream = llm.stream_chat(messages, params)
    for delta in stream:
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _serve(args: argparse.Namespace) -> int:
    args.api_key = read_secret(args.api_key, args.api_key_file, "api-key")
    args.kv_secret = read_secret(args.kv_secret, args.kv_secret_file, "kv-secret")
    config = engine_config(args)
    if args.role != "both" and not config.enable_prefix_caching:
        raise ConfigError(f"--role {args.role} hands KV blocks over through the prefix cache: drop --no-prefix-caching")
    if args.role != "both" and config.speculative == "draft":
        raise ConfigError(f"--role {args.role} does not transfer a draft model's KV: use --speculative ngram or self")
    trace = StepTrace(Path(args.step_trace)) if args.step_trace else None
    engine = AsyncLLMEngine.from_config(config, max_waiting=args.max_waiting, max_n=args.max_n, step_trace=trace)
    core = engine.engine
    if args.role != "both":
        from tokenloom.disagg.blocks import KVLayout

        try:
            KVLayout.of(core)  # a KV cache the transfer format cannot carry is refused now, not at the first prompt
        except ConfigError:
            engine.shutdown()
            raise
    freeze_gc()
    # The engine thread and the event loop share the GIL. A busy event loop (dozens of streams' SSE chunks)
    # holds it for up to the switch interval each time the engine thread comes back from a kernel and wants
    # it. Shorter is faster for many streams; not yet the default, having been measured on one machine only
    # (docs/performance-notes.md#the-gil-between-the-engine-and-the-event-loop).
    if args.gil_switch_interval is not None:
        sys.setswitchinterval(args.gil_switch_interval)
    name = args.served_model_name or core.model_name
    metrics = ServingMetrics(name)
    engine.on_step = metrics.on_step
    print(core.capacity.describe(), file=sys.stderr)
    for routing in (core.quant_routing, core.dense_routing):
        if routing is not None:
            print(routing.describe(), file=sys.stderr)
    if core.huge_pages is not None:
        print(f"weights on huge pages: {core.huge_pages.describe()}", file=sys.stderr)
    if args.warmup:  # before the server listens: /health is unreachable until the first request would be fast
        print(engine.call_soon(warm_up).result().describe(), file=sys.stderr)
    logging.getLogger("tokenloom.access").setLevel(logging.INFO)  # one JSON line per request, on stderr
    receiver = None
    # The HMAC key of KV transfers (prefill: signs, decode: checks); none: a decode worker binds loopback only.
    kv_secret = args.kv_secret or args.api_key or None
    if args.role == "decode":
        from tokenloom.disagg.transfer import KVReceiver  # ZeroMQ: loaded by decode workers only

        try:
            receiver = KVReceiver(engine, args.kv_host or args.host, args.kv_port, secret=kv_secret).start()
        except BaseException:
            engine.shutdown()
            raise
        print(f"KV receiver on {receiver.address}", file=sys.stderr)
    app = build_app(engine, name, args.api_key, metrics, args.role, receiver.address if receiver else None,
                    args.max_request_bytes, args.tool_call_parser, args.reasoning_parser)
    app.state.kv_secret = kv_secret  # serve/kv_api.py signs its sends with it
    app.state.api_key = args.api_key  # without one, only a --role prefill worker serves /internal/kv/prefill
    if args.warmup and args.role == "both":  # the serving path's one-off costs too (serve/warmup.py)
        try:
            print(f"warm-up: one request through the app, {warm_up_app(app, args.api_key):.2f} s", file=sys.stderr)
        except BaseException:
            engine.shutdown()
            raise
    try:
        run_app(app, args.host, args.port, args.graceful_timeout, args.verbose)
    finally:
        if receiver is not None:
            receiver.close()
        engine.shutdown()
    return 0


def _bench_offline(args: argparse.Namespace) -> int:
    return run_offline_bench(args)


def _bench_serve(args: argparse.Namespace) -> int:
    return run_bench_serve(args)


def _eval_perplexity(args: argparse.Namespace) -> int:
    return run_perplexity(args, LLMEngine(engine_config(args)))


def _quantize(args: argparse.Namespace) -> int:
    n = quantize_checkpoint(args.model, args.out, args.quantization, args.quant_group_size, args.gguf_weights)
    print(f"wrote {args.out}: {n} quantized linear layers ({args.quantization})")
    return 0


def _bench_compare(args: argparse.Namespace) -> int:
    from tokenloom.bench.report import compare  # matplotlib: loaded only for the plots

    missing = [str(r) for r in args.runs if not (r / "summary.json").is_file()]
    if missing:
        print(f"tokenloom: error: not a results folder (no summary.json): {', '.join(missing)}", file=sys.stderr)
        return 2
    print(compare(list(args.runs), args.out))
    print(f"table and plot in {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenloom", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details to stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream an answer to one prompt (through the chat template)")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="complete the text as is, without the chat template")
    gen.add_argument("--system", default=None, help="system message")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--request-seed", dest="seed_request", type=int, default=None, help="seed of this request")
    add_engine_args(gen)
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    srv.add_argument("--api-key-file", default=None, metavar="PATH",
                     help="--api-key read from this file (keeps it off the command line)")
    srv.add_argument("--served-model-name", default=None, help="the model id clients use (default: from the path)")
    srv.add_argument("--max-waiting", type=int, default=256,
                     help="sequences allowed to queue (a request counts its n); more get 429")
    srv.add_argument("--max-n", type=int, default=128, help="the largest n (completions per request) accepted; "
                                                          "more get 400")
    srv.add_argument("--no-warmup", dest="warmup", action="store_false",
                     help="skip the warm-up passes run before the server listens (a prefill of a full step, decode at "
                          "batch sizes 1-8 and powers of two); the first requests then pay the one-off costs")
    srv.add_argument("--step-trace", default=None, metavar="PATH",
                     help="write one CSV line per engine step (its rows, and when it was scheduled, computed, "
                          "settled and streamed) to PATH: the serving overhead `tokenloom plan host` measures")
    srv.add_argument("--gil-switch-interval", type=_positive_seconds, default=None, metavar="SECONDS",
                     help="Python's thread switch interval in the server (default: Python's own, 0.005): how long the "
                          "engine thread can wait for the GIL while the event loop streams tokens; 0.0005 served 64 "
                          "streams 1.12x faster one day and 0.91x another (docs/performance-notes.md)")
    srv.add_argument("--graceful-timeout", type=float, default=30.0,
                     help="seconds in-flight requests get to finish after SIGTERM before they are aborted")
    srv.add_argument("--max-request-bytes", type=int, default=8 << 20,
                     help="larger request bodies get 413 (default 8 MiB; 0: no limit)")
    srv.add_argument("--role", default="both", choices=get_args(Role),
                     help="disaggregated serving: prefill workers compute prompts and ship their KV blocks to "
                          "decode workers (the router pairs them); both: a whole server")
    srv.add_argument("--kv-host", default=None, help="decode role: address the KV receiver binds (default --host)")
    srv.add_argument("--kv-port", type=int, default=0, help="decode role: KV receiver port (0: a free one, "
                                                            "reported by /health as kv_address)")
    srv.add_argument("--kv-secret", default=None,
                     help="prefill/decode roles: shared secret that signs (HMAC-SHA256) every KV transfer, the same "
                          "on prefill and decode workers (default: --api-key); a decode worker without either "
                          "binds its KV receiver to loopback only")
    srv.add_argument("--kv-secret-file", default=None, metavar="PATH",
                     help="--kv-secret read from this file (keeps it off the command line)")
    srv.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                     help="how the model writes tool calls (default: detected from its chat template)")
    srv.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                     help="put the model's <think>...</think> into reasoning_content (OpenAI) / thinking (Ollama)")
    add_engine_args(srv)
    srv.set_defaults(func=_serve)

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    off = bsub.add_parser("offline", help="engine vs transformers: decode, batch throughput, prefill")
    add_offline_args(off)
    off.set_defaults(func=_bench_offline)
    sv = bsub.add_parser("serve", help="load-test a running server (tokenloom, vLLM, llama.cpp, Ollama, ...)")
    add_serve_args(sv)
    sv.set_defaults(func=_bench_serve)
    cmp_ = bsub.add_parser("compare", help="several `bench serve` results folders side by side")
    cmp_.add_argument("runs", nargs="+", type=Path, help="results folders")
    cmp_.add_argument("--out", type=Path, default=Path("results/compare"))
    cmp_.set_defaults(func=_bench_compare)

    add_plan_parser(sub)

    qz = sub.add_parser("quantize", help="write a weight-only quantized checkpoint (HF folder) that loads back fast")
    qz.add_argument("--model", default=None, help="HF model folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    qz.add_argument("--out", type=Path, required=True, help="output folder")
    qz.add_argument("--quantization", required=True, help="int8 (per output channel) or int4 (group-wise)")
    qz.add_argument("--quant-group-size", type=int, default=EngineConfig().quant_group_size, help="int4 group size")
    qz.add_argument("--gguf-weights", default=EngineConfig().gguf_weights, choices=get_args(GgufWeights),
                    help="a GGUF's Q8_0/Q4_0/Q4_1 layers: kept as they are, or dequantized and re-quantized")
    qz.set_defaults(func=_quantize)

    ev = sub.add_parser("eval", help="quality checks")
    esub = ev.add_subparsers(dest="eval_command", required=True)
    ppl = esub.add_parser("perplexity", help="sliding-window perplexity over real text")
    add_perplexity_args(ppl)
    add_engine_args(ppl)
    ppl.set_defaults(func=_eval_perplexity)

    add_router_parser(sub)
    add_cluster_parser(sub)
    add_ray_serve_parser(sub)
    return parser


def _positive_seconds(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {s!r}") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"expected seconds in (0, 1], got {s!r}")
    return v


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except TokenloomError as e:
        print(f"tokenloom: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
