"""KV through Redis: the last resort, for workers that share neither a tmpfs nor a network path
(or when forced with LLMD_WORKER__KV_TRANSPORT=redis). One hash per transfer under
`keys.kv_blob(req_id, attempt)`:

    header               msgpack {"dtype": "float32", "shape": [n, layers, 2, block_size, kv_heads, head_dim],
                         "chunks": k}
    data:0 .. data:k-1   the tensor's raw bytes in C order (never pickle), `chunk_bytes` each but the last

The bytes move one chunk per Redis call. A single call for a long prompt's KV (315 MiB at 7k
tokens in float32) outlasted the client's socket timeout, and it held Redis's one thread, and
with it every token stream, for as long. Every blob carries a TTL, so the bytes of a transfer
whose reader died do not outlive it. Copies: pool -> tensor -> Redis -> buffer -> pool, through
two sockets.
"""

from __future__ import annotations

import redis.asyncio as aioredis
import torch

from services.kv_transfer.base import KVConnector, KVTransferError, num_bytes, pack_header, tensor_bytes, unpack_header
from shared.streams import Keys

CHUNK_BYTES = 8 * 2**20


class RedisKVConnector(KVConnector):
    def __init__(self, redis: aioredis.Redis, keys: Keys, ttl_s: float, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.chunk_bytes = chunk_bytes

    async def put(self, req_id: str, attempt: int, tensor: torch.Tensor) -> str:
        location = self.keys.kv_blob(req_id, attempt)
        data = tensor_bytes(tensor)
        chunks = [data[start : start + self.chunk_bytes] for start in range(0, len(data), self.chunk_bytes)]
        # every call is a transaction that (re)sets the TTL: a blob never exists without one, even
        # should it expire between two chunks and an HSET create it afresh
        await self._write(location, {"header": pack_header(tensor.dtype, tensor.shape, len(chunks))}, replace=True)
        for i, chunk in enumerate(chunks):
            await self._write(location, {f"data:{i}": chunk})
        return location

    async def _write(self, location: str, fields: dict[str, bytes | memoryview], replace: bool = False) -> None:
        pipe = self.redis.pipeline(transaction=True)
        if replace:
            pipe.delete(location)
        pipe.hset(location, mapping=fields)  # type: ignore[arg-type]
        pipe.pexpire(location, self.ttl_ms)
        await pipe.execute()

    async def get(self, location: str) -> torch.Tensor:
        header = await self.redis.hget(location, "header")  # type: ignore[misc]
        if header is None:
            raise KVTransferError(f"no KV blob at {location!r} (expired or already discarded)")
        dtype, shape, num_chunks = unpack_header(header)
        expected = num_bytes(shape, dtype)
        described = f"{str(dtype).removeprefix('torch.')}{list(shape)} needs {expected}"
        # torch.frombuffer needs a writable buffer to hand out a tensor that owns its memory
        buffer = bytearray(expected)
        filled = 0
        for i in range(num_chunks):
            chunk = await self.redis.hget(location, f"data:{i}")  # type: ignore[misc]
            if chunk is None:
                raise KVTransferError(f"KV blob at {location!r} lost chunk {i} of {num_chunks} (expired or discarded)")
            if filled + len(chunk) > expected:
                raise KVTransferError(f"KV blob holds over {expected} bytes; {described}")
            buffer[filled : filled + len(chunk)] = chunk
            filled += len(chunk)
        if filled != expected:
            raise KVTransferError(f"KV blob holds {filled} bytes; {described}")
        if expected == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(shape)

    async def discard(self, location: str) -> None:
        await self.redis.delete(location)
