"""Turn metrics into the summary table and the JSON result document."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from bench.serving.client import RequestResult
from bench.serving.metrics import BenchmarkMetrics

WIDTH = 50
_TOTALS = (
    ("Successful requests", "num_completed", "{:d}"),
    ("Failed requests", "num_failed", "{:d}"),
    ("Benchmark duration (s)", "duration_s", "{:.2f}"),
    ("Total input tokens", "total_input_tokens", "{:d}"),
    ("Total generated tokens", "total_output_tokens", "{:d}"),
    ("Request throughput (req/s)", "request_throughput", "{:.2f}"),
    ("Output token throughput (tok/s)", "output_throughput", "{:.2f}"),
    ("Total token throughput (tok/s)", "total_token_throughput", "{:.2f}"),
    ("Request goodput (req/s)", "goodput", "{:.2f}"),
)
_LATENCIES = (
    ("TTFT", "ttft_ms", "Time to First Token"),
    ("TPOT", "tpot_ms", "Time per Output Token (excl. 1st token)"),
    ("ITL", "itl_ms", "Inter-token Latency"),
    ("E2EL", "e2el_ms", "End-to-end Latency"),
)

Row = tuple[str, str, str]  # (section title, label, formatted value)


def metric_rows(metrics: dict[str, Any]) -> list[Row]:
    """Rows of the summary, from `metrics` as stored in a result document."""
    rows: list[Row] = [
        ("", label, fmt.format(metrics[key])) for label, key, fmt in _TOTALS if metrics.get(key) is not None
    ]
    for short, key, title in _LATENCIES:
        dist = metrics.get(key)
        if dist is None:
            rows.append((title, f"{short} (ms)", "n/a"))
            continue
        stats = {"Mean": dist["mean"], "Median": dist["median"], "Std": dist["std"]}
        stats |= {name.upper(): value for name, value in dist["percentiles"].items()}
        rows += [(title, f"{stat} {short} (ms)", f"{value:.2f}") for stat, value in stats.items()]
    return rows


def format_summary(metrics: BenchmarkMetrics) -> str:
    lines = [_rule("Serving Benchmark Result", "=")]
    section = ""
    for title, label, value in metric_rows(dataclasses.asdict(metrics)):
        if title != section:
            lines.append(_rule(title, "-"))
            section = title
        lines.append(f"{label + ':':<40}{value:>10}")
    if metrics.failures:
        lines.append(_rule("Failures", "-"))
        lines += [f"{count:>6}  {message[:200]}" for message, count in metrics.failures.items()]
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def result_document(config: dict[str, Any], metrics: BenchmarkMetrics, results: list[RequestResult]) -> dict[str, Any]:
    """Everything a later reader needs: how the run was made, its metrics, and per-request
    measurements (seconds) from which the plots are drawn."""
    return {"config": config, "metrics": dataclasses.asdict(metrics), "requests": [request_record(r) for r in results]}


def request_record(result: RequestResult) -> dict[str, Any]:
    return {
        "start_s": result.start_s,
        "num_prompt_tokens": result.num_prompt_tokens,
        "num_output_tokens": result.num_output_tokens,
        "ttft_s": result.ttft_s,
        "latency_s": result.latency_s,
        "itl_s": result.itl_s,
        "error": result.error,
    }


def write_json(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")


def _rule(title: str, fill: str) -> str:
    return f" {title} ".center(WIDTH, fill)
