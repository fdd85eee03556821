"""What the gateway's tests share: the real app against the real Redis, and `FakeWorker`, which plays
the workers through `Bus` and protocol messages: it reads each GenerateRequest off the requests
stream and answers with TokenBatches on the gateway's replies stream."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, TypeVar

import pytest
from aiohttp.test_utils import TestClient, TestServer
from openai import AsyncOpenAI

from services.gateway.app import create_app
from shared.model.paths import default_model_path
from shared.protocol import GenerateRequest, Message, TokenBatch, TokenUpdate, WorkerStatus, decode
from shared.settings import GatewayServiceSettings, RedisSettings
from shared.streams import Bus
from shared.text.tokenizer import Tokenizer

REDIS_URL = os.environ["REDIS_URL"]
GATEWAY_ID = "gw-test"
MODEL = default_model_path().stem
HELLO, WORLD, BANG, IM_END = 19556, 905, 17, 2  # "Hello", " world", "!", "<|im_end|>"
T = TypeVar("T")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_path(str(default_model_path()))


@pytest.fixture
def namespace(monkeypatch: pytest.MonkeyPatch) -> str:
    namespace = f"test-gateway-{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("LLMD_REDIS__URL", REDIS_URL)
    monkeypatch.setenv("LLMD_REDIS__NAMESPACE", namespace)
    monkeypatch.setenv("LLMD_GATEWAY__GATEWAY_ID", GATEWAY_ID)
    return namespace


@pytest.fixture
async def bus(namespace: str) -> AsyncIterator[Bus]:
    bus = Bus(RedisSettings(url=REDIS_URL, namespace=namespace))
    yield bus
    keys = [key async for key in bus.redis.scan_iter(f"{namespace}:*")]
    if keys:
        await bus.redis.delete(*keys)
    await bus.close()


Start = Callable[..., Awaitable[TestClient]]


@pytest.fixture
async def start(bus: Bus, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Start]:
    """Starts a gateway whose settings come from the environment; keyword arguments set LLMD_GATEWAY__<NAME>."""
    async with AsyncExitStack() as stack:

        async def start_gateway(**gateway_env: str) -> TestClient:
            for name, value in gateway_env.items():
                monkeypatch.setenv(f"LLMD_GATEWAY__{name.upper()}", value)
            app = create_app(GatewayServiceSettings(), tokenizer)
            return await stack.enter_async_context(TestClient(TestServer(app)))

        yield start_gateway


@pytest.fixture
async def client(start: Start) -> TestClient:
    return await start()


@asynccontextmanager
async def openai_client(client: TestClient, api_key: str = "unused") -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=api_key, max_retries=0) as oai:
        yield oai


class FakeWorker:
    """Plays the worker pools: takes GenerateRequests off the requests stream, answers with TokenBatches."""

    def __init__(self, bus: Bus, worker_id: str = "decode-7") -> None:
        self.bus = bus
        self.worker_id = worker_id
        self._last_id = b"0-0"

    async def next_request(self) -> GenerateRequest:
        while True:
            entries = await self.bus.read(self.bus.keys.requests, self._last_id, count=1, block_ms=100)
            if entries:
                self._last_id, msg = entries[0]
                assert isinstance(msg, GenerateRequest)
                return msg

    async def reply(
        self, req: GenerateRequest, token_ids: list[int], index: int = 0, finish_reason: str | None = None,
        **fields: Any,
    ) -> None:
        update = TokenUpdate(
            req_id=req.req_id, attempt=fields.pop("attempt", req.attempt), index=index, token_ids=token_ids,
            finish_reason=finish_reason, num_prompt_tokens=len(req.prompt_token_ids),
            worker_id=fields.pop("worker_id", self.worker_id), **fields,
        )  # fmt: skip
        await self.bus.send(self.bus.keys.replies(req.gateway_id), TokenBatch([update]))

    async def inbox(self, worker_id: str | None = None) -> list[Message]:
        entries = await self.bus.redis.xrange(self.bus.keys.inbox(worker_id or self.worker_id))
        return [decode(fields[b"m"]) for _, fields in entries]

    async def heartbeat(self, role: str, worker_id: str, draining: bool = False) -> None:
        status = WorkerStatus(worker_id, role, self.bus.keys.inbox(worker_id), 100, 100, 0, 0, time.time(), draining)
        await self.bus.publish_status(status, ttl_s=30)


@pytest.fixture
def worker(bus: Bus) -> FakeWorker:
    return FakeWorker(bus)


async def eventually(probe: Callable[[], Awaitable[T]], timeout_s: float = 10.0) -> T:
    """The first truthy value of `probe`; fails the test if none comes (the bound only stops a hang)."""
    async with asyncio.timeout(timeout_s):
        while not (value := await probe()):
            await asyncio.sleep(0.01)
    return value


async def post(client: TestClient, path: str, body: Any, **kwargs: Any) -> tuple[int, dict[str, Any], dict[str, str]]:
    data = json.dumps(body) if isinstance(body, (dict, list)) else body
    async with client.post(path, data=data, headers={"Content-Type": "application/json"}, **kwargs) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


def sse_events(raw: bytes) -> list[Any]:
    events = [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]
