"""`tokenloom router` (a gateway in front of running workers) and `tokenloom cluster` (N local workers and a
router, one command)."""

from __future__ import annotations

import argparse
import logging
import secrets
import sys
from pathlib import Path

from tokenloom.engine_args import add_engine_args, engine_argv
from tokenloom.errors import ConfigError
from tokenloom.netutil import free_ports
from tokenloom.router.app import build_router_app
from tokenloom.router.cluster import LocalWorkers
from tokenloom.router.config import POLICIES, RouterConfig
from tokenloom.secrets_file import SecretFiles, read_secret
from tokenloom.serve.reasoning import REASONING_PARSERS
from tokenloom.serve.server import run_app
from tokenloom.serve.tool_parsers import TOOL_PARSERS


def router_args(p: argparse.ArgumentParser, default_port: int) -> None:
    d = RouterConfig(workers=("http://placeholder",))  # only for the defaults
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=default_port, help="the router's port")
    p.add_argument("--policy", default=d.policy, choices=POLICIES,
                   help="cache_aware: a prompt prefix goes back to the worker that served it, load permitting")
    p.add_argument("--cache-aware-margin", type=int, default=d.cache_aware_margin,
                   help="cache_aware: outstanding requests the prefix's worker may have above the least loaded one")
    p.add_argument("--health-interval", type=float, default=d.health_interval, help="seconds between /health checks")
    p.add_argument("--health-timeout", type=float, default=d.health_timeout, help="seconds a /health check may take")
    p.add_argument("--unhealthy-after", type=int, default=d.unhealthy_after,
                   help="/health timeouts in a row that take a worker out (refusals and non-200 answers: at once)")
    p.add_argument("--max-retries", type=int, default=d.max_retries,
                   help="other workers a request is sent to when one fails before its response started")
    p.add_argument("--read-timeout", type=float, default=d.read_timeout,
                   help="longest silence of a worker mid-response (a stream then ends with an error event)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (forwarded to the workers)")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="--api-key read from this file (keeps it off the command line)")
    p.add_argument("--graceful-timeout", type=float, default=30.0,
                   help="seconds in-flight responses get to finish after SIGTERM")
    p.add_argument("--kv-transfer-timeout", type=float, default=d.kv_transfer_timeout,
                   help="split prefill/decode: seconds a prefill worker's KV send to a decode worker may take")


def router_config(args: argparse.Namespace, workers: list[str], prefill_workers: list[str]) -> RouterConfig:
    discovery = {"worker_discovery": args.worker_discovery, "discovery_interval": args.discovery_interval} \
        if getattr(args, "worker_discovery", None) is not None else {}
    return RouterConfig(workers=tuple(workers), prefill_workers=tuple(prefill_workers), policy=args.policy, **discovery,
                        health_interval=args.health_interval, health_timeout=args.health_timeout,
                        unhealthy_after=args.unhealthy_after, max_retries=args.max_retries, api_key=args.api_key,
                        cache_aware_margin=args.cache_aware_margin, read_timeout=args.read_timeout,
                        kv_transfer_timeout=args.kv_transfer_timeout)


def add_router_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("router", help="a gateway (load balancer) in front of running `tokenloom serve` workers")
    p.add_argument("--worker", action="append", default=[], metavar="URL",
                   help="a worker's base URL, e.g. http://10.0.0.5:8000 (repeat for each worker); with "
                        "--prefill-worker, these are the decode workers (`serve --role decode`)")
    p.add_argument("--prefill-worker", action="append", default=[], metavar="URL",
                   help="a `serve --role prefill` worker: it computes the prompts of OpenAI completion and chat "
                        "requests and ships their KV blocks to the decode worker chosen for them (repeatable)")
    p.add_argument("--worker-discovery", default=None, metavar="dns:NAME:PORT",
                   help="instead of --worker: every address NAME resolves to is a worker on PORT (a Kubernetes "
                        "headless Service), looked up again every --discovery-interval seconds")
    p.add_argument("--discovery-interval", type=float, default=5.0, help="seconds between --worker-discovery lookups")
    router_args(p, default_port=8000)
    p.set_defaults(func=_run_router)


def add_cluster_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("cluster", help="N local `tokenloom serve` workers and a router in front of them")
    p.add_argument("--workers", type=int, default=2,
                   help="how many workers to start (decode workers when --prefill-workers > 0)")
    p.add_argument("--prefill-workers", type=int, default=0,
                   help="also start this many `--role prefill` workers; the --workers ones then run --role decode")
    p.add_argument("--worker-ports", type=int, nargs="+", default=None, metavar="PORT",
                   help="the workers' ports (one per worker, decode workers first; default: free ports)")
    p.add_argument("--worker-host", default="127.0.0.1",
                   help="address the workers listen on (0.0.0.0 lets a Prometheus elsewhere scrape them)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds the workers get to come up")
    add_worker_serving_args(p)
    p.add_argument("--kv-secret", default=None,
                   help="with --prefill-workers: the secret signing KV transfers between the workers (default: "
                        "--api-key, else a random one)")
    p.add_argument("--kv-secret-file", default=None, metavar="PATH", help="--kv-secret read from this file")
    p.add_argument("--step-trace-dir", default=None, metavar="DIR",
                   help="each worker writes its `serve --step-trace` to DIR/worker-I.csv (decode workers first, "
                        "then prefill workers; I counts from 0 over all of them; a restarted worker starts its file "
                        "again); DIR must exist")
    router_args(p, default_port=8000)
    add_engine_args(p)
    p.set_defaults(func=_run_cluster)


def add_worker_serving_args(p: argparse.ArgumentParser) -> None:
    """The `tokenloom serve` flags (besides the engine's) that `cluster` and `ray-serve` pass to every worker."""
    p.add_argument("--served-model-name", default=None, help="passed to every worker")
    p.add_argument("--max-waiting", type=int, default=256, help="passed to every worker")
    p.add_argument("--max-n", type=int, default=128, help="passed to every worker")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS), help="passed to every worker")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="passed to every worker")


def _run_router(args: argparse.Namespace) -> int:
    args.api_key = read_secret(args.api_key, args.api_key_file, "api-key")
    config = router_config(args, args.worker, args.prefill_worker)
    logging.getLogger("tokenloom.router").setLevel(logging.INFO)  # workers going out and coming back
    run_app(build_router_app(config), args.host, args.port, args.graceful_timeout, args.verbose)
    return 0


def worker_argv(args: argparse.Namespace, secrets_dir: SecretFiles | None = None) -> list[str]:
    """The `tokenloom serve` flags every cluster worker gets: the engine flags given to `cluster` (those
    that differ from their defaults) and the serving flags workers share with the router. The API key goes
    through a private file of `secrets_dir` (when given), not the workers' command lines."""
    argv = engine_argv(args)
    argv += ["--max-waiting", str(args.max_waiting), "--max-n", str(args.max_n),
             "--graceful-timeout", str(args.graceful_timeout)]
    if args.served_model_name is not None:
        argv += ["--served-model-name", args.served_model_name]
    if args.api_key is not None:
        argv += (["--api-key-file", secrets_dir.write("api-key", args.api_key)] if secrets_dir is not None
                 else ["--api-key", args.api_key])
    if args.tool_call_parser is not None:
        argv += ["--tool-call-parser", args.tool_call_parser]
    if args.reasoning_parser is not None:
        argv += ["--reasoning-parser", args.reasoning_parser]
    return argv


def _run_cluster(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise ConfigError(f"--workers must be >= 1 (got {args.workers})")
    if args.prefill_workers < 0:
        raise ConfigError(f"--prefill-workers must be >= 0 (got {args.prefill_workers})")
    total = args.workers + args.prefill_workers
    # Free ports chosen here, not by each worker: none may be the router's own (not yet bound, so the OS
    # can hand it out again; a prefill worker once got it, and the router then failed to start).
    ports = args.worker_ports or free_ports(total, {args.port})
    if len(ports) != total:
        raise ConfigError(f"--worker-ports: {len(ports)} ports given for {total} workers")
    if args.port in ports:
        raise ConfigError(f"--port {args.port} is also in --worker-ports")
    args.api_key = read_secret(args.api_key, args.api_key_file, "api-key")
    args.kv_secret = read_secret(args.kv_secret, args.kv_secret_file, "kv-secret")
    secret_files = SecretFiles()  # the workers read their secrets from here, not from their command lines
    roles: list[list[str]] = [[]] * args.workers
    if args.prefill_workers:
        # Every KV transfer is signed: the given secret, else the API key (the workers get it), else a fresh one.
        kv = [] if args.kv_secret is None and args.api_key is not None else \
            ["--kv-secret-file", secret_files.write("kv-secret", args.kv_secret or secrets.token_hex(32))]
        roles = [["--role", "decode", "--kv-host", args.worker_host, *kv]] * args.workers + \
                [["--role", "prefill", *kv]] * args.prefill_workers
    if args.step_trace_dir is not None:
        trace_dir = Path(args.step_trace_dir)
        if not trace_dir.is_dir():
            raise ConfigError(f"--step-trace-dir {trace_dir}: not a directory")
        roles = [[*r, "--step-trace", str(trace_dir / f"worker-{i}.csv")] for i, r in enumerate(roles)]
    workers = LocalWorkers(ports, args.worker_host, worker_argv(args, secret_files), roles)
    urls = workers.urls
    # Bad router flags fail before any worker starts.
    try:
        config = router_config(args, urls[:args.workers], urls[args.workers:])
    except BaseException:
        secret_files.close()
        raise
    logging.getLogger("tokenloom.router").setLevel(logging.INFO)
    try:
        workers.start(args.startup_timeout)
        # Dead workers are restarted (with back-off) on their ports; the router's health checks take them
        # out meanwhile. stop() below ends the supervision first, so a clean shutdown restarts nothing.
        workers.supervise()
        split = f" (prefill: {', '.join(urls[args.workers:])})" if args.prefill_workers else ""
        print(f"tokenloom cluster: router on http://{args.host}:{args.port} -> {', '.join(urls[:args.workers])}{split}",
              file=sys.stderr, flush=True)
        run_app(build_router_app(config), args.host, args.port, args.graceful_timeout, args.verbose)
    finally:
        workers.stop(args.graceful_timeout + 5.0)
        secret_files.close()
    return 0
