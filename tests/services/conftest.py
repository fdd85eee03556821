"""Fixtures the service test modules share. A module that starts a stack defines `stack` and an
OpenAI `client` for it; `model` and `rds` build on those."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from openai import OpenAI

from services.launcher import Stack
from services.launcher.redis_server import RedisServer
from tests.services.stack_client import REDIS_URL


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
