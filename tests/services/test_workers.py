"""Prefill and decode workers as real subprocesses on a real Redis with the real model; the test
plays the gateway (and, for the handoff-timeout test, a prefill worker) through the protocol."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from services.decode.reservation import Reservation
from services.decode.worker import DecodeWorker
from services.kv_transfer import RedisKVConnector
from services.launcher import Stack, StackConfig
from services.launcher.redis_server import RedisServer, free_port
from services.prefill.placement import AcceptBoard, DecodePicker
from services.prefill.worker import PrefillWorker
from services.runtime.engine_thread import EngineThread
from services.runtime.health import create_health_app
from services.runtime.worker import Worker
from shared.engine.engine import EngineStats, RequestOutput
from shared.engine.kv_cache_manager import KVCacheStats
from shared.engine.policy import StepPolicy
from shared.engine.request import ReqId
from shared.engine.sampling_params import SamplingParams
from shared.model.loader import LoadedModel
from shared.protocol import (
    Cancel,
    HandoffAccept,
    HandoffOffer,
    KVReady,
    Message,
    WorkerStatus,
)
from shared.settings import KVCacheSettings, ModelSettings, RedisSettings, WorkerServiceSettings, WorkerSettings
from shared.streams import INBOX_GROUP, with_backoff
from tests.services.stack_client import (
    REDIS_URL,
    WAIT_S,
    FakeGateway,
    block_bytes,
    eventually,
    offline_greedy,
)

pytestmark = pytest.mark.timeout(600)

NUM_BLOCKS = 96
HANDOFF_TIMEOUT_S = 3.0
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


def prompt(n: int, offset: int = 0) -> list[int]:
    return [(offset * 7919 + i * 104729) % 49000 + 50 for i in range(n)]


@pytest.fixture(scope="module")
def stack(loaded_model: LoadedModel) -> Iterator[Stack]:
    config = StackConfig(
        num_prefill=2, num_decode=2, gateway=False, redis_url=REDIS_URL, namespace=f"test-workers-{uuid.uuid4().hex[:8]}",
        dtype="float32",
        env={
            "LLMD_KV_CACHE__MEMORY_BYTES": str(NUM_BLOCKS * block_bytes(loaded_model)),
            "LLMD_WORKER__HEARTBEAT_INTERVAL_S": "0.2",
            "LLMD_WORKER__HEARTBEAT_TTL_S": "2",
            "LLMD_WORKER__HANDOFF_TIMEOUT_S": str(HANDOFF_TIMEOUT_S),
        },
    )
    with Stack(config) as stack:
        yield stack
        assert stack.exited() == {}, "a worker died during the tests"


@pytest.fixture
async def gateway(stack: Stack) -> AsyncIterator[FakeGateway]:
    gateway = FakeGateway(stack.namespace, gateway_id=f"gw-{uuid.uuid4().hex[:6]}")
    yield gateway
    await gateway.close()


async def test_tokens_equal_the_offline_engine_and_the_first_comes_from_prefill(
    gateway: FakeGateway, loaded_model: LoadedModel
) -> None:
    prompts = [prompt(5), prompt(16, 1), prompt(37, 2)]
    for i, p in enumerate(prompts):
        await gateway.submit(f"greedy-{i}", p, GREEDY)
    replies = await gateway.finish(*(f"greedy-{i}" for i in range(len(prompts))))

    expected = offline_greedy(loaded_model, prompts, GREEDY)
    for i, reply in enumerate(replies.values()):
        assert reply.token_ids == expected[i]
        assert reply.error is None
        first, *rest = reply.updates
        assert (first.index, first.worker_id.split("-")[0]) == (0, "prefill")
        assert {u.worker_id.split("-")[0] for u in rest} == ({"decode"} if rest else set())
        assert reply.finish_reason == ("length" if len(expected[i]) == GREEDY.max_tokens else "stop")
    await gateway.until_all_blocks_free()


async def test_sixteen_concurrent_requests_complete_and_every_worker_serves_some(
    gateway: FakeGateway, loaded_model: LoadedModel
) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [prompt(8 + 3 * i, 100 + i) for i in range(16)]
    await gateway.submit_many({f"many-{i}": p for i, p in enumerate(prompts)}, params)
    replies = await gateway.finish(*(f"many-{i}" for i in range(16)))

    expected = offline_greedy(loaded_model, prompts, params)
    assert [r.token_ids for r in replies.values()] == expected
    assert all(r.finish_reason == "length" for r in replies.values())
    served = {w for r in replies.values() for w in r.worker_ids}
    assert served == {"prefill-0", "prefill-1", "decode-0", "decode-1"}
    await gateway.until_all_blocks_free()


async def test_a_seeded_rerun_after_streamed_tokens_continues_with_the_same_tokens(gateway: FakeGateway) -> None:
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    await gateway.submit("first-run", prompt(20, 5), params, seed=99)
    first = (await gateway.finish("first-run"))["first-run"].token_ids

    await gateway.submit("re-run", prompt(20, 5), params, seed=99, attempt=1, output_token_ids=first[:3])
    rerun = (await gateway.finish("re-run"))["re-run"]

    assert [(u.index, u.attempt) for u in rerun.updates[:2]] == [(3, 1), (4, 1)]
    assert [rerun.tokens[i] for i in range(3, 8)] == first[3:]
    assert rerun.finish_reason == "length"


async def test_a_cancel_of_an_older_attempt_is_ignored_and_one_of_the_held_attempt_frees_the_blocks(
    gateway: FakeGateway,
) -> None:
    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
    await gateway.submit("doomed", prompt(40, 3), params, attempt=1)  # a re-run: attempt 0 was lost
    reply = gateway.replies["doomed"]
    await gateway.until(lambda: len(reply.tokens) >= 3, "decode tokens of the doomed request")
    prefill_id, decode_id = reply.worker_ids[0], reply.worker_ids[-1]
    assert (prefill_id.split("-")[0], decode_id.split("-")[0]) == ("prefill", "decode")

    # the cancel of attempt 0 reaches the decode worker directly and through the prefill worker
    # (which forwards cancels of requests it handed over): both times attempt 1 runs on
    for worker_id in (decode_id, prefill_id):
        await gateway.bus.send(gateway.keys.inbox(worker_id), Cancel("doomed", "attempt 0 is lost", attempt=0))
        await _until_inbox_read(gateway, worker_id)
    await _until_inbox_read(gateway, decode_id)
    num_tokens = len(reply.tokens)
    await gateway.until(lambda: len(reply.tokens) >= num_tokens + 3, "more tokens after the stale cancels")

    await gateway.bus.send(gateway.keys.inbox(decode_id), Cancel("doomed", "client disconnected", attempt=1))

    await gateway.until_all_blocks_free()
    await gateway.poll()
    assert reply.finish_reason is None and len(reply.tokens) < 500


async def test_cancel_mark_and_expired_deadline_answer_without_running(gateway: FakeGateway) -> None:
    await gateway.bus.redis.set(gateway.keys.cancelled("marked"), b"1", ex=60)
    await gateway.submit("marked", prompt(12), GREEDY)
    await gateway.submit("late", prompt(12), GREEDY, deadline=time.time() - 1)
    await gateway.submit("bad", [1, 2, 10**7], GREEDY)

    replies = await gateway.finish("marked", "late", "bad")

    assert [(r.token_ids, r.finish_reason) for r in replies.values()] == [([], "abort")] * 3
    assert replies["marked"].error is None
    assert "deadline" in (replies["late"].error or "")
    assert "outside the vocabulary" in (replies["bad"].error or "")


async def test_a_reservation_whose_kv_never_comes_is_freed_and_the_gateway_told(gateway: FakeGateway) -> None:
    """The test plays a prefill worker that dies after its offer was accepted."""
    await gateway.until_all_blocks_free()
    decode = (await gateway.workers("decode"))[0]
    ghost = f"ghost-prefill-{uuid.uuid4().hex[:6]}"
    offer = HandoffOffer(
        req_id="orphan", attempt=0, gateway_id=gateway.gateway_id, prefill_id=ghost,
        prompt_token_ids=prompt(40, 4), output_token_ids=[42], output_logprobs=[], output_top_logprobs=[],
        params=GREEDY.to_dict(), seed=1, num_cached_tokens=0, num_blocks=3,
    )
    await gateway.bus.send(decode.inbox, offer)
    accept = await _read_one(gateway, gateway.keys.inbox(ghost))
    assert accept == HandoffAccept("orphan", 0, decode.worker_id, needed_blocks=[0, 1, 2], kv_shm=accept.kv_shm,
                                   kv_token=accept.kv_token)
    assert len(accept.kv_token) == 32  # a transfer over its data port must show this token
    await gateway.until_status(
        lambda ss: _status(ss, decode.worker_id).free_blocks == decode.total_blocks - 3, "decode", "the reservation"
    )

    await gateway.until_status(
        lambda ss: _status(ss, decode.worker_id).free_blocks == decode.total_blocks, "decode", "the reservation to lapse"
    )

    # KV that turns up after the reservation lapsed is dropped, bytes included
    connector = RedisKVConnector(gateway.bus.redis, gateway.keys, ttl_s=60)
    location = await connector.put("orphan", 0, torch.zeros(3, 1))
    await gateway.bus.send(decode.inbox, KVReady("orphan", 0, [0, 1, 2], location, 12))
    await eventually(lambda: _missing(gateway, location), "the late KV bytes to be discarded")
    reply = (await gateway.finish("orphan"))["orphan"]
    assert (reply.token_ids, reply.finish_reason, reply.worker_ids) == ([], "abort", [decode.worker_id])
    assert f"did not arrive from {ghost}" in (reply.error or "")


async def test_a_burst_of_offers_is_answered_within_a_step_or_two_not_one_step_each(loaded_model: LoadedModel) -> None:
    """A decode worker in this process, kept busy by a long request: the offers of a burst wait for
    the step in progress together, so their answers go out within a step or two of each other."""
    settings = WorkerServiceSettings(
        redis=RedisSettings(url=REDIS_URL, namespace=f"test-offers-{uuid.uuid4().hex[:8]}"),
        model=ModelSettings(dtype="float32"),
        kv_cache=KVCacheSettings(memory_bytes=NUM_BLOCKS * block_bytes(loaded_model)),
        worker=WorkerSettings(worker_id="decode-burst", health_port=0, handoff_timeout_s=60),
    )
    worker = DecodeWorker(settings)
    answered_at_step: dict[str, int] = {}
    answer = worker._answer

    async def answer_and_note_the_step(offer: HandoffOffer, held: Reservation | None) -> None:
        answered_at_step[offer.req_id] = worker.engine.num_steps
        await answer(offer, held)

    worker._answer = answer_and_note_the_step  # type: ignore[method-assign]
    try:
        await worker.start(handle_signals=False)
        engine = worker.engine.engine
        busy = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
        await worker.engine.call(engine.add_request, "busy", prompt(64, 9), busy)
        worker.wake_engine()
        await eventually(_async(lambda: worker.engine.num_steps >= 3), "the decode worker to be stepping")

        offers = [
            HandoffOffer(
                req_id=f"offer-{i}", attempt=0, gateway_id="gw-burst", prefill_id="prefill-burst",
                prompt_token_ids=prompt(20, 10 + i), output_token_ids=[42], output_logprobs=[],
                output_top_logprobs=[], params=GREEDY.to_dict(), seed=i, num_cached_tokens=0, num_blocks=2,
            )
            for i in range(8)
        ]
        await asyncio.gather(*(worker.bus.send(worker.inbox, offer) for offer in offers))
        await eventually(_async(lambda: len(answered_at_step) == len(offers)), "answers to every offer")

        steps = sorted(answered_at_step.values())
        assert steps[-1] - steps[0] <= 2, f"answered at steps {steps}: the offers waited for a step each"
        assert set(worker._reserved) == {offer.req_id for offer in offers}
        for offer in offers:
            await worker.bus.send(worker.inbox, Cancel(offer.req_id, "test over", attempt=0))
        await eventually(_async(lambda: not worker._reserved), "the reservations to be dropped")
    finally:
        worker.stopped.set()
        await worker.close()


async def test_a_drain_ends_once_redis_has_been_gone_longer_than_the_heartbeat_ttl(
    loaded_model: LoadedModel, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker told to drain while Redis is down cannot deliver what it computes, and once its
    heartbeat has lapsed the others have taken its work over: it stops instead of draining forever,
    and the outage costs one warning per loop, not one per retry."""
    settings = WorkerServiceSettings(
        redis=RedisSettings(url=redis_server.url, namespace=f"test-drain-{uuid.uuid4().hex[:8]}", socket_timeout_s=1),
        model=ModelSettings(dtype="float32"),
        kv_cache=KVCacheSettings(memory_bytes=NUM_BLOCKS * block_bytes(loaded_model)),
        worker=WorkerSettings(worker_id="decode-drain", health_port=0, heartbeat_interval_s=0.2, heartbeat_ttl_s=2),
    )
    worker = DecodeWorker(settings)
    try:
        await worker.start(handle_signals=False)
        busy = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
        await worker.engine.call(worker.engine.engine.add_request, "held", prompt(64, 3), busy)
        worker.wake_engine()
        await asyncio.to_thread(redis_server.stop)
        worker.request_stop()
        async with asyncio.timeout(WAIT_S):
            await worker._drain_when_asked()
        assert worker.stopped.is_set() and worker.engine.has_work
        assert any("no heartbeat reached Redis for over 2s while draining" in r.message for r in caplog.records)
        heartbeat_warnings = [r for r in caplog.records if r.levelname == "WARNING" and r.message.startswith("heartbeat")]
        assert len(heartbeat_warnings) == 1, [r.message for r in heartbeat_warnings]
    finally:
        worker.stopped.set()
        await worker.close()


async def test_a_stop_while_starting_without_redis_ends_the_worker(
    loaded_model: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker told to stop before it serves holds no work: it stops, instead of waiting for a
    Redis that may never come (the launcher that started it and its private Redis are gone)."""
    settings = WorkerServiceSettings(
        redis=RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0", socket_timeout_s=1),  # nothing listens
        model=ModelSettings(dtype="float32"),
        kv_cache=KVCacheSettings(memory_bytes=NUM_BLOCKS * block_bytes(loaded_model)),
        worker=WorkerSettings(worker_id="decode-orphan", health_port=0),
    )
    worker = DecodeWorker(settings)
    run = asyncio.create_task(worker.run(handle_signals=False))

    async def waiting_for_redis() -> bool:
        return any("creating consumer groups: Redis unavailable" in r.message for r in caplog.records)

    await eventually(waiting_for_redis, "the worker to wait for Redis")
    worker.request_stop()
    async with asyncio.timeout(WAIT_S):
        await run
    assert not worker.serving and not worker.failed


async def _read_one(gateway: FakeGateway, stream: str) -> object:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        entries = await gateway.bus.read(stream, b"0", 1, 200)
        if entries:
            return entries[0][1]
    raise AssertionError(f"nothing arrived on {stream}")


async def _until_inbox_read(gateway: FakeGateway, worker_id: str) -> None:
    """Until the worker has handled every message in its inbox (it acknowledges each once handled)."""
    inbox = gateway.keys.inbox(worker_id)

    async def all_handled() -> bool:
        last_id = (await gateway.bus.redis.xinfo_stream(inbox))["last-generated-id"]
        [group] = await gateway.bus.redis.xinfo_groups(inbox)
        return bool(group["last-delivered-id"] == last_id and group["pending"] == 0)

    await eventually(all_handled, f"{worker_id} to handle its inbox")


async def _missing(gateway: FakeGateway, key: str) -> bool:
    return not await gateway.bus.redis.exists(key)


def _status(statuses: list[WorkerStatus], worker_id: str) -> WorkerStatus:
    return next(s for s in statuses if s.worker_id == worker_id)


# -- in-process pieces: no model needed ------------------------------------------------------------


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


async def test_engine_thread_runs_every_call_on_one_thread_and_tells_stalls_from_idleness() -> None:
    now = [100.0]
    thread = EngineThread(clock=lambda: now[0])
    engine = FakeEngine()
    thread._engine = engine  # type: ignore[assignment]
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
    thread = EngineThread()
    engine = FakeEngine()
    thread._engine = engine  # type: ignore[assignment]
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
    thread = EngineThread()
    engine = FakeEngine()
    thread._engine = engine  # type: ignore[assignment]
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


def _async(check: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def run() -> bool:
        return check()

    return run


class FakeBus:
    def __init__(self, statuses: list[WorkerStatus]) -> None:
        self.statuses = statuses

    async def live_workers(self, role: str) -> list[WorkerStatus]:
        assert role == "decode"
        return self.statuses


def decode_status(worker_id: str, free_blocks: int, num_running: int, draining: bool = False) -> WorkerStatus:
    return WorkerStatus(worker_id, "decode", f"inbox:{worker_id}", free_blocks, 100, num_running, 0,
                        timestamp=time.time() - 1, draining=draining)


async def test_decode_picker_prefers_free_blocks_then_fewer_running_and_counts_its_own_placements() -> None:
    picker = DecodePicker(FakeBus([  # type: ignore[arg-type]
        decode_status("d-a", free_blocks=50, num_running=1),
        decode_status("d-b", free_blocks=60, num_running=3),
        decode_status("d-c", free_blocks=60, num_running=2),
        decode_status("d-draining", free_blocks=100, num_running=0, draining=True),
    ]))
    assert [s.worker_id for s in await picker.candidates(num_blocks=4)] == ["d-c", "d-b", "d-a"]
    assert await picker.candidates(num_blocks=101) == []

    picker.record("d-c", 20)  # not in d-c's heartbeat yet: 40 free, 3 running as far as we know

    assert [s.worker_id for s in await picker.candidates(num_blocks=4)] == ["d-b", "d-a", "d-c"]


async def test_accept_board_hands_an_answer_only_to_the_handoff_that_asked_that_worker() -> None:
    board = AcceptBoard()
    future = board.expect("r", 1, "d-a")

    assert not board.resolve(HandoffAccept("r", 1, "d-b", [0]))  # a worker we no longer wait for
    assert not board.resolve(HandoffAccept("r", 0, "d-a", [0]))  # an older attempt
    assert board.resolve(HandoffAccept("r", 1, "d-a", [0, 1]))
    assert (await future).needed_blocks == [0, 1]
    board.forget("r", 1)
    assert not board.resolve(HandoffAccept("r", 1, "d-a", [0, 1]))


@dataclass
class InboxReader:
    """A decode worker reading its inbox on a private Redis (`server`), the ids of the Cancels it read in `got`."""

    server: RedisServer
    worker: DecodeWorker
    got: list[str]

    def start(self) -> asyncio.Task[None]:
        async def handle(entry_id: bytes, msg: Message | None) -> None:
            assert isinstance(msg, Cancel)
            self.got.append(msg.req_id)
            await self.worker.ack(self.worker.inbox, INBOX_GROUP, entry_id)

        worker = self.worker
        return asyncio.create_task(worker.consume(worker.inbox, INBOX_GROUP, handle, lambda: 8, worker.stopped))


@contextlib.asynccontextmanager
async def inbox_reader(name: str) -> AsyncIterator[InboxReader]:
    server = RedisServer()
    url = await asyncio.to_thread(server.start)
    worker = DecodeWorker(WorkerServiceSettings(
        redis=RedisSettings(url=url, namespace=name, socket_timeout_s=1), worker=WorkerSettings(worker_id=f"d-{name}")
    ))
    try:
        await worker.setup()
        yield InboxReader(server, worker, [])
    finally:
        await worker.bus.close()
        worker.engine.shutdown()
        await asyncio.to_thread(server.stop)


async def test_a_reader_survives_redis_restarting_and_recreates_its_consumer_group() -> None:
    async with inbox_reader("restart") as inbox:
        worker = inbox.worker
        reader = inbox.start()
        await worker.bus.send(worker.inbox, Cancel("before"))
        await eventually(_async(lambda: inbox.got == ["before"]), "the first message")

        await asyncio.to_thread(inbox.server.stop)
        await asyncio.to_thread(inbox.server.start)  # same port, empty: the stream and its group are gone
        await with_backoff(lambda: worker.bus.send(worker.inbox, Cancel("after")), "send")

        await eventually(_async(lambda: inbox.got == ["before", "after"]), "a message after the restart")
        worker.stopped.set()
        await reader


async def test_a_reader_refused_by_redis_warns_once_and_reads_again_once_allowed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="services.runtime.worker")
    async with inbox_reader("refused") as inbox:  # a private Redis: its ACL changes
        worker = inbox.worker
        reading = f"reading {worker.inbox}"
        await worker.bus.redis.acl_setuser("default", enabled=True, reset_keys=False, commands=["-xreadgroup"])
        reader = inbox.start()
        await eventually(_async(lambda: any(r.message.startswith(f"{reading}: Redis refused it")
                                            for r in caplog.records)), "the refusal logged")
        await asyncio.sleep(1.0)  # several more refused reads (50, 100, 200, 400 ms apart)
        await worker.bus.redis.acl_setuser("default", enabled=True, reset_keys=False, commands=["+xreadgroup"])
        await worker.bus.send(worker.inbox, Cancel("allowed"))
        await eventually(_async(lambda: inbox.got == ["allowed"]), "a message once the read is allowed")
        worker.stopped.set()
        await reader
    lines = [(r.levelname, r.message.split(" (")[0].split(" after")[0]) for r in caplog.records
             if r.message.startswith(reading)]
    assert lines == [("WARNING", f"{reading}: Redis refused it"), ("INFO", f"{reading}: Redis accepts it again")]


async def test_close_ends_a_reader_that_swallowed_its_cancel() -> None:
    """A reader that runs until the drain begins, whose cancel redis-py swallowed (as it can on Python
    3.11 when the cancel lands mid-command): close() must still end it instead of waiting forever."""
    worker = DecodeWorker(WorkerServiceSettings(
        redis=RedisSettings(url=REDIS_URL, namespace=f"test-close-{uuid.uuid4().hex[:8]}"),
        worker=WorkerSettings(worker_id="d-close"),
    ))
    read_group = worker.bus.read_group
    swallowed: list[bool] = []

    async def read_swallowing_one_cancel(*args: Any) -> list[tuple[bytes, Message | None]]:
        try:
            return await read_group(*args)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed.append(True)
            return []

    worker.bus.read_group = read_swallowing_one_cancel  # type: ignore[method-assign]

    async def handle(entry_id: bytes, msg: Message | None) -> None:
        raise AssertionError("nothing is sent")

    await worker.setup()
    worker._tasks = [asyncio.create_task(worker.consume(worker.inbox, INBOX_GROUP, handle, lambda: 8, worker.stopping))]
    await asyncio.sleep(0.1)  # the reader is inside a blocking read
    async with asyncio.timeout(WAIT_S):
        await worker.close()
    assert swallowed == [True]


@pytest.mark.parametrize("worker_cls", [PrefillWorker, DecodeWorker])
async def test_health_is_503_until_the_engine_loads_and_metrics_use_vllm_names(worker_cls: type[Worker]) -> None:
    settings = WorkerServiceSettings(redis=RedisSettings(url=REDIS_URL, namespace="test-health"))
    worker = worker_cls(settings)
    async with TestClient(TestServer(create_health_app(worker))) as client:
        health = await client.get("/health")
        assert (health.status, (await health.json())["status"]) == (503, "loading")
        metrics = await (await client.get("/metrics")).text()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "llmd_handoff_bytes_total", "llmd_handoff_seconds_bucket", "llmd_torch_threads"):
        assert f"\n{name}{{" in metrics, name
    await worker.bus.close()
    worker.engine.shutdown()
