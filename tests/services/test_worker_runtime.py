"""The worker runtime (services/runtime) in the test process without a model: a stream reader on a
private Redis that restarts or refuses reads, close() ending a reader whose cancel was swallowed,
and the health app of a worker still loading."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.decode.worker import DecodeWorker
from services.launcher.redis_server import RedisServer
from services.prefill.worker import PrefillWorker
from services.runtime.health import create_health_app
from services.runtime.worker import Worker
from shared.protocol import Cancel, Message
from shared.settings import RedisSettings, WorkerServiceSettings, WorkerSettings
from shared.streams import INBOX_GROUP, with_backoff
from tests.services.stack_client import REDIS_URL, WAIT_S, as_async, eventually

pytestmark = pytest.mark.timeout(600)


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
        await eventually(as_async(lambda: inbox.got == ["before"]), "the first message")

        await asyncio.to_thread(inbox.server.stop)
        await asyncio.to_thread(inbox.server.start)  # same port, empty: the stream and its group are gone
        await with_backoff(lambda: worker.bus.send(worker.inbox, Cancel("after")), "send")

        await eventually(as_async(lambda: inbox.got == ["before", "after"]), "a message after the restart")
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
        await eventually(as_async(lambda: any(r.message.startswith(f"{reading}: Redis refused it")
                                             for r in caplog.records)), "the refusal logged")
        await asyncio.sleep(1.0)  # several more refused reads (50, 100, 200, 400 ms apart)
        await worker.bus.redis.acl_setuser("default", enabled=True, reset_keys=False, commands=["+xreadgroup"])
        await worker.bus.send(worker.inbox, Cancel("allowed"))
        await eventually(as_async(lambda: inbox.got == ["allowed"]), "a message once the read is allowed")
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
