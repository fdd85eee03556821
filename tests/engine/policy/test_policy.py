"""StepPolicy as a unit: each decision it makes before a step, from the inputs it is given (clock
times, steps' work and times, the streams held, the neighbour's state); no engine, no threads."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from shared.engine.policy import StepPolicy
from shared.engine.policy.pacing import SLACK
from shared.engine.policy.policy import KEPT_FOR_LONG_PROMPTS, PAUSE_AFTER_TTFT_SHARE
from shared.engine.policy.prompt_order import CPU_BATCH_TOKENS
from shared.engine.policy.step_cost import PROBE_PROMPT_TOKENS
from shared.engine.policy.step_cost import SLACK as STEP_SLACK
from shared.engine.request import Request
from shared.engine.sampling_params import SamplingParams
from shared.settings import LatencyTargetSettings

ITL_S = 0.1
ON_TIME_S = 0.08
AFTER_S = 0.3  # a quarter of the TTFT target below


@dataclass
class Output:
    req_id: str
    is_finished: bool = False


def policy(percentile: int = 90, targets: bool = True, device: str = "cpu") -> StepPolicy:
    given = LatencyTargetSettings(ttft_ms=1000 * AFTER_S / PAUSE_AFTER_TTFT_SHARE, itl_ms=1000 * ITL_S,
                                  itl_percentile=percentile)
    return StepPolicy(given if targets else None, device, max_num_batched_tokens=2048)


def tokens(p: StepPolicy, now: float, *req_ids: str, steps: int = 1) -> float:
    """`steps` on-time steps each giving `req_ids` a token; the clock after them."""
    for _ in range(steps):
        p.stepped(now, [Output(r) for r in req_ids])
        now += ON_TIME_S
    return now


def unknown(*req_ids: str) -> dict[str, int]:
    return dict.fromkeys(req_ids, 0)


def prompt() -> Request:
    return Request("prompt", list(range(100)), SamplingParams(max_tokens=1), seed=0, eos_token_ids=(2,),
                   max_model_len=2048)


def test_without_targets_nothing_is_capped_paced_or_stalled() -> None:
    p = policy(targets=False)
    assert p.budget is None and p.prompt_cap(num_decoding=8, context=0) is None
    assert not p.stall_for_prompts(first_token_seen=True)
    assert p.before_step(0.0, neighbour_has_work=True, held=unknown("a")) is None


def test_the_order_shares_a_step_by_device() -> None:
    assert policy(device="cpu").order.batch_tokens == CPU_BATCH_TOKENS
    assert policy(device="cuda").order.batch_tokens == 2048


def test_prompts_are_capped_only_beside_decodes_and_by_the_fitted_cost() -> None:
    p = policy()
    assert p.prompt_cap(num_decoding=0, context=0) is None  # nothing waits on the step
    assert p.prompt_cap(num_decoding=4, context=0) == PROBE_PROMPT_TOKENS  # no steps seen yet
    for num_tokens in (4, 100, 200, 4):
        p.observe_step(num_tokens, 0.0, 0.01 + 0.0002 * num_tokens)
    cap = p.prompt_cap(num_decoding=4, context=0)
    assert cap is not None
    # the most tokens that end within the target less its slack (floating point may cost one)
    assert 0.01 + 0.0002 * (4 + cap) <= (1 - STEP_SLACK) * ITL_S < 0.01 + 0.0002 * (4 + cap + 2)


def test_a_whole_step_keeps_a_late_gap_for_a_prompt_that_has_not_waited() -> None:
    p = policy()
    assert p.stall_for_prompts(first_token_seen=True)
    now = tokens(p, 0.0, "a", steps=11)  # 10 gaps on time: affords one late gap, none to keep
    assert not p.takes_whole_step(prompt(), 0.0, unknown("a"))  # just come: kept for one that waits
    assert p.takes_whole_step(prompt(), AFTER_S, unknown("a")) and p.num_pauses == 1
    now = tokens(p, now + 2.0, "a")  # the stall's gap: late, planned
    assert not p.takes_whole_step(prompt(), AFTER_S, unknown("a"))
    tokens(p, now, "a", steps=10)
    assert p.takes_whole_step(prompt(), AFTER_S, unknown("a"))  # 21 gaps, 1 late: this one's makes 2 of 22
    assert not p.takes_whole_step(prompt(), AFTER_S, {})  # no stream to stall for


def test_whole_steps_need_a_percentile_target() -> None:
    assert not policy(percentile=100).stall_for_prompts(first_token_seen=True)
    p = policy(percentile=100)
    assert not p.takes_whole_step(prompt(), 10.0, {})


def test_a_paced_step_is_due_by_the_target_from_the_slowest_recent_step() -> None:
    p = policy(percentile=100)
    p.pace(max_pause_s=1.0)
    assert not p.pauses_streams  # every gap holds the target: no pauses
    p.woke(10.0)
    p.stepped(10.05, [Output("a")])  # 50 ms from waking to the token
    assert p.before_step(10.06, neighbour_has_work=False, held=unknown("a")) is None  # nobody to lend to
    lend = p.before_step(10.06, neighbour_has_work=True, held=unknown("a"))
    assert lend is not None and not lend.is_pause
    assert lend.deadline_s == pytest.approx(10.05 + (1 - SLACK) * ITL_S - 0.05)
    assert p.before_step(11.0, neighbour_has_work=True, held=unknown("a")) is None  # overdue: step now


def test_a_pause_comes_at_once_where_streams_spare_a_late_gap_else_once_the_neighbour_ran_long() -> None:
    p = policy()
    p.pace(max_pause_s=1.0)
    now = tokens(p, 0.0, "a", steps=20)  # affords one late gap, none to keep
    lend = p.before_step(now, neighbour_has_work=True, held=unknown("a"))
    assert lend is None or not lend.is_pause  # a prompt just started: the late gap is kept for a long one
    lend = p.before_step(now + AFTER_S, neighbour_has_work=True, held=unknown("a"))
    assert lend is not None and lend.is_pause and lend.paused == {"a"} and lend.seconds == 1.0
    now = tokens(p, now + AFTER_S + 1.0, "a")  # the pause's gap
    assert p.before_step(now, neighbour_has_work=False, held=unknown("a")) is None  # the prompt is done
    now = tokens(p, now, "a", steps=20)  # 41 gaps, 2 late: affords one more and keeps one
    assert KEPT_FOR_LONG_PROMPTS == 1
    lend = p.before_step(now, neighbour_has_work=True, held=unknown("a"))
    assert lend is not None and lend.is_pause and p.num_pauses == 2


def test_a_pause_goes_on_for_a_request_committed_meanwhile_only_where_it_can_be_its_first_gap() -> None:
    p = policy()
    p.pace(max_pause_s=1.0)
    now = tokens(p, 0.0, "a", steps=40)
    lend = p.before_step(now, neighbour_has_work=True, held=unknown("a"))
    assert lend is not None and lend.is_pause
    assert p.pause_goes_on({"a": 0}, lend.paused)
    assert p.pause_goes_on({"a": 0, "b": 96}, lend.paused)  # its first gap counts as late already
    assert not p.pause_goes_on({"a": 0, "b": 96, "c": 0}, lend.paused)  # may end at any token: none to spare
    assert not p.pause_goes_on({"a": 0, "c": 10}, lend.paused)  # 9 gaps: none may be late


def test_pauses_and_whole_steps_spend_one_count_of_late_gaps() -> None:
    p = policy()
    p.pace(max_pause_s=1.0)
    assert p.stall_for_prompts(first_token_seen=False)
    now = tokens(p, 0.0, "a", steps=20)  # affords exactly one late gap once a prompt waited long
    assert p.takes_whole_step(prompt(), AFTER_S, unknown("a"))
    lend = p.before_step(now + AFTER_S, neighbour_has_work=True, held=unknown("a"))
    assert lend is None or not lend.is_pause  # the whole step spent it
