"""Decode worker: KV in from prefill workers, tokens out to the gateways, one step at a time.

    inbox --HandoffOffer--> reserve blocks --HandoffAccept(needed positions | None, transfer token)--> prefill inbox
    data port ------------> token checked against the reservation, bytes straight into its blocks
    inbox --KVReady-------> fetch bytes and write blocks (tmpfs, Redis), commit: the request joins the next step
                            (an offer made before the prefill, to stream its KV layer by layer: with its first token)
    inbox --Cancel--------> abort: its blocks are free before the next step
    requests:<own id> ----> a prompt this worker caches all but a few tokens of: prefilled here (local_prefill.py)
    every step -----------> one TokenBatch per gateway, sent while the next step runs

A reservation whose KVReady does not come within handoff_timeout_s (after its last byte, for
one the data port is still writing) is aborted, so a prefill
worker that dies mid-handoff cannot pin blocks here; the gateway is told (a clear error) unless
that prefill worker died, in which case another one re-runs the request it left pending. A
transfer over the data port that fails frees the reservation at once and tells nobody: the
prefill worker, if alive, offers the request elsewhere, and if dead, its request is re-run.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import torch

from services.decode.local_prefill import LocalPrefill
from services.decode.reservation import Reservation
from services.kv_transfer import KVTransferError, TransferHeader
from services.kv_transfer.base import num_bytes
from services.runtime.token_stream import Active, TokenStream
from services.runtime.worker import Worker
from shared.engine.engine import Engine, InvalidRequestError, RequestOutput
from shared.engine.kv_handoff import Handoff
from shared.engine.request import ReqId
from shared.engine.sampling_params import SamplingParams, SamplingParamsError
from shared.protocol import (
    Cancel,
    HandoffAccept,
    HandoffOffer,
    KVReady,
    Message,
    TokenBatch,
    TokenUpdate,
)
from shared.settings import WorkerServiceSettings
from shared.streams import INBOX_GROUP

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Tally:
    """What the worker did since its last report."""

    num_tokens: int = 0
    num_joined: int = 0
    num_finished: int = 0
    num_cancelled: int = 0
    num_prefilled_here: int = 0


def handoff_from_offer(offer: HandoffOffer) -> Handoff:
    return Handoff(
        req_id=ReqId(offer.req_id),
        prompt_token_ids=list(offer.prompt_token_ids),
        output_token_ids=list(offer.output_token_ids),
        output_logprobs=list(offer.output_logprobs),
        output_top_logprobs=[[(int(t), float(lp)) for t, lp in row] for row in offer.output_top_logprobs],
        params=SamplingParams.from_dict(offer.params),
        seed=offer.seed,
        num_cached_tokens=offer.num_cached_tokens,
        num_blocks=offer.num_blocks,
        first_token_pending=offer.first_token_pending,
    )


def reserve_kv(engine: Engine, handoff: Handoff) -> tuple[list[int], list[int]] | None:
    """Reserve blocks for an offered request: (table positions to receive, their pool blocks), or
    None without room. One engine call, so the KV can later be written without another."""
    needed = engine.reserve_import(handoff)
    return None if needed is None else (needed, engine.import_block_ids(handoff.req_id, needed))


FirstToken = tuple[int, float | None, list[tuple[int, float]] | None, int]  # Engine.add_first_token's arguments


def first_token_of(msg: KVReady) -> FirstToken:
    """The first token a KVReady brings for an offer made before the prefill sampled it."""
    if len(msg.first_token_ids) != 1:
        raise KVTransferError(f"KVReady of {msg.req_id} brings {len(msg.first_token_ids)} first tokens, not one")
    logprob = msg.first_logprobs[0] if msg.first_logprobs else None
    top = [(int(t), float(lp)) for t, lp in msg.first_top_logprobs[0]] if msg.first_top_logprobs else None
    return msg.first_token_ids[0], logprob, top, msg.num_cached_tokens


def commit_kv(engine: Engine, req_id: str, first: FirstToken | None = None) -> None:
    """Let an imported request run (with its first token, where the offer came before it); on
    failure its blocks are freed."""
    try:
        if first is not None:
            engine.add_first_token(req_id, *first)
        engine.commit_import(req_id)
    except Exception:
        engine.abort_request(req_id)
        raise


class DecodeWorker(Worker):
    role = "decode"

    def __init__(self, settings: WorkerServiceSettings) -> None:
        super().__init__(settings)
        self._reserved: dict[str, Reservation] = {}
        self._writing: dict[str, asyncio.Future[None]] = {}  # KV writes in flight, off the engine thread
        self._in_turn: dict[str, asyncio.Task[None]] = {}  # each request's latest offer or cancel being handled
        self.tokens = TokenStream(self)
        self.local = LocalPrefill(self)
        self.tally = Tally()
        self.kv.listen(self._is_kv_peer, self._claim_kv, self._kv_settled)

    def engine_loaded(self) -> None:
        self._pace()
        # after the pacing, whose ledger of late gaps it then shares: for follow-up turns prefilled here
        self.engine.stall_for_prompts(first_token_seen=False)

    def _pace(self) -> None:
        targets = self.settings.targets
        # a pause as long as a first token may take, and never so long that it reads as a stuck engine
        max_pause_s = min(targets.ttft_ms / 1000, self.settings.worker.stuck_after_s / 2)
        if not self.engine.pace(max_pause_s):
            return
        logger.info("decode paced: while a neighbour on these cores prefills, tokens come up to %g ms apart "
                    "(LLMD_TARGETS__ITL_MS) and the cores go to the prompts in between", targets.itl_ms)
        if self.engine.policy.pauses_streams:
            logger.info("a prompt that keeps the neighbour busy %g ms pauses the streams for up to %g ms where "
                        "%d%% of each one's gaps still meet the target (LLMD_TARGETS__ITL_PERCENTILE)",
                        1000 * self.engine.policy.pause_after_s, 1000 * max_pause_s, targets.itl_percentile)

    async def setup(self) -> None:
        await super().setup()
        await self.local.setup()

    def serve_tasks(self) -> list[Coroutine[Any, Any, None]]:
        inbox = self.consume(self.inbox, INBOX_GROUP, self._on_inbox, lambda: 64, self.stopped)
        return [inbox, self.local.consume(), self.tokens.send_loop()]

    def is_idle(self) -> bool:
        tokens = self.tokens
        return (not self._reserved and not tokens.active and tokens.num_unsent == 0 and not self.has_helpers
                and self.local.is_idle())

    async def trim(self) -> None:
        await super().trim()
        await self.local.trim()

    def report(self, interval_s: float) -> str | None:
        tally, self.tally = self.tally, Tally()
        stats = self.engine.stats
        if stats is None or not (tally.num_tokens or tally.num_joined or tally.num_cancelled):
            return None
        return (
            f"last {interval_s:.0f}s: {tally.num_tokens} tokens ({tally.num_tokens / interval_s:.1f}/s), "
            f"{tally.num_joined} joined, {tally.num_prefilled_here} prefilled here, {tally.num_finished} finished, "
            f"{tally.num_cancelled} cancelled; "
            f"now {stats.num_running} running, {stats.num_waiting} waiting, KV {100 * stats.kv.usage:.0f}% used"
        )

    # -- inbox -----------------------------------------------------------------------------------

    async def _on_inbox(self, entry_id: bytes, msg: Message | None) -> None:
        if isinstance(msg, (HandoffOffer, Cancel)):
            # each in its own task: the reserves of a burst of offers then share one wait for the step
            # in progress, instead of waiting for one step each; one request's messages keep their order
            task = self.spawn(self._handle_in_turn(entry_id, msg, self._in_turn.get(msg.req_id)))
            self._in_turn[msg.req_id] = task
            task.add_done_callback(lambda done: self._end_turn(msg.req_id, done))
            return
        try:
            if isinstance(msg, KVReady):
                self.spawn(self._on_kv_ready(msg))  # the fetch must not hold up offers and cancels
            else:
                logger.warning("ignoring unexpected %s in inbox", type(msg).__name__)
        finally:
            await self.ack(self.inbox, INBOX_GROUP, entry_id)

    async def _handle_in_turn(
        self, entry_id: bytes, msg: HandoffOffer | Cancel, after: asyncio.Task[None] | None
    ) -> None:
        try:
            if after is not None:
                await asyncio.wait([after])
            if isinstance(msg, HandoffOffer):
                await self._on_offer(msg)
            else:
                await self._on_cancel(msg)
        finally:
            await self.ack(self.inbox, INBOX_GROUP, entry_id)

    def _end_turn(self, req_id: str, done: asyncio.Task[None]) -> None:
        if self._in_turn.get(req_id) is done:
            del self._in_turn[req_id]

    async def _on_offer(self, offer: HandoffOffer) -> None:
        held = self._reserved.get(offer.req_id)
        if held is not None and held.offer.attempt == offer.attempt:  # re-offered after our answer got lost
            await self._answer(offer, held)
            return
        known_attempt = self.known_attempt(offer.req_id)
        if known_attempt is not None:
            if known_attempt > offer.attempt:
                await self._answer(offer, None)
                return
            await self.abort(offer.req_id, f"superseded by attempt {offer.attempt}")
        if (mismatch := self._kv_mismatch(offer)) is not None:
            logger.error("refusing %s: %s", offer.req_id, mismatch)
            await self._answer(offer, None, refused=mismatch)
            return
        await self._answer(offer, None if self.draining else await self._reserve(offer))

    def _kv_mismatch(self, offer: HandoffOffer) -> str | None:
        """Why blocks stored as the offer says cannot land in this pool, or None: they move as raw
        bytes, never converted, so both pools must store the same format."""
        ours = self.engine.engine.kv_format.name
        if not offer.kv_cache_dtype or offer.kv_cache_dtype == ours:
            return None
        return (f"KV cache dtype mismatch: prefill worker {offer.prefill_id} stores {offer.kv_cache_dtype}, decode "
                f"worker {self.worker_id} stores {ours}; start both with the same LLMD_KV_CACHE__DTYPE")

    def known_attempt(self, req_id: str) -> int | None:
        if (held := self._reserved.get(req_id)) is not None:
            return held.offer.attempt
        if (active := self.tokens.active.get(req_id)) is not None:
            return active.attempt
        return None

    async def _reserve(self, offer: HandoffOffer) -> Reservation | None:
        try:
            reserved = await self.engine.call_between_layers(reserve_kv, self.engine.engine, handoff_from_offer(offer))
        except (InvalidRequestError, SamplingParamsError, TypeError, ValueError) as e:
            logger.warning("cannot take %s: %s", offer.req_id, e)
            return None
        if reserved is None:
            logger.debug("no room for %s (%d blocks)", offer.req_id, offer.num_blocks)
            return None
        needed, block_ids = reserved
        expiry = asyncio.get_running_loop().call_later(
            self.settings.worker.handoff_timeout_s, self._expire, offer.req_id, offer.attempt
        )
        token = secrets.token_hex(16) if self.kv.port is not None else ""
        held = self._reserved[offer.req_id] = Reservation(offer, needed, block_ids, expiry, token)
        return held

    async def _answer(self, offer: HandoffOffer, held: Reservation | None, refused: str = "") -> None:
        accept = HandoffAccept(
            offer.req_id, offer.attempt, self.worker_id, None if held is None else held.needed_blocks,
            kv_shm=self.kv.shm_token, kv_token="" if held is None else held.token, refused=refused,
        )
        await self.send(self.keys.inbox(offer.prefill_id), accept)

    def _expire(self, req_id: str, attempt: int) -> None:
        held = self._reserved.get(req_id)
        if held is None or held.offer.attempt != attempt:
            return
        if held.receiving:  # a transfer streams into it as the prefill runs: its own bound on silence ends it
            held.expiry = asyncio.get_running_loop().call_later(
                self.settings.worker.handoff_timeout_s, self._expire, req_id, attempt
            )
            return
        del self._reserved[req_id]
        error = f"its KV did not arrive from {held.offer.prefill_id} within {self.settings.worker.handoff_timeout_s}s"
        logger.warning("giving up on %s: %s; its reserved blocks are free", req_id, error)
        self.spawn(self._free(req_id, attempt))
        if not held.receiving:  # a sender that is still connected learns it failed, and offers it elsewhere
            self.spawn(self._fail_unless_reclaimed(held.offer, error))

    async def _free(self, req_id: str, attempt: int) -> None:
        """Free the blocks of a reservation already dropped from `_reserved`, once no transfer writes them."""
        await self.kv.stop_receiving(req_id, attempt)
        await self.engine.call(self.engine.engine.abort_request, req_id)

    async def _fail_unless_reclaimed(self, offer: HandoffOffer, error: str, after_s: float = 0.0) -> None:
        """Tell the gateway, so the request ends instead of waiting for its deadline; unless the
        prefill worker died (judged `after_s` from now): its request stays pending, another prefill
        worker re-runs it, and an error now would end a request that is about to be served."""
        await asyncio.sleep(after_s)
        alive = await self.bus.redis.exists(self.keys.alive(offer.prefill_id))
        registered = await self.bus.redis.hexists(self.keys.workers("prefill"), offer.prefill_id)
        if alive or not registered:
            await self._fail(offer, error)

    async def _on_kv_ready(self, msg: KVReady) -> None:
        held = self._reserved.get(msg.req_id)
        if held is None or held.offer.attempt != msg.attempt or msg.block_positions != held.needed_blocks:
            logger.info("KV for %s (attempt %d) matches no reservation here; dropping it", msg.req_id, msg.attempt)
            await self._discard(msg.location)
            return
        try:
            first = first_token_of(msg) if held.offer.first_token_pending else None
            data = await self._fetch(held, msg)
        except KVTransferError as e:
            if self._reserved.get(msg.req_id) is held:  # else a cancel or its expiry ended the read, and answers
                await self.abort(msg.req_id, str(e))
                # a prefill worker that died mid-read still looks alive until its heartbeat lapses
                ttl_s = self.settings.worker.heartbeat_ttl_s if self.kv.transport_of(msg.location) == "nixl" else 0
                await self._fail_unless_reclaimed(held.offer, f"KV transfer failed: {e}", after_s=ttl_s)
            return
        if self._reserved.get(msg.req_id) is not held:  # cancelled or expired during the fetch
            await self._discard(msg.location)
            return
        del self._reserved[msg.req_id]
        held.expiry.cancel()
        offer = held.offer
        # active before the write: a Cancel from here on finds the request, and its abort waits for the write
        num_output = len(offer.output_token_ids) + (first is not None)
        active = self.tokens.active[msg.req_id] = Active(offer.gateway_id, offer.attempt, num_output)
        try:
            if data is not None:
                # off the engine thread (see Engine.write_blocks): decode steps go on while the bytes land
                write = self._writing[msg.req_id] = asyncio.ensure_future(
                    asyncio.to_thread(self.engine.engine.write_blocks, held.block_ids, data)
                )
                try:
                    await write
                finally:
                    del self._writing[msg.req_id]
            if self.tokens.active.get(msg.req_id) is not active:  # cancelled during the write: _abort frees it
                await self._discard(msg.location)
                return
            # at the step's next layer: the request joins the very next step
            await self.engine.call_between_layers(commit_kv, self.engine.engine, msg.req_id, first)
        except Exception as e:
            logger.exception("importing the KV of %s failed", msg.req_id)
            self.tokens.active.pop(msg.req_id, None)
            await self.engine.call(self.engine.engine.abort_request, msg.req_id)  # frees its blocks
            await self._fail(offer, f"KV import failed: {e}")
        else:
            self.wake_engine()
            self.tally.num_joined += 1
            logger.debug("imported %s: %d blocks, %d bytes", msg.req_id, len(msg.block_positions), msg.num_bytes)
        await self._discard(msg.location)

    async def _fetch(self, held: Reservation, msg: KVReady) -> torch.Tensor | None:
        """The KV to write into the reserved blocks; None when there is nothing to write (no
        blocks were sent, or they landed in the blocks over the data port)."""
        if not msg.block_positions:
            return None
        transport = self.kv.transport_of(msg.location)
        if transport == "nixl":
            await self._read_nixl(held, msg)
            return None
        if transport != "tcp":
            return await self.kv.get(msg.location)
        if not held.landed:
            raise KVTransferError(f"KVReady of {msg.req_id} came before all of its bytes did")
        return held.staging

    async def _read_nixl(self, held: Reservation, msg: KVReady) -> None:
        """Read the prefill worker's blocks into the reserved ones through NIXL, with the agent
        metadata of that worker's live heartbeat."""
        engine, prefill_id = self.engine.engine, held.offer.prefill_id
        expected = num_bytes(engine.kv_blocks_shape(len(held.block_ids)), engine.kv_dtype)
        if msg.num_bytes != expected:
            raise KVTransferError(f"{msg.num_bytes} bytes announced for {msg.req_id!r}; its reservation holds "
                                  f"{len(held.block_ids)} blocks of {expected} bytes")
        status = next((s for s in await self.bus.live_workers("prefill") if s.worker_id == prefill_id), None)
        if status is None or not status.kv_nixl:
            raise KVTransferError(f"{prefill_id}, which holds the KV of {msg.req_id!r}, has no live heartbeat with "
                                  f"NIXL metadata")
        await self.kv.read_into(msg.location, prefill_id, status.kv_nixl, held.block_ids, msg.req_id, msg.attempt)

    # -- the data port -----------------------------------------------------------------------------

    async def _is_kv_peer(self, host: str) -> bool:
        """Whether a live prefill worker's heartbeat names `host` as its KV address."""
        return any(s.kv_host == host for s in await self.bus.live_workers("prefill"))

    async def _claim_kv(self, header: TransferHeader, host: str) -> list[memoryview]:
        held = self._reserved.get(header.req_id)
        if held is None or held.offer.attempt != header.attempt:
            raise KVTransferError(f"no reservation for {header.req_id!r} attempt {header.attempt}")
        return held.claim(header, host, self.engine.engine)

    async def _kv_settled(self, header: TransferHeader, error: str | None) -> None:
        held = self._reserved.get(header.req_id)
        if held is None or held.offer.attempt != header.attempt:
            return  # cancelled or expired meanwhile: its blocks are freed by whoever dropped it
        held.receiving = False
        if error is None:
            held.landed = True
        else:
            await self.abort(header.req_id, f"its KV transfer failed: {error}")

    async def _on_cancel(self, msg: Cancel) -> None:
        held_attempt = self.known_attempt(msg.req_id)
        if held_attempt is None:
            return
        if not msg.covers(held_attempt):  # meant for an attempt this worker no longer runs
            logger.info("ignoring a cancel of %s attempt %s (%s): attempt %d runs here", msg.req_id, msg.attempt,
                        msg.reason, held_attempt)
            return
        await self.abort(msg.req_id, msg.reason)

    async def abort(self, req_id: str, reason: str) -> None:
        held = self._reserved.pop(req_id, None)
        if held is not None:
            held.expiry.cancel()
            await self.kv.stop_receiving(req_id, held.offer.attempt)  # freed blocks may go to another request
        self.tokens.active.pop(req_id, None)
        await self.local.forget(req_id)
        if (write := self._writing.get(req_id)) is not None:
            await asyncio.wait([write])  # freed blocks may go to another request: never while written to
        await self.engine.call(self.engine.engine.abort_request, req_id)
        self.tally.num_cancelled += 1
        logger.info("aborted %s (%s); its blocks are free", req_id, reason)

    async def _discard(self, location: str) -> None:
        if location:
            await self.kv.discard(location)

    async def _fail(self, offer: HandoffOffer, error: str) -> None:
        update = TokenUpdate(
            req_id=offer.req_id, attempt=offer.attempt, index=len(offer.output_token_ids), token_ids=[],
            finish_reason="abort", worker_id=self.worker_id, error=error,
        )
        await self.send(self.keys.replies(offer.gateway_id), TokenBatch([update]))

    # -- outputs ---------------------------------------------------------------------------------

    async def on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in self.tokens.push(outputs, self.local.first_tokens(outputs)):
            self.tally.num_tokens += len(out.new_token_ids)
            self.tally.num_finished += out.is_finished
