"""How many prompt tokens a step may take while requests decode, so that it ends within the
inter-token target.

A step that carries a prompt's chunk beside running decodes delays each of their next tokens by
the chunk's time: on two Sapphire Rapids cores in bfloat16 a decode step of 8 requests takes
22 ms, with a 512-token chunk 190 ms and with a 2,040-token one 1.25 s. So while any request
decodes, a step takes only as many prompt tokens as fit in the target, less a slack against
jitter. Sarathi-Serve sizes its chunks to its inter-token target the same way, from an offline
profile; here the cost is fitted to the steps the engine ran, so it follows the machine, the
model and the cores a lease grants. A step's time is modelled as

    fixed + per_token * tokens + per_pair * (query, key) pairs of its prompts' attention

the last term because a chunk late in a long prompt attends to all that came before it (on that
machine the fourth 470-token chunk of a 2,040-token prompt took 250 ms, the first 140 ms). With
nothing decoding no stream waits, and prompts take the scheduler's whole budget.

The fit gives a step's mean time, and steps scatter about it: on a 2-core Zen 4 in bfloat16, under
Poisson arrivals of a chat mix at 1.5 req/s with an 86 ms target, steps aimed at the mean took
p50 / p90 / p99 76 / 82-85 / 91-94 ms (their residuals +-7 ms at p10 / p90), so 5-9% of them ran
past the target, and more of the gaps a client sees, which also hold the worker's time between
steps. So a step aims below the target by the OVERRUN_QUANTILE of the recent steps' residuals
too: there the steps took 71 / 79 / 90 ms, 2.6% past the target. Through a colocated stack at
1.5 req/s the requests meeting the p90 gap target went from 81% to 97-98%, and, the chunks being
smaller, those meeting the TTFT target from 86% to 63-76%, as many meeting both as without the
budget: the trade the inter-token target asks for (docs/scheduling.md).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

SLACK = 0.1  # of the target, kept in hand against jitter, as the decode worker's pacing keeps
# a prompt always advances, by at least a KV block, even where the decodes alone take the target:
# both targets cannot hold then, and a stalled prompt would only add its wait to the miss. No
# more than a block, as on a slow CPU more would itself break the target: 64 float32 tokens
# take 113 ms on two Zen 3 cores, beside an 87 ms target there
MIN_PROMPT_TOKENS = 16
# the first chunk beside decodes before two step sizes are known: a short stall even on that
# CPU, and one step only
PROBE_PROMPT_TOKENS = 64
WINDOW = 64  # steps the cost is fitted to: a few seconds of steps, so it follows a changed lease
REFIT_EVERY = 8  # steps between two fits once the window is full
# the share of recent steps that may run past their fitted time by more than a step aims below it
OVERRUN_QUANTILE = 0.9


@dataclass(frozen=True, slots=True)
class StepCost:
    """A step's time in seconds: fixed_s + per_token_s * tokens + per_pair_s * attention pairs."""

    fixed_s: float
    per_token_s: float
    per_pair_s: float

    def prompt_tokens_within(self, seconds: float, num_decoding: int, context: int) -> float:
        """Prompt tokens, continuing a prompt `context` tokens in, that a step beside `num_decoding`
        decodes can take in `seconds`: the root of per_pair/2 p^2 + (per_token + per_pair context) p = rest."""
        rest = seconds - self.fixed_s - self.per_token_s * num_decoding
        if rest <= 0:
            return 0.0
        linear = self.per_token_s + self.per_pair_s * context
        if self.per_pair_s == 0:
            return rest / linear
        return (math.sqrt(linear * linear + 2 * self.per_pair_s * rest) - linear) / self.per_pair_s


def attention_pairs(num_new_tokens: int, context: int) -> float:
    """(query, key) pairs of causal attention for `num_new_tokens` prompt tokens after `context` ones."""
    return num_new_tokens * (context + num_new_tokens / 2)


class StepTimes:
    """Steps' work and times in (`observe`), the cost fitted to the recent ones out (`cost`)."""

    def __init__(self, window: int = WINDOW) -> None:
        self._steps: deque[tuple[float, float, float]] = deque(maxlen=window)  # tokens, pairs, seconds
        self._fitted: tuple[StepCost, np.ndarray] | None = None
        self._fitted_at = -1  # steps observed when `_fitted` was fitted
        self._num_observed = 0

    def observe(self, num_tokens: int, pairs: float, seconds: float) -> None:
        """A step of `num_tokens` tokens whose prompts' attention spans `pairs` pairs took `seconds`."""
        self._steps.append((num_tokens, pairs, seconds))
        self._num_observed += 1

    def cost(self) -> StepCost | None:
        """The cost fitted by least squares to the recent steps; without the attention term where
        the steps cannot tell it apart or it comes out negative; None until the steps differ in size
        or where they say tokens cost nothing (noise alone)."""
        fit = self._fit()
        return None if fit is None else fit[0]

    def only_size(self) -> int | None:
        """The token count of every recent step where they all had one (so no fit can tell a step's
        fixed cost from its tokens'), else None."""
        sizes = {tokens for tokens, _, _ in self._steps}
        return int(sizes.pop()) if len(sizes) == 1 else None

    def overrun_s(self) -> float:
        """How far past its fitted time a step runs at the OVERRUN_QUANTILE of the recent steps (0
        until a cost is fitted, and never below 0)."""
        fit = self._fit()
        return 0.0 if fit is None else _overrun(fit[1])

    def _fit(self) -> tuple[StepCost, np.ndarray] | None:
        """The fitted cost and each recent step's time less what the cost gives it: fitted anew after
        each step until the window is full, then every REFIT_EVERY steps (a fit is a least-squares
        solve, 5% of a prefill worker's busy time when done every step, and a full window moves
        little in a few steps)."""
        since = self._num_observed - self._fitted_at
        if since and (self._fitted_at < 0 or since >= REFIT_EVERY or len(self._steps) < self._steps.maxlen):
            self._fitted, self._fitted_at = self._fit_now(), self._num_observed
        return self._fitted

    def _fit_now(self) -> tuple[StepCost, np.ndarray] | None:
        if len(self._steps) < 2:
            return None
        steps = np.array(self._steps)
        tokens, pairs, seconds = steps[:, 0], steps[:, 1], steps[:, 2]
        ones = np.ones_like(tokens)
        for features in ((ones, tokens, pairs), (ones, tokens)):
            design = np.stack(features, axis=1)
            coef, _, rank, _ = np.linalg.lstsq(design, seconds, rcond=None)
            if rank == design.shape[1] and (coef[1:] > 0).all():
                cost = StepCost(max(float(coef[0]), 0.0), float(coef[1]), float(coef[2]) if len(coef) == 3 else 0.0)
                return cost, seconds - design @ coef
        return None


class StepBudget(StepTimes):
    """`StepTimes` with an inter-token target: the prompt tokens the next step may take beside
    running decodes (`prompt_tokens`)."""

    def __init__(self, target_s: float, window: int = WINDOW) -> None:
        if target_s <= 0:
            raise ValueError(f"the step time target must be positive, got {target_s} s")
        super().__init__(window)
        self.target_s = target_s

    def prompt_tokens(self, num_decoding: int, context: int) -> int:
        """Prompt tokens a step beside `num_decoding` decodes may take to end within the target, its
        first prompt continuing `context` tokens in."""
        fit = self._fit()
        if fit is None:
            return PROBE_PROMPT_TOKENS
        cost, residuals = fit
        fits = cost.prompt_tokens_within((1 - SLACK) * self.target_s - _overrun(residuals), num_decoding, context)
        return max(int(fits), MIN_PROMPT_TOKENS)


def _overrun(residuals: np.ndarray) -> float:
    return max(float(np.quantile(residuals, OVERRUN_QUANTILE)), 0.0)
