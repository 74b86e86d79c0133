"""Plots (matplotlib, PNG) and one self-contained HTML page for a `plan simulate` sweep: p99 TTFT and p99
TPOT against request rate, one line per fleet, each fleet's knee marked (the bench lab's definition,
tokenloom/bench/stats.py `knee`, over output throughput and p95 end-to-end latency)."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from tokenloom.bench.stats import SweepPoint, knee  # noqa: E402

COLUMNS = ["fleet", "rate", "completed", "failed", "request_throughput", "output_throughput", "goodput",
           "ttft_s_median", "ttft_s_p99", "tpot_s_median", "tpot_s_p99", "e2el_s_p99", "queue_mean", "queue_max",
           "kv_usage_max", "prefix_hit_rate", "preemptions"]


def fleet_name(workers: int, prefill_workers: int) -> str:
    if prefill_workers:
        return f"{prefill_workers}P+{workers}D"
    return f"{workers} worker" + ("s" if workers > 1 else "")


def knees(points: list[dict[str, Any]], efficiency: float = 0.5) -> dict[str, float | None]:
    """Each fleet's knee over its rate sweep."""
    out: dict[str, float | None] = {}
    for name in dict.fromkeys(p["fleet"] for p in points):
        sweep = [SweepPoint(p["rate"], p["output_throughput"], p["e2el_s_p95"]) for p in points
                 if p["fleet"] == name and p["e2el_s_p95"] is not None]
        out[name] = knee(sweep, efficiency)
    return out


def plot_sweep(points: pd.DataFrame, knee_of: dict[str, float | None], path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, grp in points.groupby("fleet", sort=False):
        grp = grp.sort_values("rate")
        for ax, col in ((axes[0], "ttft_s_p99"), (axes[1], "tpot_s_p99")):
            line = ax.plot(grp["rate"], grp[col], "o-", label=name)[0]
            k = knee_of.get(str(name))
            if k is not None:
                y = grp[grp["rate"] == k][col]
                ax.plot([k], y, "*", ms=14, color=line.get_color())
    for ax, title in ((axes[0], "p99 time to first token, s"), (axes[1], "p99 time per output token, s")):
        ax.set_xlabel("request rate, req/s")
        ax.set_ylabel(title)
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.suptitle("Simulated tail latency against load (star: knee)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(out: Path, points: list[dict[str, Any]], meta: dict[str, Any]) -> Path:
    """summary.json, sweep.png and report.html in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    knee_of = knees(points)
    (out / "summary.json").write_text(json.dumps({"meta": meta, "points": points, "knee": knee_of}, indent=1))
    df = pd.DataFrame(points)
    plot_sweep(df, knee_of, out / "sweep.png")
    table = df[[c for c in COLUMNS if c in df]].to_html(index=False, float_format=lambda v: f"{v:.4g}")
    img = base64.b64encode((out / "sweep.png").read_bytes()).decode()
    doc = (f"<!doctype html><html><head><meta charset='utf-8'><title>tokenloom plan</title>"
           f"<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}"
           f"td,th{{border:1px solid #ccc;padding:3px 6px;font-size:13px}}</style></head><body>"
           f"<h1>Capacity plan: {html.escape(str(meta.get('model')))} ({html.escape(str(meta.get('source')))})</h1>"
           f"<p>Simulated with the engine's scheduler and block pool; step costs from {html.escape(str(meta.get('profile')))}. "
           f"Knees: {html.escape(json.dumps(knee_of))}.</p>"
           f"<img src='data:image/png;base64,{img}'/>{table}</body></html>")
    path = out / "report.html"
    path.write_text(doc)
    return path
