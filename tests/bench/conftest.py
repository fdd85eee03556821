from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp.test_utils import TestServer

from tests.bench.stub_server import StubScript, StubServer

StartStub = Callable[[StubScript], Awaitable[tuple[StubServer, str]]]


@pytest.fixture
async def start_stub() -> AsyncIterator[StartStub]:
    """`stub, base_url = await start_stub(StubScript(...))` serves on a loopback port."""
    running: list[tuple[StubServer, TestServer]] = []

    async def start(script: StubScript) -> tuple[StubServer, str]:
        stub = StubServer(script)
        server = TestServer(stub.app(), host="127.0.0.1")
        await server.start_server()
        running.append((stub, server))
        return stub, str(server.make_url("")).rstrip("/")

    yield start
    for stub, server in running:
        stub.released.set()
        await server.close()
