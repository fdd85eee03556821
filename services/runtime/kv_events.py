"""A worker's side of cache-aware routing: its prefix cache's changes out to the kv_events stream.

    engine thread: after every engine call, drain the block pool's event log -> KVEvents(seq + 1)
    event loop:    XADD the queued KVEvents to <ns>:kv_events (MAXLEN-trimmed); every
                   snapshot_interval_s, SET <ns>:kv_snapshot:<worker> to a KVSnapshot

Numbers are given on the engine thread, and a snapshot is taken there too, so a snapshot's
`seq` is exactly the last KVEvents it includes. Publishing is best effort: events lost to a
Redis outage show as a gap, and readers rebuild from the next snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque

from shared.engine.block_pool import BlockPool
from shared.engine.kv_events import BlockEventLog
from shared.outage_log import OutageLog
from shared.protocol import KVEvents, KVSnapshot, encode
from shared.settings import KVEventSettings
from shared.streams import REDIS_ERRORS, Bus

logger = logging.getLogger(__name__)


class KVEventSource:
    """Numbers a worker's prefix-cache changes; engine-thread methods say so."""

    def __init__(self, worker_id: str, role: str, block_size: int) -> None:
        self.worker_id, self.role, self.block_size = worker_id, role, block_size
        self.epoch = secrets.token_hex(8)  # a restart under the same worker id starts a new numbering
        self.seq = 0
        self.ready: deque[KVEvents] = deque()  # appended on the engine thread, taken on the event loop
        self._log: BlockEventLog | None = None

    def attach(self, pool: BlockPool) -> None:
        """Engine thread: log the pool's prefix-cache changes from now on (it must be empty, or readers
        take the first KVEvents for its whole content)."""
        self._log = BlockEventLog()
        pool.on_event = self._log

    def collect(self) -> bool:
        """Engine thread: turn the changes since the last call into the next KVEvents; True if any."""
        if self._log is None:
            return False
        changes = self._log.drain()
        if changes.is_empty:
            return False
        self.seq += 1
        self.ready.append(KVEvents(
            worker_id=self.worker_id, role=self.role, epoch=self.epoch, seq=self.seq, block_size=self.block_size,
            stored=list(changes.stored), removed=list(changes.removed),
        ))  # fmt: skip
        return True

    def snapshot(self, pool: BlockPool) -> KVSnapshot:
        """Engine thread: every hash cached now, numbered as the last KVEvents (collected first)."""
        self.collect()
        return KVSnapshot(
            worker_id=self.worker_id, role=self.role, epoch=self.epoch, seq=self.seq, block_size=self.block_size,
            block_hashes=list(pool.cached_hashes()),
        )


class KVEventPublisher:
    """The event-loop half: pushes `source.ready` to Redis, and a snapshot now and then."""

    def __init__(self, bus: Bus, source: KVEventSource, settings: KVEventSettings) -> None:
        self.bus, self.source, self.settings = bus, source, settings
        self.wake = asyncio.Event()
        # events not sent are dropped: readers see the gap and wait for a snapshot
        self._outage = OutageLog(logger, "publishing KV events")
        self._snapshot_seq: int | None = None
        self._snapshot_at = 0.0  # monotonic
        self._checked_at = 0.0  # monotonic: the last look for the snapshot's key

    async def publish_events(self) -> None:
        ready = self.source.ready
        if not ready:
            return
        batch = [ready.popleft() for _ in range(len(ready))]
        pipe = self.bus.redis.pipeline(transaction=False)
        for msg in batch:
            pipe.xadd(self.bus.keys.kv_events, {"m": encode(msg)}, maxlen=self.settings.stream_maxlen,
                      approximate=True)
        try:
            await pipe.execute()
            self._outage.recovered()
        except REDIS_ERRORS as e:
            self._outage.failed(e)

    async def snapshot_due(self) -> bool:
        """At most once an interval: when the cache changed, when the last snapshot nears its TTL, or
        when its key is gone (Redis restarted empty: readers have nothing to rebuild from)."""
        age_s = time.monotonic() - self._snapshot_at
        if age_s < self.settings.snapshot_interval_s:
            return False
        if self._snapshot_seq != self.source.seq or age_s >= self.settings.snapshot_ttl_s / 2:
            return True
        if time.monotonic() - self._checked_at < self.settings.snapshot_interval_s:
            return False
        self._checked_at = time.monotonic()
        return not await self.bus.redis.exists(self.bus.keys.kv_snapshot(self.source.worker_id))

    async def publish_snapshot(self, snap: KVSnapshot) -> None:
        key = self.bus.keys.kv_snapshot(snap.worker_id)
        await self.bus.redis.set(key, encode(snap), px=int(self.settings.snapshot_ttl_s * 1000))
        self._snapshot_seq, self._snapshot_at = snap.seq, time.monotonic()
