"""How many of its leased cores a CPU engine steps on: the count that measured fastest for steps of that size.

A team of OpenMP threads pays where each parallel region holds enough work and every thread of the
team gets a core. On a host whose cores the serving processes share, neither holds for a fast
model: the gateway, the workers' event loops and the client want the second core too, and an
OpenMP thread descheduled there stalls the team at every barrier, while between regions it spins
on the core they wanted. With a 2-layer model of hidden size 64 on 2 cores, the decode worker's
forward and LM head took 26 ms per 124-row step on 2 threads and 19 ms per 128-row step on 1, and
the stack served 2.6-3.2k tokens/s on 2 threads against 3.5-4.5k on 1. SmolLM2-135M on the same
host and burst ran 12% faster on 2 (202-212 against 185-187 tokens/s): its steps are matrix
products of megabytes of weights, and its gateway is almost idle.

No size rule tells the two apart (the tiny model's 128-row step has more arithmetic per layer than
the 135M model's one-row step), so the engine measures: each step's seconds per token go into a
moving average for its thread count and its size (steps of 1, 2-3, 4-7, ... tokens), and the
next step runs on the count with the lowest; until the most is measured, on every core the lease
gives. Every `EXPLORE_EVERY`th step of a size tries the count measured longest ago (one never
measured first), so the choice follows the load as it changes, and a short run (a few requests)
keeps the lease's cores.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EXPLORE_EVERY = 32
# weight of the newest step in a moving average
ALPHA = 0.25


@dataclass
class _SizeClass:
    seconds_per_token: dict[int, float] = field(default_factory=dict)
    measured_at: dict[int, int] = field(default_factory=dict)  # the step count of each count's last measure
    steps: int = 0


class StepThreads:
    """Chooses a step's thread cap (`choose`) from the seconds per token it was told (`observe`)."""

    def __init__(self, max_threads: int) -> None:
        # powers of two up to the most, and the most itself
        self.candidates = sorted({1 << i for i in range(max_threads.bit_length())} | {max_threads})
        self._sizes: dict[int, _SizeClass] = {}
        self._next_tokens = 1  # the size the next step is expected to have: the last one's

    def choose(self) -> int:
        """The most threads the next step should run on; its size is taken to be the last step's."""
        size = self._sizes.setdefault(self._next_tokens.bit_length(), _SizeClass())
        size.steps += 1
        if size.steps % EXPLORE_EVERY == 0:  # a count never measured first, the most threads before fewer
            return min(reversed(self.candidates), key=lambda n: size.measured_at.get(n, -1))
        # every core the lease gives, until they are measured: a neighbour's work may have held the
        # steps measured so far to fewer
        if self.candidates[-1] not in size.seconds_per_token:
            return self.candidates[-1]
        return min(size.seconds_per_token, key=lambda n: (size.seconds_per_token[n], n))

    def observe(self, threads: int, tokens: int, seconds: float) -> None:
        """A step of `tokens` tokens took `seconds` on `threads` threads throughout."""
        if tokens < 1 or threads not in self.candidates:
            return
        self._next_tokens = tokens
        size = self._sizes.setdefault(tokens.bit_length(), _SizeClass())
        per_token = seconds / tokens
        old = size.seconds_per_token.get(threads)
        size.seconds_per_token[threads] = per_token if old is None else old + ALPHA * (per_token - old)
        size.measured_at[threads] = size.steps
