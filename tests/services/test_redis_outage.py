"""Redis outages against the gateway's real app: a private redis-server (never the shared one) is
stopped and started again empty, while the test plays the workers through `Bus`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.gateway.app import create_app
from services.launcher.redis_server import RedisServer
from shared.protocol import Cancel, GenerateRequest
from shared.settings import GatewayServiceSettings, RedisSettings
from shared.streams import Bus, with_backoff
from shared.text.tokenizer import Tokenizer
from tests.services.gateway_harness import (
    BANG,
    WORLD,
    FakeWorker,
    eventually,
    post,
    sse_events,
)

pytestmark = pytest.mark.timeout(120)

GATEWAY_ID = "gw-outage"


@pytest.fixture
async def bus(redis_server: RedisServer) -> AsyncIterator[Bus]:
    bus = Bus(RedisSettings(url=redis_server.url, namespace=f"outage-{uuid.uuid4().hex[:8]}", socket_timeout_s=2))
    yield bus
    await bus.close()


@pytest.fixture
async def client(bus: Bus, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[TestClient]:
    async with _client(bus, tokenizer, monkeypatch) as client:
        yield client


@contextlib.asynccontextmanager
async def _client(bus: Bus, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[TestClient]:
    """The gateway's real app on `bus`'s Redis, started now."""
    monkeypatch.setenv("LLMD_REDIS__URL", bus.settings.url)
    monkeypatch.setenv("LLMD_REDIS__NAMESPACE", bus.settings.namespace)
    monkeypatch.setenv("LLMD_REDIS__SOCKET_TIMEOUT_S", "2")
    monkeypatch.setenv("LLMD_GATEWAY__GATEWAY_ID", GATEWAY_ID)
    async with TestClient(TestServer(create_app(GatewayServiceSettings(), tokenizer))) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    from shared.model.paths import default_model_path

    return Tokenizer.from_path(str(default_model_path()))


async def restart_empty(server: RedisServer, bus: Bus) -> None:
    await asyncio.to_thread(server.stop)
    await asyncio.to_thread(server.start)
    await bus.redis.connection_pool.disconnect()  # the test's own connections: the gateway must cope alone


async def next_request(worker: FakeWorker) -> GenerateRequest:
    async with asyncio.timeout(60):
        return await worker.next_request()


async def test_in_flight_request_is_requeued_after_redis_restarts_empty(
    client: TestClient, bus: Bus, redis_server: RedisServer
) -> None:
    worker = FakeWorker(bus)
    call = asyncio.create_task(client.post("/v1/completions", json={"prompt": "Hello", "stream": True}))
    req = await next_request(worker)
    await worker.reply(req, [WORLD])
    await eventually(lambda: _is_empty(bus, bus.keys.replies(GATEWAY_ID)))  # the gateway took the token

    await restart_empty(redis_server, bus)
    worker._last_id = b"0-0"  # the requests stream is new
    again = await next_request(worker)
    assert (again.req_id, again.attempt, again.output_token_ids) == (req.req_id, 1, [WORLD])
    # the worker that held the lost attempt is told to drop it, fenced: a newer attempt there runs on
    assert await worker.inbox() == [Cancel(req.req_id, "re-queued as attempt 1 after Redis lost its data", attempt=0)]
    await worker.reply(req, [BANG], index=1, finish_reason="stop")  # the lost attempt's late reply: dropped
    await worker.reply(again, [BANG], index=1, finish_reason="stop")

    resp = await call
    events = sse_events(await resp.read())
    assert resp.status == 200
    assert "".join(e["choices"][0]["text"] for e in events) == " world!"
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, "stop"]


async def test_redis_down_is_503_with_retry_after_and_recovers_without_restart(
    client: TestClient, bus: Bus, redis_server: RedisServer
) -> None:
    await asyncio.to_thread(redis_server.stop)
    status, body, headers = await post(client, "/v1/completions", {"prompt": "Hello"})
    assert (status, headers["Retry-After"]) == (503, "1")
    assert body["error"] == {
        "message": "The request queue (Redis) is unavailable; retry later.", "type": "server_error",
        "param": None, "code": None,
    }  # fmt: skip
    async with client.get("/ready") as resp:
        assert (resp.status, (await resp.json())["reason"]) == (503, f"Redis at {bus.settings.url} is unreachable")
    async with client.get("/health") as resp:
        assert resp.status == 200  # the process is fine; only readiness depends on Redis

    await asyncio.to_thread(redis_server.start)
    await bus.redis.connection_pool.disconnect()
    worker = FakeWorker(bus)
    call = asyncio.create_task(post(client, "/v1/completions", {"prompt": "Hello"}))
    req = await next_request(worker)
    await worker.reply(req, [WORLD, BANG], finish_reason="stop")
    status, body, _ = await call
    assert (status, body["choices"][0]["text"]) == (200, " world!")
    await worker.heartbeat("prefill", "prefill-1")
    await worker.heartbeat("decode", "decode-1")
    async with client.get("/ready") as resp:
        assert resp.status == 200


async def test_a_gateway_started_while_redis_is_down_answers_503_until_it_is_back(
    bus: Bus, tokenizer: Tokenizer, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    await asyncio.to_thread(redis_server.stop)  # before the gateway's reply reader ever reached Redis
    async with _client(bus, tokenizer, monkeypatch) as client:
        status, body, headers = await post(client, "/v1/completions", {"prompt": "Hello"})
        assert (status, headers["Retry-After"], body["error"]["message"]) == (
            503, "1", "The request queue (Redis) is unavailable; retry later.",
        )  # fmt: skip

        await asyncio.to_thread(redis_server.start)
        await bus.redis.connection_pool.disconnect()
        worker = FakeWorker(bus)
        call = asyncio.create_task(post(client, "/v1/completions", {"prompt": "Hello"}))
        await worker.reply(await next_request(worker), [WORLD], finish_reason="stop")
        assert (await call)[0] == 200


async def test_a_request_is_not_requeued_while_redis_keeps_its_data(client: TestClient, bus: Bus) -> None:
    worker = FakeWorker(bus)
    call = asyncio.create_task(post(client, "/v1/completions", {"prompt": "Hello"}))
    req = await next_request(worker)
    await asyncio.sleep(1.5)  # several epoch checks of the gateway pass
    assert await bus.redis.xlen(bus.keys.requests) == 1
    await worker.reply(req, [WORLD], finish_reason="stop")
    assert (await call)[0] == 200


async def _is_empty(bus: Bus, stream: str) -> bool:
    return bool(await bus.redis.exists(stream)) and await bus.redis.xlen(stream) == 0


async def test_connections_pooled_before_a_restart_serve_the_commands_after_it(
    bus: Bus, redis_server: RedisServer
) -> None:
    # several connections in the pool at once, as a gateway's concurrent requests leave it
    await asyncio.gather(*(bus.redis.blpop([f"{bus.keys.namespace}:idle:{i}"], timeout=0.2) for i in range(4)))
    assert len(bus.redis.connection_pool._available_connections) == 4
    await asyncio.to_thread(redis_server.stop)
    await asyncio.to_thread(redis_server.start)
    # each stale connection fails on its first use; the command must go again on a fresh one
    keys = [f"{bus.keys.namespace}:after:{i}" for i in range(4)]
    await asyncio.gather(*(bus.redis.set(key, 1) for key in keys))
    assert await bus.redis.exists(*keys) == 4


async def test_an_outage_is_logged_once_when_it_begins_and_once_when_it_ends(
    bus: Bus, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    await asyncio.to_thread(redis_server.stop)
    caplog.set_level(logging.INFO, logger="shared.streams")
    write = asyncio.create_task(with_backoff(lambda: bus.redis.set(f"{bus.keys.namespace}:k", 1), "writing k"))
    await eventually(lambda: _failure_logged(caplog))
    await asyncio.sleep(1.0)  # several more retries (50, 100, 200, 400 ms apart)
    await asyncio.to_thread(redis_server.start)
    assert await write is True
    lines = [(r.levelname, r.message.split(" (")[0].split(" after")[0]) for r in caplog.records
             if r.message.startswith("writing k")]
    assert lines == [("WARNING", "writing k: Redis unavailable"), ("INFO", "writing k: Redis reachable again")]


async def _failure_logged(caplog: pytest.LogCaptureFixture) -> bool:
    return any(r.message.startswith("writing k: Redis unavailable") for r in caplog.records)
