"""A profile: what the simulator needs of one worker. Its step cost (measured and fitted, or analytic),
its KV cache (block size, blocks, bytes per token, each KV group's window) and the engine limits it was
taken with, the model and the machine. Saved as JSON; `source` says whether it was measured."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tokenloom.errors import ConfigError
from tokenloom.plan.cost_model import LinearStepCost, StepCost

MEASURED = "measured"
# The serving-time terms `plan calibrate` fits (seconds, but the *_ratio terms: fractions of a step's price),
# beside the engine step's cost.
OVERHEADS = ("overhead_step_s", "overhead_row_s", "request_s", "response_s", "router_hop_s", "router_step_s",
             "router_token_s", "peer_chunk_ratio", "handoff_s", "interference_step_s", "split_prefill_ratio",
             "split_prefill_peer_ratio", "split_decode_ratio", "split_decode_peer_ratio",
             "split_decode_chunk_ratio")
# Terms older versions fitted and this one no longer simulates: a profile may carry them at 0 (every profile
# written then did, calibrated or not); a calibrated value is refused, since it would price nothing now.
RETIRED = {"split_decode_row_s": "split_decode_ratio and split_decode_peer_ratio (2026-12-07)"}
# Engine time per KV block that a split fleet's handoff holds each engine for (seconds; measured by `plan
# profile`, 0 in older and analytic profiles): the prefill worker's export of a finished prompt's blocks
# (disagg/blocks.py export_prefix, run on its engine thread before its next step) and the decode
# worker's import of the received blocks (import_prefix, likewise between its steps).
KV_MOVES = ("kv_export_s_per_block", "kv_import_s_per_block")
# Step-time spread (`plan calibrate`, from served step traces: plan/host.py fit_spread): per kind of fleet
# ("single": one worker; "fleet": colocated workers sharing the host; "split": a split fleet's prefill and
# decode workers) and of step ("chunk": computes prompt tokens; "decode"), quantiles at probabilities
# (i + 0.5) / n of a served step's engine time over its price, divided by that ratio's mean (so the mean
# stays the other terms'). The simulator draws each step's factor from them (plan/simulator.py
# spread_factor); absent, every step costs its price.
SPREAD_KEYS = ("single-chunk", "single-decode", "fleet-chunk", "fleet-decode", "split-chunk", "split-decode")


@dataclass(frozen=True)
class Profile:
    source: str  # "measured" or hardware.ANALYTIC
    model: str
    cost: StepCost
    block_size: int
    num_blocks: int
    kv_bytes_per_token: float  # what a prefill -> decode transfer ships per prompt token
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    windows: tuple[int | None, ...] = (None,)  # each KV group's window (None: full attention)
    machine: dict[str, Any] = field(default_factory=dict)
    fit: dict[str, Any] = field(default_factory=dict)  # measured: the samples and the fit's errors
    # Serving time outside the engine step (HTTP, streaming, the async loop, the client), seconds per step
    # and per scheduled row; 0 unless `plan calibrate` fitted them to a real server's runs.
    overhead_step_s: float = 0.0
    overhead_row_s: float = 0.0
    calibration: dict[str, Any] = field(default_factory=dict)
    # Per-request serving time that does not hold the engine (seconds; 0 unless calibrated):
    # request_s: arrival -> enqueue in the scheduler (HTTP parsing, tokenization, stream set-up);
    # response_s: last token -> end of the response (the final chunk, [DONE], closing the stream).
    request_s: float = 0.0
    response_s: float = 0.0
    # Fleets behind a router (a `tokenloom cluster`: a separate Python process that proxies every stream):
    # router_hop_s once per request (its HTTP parse, routing, the connection to the worker);
    # router_step_s per step and router_token_s per streamed token of a worker behind it, beyond the single
    # server's overhead: the CPU the router and the other workers take from the cores they all share
    # (see simulator.SimWorker).
    router_hop_s: float = 0.0
    router_step_s: float = 0.0
    router_token_s: float = 0.0
    # A colocated worker's step that computes prompt tokens costs (1 + peer_chunk_ratio) x its price while
    # another worker of the fleet is stepping: the profile timed it with the other cores idle. On the 2-core
    # Xeon a 2-worker cluster's prompt-chunk steps cost 1.07-1.14x their price in loaded runs and 0.96-0.98x
    # at concurrency 1, where one worker steps at a time (plan/host.py fit_peer_chunks).
    peer_chunk_ratio: float = 0.0
    # Split fleets: the prefill -> decode handoff beyond bytes / link bandwidth (the prefill HTTP round
    # trip, KV export and import, the ZeroMQ send, the decode request's set-up).
    handoff_s: float = 0.0
    # Workers sharing one host: each step per second in which the *other* workers stream tokens slows a
    # split fleet's prefill step by this many seconds per second (the router, the client and their HTTP
    # loops, woken by every streaming step, preempt the engine thread and evict its caches). Fitted from a
    # loaded split point's TTFT (plan/calibrate.py) where the split workers' step traces are not given;
    # with them, the four split ratios below price the same slowing from the steps themselves, and this is 0.
    interference_step_s: float = 0.0
    # A split fleet's workers, from their step traces (plan/host.py fit_split_ratios): a prefill worker's step
    # costs its price x (1 + split_prefill_ratio), + split_prefill_peer_ratio x its price when it starts while
    # a decode worker has work; a decode worker's step likewise with split_decode_ratio, and
    # split_decode_peer_ratio when it starts while a prefill worker computes. On the 2-core EPYC (plan
    # validation runs 34-36) prefill steps ran 1.02-1.08 + 0.17-0.20 x (the fraction of the step beside
    # decode work) their price and decode steps 1.08-1.17 + 0.09-0.12 x that fraction in the judged runs
    # (each run's calibration fit is the same kind of line, from fewer steps).
    split_prefill_ratio: float = 0.0
    split_prefill_peer_ratio: float = 0.0
    split_decode_ratio: float = 0.0
    split_decode_peer_ratio: float = 0.0
    # And a decode worker's step that holds a prompt chunk: + split_decode_chunk_ratio x its price more. In
    # plan validation run 41 (2026-12-07) the decode worker's chunk steps ran 1.28-1.30x their price at 8-32
    # rows and its decode-only steps 0.94-1.16x; one ratio over both (1.077) priced the light load's 1-row
    # steps ~10% high. 0 in profiles calibrated before it (their decode ratio then covers both kinds).
    split_decode_chunk_ratio: float = 0.0
    kv_export_s_per_block: float = 0.0  # see KV_MOVES
    kv_import_s_per_block: float = 0.0
    # See SPREAD_KEYS. On the 2-core EPYC a 2-worker cluster's prompt-chunk steps ran up to 1.58x their mean
    # (q99; one worker alone 1.15x), and without it the cluster's light-load TTFT p99 came out a third short
    # (docs/benchmarks.md, plan validation run 34).
    step_spread: dict[str, tuple[float, ...]] = field(default_factory=dict)

    def step_time(self, rows: list[tuple[int, int]], spread: float = 1.0) -> float:
        """One simulated step: the engine step's cost (times `spread`, a draw of step_spread) plus the
        serving overhead."""
        return self.cost.step_time(rows) * spread + self.overhead_step_s + self.overhead_row_s * len(rows)

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"profile: {name} must be a positive integer, got {v!r}")
        for name in OVERHEADS + KV_MOVES:
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise ConfigError(f"profile: {name} must be a finite number >= 0, got {v!r}")
        for key, table in self.step_spread.items():
            if key not in SPREAD_KEYS:
                raise ConfigError(f"profile: step_spread has an unknown kind {key!r} (known: {', '.join(SPREAD_KEYS)})")
            ok = (len(table) >= 2 and all(isinstance(v, (int, float)) and 0 < v < float("inf") for v in table)
                  and all(a <= b for a, b in zip(table, table[1:])))
            if not ok:
                raise ConfigError(f"profile: step_spread[{key!r}] must be two or more non-decreasing positive "
                                  f"quantiles, got {table!r}")

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "model": self.model, "cost": self.cost.to_json(), "block_size": self.block_size,
                "num_blocks": self.num_blocks, "kv_bytes_per_token": self.kv_bytes_per_token,
                "max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
                "max_model_len": self.max_model_len, "windows": list(self.windows), "machine": self.machine,
                "fit": self.fit, **{k: getattr(self, k) for k in OVERHEADS + KV_MOVES},
                "step_spread": {k: list(v) for k, v in self.step_spread.items()}, "calibration": self.calibration}

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Profile:
        # A key this version does not know (a misspelt or renamed overhead) would simulate as 0 s: refused.
        known = {f.name for f in fields(cls)}  # to_json writes every field under its own name
        for key, successor in RETIRED.items():
            if key in d:
                if d[key]:
                    raise ConfigError(f"profile: {key} = {d[key]} was calibrated by an older tokenloom; this one "
                                      f"prices it as {successor}: run `tokenloom plan calibrate` again")
                d = {k: v for k, v in d.items() if k != key}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"profile: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        kind = d.get("cost", {}).get("kind")
        cost: StepCost
        if kind == "linear":
            cost = LinearStepCost.from_json(d["cost"])
        elif kind == "roofline":
            from tokenloom.plan.hardware import RooflineStepCost

            cost = RooflineStepCost.from_json(d["cost"])
        else:
            raise ConfigError(f"profile: unknown cost kind {kind!r} (linear or roofline)")
        return cls(d["source"], d["model"], cost, int(d["block_size"]), int(d["num_blocks"]),
                   float(d["kv_bytes_per_token"]), int(d["max_num_seqs"]), int(d["max_num_batched_tokens"]),
                   int(d["max_model_len"]), tuple(d.get("windows", [None])), d.get("machine", {}), d.get("fit", {}),
                   calibration=d.get("calibration", {}), **{k: float(d.get(k, 0.0)) for k in OVERHEADS + KV_MOVES},
                   step_spread={str(k): tuple(float(x) for x in v) for k, v in d.get("step_spread", {}).items()})

    @classmethod
    def load(cls, path: Path) -> Profile:
        try:
            d = json.loads(Path(path).read_text())
        except OSError as e:
            raise ConfigError(f"cannot read profile {path}: {e.strerror}") from None
        except ValueError as e:
            raise ConfigError(f"{path} is not JSON: {e}") from None
        try:
            return cls.from_json(d)
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{path} is not a tokenloom plan profile ({type(e).__name__}: {e})") from None
