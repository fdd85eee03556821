"""PNG plots of one run, drawn from the per-request records of its result document."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

PLOT_NAMES = ("itl_over_time.png", "ttft_hist.png", "latency_cdf.png")


def write_plots(records: list[dict[str, Any]], plot_dir: Path) -> list[Path]:
    """Write the plots of PLOT_NAMES for the successful requests; returns their paths."""
    plot_dir.mkdir(parents=True, exist_ok=True)
    done = [r for r in records if r["error"] is None]
    figures = (_itl_over_time(done), _ttft_hist(done), _latency_cdf(done))
    paths = [plot_dir / name for name in PLOT_NAMES]
    for figure, path in zip(figures, paths, strict=True):
        figure.savefig(path, dpi=120)
    return paths


def _itl_over_time(records: list[dict[str, Any]]) -> Figure:
    fig = Figure(figsize=(8, 4), layout="constrained")
    ax = fig.subplots()
    # a chunk arrives at send + ttft + the gaps before it
    arrivals_s = [r["start_s"] + r["ttft_s"] + np.cumsum(r["itl_s"]) for r in records]
    gaps_ms = [np.asarray(r["itl_s"]) * 1000 for r in records]
    if records:
        ax.scatter(np.concatenate(arrivals_s), np.concatenate(gaps_ms), s=2, color="tab:blue", alpha=0.4)
    ax.set(title="Inter-token latency over time", xlabel="time since start (s)", ylabel="ITL (ms)")
    return fig


def _ttft_hist(records: list[dict[str, Any]]) -> Figure:
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    ax.hist([r["ttft_s"] * 1000 for r in records], bins="auto", color="tab:orange")
    ax.set(title="Time to first token", xlabel="TTFT (ms)", ylabel="requests")
    return fig


def _latency_cdf(records: list[dict[str, Any]]) -> Figure:
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    for key, label in (("ttft_s", "TTFT"), ("latency_s", "end-to-end")):
        values_ms = np.sort([r[key] * 1000 for r in records])
        ax.step(values_ms, np.arange(1, len(values_ms) + 1) / max(len(values_ms), 1), where="post", label=label)
    ax.set(title="Latency CDF", xlabel="latency (ms)", ylabel="fraction of requests")
    ax.legend()
    return fig
