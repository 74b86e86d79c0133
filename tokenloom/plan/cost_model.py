"""What one engine step costs: a linear model over features of the scheduled batch, fitted by least squares.

A step is described by its rows, one per scheduled sequence: (num_new_tokens, num_computed_before). The
features are what dominates each phase of a CPU/GPU step:
- fixed: Python overhead of schedule + update, the launch of the forward, output handling (seconds/step);
- tokens: sum of num_new_tokens: the linear layers' matmuls grow with the rows of the flat batch;
- rows: scheduled sequences: sampling and per-sequence bookkeeping;
- decode_ctx: sum over decode rows (1 token) of the context they attend to: KV bytes read;
- prefill_pairs: sum over chunk rows of the (query, key) pairs of causal attention,
  n * (computed + (n + 1) / 2): quadratic in the chunk;
- has_chunk: 1 when any row is a chunk (n > 1): such a step leaves the fused decode path (on CPU a pure
  decode step runs the whole layer stack in one C++ call) for the general one, which costs more per step;
- chunk_rows: rows with n > 1: per-chunk work of the general path (metadata, per-sequence attention);
- fresh_pairs: the causal pairs n * (n + 1) / 2 of chunks that are their sequence's whole context (a fresh
  prompt, c = 0). On the CPU backend such a chunk attends over its fresh K/V with SDPA's flash kernel,
  a chunk that continues a cached context reads the cache through the paged prefill kernel
  (attention/cpu.py's routing rule), and the two cost differently per pair: two profiles of SmolLM2 on
  the 2-core EPYC put the fresh path at 1.5x and 1.7x the paged one. This is the extra over prefill_pairs.
- tokens_upto16, tokens_upto64: min(tokens, 16) and min(tokens, 64). With `tokens` they make the matmuls'
  cost a concave piecewise-linear function of the flat batch's rows, its slope falling at 16 and at 64: a
  batched matmul reads each weight once for all rows, so a row costs less the more rows share the read
  (one line through 1..128 rows priced 1-4-row steps high and 16-32-row steps low on the 2-core Xeon:
  served 1 / 8 / 16 / 32 / 64 / 128 rows took 5.2 / 14.2 / 26.1 / 42.2 / 66.7 / 96.1 ms, 1.3 ms a row up to
  16, 0.8 from 32 to 64, 0.45 past 64). Non-negative coefficients keep it non-decreasing.
- past_skinny: 1 when the flat batch has more than SKINNY_MAX_ROWS (kernels/limits.py) rows: the CPU
  kernels' few-row matmuls serve up to that many rows, a bigger batch goes to the tiles, which quantize x
  and fill the LM head's int8 panel first, a fixed cost a step. A step, not a slope: the embedded Q4_1
  SmolLM2's profiled decode steps on the 2-core EPYC took 17.9 ms at 8 rows and 22.5 at 9 (7 -> 8 rows:
  +1.7 ms). Without it the fit spread the jump over its neighbours: steps of 9-16 rows ran 1.08-1.14x
  their price and those of 1-8 rows 0.92-0.96x, in every set-up's served traces (plan validation run 38),
  and a split fleet's decode ratio, one constant over its steps' rows, priced its 1-2-row light-load steps
  by its 16-row calibration steps (its TPOT +22%). The kernels have since moved int4's hand-over to a
  crossover measured at start-up (the few-row kernel in panels, quant/routing.py), where both routes cost
  the same: a profile of that build fitted 1.29 ms here (3.76 before; what is left is the tied Q8_0 LM
  head's tiles from 7 rows). A CPU or build whose kernels change cost at the boundary gets the step priced.
So a lone prefill of n tokens costs fixed + has_chunk + rows + chunk_rows + n x tokens + quadratic terms
in n: its cost depends on the chunk size through a slope and a curve fitted from lone prefills of several
sizes (profile.py's grid), not through one constant.
step_time = coef . features, coefficients >= 0 (non-negative least squares, so no phase has a negative
cost that would make a bigger batch cheaper).

Profiles saved before fresh_pairs (FEATURES_V1), the two tokens_upto features (FEATURES_V2) or
past_skinny (FEATURES_V3) existed still load: their coefficients with 0 for the features they lack
predict exactly what they did.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.kernels.limits import SKINNY_MAX_ROWS

FEATURES = ("fixed", "tokens", "rows", "decode_ctx", "prefill_pairs", "has_chunk", "chunk_rows", "fresh_pairs",
            "tokens_upto16", "tokens_upto64", "past_skinny")
FEATURES_V1 = FEATURES[:7]  # profiles before fresh_pairs (2026-12-04)
FEATURES_V2 = FEATURES[:8]  # profiles before the tokens_upto features (2026-12-06)
FEATURES_V3 = FEATURES[:10]  # profiles before past_skinny (2026-12-07)
Row = tuple[int, int]  # (num_new_tokens, num_computed_tokens before the step)


class StepCost(Protocol):
    """Seconds one step of these rows takes."""

    def step_time(self, rows: Sequence[Row]) -> float: ...

    def to_json(self) -> dict[str, Any]: ...


def features(rows: Sequence[Row]) -> list[float]:
    """The FEATURES of one step (see the module docstring)."""
    tokens = sum(n for n, _ in rows)
    decode_ctx = sum(c + 1 for n, c in rows if n == 1)
    pairs = sum(n * (c + (n + 1) / 2) for n, c in rows if n > 1)
    chunks = sum(1 for n, _ in rows if n > 1)
    fresh = sum(n * (n + 1) / 2 for n, c in rows if n > 1 and c == 0)
    return [1.0, float(tokens), float(len(rows)), float(decode_ctx), float(pairs), float(chunks > 0), float(chunks),
            float(fresh), float(min(tokens, 16)), float(min(tokens, 64)), float(tokens > SKINNY_MAX_ROWS)]


def nnls(a: np.ndarray, b: np.ndarray, iters: int = 200) -> np.ndarray:
    """Non-negative least squares, min |a x - b| with x >= 0, by Lawson-Hanson's active set method.
    a: (m, k), b: (m,). Small k (11 features), so the plain algorithm is quick."""
    m, k = a.shape
    x = np.zeros(k)
    passive = np.zeros(k, dtype=bool)
    for _ in range(iters):
        w = a.T @ (b - a @ x)
        if passive.all() or (w[~passive] <= 1e-12 * max(1.0, np.abs(w).max())).all():
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(k)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
    return x


@dataclass(frozen=True)
class LinearStepCost:
    """step_time = coef . features(rows); coef in seconds per unit of each feature."""

    coef: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.coef) != len(FEATURES) or any(c < 0 or not np.isfinite(c) for c in self.coef):
            raise ConfigError(f"a linear step cost needs {len(FEATURES)} finite non-negative coefficients, "
                              f"got {self.coef!r}")

    def step_time(self, rows: Sequence[Row]) -> float:
        return float(np.dot(self.coef, features(rows)))

    @classmethod
    def fit(cls, samples: Sequence[tuple[Sequence[Row], float]]) -> LinearStepCost:
        """Fit to (rows, measured seconds) samples. Each sample is weighted by 1 / its time, so the fit
        minimises relative error: a 5 ms decode step matters as much as a 500 ms prefill."""
        if len(samples) < len(FEATURES):
            raise ConfigError(f"fitting a step cost needs at least {len(FEATURES)} timed steps, got {len(samples)}")
        a = np.array([features(rows) for rows, _ in samples])
        b = np.array([t for _, t in samples])
        if (b <= 0).any():
            raise ConfigError("a timed step took no time; the clock or the samples are wrong")
        w = 1.0 / b
        return cls(tuple(float(c) for c in nnls(a * w[:, None], b * w)))

    @classmethod
    def fit_robust(cls, samples: Sequence[tuple[Sequence[Row], float]], slow: float = 2.0,
                   rounds: int = 5) -> tuple[LinearStepCost, list[bool]]:
        """`fit`, then refit without the steps that took more than `slow` x the prediction, until none is
        left out anew. On a shared machine another process's burst only ever slows a step down (one-sided
        outliers); the mask (True: kept) says which samples the final fit used."""
        keep = [True] * len(samples)
        cost = cls.fit(samples)
        for _ in range(rounds):
            new = [t <= slow * cost.step_time(rows) for rows, t in samples]
            if new == keep or sum(new) < len(FEATURES):
                break
            keep = new
            cost = cls.fit([s for s, k in zip(samples, keep) if k])
        return cost, keep

    def to_json(self) -> dict[str, Any]:
        return {"kind": "linear", "features": list(FEATURES), "coef": list(self.coef)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LinearStepCost:
        names, coef = list(d.get("features", [])), [float(c) for c in d["coef"]]
        older = [list(v) for v in (FEATURES_V1, FEATURES_V2, FEATURES_V3)]
        if names in older and len(coef) == len(names):
            coef += [0.0] * (len(FEATURES) - len(names))  # the features it lacks cost nothing: same times
        elif names != list(FEATURES):
            raise ConfigError(f"profile's cost features {names!r} are neither {list(FEATURES)} nor an older set "
                              f"{older}: take the profile again with `tokenloom plan profile`")
        return cls(tuple(coef))


def relative_errors(cost: StepCost, samples: Sequence[tuple[Sequence[Row], float]]) -> list[float]:
    """|predicted - measured| / measured for each sample: the fit's quality, saved with the profile."""
    return [abs(cost.step_time(rows) - t) / t for rows, t in samples]
