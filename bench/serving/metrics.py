"""Benchmark metrics with the definitions of `vllm bench serve`."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from bench.serving.client import RequestResult

SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass(slots=True, frozen=True)
class Distribution:
    """Summary of one latency metric, in milliseconds; percentiles keyed "p99", "p99.9"."""

    mean: float
    median: float
    std: float
    percentiles: dict[str, float]


@dataclass(slots=True, frozen=True)
class GoodputSLO:
    """Per-request limits in milliseconds; a request is good when it meets all that are set."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def is_met(self, result: RequestResult) -> bool:
        if not result.success:
            return False
        # vLLM counts TPOT as 0 for one-token outputs, so they always meet the TPOT limit.
        checks = ((self.ttft_ms, result.ttft_s), (self.tpot_ms, result.tpot_s), (self.e2el_ms, result.latency_s))
        return all(limit is None or (value_s or 0.0) * 1000 <= limit for limit, value_s in checks)


@dataclass(slots=True, frozen=True)
class BenchmarkMetrics:
    num_completed: int
    num_failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float | None
    ttft_ms: Distribution | None
    tpot_ms: Distribution | None
    itl_ms: Distribution | None
    e2el_ms: Distribution | None
    failures: dict[str, int]


def parse_goodput(items: list[str]) -> GoodputSLO:
    """`["ttft:200", "tpot:50"]` -> limits in ms; keys are ttft, tpot and e2el."""
    limits: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"goodput item {item!r} must be KEY:MS with KEY one of {', '.join(SLO_KEYS)}")
        ms = float(value)
        if ms < 0:
            raise ValueError(f"goodput limit {item!r} must be >= 0")
        limits[f"{key}_ms"] = ms
    return GoodputSLO(**limits)


def parse_percentiles(text: str) -> list[float]:
    """`"50,90,99"` -> [50.0, 90.0, 99.0], each in (0, 100]."""
    percentiles = [float(p) for p in text.split(",") if p.strip()]
    if not percentiles or any(not 0 < p <= 100 for p in percentiles):
        raise ValueError(f"percentiles {text!r} must be a comma-separated list of numbers in (0, 100]")
    return percentiles


def summarize(values_s: list[float], percentiles: list[float]) -> Distribution | None:
    """Seconds in, milliseconds out; None when there is nothing to summarise."""
    if not values_s:
        return None
    ms = np.asarray(values_s, dtype=np.float64) * 1000
    return Distribution(
        mean=float(ms.mean()),
        median=float(np.median(ms)),
        std=float(ms.std()),
        percentiles={f"p{p:g}": float(np.percentile(ms, p)) for p in percentiles},
    )


def compute_metrics(
    results: list[RequestResult], duration_s: float, percentiles: list[float], slo: GoodputSLO | None = None
) -> BenchmarkMetrics:
    """Throughputs count successful requests only and divide by the whole run's duration.
    ITL pools every gap between consecutive chunks of every successful request; TPOT is
    per request and skips one-token outputs."""
    assert duration_s > 0, "a benchmark run has a positive duration"
    done = [r for r in results if r.success]
    total_in = sum(r.num_prompt_tokens for r in done)
    total_out = sum(r.num_output_tokens for r in done)
    return BenchmarkMetrics(
        num_completed=len(done),
        num_failed=len(results) - len(done),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(done) / duration_s,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        goodput=None if slo is None else sum(slo.is_met(r) for r in done) / duration_s,
        ttft_ms=summarize([r.ttft_s for r in done if r.ttft_s is not None], percentiles),
        tpot_ms=summarize([r.tpot_s for r in done if r.tpot_s is not None], percentiles),
        itl_ms=summarize([gap for r in done for gap in r.itl_s], percentiles),
        e2el_ms=summarize([r.latency_s for r in done if r.latency_s is not None], percentiles),
        failures=dict(Counter(r.error for r in results if r.error is not None).most_common()),
    )
