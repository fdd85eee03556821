"""A decode worker run inside the test process on the real model, where the test can watch its
engine: the answers to a burst of handoff offers, a drain with Redis gone, and a stop before
Redis ever answered."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from services.decode.reservation import Reservation
from services.decode.worker import DecodeWorker
from services.launcher.redis_server import RedisServer, free_port
from shared.engine.sampling_params import SamplingParams
from shared.model.loader import LoadedModel
from shared.protocol import Cancel, HandoffOffer
from shared.settings import KVCacheSettings, ModelSettings, RedisSettings, WorkerServiceSettings, WorkerSettings
from tests.services.stack_client import REDIS_URL, WAIT_S, as_async, block_bytes, eventually, prompt

pytestmark = pytest.mark.timeout(600)

NUM_BLOCKS = 96
OFFERED_PARAMS = SamplingParams(max_tokens=10, temperature=0.0)


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
        await worker.start(owns_process=False)
        engine = worker.engine.engine
        busy = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
        await worker.engine.call(engine.add_request, "busy", prompt(64, 9), busy)
        worker.wake_engine()
        await eventually(as_async(lambda: worker.engine.num_steps >= 3), "the decode worker to be stepping")

        offers = [
            HandoffOffer(
                req_id=f"offer-{i}", attempt=0, gateway_id="gw-burst", prefill_id="prefill-burst",
                prompt_token_ids=prompt(20, 10 + i), output_token_ids=[42], output_logprobs=[],
                output_top_logprobs=[], params=OFFERED_PARAMS.to_dict(), seed=i, num_cached_tokens=0, num_blocks=2,
            )
            for i in range(8)
        ]
        await asyncio.gather(*(worker.bus.send(worker.inbox, offer) for offer in offers))
        await eventually(as_async(lambda: len(answered_at_step) == len(offers)), "answers to every offer")

        steps = sorted(answered_at_step.values())
        assert steps[-1] - steps[0] <= 2, f"answered at steps {steps}: the offers waited for a step each"
        assert set(worker._reserved) == {offer.req_id for offer in offers}
        for offer in offers:
            await worker.bus.send(worker.inbox, Cancel(offer.req_id, "test over", attempt=0))
        await eventually(as_async(lambda: not worker._reserved), "the reservations to be dropped")
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
        await worker.start(owns_process=False)
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
    run = asyncio.create_task(worker.run(owns_process=False))

    async def waiting_for_redis() -> bool:
        return any("creating consumer groups: Redis unavailable" in r.message for r in caplog.records)

    await eventually(waiting_for_redis, "the worker to wait for Redis")
    worker.request_stop()
    async with asyncio.timeout(WAIT_S):
        await run
    assert not worker.serving and not worker.failed
