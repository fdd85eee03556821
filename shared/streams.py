"""Redis Streams helpers: key names, connection, consumer groups, safe trimming, heartbeats.

All Redis I/O of the services goes through `Bus`; the key layout is defined here once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.outage_log import OutageLog
from shared.protocol import Message, WorkerStatus, decode, encode
from shared.settings import RedisSettings

logger = logging.getLogger(__name__)

PREFILL_GROUP = "prefill"
INBOX_GROUP = "worker"
# The worker roles that can run each stage of a request: colocated workers prefill and decode
STAGE_ROLES = {"prefill": ("prefill", "colocated"), "decode": ("decode", "colocated")}
REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)
# how long a blocking read may wait: it bounds how late a reader notices it should stop (a cancel
# alone is not enough: on Python 3.11 one that lands while redis-py sends a command can be swallowed)
READ_BLOCK_MS = 200
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Keys:
    """The Redis key layout of one deployment (`namespace`)."""

    namespace: str

    @property
    def requests(self) -> str:
        return f"{self.namespace}:requests"

    def routed_requests(self, worker_id: str) -> str:
        """Requests a gateway routed to one prefill worker (same consumer group as `requests`)."""
        return f"{self.namespace}:requests:{worker_id}"

    @property
    def routed_workers(self) -> str:
        """The set of prefill workers that have a `routed_requests` stream, live or dead."""
        return f"{self.namespace}:routed-workers"

    @property
    def kv_events(self) -> str:
        return f"{self.namespace}:kv_events"

    def kv_snapshot(self, worker_id: str) -> str:
        return f"{self.namespace}:kv_snapshot:{worker_id}"

    @property
    def dead_letter(self) -> str:
        return f"{self.namespace}:dead-letter"

    def replies(self, gateway_id: str) -> str:
        return f"{self.namespace}:replies:{gateway_id}"

    def inbox(self, worker_id: str) -> str:
        return f"{self.namespace}:inbox:{worker_id}"

    def workers(self, role: str) -> str:
        return f"{self.namespace}:workers:{role}"

    def alive(self, worker_id: str) -> str:
        return f"{self.namespace}:alive:{worker_id}"

    def cancelled(self, req_id: str) -> str:
        return f"{self.namespace}:cancelled:{req_id}"

    def kv_blob(self, req_id: str, attempt: int) -> str:
        return f"{self.namespace}:kv:{req_id}:{attempt}"

    def epoch(self, gateway_id: str) -> str:
        """A gateway's mark in Redis: gone means Redis lost its data (restart without persistence, flush)."""
        return f"{self.namespace}:epoch:{gateway_id}"


class Bus:
    """One Redis connection pool plus the stream operations the services use."""

    def __init__(self, settings: RedisSettings) -> None:
        self.settings = settings
        self.keys = Keys(settings.namespace)
        # A burst of requests queues for a free connection instead of failing: redis-py's plain pool
        # refuses a command outright once max_connections are in use (100 by default).
        pool = aioredis.BlockingConnectionPool.from_url(
            settings.url,
            max_connections=settings.max_connections,
            timeout=settings.socket_timeout_s,
            socket_timeout=settings.socket_timeout_s,
            socket_connect_timeout=settings.socket_timeout_s,
            health_check_interval=10,
            # a pooled connection from before a Redis restart fails on its first use: the command goes
            # again on a fresh one instead of failing a request. Timeouts are not retried: the server
            # may have run the command (an XADD twice)
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=2, supported_errors=(RedisConnectionError,)),
        )
        self.redis = aioredis.Redis.from_pool(pool)

    async def close(self) -> None:
        await self.redis.aclose()

    async def ping(self) -> bool:
        try:
            return bool(await self.redis.ping())
        except REDIS_ERRORS:
            return False

    async def send(self, stream: str, msg: Message) -> bytes:
        return await self.redis.xadd(stream, {"m": encode(msg)})

    async def ensure_group(self, stream: str, group: str) -> None:
        try:
            await self.redis.xgroup_create(stream, group, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def read_group(
        self, stream: str, group: str, consumer: str, count: int, block_ms: int
    ) -> list[tuple[bytes, Message | None]]:
        """New entries for this consumer; undecodable ones come back as None so they can be dead-lettered."""
        reply = await self.redis.xreadgroup(group, consumer, {stream: ">"}, count=count, block=block_ms)
        return [(entry_id, _decode_entry(fields)) for _, entries in reply or [] for entry_id, fields in entries]

    async def read(
        self, stream: str, last_id: bytes, count: int, block_ms: int, trim_through: bytes | None = None
    ) -> list[tuple[bytes, Message | None]]:
        """Entries after `last_id`; `trim_through`: first drop the entries up to that id, in the same
        round trip (a stream's only reader trims what it read before, without a second call per read)."""
        if trim_through is None:
            reply = await self.redis.xread({stream: last_id}, count=count, block=block_ms)
        else:
            pipe = self.redis.pipeline(transaction=False)
            pipe.xtrim(stream, minid=_next_id(trim_through), approximate=False)
            pipe.xread({stream: last_id}, count=count, block=block_ms)
            _, reply = await pipe.execute()
        return [(entry_id, _decode_entry(fields)) for _, entries in reply or [] for entry_id, fields in entries]

    async def ack(self, stream: str, group: str, *entry_ids: bytes) -> None:
        if entry_ids:
            await self.redis.xack(stream, group, *entry_ids)

    async def trim_acknowledged(self, stream: str, group: str) -> None:
        """Drop entries every consumer of `group` has acknowledged, and nothing else."""
        pending = await self.redis.xpending(stream, group)
        if pending and pending.get("pending"):
            min_id = pending["min"]
        else:
            groups = await self.redis.xinfo_groups(stream)
            last = next((g["last-delivered-id"] for g in groups if _text(g["name"]) == group), None)
            if last is None:
                return
            min_id = _next_id(last)
        await self.redis.xtrim(stream, minid=min_id, approximate=False)

    async def publish_status(self, status: WorkerStatus, ttl_s: float) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(self.keys.workers(status.role), status.worker_id, encode(status))
        pipe.set(self.keys.alive(status.worker_id), b"1", px=int(ttl_s * 1000))
        await pipe.execute()

    async def deregister(self, role: str, worker_id: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.hdel(self.keys.workers(role), worker_id)
        pipe.delete(self.keys.alive(worker_id))
        await pipe.execute()

    async def live_workers(self, role: str) -> list[WorkerStatus]:
        """Workers of a role whose heartbeat has not lapsed."""
        raw = await self.redis.hgetall(self.keys.workers(role))
        statuses = [decode(v) for v in raw.values()]
        if not statuses:
            return []
        alive = await self.redis.mget([self.keys.alive(s.worker_id) for s in statuses])  # type: ignore[attr-defined]
        return [s for s, a in zip(statuses, alive) if a is not None and isinstance(s, WorkerStatus)]


def _decode_entry(fields: dict[bytes, bytes]) -> Message | None:
    try:
        return decode(fields[b"m"])
    except (KeyError, ValueError) as e:
        logger.error("dropping undecodable stream entry: %s", e)
        return None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _next_id(entry_id: bytes | str) -> str:
    ms, seq = _text(entry_id).split("-")
    return f"{ms}-{int(seq) + 1}"


async def with_backoff(
    op: Callable[[], Awaitable[T]], what: str, stop: asyncio.Event | None = None, max_delay_s: float = 2.0
) -> T | None:
    """Retry `op` on Redis connection errors with exponential backoff; None if `stop` was set meanwhile."""
    delay = 0.05
    outage = OutageLog(logger, what)
    while stop is None or not stop.is_set():
        try:
            result = await op()
        except REDIS_ERRORS as e:
            outage.failed(e)
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_delay_s)
        else:
            outage.recovered()
            return result
    return None


def now() -> float:
    return time.time()
