"""`tokenloom plan calibrate`: fit the serving time a profile's engine steps leave out, from real runs.

A profile times `LLMEngine.step()` alone. A served request also pays for the async engine loop, the HTTP
layer, tokenization, the per-token stream (SSE framing, writes), a router for a cluster, a KV handoff for
a split fleet, and a load generator sharing the machine. The terms (Profile.OVERHEADS) and their fits,
each a least-squares fit of a constant or a line to a few measured `bench serve` points (medians):
1. Single server (two or more points, e.g. concurrency 1 and 8):
   - per step + per row (overhead_step_s + overhead_row_s x rows, added to each step, holding the engine):
     the measured median TPOT less the simulated one's engine part is regressed, non-negatively, on
     (1, mean running rows); or, given the server's step trace (`serve --step-trace`), each served decode
     step's time less the profile's price for its rows, regressed on (1, rows) (plan/host.py): thousands
     of steps at every load the calibration runs reached, not two medians. With a trace the step cost
     itself is first fitted again to the profile's timed steps and the served ones together
     (host.refit_cost): the served steps are the engine's in the state the judged runs find it in;
   - request_s (arrival -> enqueue, no engine held): the mean over the light points (`light`:
     concurrency 1, else the sparsest Poisson point) of measured median TTFT - simulated median TTFT
     without it. A constant
     delay before every request shifts the whole timeline, so this gap is exactly what it must be;
   - response_s (last token -> end of response): the median over the light points' records of
     e2el - ttft - (output_tokens - 1) x itl_mean, the time from the last streamed chunk to the end.
   These are refitted in turn until they settle (more overhead means more rows in flight).
2. A cluster behind the router (optional): router_step_s and router_token_s from its workers' step traces
   where given (their decode steps' time beyond the single server's per-step and per-row terms, a line in
   the streamed tokens: plan/host.py fit_router_excess), and from the same traces peer_chunk_ratio (their
   prompt-chunk steps' time beyond the price and those terms, per unit of price beside another worker's
   step: fit_peer_chunks; 0 without traces), else router_token_s from its loaded points (e.g.
   concurrency 8, where both workers stream while the router proxies every token on the same cores): the measured less
   the simulated median TPOT per running row as a first guess, bracketed, then regula falsi to a zero
   mean gap (`_per_token_fit`); without loaded points, from the light ones (about one streamed row per
   step, so the gap is the per-token cost). Then router_hop_s = measured - simulated median TTFT at the
   light points.
3. A split fleet (optional): given its workers' step traces, first what each role's steps cost against
   their price, alone and beside the other role's work (split_{prefill,decode}_ratio and _peer_ratio:
   plan/host.py fit_split_ratios; plan_validate.py adds runs at 16 rows and a burst above its knee for
   the traces, used for nothing else). Then handoff_s = measured - simulated median TTFT at its light
   points. Without the traces, interference_step_s from its loaded points (e.g. concurrency 4): how much
   the decode worker's streaming steps slow the prefill worker's steps on the shared host (the same search
   on the median TTFT gap); with them it stays 0, the ratios price that slowing from the steps themselves
   (on the 2-core EPYC this TTFT-gap term priced the prefill steps 1.3-1.6x where they ran 1.25x, and the
   decode worker at its price where it ran 1.15-1.3x: plan validation run 35, docs/benchmarks.md). It
   slows only a split fleet's prefill worker (plan/simulator.py), so the router terms are fitted once,
   before it.
4. The step spread (Profile.step_spread), from the same traces: the single server's steps' engine time over
   their price, the cluster workers' and the split workers' (host.fit_spread), per kind of step, as
   quantiles around the mean that the terms above carry. Each is set before the fits that simulate with it
   (request_s, router_hop_s, handoff_s).
Every term is clipped at 0 (a faster-than-simulated measurement means no such cost, not a negative one).
Calibrate on points you will not judge the simulation by, then compare at others.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from tokenloom.errors import ConfigError
from tokenloom.plan.cost_model import nnls
from tokenloom.plan.metrics import fleet_summary
from tokenloom.plan.profile_file import Profile
from tokenloom.plan.simulator import FleetConfig, simulate
from tokenloom.plan.workload import SimRequest, replay

if TYPE_CHECKING:
    from tokenloom.plan.host import SplitRatioFit, SpreadFit

Point = tuple[dict[str, Any], Path]  # a bench summary point and its own records file


def bench_points(folder: Path) -> list[Point]:
    """Each point of a `bench serve` results folder with its own records file (written beside them)."""
    try:
        summary = json.loads((folder / "summary.json").read_text())
        records = pd.read_csv(folder / "records.csv")
    except (OSError, ValueError) as e:
        raise ConfigError(f"{folder}: not a bench serve results folder ({e})") from None
    out = []
    for i, p in enumerate(summary["points"]):
        sel = records["input_len"] == p["input_len"]
        for col in ("concurrency", "request_rate"):
            if p.get(col) is not None:
                sel &= records[col] == p[col]
        path = folder / f"calibration-point-{i}.csv"
        records[sel].to_csv(path, index=False)
        out.append((p, path))
    return out


def light(points: list[Point]) -> list[Point]:
    """The points that fit the per-request terms, where no queueing blurs them: the concurrency-1 points if
    there are any, else the lowest-rate open-loop (Poisson) point, else all."""
    ones = [pt for pt in points if pt[0].get("concurrency") == 1]
    if ones:
        return ones
    rates = [pt for pt in points if pt[0].get("request_rate")]
    if rates:
        low = min(pt[0]["request_rate"] for pt in rates)
        return [pt for pt in rates if pt[0]["request_rate"] == low]
    return points


def response_tail(trace: Path) -> float:
    """Median time from a request's last streamed chunk to the end of its response (one chunk a token)."""
    df = pd.read_csv(trace)
    need = {"ttft", "e2el", "itl_mean", "output_tokens"}
    if not need <= set(df.columns):
        raise ConfigError(f"{trace}: a bench records file needs columns {sorted(need)}")
    df = df.dropna(subset=list(need))
    df = df[df["output_tokens"] > 1]
    if df.empty:
        return 0.0
    tail = df["e2el"] - df["ttft"] - (df["output_tokens"] - 1) * df["itl_mean"]
    return max(0.0, float(np.median(tail)))


def _light_and_loaded(folders: list[Path], metric: str) -> tuple[list[Point], list[Point]]:
    """The points of `folders`: the light ones (`light`) and the others that measured `metric`."""
    every = [pt for f in folders for pt in bench_points(f)]
    lights = light(every)
    return lights, [pt for pt in every if all(pt is not p for p in lights) and pt[0].get(metric) is not None]


def _residual_fit(name: str, prof: Profile, fleet: FleetConfig, points: list[Point], metric: str, seed: int,
                  log: Callable[[str], None]) -> tuple[float, list[dict[str, Any]]]:
    """Least squares of a constant: the mean over `points` of measured - simulated `metric` (simulated with
    the term at 0), clipped at 0."""
    rows = []
    for point, trace in points:
        # At concurrency 1 one request is in flight at a time, so nothing streams during a prefill; the
        # replay (open loop, at the measured start times) can overlap a request's simulated tail with the
        # next one's prefill, which the interference (or the split's peer ratios) would then slow: left out.
        cur = replace(prof, **{name: 0.0})  # the term's own current value out: the residual is all of it
        if point.get("concurrency") == 1:
            cur = replace(cur, interference_step_s=0.0, split_prefill_peer_ratio=0.0, split_decode_peer_ratio=0.0)
        s = fleet_summary(simulate(cur, fleet, replay(trace, seed=seed), seed))
        if point.get(metric) is None or s[metric] is None:
            continue
        rows.append({"term": name, "concurrency": point.get("concurrency"), "request_rate": point.get("request_rate"),
                     "metric": metric, "measured_s": point[metric], "simulated_s": s[metric],
                     "residual_s": point[metric] - s[metric]})
        log(f"  {name}: {metric} measured {point[metric] * 1e3:.1f} ms, simulated {s[metric] * 1e3:.1f} ms")
    if not rows:
        raise ConfigError(f"calibrating {name} needs a measured point with a {metric}")
    value = max(0.0, float(np.mean([r["residual_s"] for r in rows])))
    log(f"  -> {name} = {value * 1e3:.2f} ms")
    return value, rows


def _zero_gap_fit(term: str, prof: Profile, fleet: FleetConfig, points: list[Point], metric: str, seed: int,
                  log: Callable[[str], None], first: Callable[[float, float], float],
                  rounds: int = 8) -> tuple[float, list[dict[str, Any]]]:
    """The value of the profile's `term` at which the mean of (measured - simulated `metric`) over `points`
    is 0: a first guess `first(gap at 0, mean running rows at 0)`, bracketed, then regula falsi (the gap
    shrinks as the term grows, not quite linearly: longer steps keep more rows running). Clipped at 0:
    measured no slower than the simulation without the term means no such cost."""
    reqs = [replay(trace, seed=seed) for _, trace in points]

    def gap(value: float) -> tuple[float, float, list[dict[str, Any]]]:
        cur = replace(prof, **{term: value})
        gaps, runs, rows = [], [], []
        for (point, _), rq in zip(points, reqs):
            s = fleet_summary(simulate(cur, fleet, rq, seed))
            if point.get(metric) is None or s[metric] is None:
                continue
            gaps.append(point[metric] - s[metric])
            runs.append(max(1.0, s["running_mean"]))
            rows.append({"term": term, "concurrency": point.get("concurrency"),
                         "request_rate": point.get("request_rate"), "metric": metric,
                         "measured_s": point[metric], "simulated_s": s[metric],
                         "rows": s["running_mean"], term: value})
        if not gaps:
            raise ConfigError(f"calibrating {term} needs a loaded measured point with a {metric}")
        return float(np.mean(gaps)), float(np.mean(runs)), rows

    g0, r0, rows = gap(0.0)
    x1 = 0.0
    if g0 > 0:
        # The gap falls as the term grows: bracket its zero (doubling from the first guess), then regula
        # falsi with the Illinois rule. A secant step alone can leap far past it where the gap is flat.
        lo, g_lo = 0.0, g0
        hi = max(first(g0, r0), 1e-9)
        g_hi, _, rows = gap(hi)
        for _ in range(40):
            if g_hi <= 0:
                break
            lo, g_lo, hi = hi, g_hi, hi * 2
            g_hi, _, rows = gap(hi)
        if g_hi > 0:
            raise ConfigError(f"calibrating {term}: no value up to {hi:.3g} brings the simulated {metric} up to "
                              f"the measured one")
        x1 = hi
        side = 0
        for _ in range(rounds):
            x1 = hi - g_hi * (hi - lo) / (g_hi - g_lo) if g_hi != g_lo else (lo + hi) / 2
            g1, _, rows = gap(x1)
            if abs(g1) < 1e-6:
                break
            if g1 > 0:
                lo, g_lo = x1, g1
                if side == 1:
                    g_hi /= 2  # Illinois: the end that stays put for a second time weighs half
                side = 1
            else:
                hi, g_hi = x1, g1
                if side == -1:
                    g_lo /= 2
                side = -1
    # `rows` are those of the last value tried, x1's.
    for r in rows:
        log(f"  {term}: {metric} measured {r['measured_s'] * 1e3:.1f} ms, simulated {r['simulated_s'] * 1e3:.1f} ms "
            f"at {r['rows']:.1f} rows (concurrency {r['concurrency']}, rate {r['request_rate']})")
    log(f"  -> {term} = {x1 * 1e3:.3f} ms")
    return x1, rows


def _per_token_fit(prof: Profile, fleet: FleetConfig, points: list[Point], seed: int,
                   log: Callable[[str], None]) -> tuple[float, list[dict[str, Any]]]:
    """router_token_s from loaded cluster points (median TPOT). Each streamed token lengthens the step that
    made it by the term, so a step of R rows grows by about R x it: the first guess is the gap per running
    row."""
    return _zero_gap_fit("router_token_s", prof, fleet, points, "tpot_s_median", seed, log, lambda g, rows: g / rows)


def _interference_fit(prof: Profile, fleet: FleetConfig, points: list[Point], seed: int,
                      log: Callable[[str], None]) -> tuple[float, list[dict[str, Any]]]:
    """interference_step_s from loaded split points (median TTFT): there a prompt's prefill runs while the
    decode worker streams. First guess 2 ms of slowing per streaming step per second (about what the 2-core
    CPU showed); the bracketed search does the rest."""
    return _zero_gap_fit("interference_step_s", prof, fleet, points, "ttft_s_median", seed, log, lambda g, rows: 2e-3)


def calibrate(profile: Profile, folders: list[Path], fleet: FleetConfig, seed: int = 0, rounds: int = 6,
              cluster: tuple[list[Path], FleetConfig] | None = None,
              split: tuple[list[Path], FleetConfig] | None = None,
              step_traces: list[Path] | None = None, cluster_step_traces: list[Path] | None = None,
              split_step_traces: list[Path] | None = None, log: Callable[[str], None] = lambda m: None) -> Profile:
    """Fit the module docstring's terms: `folders` of the single server (`fleet`), then optionally the
    router terms from `cluster`'s measured folders, and the handoff (light points) and the interference
    (loaded points) from `split`'s.
    With `step_traces` (`serve --step-trace` of the same server's calibration runs) the step cost is refitted
    with the served steps, and the per-step and per-row overhead come from the traced steps themselves
    (plan/host.py) instead of the TPOT regression. With `cluster_step_traces` (the cluster's workers'
    traces over its calibration runs) router_step_s and router_token_s are their decode steps' cost beyond
    the single server's per-step and per-row terms (host.fit_router_excess), not the loaded TPOT gap. With
    `split_step_traces` (the split fleet's workers' traces over its calibration runs, in `cluster
    --step-trace-dir`'s order: its decode workers, then its prefill workers) the split ratios are fitted
    (host.fit_split_ratios) before the handoff, and no interference is."""
    points = [pt for folder in folders for pt in bench_points(folder) if pt[0].get("tpot_s_median") is not None]
    need = 1 if step_traces else 2
    if len(points) < need:
        raise ConfigError(f"calibration needs at least {need} measured point(s) with a TPOT (e.g. concurrency 1 "
                          f"and 8{'' if need == 2 else ', or 1 with a step trace'})")
    requests: list[list[SimRequest]] = [replay(trace, seed=seed) for _, trace in points]
    lights = light(points)
    response = float(np.mean([response_tail(trace) for _, trace in lights]))
    a = b = req = 0.0
    traced = single_spread = None
    refit = None
    profile = replace(profile, step_spread={})  # fitted afresh below, from the traces given, or none
    if step_traces:
        from tokenloom.plan.host import attribute, fit_overheads, fit_spread, load_trace, refit_cost

        trace = load_trace(step_traces)
        profile, refit = refit_cost(profile, trace)
        log(f"step trace: {refit}")
        attributed = attribute(profile, trace)
        traced = fit_overheads(attributed)
        a, b = traced.step_s, traced.row_s
        log(f"step trace: {traced.line()}")
        single_spread = fit_spread(attributed)
        log(f"step trace: {single_spread.line()}")
        profile = replace(profile, step_spread={f"single-{k}": t for k, t in single_spread.tables.items()})
    used: list[dict[str, Any]] = []
    for _ in range(rounds):
        cur = replace(profile, overhead_step_s=a, overhead_row_s=b, request_s=req, response_s=response,
                      **_NO_FLEET_TERMS)
        xs, ys, used, gaps = [], [], [], []
        for (point, _), reqs in zip(points, requests):
            s = fleet_summary(simulate(cur, fleet, reqs, seed))
            if s["tpot_s_median"] is None:
                continue
            rows = s["running_mean"]
            xs.append([1.0, rows])
            ys.append(point["tpot_s_median"] - (s["tpot_s_median"] - a - b * rows))
            if any(point is p for p, _ in lights) and s["ttft_s_median"] is not None:
                gaps.append(point["ttft_s_median"] - (s["ttft_s_median"] - req))
            used.append({"concurrency": point.get("concurrency"), "request_rate": point.get("request_rate"),
                         "measured_tpot_s": point["tpot_s_median"], "simulated_tpot_s": s["tpot_s_median"],
                         "measured_ttft_s": point["ttft_s_median"], "simulated_ttft_s": s["ttft_s_median"],
                         "rows": rows})
        if traced is None:
            if len(xs) < 2:
                raise ConfigError("calibration needs at least two measured points the simulation gives a TPOT for")
            a, b = (float(v) for v in nnls(np.array(xs), np.array(ys)))
        req = max(0.0, float(np.mean(gaps))) if gaps else 0.0
    out = replace(profile, overhead_step_s=a, overhead_row_s=b, request_s=req, response_s=response,
                  **_NO_FLEET_TERMS)
    log(f"single server: {a * 1e3:.2f} ms/step + {b * 1e3:.3f} ms/row; request {req * 1e3:.1f} ms, "
        f"response {response * 1e3:.1f} ms, from {len(used)} points")
    if split is not None and split[1].prefill_workers < 1:
        raise ConfigError("the split calibration fleet needs prefill workers")
    # (fleet, light points, loaded points) of each optional measured fleet
    c_pts = (cluster[1], *_light_and_loaded(cluster[0], "tpot_s_median")) if cluster is not None else None
    s_pts = (split[1], *_light_and_loaded(split[0], "ttft_s_median")) if split is not None else None
    fits: list[dict[str, Any]] = []
    router_fit = chunk_fit = cluster_spread = None
    if cluster_step_traces:
        if c_pts is None:
            raise ConfigError("the cluster's step traces need its calibration runs (cluster=) too")
        from tokenloom.plan.host import attribute, fit_peer_chunks, fit_router_excess, fit_spread, load_trace

        c_trace = attribute(profile, load_trace(cluster_step_traces))
        router_fit = fit_router_excess(c_trace, a, b)
        log(f"cluster step traces: {router_fit.line()}")
        chunk_fit = fit_peer_chunks(c_trace, a, b, router_fit.step_s, router_fit.token_s)
        log(f"cluster step traces: {chunk_fit.line()}")
        cluster_spread = fit_spread(c_trace)
        log(f"cluster step traces: {cluster_spread.line()}")
        out = replace(out, router_step_s=router_fit.step_s, peer_chunk_ratio=chunk_fit.ratio,
                      step_spread={**out.step_spread, **{f"fleet-{k}": t for k, t in cluster_spread.tables.items()}})
    if c_pts is not None:
        c_fleet, c_light, c_loaded = c_pts
        if router_fit is not None:
            tok, r1 = router_fit.token_s, []
        elif c_loaded:  # the router's per-token cost shows when both workers stream at once, not at concurrency 1
            tok, r1 = _per_token_fit(out, c_fleet, c_loaded, seed, log)
        else:
            tok, r1 = _residual_fit("router_token_s", out, c_fleet, c_light, "tpot_s_median", seed, log)
        out = replace(out, router_token_s=tok)
        hop, r2 = _residual_fit("router_hop_s", out, c_fleet, c_light, "ttft_s_median", seed, log)
        out = replace(out, router_hop_s=hop)
        fits += r1 + r2
    split_fit = split_spread = None
    if split_step_traces:
        if s_pts is None:
            raise ConfigError("the split fleet's step traces need its calibration runs (split=) too")
        split_fit, split_spread = _split_ratio_fit(out, s_pts[0], split_step_traces)
        log(f"split step traces: {split_fit.line()}")
        log(f"split step traces: {split_spread.line()}")
        out = replace(out, split_prefill_ratio=split_fit.prefill[0], split_prefill_peer_ratio=split_fit.prefill[1],
                      split_decode_ratio=split_fit.decode[0], split_decode_peer_ratio=split_fit.decode[1],
                      split_decode_chunk_ratio=split_fit.decode_chunk,
                      step_spread={**out.step_spread, **{f"split-{k}": t for k, t in split_spread.tables.items()}})
    if s_pts is not None:
        s_fleet, s_light, s_loaded = s_pts
        handoff, r3 = _residual_fit("handoff_s", out, s_fleet, s_light, "ttft_s_median", seed, log)
        out = replace(out, handoff_s=handoff)
        fits += r3
        if split_fit is not None:
            log("  interference_step_s: 0 (the split workers' traces priced their steps)")
        elif s_loaded:
            inter, r4 = _interference_fit(out, s_fleet, s_loaded, seed, log)
            out = replace(out, interference_step_s=inter)
            fits += r4
    return replace(out, calibration={"points": used, "residual_fits": fits, "folders": [str(f) for f in folders],
                                     "step_traces": [str(f) for f in step_traces or []],
                                     "step_trace_fit": None if traced is None else traced.line(),
                                     "step_trace_cost": refit,
                                     "fleet_workers": fleet.workers,
                                     "cluster_folders": [str(f) for f in cluster[0]] if cluster else [],
                                     "cluster_step_traces": [str(f) for f in cluster_step_traces or []],
                                     "cluster_step_trace_fit": None if router_fit is None else router_fit.line(),
                                     "cluster_chunk_fit": None if chunk_fit is None else chunk_fit.line(),
                                     "single_spread_fit": None if single_spread is None else single_spread.line(),
                                     "cluster_spread_fit": None if cluster_spread is None else cluster_spread.line(),
                                     "split_spread_fit": None if split_spread is None else split_spread.line(),
                                     "split_folders": [str(f) for f in split[0]] if split else [],
                                     "split_step_traces": [str(f) for f in split_step_traces or []],
                                     "split_ratio_fit": None if split_fit is None else split_fit.line()})


# Every fleet's term at 0 (the router's, the colocated workers', the split fleet's): the single server's
# fit simulates without them, and the fleets' fits set them afresh after it.
_NO_FLEET_TERMS = {name: 0.0 for name in ("router_hop_s", "router_step_s", "router_token_s", "peer_chunk_ratio",
                                          "handoff_s", "interference_step_s", "split_prefill_ratio",
                                          "split_prefill_peer_ratio", "split_decode_ratio",
                                          "split_decode_peer_ratio", "split_decode_chunk_ratio")}


def _split_ratio_fit(prof: Profile, fleet: FleetConfig, traces: list[Path]) -> tuple[SplitRatioFit, SpreadFit]:
    """host.fit_split_ratios over the split fleet's worker traces (the first fleet.workers are its decode
    workers, the next fleet.prefill_workers its prefill workers: `cluster --step-trace-dir`'s order), and
    their steps' spread around their price (host.fit_spread)."""
    from tokenloom.plan.host import attribute, fit_split_ratios, fit_spread, load_trace

    if len(traces) != fleet.workers + fleet.prefill_workers:
        raise ConfigError(f"the split fleet's step traces: {len(traces)} given, its {fleet.workers} decode and "
                          f"{fleet.prefill_workers} prefill workers make "
                          f"{fleet.workers + fleet.prefill_workers} (decode workers' first)")
    df = attribute(prof, load_trace(traces))
    return fit_split_ratios(df, {str(t) for t in traces[fleet.workers:]}), fit_spread(df)


def overheads_line(prof: Profile) -> str:
    """The calibrated terms in one line (milliseconds)."""
    return (f"{prof.overhead_step_s * 1e3:.2f} ms/step + {prof.overhead_row_s * 1e3:.3f} ms/row; per request "
            f"{prof.request_s * 1e3:.1f} ms in + {prof.response_s * 1e3:.1f} ms out; router {prof.router_hop_s * 1e3:.1f} "
            f"ms/request + {prof.router_step_s * 1e3:.2f} ms/step + {prof.router_token_s * 1e3:.2f} ms/token, prompt "
            f"chunks x{1 + prof.peer_chunk_ratio:.3f} beside another worker; "
            f"split handoff +{prof.handoff_s * 1e3:.1f} ms; "
            f"interference {prof.interference_step_s * 1e3:.2f} ms per streaming step/s of other workers; split "
            f"prefill steps x{1 + prof.split_prefill_ratio:.3f} +{prof.split_prefill_peer_ratio:.3f} beside decode work, "
            f"decode steps x{1 + prof.split_decode_ratio:.3f} +{prof.split_decode_peer_ratio:.3f} beside a prefill "
            f"+{prof.split_decode_chunk_ratio:.3f} holding a prompt chunk; "
            f"step spread "
            f"{', '.join(sorted(prof.step_spread)) or 'none'}")
