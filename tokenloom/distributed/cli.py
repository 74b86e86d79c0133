"""`tokenloom ray-serve`: tokenloom workers as Ray actors over a Ray cluster, tokenloom's router in front.

This process is the Ray driver (the actors live as long as it does) and the router: the router's policies,
retries, OpenAI and Ollama endpoints and streaming are those of `tokenloom router`; its workers come from
the supervisor (supervisor.py) instead of --worker flags. Two more endpoints: GET /admin/workers (the
actors, their nodes and states) and POST /admin/workers {"workers": N} (scale by hand, within
--min-workers .. --max-workers; the autoscaler, when on, takes over again at its next decision).

Every node needs tokenloom installed (the actors import it) and the model at the same path.
"""

from __future__ import annotations

import argparse
import json
import logging
import secrets
import shlex
import sys

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from tokenloom.distributed.config import PLACEMENTS, AutoscaleConfig, RayServeConfig
from tokenloom.distributed.supervisor import RayWorkers
from tokenloom.engine_args import add_engine_args
from tokenloom.errors import ConfigError, InvalidRequest
from tokenloom.router.app import build_router_app
from tokenloom.router.cli import add_worker_serving_args, router_args, router_config, worker_argv
from tokenloom.router.discovery import EXTERNAL, CallableDiscovery
from tokenloom.router.replies import error_reply
from tokenloom.router.workers import WorkerPool
from tokenloom.secrets_file import read_secret
from tokenloom.serve.errors import Unauthorized
from tokenloom.serve.server import run_app


def add_ray_serve_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("ray-serve", help="tokenloom workers as Ray actors on a Ray cluster, the router in front")
    d = AutoscaleConfig()
    p.add_argument("--address", default=None,
                   help="the Ray cluster, e.g. 10.0.0.5:6379 (default: RAY_ADDRESS, else a running local one)")
    p.add_argument("--min-workers", type=int, default=1)
    p.add_argument("--max-workers", type=int, default=None, help="default: --min-workers (no autoscaling)")
    p.add_argument("--initial-workers", type=int, default=None, help="default: --min-workers")
    p.add_argument("--num-cpus-per-worker", type=float, default=1.0, help="Ray CPUs each worker holds")
    p.add_argument("--num-gpus-per-worker", type=float, default=0.0, help="Ray GPUs each worker holds")
    p.add_argument("--worker-resources", default="{}", metavar="JSON",
                   help='custom Ray resources each worker holds, e.g. \'{"inference": 1}\'')
    p.add_argument("--prefill-workers", type=int, default=0,
                   help="split prefill/decode: also this many `serve --role prefill` workers (not autoscaled); "
                        "the others then run --role decode. KV transfers are signed with --api-key, else a "
                        "random secret")
    p.add_argument("--placement", default="spread", choices=PLACEMENTS,
                   help="spread: workers on different nodes where possible; pack: Ray's default placement")
    p.add_argument("--worker-host", default=None,
                   help="address the workers bind (default: their node's IP, which the router connects to)")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds a worker gets to come up; one silent longer is replaced")
    p.add_argument("--drain-timeout", type=float, default=600.0,
                   help="seconds a worker being scaled down gets to finish its in-flight requests")
    p.add_argument("--check-interval", type=float, default=0.5, help="seconds between looks at the actors")
    p.add_argument("--worker-logs-to-driver", action="store_true",
                   help="print the workers' logs here too (default: only in Ray's logs on their nodes, "
                        "session_latest/logs/worker-*; this process is also the router, and every request "
                        "logs a line)")
    p.add_argument("--autoscale-interval", type=float, default=d.interval,
                   help="seconds between autoscaling decisions (0: off)")
    p.add_argument("--scale-up-waiting", type=float, default=d.up_waiting,
                   help="add a worker when the mean waiting requests per worker reach this (0: never on this)")
    p.add_argument("--scale-up-kv", type=float, default=d.up_kv,
                   help="add a worker when one worker's KV cache usage reaches this fraction")
    p.add_argument("--scale-up-after", type=int, default=d.up_after, help="checks in a row before adding")
    p.add_argument("--scale-down-running", type=float, default=d.down_running,
                   help="remove a worker when nothing waits and the running sequences fit one fewer worker at "
                        "this many each (0: only when idle)")
    p.add_argument("--scale-down-after", type=int, default=d.down_after, help="checks in a row before removing")
    add_worker_serving_args(p)
    router_args(p, default_port=8000)
    add_engine_args(p)
    p.set_defaults(func=run_ray_serve)


def ray_serve_config(args: argparse.Namespace) -> RayServeConfig:
    try:
        resources = json.loads(args.worker_resources)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--worker-resources: not JSON ({e})") from e
    if not isinstance(resources, dict) or not all(isinstance(v, (int, float)) for v in resources.values()):
        raise ConfigError('--worker-resources: expected a JSON object of numbers, e.g. {"node2": 1}')
    autoscale = AutoscaleConfig(
        min_workers=args.min_workers, max_workers=args.min_workers if args.max_workers is None else args.max_workers,
        up_waiting=args.scale_up_waiting, up_kv=args.scale_up_kv, up_after=args.scale_up_after,
        down_running=args.scale_down_running, down_after=args.scale_down_after, interval=args.autoscale_interval)
    return RayServeConfig(
        serve_argv=tuple(worker_argv(args)), autoscale=autoscale, address=args.address,
        initial_workers=args.initial_workers, num_cpus=args.num_cpus_per_worker, num_gpus=args.num_gpus_per_worker,
        resources={str(k): float(v) for k, v in resources.items()}, placement=args.placement,
        worker_host=args.worker_host, startup_timeout=args.startup_timeout, check_interval=args.check_interval,
        drain_timeout=args.drain_timeout, graceful_timeout=args.graceful_timeout, prefill_workers=args.prefill_workers)


def add_admin_routes(app: FastAPI, workers: RayWorkers, prefill: RayWorkers | None, api_key: str | None) -> None:
    import hmac

    def denied(request: Request) -> Response | None:
        given = request.headers.get("authorization", "")
        if api_key is not None and not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            return error_reply(request.url.path, Unauthorized("missing or wrong API key (Authorization: Bearer ...)"))
        return None

    @app.get("/admin/workers")
    async def list_workers(request: Request) -> Response:
        return denied(request) or JSONResponse(_described(workers, prefill))

    @app.post("/admin/workers")
    async def scale(request: Request) -> Response:
        if (no := denied(request)) is not None:
            return no
        try:
            body = json.loads(await request.body() or b"null")
            n = body.get("workers") if isinstance(body, dict) else None
            if not isinstance(n, int) or isinstance(n, bool):
                raise InvalidRequest('expected a JSON body {"workers": N} with an integer N')
            workers.set_target(n)
        except (InvalidRequest, json.JSONDecodeError) as e:
            err = e if isinstance(e, InvalidRequest) else InvalidRequest(f"body is not JSON: {e}")
            return error_reply(request.url.path, err)
        return JSONResponse(_described(workers, prefill))


def _described(workers: RayWorkers, prefill: RayWorkers | None) -> dict[str, object]:
    return workers.describe() | ({"prefill": prefill.describe()} if prefill is not None else {})


# The Ray Serve application's (serve_app.py) argv may not hold these: Serve owns the HTTP port and Ray.
SERVE_OWNED_FLAGS = ("--host", "--port", "--address")


def parse_serve_app_argv(argv: list[str]) -> argparse.Namespace:
    """`tokenloom ray-serve` flags, as the Serve application takes them (ConfigError where they are wrong)."""
    for a in argv:
        if a.split("=", 1)[0] in SERVE_OWNED_FLAGS:
            raise ConfigError(f"argv: {a.split('=', 1)[0]} is Ray Serve's to set (http_options, the cluster), "
                              "not the application's")
    parser = argparse.ArgumentParser(prog="tokenloom")  # the ray-serve subcommand alone, as tokenloom.cli adds it
    add_ray_serve_parser(parser.add_subparsers(dest="command", required=True))
    try:
        return parser.parse_args(["ray-serve", *argv])
    except SystemExit as e:  # argparse has printed what is wrong
        raise ConfigError(f"argv: not `tokenloom ray-serve` flags: {shlex.join(argv)}") from e


def build_ray_router(args: argparse.Namespace) -> tuple[RayServeConfig, FastAPI, list[RayWorkers]]:
    """The router app over the supervised worker actors: the (decode) workers, then the prefill workers
    where --prefill-workers asks for them (not started: each .start() once Ray is up). Shared by the
    `ray-serve` driver below and the Ray Serve application (serve_app.py)."""
    args.api_key = read_secret(args.api_key, args.api_key_file, "api-key")
    api_key, args.api_key = args.api_key, None  # worker_argv would put it on the workers' command lines
    config = ray_serve_config(args)
    args.api_key = api_key
    args.worker_discovery, args.discovery_interval = EXTERNAL, min(args.check_interval, 1.0)
    router = router_config(args, [], [])
    logging.getLogger("tokenloom.router").setLevel(logging.INFO)
    logging.getLogger("tokenloom.distributed").setLevel(logging.INFO)
    pools: dict[str, WorkerPool] = {}

    class _Routing:  # one of the router's pools, once the app made it
        def __init__(self, name: str) -> None:
            self.name = name

        def routes_to(self, url: str) -> bool:
            return pools[self.name].routes_to(url)

        def outstanding_of(self, url: str) -> int:
            return pools[self.name].outstanding_of(url)

    if config.prefill_workers:
        # Every KV transfer is signed: with the API key (the workers' default), else a fresh secret.
        kv_secret = None if api_key is not None else secrets.token_hex(32)
        workers = RayWorkers(config, _Routing("pool"), api_key, role="decode", kv_secret=kv_secret)
        prefill: RayWorkers | None = RayWorkers(config.prefill_group(), _Routing("prefill_pool"), api_key,
                                                role="prefill", kv_secret=kv_secret)
    else:
        workers, prefill = RayWorkers(config, _Routing("pool"), api_key), None
    app = build_router_app(router, discovery=CallableDiscovery(workers.urls),
                           prefill_discovery=CallableDiscovery(prefill.urls) if prefill is not None else None)
    pools.update(pool=app.state.pool, prefill_pool=app.state.prefill_pool)
    add_admin_routes(app, workers, prefill, args.api_key)
    return config, app, [workers] + ([prefill] if prefill is not None else [])


def run_ray_serve(args: argparse.Namespace) -> int:
    try:
        import ray
    except ImportError as e:
        raise ConfigError(f"ray-serve needs Ray: pip install 'tokenloom[ray]' ({e})") from e
    config, app, groups = build_ray_router(args)
    ray.init(address=config.address, logging_level=logging.WARNING, log_to_driver=args.worker_logs_to_driver)
    try:
        start_groups(groups)
        split = f" (prefill: {', '.join(groups[1].urls())})" if len(groups) > 1 else ""
        print(f"tokenloom ray-serve: router on http://{args.host}:{args.port} -> {', '.join(groups[0].urls())}"
              f"{split}", file=sys.stderr, flush=True)
        run_app(app, args.host, args.port, args.graceful_timeout, args.verbose)
    finally:
        for g in groups:
            g.close()
        ray.shutdown()
    return 0


def start_groups(groups: list[RayWorkers]) -> None:
    """Start every group's workers and wait until each has its first ones ready (all of them together)."""
    for g in groups:
        g.start()
    for g in groups:
        g.wait_ready(g.config.first_workers, g.config.startup_timeout)
