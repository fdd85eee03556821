"""The one reader of a gateway's replies stream: it hands each TokenUpdate to its request.

Workers append TokenBatches to `replies:<gateway_id>`; this gateway is the stream's only
consumer, so a plain XREAD from the last id read suffices (no consumer group), and entries
are trimmed as soon as they are routed, which keeps Redis' memory bounded.

Redis may restart empty (no persistence): the gateway's epoch mark is then gone, and every
request still in flight is re-queued from the gateway's own record as its next attempt, which
continues after the tokens already streamed. Replies of the old attempt are dropped, and the
worker that may still hold it gets a Cancel fenced to that attempt, so it stops computing tokens
nobody reads without touching the new attempt should that land on the same worker.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

from redis.exceptions import ConnectionError as RedisConnectionError

from services.gateway.inflight import InflightRequest
from services.gateway.metrics import ROUTE
from shared.outage_log import OutageLog
from shared.protocol import Cancel, Message, TokenBatch
from shared.streams import READ_BLOCK_MS, REDIS_ERRORS, STAGE_ROLES, Bus, with_backoff

logger = logging.getLogger(__name__)

READ_COUNT = 512
MAX_BACKOFF_S = 2.0
EPOCH_CHECK_INTERVAL_S = 0.5
READY_TIMEOUT_S = 2.0  # how long a request waits for the reader's start-up before a 503
EPOCH_TTL_S = 3600  # refreshed every check; outlives a gateway that died without cleaning up only this long


class ReplyRouter:
    def __init__(self, bus: Bus, gateway_id: str, phase_seconds: dict[str, float] | None = None) -> None:
        """`phase_seconds`: where the time routing takes is added (GatewayMetrics.phase_seconds)."""
        self._bus = bus
        self._phase_seconds = phase_seconds if phase_seconds is not None else {ROUTE: 0.0}
        self.gateway_id = gateway_id
        self.stream = bus.keys.replies(gateway_id)
        self._epoch_key = bus.keys.epoch(gateway_id)
        self._epoch = secrets.token_hex(8).encode()
        self._epoch_checked_at = 0.0  # monotonic
        self._requests: dict[str, InflightRequest] = {}
        self._registered_at: dict[str, float] = {}  # monotonic
        self._failed_at: float | None = None  # monotonic: the last Redis error since the epoch was confirmed
        self._stopping = asyncio.Event()
        self._ready = asyncio.Event()  # set once the start-up clean-up of the stream is done
        self.num_requeued = 0

    def register(self, req: InflightRequest) -> None:
        self._requests[req.req_id] = req
        self._registered_at[req.req_id] = time.monotonic()

    async def wait_ready(self) -> None:
        """Block until replies can be routed: a request queued before the start-up clean-up of the
        stream could have its replies deleted by it."""
        try:
            async with asyncio.timeout(READY_TIMEOUT_S):
                await self._ready.wait()
        except TimeoutError:
            raise RedisConnectionError(f"{self.stream} is not ready: Redis has been unreachable since start-up") from None

    def unregister(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        self._registered_at.pop(req_id, None)

    def stop(self) -> None:
        """Make `run` return after the read in progress (at most READ_BLOCK_MS)."""
        self._stopping.set()

    async def run(self) -> None:
        """Route replies until stopped; rides out Redis outages with backoff."""
        # entries left by an earlier process with this gateway id answer requests nobody waits for
        await with_backoff(lambda: self._bus.redis.delete(self.stream), f"clearing {self.stream}", self._stopping)
        await with_backoff(self._mark_epoch, "marking the gateway's epoch", self._stopping)
        self._ready.set()
        last_id = b"0-0"
        read_through: bytes | None = None  # the last entry routed and not trimmed yet
        delay = 0.05
        outage = OutageLog(logger, f"reading {self.stream}")
        while not self._stopping.is_set():
            try:
                if time.monotonic() - self._epoch_checked_at >= EPOCH_CHECK_INTERVAL_S and not await self._check_epoch():
                    last_id, read_through = b"0-0", None  # the stream restarted too
                    await self._requeue_lost()
                    await self._mark_epoch()
                entries = await self._bus.read(self.stream, last_id, READ_COUNT, READ_BLOCK_MS, read_through)
                read_through = None
                if entries:
                    self._route_all([msg for _, msg in entries])
                    last_id = read_through = entries[-1][0]
                outage.recovered()
                delay = 0.05
            except REDIS_ERRORS as e:
                outage.failed(e)
                self._epoch_checked_at = 0.0  # check at once when Redis is back
                self._failed_at = time.monotonic()
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_BACKOFF_S)

    async def clear_epoch(self) -> None:
        try:
            await self._bus.redis.delete(self._epoch_key)
        except REDIS_ERRORS as e:
            logger.warning("could not remove %s: %s", self._epoch_key, e)

    async def _mark_epoch(self) -> None:
        await self._bus.redis.set(self._epoch_key, self._epoch, ex=EPOCH_TTL_S)
        self._epoch_checked_at = time.monotonic()

    async def _check_epoch(self) -> bool:
        """Refresh the epoch mark; False when it had vanished. The mark is set again only after
        the caller re-queued, so a re-queue cut short by another outage is redone."""
        pipe = self._bus.redis.pipeline(transaction=False)
        pipe.get(self._epoch_key)
        pipe.expire(self._epoch_key, EPOCH_TTL_S)
        epoch, _ = await pipe.execute()
        self._epoch_checked_at = time.monotonic()
        if epoch == self._epoch:
            self._failed_at = None
        return epoch == self._epoch

    async def _requeue_lost(self) -> None:
        """Queue every unfinished request the old Redis had as its next attempt; the old attempt's
        replies no longer count. Requests registered after the last failed read went to the new
        Redis already (Redis was down then, so their XADD could only succeed after it was back)."""
        cutoff = self._failed_at if self._failed_at is not None else time.monotonic()
        lost = [
            req for req_id, req in list(self._requests.items())
            if not req.is_finished and self._registered_at.get(req_id, cutoff) < cutoff
        ]  # fmt: skip
        logger.error("Redis lost its data (restarted empty?): re-queueing %d request(s)", len(lost))
        stream = self._bus.keys.requests
        for req in lost:
            reason = f"re-queued as attempt {req.attempt + 1} after Redis lost its data"
            await cancel_on_holders(self._bus, req, reason, attempt=req.attempt)
            req.attempt += 1
            req.worker_id = None  # whoever takes the new attempt names itself
            self._registered_at[req.req_id] = time.monotonic()  # its new attempt went to this Redis
            await self._bus.send(stream, req.to_message(self.gateway_id))
            self.num_requeued += 1
            logger.warning("%s: re-queued as attempt %d after %d tokens", req.req_id, req.attempt,
                           len(req.output_token_ids))

    def _route_all(self, msgs: list[Message | None]) -> None:
        started = time.perf_counter()
        for msg in msgs:
            try:
                self.route(msg)
            except Exception:  # one bad entry must not stop the replies of every other request
                logger.exception("routing a reply failed")
        self._phase_seconds[ROUTE] += time.perf_counter() - started

    def route(self, msg: Message | None) -> None:
        if not isinstance(msg, TokenBatch):
            logger.error("dropping a %s from %s: only token batches belong there", type(msg).__name__, self.stream)
            return
        for update in msg.updates:
            req = self._requests.get(update.req_id)
            if req is None:
                continue  # finished or cancelled here; the worker's late tokens are moot
            fresh = req.accept(update)
            if fresh is not None:
                req.replies.put_nowait(fresh)
            if req.is_finished:
                self.unregister(req.req_id)


async def cancel_on_holders(bus: Bus, req: InflightRequest, reason: str, attempt: int | None = None) -> None:
    """Send a Cancel (fenced to `attempt`, None: any) to the workers that may hold `req`: the one
    last heard from; before any token, every live prefill or colocated worker (one may be computing it)
    and the worker it was routed to (a decode worker that prefills it itself)."""
    if req.worker_id is not None:
        holders = [req.worker_id]
    else:
        holders = [status.worker_id for role in STAGE_ROLES["prefill"] for status in await bus.live_workers(role)]
        if req.queued_on is not None and req.queued_on not in holders:
            holders.append(req.queued_on)
    for worker_id in holders:
        await bus.send(bus.keys.inbox(worker_id), Cancel(req.req_id, reason, attempt))

