"""Where a process's time goes, by phase, from the counters it keeps: every Prometheus series named
`*_phase_seconds_total` with a `phase` label (the engine's schedule, prepare, forward, logits,
sample, update, outputs; the gateway's Redis reads, SSE writes, detokenising, ...), read before and after a
run and divided by the run's output tokens and engine steps.

    before = read_phases(scrape_metrics(url))
    ... the run ...
    spent = read_phases(scrape_metrics(url)) - before     # PhaseCounters of the run alone
    rows = phase_rows("decode-0", spent, output_tokens)
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.engine.engine import Engine

PHASE_SUFFIX = "_phase_seconds_total"
# an engine's steps, by which a phase's seconds become milliseconds per step (shared/metrics.py)
STEP_SERIES = "llmd_engine_steps"
_PHASE_LABEL = re.compile(r'(?:^|,)phase="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True, slots=True)
class PhaseCounters:
    seconds: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    steps: float | None = None  # None: the process counts no steps

    def __sub__(self, before: PhaseCounters) -> PhaseCounters:
        seconds = {phase: value - before.seconds.get(phase, 0.0) for phase, value in self.seconds.items()}
        steps = None if self.steps is None else self.steps - (before.steps or 0.0)
        return PhaseCounters(seconds, steps)


def read_phases(samples: Mapping[str, float]) -> PhaseCounters:
    """The phase counters of one process's scraped series (`stack_harness.parse_metrics` keys);
    a phase's series of several label sets (models, workers) add up."""
    seconds: dict[str, float] = {}
    steps: float | None = None
    for key, value in samples.items():
        name, _, labels = key.partition("{")
        if name == STEP_SERIES:
            steps = (steps or 0.0) + value
        elif name.endswith(PHASE_SUFFIX):
            found = _PHASE_LABEL.search(labels.rstrip("}"))
            # a counter without a phase label is one phase, named by the counter
            phase = found.group(1) if found else name.removesuffix(PHASE_SUFFIX)
            seconds[phase] = seconds.get(phase, 0.0) + value
    return PhaseCounters(seconds, steps)


def engine_phases(engine: Engine) -> PhaseCounters:
    """An in-process engine's phase counters (shared/engine/step_phases.py) and its steps."""
    return PhaseCounters(dict(engine.phases.seconds), float(engine.num_steps))


def phase_rows(process: str, spent: PhaseCounters, output_tokens: int) -> list[dict[str, Any]]:
    """One row per phase: microseconds per output token, milliseconds per step (None without a
    step count) and the phase's share of the process's counted time."""
    total = sum(spent.seconds.values())
    return [
        {
            "process": process,
            "phase": phase,
            "seconds": seconds,
            "us_per_token": seconds * 1e6 / output_tokens if output_tokens else None,
            "ms_per_step": seconds * 1e3 / spent.steps if spent.steps else None,
            "share": seconds / total if total else None,
        }
        for phase, seconds in spent.seconds.items()
    ]
