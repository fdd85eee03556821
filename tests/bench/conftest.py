from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp.test_utils import TestServer

from tests.bench.stub_server import StubScript, StubServer

StartStub = Callable[[StubScript], Awaitable[tuple[StubServer, str]]]


@pytest.fixture(autouse=True)
def small_kv_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmarks' stacks size their KV pools from memory (2 GiB a worker, zeroed at start) unless
    told otherwise; these small runs need a few blocks, and their stacks start a second or more sooner."""
    monkeypatch.setenv("LLMD_KV_CACHE__MEMORY_BYTES", str(64 * 2**20))


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
