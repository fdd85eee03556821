"""The step budget of the step policy: a cost fitted to steps' work and times, and the prompt tokens that keep a step
beside decodes within the target; then in a real engine, a long prompt beside a decoding request."""

from __future__ import annotations

from dataclasses import astuple

import pytest

from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from shared.engine.policy.step_cost import (
    MIN_PROMPT_TOKENS, PROBE_PROMPT_TOKENS, SLACK, StepBudget, StepCost, attention_pairs,
)
from shared.model.loader import LoadedModel
from shared.settings import EngineSettings, KVCacheSettings, LatencyTargetSettings, ModelSettings

TRUE_COST = StepCost(fixed_s=0.020, per_token_s=0.0002, per_pair_s=1e-7)


def step_time(cost: StepCost, num_decoding: int, prompt_tokens: int, context: int) -> float:
    return (cost.fixed_s + cost.per_token_s * (num_decoding + prompt_tokens)
            + cost.per_pair_s * attention_pairs(prompt_tokens, context))


def fitted(budget: StepBudget) -> tuple[float, float, float]:
    cost = budget.cost()
    assert cost is not None
    return astuple(cost)


def observe(budget: StepBudget, cost: StepCost, num_decoding: int, prompt_tokens: int, context: int) -> None:
    budget.observe(num_decoding + prompt_tokens, attention_pairs(prompt_tokens, context),
                   step_time(cost, num_decoding, prompt_tokens, context))


def test_the_fit_recovers_the_cost_and_the_chunk_fills_the_target() -> None:
    budget = StepBudget(target_s=0.2)
    assert budget.prompt_tokens(num_decoding=8, context=0) == PROBE_PROMPT_TOKENS
    for prompt_tokens, context in ((0, 0), (256, 0), (300, 256), (0, 0), (128, 1024), (512, 0), (64, 1800)):
        observe(budget, TRUE_COST, 8, prompt_tokens, context)
    assert fitted(budget) == pytest.approx(astuple(TRUE_COST), rel=1e-6)
    for context in (0, 1000):
        tokens = budget.prompt_tokens(num_decoding=8, context=context)
        assert step_time(TRUE_COST, 8, tokens, context) <= (1 - SLACK) * 0.2 < step_time(TRUE_COST, 8, tokens + 1, context)
    # later in a long prompt each token attends to more: fewer fit
    assert budget.prompt_tokens(8, context=1000) < budget.prompt_tokens(8, context=0)


def test_a_step_aims_below_the_target_by_how_far_recent_steps_ran_past_their_fit() -> None:
    exact, scattered = StepBudget(target_s=0.2), StepBudget(target_s=0.2)
    sizes = [(0, 0), (256, 0), (300, 256), (0, 0), (128, 1024), (512, 0), (64, 1800), (200, 0)]
    for rep in range(4):
        for i, (prompt_tokens, context) in enumerate(sizes):
            observe(exact, TRUE_COST, 8, prompt_tokens, context)
            jitter = 0.01 if (rep + i) % 2 else -0.01  # each size 10 ms over its cost twice, under it twice
            scattered.observe(8 + prompt_tokens, attention_pairs(prompt_tokens, context),
                              step_time(TRUE_COST, 8, prompt_tokens, context) + jitter)
    assert exact.overrun_s() == pytest.approx(0.0, abs=1e-9)
    assert fitted(scattered) == pytest.approx(astuple(TRUE_COST), rel=1e-6)
    assert scattered.overrun_s() == pytest.approx(0.01)
    tokens = scattered.prompt_tokens(num_decoding=8, context=0)
    aim = (1 - SLACK) * 0.2 - 0.01
    assert step_time(TRUE_COST, 8, tokens, 0) <= aim < step_time(TRUE_COST, 8, tokens + 1, 0)
    assert tokens < exact.prompt_tokens(num_decoding=8, context=0)


def test_without_attention_in_the_steps_a_line_is_fitted() -> None:
    budget = StepBudget(target_s=0.2)
    for tokens in (1, 8, 100, 8, 300):
        budget.observe(tokens, 0.0, 0.01 + 0.001 * tokens)
    assert fitted(budget) == pytest.approx((0.01, 0.001, 0.0))
    # (0.18 - 0.01) / 0.001 - 10, floored: a fit a rounding error under it gives 159 (AMD's BLAS)
    assert budget.prompt_tokens(num_decoding=10, context=0) in (159, 160)


def test_a_prompt_always_advances_and_noise_alone_gives_the_probe() -> None:
    budget = StepBudget(target_s=0.05)
    for num_decoding in (140, 160, 140, 160):  # 160 decodes alone take 52 ms, more than the target
        observe(budget, TRUE_COST, num_decoding, 0, 0)
    observe(budget, TRUE_COST, 140, 100, 0)
    assert budget.prompt_tokens(num_decoding=160, context=0) == MIN_PROMPT_TOKENS
    still = StepBudget(target_s=0.05)
    for _ in range(3):
        still.observe(8, 0.0, 0.03)  # one size: the cost of a token is unknown
    assert still.cost() is None and still.prompt_tokens(8, 0) == PROBE_PROMPT_TOKENS
    with pytest.raises(ValueError, match="positive"):
        StepBudget(target_s=0)


def test_the_cost_follows_a_slower_machine_within_its_window() -> None:
    budget = StepBudget(target_s=0.2, window=8)
    sizes = [(0, 0), (200, 0), (0, 0), (400, 200)] * 2
    for prompt_tokens, context in sizes:
        observe(budget, TRUE_COST, 4, prompt_tokens, context)
    fast = budget.prompt_tokens(4, context=0)
    slower = StepCost(TRUE_COST.fixed_s * 2, TRUE_COST.per_token_s * 2, TRUE_COST.per_pair_s * 2)
    for prompt_tokens, context in sizes:  # a lease took half the cores
        observe(budget, slower, 4, prompt_tokens, context)
    assert fitted(budget) == pytest.approx(astuple(slower), rel=1e-6)
    assert budget.prompt_tokens(4, context=0) < fast


def targets(itl_ms: float | None) -> LatencyTargetSettings | None:
    return None if itl_ms is None else LatencyTargetSettings(itl_ms=itl_ms)


def chunks_beside_a_decode(loaded_model: LoadedModel, itl_ms: float | None) -> list[int]:
    """The chunks a 400-token prompt is prefilled in beside a decoding request, checking that the
    decode gets its token every step."""
    engine = Engine(EngineSettings(
        model=ModelSettings(dtype="float32", device="cpu"), kv_cache=KVCacheSettings(memory_bytes=64 * 2**20),
        targets=targets(itl_ms),
    ), loaded_model)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    engine.add_request("decoding", list(range(100, 140)), params)
    for _ in range(3):
        engine.step()
    engine.add_request("long", list(range(1000, 1400)), SamplingParams(max_tokens=1, temperature=0.0))
    long = engine._requests["long"]
    chunks: list[int] = []
    while not long.is_finished:
        computed = long.num_computed_tokens
        outputs = engine.step()
        assert "decoding" in [out.req_id for out in outputs]
        chunks.append(long.num_computed_tokens - computed)
    return chunks


def test_an_engine_chunks_a_prompt_beside_decodes_only_under_a_target(loaded_model: LoadedModel) -> None:
    assert chunks_beside_a_decode(loaded_model, itl_ms=None) == [400]
    # no step can end within 1 ms: every chunk is the least, or the probe while the cost is unknown
    chunks = chunks_beside_a_decode(loaded_model, itl_ms=1.0)
    assert sum(chunks) == 400 and len(chunks) > 1
    assert all(chunk in (MIN_PROMPT_TOKENS, PROBE_PROMPT_TOKENS) for chunk in chunks[:-1])


def test_a_prompt_held_back_beside_decodes_is_named_and_takes_one_step_when_the_decodes_may_stall(
    loaded_model: LoadedModel,
) -> None:
    engine = Engine(EngineSettings(
        model=ModelSettings(dtype="float32", device="cpu"), kv_cache=KVCacheSettings(memory_bytes=64 * 2**20),
        targets=targets(1.0),
    ), loaded_model)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    engine.add_request("decoding", list(range(100, 140)), params)
    assert engine.prompt_held_back() is None  # with nothing decoding beside it, a prompt takes the whole budget
    engine.step()
    assert engine.prompt_held_back() is None  # no prompt waits
    engine.add_request("long", list(range(1000, 1400)), SamplingParams(max_tokens=1, temperature=0.0))
    long = engine._requests["long"]
    assert engine.prompt_held_back() is long
    engine.step()  # a chunk
    assert 0 < long.num_computed_tokens < 400 and engine.prompt_held_back() is long
    # the policy's judgement of the streams is its own test's (test_policy.py): here, that the engine heeds it
    engine.policy.takes_whole_step = lambda prompt, waited_s, streams: prompt is long  # type: ignore[method-assign]
    outputs = engine.step()
    assert {out.req_id for out in outputs} == {"decoding", "long"} and long.is_finished
    assert engine.prompt_held_back() is None
