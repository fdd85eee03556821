"""StepThreads: a CPU engine steps on the thread count that measured fastest for steps of that size,
and keeps measuring the others."""

from __future__ import annotations

from services.runtime.step_threads import EXPLORE_EVERY, StepThreads


def measured(tuner: StepThreads, tokens: int, seconds_per_token: dict[int, float]) -> None:
    """Every candidate tried once on a step of `tokens` tokens, at the given speeds."""
    for threads in tuner.candidates:
        tuner.observe(threads, tokens, seconds_per_token[threads] * tokens)


def test_candidates_are_powers_of_two_and_the_most() -> None:
    assert StepThreads(1).candidates == [1]
    assert StepThreads(2).candidates == [1, 2]
    assert StepThreads(6).candidates == [1, 2, 4, 6]


def test_steps_take_every_core_until_it_is_measured_and_other_counts_at_exploring_steps() -> None:
    tuner = StepThreads(4)
    tuner.observe(1, 8, 1e-3 * 8)  # a step the lease held to one thread: the next still takes every core
    tried = []
    for _ in range(3 * EXPLORE_EVERY):
        threads = tuner.choose()
        tried.append(threads)
        tuner.observe(threads, 8, {1: 1e-3, 2: 2e-3, 4: 3e-3}[threads] * 8)
    # the first exploring step tries 2, never measured; 1 is fastest all along after the first step
    assert tried[:2] == [4, 1] and tried[2:EXPLORE_EVERY] == [1] * (EXPLORE_EVERY - 3) + [2]
    assert tried[EXPLORE_EVERY:2 * EXPLORE_EVERY] == [1] * (EXPLORE_EVERY - 1) + [4]


def test_the_faster_count_runs_and_the_others_are_measured_again_every_so_often() -> None:
    tuner = StepThreads(2)
    measured(tuner, 128, {1: 150e-6, 2: 210e-6})  # a second thread that only contends for the core
    choices = []
    for _ in range(2 * EXPLORE_EVERY):
        threads = tuner.choose()
        choices.append(threads)
        tuner.observe(threads, 128, {1: 150e-6, 2: 210e-6}[threads] * 128)
    assert choices.count(2) == 2 and choices.count(1) == 2 * EXPLORE_EVERY - 2


def test_a_change_of_load_changes_the_choice() -> None:
    tuner = StepThreads(2)
    measured(tuner, 64, {1: 3e-3, 2: 2e-3})
    assert tuner.choose() == 2
    for _ in range(8 * EXPLORE_EVERY):  # the second core got busy: two threads got slower
        threads = tuner.choose()
        tuner.observe(threads, 64, {1: 3e-3, 2: 5e-3}[threads] * 64)
    assert tuner.choose() == 1


def test_steps_of_other_sizes_keep_their_own_measures() -> None:
    tuner = StepThreads(2)
    measured(tuner, 1, {1: 20e-3, 2: 14e-3})  # one row: its weights stream faster on two cores
    measured(tuner, 128, {1: 150e-6, 2: 210e-6})
    assert tuner.choose() == 1  # the last step had 128 tokens: the next is taken to be as wide
    tuner.observe(1, 1, 20e-3)
    assert tuner.choose() == 2


def test_a_step_that_computed_nothing_teaches_nothing() -> None:
    tuner = StepThreads(2)
    measured(tuner, 16, {1: 1e-3, 2: 2e-3})
    tuner.observe(2, 0, 1.0)
    tuner.observe(3, 16, 1e-9)  # not a candidate: the lease held it to another count
    assert tuner.choose() == 1
