"""Where an engine's steps spend their time, phase by phase, counted on every step.

A step reads the clock once per phase boundary (about 0.1 us each), so the counters stay on in
production: the workers export them (`llmd_engine_phase_seconds_total`), and `make
bench-overhead` divides them by steps and output tokens. Unlike a profiler range, they cost
nothing worth measuring, and unlike a one-off py-spy they are there when an operator asks.
On CUDA the phases are the host's time: "forward" is launching the kernels (or replaying a
graph), and the device's time shows up where the host waits for it (sampling's copy back).
"""

from __future__ import annotations

import time

SCHEDULE = "schedule"  # which requests run, and how many tokens each
PREPARE = "prepare"  # the step's input tensors
FORWARD = "forward"  # the model's layers
LOGITS = "logits"  # the LM head over the rows that sample
SAMPLE = "sample"  # penalties, filters, the next tokens, back on the host
UPDATE = "update"  # the requests' state: tokens appended, blocks cached, finished ones freed
OUTPUTS = "outputs"  # what the step returns to its caller
PHASES = (SCHEDULE, PREPARE, FORWARD, LOGITS, SAMPLE, UPDATE, OUTPUTS)


class StepPhases:
    """Seconds spent in each phase since the engine started; written by the engine's thread only."""

    __slots__ = ("seconds", "_mark")

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._mark = 0.0

    def start(self) -> None:
        self._mark = time.perf_counter()

    def lap(self, phase: str) -> None:
        """The time since the last `start` or `lap` goes to `phase`."""
        now = time.perf_counter()
        self.seconds[phase] += now - self._mark
        self._mark = now
