"""The step policy: everything that decides, step by step, when an engine's work runs and how much of
it, in one object. docs/scheduling.md explains each decision and the measurements behind it.

Before each step it answers, from what it has seen of recent steps and streams:
1. Which prompt goes first, and how many prompts share the step: the fewest tokens left first
   (`ShortestFirst`, asked by the scheduler).
2. How many prompt tokens the step may take beside running decodes: as many as keep it within the
   inter-token target (`StepBudget`, fitted to the steps' measured times).
3. Whether a prompt that cap holds back takes a whole step anyway, where every stream can take the
   one late gap this makes under a percentile target (`takes_whole_step`; the streams' late gaps
   are counted by one `LateGapLedger`).
4. On a decode worker that shares its cores with a prefill worker: how long to lend the cores before
   the step, so that its token comes just by the target (`StepPacer`), or whether to pause every
   stream once for a long prompt beside it (`before_step`, on the same ledger).
Its inputs are the latency targets, the device, each step's work and time (`observe_step`), each
step's outputs (`stepped`), the streams the engine holds and whether the neighbour has work.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

from shared.engine.policy.late_gaps import LateGapLedger, StepOutput
from shared.engine.policy.pacing import StepPacer
from shared.engine.policy.prompt_order import ShortestFirst
from shared.engine.policy.step_cost import StepBudget, StepTimes
from shared.engine.request import Request
from shared.settings import LatencyTargetSettings

# A prompt that has kept the cores busy this share of the TTFT target gets a pause or a whole step
# even where that leaves the streams no late gap to spare: prefilled on the cores paced decode
# leaves (about 60% of its speed alone on 2 cores), a prompt misses its target from 60% of it on,
# and with a pause from a quarter of the target on, it meets it up to 90%; a shorter one ends
# before the pause and leaves the streams' late gaps to the next long one.
PAUSE_AFTER_TTFT_SHARE = 0.25
# late gaps each stream must still afford after a pause that starts as soon as a prompt does: kept
# for a long prompt, which misses its target without a pause where a short one only comes later
KEPT_FOR_LONG_PROMPTS = 1


@dataclass(frozen=True, slots=True)
class Lend:
    """Lend the cores to the neighbour before the step: until `deadline_s` on the policy's clock for
    a paced step (`paused` empty), or for `seconds` from when the lend took effect for a pause of the
    streams `paused`."""

    seconds: float
    deadline_s: float
    paused: frozenset[str] = frozenset()

    @property
    def is_pause(self) -> bool:
        return bool(self.paused)


class StepPolicy:
    """See the module's docstring. An engine makes one (`Engine.policy`); a worker turns on the parts
    its role uses: `stall_for_prompts` (colocated, and decode for follow-up turns), `pace` (a decode
    worker on a core lease)."""

    def __init__(self, targets: LatencyTargetSettings | None, device_type: str, max_num_batched_tokens: int,
                 chunked_prefill: bool = True) -> None:
        self.targets = targets
        # how long a prompt has kept the cores busy before it may spend the streams' last spare late gap
        self.pause_after_s = PAUSE_AFTER_TTFT_SHARE * targets.ttft_ms / 1000 if targets is not None else 0.0
        # without chunks a prompt wider than the cap could only wait for the decodes to end
        self.budget = StepBudget(targets.itl_ms / 1000) if targets is not None and chunked_prefill else None
        # every step's work and time, fitted for the budget and for how many prompts share a step
        self.step_times: StepTimes = self.budget if self.budget is not None else StepTimes()
        self.order = ShortestFirst.for_device(device_type, max_num_batched_tokens, self.step_times)
        self._ledger: LateGapLedger | None = None
        self._whole_steps = False
        self._pacer: StepPacer | None = None
        self._max_pause_s = 0.0
        self._neighbour_busy_since: float | None = None
        self.num_pauses = 0  # pauses of the streams for a neighbour's prompt, and whole steps for the engine's

    # -- the engine's questions ----------------------------------------------------------------

    def prompt_cap(self, num_decoding: int, context: int) -> int | None:
        """Prompt tokens a step beside `num_decoding` decodes may take, its first prompt continuing
        `context` tokens in; None: no cap (nothing decodes, or no inter-token target)."""
        if self.budget is None or not num_decoding:
            return None
        return self.budget.prompt_tokens(num_decoding, context)

    def observe_step(self, num_tokens: int, attention_pairs: float, seconds: float) -> None:
        self.step_times.observe(num_tokens, attention_pairs, seconds)

    def takes_whole_step(self, prompt: Request, waited_s: float, streams: Mapping[str, int]) -> bool:
        """Whether `prompt`, which the cap holds back and has waited `waited_s`, takes a whole step beside
        `streams` (each with its sure output tokens, 0 where unknown); if so the ledger counts their
        next gaps as its. The streams' tokens ride in the prompt's step, so unlike a pause they cost
        little more than the prompt alone."""
        if not self._whole_steps or not self._affords(streams, waited_s):
            return False
        assert self._ledger is not None
        self._ledger.pausing(streams)
        self.num_pauses += 1
        return True

    # -- the roles ---------------------------------------------------------------------------

    def stall_for_prompts(self, first_token_seen: bool) -> bool:
        """Let a prompt the cap holds back take a whole step where the streams afford it (3. above);
        False where the target holds every gap or steps are not fitted to it. `first_token_seen`:
        every stream's first token is this engine's (colocated), so no gap before it goes unseen."""
        if self.targets is None or self.targets.itl_percentile == 100 or self.budget is None:
            return False
        self._ledger_for(first_token_seen)
        self._whole_steps = True
        return True

    def pace(self, max_pause_s: float) -> None:
        """Pace steps to the inter-token target while a neighbour has work, and below the 100th
        percentile also pause the streams for up to `max_pause_s` (4. above)."""
        assert self.targets is not None, "pacing needs the latency targets"
        self._pacer = StepPacer(self.targets.itl_ms / 1000)
        if self.targets.itl_percentile < 100 and max_pause_s > 0:
            self._ledger_for(first_token_seen=False)
            self._max_pause_s = max_pause_s

    @property
    def is_paced(self) -> bool:
        return self._pacer is not None

    @property
    def pauses_streams(self) -> bool:
        return self._max_pause_s > 0

    @property
    def paced_steps(self) -> tuple[int, int]:
        """(steps the pacer planned, those of them whose tokens came later than the target)."""
        pacer = self._pacer
        return (0, 0) if pacer is None else (pacer.paced_steps, pacer.late_paced_steps)

    # -- the worker's questions and reports ----------------------------------------------------

    def before_step(self, now: float, neighbour_has_work: bool, held: Mapping[str, int]) -> Lend | None:
        """How long to lend the cores before the next step (None: step now). `held`: the engine's
        requests with their sure output tokens."""
        if self._pacer is None:
            return None
        if not neighbour_has_work:
            self._neighbour_busy_since = None
            return None
        if self._neighbour_busy_since is None:
            self._neighbour_busy_since = now
        if self.pauses_streams and self._affords(held, now - self._neighbour_busy_since):
            assert self._ledger is not None
            paused = frozenset(held)
            self._ledger.pausing(paused)
            self.num_pauses += 1
            return Lend(self._max_pause_s, now + self._max_pause_s, paused)
        pause = self._pacer.pause_s(now)
        if not pause:
            return None
        self._pacer.lent()
        return Lend(pause, now + pause)

    def pause_goes_on(self, held: Mapping[str, int], paused: Set[str]) -> bool:
        """Whether a pause of the streams `paused` goes on now that the engine holds `held`: each
        request committed since must afford it as its first gap."""
        assert self._ledger is not None
        return all(self._ledger.stream_affords_a_pause(r, sure) for r, sure in held.items() if r not in paused)

    def woke(self, now: float) -> None:
        """A step is asked for: from here, calls queued ahead of it delay its tokens too."""
        if self._pacer is not None:
            self._pacer.woke(now)

    def stepped(self, now: float, outputs: Sequence[StepOutput]) -> None:
        """A step that computed something ended at `now` with `outputs`."""
        if self._pacer is not None:
            self._pacer.stepped(now)
        if self._ledger is not None:
            self._ledger.stepped(now, outputs)

    # -- internals ---------------------------------------------------------------------------

    def _ledger_for(self, first_token_seen: bool) -> LateGapLedger:
        """The one ledger of late gaps, whatever spends them: made by the first role that needs it."""
        if self._ledger is None:
            assert self.targets is not None
            self._ledger = LateGapLedger(self.targets.itl_ms / 1000, self.targets.itl_percentile, first_token_seen)
        return self._ledger

    def _affords(self, streams: Mapping[str, int], waited_s: float) -> bool:
        """Whether every stream can take one more late gap for a prompt that has kept the cores busy
        `waited_s`, and, until that reaches `pause_after_s`, KEPT_FOR_LONG_PROMPTS more after it."""
        assert self._ledger is not None
        kept = 0 if waited_s >= self.pause_after_s else KEPT_FOR_LONG_PROMPTS
        return self._ledger.affords_a_pause(streams, kept)
