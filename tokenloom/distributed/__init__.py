"""tokenloom on a Ray cluster (`tokenloom ray-serve`): `tokenloom serve` workers as Ray actors placed by
resources, restarted by Ray, scaled on their measured load, behind tokenloom's own router.

config.py     the settings (one frozen dataclass)
actor.py      the Ray actor: one `tokenloom serve` process on a free port of its node
supervisor.py the set of actors: publishes the ready ones to the router, replaces dead ones, drains on scale-down
autoscale.py  how many workers the measured load asks for (pure: no Ray, no I/O)
local.py      a Ray cluster of several nodes on this machine (tests, benchmarks)
cli.py        the `tokenloom ray-serve` command
serve_app.py  the same router and supervisor as a Ray Serve application (`serve run`, KubeRay's RayService)
"""
