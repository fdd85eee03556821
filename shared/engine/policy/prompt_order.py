"""Which prompt a step serves first: the one with the fewest tokens left.

On a CPU a prefill step is bound by its arithmetic from a few dozen tokens on: a 1,024-token
prompt takes 2.1 s on two Zen 2 cores in float32 and a 64-token one 0.14 s, and the two in one
step take as long as both one after the other. Batching prompts then gains nothing, and a short
prompt that shares a step with a long one, or waits behind it, has its first token as late as the
long one's. Serving the prompt with the fewest tokens left first (shortest remaining processing
time, which minimises the mean wait of a single server) and letting a step take more prompts only
while they stay small beside the first, a short prompt waits at most for the step in flight.
On those cores, under Poisson arrivals of a chat mix (bench/goodput.py, TTFT target 2.5 s), this
order met the targets for 4-20 more requests in 100 than arrival order at 0.4-0.7 req/s in two
pairs of runs, and arrival order was never ahead by more than 3, within the runs' noise: so it is
the only order (docs/scheduling.md).

That holds where a step's fixed cost is small beside its tokens'. Where it is not (a small model, or
any model on a GPU), a step per prompt multiplies that cost: a 2-layer model of hidden size 64
prefilled one 128-token prompt a step, and 256 such prompts took 256 steps of about 3 ms each, where
batches of 4,096 tokens take 8. So on a CPU prompts share a step up to the tokens at which the
fitted fixed cost (shared/engine/policy/step_cost.py) is at most an eighth of the step, and never
fewer than CPU_BATCH_TOKENS. Steps all of one size tell the fit nothing: a prefill worker fed such
prompts one at a time stayed at one a step, 256 steps for 256 prompts with 15 of them waiting. So
where the recent steps all had one size, the next may take twice that, and the fit then decides.

A prompt that has waited MAX_PROMPT_WAIT_S goes ahead of shorter ones, in arrival order, so that long
prompts are not starved while short ones keep coming.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from shared.engine.policy.step_cost import StepTimes
from shared.engine.request import Request

# prompt tokens from which a CPU prefill step is bound by its arithmetic: 64 float32 tokens take
# 142 ms on two Zen 2 cores, of which about 11 ms does not grow with the tokens
CPU_BATCH_TOKENS = 64
# prompts share a step while its fixed cost is more than an eighth of it: up to 7 times as many tokens
# as cost what the fixed part does
AMORTIZING_TOKENS_PER_FIXED_COST = 7
# a prompt that has waited this long goes first: long enough that short prompts rarely wait behind
# it, short enough to bound a long prompt's wait under a stream of short ones
MAX_PROMPT_WAIT_S = 10.0


@dataclass(frozen=True, slots=True)
class ShortestFirst:
    """The prompts' order and the rule by which they share a step."""

    batch_tokens: int  # prompts share a step only while their tokens stay within this or the first one's share
    max_wait_s: float = MAX_PROMPT_WAIT_S
    # the steps' fitted cost, where it may raise `batch_tokens` up to `max_batch_tokens` (a CPU's)
    step_times: StepTimes | None = None
    max_batch_tokens: int = 0

    def __post_init__(self) -> None:
        if self.batch_tokens < 1:
            raise ValueError(f"batch_tokens must be at least 1, got {self.batch_tokens}")
        if self.max_wait_s <= 0:
            raise ValueError(f"max_wait_s must be positive, got {self.max_wait_s}")

    @classmethod
    def for_device(cls, device_type: str, max_num_batched_tokens: int, step_times: StepTimes) -> ShortestFirst:
        """On a CPU prompts share a step up to CPU_BATCH_TOKENS, or more where `step_times` finds the
        steps' fixed cost large; on a GPU, whose steps are not bound by their arithmetic until far more
        tokens, up to the step's whole budget."""
        if device_type != "cpu":
            return cls(max_num_batched_tokens)
        return cls(min(CPU_BATCH_TOKENS, max_num_batched_tokens), step_times=step_times,
                   max_batch_tokens=max_num_batched_tokens)

    def order(self, prompts: Iterable[Request], tokens_left: Callable[[Request], int], now: float) -> list[Request]:
        """Prompts that waited too long first, oldest first; then the fewest tokens left first,
        the oldest first among equals."""

        def key(req: Request) -> tuple[int, int, float]:
            if now - req.arrived_s >= self.max_wait_s:
                return (0, 0, req.arrived_s)
            return (1, tokens_left(req), req.arrived_s)

        return sorted(prompts, key=key)

    def step_prompt_tokens(self, first_share: int) -> int:
        """Prompt tokens a step may take in all, given what its first prompt takes."""
        return max(first_share, self.batch_tokens_now())

    def batch_tokens_now(self) -> int:
        """`batch_tokens`, raised where the recent steps' fixed cost would otherwise weigh more than an
        eighth of a step, or to twice the size of every recent step where they all had one size."""
        if self.step_times is None:
            return self.batch_tokens
        cost = self.step_times.cost()
        if cost is not None:
            return self._within_budget(AMORTIZING_TOKENS_PER_FIXED_COST * cost.fixed_s / cost.per_token_s)
        only_size = self.step_times.only_size()
        return self.batch_tokens if only_size is None else self._within_budget(2 * only_size)

    def _within_budget(self, tokens: float) -> int:
        return int(min(max(self.batch_tokens, tokens), max(self.max_batch_tokens, self.batch_tokens)))
