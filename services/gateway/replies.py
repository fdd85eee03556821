"""The one reader of a gateway's replies stream: it hands each TokenUpdate to its request.

Workers append TokenBatches to `replies:<gateway_id>`; this gateway is the stream's only
consumer, so a plain XREAD from the last id read suffices (no consumer group), and entries
are trimmed as soon as they are routed, which keeps Redis' memory bounded.
"""

from __future__ import annotations

import asyncio
import logging

from services.gateway.inflight import InflightRequest
from shared.protocol import Message, TokenBatch
from shared.streams import REDIS_ERRORS, Bus, with_backoff

logger = logging.getLogger(__name__)

READ_COUNT = 512
READ_BLOCK_MS = 1000
MAX_BACKOFF_S = 2.0


class ReplyRouter:
    def __init__(self, bus: Bus, gateway_id: str) -> None:
        self._bus = bus
        self.stream = bus.keys.replies(gateway_id)
        self._requests: dict[str, InflightRequest] = {}
        self._stopping = asyncio.Event()

    def register(self, req: InflightRequest) -> None:
        self._requests[req.req_id] = req

    def unregister(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def stop(self) -> None:
        """Make `run` return after the read in progress. Cancelling alone is not enough: on Python
        3.11 a cancel that lands while redis-py sends a command can be swallowed (asyncio.wait_for)."""
        self._stopping.set()

    async def run(self) -> None:
        """Route replies until stopped; rides out Redis outages with backoff."""
        # entries left by an earlier process with this gateway id answer requests nobody waits for
        await with_backoff(lambda: self._bus.redis.delete(self.stream), f"clearing {self.stream}", self._stopping)
        last_id = b"0-0"
        delay = 0.05
        while not self._stopping.is_set():
            try:
                entries = await self._bus.read(self.stream, last_id, READ_COUNT, READ_BLOCK_MS)
                if entries:
                    self._route_all([msg for _, msg in entries])
                    last_id = entries[-1][0]
                    await self._bus.redis.xtrim(self.stream, minid=_next_id(last_id), approximate=False)
                delay = 0.05
            except REDIS_ERRORS as e:
                logger.warning("reading %s: Redis unavailable (%s); retrying in %.2fs", self.stream, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_BACKOFF_S)

    def _route_all(self, msgs: list[Message | None]) -> None:
        for msg in msgs:
            try:
                self.route(msg)
            except Exception:  # one bad entry must not stop the replies of every other request
                logger.exception("routing a reply failed")

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


def _next_id(entry_id: bytes) -> str:
    """The smallest stream id after `entry_id` (ids are `<ms>-<seq>`)."""
    ms, seq = entry_id.decode().split("-")
    return f"{ms}-{int(seq) + 1}"
