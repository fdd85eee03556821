"""Faults the model-backed tests leave out, checked without a model: a poison request that crashes
the engine call, overload at the gateway, a stuck engine, and what crosses Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest

from services.gateway.context import GATEWAY
from services.prefill.worker import PrefillWorker
from services.runtime.engine_thread import EngineThread
from services.runtime.worker import Worker
from shared.engine.engine import EngineStats, RequestOutput
from shared.engine.kv_cache_manager import KVCacheStats
from shared.engine.policy import StepPolicy
from shared.engine.sampling_params import SamplingParams
from shared.protocol import (
    GenerateRequest,
    TokenBatch,
    TokenUpdate,
    WorkerStatus,
    decode,
)
from shared.settings import RedisSettings, WorkerServiceSettings, WorkerSettings
from shared.streams import PREFILL_GROUP, Bus
from tests.services.gateway_harness import (  # noqa: F401 (fixtures)
    WORLD,
    FakeWorker,
    Start,
    bus,
    eventually,
    namespace,
    post,
    start,
    tokenizer,
    worker,
)
from tests.services.stack_client import REDIS_URL

pytestmark = pytest.mark.timeout(60)


class FakeEngine:
    """What EngineThread and the prefill worker touch; `add_request` crashes when `crash` is set."""

    def __init__(self, crash: bool = False, admit_delay_s: float = 0.0,
                 on_add: Callable[[str], None] = lambda req_id: None) -> None:
        self.crash = crash
        self.admit_delay_s = admit_delay_s
        self.on_add = on_add  # runs on the engine thread as it takes a request
        self.num_steps = 0
        self.num_waiting = 0
        self.policy = StepPolicy(None, "cpu", max_num_batched_tokens=2048)  # no targets: decides nothing

    def stats(self) -> EngineStats:
        return EngineStats(0, self.num_waiting, 0, KVCacheStats(8, 0, 0, 8, 0, 0, 0, 0))

    def add_request(self, *args: Any) -> None:
        time.sleep(self.admit_delay_s)  # the engine thread is busy, as behind a long prefill step
        if self.crash:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        self.on_add(args[0] if args else "")
        self.num_waiting += 1

    def step(self) -> list[RequestOutput]:
        self.num_steps += 1
        return []


def worker_settings(namespace: str, worker_id: str, **worker: Any) -> WorkerServiceSettings:
    return WorkerServiceSettings(
        redis=RedisSettings(url=REDIS_URL, namespace=namespace),
        worker=WorkerSettings(worker_id=worker_id, health_port=0, **worker),
    )


async def with_engine(worker: Worker, engine: FakeEngine, thread: EngineThread | None = None) -> Worker:
    if thread is not None:
        worker.engine = thread
    worker.engine._engine = engine  # type: ignore[assignment]
    await worker.engine.call(lambda: None)  # first stats snapshot, as `load` takes
    return worker


@pytest.fixture
async def spawn() -> AsyncIterator[Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]]]:
    tasks: list[asyncio.Task[None]] = []

    def run(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        tasks.append(asyncio.create_task(coro))
        return tasks[-1]

    yield run
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# ---- poison request --------------------------------------------------------------------------------


async def test_a_request_that_crashes_the_engine_call_is_dead_lettered_and_the_gateway_told(
    bus: Bus, namespace: str, spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = dict(heartbeat_interval_s=0.05, heartbeat_ttl_s=0.2, max_deliveries=2)
    w = PrefillWorker(worker_settings(namespace, "prefill-first", **settings))
    engine = FakeEngine(crash=True)
    await with_engine(w, engine)
    await w.setup()
    req = GenerateRequest("poison", "gw-poison", [1, 2, 3], SamplingParams(max_tokens=4).to_dict(), seed=7)
    await bus.send(bus.keys.requests, req)

    # delivery 1 crashes the intake's engine call, delivery 2 (the reclaim loop takes back its own
    # entry) crashes it again; both leave the entry pending, and delivery 3 is over max_deliveries
    loops = [
        spawn(w.consume(bus.keys.requests, PREFILL_GROUP, w._on_request, w._intake_capacity, w.stopping)),
        spawn(w._reclaim_loop()),
    ]
    await eventually(lambda: bus.redis.xlen(bus.keys.dead_letter), timeout_s=30)

    [(_, fields)] = await bus.redis.xrange(bus.keys.dead_letter)
    assert decode(fields[b"m"]) == req
    assert fields[b"reason"] == b"delivered 3 times"
    assert (await bus.redis.xpending(bus.keys.requests, PREFILL_GROUP))["pending"] == 0
    [(_, reply)] = await bus.redis.xrange(bus.keys.replies("gw-poison"))
    assert decode(reply[b"m"]) == TokenBatch([TokenUpdate(
        req_id="poison", attempt=0, index=0, token_ids=[], finish_reason="abort", worker_id="prefill-first",
        error="the request failed 2 times; giving up",
    )])  # fmt: skip
    assert "admitting poison (delivery 2) failed; it stays pending" in caplog.text

    # the worker survived its poison and serves the next request
    engine.crash = False
    good = GenerateRequest("good", "gw-poison", [4, 5], SamplingParams(max_tokens=4).to_dict(), seed=7)
    await bus.send(bus.keys.requests, good)
    await eventually(lambda: _async("good" in w._tracked))
    assert engine.num_waiting == 1
    assert not any(loop.done() for loop in loops)
    w.stopping.set()
    w.engine.shutdown()
    await w.bus.close()


async def test_a_request_is_tracked_before_the_engine_takes_it(
    bus: Bus, namespace: str, spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
) -> None:
    """The engine thread may prefill a request in the step right after taking it, before the
    admission resumes on the event loop, and exports its handoff only where the worker tracks it;
    a request the engine rejects is tracked no more."""
    w = PrefillWorker(worker_settings(namespace, "prefill-tracked"))
    tracked_when_added: dict[str, bool] = {}

    def on_add(req_id: str) -> None:
        tracked_when_added[req_id] = req_id in w._tracked
        if req_id == "invalid":
            raise ValueError("a prompt the engine refuses")

    await with_engine(w, FakeEngine(on_add=on_add))
    await w.setup()
    spawn(w.consume(bus.keys.requests, PREFILL_GROUP, w._on_request, w._intake_capacity, w.stopping))
    for req_id in ("early", "invalid"):
        await bus.send(bus.keys.requests, GenerateRequest(
            req_id, "gw-tracked", [1, 2, 3], SamplingParams(max_tokens=4).to_dict(), seed=7))  # fmt: skip
    await eventually(lambda: bus.redis.xlen(bus.keys.replies("gw-tracked")), timeout_s=30)  # the rejection
    assert tracked_when_added == {"early": True, "invalid": True}
    assert set(w._tracked) == {"early"}
    w.stopping.set()
    w.engine.shutdown()
    await w.bus.close()


async def test_entries_waiting_behind_a_slow_engine_are_not_reclaimed_by_their_own_worker(
    bus: Bus, namespace: str, spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # one read takes all three requests; each admission waits on the engine thread far longer than
    # the reclaim loop's idle limit, so the later entries sit read but unhandled past it
    settings = dict(heartbeat_interval_s=0.05, heartbeat_ttl_s=0.1, max_deliveries=1)
    w = PrefillWorker(worker_settings(namespace, "prefill-slow", **settings))
    engine = FakeEngine(admit_delay_s=0.5)
    await with_engine(w, engine)
    await w.setup()
    for i in range(3):
        await bus.send(bus.keys.requests, GenerateRequest(
            f"slow-{i}", "gw-slow", [1, 2, 3], SamplingParams(max_tokens=4).to_dict(), seed=7))  # fmt: skip
    spawn(w.consume(bus.keys.requests, PREFILL_GROUP, w._on_request, w._intake_capacity, w.stopping))
    spawn(w._reclaim_loop())
    await eventually(lambda: _async(len(w._tracked) == 3 and engine.num_waiting == 3), timeout_s=30)

    pending = await bus.redis.xpending_range(bus.keys.requests, PREFILL_GROUP, min="-", max="+", count=10)
    # delivered once each: the reclaim loop took none back (with max_deliveries 1 it would have
    # dead-lettered them, healthy as they are)
    assert [p["times_delivered"] for p in pending] == [1, 1, 1]
    assert await bus.redis.xlen(bus.keys.dead_letter) == 0
    assert "taking over" not in caplog.text
    w.stopping.set()
    w.engine.shutdown()
    await w.bus.close()


# ---- overload ----------------------------------------------------------------------------------------


async def test_an_overloaded_gateway_rejects_at_once_and_keeps_nothing_of_the_rejected(
    start: Start, worker: FakeWorker, bus: Bus
) -> None:
    client = await start(max_queued_requests="1")
    gw = client.server.app[GATEWAY]
    held = asyncio.create_task(post(client, "/v1/completions", {"prompt": "Hello", "max_tokens": 1}))
    req = await worker.next_request()

    statuses: list[tuple[int, str | None]] = []
    for _ in range(40):  # 2,000 requests, 50 at a time
        replies = await asyncio.gather(*(post(client, "/v1/completions", {"prompt": "Hello"}) for _ in range(50)))
        statuses += [(status, headers.get("Retry-After")) for status, _, headers in replies]
    assert statuses == [(429, "1")] * 2000
    assert await bus.redis.xlen(bus.keys.requests) == 1
    assert (len(gw.dispatcher._inflight), len(gw.router._requests), gw.admission.num_requests) == (1, 1, 1)

    await worker.reply(req, [WORLD], finish_reason="length")
    assert (await held)[0] == 200
    assert (len(gw.dispatcher._inflight), len(gw.router._requests)) == (0, 0)
    assert (gw.admission.num_requests, gw.admission.num_prompt_tokens) == (0, 0)
    assert await bus.redis.xlen(bus.keys.requests) == 1  # only the admitted one was ever queued


# ---- stuck worker ------------------------------------------------------------------------------------


class IdleWorker(Worker):
    role = "stub"


async def test_a_worker_whose_engine_holds_work_without_progress_stops_heartbeating(
    bus: Bus, namespace: str, spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]]
) -> None:
    now = [1000.0]
    settings = worker_settings(namespace, "stub-0", heartbeat_interval_s=0.02, heartbeat_ttl_s=60, stuck_after_s=5)
    w = IdleWorker(settings)
    engine = FakeEngine()
    await with_engine(w, engine, EngineThread(clock=lambda: now[0]))
    await w.engine.call(engine.add_request)  # holds work from now on
    num_checks = [0]
    stalled_s = w.engine.stalled_s

    def counted_stalled_s() -> float:
        num_checks[0] += 1
        return stalled_s()

    w.engine.stalled_s = counted_stalled_s  # type: ignore[method-assign]
    alive = bus.keys.alive("stub-0")
    spawn(w._heartbeat_loop())
    await eventually(lambda: bus.redis.exists(alive))
    assert w.health()[0] == 200

    now[0] += 4.9  # busy but within the bound: still beating
    await bus.redis.delete(alive)
    await eventually(lambda: bus.redis.exists(alive))

    now[0] += 0.2  # 5.1 s without a step while holding work
    await eventually(lambda: _async(w._is_stuck))
    await bus.redis.delete(alive, bus.keys.workers("stub"))
    seen = num_checks[0]
    await eventually(lambda: _async(num_checks[0] >= seen + 10))  # ten more turns of the loop
    assert (await bus.redis.exists(alive, bus.keys.workers("stub"))) == 0
    code, body = w.health()
    assert (code, body["status"], body["stalled_s"]) == (503, "stuck", 5.1)

    await w.engine.step()  # progress: it beats again
    await eventually(lambda: bus.redis.exists(alive))
    assert w.health()[0] == 200
    assert isinstance(decode((await bus.redis.hgetall(bus.keys.workers("stub")))[b"stub-0"]), WorkerStatus)
    w.stopped.set()
    w.engine.shutdown()
    await w.bus.close()


async def _async(value: Any) -> Any:
    return value


# ---- the wire --------------------------------------------------------------------------------------


async def test_every_stream_entry_and_status_in_redis_is_a_protocol_message(
    start: Start, worker: FakeWorker, bus: Bus, namespace: str
) -> None:
    client = await start()
    await worker.heartbeat("decode", worker.worker_id)
    done = asyncio.create_task(post(client, "/v1/completions", {"prompt": "Hello", "max_tokens": 2}))
    req = await worker.next_request()
    await worker.reply(req, [WORLD])
    await worker.reply(req, [WORLD], index=1, finish_reason="length")
    assert (await done)[0] == 200

    async with client.post(
        "/v1/completions", json={"prompt": "Hello", "stream": True, "max_tokens": 50}
    ) as resp:  # the client leaves after the first token: the gateway cancels
        streamed = await worker.next_request()
        await worker.reply(streamed, [WORLD])
        await resp.content.readline()
    await eventually(lambda: worker.inbox())

    types: list[str] = []
    async for key in bus.redis.scan_iter(f"{namespace}:*"):
        kind = (await bus.redis.type(key)).decode()
        if kind == "stream":
            for _, fields in await bus.redis.xrange(key):
                assert list(fields) == [b"m"], key
                types.append(decode(fields[b"m"]).TYPE)
        elif kind == "hash":
            types += [decode(value).TYPE for value in (await bus.redis.hgetall(key)).values()]
    # the gateway trims its replies stream as it reads, so token batches may be gone already
    assert types.count(GenerateRequest.TYPE) == 2
    assert {"cancel", WorkerStatus.TYPE} <= set(types) <= {GenerateRequest.TYPE, TokenBatch.TYPE, WorkerStatus.TYPE, "cancel"}
