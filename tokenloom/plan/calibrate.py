"""`tokenloom plan calibrate`: fit the serving time a profile's engine steps leave out, from real runs.

A profile times `LLMEngine.step()` alone. A served request also pays for the async engine loop, the HTTP
layer's per-token stream (SSE framing, writes), a router hop, and a load generator sharing the machine.
That time recurs every step, and partly per streamed row, so it is modelled as overhead_step_s +
overhead_row_s x rows, added to each simulated step. Fit: for each measured `bench serve` point, the
replayed simulation without overhead gives its median TPOT and its mean running rows; the gap to the
measured median TPOT is regressed, non-negatively, on (1, rows). Calibrate on points you will not judge
the simulation by (e.g. concurrency 1 and 8), then compare at others.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from tokenloom.errors import ConfigError
from tokenloom.plan.cost_model import nnls
from tokenloom.plan.metrics import fleet_summary
from tokenloom.plan.profile_file import Profile
from tokenloom.plan.simulator import FleetConfig, simulate
from tokenloom.plan.workload import replay


def bench_points(folder: Path) -> list[tuple[dict[str, Any], Path]]:
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


def calibrate(profile: Profile, folders: list[Path], fleet: FleetConfig, seed: int = 0, rounds: int = 6) -> Profile:
    """Fixed-point fit: simulate every point with the current overheads; the measured median TPOT less the
    simulated one's engine part (simulated TPOT - a - b x its mean rows) is what a + b x rows must give;
    refit (a, b) >= 0 and repeat, since more overhead means more rows in flight."""
    points = [(p, trace) for folder in folders for p, trace in bench_points(folder) if p.get("tpot_s_median") is not None]
    if len(points) < 2:
        raise ConfigError("calibration needs at least two measured points with a TPOT (e.g. concurrency 1 and 8)")
    requests = [replay(trace, seed=seed) for _, trace in points]
    a = b = 0.0
    used: list[dict[str, Any]] = []
    for _ in range(rounds):
        cur = replace(profile, overhead_step_s=a, overhead_row_s=b)
        xs, ys, used = [], [], []
        for (point, _), reqs in zip(points, requests):
            s = fleet_summary(simulate(cur, fleet, reqs, seed))
            if s["tpot_s_median"] is None:
                continue
            rows = s["running_mean"]
            xs.append([1.0, rows])
            ys.append(point["tpot_s_median"] - (s["tpot_s_median"] - a - b * rows))
            used.append({"concurrency": point.get("concurrency"), "request_rate": point.get("request_rate"),
                         "measured_tpot_s": point["tpot_s_median"], "simulated_tpot_s": s["tpot_s_median"], "rows": rows})
        if len(xs) < 2:
            raise ConfigError("calibration needs at least two measured points the simulation gives a TPOT for")
        a, b = (float(v) for v in nnls(np.array(xs), np.array(ys)))
    return replace(profile, overhead_step_s=a, overhead_row_s=b,
                   calibration={"points": used, "folders": [str(f) for f in folders], "fleet_workers": fleet.workers})
