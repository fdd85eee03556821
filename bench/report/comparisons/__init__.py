"""One renderer per benchmark, in the page's order. A new benchmark adds a module here and a line below."""

from __future__ import annotations

from bench.report.comparisons import (
    engine,
    goodput,
    handoff,
    interference,
    kv_dtype,
    kv_reservation,
    overhead,
    prefix_cache,
    routing,
    side_by_side,
)
from bench.report.model import Comparison

COMPARISONS: tuple[Comparison, ...] = (
    side_by_side.COMPARISON,
    goodput.COMPARISON,
    engine.COMPARISON,
    interference.COMPARISON,
    prefix_cache.COMPARISON,
    kv_reservation.COMPARISON,
    handoff.COMPARISON,
    kv_dtype.COMPARISON,
    routing.COMPARISON,
    overhead.COMPARISON,
)


def claimed(name: str) -> bool:
    """Whether some comparison renders the result file `name` (its stem)."""
    return any(comparison.claims(name) for comparison in COMPARISONS)
