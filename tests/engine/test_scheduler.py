from __future__ import annotations

import pytest

from shared.engine.kv_cache_manager import KVCacheManager
from shared.engine.request import ReqId, Request, RequestStatus
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig, StepResult
from shared.settings import KVReservation

BLOCK_SIZE = 4


def make_scheduler(
    num_blocks: int = 16,
    budget: int = 32,
    max_seqs: int = 8,
    caching: bool = True,
    reservation: KVReservation = "paged",
) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=caching)
    return Scheduler(SchedulerConfig(budget, max_seqs, enable_chunked_prefill=True, kv_reservation=reservation), kv)


def make_req(req_id: str, num_prompt: int, max_tokens: int = 4, first_token: int = 0) -> Request:
    return Request(
        ReqId(req_id),
        list(range(first_token, first_token + num_prompt)),
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        seed=0,
        eos_token_ids=(),
        max_model_len=1000,
    )


def run_step(sched: Scheduler, token: int = 5) -> ScheduledBatch:
    batch = sched.schedule()
    num_sampling = sum(batch.samples(i) for i in range(len(batch.reqs)))
    sched.update(batch, StepResult(token_ids=[token] * num_sampling))
    return batch


def plan(batch: ScheduledBatch) -> list[tuple[str, int]]:
    return [(r.req_id, n) for r, n in zip(batch.reqs, batch.num_new_tokens)]


def test_running_decodes_go_first_then_waiting_prompts_fill_budget() -> None:
    sched = make_scheduler(budget=10)
    sched.add(make_req("a", 6, max_tokens=10))
    assert plan(run_step(sched)) == [("a", 6)]
    sched.add(make_req("b", 20, first_token=100))
    assert plan(run_step(sched)) == [("a", 1), ("b", 9)]
    assert plan(run_step(sched)) == [("a", 1), ("b", 9)]
    assert plan(run_step(sched)) == [("a", 1), ("b", 2)]
    assert sched.running[1].num_output_tokens == 1


def test_a_prompt_token_cap_limits_chunks_but_not_decodes() -> None:
    sched = make_scheduler(budget=32, num_blocks=32)
    sched.add(make_req("a", 6, max_tokens=10))
    sched.add(make_req("b", 6, max_tokens=10, first_token=100))
    assert plan(run_step(sched)) == [("a", 6), ("b", 6)]
    sched.add(make_req("long", 40, max_tokens=10, first_token=200))
    assert sched.num_decoding == 2 and sched.next_prompt().req_id == "long"
    batch = sched.schedule(max_prompt_tokens=10)
    assert plan(batch) == [("a", 1), ("b", 1), ("long", 10)]  # the decodes are not in the cap
    sched.update(batch, StepResult(token_ids=[5, 5]))
    assert plan(sched.schedule(max_prompt_tokens=3)) == [("a", 1), ("b", 1), ("long", 3)]


def test_a_long_prompt_takes_at_most_its_threshold_a_step_and_a_short_one_beside_it_finishes_first() -> None:
    kv = KVCacheManager(32, BLOCK_SIZE, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(32, 8, enable_chunked_prefill=True, long_prefill_token_threshold=12), kv)
    sched.add(make_req("long", 40, max_tokens=2))
    assert plan(run_step(sched)) == [("long", 12)]
    sched.add(make_req("short", 10, max_tokens=2, first_token=100))  # came during the long one's first chunk
    assert plan(run_step(sched)) == [("short", 10), ("long", 12)]
    assert sched.running[1].num_output_tokens == 1  # its first token, two chunks before the long one's
    assert plan(run_step(sched)) == [("short", 1), ("long", 12)]
    assert plan(run_step(sched)) == [("long", 4)]
    assert sched.running[0].num_output_tokens == 1


def test_finished_request_frees_blocks_in_same_step() -> None:
    sched = make_scheduler()
    sched.add(make_req("a", 5, max_tokens=2, first_token=50))
    run_step(sched)
    assert sched.kv_cache.pool.num_used_blocks == 2
    run_step(sched)
    assert sched.running == [] and sched.kv_cache.pool.num_used_blocks == 0
    sched.kv_cache.check_invariants()


def test_max_num_seqs_caps_running() -> None:
    sched = make_scheduler(max_seqs=2)
    for name in "abc":
        sched.add(make_req(name, 3, first_token=ord(name) * 10))
    assert [r for r, _ in plan(run_step(sched))] == ["a", "b"]
    assert [r.req_id for r in sched.waiting] == ["c"]


def test_preempts_most_recent_and_resumes_with_cached_prefix() -> None:
    # 6 blocks of 4 tokens; two 8-token prompts take 2 blocks each, then decoding grows them
    sched = make_scheduler(num_blocks=6, budget=64)
    sched.add(make_req("old", 8, max_tokens=12, first_token=0))
    sched.add(make_req("new", 8, max_tokens=12, first_token=100))
    run_step(sched)
    for _ in range(4):
        run_step(sched)
    assert sched.num_preemptions == 0
    # the sixth step needs 13 tokens each, 4 + 4 blocks > 6: the most recently started one yields
    batch = run_step(sched)
    assert [r.req_id for r in batch.preempted] == ["new"] and plan(batch) == [("old", 1)]
    assert sched.num_preemptions == 1
    preempted = sched.waiting[0] if sched.waiting else None
    assert preempted is not None and preempted.req_id == "new"
    assert preempted.status is RequestStatus.WAITING and preempted.num_computed_tokens == 0
    sched.kv_cache.check_invariants()
    while sched.num_unfinished:
        run_step(sched)
    assert sched.kv_cache.pool.num_used_blocks == 0
    sched.kv_cache.check_invariants()


def test_prefix_hit_counts_cached_tokens() -> None:
    sched = make_scheduler()
    sched.add(make_req("a", 9, max_tokens=1))
    run_step(sched)
    follower = make_req("b", 9, max_tokens=1)
    sched.add(follower)
    assert plan(run_step(sched)) == [("b", 1)]
    assert follower.num_cached_tokens == 8
    stats = sched.kv_cache.stats()
    assert (stats.prefix_queries, stats.prefix_hits) == (18, 8)


def test_abort_frees_blocks_at_once() -> None:
    sched = make_scheduler()
    sched.add(make_req("a", 10))
    run_step(sched)
    assert sched.abort(ReqId("a")) is not None
    assert sched.kv_cache.pool.num_used_blocks == 0 and sched.num_unfinished == 0


@pytest.mark.parametrize(("reservation", "admitted", "used_blocks"), [
    ("paged", ["a", "b", "c"], 6),
    ("max_length", ["a", "b"], 8),
])
def test_max_length_admits_only_whole_reservations(reservation: KVReservation, admitted: list[str],
                                                   used_blocks: int) -> None:
    # 8 blocks of 4 tokens; each request has 8 prompt tokens (2 blocks) and may reach 16 (4 blocks)
    sched = make_scheduler(num_blocks=8, reservation=reservation)
    for name in "abc":
        sched.add(make_req(name, 8, max_tokens=8, first_token=ord(name) * 10))
    assert [r for r, _ in plan(run_step(sched))] == admitted
    assert sched.kv_cache.pool.num_used_blocks == used_blocks


@pytest.mark.parametrize("reservation", ["paged", "max_length"])
def test_reservation_runs_to_the_end_without_leaking_blocks(reservation: KVReservation) -> None:
    sched = make_scheduler(num_blocks=8, reservation=reservation)
    for name in "abc":
        sched.add(make_req(name, 8, max_tokens=8, first_token=ord(name) * 10))
    steps: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    step = 0
    while sched.num_unfinished:
        for req_id, _ in plan(run_step(sched)):
            steps[req_id].append(step)
        sched.kv_cache.check_invariants()
        step += 1
    assert sched.kv_cache.pool.num_used_blocks == 0
    if reservation == "paged":
        # all three started at once and outgrew the pool: preemption still frees room
        assert sched.num_preemptions > 0
    else:
        # reserved blocks never run out; c waits until a and b are done
        assert sched.num_preemptions == 0
        assert steps["c"][0] > max(steps["a"] + steps["b"])


def test_max_length_reservation_beyond_the_pool_is_capped_at_it() -> None:
    # 6 blocks hold 24 tokens; prompt + max_tokens is 25, but the last token's KV is never computed
    sched = make_scheduler(num_blocks=6, reservation="max_length")
    sched.add(make_req("a", 8, max_tokens=17))
    for _ in range(17):  # uncapped, it would wait for ever
        run_step(sched)
    assert sched.num_unfinished == 0 and sched.num_preemptions == 0
    assert sched.kv_cache.pool.num_used_blocks == 0
