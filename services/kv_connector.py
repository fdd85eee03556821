"""Moves a request's KV blocks from the prefill worker that computed them to a decode worker.

`KVConnector` is the seam: the prefill side `put`s a tensor and sends the returned location in
KVReady; the decode side `get`s it, writes it into its pool, then `discard`s it. Locations are
opaque strings, so a faster transport (shared memory, RDMA) can replace the Redis one without
touching the workers.

`KVTransports` picks the transport per transfer: `SharedMemoryKVConnector` when the two workers
share a tmpfs (one host, or containers given one /dev/shm), `RedisKVConnector` otherwise.

`RedisKVConnector` keeps one hash per transfer under `keys.kv_blob(req_id, attempt)`, so it works
across hosts with nothing but Redis and TCP:

    header               msgpack {"dtype": "float32", "shape": [n, layers, 2, block_size, kv_heads, head_dim],
                         "chunks": k}
    data:0 .. data:k-1   the tensor's raw bytes in C order (never pickle), `chunk_bytes` each but the last

The bytes move one chunk per Redis call. A single call for a long prompt's KV (315 MiB at 7k
tokens in float32) outlasted the client's socket timeout, and it held Redis's one thread, and
with it every token stream, for as long. Every blob carries a TTL, so the bytes of a transfer
whose reader died do not outlive it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import mmap
import os
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path

import msgpack
import redis.asyncio as aioredis
import torch

from shared.streams import Keys

logger = logging.getLogger(__name__)

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


CHUNK_BYTES = 8 * 2**20


def pack_header(dtype: torch.dtype, shape: Sequence[int], num_chunks: int) -> bytes:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise TypeError(f"KV tensors of dtype {dtype} cannot be transferred")
    return msgpack.packb({"dtype": name, "shape": list(shape), "chunks": num_chunks})


def unpack_header(header: bytes) -> tuple[torch.dtype, tuple[int, ...], int]:
    """(dtype, shape, number of data chunks) of a blob's header."""
    try:
        meta = msgpack.unpackb(header)
        return _DTYPES[meta["dtype"]], tuple(int(d) for d in meta["shape"]), int(meta["chunks"])
    except (ValueError, KeyError, TypeError) as e:
        raise KVTransferError(f"malformed KV header: {e!r}") from e


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor, without a copy when it is already contiguous."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)  # [numel]
    return memoryview(flat.view(torch.uint8).numpy())


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
        expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
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


SHM_SCHEME = "shm:"


class SharedMemoryKVConnector(KVConnector):
    """Transfers between workers that share a tmpfs directory (/dev/shm): one file per transfer,
    written with one copy and mapped by the reader, where Redis costs a round trip per 8 MiB
    chunk and copies through its own memory and two sockets.

    A file is `<header length: u32 LE><msgpack header as in Redis><the tensor's raw bytes>`,
    written under a temporary name and renamed, so a reader never sees half of one. Each
    worker also keeps an empty marker file, `<prefix>worker-<token>`: a prefill worker that
    finds the decode worker's marker in its own directory knows that they share it (containers
    on one host each have their own /dev/shm unless given one). Files have no TTL in a tmpfs, so
    `sweep` removes transfers older than `ttl_s`, which a reader that died left behind, and
    markers not refreshed for as long, which a killed worker left behind.
    """

    def __init__(self, directory: str | Path, namespace: str, ttl_s: float) -> None:
        self.directory = Path(directory)
        self.prefix = f"llmd-{namespace}-"
        self.ttl_s = ttl_s
        self.token = secrets.token_hex(8)
        self._marker = self._worker_marker(self.token)
        self._refresh_failed = False

    def _worker_marker(self, token: str) -> Path:
        return self.directory / f"{self.prefix}worker-{token}"

    def advertise(self) -> bool:
        """Create this worker's marker; False (logged) where the directory cannot take files."""
        try:
            self._marker.touch()
        except OSError as e:
            logger.warning("KV handoffs go through Redis only: %s is not usable (%s)", self.directory, e)
            return False
        return True

    def refresh(self) -> None:
        """Show that this worker is alive: a marker older than ttl_s is swept as a dead worker's.
        A marker that disappeared anyway (removed by hand, or the tmpfs was cleared) is recreated."""
        try:
            os.utime(self._marker)
            self._refresh_failed = False
            return
        except FileNotFoundError:
            pass
        except OSError as e:
            self._warn_once(f"could not refresh the KV marker {self._marker} ({e}); prefill workers may use Redis")
            return
        try:
            self._marker.touch()
        except OSError as e:
            self._warn_once(f"could not recreate the KV marker {self._marker} ({e}); prefill workers may use Redis")
            return
        logger.warning("the KV marker %s had disappeared; recreated it", self._marker)
        self._refresh_failed = False

    def _warn_once(self, message: str) -> None:
        """Log a failed refresh once, not every heartbeat until it succeeds again."""
        if not self._refresh_failed:
            logger.warning("%s", message)
        self._refresh_failed = True

    def withdraw(self) -> None:
        self._marker.unlink(missing_ok=True)

    def shares_with(self, token: str) -> bool:
        """Whether the worker that advertised `token` sees this worker's directory."""
        return bool(token) and token.isalnum() and self._worker_marker(token).exists()

    def _path_of(self, location: str) -> Path:
        """The file a location names, refused unless it is one of this deployment's transfers:
        locations arrive in messages, and `discard` deletes what they name."""
        name = location.removeprefix(SHM_SCHEME)
        path = self.directory / Path(name).name
        if not location.startswith(SHM_SCHEME) or str(path) != name or not path.name.startswith(f"{self.prefix}kv-"):
            raise KVTransferError(f"{location!r} is not a KV transfer in {self.directory}")
        return path

    async def put(self, req_id: str, attempt: int, tensor: torch.Tensor) -> str:
        def copy(out: torch.Tensor) -> None:
            # a memcpy, not a torch copy: on a helper thread that would start a second OpenMP team
            memoryview(out.view(torch.uint8).reshape(-1).numpy())[:] = tensor_bytes(tensor)

        return await self.put_filled(req_id, attempt, tensor.shape, tensor.dtype, copy)

    async def put_filled(
        self, req_id: str, attempt: int, shape: Sequence[int], dtype: torch.dtype,
        fill: Callable[[torch.Tensor], object],
    ) -> str:
        """A transfer whose bytes `fill(out)` writes into `out`, a tensor of that shape and dtype
        over the file's own pages: the KV goes from the pool to shared memory in one copy, with
        no buffer between to allocate and fault in. `fill` runs on a helper thread."""
        name = f"{self.prefix}kv-{secrets.token_hex(8)}-{attempt}"  # req ids come from clients: not in file names
        path = self.directory / name
        await asyncio.to_thread(self._write, path, tuple(shape), dtype, fill)
        return SHM_SCHEME + str(path)

    @staticmethod
    def _write(path: Path, shape: tuple[int, ...], dtype: torch.dtype, fill: Callable[[torch.Tensor], object]) -> None:
        header = pack_header(dtype, shape, 1)
        num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        tmp = path.with_name(path.name + ".tmp")
        try:
            with open(tmp, "w+b") as f:
                f.write(len(header).to_bytes(4, "little") + header)
                f.flush()
                offset = 4 + len(header)
                if num_bytes:
                    # every page now, or ENOSPC here: a full tmpfs would otherwise kill the process
                    # with SIGBUS in the middle of the copy into the mapping
                    os.posix_fallocate(f.fileno(), 0, offset + num_bytes)
                    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # map the pages in one call
                    with mmap.mmap(f.fileno(), offset + num_bytes, flags=flags) as mapped:
                        out = torch.frombuffer(mapped, dtype=torch.uint8, offset=offset, count=num_bytes)
                        fill(out.view(dtype).view(shape))
                        del out  # the mapping cannot close while a tensor still exports it
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    async def get(self, location: str) -> torch.Tensor:
        return await asyncio.to_thread(self._read, self._path_of(location))

    @staticmethod
    def _read(path: Path) -> torch.Tensor:
        """The file's tensor over a private mapping of its pages: no copy until the pool write,
        and the pages outlive the file's removal for as long as the tensor lives."""
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                # copy-on-write: torch.frombuffer wants a writable buffer, and the file stays as it is
                data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else b""
        except FileNotFoundError as e:
            raise KVTransferError(f"no KV transfer at {str(path)!r} (expired or already discarded)") from e
        if size < 4:
            raise KVTransferError(f"KV transfer at {str(path)!r} holds {size} bytes, not even a header")
        header_len = int.from_bytes(data[:4], "little")
        dtype, shape, _ = unpack_header(bytes(data[4 : 4 + header_len]))
        offset = 4 + header_len
        expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if len(data) - offset != expected:
            raise KVTransferError(
                f"KV transfer holds {len(data) - offset} bytes; {str(dtype).removeprefix('torch.')}{list(shape)} "
                f"needs {expected}"
            )
        if expected == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(data, dtype=torch.uint8, offset=offset).view(dtype).reshape(shape)

    async def discard(self, location: str) -> None:
        self._path_of(location).unlink(missing_ok=True)

    def sweep(self, now: float | None = None) -> int:
        """Remove this deployment's transfers and worker markers older than ttl_s (left by workers
        that were killed; a live worker refreshes its marker every heartbeat interval from its
        start, while its model still loads); returns how many."""
        cutoff = (time.time() if now is None else now) - self.ttl_s
        removed = 0
        for path in [*self.directory.glob(f"{self.prefix}kv-*"), *self.directory.glob(f"{self.prefix}worker-*")]:
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:  # its reader discarded it meanwhile
                continue
        return removed


class KVTransports:
    """The connector for each transfer: shared memory to a worker that shares this one's
    directory, Redis otherwise, and Redis again when writing the file fails (a full tmpfs: Docker
    gives a container 64 MiB of /dev/shm unless told otherwise). Reads and discards go by the
    location, so a reader takes whatever the writer chose."""

    def __init__(self, redis: RedisKVConnector, shm: SharedMemoryKVConnector | None) -> None:
        self.redis = redis
        self.shm = shm

    def start(self) -> None:
        """Advertise this worker's shared-memory marker; without a usable directory, Redis only."""
        if self.shm is not None and not self.shm.advertise():
            self.shm = None

    def close(self) -> None:
        if self.shm is not None:
            self.shm.withdraw()

    def refresh(self) -> None:
        if self.shm is not None:
            self.shm.refresh()

    def sweep(self) -> None:
        """Remove shared-memory transfers and markers that outlived their TTL (their worker died)."""
        if self.shm is not None and (removed := self.shm.sweep()):
            logger.warning("removed %d abandoned KV transfers or markers from %s", removed, self.shm.directory)

    @property
    def shm_token(self) -> str:
        """What a decode worker tells prefill workers (HandoffAccept.kv_shm); empty: Redis only."""
        return "" if self.shm is None else self.shm.token

    def _at(self, location: str) -> KVConnector:
        if location.startswith(SHM_SCHEME):
            if self.shm is None:
                raise KVTransferError(f"KV transfer {location!r} is in shared memory, which this worker does not use")
            return self.shm
        return self.redis

    async def put(
        self, req_id: str, attempt: int, shape: Sequence[int], dtype: torch.dtype,
        read: Callable[[torch.Tensor | None], torch.Tensor], peer_shm_token: str,
    ) -> str:
        """Store one transfer of `read(out)`'s bytes: `read` fills `out` (shared memory) or,
        given None, returns a tensor of its own (Redis). It runs on a helper thread."""
        if self.shm is not None and self.shm.shares_with(peer_shm_token):
            try:
                return await self.shm.put_filled(req_id, attempt, shape, dtype, read)
            except OSError as e:
                logger.warning("KV of %s goes through Redis: writing it to %s failed (%s)", req_id,
                               self.shm.directory, e)
        return await self.redis.put(req_id, attempt, await asyncio.to_thread(read, None))

    async def get(self, location: str) -> torch.Tensor:
        return await self._at(location).get(location)

    @staticmethod
    def transport_of(location: str) -> str:
        """The transport a location's bytes went through, as the metrics label it."""
        return "shm" if location.startswith(SHM_SCHEME) else "redis"

    async def discard(self, location: str) -> None:
        await self._at(location).discard(location)


def kv_transports(redis: aioredis.Redis, keys: Keys, namespace: str, shm_dir: str, ttl_s: float) -> KVTransports:
    """A worker's transports: Redis always, shared memory in `shm_dir` unless it is empty."""
    shm = SharedMemoryKVConnector(shm_dir, namespace, ttl_s) if shm_dir else None
    return KVTransports(RedisKVConnector(redis, keys, ttl_s), shm)
