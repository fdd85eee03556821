"""OpenMP threads that sleep when a parallel region ends instead of spinning for the next one.

torch's CPU kernels and ours run on OpenMP thread pools, and by default libgomp's idle threads spin
for a while after every parallel region. A worker steps through dozens of regions a step, so its
spare threads spin most of the time between them, on cores that its neighbours (the other worker,
the gateway, Redis) need: on a 2-core Xeon, with a burst of 256 prompts through the stack on the
tiny model of `make bench-overhead`, the decode worker's second thread burned 105-130 µs of CPU per
output token spinning; with the threads sleeping it spent 54, and the stack served 4,000-4,300
output tokens/s before and 4,500-5,200 after (3 runs each, alternated).

libgomp reads its wait policy once, when it loads with torch, so a worker's entry point calls
`sleep_between_regions` before anything imports torch. An operator's own OMP_WAIT_POLICY or
GOMP_SPINCOUNT wins.
"""

from __future__ import annotations

import os
import sys

OPERATOR_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def sleep_between_regions() -> bool:
    """Sets OMP_WAIT_POLICY=PASSIVE for this process; False where the operator chose a policy.
    Raises RuntimeError once torch is loaded: the policy could no longer take effect."""
    if "torch" in sys.modules:
        raise RuntimeError("torch is already loaded, with OpenMP's wait policy read: call sleep_between_regions "
                           "before importing anything that imports torch")
    if any(name in os.environ for name in OPERATOR_SETTINGS):
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True
