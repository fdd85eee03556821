"""The prompt order: the fewest tokens left first, small prompts batched, the long-waiting first."""

from __future__ import annotations

import time

import pytest

from shared.engine.kv_cache_manager import KVCacheManager
from shared.engine.policy.prompt_order import CPU_BATCH_TOKENS, ShortestFirst
from shared.engine.policy.step_cost import StepTimes
from shared.engine.scheduler import Scheduler, SchedulerConfig
from tests.engine.test_scheduler import BLOCK_SIZE, make_req, plan, run_step


def shortest_first(num_blocks: int = 64, budget: int = 64, batch_tokens: int = 8, max_wait_s: float = 60.0,
                   threshold: int = 0) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=True)
    order = ShortestFirst(batch_tokens, max_wait_s)
    return Scheduler(SchedulerConfig(budget, 8, long_prefill_token_threshold=threshold, prompt_order=order), kv)


def test_a_short_prompt_goes_before_the_rest_of_a_long_one_and_alone() -> None:
    sched = shortest_first(threshold=16)
    sched.add(make_req("long", 40, max_tokens=2))
    assert plan(run_step(sched)) == [("long", 16)]
    sched.add(make_req("short", 10, max_tokens=2, first_token=100))  # came during the long one's first chunk
    # 10 tokens left beats 24: the short one takes the step, and the long one's chunk would exceed
    # what may share a step with it (max(10, 8) tokens)
    assert plan(run_step(sched)) == [("short", 10)]
    assert plan(run_step(sched)) == [("short", 1), ("long", 16)]
    assert plan(run_step(sched)) == [("long", 8)]
    assert [req.num_output_tokens for req in sched.running] == [1]


def test_small_prompts_share_a_step_up_to_the_batch_tokens_shortest_first() -> None:
    sched = shortest_first(batch_tokens=8)
    for name, length, first in (("five", 5, 0), ("three", 3, 100), ("two", 2, 200), ("nine", 9, 300)):
        sched.add(make_req(name, length, max_tokens=1, first_token=first))
    assert plan(run_step(sched)) == [("two", 2), ("three", 3), ("five", 3)]
    assert plan(run_step(sched)) == [("five", 2), ("nine", 6)]
    assert plan(run_step(sched)) == [("nine", 3)]
    sched.add(make_req("twelve", 12, max_tokens=1, first_token=400))
    assert plan(run_step(sched)) == [("twelve", 12)]  # alone past the batch tokens: its own share sets the step's


def test_a_prompt_that_waited_long_goes_ahead_of_shorter_ones() -> None:
    sched = shortest_first(max_wait_s=5.0)
    old = make_req("old", 30, max_tokens=1)
    old.arrived_s = time.monotonic() - 6.0
    sched.add(make_req("short", 4, max_tokens=1, first_token=100))
    sched.add(old)
    assert plan(run_step(sched)) == [("old", 30)]
    assert plan(run_step(sched)) == [("short", 4)]


def test_a_cached_prefix_does_not_count_as_tokens_left() -> None:
    sched = shortest_first()
    sched.add(make_req("history", 24, max_tokens=1))
    run_step(sched)
    sched.add(make_req("new", 6, max_tokens=1, first_token=500))
    follow_up = make_req("follow-up", 28, max_tokens=1)  # the history's 24 tokens cached, 4 new
    sched.add(follow_up)
    assert plan(run_step(sched)) == [("follow-up", 4), ("new", 4)]
    assert follow_up.num_cached_tokens == 24


def test_out_of_blocks_the_longest_unscheduled_prompt_yields_not_a_decode() -> None:
    # 10 blocks of 4 tokens: a decoding request holds 3, two chunked prompts hold 3 and 1
    sched = shortest_first(num_blocks=10, budget=64, batch_tokens=64, threshold=12)
    sched.add(make_req("decoding", 8, max_tokens=20))
    run_step(sched)
    sched.add(make_req("long", 40, max_tokens=1, first_token=100))
    sched.add(make_req("mid", 20, max_tokens=1, first_token=200))
    assert plan(run_step(sched)) == [("decoding", 1), ("mid", 12), ("long", 12)]
    # now the decode holds 3 blocks, mid 3 and long 3; mid's last 8 tokens need 2 more than the 1 free
    batch = run_step(sched)
    assert [req.req_id for req in batch.preempted] == ["long"]
    assert plan(batch) == [("decoding", 1), ("mid", 8)]
    while sched.num_unfinished:
        run_step(sched)
        sched.kv_cache.check_invariants()
    assert sched.kv_cache.pool.num_used_blocks == 0


def test_two_chunked_prompts_that_fill_the_pool_both_finish() -> None:
    # neither fits beside the other: one yields its blocks, so there is no deadlock
    sched = shortest_first(num_blocks=8, budget=64, batch_tokens=64, threshold=16)
    sched.add(make_req("a", 28, max_tokens=1))
    sched.add(make_req("b", 30, max_tokens=1, first_token=100))
    a, b = list(sched.waiting)
    for _ in range(12):
        run_step(sched)
        if not sched.num_unfinished:
            break
    assert a.is_finished and b.is_finished and sched.num_preemptions == 1


@pytest.mark.parametrize(("device", "expected"), [("cpu", CPU_BATCH_TOKENS), ("cuda", 2048)])
def test_a_devices_prompts_share_a_step_up_to_its_batch(device: str, expected: int) -> None:
    order = ShortestFirst.for_device(device, 2048, StepTimes())
    assert order.batch_tokens == expected and order.batch_tokens_now() == expected  # nothing fitted yet


def observed(fixed_s: float, per_token_s: float) -> StepTimes:
    times = StepTimes()
    for tokens in (16, 64, 128, 256, 512, 1024):
        times.observe(tokens, 0.0, fixed_s + per_token_s * tokens)
    return times


@pytest.mark.parametrize(("fixed_s", "per_token_s", "expected"), [
    (0.011, 0.002, CPU_BATCH_TOKENS),  # a model whose tokens cost far more than a step's fixed part
    (0.003, 0.00001, 2048),  # a tiny model: 7 x 300 tokens' worth of fixed cost, capped at the step budget
    (0.002, 0.0001, 140),  # between: 7 x 20 tokens
])
def test_on_a_cpu_prompts_share_a_step_until_its_fixed_cost_is_an_eighth_of_it(
        fixed_s: float, per_token_s: float, expected: int) -> None:
    order = ShortestFirst.for_device("cpu", 2048, observed(fixed_s, per_token_s))
    assert order.batch_tokens_now() == pytest.approx(expected, abs=1)
    assert order.step_prompt_tokens(first_share=4000) == 4000


def test_steps_all_of_one_size_let_the_next_take_twice_that_so_the_fit_can_start() -> None:
    """A prefill worker fed 16-token prompts one at a time: while every step it timed took one
    prompt, the fixed cost cannot be told from the tokens', so the next step takes two; once the
    steps differ, the fit decides (here a large fixed cost: the whole budget)."""
    times = StepTimes()
    kv = KVCacheManager(64, BLOCK_SIZE, enable_prefix_caching=False)
    order = ShortestFirst(8, step_times=times, max_batch_tokens=64)
    sched = Scheduler(SchedulerConfig(64, 8, prompt_order=order), kv)
    assert order.batch_tokens_now() == 8  # nothing timed yet
    for name in "ab":
        sched.add(make_req(name, 16, max_tokens=1, first_token=ord(name) * 100))
        assert plan(run_step(sched)) == [(name, 16)]
        times.observe(16, 0.0, 0.003)
    assert times.cost() is None and times.only_size() == 16 and order.batch_tokens_now() == 32
    for name in "cdef":
        sched.add(make_req(name, 16, max_tokens=1, first_token=ord(name) * 100))
    assert plan(run_step(sched)) == [("c", 16), ("d", 16)]
    times.observe(32, 0.0, 0.0031)
    assert times.only_size() is None and order.batch_tokens_now() == 64
    assert plan(run_step(sched)) == [("e", 16), ("f", 16)]


def test_bad_values_are_named() -> None:
    with pytest.raises(ValueError, match="batch_tokens must be at least 1, got 0"):
        ShortestFirst(0, 1.0)
    with pytest.raises(ValueError, match="max_wait_s must be positive, got 0"):
        ShortestFirst(8, 0.0)
