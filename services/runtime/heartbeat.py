"""A worker's heartbeat: its status in Redis every interval while its engine makes progress, so
the gateways and the other workers see it alive, loaded and reachable, and treat it as dead once
the status expires. `Worker` takes these methods from `Heartbeats`."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from redis.exceptions import ResponseError

from shared.outage_log import OutageLog
from shared.protocol import WorkerStatus
from shared.streams import REDIS_ERRORS

if TYPE_CHECKING:
    from services.kv_transfer.select import KVTransports
    from services.runtime.engine_thread import EngineThread
    from shared.settings import WorkerServiceSettings
    from shared.streams import Bus

logger = logging.getLogger(__name__)

TRIM_EVERY_BEATS = 20
REPORT_EVERY_S = 10.0


class Heartbeats:
    # what the heartbeat reads of its worker
    role: str
    worker_id: str
    inbox: str
    settings: WorkerServiceSettings
    bus: Bus
    engine: EngineThread
    kv: KVTransports
    draining: bool
    health_port: int | None
    num_prefilled: int
    stopped: asyncio.Event
    _beat_now: asyncio.Event
    _beat_outage: OutageLog
    _status_published_at: float
    _is_stuck: bool

    if TYPE_CHECKING:
        def report(self, interval_s: float) -> str | None: ...

        async def trim(self) -> None: ...

    def status(self) -> WorkerStatus:
        stats = self.engine.stats
        assert stats is not None
        return WorkerStatus(
            worker_id=self.worker_id,
            role=self.role,
            inbox=self.inbox,
            free_blocks=stats.kv.num_free_blocks,
            total_blocks=stats.kv.num_blocks,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting + stats.num_importing,
            timestamp=time.time(),
            draining=self.draining,
            health_port=self.health_port,
            busy_s=self.engine.busy_s,
            num_steps=self.engine.num_steps,
            num_prefilled=self.num_prefilled,
            kv_transports=self.kv.names,
            kv_shm=self.kv.shm_token,
            kv_host=self.kv.host,
            kv_port=self.kv.port,
            kv_nixl=self.kv.nixl_advertisement,
        )

    def beat_now(self) -> None:
        self._beat_now.set()

    async def _publish_status(self) -> None:
        await self.bus.publish_status(self.status(), self.settings.worker.heartbeat_ttl_s)
        self._status_published_at = time.monotonic()

    def heartbeat_lapsed(self) -> bool:
        """True once the last heartbeat Redis took has expired: the gateways and the other workers
        then count this worker as dead and re-queue what it holds elsewhere."""
        return time.monotonic() - self._status_published_at > self.settings.worker.heartbeat_ttl_s

    async def _heartbeat_loop(self) -> None:
        """A worker whose engine stalls stops beating, so the others treat it as dead."""
        cfg = self.settings.worker
        num_beats = 0
        reported_at = time.monotonic()
        while not self.stopped.is_set():
            if time.monotonic() - reported_at >= REPORT_EVERY_S:
                line = self.report(time.monotonic() - reported_at)
                reported_at = time.monotonic()
                if line:
                    logger.info("%s", line)
            stalled_s = self.engine.stalled_s()
            if stalled_s > cfg.stuck_after_s:
                if not self._is_stuck:
                    logger.error("engine made no progress for %.0fs while holding work; heartbeat stopped", stalled_s)
                self._is_stuck = True
            else:
                if self._is_stuck:
                    logger.warning("engine progressing again; heartbeat resumed")
                self._is_stuck = False
                await self._beat(num_beats)
            num_beats += 1
            await wait_for(self._beat_now, cfg.heartbeat_interval_s)
            self._beat_now.clear()

    async def _kv_marker_loop(self) -> None:
        while not self.stopped.is_set():
            self.kv.refresh()
            await wait_for(self.stopped, self.settings.worker.heartbeat_interval_s)

    async def _beat(self, num_beats: int) -> None:
        try:
            await self._publish_status()
            if num_beats % TRIM_EVERY_BEATS == 0:
                await self.trim()
            self._beat_outage.recovered()
        except (*REDIS_ERRORS, ResponseError) as e:
            self._beat_outage.failed(e)


async def wait_for(event: asyncio.Event, timeout_s: float) -> None:
    """Until `event` is set or `timeout_s` passed."""
    # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel that races its timeout
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        pass
