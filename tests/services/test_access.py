"""Access to Redis: URLs with a password and with an ACL user work through `Bus`; a wrong one does
not. A private redis-server is started for this (never the shared one)."""

from __future__ import annotations

import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest
import redis

from services.launcher.redis_server import find_redis_server, free_port
from shared.protocol import Cancel
from shared.settings import RedisSettings
from shared.streams import Bus

pytestmark = pytest.mark.timeout(60)

PASSWORD = "s3cret-pw"
ACL_USER, ACL_PASSWORD = "llmd", "acl-pw"


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    port = free_port()
    with tempfile.TemporaryDirectory() as workdir:
        process = subprocess.Popen(
            [find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", workdir, "--requirepass", PASSWORD,
             "--user", ACL_USER, "on", f">{ACL_PASSWORD}", "~llmd-acl:*", "+@all"],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        client = redis.Redis(port=port, password=PASSWORD, socket_timeout=1)
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        client.close()
        yield port
        process.terminate()
        process.wait(timeout=10)


@pytest.mark.parametrize(
    ("userinfo", "namespace"), [(f":{PASSWORD}", "llmd-pw"), (f"{ACL_USER}:{ACL_PASSWORD}", "llmd-acl")]
)
async def test_password_and_acl_user_urls_work(port: int, userinfo: str, namespace: str) -> None:
    bus = Bus(RedisSettings(url=f"redis://{userinfo}@127.0.0.1:{port}/0", namespace=namespace))
    try:
        assert await bus.ping()
        await bus.send(bus.keys.requests, Cancel("req-1", "test"))
        entries = await bus.read(bus.keys.requests, b"0-0", count=10, block_ms=100)
        assert [msg for _, msg in entries] == [Cancel("req-1", "test")]
    finally:
        await bus.close()


@pytest.mark.parametrize("userinfo", [":wrong", f"{ACL_USER}:wrong", ""])
async def test_a_wrong_or_missing_password_is_refused(port: int, userinfo: str) -> None:
    bus = Bus(RedisSettings(url=f"redis://{userinfo}@127.0.0.1:{port}/0".replace("//@", "//"), namespace="llmd-acl"))
    try:
        assert not await bus.ping()
    finally:
        await bus.close()
