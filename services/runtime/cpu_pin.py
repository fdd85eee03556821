"""Pinning a worker process to the CPUs an operator names (`LLMD_WORKER__CPUS`)."""

from __future__ import annotations

import contextlib
import logging
import os

from shared.settings import parse_cpu_list

logger = logging.getLogger(__name__)


class CpuPinError(ValueError):
    pass


def pin_to_cpus(cpus: str) -> None:
    """Run every thread of this process, and the threads they start, on the CPUs of `cpus` (the
    syntax of `WorkerSettings.cpus`); '' leaves the affinity alone."""
    wanted = parse_cpu_list(cpus)
    if not wanted:
        return
    available = os.sched_getaffinity(0)
    if not wanted <= available:
        raise CpuPinError(
            f"cpus {cpus!r} names CPUs {sorted(wanted - available)} this process may not run on; "
            f"available: {sorted(available)}"
        )
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), wanted)
    logger.info("pinned to CPUs %s", sorted(wanted))
