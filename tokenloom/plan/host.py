"""The serving overhead a served step trace shows (`serve --step-trace`), beside a profile of the same engine.

A profile prices a step of given rows as the engine alone ran it. In a server the same rows cost more:
the event loop's work for every streamed token (SSE framing, detokenized text, socket writes), the HTTP
layer and tokenization of every new request run in the same process (one GIL) and, with the load
generator, on the same cores. For each traced step i (tokenloom/engine/step_trace.py):
- served_i = posted_i - loop_start_i: the engine loop's iteration (queued adds, the step, posting);
- engine_i = step_end_i - step_start_i: what the profile timed (`LLMEngine.step()`);
- predicted_i = the profile's bare step cost for rows_i;
- inside_i = engine_i - predicted_i: the step itself slowed by what ran beside it;
- outside_i = served_i - engine_i: the loop's own work around the step.
`fit_overheads` regresses served_i - predicted_i on (1, rows_i), non-negatively, over the decode-only
steps: the simulator's overhead_step_s and overhead_row_s, added to each simulated step as it holds the
engine. Steps with a prefill chunk are left out of the fit: their residual is dominated by the profile's
own error on chunks (+-10% of a 150 ms step), not by serving. Fitted from a loaded run, the terms carry the
contention that grows with the rows streamed, which light-load calibration points cannot show.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from tokenloom.engine.step_trace import COLUMNS, parse_rows
from tokenloom.errors import ConfigError
from tokenloom.plan.cost_model import LinearStepCost, nnls
from tokenloom.plan.profile_file import Profile

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def load_trace(paths: Sequence[Path]) -> pd.DataFrame:
    """One or more step traces, one frame: a line per step with its parsed rows and derived times (s)."""
    frames = []
    for path in paths:
        try:
            df = pd.read_csv(path)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path}: not a readable step trace ({e})") from None
        missing = set(COLUMNS) - set(df.columns)
        if missing:
            raise ConfigError(f"{path}: not a step trace (`serve --step-trace`); missing {sorted(missing)}")
        df["trace"] = str(path)
        frames.append(df)
    if not frames or all(f.empty for f in frames):
        raise ConfigError("the step trace has no steps: serve some requests first")
    df = pd.concat(frames, ignore_index=True)
    df["rows_parsed"] = [parse_rows(str(r)) for r in df["rows"].fillna("")]
    df["served"] = df["posted"] - df["loop_start"]
    df["engine"] = df["step_end"] - df["step_start"]
    df["decode_only"] = df["num_tokens"] == df["num_rows"]
    return df


def attribute(profile: Profile, df: pd.DataFrame) -> pd.DataFrame:
    """Add each step's predicted bare cost and its inside / outside / total overhead (seconds)."""
    out = df.copy()
    out["predicted"] = [profile.cost.step_time(rows) for rows in out["rows_parsed"]]
    out["inside"] = out["engine"] - out["predicted"]
    out["outside"] = out["served"] - out["engine"]
    out["overhead"] = out["served"] - out["predicted"]
    return out


@dataclass(frozen=True)
class HostFit:
    step_s: float  # per step
    row_s: float  # per scheduled row
    steps: int  # decode-only steps fitted
    median_abs_error_s: float  # of the fitted overhead per step

    def line(self) -> str:
        return (f"{self.step_s * 1e3:.2f} ms/step + {self.row_s * 1e3:.3f} ms/row, from {self.steps} served decode "
                f"steps (median |error| {self.median_abs_error_s * 1e3:.2f} ms)")


def fit_overheads(attributed: pd.DataFrame) -> HostFit:
    """served - predicted ~ step_s + row_s x rows over the decode-only steps, non-negative least squares
    (unweighted: the fit must get the total time right, which the many-row steps dominate)."""
    dec = attributed[attributed["decode_only"]]
    if len(dec) < 3:
        raise ConfigError(f"fitting the serving overhead needs at least 3 traced decode steps, got {len(dec)}")
    a = np.column_stack([np.ones(len(dec)), dec["num_rows"].to_numpy(float)])
    b = dec["overhead"].to_numpy(float)
    x = nnls(a, b)
    return HostFit(float(x[0]), float(x[1]), len(dec), float(np.median(np.abs(a @ x - b))))


def uncharged(attributed: pd.DataFrame, step_s: float, row_s: float, router_step_s: float = 0.0,
              token_s: float = 0.0) -> np.ndarray:
    """Per traced step, its overhead (served - predicted) beyond the terms the simulator already charges
    it: step_s + row_s x rows (the single server's), router_step_s, token_s x streamed tokens."""
    return (attributed["overhead"].to_numpy(float) - step_s - row_s * attributed["num_rows"].to_numpy(float)
            - router_step_s - token_s * attributed["streamed"].to_numpy(float))


@dataclass(frozen=True)
class RouterFit:
    step_s: float  # per step of a worker behind the router, beyond the single server's overhead
    token_s: float  # per streamed token, likewise
    steps: int  # decode steps fitted
    tokens: int  # tokens they streamed
    median_abs_error_s: float  # of the fitted excess per step

    def line(self) -> str:
        return (f"{self.step_s * 1e3:.2f} ms/step + {self.token_s * 1e3:.3f} ms/token, from {self.steps} served "
                f"decode steps streaming {self.tokens} tokens (median |error| {self.median_abs_error_s * 1e3:.2f} ms)")


def fit_router_excess(attributed: pd.DataFrame, step_s: float, row_s: float) -> RouterFit:
    """What a cluster's traced decode steps cost beyond a single server's overhead (`step_s` + `row_s` x
    rows): a line in the step's streamed tokens, non-negative least squares, both terms charged (the
    simulator's router_step_s and router_token_s). Behind the router every token is also proxied by the
    router process, and on a host whose cores the workers share that CPU is taken from the steps: the
    per-token term. The per-step term is what a worker's step costs beside another worker and the router
    whatever it streams: on the 2-core Xeon mostly the other worker's decode steps, which share the memory
    bandwidth (a 1-row step took 0.95x its price while the other worker idled and 1.29x while it decoded;
    plan validation run 20: +2.03 ms per step and no slope, which a per-token term alone left uncharged, the
    cluster simulated 6-52% short: docs/benchmarks.md, "Run 20" and "Runs 21-23"). Non-negative: in run 17
    the workers' 1-row steps ran 0.6 ms faster than the single server's a few minutes earlier, which is the
    machine's drift, not a saving a router brings. From the workers' own traces, thousands of steps, not
    the gap between two TPOT medians (on the 2-core Xeon a concurrency-8 point's TPOT gap fitted 0.15 ms in
    one run and 0.01 in the next)."""
    dec = attributed[attributed["decode_only"] & (attributed["streamed"] > 0)]
    tokens = dec["streamed"].to_numpy(float)
    if len(dec) < 3 or np.ptp(tokens) == 0:
        raise ConfigError(f"fitting the router's cost needs traced decode steps streaming different numbers of "
                          f"tokens (a light and a loaded run), got {len(dec)} steps streaming "
                          f"{sorted(set(tokens.astype(int).tolist()))[:8]}")
    excess = uncharged(dec, step_s, row_s)
    a = np.column_stack([np.ones(len(dec)), tokens])
    x = nnls(a, excess)
    return RouterFit(float(x[0]), float(x[1]), len(dec), int(tokens.sum()), float(np.median(np.abs(a @ x - excess))))


def _covered_before(m: np.ndarray, t: np.ndarray) -> np.ndarray:
    """The length of the union of disjoint sorted intervals m (K, 2) that lies before each time in t."""
    length = m[:, 1] - m[:, 0]
    before = np.concatenate([[0.0], np.cumsum(length)])  # before[k]: the length of intervals 0 .. k-1
    k = np.searchsorted(m[:, 0], t, side="right")  # intervals starting at or before t
    last = np.maximum(k - 1, 0)  # the last of them, counted up to t
    return np.where(k > 0, before[last] + np.clip(t - m[last, 0], 0.0, length[last]), 0.0)


def peer_busy(df: pd.DataFrame, peers: Collection[str] | None = None) -> np.ndarray:
    """Per traced step, the fraction of its engine time (step_start .. step_end) during which another trace
    (another worker of the fleet; the traces share the monotonic clock) was in a loop iteration (loop_start ..
    posted: its step and the work around it, all of it on the shared cores; the simulator's step holds the
    engine as long). `peers`: the traces that count as the others (default: all)."""
    out = np.zeros(len(df))
    starts, ends = df["step_start"].to_numpy(float), df["step_end"].to_numpy(float)
    loops, posted = df["loop_start"].to_numpy(float), df["posted"].to_numpy(float)
    traces = df["trace"].to_numpy()
    counted = np.ones(len(df), bool) if peers is None else np.isin(traces, list(peers))
    for name in np.unique(traces):
        mine = traces == name
        others = ~mine & counted
        # The union of the other traces' iterations as disjoint intervals [lo_k, hi_k).
        order = np.argsort(loops[others])
        lo, hi = loops[others][order], posted[others][order]
        merged: list[list[float]] = []
        for a, b in zip(lo, hi):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        if not merged:
            continue
        m = np.array(merged)  # (K, 2), disjoint and sorted
        s, e = starts[mine], ends[mine]
        out[mine] = (_covered_before(m, e) - _covered_before(m, s)) / np.maximum(e - s, 1e-12)
    return np.clip(out, 0.0, 1.0)


@dataclass(frozen=True)
class PeerChunkFit:
    ratio: float  # a prompt-chunk step's cost beyond its price and the charged terms, per unit of price, peer busy
    steps: int  # chunk steps fitted (0: none beside another worker's, nothing charged)
    busy: float  # their mean fraction of time beside another worker's step

    def line(self) -> str:
        if not self.steps:
            return "no traced prompt-chunk step beside another worker's: none charged"
        return (f"prompt-chunk steps {1 + self.ratio:.3f}x their price beside another worker's step, from {self.steps} "
                f"served chunk steps ({self.busy:.0%} of their time beside one)")


def fit_peer_chunks(attributed: pd.DataFrame, step_s: float, row_s: float, router_step_s: float,
                    router_token_s: float) -> PeerChunkFit:
    """A cluster's traced steps that compute prompt tokens: their time beyond the price and every term the
    simulator already charges them (the single server's per-step and per-row overhead, the router's per-step
    and per-token cost), against price x the fraction of the step another worker spent stepping beside it
    (`peer_busy`): a least-squares ratio through the origin, non-negative (the simulator's
    peer_chunk_ratio). The profile times a chunk with the other cores idle; beside another worker's steps
    it ran 7-14% over its price on the 2-core Xeon, in the calibration runs and the judged ones alike (plan
    validation runs 24-26), and 2-4% under it at concurrency 1 (one worker at a time). Unpriced, the
    cluster's capacity came out 4-6% high, and its latency near saturation 15-30% short (docs/benchmarks.md,
    "Run 26")."""
    busy = peer_busy(attributed)
    chunk = ~attributed["decode_only"].to_numpy(bool)
    if not (busy[chunk] > 0).any():  # nothing measured beside another worker (one worker's trace): no charge
        return PeerChunkFit(0.0, 0, 0.0)
    df = attributed[chunk]
    excess = uncharged(df, step_s, row_s, router_step_s, router_token_s)
    x = df["predicted"].to_numpy(float) * busy[chunk]
    ratio = max(0.0, float(x @ excess / (x @ x)))
    return PeerChunkFit(ratio, len(df), float(busy[chunk].mean()))


SPREAD_POINTS = 100  # quantiles kept per kind of step
MIN_SPREAD_STEPS = 30  # fewer traced steps of a kind say too little about its tail: no table for it


@dataclass(frozen=True)
class SpreadFit:
    tables: dict[str, tuple[float, ...]]  # "chunk" / "decode": quantiles of engine / price over their mean
    steps: dict[str, int]  # traced steps behind each (a kind with too few has no table)

    def line(self) -> str:
        parts = []
        for kind in ("chunk", "decode"):
            t = self.tables.get(kind)
            if t is None:
                parts.append(f"{kind} steps: {self.steps.get(kind, 0)} traced, too few (no spread)")
                continue
            q = [t[min(int(p * len(t)), len(t) - 1)] for p in (0.1, 0.9, 0.99)]
            parts.append(f"{kind} steps x{q[0]:.2f} / x{q[1]:.2f} / x{q[2]:.2f} their mean at q10 / q90 / q99 "
                         f"({self.steps[kind]} traced)")
        return "step spread: " + "; ".join(parts)


def fit_spread(attributed: pd.DataFrame, points: int = SPREAD_POINTS,
               min_steps: int = MIN_SPREAD_STEPS) -> SpreadFit:
    """The spread of traced steps' engine time around their price, for the simulator to draw from
    (Profile.step_spread): per kind of step (prompt chunks, decode-only), `points` quantiles at (i + 0.5) /
    points of engine / predicted, divided by its mean. The mean is what the other terms carry (the price,
    peer_chunk_ratio); this is only the shape around it: the slow steps a p99 is made of."""
    tables: dict[str, tuple[float, ...]] = {}
    steps: dict[str, int] = {}
    decode = attributed["decode_only"].to_numpy(bool)
    for kind, mask in (("chunk", ~decode), ("decode", decode)):
        df = attributed[mask]
        df = df[df["predicted"] > 0]
        steps[kind] = len(df)
        if len(df) < min_steps:
            continue
        ratio = df["engine"].to_numpy(float) / df["predicted"].to_numpy(float)
        q = np.quantile(ratio / ratio.mean(), (np.arange(points) + 0.5) / points)
        tables[kind] = tuple(float(v) for v in np.maximum.accumulate(np.maximum(q, 1e-6)))
    return SpreadFit(tables, steps)


@dataclass(frozen=True)
class SplitRatioFit:
    prefill: tuple[float, float]  # (alone, peer): a prefill step costs price x (1 + alone + peer x busy)
    decode: tuple[float, float]  # the same for a decode worker's steps, busy beside a prefill worker's
    decode_chunk: float  # + this x price for a decode worker's step that holds a prompt chunk
    prefill_steps: int
    decode_steps: int
    prefill_busy: float  # the mean fraction of those steps' time beside the other role's work
    decode_busy: float

    def line(self) -> str:
        def one(name: str, r: tuple[float, float], n: int, busy: float) -> str:
            if not n:
                return f"no traced {name} steps: none charged"
            return (f"{name} steps x{1 + r[0]:.3f} their price alone, +{r[1]:.3f} beside the other role's work "
                    f"({n} traced, {busy:.0%} of their time beside it)")
        return "; ".join((one("prefill", self.prefill, self.prefill_steps, self.prefill_busy),
                          one("decode", self.decode, self.decode_steps, self.decode_busy)
                          + (f", +{self.decode_chunk:.3f} holding a prompt chunk" if self.decode_steps else "")))


def _ratio_fit(df: pd.DataFrame, *marks: np.ndarray) -> tuple[float, ...]:
    """engine - price ~ alone x price + sum of coef_i x price x marks_i (busy: the fraction of the step beside
    the other role's work; a decode worker's 0/1 for holding a prompt chunk), non-negative least squares
    (unweighted: the total time is what the simulation must get right, which the long steps carry).
    Returns (alone, coef_1, ...)."""
    if df.empty:
        return (0.0,) * (1 + len(marks))
    price = df["predicted"].to_numpy(float)
    x = nnls(np.column_stack([price, *(price * m for m in marks)]), df["engine"].to_numpy(float) - price)
    return tuple(float(v) for v in x)


def fit_split_ratios(attributed: pd.DataFrame, prefill_traces: Collection[str]) -> SplitRatioFit:
    """A split fleet's traced steps against their price, per role (a trace in `prefill_traces` is a prefill
    worker's, any other a decode worker's): engine time = price x (1 + alone + peer x busy), busy the
    fraction of the step during which a worker of the other role was in a loop iteration (`peer_busy`: its
    step and the work around it, on the shared cores). The simulator's split_{prefill,decode}_ratio and
    _peer_ratio; it charges the peer part on a step that starts while the other role has work. A ratio, not
    a cost per streaming step or per row: on the 2-core EPYC the prefill worker's steps ran 1.02-1.08 + 0.17-0.20
    x busy their price in the judged runs of plan validation runs 34-36, its decode worker's 1.08-1.17 +
    0.09-0.12 x busy (each run's calibration lines within 0.05 of its judged ones at the busy fractions the
    calibration covers); the TTFT-gap term `interference_step_s` fitted 5.4 and
    6.4 ms per streaming step/s there, which priced prefill steps at 1.3-1.6x beside a 10 ms decode step
    (their measured 1.25x) and the decode worker at its price, so the split fleet's TPOT came out 12-41%
    short in run 35 and its loaded TTFT up to 56% long. Where a role's steps all ran beside the other
    role's work, or none did, alone and peer cannot be told apart: the fit fixes their sum (or alone), which
    is what the simulator charges steps in the same situation. A decode worker's steps that hold a prompt
    chunk (the tail of a prompt past its last whole imported block) get a third term, + decode_chunk x
    price: in plan validation run 41 they ran 1.28-1.30x their price at 8-32 rows against 0.94-1.16x for
    its decode-only steps, and one ratio over both (1.077) priced the light load's 1-row steps ~10% high;
    rejudged with the term, runs 38-41's split light-load TPOT p50 came out 3-8 points closer."""
    is_prefill = attributed["trace"].isin(list(prefill_traces)).to_numpy(bool)
    decode_traces = set(attributed["trace"][~is_prefill])
    beside_decode = peer_busy(attributed, decode_traces)  # for the prefill workers' steps
    beside_prefill = peer_busy(attributed, prefill_traces)  # for the decode workers'
    ok = (attributed["predicted"] > 0).to_numpy(bool)
    pre, dec = is_prefill & ok, ~is_prefill & ok
    chunk = (~attributed["decode_only"]).to_numpy(float)
    p_alone, p_peer = _ratio_fit(attributed[pre], beside_decode[pre])
    d_alone, d_peer, d_chunk = _ratio_fit(attributed[dec], beside_prefill[dec], chunk[dec])
    return SplitRatioFit((p_alone, p_peer), (d_alone, d_peer), d_chunk, int(pre.sum()), int(dec.sum()),
                         float(beside_decode[pre].mean()) if pre.any() else 0.0,
                         float(beside_prefill[dec].mean()) if dec.any() else 0.0)


def refit_cost(profile: Profile, df: pd.DataFrame) -> tuple[Profile, str]:
    """The profile's linear step cost fitted again to its own timed steps and the trace's served ones
    together (each served step: its rows and `engine` time). A separate profiling process prices the steps
    of the CPU's state at that moment; the served steps are the server's own at the runs being calibrated
    (on the 2-core Xeon with 480 MiB of shared L3 a profiled 1-row step took 8.6 ms where the server's
    took 5.2, docs/benchmarks.md, plan validation run 12). The profile's samples keep what the served
    steps do not reach (long contexts, many rows, long prompts) in the fit. Returns the profile with the
    new cost and a line saying what the fit used; an analytic profile (no timed steps) comes back as it
    is."""
    samples = profile.fit.get("samples") if isinstance(profile.cost, LinearStepCost) else None
    if not samples:
        return profile, "no timed steps in the profile: its cost is kept"
    kept = profile.fit.get("kept") or [True] * len(samples)
    own = [([tuple(r) for r in rows], float(t)) for (rows, t), k in zip(samples, kept) if k]
    served = [(rows, float(t)) for rows, t in zip(df["rows_parsed"], df["engine"]) if rows and t > 0]
    cost, keep = LinearStepCost.fit_robust(own + served)
    left = len(keep) - sum(keep)
    return (replace(profile, cost=cost),
            f"cost refitted on {len(own)} profiled + {len(served)} served steps ({left} left out as slowed)")


def bucket_table(attributed: pd.DataFrame) -> pd.DataFrame:
    """Medians per (decode-only or with a chunk, rows bucket), milliseconds: predicted, engine, served,
    inside, outside."""
    df = attributed.copy()
    df["bucket"] = [next((b for b in ROW_BUCKETS if n <= b), ROW_BUCKETS[-1]) for n in df["num_rows"]]
    df["kind"] = np.where(df["decode_only"], "decode", "with chunk")
    g = df.groupby(["kind", "bucket"])
    table = g[["predicted", "engine", "served", "inside", "outside"]].median() * 1e3
    table.insert(0, "steps", g.size())
    return table.round(2)
