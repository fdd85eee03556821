"""Moves a request's KV blocks from the prefill worker that computed them to a decode worker.

`KVConnector` is the seam: the prefill side `put`s a tensor and sends the returned location in
KVReady; the decode side `get`s it, writes it into its pool, then `discard`s it. Locations are
opaque strings, so a faster transport (shared memory, RDMA) can replace the Redis one without
touching the workers.

`RedisKVConnector` keeps one hash per transfer under `keys.kv_blob(req_id, attempt)`, so it works
across hosts with nothing but Redis and TCP:

    header  msgpack {"dtype": "float32", "shape": [n, layers, 2, block_size, kv_heads, head_dim]}
    data    the tensor's raw bytes in C order (never pickle)

Every blob carries a TTL, so the bytes of a transfer whose reader died do not outlive it.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import msgpack
import redis.asyncio as aioredis
import torch

from shared.streams import Keys

_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int32)
}


class KVTransferError(RuntimeError):
    """The bytes of a transfer are gone (expired, discarded) or do not describe a tensor."""


class KVConnector(ABC):
    @abstractmethod
    async def put(self, req_id: str, attempt: int, tensor: torch.Tensor) -> str:
        """Store a tensor for one transfer; returns the location a reader passes to `get`."""

    @abstractmethod
    async def get(self, location: str) -> torch.Tensor:
        """The tensor stored at `location`, on the CPU; raises KVTransferError if it is gone."""

    @abstractmethod
    async def discard(self, location: str) -> None:
        """Free the bytes of a finished or abandoned transfer; a missing location is not an error."""


def pack_header(tensor: torch.Tensor) -> bytes:
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise TypeError(f"KV tensors of dtype {tensor.dtype} cannot be transferred")
    return msgpack.packb({"dtype": dtype, "shape": list(tensor.shape)})


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor, without a copy when it is already contiguous."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)  # [numel]
    return memoryview(flat.view(torch.uint8).numpy())


def unpack_tensor(header: bytes, data: bytes) -> torch.Tensor:
    try:
        meta = msgpack.unpackb(header)
        dtype, shape = _DTYPES[meta["dtype"]], tuple(int(d) for d in meta["shape"])
    except (ValueError, KeyError, TypeError) as e:
        raise KVTransferError(f"malformed KV header: {e!r}") from e
    expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if len(data) != expected:
        raise KVTransferError(f"KV blob holds {len(data)} bytes; {meta['dtype']}{list(shape)} needs {expected}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    # bytearray: torch.frombuffer needs a writable buffer to hand out a tensor that owns its memory
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


class RedisKVConnector(KVConnector):
    def __init__(self, redis: aioredis.Redis, keys: Keys, ttl_s: float) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_ms = max(1, int(ttl_s * 1000))

    async def put(self, req_id: str, attempt: int, tensor: torch.Tensor) -> str:
        location = self.keys.kv_blob(req_id, attempt)
        header, data = pack_header(tensor), tensor_bytes(tensor)
        # one transaction: a blob never exists without its TTL
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(location)
        pipe.hset(location, mapping={"header": header, "data": data})  # type: ignore[dict-item]
        pipe.pexpire(location, self.ttl_ms)
        await pipe.execute()
        return location

    async def get(self, location: str) -> torch.Tensor:
        header, data = await self.redis.hmget(location, ["header", "data"])  # type: ignore[misc]
        if header is None or data is None:
            raise KVTransferError(f"no KV blob at {location!r} (expired or already discarded)")
        return unpack_tensor(header, data)

    async def discard(self, location: str) -> None:
        await self.redis.delete(location)
