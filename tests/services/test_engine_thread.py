"""The engine thread (services/runtime/engine_thread.py) around a fake engine: one thread for every
call, stalls told from idleness, step hooks and calls between a step's layers in their order."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest

from services.runtime.engine_thread import EngineThread
from shared.engine.engine import EngineStats, RequestOutput
from shared.engine.kv_cache_manager import KVCacheStats
from shared.engine.policy import StepPolicy
from shared.engine.request import ReqId

pytestmark = pytest.mark.timeout(600)


class FakeEngine:
    """Just what EngineThread reads: stats, a step and the step policy."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.num_waiting = 0
        self.policy = StepPolicy(None, "cpu", max_num_batched_tokens=2048)  # no targets: decides nothing

    def stats(self) -> EngineStats:
        return EngineStats(0, self.num_waiting, 0, KVCacheStats(8, 0, 0, 8, 0, 0, 0, 0))

    def step(self) -> list[RequestOutput]:
        return []

    def hold_work(self) -> None:
        self.num_waiting = 1

    def drop_work(self) -> None:
        self.num_waiting = 0


def engine_thread_around(engine: FakeEngine, clock: Callable[[], float] = time.monotonic) -> EngineThread:
    """An engine thread that runs `engine` instead of loading a model."""
    thread = EngineThread(clock)
    thread._engine = engine  # type: ignore[assignment]
    return thread


async def test_engine_thread_runs_every_call_on_one_thread_and_tells_stalls_from_idleness() -> None:
    now = [100.0]
    engine = FakeEngine()
    thread = engine_thread_around(engine, clock=lambda: now[0])
    names = {await thread.call(lambda: threading.current_thread().name) for _ in range(5)}
    assert len(names) == 1 and names.pop().startswith("engine")
    now[0] += 50
    assert thread.stalled_s() == 0.0  # idle is not a stall

    await thread.call(engine.hold_work)
    assert thread.has_work and thread.stats is not None and thread.stats.num_waiting == 1
    now[0] += 40
    assert thread.stalled_s() == 40.0  # work held, nobody stepping

    await thread.step()  # a step that schedules nothing still proves the engine is alive
    now[0] += 1
    assert thread.stalled_s() == 1.0
    await thread.call(engine.drop_work)
    assert (thread.has_work, thread.stalled_s()) == (False, 0.0)
    thread.shutdown()


async def test_a_step_hook_runs_on_the_engine_thread_before_calls_queued_during_the_step() -> None:
    engine = FakeEngine()
    thread = engine_thread_around(engine)
    in_step, finish_step = threading.Event(), threading.Event()
    outputs = [RequestOutput(ReqId("r"), [1], None, None, None, num_prompt_tokens=2, num_cached_tokens=0)]

    def long_step() -> list[RequestOutput]:
        in_step.set()
        finish_step.wait(30)
        return outputs

    engine.step = long_step  # type: ignore[method-assign]
    order: list[tuple[str, str]] = []
    step = asyncio.ensure_future(thread.step(lambda outs: order.append(("hook", threading.current_thread().name))))
    await asyncio.to_thread(in_step.wait, 30)
    queued = asyncio.ensure_future(thread.call(lambda: order.append(("call", threading.current_thread().name))))
    finish_step.set()
    assert await step == outputs
    await queued
    assert [what for what, _ in order] == ["hook", "call"]
    assert all(name.startswith("engine") for _, name in order)
    thread.shutdown()


async def test_a_call_between_layers_runs_inside_the_step_in_progress_and_after_none_when_idle() -> None:
    engine = FakeEngine()
    thread = engine_thread_around(engine)
    in_step, next_layer = threading.Event(), threading.Event()
    order: list[str] = []

    def step_of_two_layers() -> list[RequestOutput]:
        in_step.set()
        next_layer.wait(30)
        thread.between_layers()  # what the model calls after each decoder layer
        order.append("layer 2")
        return []

    engine.step = step_of_two_layers  # type: ignore[method-assign]
    step = asyncio.ensure_future(thread.step(lambda outs: order.append("step done")))
    await asyncio.to_thread(in_step.wait, 30)
    call = asyncio.ensure_future(thread.call_between_layers(lambda: order.append("reserve") or "reserved"))
    await asyncio.sleep(0)  # queued
    next_layer.set()
    assert await call == "reserved"
    await step
    assert order == ["reserve", "layer 2"]  # in the step, not after it ("step done": no outputs, no hook)

    assert (await thread.call_between_layers(lambda: threading.current_thread().name)).startswith("engine")  # idle

    def fails() -> None:
        raise ValueError("no room")

    with pytest.raises(ValueError, match="no room"):
        await thread.call_between_layers(fails)
    thread.shutdown()
