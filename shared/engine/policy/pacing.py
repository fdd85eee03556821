"""When a decode worker that shares its cores with a prefill worker must start its next step.

On one host the two split the cores (services/runtime/core_lease.py), and a decode step that starts as soon
as the last one ended gives prompts only the cores decode leaves: on two cores, one. Yet a decode
step takes a fraction of the inter-token target. So while a neighbour prefills, the decode worker
lends it every core and starts its next step only when the next token is due: the last token's
time plus the target, less what recent steps took from waking to their tokens (the wait for a
neighbour to give its cores back at a layer boundary, then the step itself) and a slack for
jitter. Decode then uses only the share of the machine its target needs, and prefill the rest.
"""

from __future__ import annotations

from collections import deque

SLACK = 0.1  # of the target, kept in hand against jitter: tokens are due at 90% of it
MIN_PAUSE_S = 0.002  # shorter pauses only cost the neighbour's threads a resize


class StepPacer:
    """Clock times in, pause lengths out; `woke` when a step is asked for, `stepped` when it computed
    tokens, `pause_s` before asking for the next one, and `lent` once the cores were lent for it.

    It also counts the steps it planned (`paced_steps`) and those whose tokens still came later
    than the target after the step before (`late_paced_steps`): the step outran the longest of the
    recent ones by more than the slack. An operator reads there whether the gaps a client sees late
    were made late by the pacer (compare the gateway's gaps), not by the delivery of the tokens."""

    def __init__(self, itl_target_s: float, window: int = 16) -> None:
        if itl_target_s <= 0:
            raise ValueError(f"the inter-token target must be positive, got {itl_target_s} s")
        self.itl_target_s = itl_target_s
        self._to_token_s: deque[float] = deque(maxlen=window)  # recent steps, waking to their tokens
        self._woke_at: float | None = None
        self._token_at: float | None = None
        self._planned = False  # the next step's start was set by pause_s
        self.paced_steps = 0
        self.late_paced_steps = 0

    def woke(self, now: float) -> None:
        self._woke_at = now

    def lent(self) -> None:
        """The cores were lent for the pause `pause_s` gave: the next step is one this pacer planned."""
        self._planned = True

    def stepped(self, now: float) -> None:
        if self._woke_at is not None:
            self._to_token_s.append(now - self._woke_at)
        if self._planned and self._token_at is not None:
            self.paced_steps += 1
            self.late_paced_steps += now - self._token_at > self.itl_target_s
        self._token_at, self._woke_at, self._planned = now, None, False

    def pause_s(self, now: float) -> float:
        """How long to lend the cores before the next step (0: step now)."""
        if self._token_at is None or not self._to_token_s:
            return 0.0
        due = self._token_at + (1 - SLACK) * self.itl_target_s - max(self._to_token_s)
        pause = due - now
        return pause if pause >= MIN_PAUSE_S else 0.0
