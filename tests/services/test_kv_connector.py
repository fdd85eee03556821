"""The Redis KV connector against a real Redis: exact round trips, a self-describing header that
is not pickle, a TTL on every blob, and clear errors for bytes that are gone or damaged."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import msgpack
import pytest
import torch

from services.kv_transfer import KVTransferError, RedisKVConnector
from shared.settings import RedisSettings
from shared.streams import Bus
from tests.services.stack_client import REDIS_URL

pytestmark = pytest.mark.timeout(60)

KV_SHAPE = (3, 30, 2, 16, 3, 64)  # [num_blocks, layers, 2, block_size, kv_heads, head_dim] of SmolLM2-135M


@pytest.fixture
async def bus() -> AsyncIterator[Bus]:
    bus = Bus(RedisSettings(url=REDIS_URL, namespace=f"test-kv-{uuid.uuid4().hex[:8]}"))
    yield bus
    keys = [key async for key in bus.redis.scan_iter(f"{bus.keys.namespace}:*")]
    if keys:
        await bus.redis.delete(*keys)
    await bus.close()


@pytest.fixture
def connector(bus: Bus) -> RedisKVConnector:
    return RedisKVConnector(bus.redis, bus.keys, ttl_s=30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
async def test_round_trip_is_bit_exact(connector: RedisKVConnector, dtype: torch.dtype) -> None:
    kv = torch.randn(KV_SHAPE, generator=torch.Generator().manual_seed(0)).to(dtype)

    location = await connector.put("req-1", 2, kv)
    back = await connector.get(location)

    assert location == connector.keys.kv_blob("req-1", 2)
    assert (back.dtype, back.shape) == (dtype, kv.shape)
    assert torch.equal(back.view(torch.uint8), kv.view(torch.uint8))


async def test_non_contiguous_and_empty_tensors_round_trip(connector: RedisKVConnector) -> None:
    transposed = torch.arange(12, dtype=torch.float32).view(3, 4).t()
    empty = torch.empty(0, *KV_SHAPE[1:])
    assert torch.equal(await connector.get(await connector.put("t", 0, transposed)), transposed)
    assert (await connector.get(await connector.put("e", 0, empty))).shape == empty.shape


async def test_blob_is_a_msgpack_header_plus_raw_bytes_with_a_ttl(bus: Bus, connector: RedisKVConnector) -> None:
    kv = torch.ones(2, 3, dtype=torch.bfloat16)

    location = await connector.put("req-1", 0, kv)

    header, data = await bus.redis.hmget(location, ["header", "data:0"])
    assert msgpack.unpackb(header) == {"dtype": "bfloat16", "shape": [2, 3], "chunks": 1}
    assert data == kv.view(torch.uint8).numpy().tobytes()
    assert 0 < await bus.redis.pttl(location) <= 30_000


async def test_large_tensors_move_in_chunks_of_one_redis_call_each(bus: Bus) -> None:
    connector = RedisKVConnector(bus.redis, bus.keys, ttl_s=30, chunk_bytes=1000)
    kv = torch.randn(625, generator=torch.Generator().manual_seed(1))  # 2,500 bytes

    location = await connector.put("req-1", 0, kv)

    fields = await bus.redis.hgetall(location)
    assert msgpack.unpackb(fields[b"header"])["chunks"] == 3
    assert [len(fields[f"data:{i}".encode()]) for i in range(3)] == [1000, 1000, 500]
    assert b"".join(fields[f"data:{i}".encode()] for i in range(3)) == kv.numpy().tobytes()
    assert 0 < await bus.redis.pttl(location) <= 30_000
    assert torch.equal(await connector.get(location), kv)

    await bus.redis.hdel(location, "data:1")
    with pytest.raises(KVTransferError, match="lost chunk 1 of 3"):
        await connector.get(location)


async def test_discarded_bytes_are_gone_and_discard_is_idempotent(connector: RedisKVConnector) -> None:
    location = await connector.put("req-1", 0, torch.zeros(4))

    await connector.discard(location)
    await connector.discard(location)

    with pytest.raises(KVTransferError, match="expired or already discarded"):
        await connector.get(location)


async def test_damaged_blob_is_an_error_not_a_wrong_tensor(bus: Bus, connector: RedisKVConnector) -> None:
    location = await connector.put("req-1", 0, torch.zeros(4))
    await bus.redis.hset(location, "data:0", b"\x00" * 15)
    with pytest.raises(KVTransferError, match="holds 15 bytes; float32\\[4\\] needs 16"):
        await connector.get(location)

    await bus.redis.hset(location, "data:0", b"\x00" * 17)
    with pytest.raises(KVTransferError, match="holds over 16 bytes"):
        await connector.get(location)

    await bus.redis.hset(location, "header", msgpack.packb({"dtype": "object", "shape": [1], "chunks": 1}))
    with pytest.raises(KVTransferError, match="malformed KV header"):
        await connector.get(location)
