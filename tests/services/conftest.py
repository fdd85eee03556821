"""Fixtures the service test modules share. A module that starts a stack defines `stack`; `client`
(its gateway's `openai` client), `model` and `rds` build on it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis
from openai import OpenAI

from services.launcher import Stack
from services.launcher.redis_server import RedisServer
from tests.services.stack_client import REDIS_URL, FakeGateway
from tests.services.stacks import openai_client


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[OpenAI]:
    with openai_client(stack) as client:
        yield client


@pytest.fixture
async def gateway(stack: Stack) -> AsyncIterator[FakeGateway]:
    """Plays a gateway of its own on the module's stack, through the protocol."""
    gateway = FakeGateway(stack.namespace, gateway_id=f"gw-{uuid.uuid4().hex[:6]}")
    yield gateway
    await gateway.close()


@pytest.fixture(scope="module")
def model(client: OpenAI) -> str:
    """The id the stack serves."""
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def rds(stack: Stack) -> Iterator[redis.Redis]:
    """A plain Redis client next to a module's stack, to inspect streams and heartbeats."""
    client = redis.Redis.from_url(REDIS_URL)
    yield client
    client.close()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A private Redis server of the test's own, for tests that stop or restart it."""
    server = RedisServer()
    server.start()
    yield server
    server.stop()
