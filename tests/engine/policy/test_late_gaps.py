"""LateGapLedger: whether every stream can take one more late gap and still meet its inter-token
percentile, as the goodput benchmark reads it (the policy's pauses and whole steps: test_policy.py)."""

from __future__ import annotations

import numpy as np
import pytest

from shared.engine.policy.late_gaps import PLANNED_RESERVE, LateGapLedger, late_gaps_allowed

TARGET_S = 0.1
ON_TIME_S, LATE_S = 0.08, 2.0
PAUSE_S = 1e6  # a pause's length is not known when it starts: the count must hold however long it is


@pytest.mark.parametrize("percentile", [50, 90, 99, 100])
def test_the_late_gaps_allowed_are_the_most_numpys_percentile_tolerates_however_late(percentile: int) -> None:
    for num_gaps in range(1, 120):
        allowed = late_gaps_allowed(num_gaps, percentile)
        for late in range(num_gaps + 1):
            gaps = [ON_TIME_S] * (num_gaps - late) + [PAUSE_S] * late
            meets = np.percentile(gaps, percentile) <= TARGET_S
            assert meets == (late <= allowed), (num_gaps, late, allowed)


def unknown(*req_ids: str) -> dict[str, int]:
    """Streams held whose length is not sure."""
    return dict.fromkeys(req_ids, 0)


def step(ledger: LateGapLedger, now: float, *req_ids: str) -> float:
    ledger.tokens(now, req_ids)
    return now + ON_TIME_S


def test_a_stream_affords_a_pause_once_its_on_time_gaps_cover_one_more_late_one() -> None:
    ledger = LateGapLedger(TARGET_S, 90)
    now = step(ledger, 0.0, "a")  # its first token here: the gap before it is counted late
    tokens = 1
    while not ledger.affords_a_pause(unknown("a")):
        now = step(ledger, now, "a")
        tokens += 1
    # 20 gaps (one late) and the pause's: 2 late of 21 keep the p90 on time, 2 of 20 would not
    assert tokens == 20
    ledger.tokens(now + LATE_S, ["a"])  # the pause: one late gap
    assert not ledger.affords_a_pause(unknown("a"))
    now += LATE_S + ON_TIME_S
    for _ in range(10):
        now = step(ledger, now, "a")
    assert ledger.affords_a_pause(unknown("a"))  # 31 gaps, 3 late with the next pause's


def test_a_stream_affords_a_pause_that_keeps_one_for_later_once_it_could_take_two() -> None:
    ledger = LateGapLedger(TARGET_S, 90)
    now, tokens = step(ledger, 0.0, "a"), 1
    while not ledger.affords_a_pause(unknown("a"), kept=1):
        now, tokens = step(ledger, now, "a"), tokens + 1
    # 30 gaps (one late) and the pause's: 3 late of 31 keep the p90 on time, so one more is left
    assert tokens == 30
    assert late_gaps_allowed(31, 90) == 3


def test_every_stream_held_must_afford_it_and_one_never_seen_cannot() -> None:
    ledger = LateGapLedger(TARGET_S, 90)
    now = 0.0
    for _ in range(25):
        now = step(ledger, now, "a")
    assert ledger.affords_a_pause(unknown("a"))
    assert not ledger.affords_a_pause(unknown("a", "new"))  # committed since the last step: no token seen yet
    assert not ledger.affords_a_pause({})  # no streams: nothing to pause
    now = step(ledger, now, "a", "b")
    assert not ledger.affords_a_pause(unknown("a", "b"))  # "b" has one gap, and it counts as late


def test_finished_and_aborted_streams_are_forgotten() -> None:
    ledger = LateGapLedger(TARGET_S, 90)
    now = 0.0
    for _ in range(25):
        now = step(ledger, now, "a", "b")
    ledger.tokens(now, ["a", "b"], finished=["a"])
    assert not ledger.affords_a_pause(unknown("a", "b"))  # "a" is new again to the ledger
    assert ledger.affords_a_pause(unknown("b"))
    assert not ledger.affords_a_pause(unknown("c"))  # "b" was aborted: forgotten, and "c" never seen
    assert not ledger.affords_a_pause(unknown("b"))


def test_at_the_100th_percentile_no_gap_may_be_late() -> None:
    ledger = LateGapLedger(TARGET_S, 100)
    now = 0.0
    for _ in range(500):
        now = step(ledger, now, "a")
    assert not ledger.affords_a_pause(unknown("a"))


@pytest.mark.parametrize("percentile", [0, 101])
def test_a_percentile_must_be_in_0_to_100(percentile: int) -> None:
    with pytest.raises(ValueError, match=f"must be in \\(0, 100\\], got {percentile}"):
        LateGapLedger(TARGET_S, percentile)


@pytest.mark.parametrize("num_tokens", [12, 21, 32, 96, 300])
def test_a_stream_of_sure_length_that_pauses_whenever_allowed_still_meets_its_p90(num_tokens: int) -> None:
    """From its first token from the decode worker on; its first gap late, as the ledger assumes."""
    ledger = LateGapLedger(TARGET_S, 90)
    held = {"a": num_tokens}
    gaps = [LATE_S]  # the first, paused for or not
    now = 0.0
    ledger.tokens(now, ["a"])
    for _ in range(num_tokens - 2):
        gap = ON_TIME_S
        if ledger.affords_a_pause(held):
            ledger.pausing(held)
            gap = LATE_S
        gaps.append(gap)
        now += gap
        ledger.tokens(now, ["a"])
    assert len(gaps) == num_tokens - 1
    assert np.percentile(gaps, 90) <= TARGET_S
    assert gaps.count(LATE_S) == late_gaps_allowed(num_tokens - 1, 90)  # the reserve goes at the last gap


def test_a_stream_of_sure_length_affords_a_pause_before_its_first_token_keeping_a_late_gap_in_reserve() -> None:
    ledger = LateGapLedger(TARGET_S, 90)
    assert late_gaps_allowed(95, 90) == 9
    assert ledger.affords_a_pause({"a": 96}, kept=7)  # 9, less the first gap's and PLANNED_RESERVE
    assert not ledger.affords_a_pause({"a": 96}, kept=8)
    assert PLANNED_RESERVE == 1
    assert not ledger.affords_a_pause({"a": 0})  # unplanned, it waits for 20 tokens (above)
    # 3 late gaps of 31: the first one's (the pause), one to keep and PLANNED_RESERVE
    assert ledger.affords_a_pause({"a": 32}, kept=1) and not ledger.affords_a_pause({"a": 31}, kept=1)


def test_each_late_gap_no_pause_caused_keeps_one_more_in_reserve() -> None:
    def pauses_left(unplanned: int) -> int:
        ledger = LateGapLedger(TARGET_S, 90)
        ledger.tokens(0.0, ["a"])
        now = 0.0
        ledger.pausing(["a"])  # one pause ...
        now += LATE_S
        ledger.tokens(now, ["a"])
        for _ in range(unplanned):  # ... and late gaps of its own
            now += LATE_S
            ledger.tokens(now, ["a"])
        return next(k for k in range(20) if not ledger.affords_a_pause({"a": 96}, kept=k))  # one, and k - 1 kept

    # 9 late gaps of 95, less the first one's, the pause's and PLANNED_RESERVE: 6 more pauses
    assert pauses_left(0) == 6
    assert pauses_left(1) == 4  # the late gap itself, and one more kept for the next such
    assert pauses_left(2) == 2


def test_a_colocated_stream_has_no_gap_before_its_first_token() -> None:
    ledger = LateGapLedger(TARGET_S, 90, first_token_seen=True)
    now = step(ledger, 0.0, "a")
    tokens = 1
    while not ledger.affords_a_pause(unknown("a")):
        now = step(ledger, now, "a")
        tokens += 1
    # 10 gaps, all on time, and the pause's: 1 late of 11 keeps the p90 on time (20 tokens above)
    assert tokens == 11
