"""StepPacer: a paced decode worker's next step starts so that its token comes by the inter-token
target, given how long recent steps took from waking to their tokens."""

from __future__ import annotations

import pytest

from shared.engine.policy.pacing import MIN_PAUSE_S, SLACK, StepPacer

TARGET_S = 0.2


def test_nothing_is_paused_before_a_step_was_measured() -> None:
    pacer = StepPacer(TARGET_S)
    assert pacer.pause_s(0.0) == 0.0
    pacer.stepped(1.0)  # a step with no wake time recorded (e.g. the first): no duration to plan with
    assert pacer.pause_s(1.0) == 0.0


def test_the_next_step_starts_so_that_its_token_is_due_by_the_target_less_the_slack() -> None:
    pacer = StepPacer(TARGET_S)
    pacer.woke(10.0)
    pacer.stepped(10.05)  # 50 ms from waking to the token
    aim = 10.05 + (1 - SLACK) * TARGET_S - 0.05
    assert pacer.pause_s(10.06) == pytest.approx(aim - 10.06)
    assert pacer.pause_s(aim - MIN_PAUSE_S / 2) == 0.0  # too short to be worth a resize of the neighbour
    assert pacer.pause_s(aim + 1) == 0.0  # overdue: step at once


def test_the_slowest_recent_step_sets_the_margin_and_old_ones_age_out() -> None:
    pacer = StepPacer(TARGET_S, window=3)
    now = 0.0
    for took in (0.12, 0.03, 0.03):
        pacer.woke(now)
        now += took
        pacer.stepped(now)
    assert pacer.pause_s(now) == pytest.approx((1 - SLACK) * TARGET_S - 0.12)
    pacer.woke(now)
    now += 0.03
    pacer.stepped(now)  # the 120 ms step left the window
    assert pacer.pause_s(now) == pytest.approx((1 - SLACK) * TARGET_S - 0.03)


def test_it_counts_the_steps_it_planned_and_those_whose_tokens_still_came_late() -> None:
    pacer = StepPacer(TARGET_S)
    pacer.lent()
    pacer.woke(0.0)
    pacer.stepped(0.05)  # the first token: no gap before it to plan
    assert (pacer.paced_steps, pacer.late_paced_steps) == (0, 0)
    pacer.woke(0.1)
    pacer.stepped(0.15)  # not planned: it started as soon as it was asked for
    assert (pacer.paced_steps, pacer.late_paced_steps) == (0, 0)

    pause = pacer.pause_s(0.16)
    pacer.lent()
    pacer.woke(0.16 + pause)
    pacer.stepped(0.16 + pause + 0.05)  # as long as the slowest recent step: on time
    assert (pacer.paced_steps, pacer.late_paced_steps) == (1, 0)

    token_at = 0.16 + pause + 0.05
    pause = pacer.pause_s(token_at)
    pacer.lent()
    pacer.woke(token_at + pause)
    pacer.stepped(token_at + pause + 0.05 + SLACK * TARGET_S + 0.01)  # outran the estimate by more than the slack
    assert (pacer.paced_steps, pacer.late_paced_steps) == (2, 1)


def test_a_target_must_be_positive() -> None:
    with pytest.raises(ValueError, match="must be positive, got 0"):
        StepPacer(0)
