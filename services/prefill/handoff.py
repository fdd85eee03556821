"""The prefill worker's KV handoff (a mixin of `PrefillWorker`, which holds the state it uses):
offer a prefilled request to a decode worker, stream or send its KV blocks, and offer it elsewhere
when a direct transfer fails. See worker.py for the whole flow."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from services.kv_transfer import TCP_SCHEME, KVPeer, KVSource, KVTransferError
from services.prefill.tracked import MIB, Tracked
from shared.protocol import Cancel, HandoffOffer, KVReady, TokenBatch, TokenUpdate, WorkerStatus
from shared.streams import REDIS_ERRORS, with_backoff

logger = logging.getLogger(__name__)

MAX_PLACEMENTS = 3  # decode workers one handoff tries when its direct transfers fail
MAX_REMEMBERED_HANDOFFS = 4096


class HandoffRefused(Exception):
    """A decode worker that can never take this offer, with its reason."""


class Handoffs:
    async def _hand_off(self, t: Tracked) -> None:
        try:
            failed: set[str] = set()  # decode workers a transfer of this request to failed
            if t.first is None and await self._stream_while_prefilling(t, failed):
                return
            await t.prefill_over.wait()
            if t.cancelled or t.first is None or t.first.is_finished:
                return
            offer = await self._offer_message(t)
            while True:
                decode_id, needed = await self._place(t, offer, failed)
                if decode_id is None or needed is None:
                    return
                if t.cancelled:  # while the accept was on its way: that worker holds blocks for nothing
                    cancel = Cancel(t.req_id, "cancelled during the handoff", t.msg.attempt)
                    await self.send(self.keys.inbox(decode_id), cancel)
                    return
                try:
                    await self._transfer(t, decode_id, needed)
                    return
                except KVTransferError as e:
                    if t.cancelled or len(failed) + 1 >= MAX_PLACEMENTS:
                        raise
                    failed.add(decode_id)
                    await self._transfer_failed(t, decode_id, e)
        except Exception as e:
            if not t.cancelled:
                logger.exception("handoff of %s failed", t.req_id)
                await self._fail(t, f"handoff failed: {e}")
        finally:
            await self._forget(t, release=True)

    async def _stream_while_prefilling(self, t: Tracked, failed: set[str]) -> bool:
        """Offer `t` before its prefill is over to a decode worker reached over the data port, and
        stream its KV there layer by layer. False: no such worker took it, its prefill ended
        first, or the stream failed (that worker is then in `failed`); the handoff goes on the
        usual way once the prefill is over."""
        offer = self._early_offer(t)
        try:
            statuses = await self.picker.candidates(offer.num_blocks, t.msg.decode_hint)
        except REDIS_ERRORS as e:
            logger.warning("not streaming the KV of %s: listing decode workers failed (%s)", t.req_id, e)
            return False
        for status in statuses:
            if t.prefill_over.is_set():
                return False
            if not self.kv.streams_to(status):
                continue
            try:
                needed = await self._offer(t, offer, status)
            except HandoffRefused:
                continue  # the usual handoff reports why, should every worker refuse
            if needed is None:
                continue
            if t.cancelled:  # while the accept was on its way: that worker holds blocks for nothing
                await self.send(self.keys.inbox(status.worker_id), Cancel(t.req_id, "cancelled", t.msg.attempt))
                return True
            try:
                await self._stream(t, status.worker_id, needed)
            except KVTransferError as e:
                if t.cancelled:
                    return True
                failed.add(status.worker_id)
                await self._transfer_failed(t, status.worker_id, e)
                return False
            return True
        return False

    def _early_offer(self, t: Tracked) -> HandoffOffer:
        """An offer of `t` before its prefill: blocks for every token it computes, the first token to follow."""
        engine = self.engine.engine
        return HandoffOffer(
            req_id=t.req_id, attempt=t.msg.attempt, gateway_id=t.msg.gateway_id, prefill_id=self.worker_id,
            prompt_token_ids=t.msg.prompt_token_ids, output_token_ids=t.msg.output_token_ids, output_logprobs=[],
            output_top_logprobs=[], params=t.msg.params, seed=t.msg.seed, num_cached_tokens=0,
            num_blocks=-(-t.num_prefill_tokens // engine.block_size), deadline=t.msg.deadline,
            kv_cache_dtype=engine.kv_format.name, first_token_pending=True,
        )

    async def _stream(self, t: Tracked, decode_id: str, needed: list[int]) -> None:
        """Send the blocks at table positions `needed` to `decode_id` as the prefill computes
        them, then KVReady with the first token. Raises KVTransferError if the stream fails."""
        assert t.peer is not None
        stream = self.kv.stream(t.req_id, t.msg.attempt, t.peer, needed, self.engine.engine) if needed else None
        sending = None
        if stream is not None:
            t.kv_stream = stream
            self.layer_streams.add(t.req_id, stream)
            sending = asyncio.ensure_future(stream.run())
        over = asyncio.ensure_future(t.prefill_over.wait())
        try:
            await asyncio.wait([over] if sending is None else [over, sending], return_when=asyncio.FIRST_COMPLETED)
            if sending is not None and sending.done():
                sending.result()  # failed: raises; else every block landed before the first token was out
            await over
            if t.cancelled:
                return  # the cancel went to the decode worker too
            assert t.first is not None
            if t.first.is_finished:  # the first token ended it: that worker holds blocks for nothing
                await self.send(self.keys.inbox(decode_id), Cancel(t.req_id, "finished at its first token", t.msg.attempt))
                return
            if stream is not None and sending is not None:
                assert t.kv_block_ids is not None
                stream.finish(t.kv_block_ids)
                await sending
        finally:
            over.cancel()
            self.layer_streams.remove(t.req_id)
            t.kv_stream = None
            if stream is not None and sending is not None and not sending.done():
                stream.abort("the handoff ended")
                with contextlib.suppress(KVTransferError):
                    await sending
        location = "" if stream is None else f"{TCP_SCHEME}{t.peer.tcp_host}:{t.peer.tcp_port}"
        num_bytes = 0 if stream is None else stream.header.num_bytes
        await self._announce(t, decode_id, needed, location, num_bytes, with_first_token=True)
        if stream is not None:
            self.metrics.handoffs_streamed.inc()

    async def _offer_message(self, t: Tracked) -> HandoffOffer:
        h = t.export
        assert h is not None, "exported after the step that finished the prefill"
        return HandoffOffer(
            req_id=t.req_id, attempt=t.msg.attempt, gateway_id=t.msg.gateway_id, prefill_id=self.worker_id,
            prompt_token_ids=h.prompt_token_ids, output_token_ids=h.output_token_ids,
            output_logprobs=h.output_logprobs,
            output_top_logprobs=[[[token_id, logprob] for token_id, logprob in row] for row in h.output_top_logprobs],
            params=h.params.to_dict(), seed=h.seed, num_cached_tokens=h.num_cached_tokens,
            num_blocks=h.num_blocks, deadline=t.msg.deadline, kv_cache_dtype=self.engine.engine.kv_format.name,
        )

    async def _transfer_failed(self, t: Tracked, decode_id: str, error: KVTransferError) -> None:
        """A direct transfer failed (the decode worker died, stalled or refused it): that worker
        frees what it reserved, and the request is offered to another one."""
        logger.warning("the KV of %s did not reach %s (%s); offering it to another decode worker", t.req_id,
                       decode_id, error)
        self.metrics.handoff_failures.inc()
        t.decode_id = None
        await self.send(self.keys.inbox(decode_id), Cancel(t.req_id, "its KV transfer failed", t.msg.attempt))

    async def _place(
        self, t: Tracked, offer: HandoffOffer, failed: set[str]
    ) -> tuple[str | None, list[int] | None]:
        """Offer the request to decode workers but the `failed` ones, least loaded first, until one
        reserves blocks.

        Full workers are retried with backoff until the request's deadline; no decode worker at
        all for handoff_timeout_s is an error, and so is a round in which every one refused the
        offer outright (a KV cache dtype other than this worker's).
        """
        timeout_s = self.settings.worker.handoff_timeout_s
        alone_since: float | None = None
        delay = 0.05
        while not t.cancelled:
            if t.msg.deadline is not None and t.msg.deadline < time.time():
                await self._fail(t, "the request's deadline passed while waiting for a decode worker")
                return None, None
            candidates = [s for s in await with_backoff(
                lambda: self.picker.candidates(offer.num_blocks, t.msg.decode_hint), "listing decode workers",
                self.stopped,
            ) or [] if s.worker_id not in failed]
            if candidates:
                alone_since = None
            else:
                alone_since = alone_since or time.monotonic()
                if time.monotonic() - alone_since > timeout_s:
                    await self._fail(t, f"no decode worker able to hold {offer.num_blocks} KV blocks is alive")
                    return None, None
            refusals: list[str] = []
            for status in candidates:
                try:
                    needed = await self._offer(t, offer, status)
                except HandoffRefused as e:
                    refusals.append(str(e))
                    continue
                if needed is not None:
                    return status.worker_id, needed
                if t.cancelled:
                    break
            if refusals and len(refusals) == len(candidates):
                await self._fail(t, refusals[0])
                return None, None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
        return None, None

    async def _offer(self, t: Tracked, offer: HandoffOffer, status: WorkerStatus) -> list[int] | None:
        decode_id = status.worker_id
        future = self.accepts.expect(t.req_id, t.msg.attempt, decode_id)
        try:
            await self.send(self.keys.inbox(decode_id), offer)
            async with asyncio.timeout(self.settings.worker.handoff_timeout_s):
                accept = await future
        except TimeoutError:
            logger.warning("decode worker %s did not answer the offer of %s in time", decode_id, t.req_id)
            return None
        finally:
            self.accepts.forget(t.req_id, t.msg.attempt)
        if accept.refused:
            raise HandoffRefused(accept.refused)
        if accept.needed_blocks is None:
            logger.debug("decode worker %s has no room for %s", decode_id, t.req_id)
            return None
        t.decode_id = decode_id
        t.peer = KVPeer(decode_id, accept.kv_shm, status.kv_host, status.kv_port, accept.kv_token, bool(status.kv_nixl))
        self.picker.record(decode_id, offer.num_blocks)
        return accept.needed_blocks

    async def _transfer(self, t: Tracked, decode_id: str, needed: list[int]) -> None:
        location, num_bytes = "", 0
        if needed:
            assert t.kv_block_ids is not None and t.peer is not None
            engine, block_ids = self.engine.engine, [t.kv_block_ids[i] for i in needed]
            # read off the engine thread (see Engine.read_blocks): it does not wait for the step in progress
            source = KVSource(
                engine.kv_blocks_shape(len(block_ids)), engine.kv_dtype,
                read=lambda out: engine.read_blocks(block_ids, out), views=lambda: engine.kv_block_views(block_ids),
                block_ids=block_ids,
            )  # fmt: skip
            num_bytes = source.num_bytes
            location = await self.kv.put(t.req_id, t.msg.attempt, source, t.peer)
        if t.cancelled:  # the Cancel was forwarded to the decode worker, which dropped its reservation
            await self.kv.discard(location)
            return
        await self._announce(t, decode_id, needed, location, num_bytes)

    async def _announce(self, t: Tracked, decode_id: str, needed: list[int], location: str, num_bytes: int,
                        with_first_token: bool = False) -> None:
        """The KV is at `location`: tell the decode worker (with the first token, where the offer
        came before it), and the gateway who holds the request now."""
        ready = KVReady(t.req_id, t.msg.attempt, needed, location, num_bytes)
        if with_first_token:
            first = t.first
            assert first is not None
            ready.first_token_ids, ready.num_cached_tokens = first.new_token_ids, first.num_cached_tokens
            ready.first_logprobs = first.new_logprobs
            if first.new_top_logprobs is not None:
                ready.first_top_logprobs = [[[tid, lp] for tid, lp in row] for row in first.new_top_logprobs]
        # the update names the new holder, so the gateway can re-run the request should that worker die
        holder = TokenUpdate(
            req_id=t.req_id, attempt=t.msg.attempt, index=t.first_index + 1, token_ids=[], worker_id=decode_id
        )
        await self.send_many([
            (self.keys.inbox(decode_id), ready),
            (self.keys.replies(t.msg.gateway_id), TokenBatch([holder])),
        ])
        self._remember_handoff(t.req_id, decode_id)
        try:
            await self.kv.until_read(location, decode_id, t.req_id, t.msg.attempt)
        except KVTransferError as e:
            # that worker has given up on the read by now too: it failed the request, or died and its
            # requests are re-run; the blocks can go
            logger.warning("%s did not read the KV of %s: %s", decode_id, t.req_id, e)
            self.metrics.handoff_failures.inc()
            return
        self._observe_handoff(t, decode_id, len(needed), num_bytes, self.kv.transport_of(location))

    def _observe_handoff(self, t: Tracked, decode_id: str, num_blocks: int, num_bytes: int, transport: str) -> None:
        assert t.prefilled_at is not None
        handoff_s = time.monotonic() - t.prefilled_at
        ttft_s = max(1e-6, time.time() - handoff_s - t.arrived_at)
        self.metrics.handoff_seconds.observe(handoff_s)
        self.metrics.handoff_bytes[transport].inc(num_bytes)
        self._tally.num_handoffs += 1
        self._tally.num_handoff_bytes += num_bytes
        self._tally.handoff_s += handoff_s
        self._tally.ttft_s += ttft_s
        logger.debug(
            "handed %s to %s: %d blocks, %.2f MiB in %.1f ms (%.0f MiB/s), %.0f%% of its TTFT of %.0f ms",
            t.req_id, decode_id, num_blocks, num_bytes / MIB, handoff_s * 1000,
            num_bytes / MIB / max(handoff_s, 1e-6), 100 * handoff_s / ttft_s, ttft_s * 1000,
        )

    def _remember_handoff(self, req_id: str, decode_id: str) -> None:
        self._handed_off[req_id] = decode_id
        while len(self._handed_off) > MAX_REMEMBERED_HANDOFFS:
            self._handed_off.popitem(last=False)
