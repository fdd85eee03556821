"""Puts requests on the workers and takes them off again: every write of the gateway to Redis."""

from __future__ import annotations

import asyncio
import logging

from services.gateway.inflight import InflightRequest
from services.gateway.openai_schema import ApiError
from services.gateway.replies import ReplyRouter
from shared.protocol import Cancel
from shared.streams import REDIS_ERRORS, Bus

logger = logging.getLogger(__name__)

# Long enough for a queued request to reach a prefill worker, which then skips it.
CANCEL_MARK_TTL_S = 300


class Dispatcher:
    def __init__(self, bus: Bus, router: ReplyRouter, gateway_id: str) -> None:
        self._bus = bus
        self._router = router
        self.gateway_id = gateway_id

    async def submit(self, reqs: list[InflightRequest]) -> None:
        """Queue `reqs` for the prefill pool; their replies are routed from now on."""
        for req in reqs:
            self._router.register(req)  # before the XADD, so no reply can arrive unrouted
        try:
            stream = self._bus.keys.requests
            await asyncio.gather(*(self._bus.send(stream, req.to_message(self.gateway_id)) for req in reqs))
        except REDIS_ERRORS as e:
            for req in reqs:
                self._router.unregister(req.req_id)
            logger.error("cannot queue requests: Redis unavailable (%s)", e)
            raise ApiError(503, "The request queue (Redis) is unavailable; retry later.", "server_error") from e

    def release(self, req: InflightRequest) -> None:
        """Stop routing replies of `req` (it finished, or the gateway gave up on it)."""
        self._router.unregister(req.req_id)

    async def cancel(self, req: InflightRequest, reason: str) -> None:
        """Stop `req` wherever it is: the mark makes a prefill worker skip it if still queued, the
        Cancel frees its KV on the worker that holds it (a prefill worker forwards it after a handoff)."""
        self.release(req)
        keys = self._bus.keys
        try:
            await self._bus.redis.set(keys.cancelled(req.req_id), b"1", ex=CANCEL_MARK_TTL_S)
            for worker_id in await self._holders(req):
                await self._bus.send(keys.inbox(worker_id), Cancel(req.req_id, reason))
        except REDIS_ERRORS as e:
            logger.warning("could not cancel %s (%s): Redis unavailable (%s)", req.req_id, reason, e)

    async def _holders(self, req: InflightRequest) -> list[str]:
        """The worker last heard from; before any token, every prefill worker (one may be computing it)."""
        if req.worker_id is not None:
            return [req.worker_id]
        return [status.worker_id for status in await self._bus.live_workers("prefill")]
