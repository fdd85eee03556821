"""Prefill worker: prompts in from the requests streams, first tokens out to the gateways, KV out
to a decode worker.

    requests, requests:<own id> --(group "prefill")--> engine (stop_after_prefill) --first token--> replies:<gateway>
                                           |
                    own inbox <-- HandoffAccept <-- decode inbox <-- HandoffOffer
                                           |
                    KV bytes (services/kv_transfer) + KVReady --> decode inbox; release; XACK

A long prompt (kv_stream_min_tokens) for a decode worker reached over the data port is offered
before its prefill, and its KV sent layer by layer as the engine computes it
(services/kv_transfer/tcp_layers.py); the first token follows with KVReady. Should no such worker
take it, or its stream fail, the handoff waits for the prefill and goes the usual way.
A direct (TCP) transfer that fails, because the decode worker died, stalled or refused it, is
offered to another decode worker (MAX_PLACEMENTS in all). A request's entry is acknowledged only
once it finished here or its handoff is complete, so the entries of a worker that dies stay
pending and another prefill worker claims them (reclaim.py).
A gateway that routes by cached prefix puts a request on the worker's own stream, and may name
the decode worker to offer it to first (`decode_hint`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Coroutine
from typing import Any

from redis.exceptions import ResponseError

from services.kv_transfer.tcp_layers import LayerStreams
from services.prefill.handoff import Handoffs
from services.prefill.placement import AcceptBoard, DecodePicker
from services.prefill.reclaim import Claimed, Reclaimer
from services.prefill.tracked import Tally, Tracked, entry_time
from services.runtime.intake import add_to_engine, finish_early, refusal
from services.runtime.token_stream import token_update
from services.runtime.worker import Worker
from shared.engine.engine import RequestOutput
from shared.protocol import (
    Cancel,
    GenerateRequest,
    HandoffAccept,
    Message,
    TokenBatch,
    TokenUpdate,
    WorkerStatus,
)
from shared.settings import WorkerServiceSettings
from shared.streams import INBOX_GROUP, PREFILL_GROUP, REDIS_ERRORS

logger = logging.getLogger(__name__)

INTAKE_BATCH = 4  # entries per read: small, so that idle prefill workers share a burst


class PrefillWorker(Handoffs, Worker):
    role = "prefill"
    stop_after_prefill = True  # the engine keeps a request once its first token is out: it is handed off

    def __init__(self, settings: WorkerServiceSettings) -> None:
        super().__init__(settings)
        cfg = settings.worker
        self.picker = DecodePicker(self.bus)
        self.accepts = AcceptBoard()
        self.reclaimer = Reclaimer(self.bus, self.worker_id, min_idle_s=cfg.heartbeat_ttl_s)
        self._tracked: dict[str, Tracked] = {}
        self._admitting: set[tuple[str, bytes]] = set()  # (stream, entry) read but not yet in the engine
        self.routed_stream = self.keys.routed_requests(self.worker_id)
        self._handed_off: OrderedDict[str, str] = OrderedDict()  # req_id -> decode_id, to forward late cancels
        self._tally = Tally()
        self.layer_streams = LayerStreams()
        self.engine.after_layer = self.layer_streams.after_layer

    async def setup(self) -> None:
        await super().setup()
        await self.bus.ensure_group(self.keys.requests, PREFILL_GROUP)
        await self.bus.ensure_group(self.routed_stream, PREFILL_GROUP)
        await self.bus.redis.sadd(self.keys.routed_workers, self.worker_id)

    def serve_tasks(self) -> list[Coroutine[Any, Any, None]]:
        return [
            self.consume(self.routed_stream, PREFILL_GROUP, self._on_routed, self._intake_capacity, self.stopping),
            self.consume(self.keys.requests, PREFILL_GROUP, self._on_request, self._intake_capacity, self.stopping),
            self.consume(self.inbox, INBOX_GROUP, self._on_inbox, lambda: 64, self.stopped),
            self._reclaim_loop(),
        ]

    def is_idle(self) -> bool:
        return not self._tracked and not self._admitting

    def report(self, interval_s: float) -> str | None:
        tally, self._tally = self._tally, Tally()
        return tally.line(interval_s)

    async def trim(self) -> None:
        await super().trim()
        await self.bus.trim_acknowledged(self.keys.requests, PREFILL_GROUP)
        await self.bus.trim_acknowledged(self.routed_stream, PREFILL_GROUP)

    def status(self) -> WorkerStatus:
        status = super().status()
        status.num_queued_tokens = self._num_queued_tokens()
        return status

    # -- intake ----------------------------------------------------------------------------------

    def _num_queued_tokens(self) -> int:
        return sum(t.num_prefill_tokens for t in self._tracked.values() if t.prefilled_at is None)

    def _intake_capacity(self) -> int:
        """Read more only while the engine's queue is short of a step's token budget; entries read
        from either stream and not yet handled count against the batch."""
        sched = self.settings.scheduler
        if self.draining or self._num_queued_tokens() >= sched.max_num_batched_tokens:
            return 0
        unread = len(self.unhandled[self.keys.requests]) + len(self.unhandled[self.routed_stream])
        return min(INTAKE_BATCH - unread, sched.max_num_seqs - len(self._tracked) - unread)

    async def _on_request(self, entry_id: bytes, msg: Message | None) -> None:
        await self._on_entry(self.keys.requests, entry_id, msg)

    async def _on_routed(self, entry_id: bytes, msg: Message | None) -> None:
        await self._on_entry(self.routed_stream, entry_id, msg)

    async def _on_entry(self, stream: str, entry_id: bytes, msg: Message | None) -> None:
        if not isinstance(msg, GenerateRequest):
            logger.error("dropping entry %s of %s: not a generate request", entry_id.decode(), stream)
            await self.ack(stream, PREFILL_GROUP, entry_id)
            return
        await self.admit(stream, entry_id, msg)

    async def admit(self, stream: str, entry_id: bytes, msg: GenerateRequest) -> None:
        if (stream, entry_id) in self._admitting:
            return
        self._admitting.add((stream, entry_id))
        try:
            await self._admit(stream, entry_id, msg)
        finally:
            self._admitting.discard((stream, entry_id))

    async def _admit(self, stream: str, entry_id: bytes, msg: GenerateRequest) -> None:
        known = self._tracked.get(msg.req_id)
        if known is not None:
            if msg.attempt <= known.msg.attempt:  # a duplicate of work in hand
                if (stream, entry_id) != (known.stream, known.entry_id):
                    await self.ack(stream, PREFILL_GROUP, entry_id)
                return
            await self._cancel(known, f"superseded by attempt {msg.attempt}")
            # the old attempt's handoff, if any, fails at its next engine call and cleans up after itself
            await self.engine.call(self.engine.engine.abort_request, msg.req_id)
        tracked = Tracked(msg, stream, entry_id, arrived_at=entry_time(entry_id))
        refused = await refusal(self, msg)
        if refused is not None:
            await self._finish_early(tracked, *refused)
            return
        # tracked before the engine has it: the engine thread may prefill it before this coroutine
        # resumes, and it exports the handoff of what it finds here right after that step
        self._tracked[msg.req_id] = tracked
        try:
            rejected = await add_to_engine(self, msg, self.stop_after_prefill)
        except BaseException:
            self._untrack(tracked)
            raise
        if rejected is not None:
            self._untrack(tracked)
            await self._finish_early(tracked, "abort", rejected)
            return
        logger.debug("admitted %s (%d prompt tokens, attempt %d)", msg.req_id, tracked.num_prefill_tokens, msg.attempt)
        self.wake_engine()
        if self._streams_while_prefilling(tracked):
            tracked.handoff = self.spawn(self._hand_off(tracked))

    def _untrack(self, t: Tracked) -> None:
        if self._tracked.get(t.req_id) is t:
            del self._tracked[t.req_id]

    def _streams_while_prefilling(self, t: Tracked) -> bool:
        """Whether `t`'s handoff starts now, to stream its KV layer by layer as the prefill runs."""
        min_tokens = self.settings.worker.kv_stream_min_tokens
        return self.stop_after_prefill and self.kv.streams_layers and 0 < min_tokens <= t.num_prefill_tokens

    async def _finish_early(self, tracked: Tracked, finish_reason: str, error: str | None) -> None:
        await finish_early(self, tracked.msg, tracked.stream, tracked.entry_id, finish_reason, error)

    async def _reclaim_loop(self) -> None:
        cfg = self.settings.worker
        while not self.stopping.is_set():
            await asyncio.sleep(cfg.heartbeat_ttl_s)
            try:
                await self._reclaim()
            except (*REDIS_ERRORS, ResponseError) as e:
                logger.warning("reclaiming abandoned requests: %s", e)

    async def _reclaim(self) -> None:
        """Pending entries of dead consumers (or of this worker's earlier life) on every requests
        stream, then the never-read entries routed to workers that are gone."""
        orphaned = await self.reclaimer.orphaned_streams()
        for stream in [self.keys.requests, self.routed_stream, *(s for _, s in orphaned)]:
            capacity = self._intake_capacity()
            if capacity <= 0:
                return
            for claimed in await self.reclaimer.claim(stream, capacity, self._held(stream)):
                await self._take_over(claimed)
        for worker_id, stream in orphaned:
            capacity = self._intake_capacity()
            if capacity <= 0:
                return
            claimed_now = await self.reclaimer.read_orphans(stream, capacity)
            for claimed in claimed_now:
                await self._take_over(claimed)
            if not claimed_now and await self.reclaimer.remove_if_exhausted(worker_id, stream):
                logger.info("removed the requests stream of %s: it is gone and its stream drained", worker_id)

    def _held(self, stream: str) -> set[bytes]:
        """Entries of `stream` this worker holds or is about to handle: no reclaim takes them."""
        return (
            {t.entry_id for t in self._tracked.values() if t.stream == stream}
            | {e for s, e in self._admitting if s == stream}
            | self.unhandled[stream]
        )

    async def _take_over(self, claimed: Claimed) -> None:
        msg = claimed.request
        if msg is None:
            await self.ack(claimed.stream, PREFILL_GROUP, claimed.entry_id)
        elif claimed.num_deliveries > self.settings.worker.max_deliveries:
            logger.error("dead-lettering %s: delivered %d times", msg.req_id, claimed.num_deliveries)
            await self.reclaimer.dead_letter(claimed, f"delivered {claimed.num_deliveries} times")
            await self._finish_early(
                Tracked(msg, claimed.stream, claimed.entry_id, entry_time(claimed.entry_id)), "abort",
                f"the request failed {claimed.num_deliveries - 1} times; giving up",
            )
        else:
            logger.warning("taking over %s from %s (delivery %d)", msg.req_id,
                           claimed.previous_consumer or f"the stream {claimed.stream}", claimed.num_deliveries)
            msg.num_deliveries = claimed.num_deliveries
            try:
                await self.admit(claimed.stream, claimed.entry_id, msg)
            except Exception:
                # a poison request must not end the reclaim loop, and the worker with it: its entry
                # stays pending, is claimed again with one more delivery, and dead-lettered in the end
                logger.exception("admitting %s (delivery %d) failed; it stays pending", msg.req_id,
                                 claimed.num_deliveries)

    # -- outputs ---------------------------------------------------------------------------------

    async def on_outputs(self, outputs: list[RequestOutput]) -> None:
        batches: dict[str, list[TokenUpdate]] = {}
        emitted: list[tuple[Tracked, RequestOutput]] = []
        now = time.time()
        for out in outputs:
            t = self._tracked.get(out.req_id)
            if t is None:
                continue
            self._observe_prefill(t, out, now)
            batches.setdefault(t.msg.gateway_id, []).append(token_update(out, t.msg.attempt, t.first_index, self.worker_id))
            emitted.append((t, out))
            self.metrics.generation_tokens.inc(len(out.new_token_ids))
        # the first token goes out before the handoff starts: TTFT does not wait for decode
        await self.send_many([(self.keys.replies(g), TokenBatch(u)) for g, u in batches.items()])
        for t, out in emitted:
            t.first = out
            if t.handoff is not None:  # started at admission: it goes on from here
                t.prefill_over.set()
            elif out.is_finished or t.cancelled:
                await self._forget(t, release=not out.is_finished)
            else:
                t.prefill_over.set()
                t.handoff = self.spawn(self._hand_off(t))
        self.capacity_changed.set()

    def _observe_prefill(self, t: Tracked, out: RequestOutput, now: float) -> None:
        """Record that `t` got its first token (`out`) at unix time `now`."""
        t.prefilled_at = time.monotonic()
        self.num_prefilled += 1
        self.metrics.prompt_tokens.inc(out.num_prompt_tokens)
        self.metrics.time_to_first_token.observe(max(0.0, now - t.arrived_at))
        self._tally.num_prefilled += 1
        self._tally.num_prompt_tokens += out.num_prompt_tokens
        self._tally.num_cached_tokens += out.num_cached_tokens

    def after_step_on_engine_thread(self, outputs: list[RequestOutput]) -> None:
        """Export each handoff now: queued as an engine call it would wait for the next step,
        which during a burst of long prompts is a long prefill, and delay the second token."""
        engine = self.engine.engine
        for out in outputs:
            t = self._tracked.get(out.req_id)
            if t is not None and out.is_prefilled:
                t.export, t.kv_block_ids = engine.export_handoff(out.req_id), engine.kv_block_ids(out.req_id)

    async def _forget(self, t: Tracked, release: bool) -> None:
        if release:
            with contextlib.suppress(KeyError):  # already aborted
                await self.engine.call(self.engine.engine.release, t.req_id)
        await self.ack(t.stream, PREFILL_GROUP, t.entry_id)
        self._untrack(t)
        self.capacity_changed.set()

    async def _fail(self, t: Tracked, error: str) -> None:
        logger.error("%s: %s", t.req_id, error)
        update = TokenUpdate(
            req_id=t.req_id, attempt=t.msg.attempt, index=t.first_index + 1, token_ids=[], finish_reason="abort",
            worker_id=self.worker_id, error=error,
        )
        await self.send(self.keys.replies(t.msg.gateway_id), TokenBatch([update]))

    # -- inbox: accepts and cancels --------------------------------------------------------------

    async def _on_inbox(self, entry_id: bytes, msg: Message | None) -> None:
        try:
            if isinstance(msg, HandoffAccept):
                await self._on_accept(msg)
            elif isinstance(msg, Cancel):
                await self._on_cancel(msg)
            else:
                logger.warning("ignoring unexpected %s in inbox", type(msg).__name__)
        finally:
            await self.ack(self.inbox, INBOX_GROUP, entry_id)

    async def _on_accept(self, accept: HandoffAccept) -> None:
        if self.accepts.resolve(accept) or accept.needed_blocks is None:
            return
        # an answer that came too late: free the blocks that worker reserved for nothing
        logger.info("late answer from %s for %s; telling it to drop its reservation", accept.decode_id, accept.req_id)
        cancel = Cancel(accept.req_id, "handoff went elsewhere", accept.attempt)
        await self.send(self.keys.inbox(accept.decode_id), cancel)

    async def _on_cancel(self, msg: Cancel) -> None:
        t = self._tracked.get(msg.req_id)
        if t is None:
            decode_id = self._handed_off.get(msg.req_id)
            if decode_id is not None:  # the decode worker applies the attempt fence
                await self.send(self.keys.inbox(decode_id), msg)
            return
        if not msg.covers(t.msg.attempt):  # meant for an attempt this worker no longer runs
            logger.info("ignoring a cancel of %s attempt %s (%s): attempt %d runs here", msg.req_id, msg.attempt,
                        msg.reason, t.msg.attempt)
            return
        await self._cancel(t, msg.reason)

    async def _cancel(self, t: Tracked, reason: str) -> None:
        logger.info("cancelling %s: %s", t.req_id, reason)
        t.cancelled = True
        if t.kv_stream is not None:  # before its blocks are freed
            t.kv_stream.abort(f"cancelled: {reason}")
        t.prefill_over.set()
        if t.decode_id is not None:
            await self.send(self.keys.inbox(t.decode_id), Cancel(t.req_id, reason, t.msg.attempt))
        if t.prefilled_at is None:  # still in the engine: free its blocks now
            await self.engine.call(self.engine.engine.abort_request, t.req_id)
            await self._forget(t, release=False)
        # otherwise the output handler or the handoff task sees `cancelled` and cleans up
