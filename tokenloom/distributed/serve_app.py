"""`tokenloom ray-serve` as a Ray Serve application: what a KubeRay RayService deploys
(deploy/kubernetes/ray/rayservice.yaml), or `serve run` / `serve deploy` on any Ray cluster:

    serve run tokenloom.distributed.serve_app:build argv="--model /models/m.gguf --min-workers 1 --max-workers 4"

One Serve replica, the application's ingress, is the `ray-serve` driver's router and worker supervisor
(cli.build_ray_router: the same policies, admin endpoints, autoscaling, draining); Serve's proxies forward
HTTP to it, streams included. The worker actors are the replica's children: they die with it, and Serve
replaces a replica whose health check fails (its supervisor stopped), which starts its workers anew.

`argv` holds `tokenloom ray-serve` flags. Serve owns the HTTP port and the Ray connection, so --host,
--port and --address are refused rather than ignored. Needs Ray Serve (`pip install "ray[serve]"`);
tokenloom's own `ray-serve` command does not.
"""

from __future__ import annotations

import shlex
from typing import Any

from ray import serve
from ray.serve import Application

from tokenloom.distributed.cli import build_ray_router, parse_serve_app_argv, start_groups
from tokenloom.errors import ConfigError

# Requests Serve lets through to the one replica at once: every stream the router holds open counts, and
# the workers' queues (not Serve's) are where waiting belongs (they are what the autoscaler measures).
MAX_ONGOING_REQUESTS = 10_000


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=MAX_ONGOING_REQUESTS)
@serve.ingress()
class TokenloomRouter:
    def __init__(self, argv: list[str]) -> None:
        args = parse_serve_app_argv(argv)
        self.config, self.router_app, self.groups = build_ray_router(args)
        try:
            start_groups(self.groups)
        except TimeoutError:
            for g in self.groups:
                g.close()
            raise

    def __serve_build_asgi_app__(self) -> Any:
        return self.router_app

    def check_health(self) -> None:
        if not all(g.supervising() for g in self.groups):
            raise RuntimeError("a tokenloom worker supervisor is not running")

    def __del__(self) -> None:  # Serve's replica shutdown: the workers drain and stop with it
        for g in getattr(self, "groups", []):
            g.close()


def build(args: dict[str, str]) -> Application:
    """The application builder (`import_path: tokenloom.distributed.serve_app:build`); args: {"argv": "..."}."""
    unknown = set(args) - {"argv"}
    if unknown:
        raise ConfigError(f"tokenloom's Serve application takes one argument, argv (got {sorted(unknown)})")
    argv = shlex.split(args.get("argv", ""))
    parse_serve_app_argv(argv)  # a bad flag fails the deployment here, before any replica starts
    return TokenloomRouter.bind(argv)
