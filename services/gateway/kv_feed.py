"""Keeps the gateway's KV index current: the kv_events stream in, snapshots where it falls behind.

    XREAD <ns>:kv_events from where it left off -> KVIndex.on_events
    every SNAPSHOT_POLL_S: GET <ns>:kv_snapshot:<worker> of the stale and the unknown live workers

A gateway that starts reads from the stream's end and takes each worker's snapshot. When Redis
fails, the index is dropped (routing falls back to load until it is rebuilt): a Redis that came
back empty lost events nobody can replay, and the workers' next snapshots rebuild it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis.exceptions import ResponseError

from services.gateway.kv_index import KVIndex
from shared.protocol import KVEvents, KVSnapshot, ProtocolError, decode
from shared.streams import READ_BLOCK_MS, REDIS_ERRORS, Bus

logger = logging.getLogger(__name__)

READ_COUNT = 512
SNAPSHOT_POLL_S = 0.5
MAX_BACKOFF_S = 2.0
ROUTED_ROLES = ("prefill", "decode")


class KVIndexFeed:
    def __init__(self, bus: Bus, index: KVIndex) -> None:
        self.bus, self.index = bus, index
        self._last_id: bytes | None = None  # None: start at the stream's end
        self._polled_at = 0.0  # monotonic
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        delay = 0.05
        while not self._stopping.is_set():
            try:
                await self._read()
                if time.monotonic() - self._polled_at >= SNAPSHOT_POLL_S:
                    await self._catch_up()
                delay = 0.05
            except (*REDIS_ERRORS, ResponseError) as e:
                if self.index.workers:
                    logger.warning("KV events: Redis unavailable (%s); routing by load until the index is rebuilt", e)
                self.index.clear()
                self._last_id = None
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_BACKOFF_S)

    async def _read(self) -> None:
        stream = self.bus.keys.kv_events
        if self._last_id is None:
            # the end as an id, not "$": that would skip whatever arrives between two reads
            newest = await self.bus.redis.xrevrange(stream, count=1)
            self._last_id = newest[0][0] if newest else b"0-0"
        entries = await self.bus.read(stream, self._last_id, READ_COUNT, READ_BLOCK_MS)
        for entry_id, msg in entries:
            self._last_id = entry_id
            if isinstance(msg, KVEvents):
                self.index.on_events(msg)

    async def _catch_up(self) -> None:
        """Snapshots of the workers the index cannot follow: stale ones, and live ones it never heard of;
        the gone ones are dropped."""
        self._polled_at = time.monotonic()
        live = {s.worker_id for role in ROUTED_ROLES for s in await self.bus.live_workers(role)}
        for worker_id in [w for w in self.index.workers if w not in live]:
            self.index.forget(worker_id)
        wanted = sorted({*self.index.stale_workers, *(live - set(self.index.workers))})
        if not wanted:
            return
        raw = await self.bus.redis.mget([self.bus.keys.kv_snapshot(w) for w in wanted])
        for worker_id, data in zip(wanted, raw):
            if data is None:
                continue
            try:
                snap = decode(data)
            except ProtocolError as e:
                logger.error("KV snapshot of %s: %s", worker_id, e)
                continue
            if isinstance(snap, KVSnapshot) and not self.index.on_snapshot(snap):
                logger.debug("KV snapshot of %s (seq %d) predates events it missed; waiting for the next", worker_id,
                             snap.seq)
