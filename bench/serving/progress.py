"""A one-line status report of a running benchmark, written every interval."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from bench.serving.client import RequestResult


@dataclass(slots=True)
class ProgressTracker:
    num_total: int
    num_sent: int = 0
    num_done: int = 0
    num_failed: int = 0
    num_output_tokens: int = 0

    def on_sent(self) -> None:
        self.num_sent += 1

    def on_done(self, result: RequestResult) -> None:
        self.num_done += 1
        if result.success:
            self.num_output_tokens += result.num_output_tokens
        else:
            self.num_failed += 1

    def line(self, elapsed_s: float) -> str:
        running = self.num_sent - self.num_done
        tok_per_s = self.num_output_tokens / elapsed_s if elapsed_s > 0 else 0.0
        return (
            f"[{elapsed_s:7.1f}s] done {self.num_done}/{self.num_total}"
            f" failed {self.num_failed} running {running}"
            f" output tok/s (finished requests) {tok_per_s:.1f}"
        )


async def report_every(tracker: ProgressTracker, interval_s: float, now: Callable[[], float], stream: TextIO) -> None:
    """Write a status line every interval_s until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        print(tracker.line(now()), file=stream, flush=True)
