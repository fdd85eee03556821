"""Puts requests on the workers and takes them off again: every write of the gateway to Redis.

Each request goes where the router (router.py) sends it: the requests stream of the prefill
worker that caches most of its prompt, or the shared one, whose first free reader takes it; with
the decode worker to hand it to as a hint.

It also migrates requests off dead decode (and colocated) workers: `watch` looks every
WATCH_INTERVAL_S at the worker holding each in-flight request; one registered whose heartbeat lapsed is dead, so
its requests are re-queued with `attempt + 1`, continuing after the tokens already streamed.
The attempt fences the dead (or revived) worker: its late updates are dropped. A request still
on a prefill worker needs no help here: its stream entry stays pending until the handoff is
complete, and another prefill worker claims it (services/prefill/reclaim.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from services.gateway.inflight import InflightRequest
from services.gateway.openai_schema import ApiError
from services.gateway.replies import ReplyRouter, cancel_on_holders
from services.gateway.router import Router
from shared.outage_log import OutageLog
from shared.protocol import WorkerStatus, decode
from shared.streams import REDIS_ERRORS, STAGE_ROLES, Bus

logger = logging.getLogger(__name__)

# Long enough for a queued request to reach a prefill worker, which then skips it.
CANCEL_MARK_TTL_S = 300
# How often the holders of in-flight requests are checked; a migration starts within
# heartbeat_ttl_s (the workers' setting) + WATCH_INTERVAL_S of a decode worker's death.
WATCH_INTERVAL_S = 0.5


class Dispatcher:
    def __init__(
        self, bus: Bus, router: ReplyRouter, gateway_id: str, on_migrated: Callable[[], None], routing: Router
    ) -> None:
        self._bus = bus
        self._router = router
        self._routing = routing
        self.gateway_id = gateway_id
        self._inflight: dict[str, InflightRequest] = {}
        self._on_migrated = on_migrated  # counts each request re-queued off a dead worker
        self._stopping = asyncio.Event()

    async def submit(self, reqs: list[InflightRequest]) -> None:
        """Queue `reqs` for the prefill pool; their replies are routed from now on."""
        try:
            await self._router.wait_ready()
            for req in reqs:
                self._router.register(req)  # before the XADD, so no reply can arrive unrouted
                self._inflight[req.req_id] = req
            for req in reqs:  # in order: a request's choices reach the workers first to last
                await self._queue(req)
        except REDIS_ERRORS as e:
            for req in reqs:
                self.release(req)
            logger.error("cannot queue requests: Redis unavailable (%s)", e)
            raise ApiError(503, "The request queue (Redis) is unavailable; retry later.", "server_error") from e

    async def _queue(self, req: InflightRequest) -> None:
        """XADD `req` where the router sends it."""
        msg = req.to_message(self.gateway_id)
        route = await self._routing.route([*msg.prompt_token_ids, *msg.output_token_ids])
        msg.decode_hint = route.decode.worker_id
        prefill_id = route.prefill.worker_id  # a decode worker where it prefills the request itself
        stream = self._bus.keys.requests if prefill_id is None else self._bus.keys.routed_requests(prefill_id)
        req.queued_on = prefill_id
        await self._bus.send(stream, msg)

    def release(self, req: InflightRequest) -> None:
        """Stop routing replies of `req` (it finished, or the gateway gave up on it)."""
        self._router.unregister(req.req_id)
        self._inflight.pop(req.req_id, None)

    async def cancel(self, req: InflightRequest, reason: str) -> None:
        """Stop `req` wherever it is: the mark makes a prefill worker skip it if still queued, the
        Cancel frees its KV on the worker that holds it (a prefill worker forwards it after a handoff)."""
        self.release(req)
        keys = self._bus.keys
        try:
            await self._bus.redis.set(keys.cancelled(req.req_id), b"1", ex=CANCEL_MARK_TTL_S)
            await cancel_on_holders(self._bus, req, reason)
        except REDIS_ERRORS as e:
            logger.warning("could not cancel %s (%s): Redis unavailable (%s)", req.req_id, reason, e)

    # -- migration -------------------------------------------------------------------------------

    def stop(self) -> None:
        """Make `watch` return."""
        self._stopping.set()

    async def watch(self) -> None:
        """Migrate the requests of dead decode workers until stopped; rides out Redis outages."""
        outage = OutageLog(logger, "checking the holders of in-flight requests")
        while not self._stopping.is_set():
            try:
                async with asyncio.timeout(WATCH_INTERVAL_S):
                    await self._stopping.wait()
            except TimeoutError:
                pass
            if self._stopping.is_set() or not self._inflight:
                continue
            try:
                await self.migrate_from_dead()
                outage.recovered()
            except REDIS_ERRORS as e:
                outage.failed(e)

    async def migrate_from_dead(self) -> list[InflightRequest]:
        """Re-queue every unfinished request held by a dead decode worker; returns them."""
        dead = await self._dead_decode_workers()
        moved: list[InflightRequest] = []
        for req in [r for r in self._inflight.values() if not r.is_finished and r.worker_id in dead]:
            dead_id = req.worker_id
            logger.warning("%s: decode worker %s died; re-running it as attempt %d after %d streamed tokens",
                           req.req_id, dead_id, req.attempt + 1, len(req.output_token_ids))
            req.attempt += 1  # before the XADD: from now on updates of the old attempt are dropped
            req.worker_id = None
            try:
                await self._queue(req)
            except REDIS_ERRORS:
                req.attempt, req.worker_id = req.attempt - 1, dead_id  # nothing queued: try again next round
                raise
            moved.append(req)
            self._on_migrated()
        return moved

    async def _dead_decode_workers(self) -> set[str]:
        """Decode (and colocated) workers still registered (they did not exit cleanly) whose heartbeat lapsed."""
        holders = {r.worker_id for r in self._inflight.values() if r.worker_id is not None}
        if not holders:
            return set()
        keys = self._bus.keys
        registered: list[bytes] = []
        for role in STAGE_ROLES["decode"]:
            registered += (await self._bus.redis.hgetall(keys.workers(role))).values()
        ids = [s.worker_id for raw in registered if isinstance(s := decode(raw), WorkerStatus)]
        ids = [i for i in ids if i in holders]
        if not ids:
            return set()
        alive = await self._bus.redis.mget([keys.alive(i) for i in ids])
        return {i for i, beat in zip(ids, alive) if beat is None}
