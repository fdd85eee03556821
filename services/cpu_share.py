"""Sizes a CPU worker's torch threads, between engine steps, to the cores other processes leave free.

Workers that share a host's cores (`make run`, one compose stack) otherwise choose between two
losses: a fixed share of the cores leaves the decode worker on one core for the long tail of a
burst after prefill went quiet, and a full set oversubscribes while both are busy, where an
OpenMP team with one thread descheduled stalls at every barrier. So a worker may run up to
`max_threads`, and every `interval_s` it reads how busy the CPUs it may run on were (/proc/stat),
takes off what its own process used, and keeps as many threads as the rest leaves cores for,
at least one. Two such workers that are both busy settle at one core each.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

USER_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# /proc/stat columns after the name: user nice system idle iowait irq softirq steal ...; busy
# time is all but idle, iowait and steal (time the hypervisor gave to someone else)
BUSY_COLUMNS = (0, 1, 2, 5, 6)
# a core counts as free while others use less than this much of it: the gateway, Redis and
# the client take a little of the cores all the time
FREE_MARGIN = 0.25


def busy_seconds(cpus: set[int], stat_path: str = "/proc/stat") -> float:
    """CPU seconds the given CPUs have spent busy since boot, by every process."""
    total = 0
    with open(stat_path) as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                total += sum(int(fields[i]) for i in BUSY_COLUMNS)
    return total / USER_HZ


class ElasticThreads:
    """Call `adjust()` on the engine thread between steps; it changes torch's threads there (the
    C kernels follow, as they run on torch's OpenMP threads) and returns the new count when it
    changed one."""

    def __init__(
        self,
        max_threads: int,
        cpus: set[int] | None = None,
        interval_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        read_busy: Callable[[set[int]], float] = busy_seconds,
        read_own: Callable[[], float] = time.process_time,
    ) -> None:
        self.cpus = cpus if cpus is not None else os.sched_getaffinity(0)
        self.max_threads = max(1, min(max_threads, len(self.cpus)))
        self.threads = self.max_threads
        self._interval_s = interval_s
        self._clock, self._read_busy, self._read_own = clock, read_busy, read_own
        self._last = self._sample()

    def _sample(self) -> tuple[float, float, float]:
        return self._clock(), self._read_busy(self.cpus), self._read_own()

    def others_busy(self) -> float | None:
        """Cores' worth of time other processes took on our CPUs since the last sample, once
        `interval_s` has passed (then a new interval starts); None before."""
        now = self._sample()
        elapsed = now[0] - self._last[0]
        if elapsed < self._interval_s:
            return None
        others = (now[1] - self._last[1]) - (now[2] - self._last[2])
        self._last = now
        return max(0.0, others / elapsed)

    def adjust(self) -> int | None:
        others = self.others_busy()
        if others is None:
            return None
        wanted = min(self.max_threads, max(1, math.floor(len(self.cpus) - others + FREE_MARGIN)))
        if wanted == self.threads:
            return None
        logger.debug("torch threads %d -> %d (other processes used %.2f of %d cores)",
                     self.threads, wanted, others, len(self.cpus))  # fmt: skip
        self.threads = wanted
        torch.set_num_threads(wanted)
        return wanted
