"""The ledger of each stream's late gaps, from which the step policy (policy.py) judges whether every
stream can take one more: for a paced decode worker's pause for a prompt beside it, or a whole step
for an engine's own held-back prompt.

Where the inter-token target is a percentile of each request's gaps (`targets.itl_percentile`
below 100, e.g. DistServe's p90) rather than a bound on every gap, a stream of 96 tokens meets a
p90 target with 9 of its 95 gaps late. A paced decode worker (pacing.py) still holds
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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

# late gaps a stream that plans on its sure length keeps for ones no pause caused, beside one for
# each such gap it has had
PLANNED_RESERVE = 1


class StepOutput(Protocol):
    """What the ledger reads of a step's output for one request (`RequestOutput`)."""

    @property
    def req_id(self) -> str: ...

    @property
    def is_finished(self) -> bool: ...


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

    def stepped(self, now: float, outputs: Sequence[StepOutput]) -> None:
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
