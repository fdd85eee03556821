"""OpenMP threads that spin only briefly when a parallel region ends, then sleep.

torch's CPU kernels and ours run on libgomp's thread pool, whose idle threads by default spin
300,000 times (about 8 ms on a 2-core Zen 4, where one spin takes 28 ns) before they sleep. Inside a
step the next region comes within tens of microseconds, and spinning saves each region a wake-up;
between steps, while the worker waits on Redis or a handoff, the spare threads burn those 8 ms on
cores that the other worker, the gateway and Redis need. On a 2-core Zen 4 the prefill worker's
second thread took as much CPU as its engine thread during a burst of 128-token prompts on the tiny
model of `make bench-overhead`.

So a worker spins SPIN_COUNT times (about 0.3 ms there): the gaps inside a step still spin, the
gaps between steps sleep. Alternated pairs of stacks on that machine (medians of 6 and 4 runs):
- tiny model, burst of 256: 4,552 -> 4,968 output tokens/s, CPU 340 -> 294 µs per token;
- SmolLM2-135M in bfloat16, chat-mix burst of 64: 223 -> 225 tokens/s, CPU 8,381 -> 7,885 µs per token.
Threads that sleep at once (OMP_WAIT_POLICY=PASSIVE) cost that model a fifth of its throughput on a
2-core Xeon: its 30 layers' regions then each wait for a wake-up.

libgomp reads the setting once, when it loads with torch, so a worker's entry point calls
`spin_briefly` before anything imports torch. An operator's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
"""

from __future__ import annotations

import os
import sys

SPIN_COUNT = 10_000
OPERATOR_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def spin_briefly() -> bool:
    """Sets GOMP_SPINCOUNT=SPIN_COUNT for this process; False where the operator chose a policy.
    Raises RuntimeError once torch is loaded: the setting could no longer take effect."""
    if "torch" in sys.modules:
        raise RuntimeError("torch is already loaded, with OpenMP's spin count read: call spin_briefly "
                           "before importing anything that imports torch")
    if any(name in os.environ for name in OPERATOR_SETTINGS):
        return False
    os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    return True
