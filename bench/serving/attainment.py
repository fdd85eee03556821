"""DistServe's measure of a server: the share of requests that meet both a time-to-first-token
and an inter-token target, and the goodput, the highest request rate at which a set share of
requests (90%) still meets both.

A request's inter-token latency is the 90th percentile of its own gaps between chunks by default
(`ItlMeasure` "p90"), or their mean ("mean", DistServe's TPOT). The p90 is the stricter of the two:
a stream that stalls for seconds once every ten tokens fails it, while its mean can still pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from bench.serving.client import RequestResult

ItlMeasure = Literal["p90", "mean"]
ITL_MEASURES: tuple[ItlMeasure, ...] = ("p90", "mean")
DEFAULT_SHARE = 0.9


@dataclass(slots=True, frozen=True)
class LatencyTargets:
    ttft_ms: float
    itl_ms: float
    itl_measure: ItlMeasure = "p90"

    def __post_init__(self) -> None:
        if self.ttft_ms <= 0 or self.itl_ms <= 0:
            raise ValueError(f"latency targets must be > 0 ms, got TTFT {self.ttft_ms} and ITL {self.itl_ms}")
        if self.itl_measure not in ITL_MEASURES:
            raise ValueError(f"itl_measure must be one of {ITL_MEASURES}, got {self.itl_measure!r}")

    def request_itl_ms(self, result: RequestResult) -> float | None:
        """The request's inter-token latency as this measure reads it; None without a gap (one chunk)."""
        gaps = result.itl_s
        if not gaps:
            return None
        value_s = float(np.percentile(gaps, 90)) if self.itl_measure == "p90" else float(np.mean(gaps))
        return value_s * 1000

    def meets_ttft(self, result: RequestResult) -> bool:
        return result.success and result.ttft_s is not None and result.ttft_s * 1000 <= self.ttft_ms

    def meets_itl(self, result: RequestResult) -> bool:
        """A failed request meets nothing; an answer of one chunk has no gap to miss."""
        if not result.success:
            return False
        itl_ms = self.request_itl_ms(result)
        return itl_ms is None or itl_ms <= self.itl_ms


@dataclass(slots=True, frozen=True)
class Miss:
    """One request that missed a target, with what explains it: when it was sent (s after the
    first), its lengths, its TTFT and its inter-token latency (ms; None where there was none)."""

    start_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    ttft_ms: float | None
    itl_ms: float | None
    error: str | None = None


@dataclass(slots=True, frozen=True)
class Attainment:
    """How the requests sent at one rate fared against the targets (shares in [0, 1]), the
    median TTFT and p99 gap between tokens of the requests that succeeded (None without any),
    and the requests that missed."""

    request_rate: float
    num_requests: int
    num_failed: int
    ttft: float
    itl: float
    both: float
    ttft_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    misses: tuple[Miss, ...] = ()


def attainment(request_rate: float, results: Sequence[RequestResult], targets: LatencyTargets) -> Attainment:
    if not results:
        raise ValueError(f"no results at {request_rate} req/s: attainment needs at least one request")
    n = len(results)
    meets = [(targets.meets_ttft(r), targets.meets_itl(r)) for r in results]
    ttfts = [r.ttft_s for r in results if r.success and r.ttft_s is not None]
    gaps = [gap for r in results if r.success for gap in r.itl_s]
    first_start = min(r.start_s for r in results)
    return Attainment(
        request_rate=request_rate,
        num_requests=n,
        num_failed=sum(not r.success for r in results),
        ttft=sum(t for t, _ in meets) / n,
        itl=sum(i for _, i in meets) / n,
        both=sum(t and i for t, i in meets) / n,
        ttft_p50_ms=1000 * float(np.percentile(ttfts, 50)) if ttfts else None,
        itl_p99_ms=1000 * float(np.percentile(gaps, 99)) if gaps else None,
        misses=tuple(_miss(r, targets, first_start) for r, (t, i) in zip(results, meets) if not (t and i)),
    )


def _miss(result: RequestResult, targets: LatencyTargets, first_start_s: float) -> Miss:
    ttft_s = result.ttft_s
    return Miss(start_s=result.start_s - first_start_s, num_prompt_tokens=result.num_prompt_tokens,
                num_output_tokens=result.num_output_tokens, ttft_ms=None if ttft_s is None else 1000 * ttft_s,
                itl_ms=targets.request_itl_ms(result), error=result.error)


def goodput(points: Sequence[Attainment], share: float = DEFAULT_SHARE) -> float | None:
    """The highest swept rate up to which every swept rate has at least `share` of its requests
    meeting both targets; None when even the lowest misses. A rate that passes above one that
    missed is noise, not capacity, so the sweep stops at the first miss."""
    best = None
    for point in sorted(points, key=lambda p: p.request_rate):
        if point.both < share:
            break
        best = point.request_rate
    return best
