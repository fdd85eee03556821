"""Which streams a decode worker may pause once, for a prompt beside it, and still keep their target
(and, the same way, when a colocated engine may stall its streams for one of its own prompts).

Where the inter-token target is a percentile of each request's gaps (`targets.itl_percentile`
below 100, e.g. DistServe's p90) rather than a bound on every gap, a stream of 96 tokens meets a
p90 target with 9 of its 95 gaps late. A paced decode worker (services/pacing.py) still holds
every gap to the target, so a long prompt beside it is prefilled on the cores decode leaves
between its steps and can miss its TTFT target while the streams keep their late gaps unspent.
So the worker counts each stream's late gaps, and where every stream it holds can take one more
and still meet its percentile, it pauses them all once and gives the prompt every core until the
prompt is done: one late gap per stream, however long the pause. A stream whose first gap it did
not see (from the prefill worker's first token to its own first) counts that gap as late.
A stream whose length is sure (`ignore_eos`, or `min_tokens`: shared/engine/request.py) plans on
all of it instead of the gaps seen so far: one of 96 tokens may take 9 late gaps over its life, and
counted only as its gaps come it could take its first pause after 20 tokens, so under steady
arrivals some young stream nearly always forbade the pause. It keeps PLANNED_RESERVE of them for
gaps no pause caused (a step slowed by a neighbour's layer), and one more for each such gap it
has had: past the knee of the load they come often, and a stream that spent its late gaps on
pauses would miss on them.
A long prompt gets its pause once it has kept the neighbour busy a share of the TTFT target; any
prompt gets one at once where every stream could still take another late gap after it, so a
median prompt is not prefilled on the cores paced decode leaves (about 30% slower on 2 cores) while
the streams keep a late gap for the next long one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass

from shared.engine.engine import RequestOutput

# A prompt that has kept the neighbour busy this share of the TTFT target is paused for: prefilled
# on the cores paced decode leaves (about 60% of its speed alone on 2 cores), a prompt misses its
# target from 60% of it on, and with a pause from a quarter of the target on, it meets it up to 90%;
# a shorter one ends before the pause and leaves the streams' late gaps to the next long one (unless
# they have more to spare: KEPT_FOR_LONG_PROMPTS).
PAUSE_AFTER_TTFT_SHARE = 0.25
# late gaps each stream must still afford after a pause that starts as soon as a prompt does: kept
# for a long prompt, which misses its target without a pause where a short one only comes later
KEPT_FOR_LONG_PROMPTS = 1
# late gaps a stream that plans on its sure length keeps for ones no pause caused, beside one for
# each such gap it has had
PLANNED_RESERVE = 1


@dataclass(slots=True)
class _Stream:
    token_at: float
    gaps: int  # with the unseen first gap, from the prefill worker's token to this worker's first, if any
    late: int  # ... counted late
    unplanned: int = 0  # late gaps no pause caused
    paused: bool = False  # its next gap is a pause's


def late_gaps_allowed(num_gaps: int, percentile: int) -> int:
    """The most of `num_gaps` gaps that may pass the target while their `percentile`-th percentile
    (linear interpolation, numpy's default) does not: the percentile falls between the sorted gaps
    at indices floor(h) and ceil(h), h = percentile/100 * (num_gaps - 1), so every gap up to index
    ceil(h) must be on time."""
    if num_gaps < 1:
        return 0
    on_time = -(-percentile * (num_gaps - 1) // 100) + 1  # ceil(h) + 1, in integers
    return num_gaps - on_time


class LateGapLedger:
    """Tokens in (`tokens`, from each step's outputs), whether every stream affords one more late
    gap out (`affords_a_pause`). `first_token_seen`: a stream's first token is this engine's own (a
    colocated one), so it has no gap before it; else it follows one this ledger did not see."""

    def __init__(self, itl_target_s: float, percentile: int, first_token_seen: bool = False) -> None:
        if not 0 < percentile <= 100:
            raise ValueError(f"the inter-token percentile must be in (0, 100], got {percentile}")
        self.itl_target_s = itl_target_s
        self.percentile = percentile
        self._unseen_gaps = 0 if first_token_seen else 1
        self._streams: dict[str, _Stream] = {}

    def tokens(self, now: float, req_ids: Iterable[str], finished: Iterable[str] = ()) -> None:
        """A step gave each of `req_ids` a token at `now`; `finished` ones are done."""
        for req_id in req_ids:
            stream = self._streams.get(req_id)
            if stream is None:
                self._streams[req_id] = _Stream(now, gaps=self._unseen_gaps, late=self._unseen_gaps)
                continue
            late = now - stream.token_at > self.itl_target_s
            stream.late += late
            stream.unplanned += late and not stream.paused
            stream.gaps += 1
            stream.token_at, stream.paused = now, False
        for req_id in finished:
            self._streams.pop(req_id, None)

    def stepped(self, now: float, outputs: Sequence[RequestOutput]) -> None:
        """A step's outputs, at `now`."""
        self.tokens(now, (o.req_id for o in outputs), (o.req_id for o in outputs if o.is_finished))

    def pausing(self, req_ids: Iterable[str]) -> None:
        """The streams `req_ids` are paused now: their next gap is the pause's."""
        for req_id in req_ids:
            stream = self._streams.get(req_id)
            if stream is not None:
                stream.paused = True

    def _late_gaps_allowed(self, num_gaps: int, sure_tokens: int, unplanned: int) -> int:
        """The late gaps a stream may have in all once it has `num_gaps`: planned on its sure length
        while that is longer (its first token is the prefill worker's), less PLANNED_RESERVE and one
        for each of its `unplanned` late gaps."""
        sure_gaps = sure_tokens - 1
        if sure_gaps > num_gaps:
            return late_gaps_allowed(sure_gaps, self.percentile) - PLANNED_RESERVE - unplanned
        return late_gaps_allowed(num_gaps, self.percentile)

    def affords_a_pause(self, held: Mapping[str, int], kept: int = 0) -> bool:
        """Whether each stream the engine holds (`held`: each request's sure output tokens, 0 where
        unknown) can take one more late gap, and `kept` more after it, and still meet its percentile.
        For a stream without a token from this worker yet the pause lengthens its first gap, which
        counts as late already. Forgets streams no longer held (aborted ones)."""
        for gone in self._streams.keys() - held.keys():
            del self._streams[gone]
        return bool(held) and all(self.stream_affords_a_pause(r, sure, kept) for r, sure in held.items())

    def stream_affords_a_pause(self, req_id: str, sure_tokens: int, kept: int = 0) -> bool:
        """`affords_a_pause` for one stream."""
        stream = self._streams.get(req_id)
        if stream is None:
            return 1 + kept <= self._late_gaps_allowed(1, sure_tokens, 0)
        return stream.late + 1 + kept <= self._late_gaps_allowed(stream.gaps + 1, sure_tokens, stream.unplanned)


def kept_after(waited_s: float, after_s: float) -> int:
    """The late gaps each stream must still afford after a pause for a prompt that has kept the
    cores busy `waited_s`: none once that reaches `after_s`, else KEPT_FOR_LONG_PROMPTS."""
    return 0 if waited_s >= after_s else KEPT_FOR_LONG_PROMPTS


class PromptPauses:
    """When a paced decode worker pauses its streams for a neighbour's prompt: at once where every
    stream affords a late gap and KEPT_FOR_LONG_PROMPTS more; else once the neighbour has been busy
    for `after_s` (a prompt that ends sooner meets its target without the pause, and a pause spent
    on it is one the next long prompt cannot have) and every stream affords a late gap; for at most
    `max_s`. A request committed meanwhile ends it unless the pause can be its first gap."""

    def __init__(self, ledger: LateGapLedger, after_s: float, max_s: float) -> None:
        self.ledger = ledger
        self.after_s = after_s
        self.max_s = max_s
        self._busy_since: float | None = None

    def started(self, paused: Iterable[str]) -> None:
        """A pause of the streams `paused` starts now."""
        self.ledger.pausing(paused)

    def neighbour(self, now: float, has_work: bool) -> None:
        """What the worker saw of its neighbour at `now`, as often as it looks (before each step)."""
        if not has_work:
            self._busy_since = None
        elif self._busy_since is None:
            self._busy_since = now

    def due(self, now: float, held: Mapping[str, int]) -> bool:
        """Whether to pause the streams `held` (as in `LateGapLedger.affords_a_pause`) now."""
        busy_since = self._busy_since
        if busy_since is None:
            return False
        return self.ledger.affords_a_pause(held, kept_after(now - busy_since, self.after_s))

    def goes_on(self, held: Mapping[str, int], paused: Set[str]) -> bool:
        """Whether a pause of the streams `paused` goes on now that the engine holds `held`: the
        streams committed since must each afford it as their first gap."""
        return all(self.ledger.stream_affords_a_pause(r, sure) for r, sure in held.items() if r not in paused)


class WholePromptSteps:
    """When an engine that prefills beside its own decodes (a colocated worker, or a decode worker
    prefilling a follow-up turn) lets the prompt its step budget holds back take a whole step
    (`Engine.step(stall_for=...)`): on the same rule and ledger as a decode worker's pauses,
    `after_s` counted from the prompt's arrival. The streams get their next token at that step's
    end, one late gap each, where the chunks the budget allows would give them none and the
    prompt its first token a step per chunk later. Unlike a pause, the streams' tokens ride in the
    prompt's step, so they cost little more than the prompt alone."""

    def __init__(self, ledger: LateGapLedger, after_s: float) -> None:
        self.ledger = ledger
        self.after_s = after_s

    def due(self, waited_s: float, streams: Mapping[str, int]) -> bool:
        """Whether to stall `streams` (the requests with a first token, each with its sure output
        tokens, 0 where unknown) for a held-back prompt that has waited `waited_s`; if so, the
        ledger counts their next gaps as the stall's."""
        if not self.ledger.affords_a_pause(streams, kept_after(waited_s, self.after_s)):
            return False
        self.ledger.pausing(streams)
        return True
