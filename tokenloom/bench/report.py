"""Plots (matplotlib, PNG) and one self-contained HTML report for a `bench serve` results folder,
and `bench compare` for several folders side by side."""

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

COLUMNS = ["input_len", "concurrency", "request_rate", "completed", "failed", "output_throughput",
           "request_throughput", "ttft_s_median", "ttft_s_p99", "tpot_s_median", "tpot_s_p99", "itl_s_p95",
           "e2el_s_p95", "e2el_s_p99"]


def _load(folder: Path) -> tuple[dict[str, Any], pd.DataFrame, pd.DataFrame]:
    summary = json.loads((folder / "summary.json").read_text())
    points = pd.DataFrame(summary["points"])
    records = pd.read_csv(folder / "records.csv") if (folder / "records.csv").stat().st_size > 1 else pd.DataFrame()
    return summary, points, records


def plot_prompt_lengths(points: pd.DataFrame, records: pd.DataFrame, path: Path) -> None:
    """TTFT against prompt length, split into prefill (TTFT) and decode (the rest of the request)."""
    ok = records[records["success"]] if len(records) else records
    lens = sorted(points["input_len"].unique())
    low = ok[ok["concurrency"].fillna(0) == ok["concurrency"].fillna(0).min()] if len(ok) else ok
    prefill = [low[low["input_len"] == n]["ttft"].median() for n in lens]
    decode = [(low[low["input_len"] == n]["e2el"] - low[low["input_len"] == n]["ttft"]).median() for n in lens]
    fig, ax = plt.subplots(figsize=(7, 4))
    x = [str(n) for n in lens]
    ax.bar(x, prefill, label="prefill (time to first token)")
    ax.bar(x, decode, bottom=prefill, label="decode (first to last token)")
    if "server_prefill_s" in low and low["server_prefill_s"].notna().any():
        ax.plot(x, [low[low["input_len"] == n]["server_prefill_s"].median() for n in lens], "k^",
                label="server-reported prefill")
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("seconds (median request)")
    ax.set_title("Request time by prompt length")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_load_sweep(points: pd.DataFrame, knees: dict[str, Any], path: Path) -> None:
    """Throughput and p95/p99 latency against load, knee marked, one line per prompt length."""
    load_col = "concurrency" if points["concurrency"].notna().any() else "request_rate"
    fig, ax = plt.subplots(figsize=(7, 4))
    ax2 = ax.twinx()
    for n, grp in points.groupby("input_len"):
        grp = grp.sort_values(load_col)
        ax.plot(grp[load_col], grp["output_throughput"], "o-", label=f"throughput, prompt {n}")
        ax2.plot(grp[load_col], grp["e2el_s_p95"], "s--", alpha=0.7, label=f"p95 e2e, prompt {n}")
        ax2.plot(grp[load_col], grp["e2el_s_p99"], "x:", alpha=0.7, label=f"p99 e2e, prompt {n}")
        k = knees.get(str(n))
        if k is not None:
            ax.axvline(k, color="red", alpha=0.4)
            ax.annotate(f" knee {k:g} (prompt {n})", (k, ax.get_ylim()[0]), color="red", ha="left", va="bottom", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(load_col.replace("_", " "))
    ax.set_ylabel("output tokens/s")
    ax2.set_ylabel("end-to-end latency, s")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=7, loc="upper left")
    ax.set_title("Throughput and tail latency against load")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_distributions(records: pd.DataFrame, path: Path) -> None:
    ok = records[records["success"]] if len(records) else records
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, col, title in ((axes[0], "ttft", "time to first token"), (axes[1], "tpot", "time per output token")):
        vals = ok[col].dropna() * 1e3 if len(ok) else []
        ax.hist(vals, bins=30)
        ax.set_xlabel(f"{title}, ms")
        ax.set_ylabel("requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(folder: Path) -> Path:
    """PNG plots beside the records, and report.html that embeds them (no external files needed)."""
    summary, points, records = _load(folder)
    plots = {"prompt_lengths.png": "TTFT against prompt length (prefill and decode)",
             "load_sweep.png": "Throughput and p95/p99 latency against load (knee marked)",
             "distributions.png": "TTFT and TPOT distributions"}
    plot_prompt_lengths(points, records, folder / "prompt_lengths.png")
    plot_load_sweep(points, summary.get("knee", {}), folder / "load_sweep.png")
    plot_distributions(records, folder / "distributions.png")
    table = points[[c for c in COLUMNS if c in points]].to_html(index=False, float_format=lambda v: f"{v:.4g}")
    imgs = "".join(
        f"<h2>{html.escape(title)}</h2><img src='data:image/png;base64,"
        f"{base64.b64encode((folder / name).read_bytes()).decode()}'/>"
        for name, title in plots.items()
    )
    doc = (f"<!doctype html><html><head><meta charset='utf-8'><title>tokenloom bench</title>"
           f"<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}"
           f"td,th{{border:1px solid #ccc;padding:3px 6px;font-size:13px}}</style></head><body>"
           f"<h1>Benchmark: {html.escape(str(summary['model']))} via {html.escape(summary['backend'])}</h1>"
           f"<p>{html.escape(summary['base_url'])}. Knee by prompt length: {html.escape(json.dumps(summary.get('knee')))}"
           f" ({html.escape(summary.get('knee_definition', ''))}).</p>{table}{imgs}</body></html>")
    out = folder / "report.html"
    out.write_text(doc)
    return out


def compare(folders: list[Path], out: Path) -> str:
    """One table and one plot of several runs; returns the table as markdown."""
    out.mkdir(parents=True, exist_ok=True)
    frames = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for folder in folders:
        summary, points, _ = _load(folder)
        name = f"{folder.name} ({summary['model']})"
        points = points.assign(run=name)
        frames.append(points)
        load_col = "concurrency" if points["concurrency"].notna().any() else "request_rate"
        for n, grp in points.groupby("input_len"):
            grp = grp.sort_values(load_col)
            ax.plot(grp[load_col], grp["output_throughput"], "o-", label=f"{name}, prompt {n}")
    ax.set_xlabel("load")
    ax.set_ylabel("output tokens/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "compare.png", dpi=110)
    plt.close(fig)
    table = pd.concat(frames)[["run", *[c for c in COLUMNS if c in frames[0]]]]
    (out / "compare.csv").write_text(table.to_csv(index=False))
    md = table.to_markdown(index=False, floatfmt=".4g") if _has_tabulate() else table.to_string(index=False)
    (out / "compare.md").write_text(md + "\n")
    return md


def _has_tabulate() -> bool:
    try:
        import tabulate  # noqa: F401
    except ImportError:
        return False
    return True
