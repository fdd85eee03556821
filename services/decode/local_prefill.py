"""Requests a gateway sends straight to this decode worker, because it caches all but a few tokens
of their prompt (a multi-turn follow-up, typically: the history and the previous answer are
here): prefilled in this worker's own steps, with no prefill worker and no KV handoff.

    requests:<own id> --(group "prefill")--> engine --first token + XACK, one pipeline--> replies:<gateway>

The entry is acknowledged in the same Redis pipeline as the request's first token, which names
this worker as the holder (the colocated worker's scheme): a worker that dies before leaves the
entry pending, and a prefill worker takes it over as a gone worker's routed entry (reclaim.py);
one that dies after leaves the gateway a holder whose heartbeat lapsed, and the gateway re-runs
the request after the tokens it streamed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from services.prefill.tracked import entry_time
from services.runtime.intake import add_to_engine, finish_early, refusal
from services.runtime.token_stream import Active, TokenStream
from services.runtime.worker import Ack
from shared.engine.engine import RequestOutput
from shared.protocol import GenerateRequest, Message
from shared.streams import PREFILL_GROUP

logger = logging.getLogger(__name__)

INTAKE_BATCH = 8  # entries per read; each is a short prefill


@dataclass(slots=True, frozen=True)
class Unacked:
    """A request admitted here whose first token is not out yet."""

    attempt: int
    entry_id: bytes


class DecodeHost(Protocol):
    """What local prefill needs of the decode worker: any worker's runtime (`Worker`) and the decode
    worker's token stream, tally and view of the requests it holds. A protocol, so that this module
    does not import the worker that imports it."""

    bus: Any
    keys: Any
    worker_id: str
    metrics: Any
    draining: bool
    stopping: asyncio.Event
    unhandled: dict[str, set[bytes]]
    tokens: TokenStream
    tally: Any

    def consume(self, *args: Any) -> Coroutine[Any, Any, None]: ...

    async def ack(self, stream: str, group: str, entry_id: bytes) -> None: ...

    def wake_engine(self) -> None: ...

    def known_attempt(self, req_id: str) -> int | None: ...

    async def abort(self, req_id: str, reason: str) -> None: ...


class LocalPrefill:
    def __init__(self, worker: DecodeHost) -> None:
        self._worker = worker
        self.stream = worker.keys.routed_requests(worker.worker_id)
        self._unacked: dict[str, Unacked] = {}

    async def setup(self) -> None:
        w = self._worker
        await w.bus.ensure_group(self.stream, PREFILL_GROUP)
        # the prefill workers' reclaimer reads the routed streams of gone workers from this set
        await w.bus.redis.sadd(w.keys.routed_workers, w.worker_id)

    def consume(self) -> Coroutine[Any, Any, None]:
        w = self._worker
        return w.consume(self.stream, PREFILL_GROUP, self._on_entry, self._capacity, w.stopping)

    def is_idle(self) -> bool:
        return not self._unacked

    async def trim(self) -> None:
        await self._worker.bus.trim_acknowledged(self.stream, PREFILL_GROUP)

    def _capacity(self) -> int:
        w = self._worker
        return 0 if w.draining else INTAKE_BATCH - len(w.unhandled[self.stream])

    async def _on_entry(self, entry_id: bytes, msg: Message | None) -> None:
        w = self._worker
        if not isinstance(msg, GenerateRequest):
            logger.error("dropping entry %s of %s: not a generate request", entry_id.decode(), self.stream)
            await w.ack(self.stream, PREFILL_GROUP, entry_id)
            return
        known = w.known_attempt(msg.req_id)
        if known is not None and known >= msg.attempt:  # a duplicate of work in hand
            await w.ack(self.stream, PREFILL_GROUP, entry_id)
            return
        if known is not None:
            await w.abort(msg.req_id, f"superseded by attempt {msg.attempt}")
        refused = await refusal(w, msg)
        if refused is not None:
            await finish_early(w, msg, self.stream, entry_id, *refused)
            return
        rejected = await add_to_engine(w, msg, stop_after_prefill=False)
        if rejected is not None:
            await finish_early(w, msg, self.stream, entry_id, "abort", rejected)
            return
        # no await since the engine call returned: no step output for it has been handled yet
        w.tokens.active[msg.req_id] = Active(msg.gateway_id, msg.attempt, len(msg.output_token_ids))
        self._unacked[msg.req_id] = Unacked(msg.attempt, entry_id)
        w.tally.num_prefilled_here += 1
        w.metrics.local_prefills.inc()
        logger.debug("prefilling %s here (%d prompt tokens, attempt %d)", msg.req_id, len(msg.prompt_token_ids),
                     msg.attempt)
        w.wake_engine()

    def first_tokens(self, outputs: list[RequestOutput]) -> list[Ack]:
        """The entries to acknowledge with this step's tokens: those of requests whose first token it is."""
        now, acks = time.time(), []
        metrics = self._worker.metrics
        for out in outputs:
            unacked = self._unacked.pop(out.req_id, None)
            if unacked is None:
                continue
            acks.append((self.stream, PREFILL_GROUP, unacked.entry_id))
            metrics.prompt_tokens.inc(out.num_prompt_tokens)
            metrics.time_to_first_token.observe(max(0.0, now - entry_time(unacked.entry_id)))
        return acks

    async def forget(self, req_id: str) -> None:
        """A request aborted before its first token: its entry is done with."""
        unacked = self._unacked.pop(req_id, None)
        if unacked is not None:
            await self._worker.ack(self.stream, PREFILL_GROUP, unacked.entry_id)
