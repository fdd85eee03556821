"""Colocated worker: one engine prefills and decodes, as vLLM and SGLang run without
disaggregation. Long prompts are prefilled in chunks under the step's token budget, in the same
steps as the decodes of the running requests, so they slow those decodes down: the interference
that prefill and decode workers on separate cores avoid (bench/interference.py measures it).

    requests --(group "prefill")--> engine --every step: one TokenBatch per gateway--> replies:<gateway>
    inbox --Cancel--> abort: its blocks are free before the next step

The intake is the prefill worker's (admission, cancel marks, deadlines, taking over the entries of
dead workers); the output path is the decode worker's (`TokenStream`). A request's stream entry is
acknowledged in the same Redis pipeline as its first token, which names this worker as the holder:
a worker that dies before leaves the entry pending and another worker claims it (reclaim.py); one
that dies after leaves the gateway a holder whose heartbeat lapses, so the gateway re-runs the
request after the tokens it streamed. A request stays tracked here until it finishes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Coroutine
from typing import Any

from services.prefill.tracked import Tracked
from services.prefill.worker import PrefillWorker
from services.runtime.token_stream import Active, TokenStream
from services.runtime.worker import Ack
from shared.engine.engine import RequestOutput
from shared.protocol import GenerateRequest
from shared.settings import WorkerServiceSettings
from shared.streams import PREFILL_GROUP

logger = logging.getLogger(__name__)


class ColocatedWorker(PrefillWorker):
    role = "colocated"
    stop_after_prefill = False

    def __init__(self, settings: WorkerServiceSettings) -> None:
        super().__init__(settings)
        self.tokens = TokenStream(self)

    def engine_loaded(self) -> None:
        super().engine_loaded()
        self.engine.stall_for_prompts(first_token_seen=True)

    def serve_tasks(self) -> list[Coroutine[Any, Any, None]]:
        return [*super().serve_tasks(), self.tokens.send_loop()]

    def is_idle(self) -> bool:
        return super().is_idle() and self.tokens.num_unsent == 0

    async def _admit(self, stream: str, entry_id: bytes, msg: GenerateRequest) -> None:
        await super()._admit(stream, entry_id, msg)
        t = self._tracked.get(msg.req_id)
        if t is not None and t.msg is msg:  # admitted now (not a duplicate, refused or invalid)
            # super() tracked it with no await since, so no step output for it has been handled yet
            self.tokens.active[msg.req_id] = Active(msg.gateway_id, msg.attempt, t.first_index)

    async def on_outputs(self, outputs: list[RequestOutput]) -> None:
        now = time.time()
        acks: list[Ack] = []
        for out in outputs:
            t = self._tracked.get(out.req_id)
            if t is None:  # cancelled while its step ran
                continue
            if t.prefilled_at is None:
                self._observe_prefill(t, out, now)
                acks.append((t.stream, PREFILL_GROUP, t.entry_id))
            if out.is_finished:
                del self._tracked[out.req_id]
        self.tokens.push(outputs, acks)
        self.capacity_changed.set()

    async def _cancel(self, t: Tracked, reason: str) -> None:
        logger.info("cancelling %s: %s", t.req_id, reason)
        self.tokens.active.pop(t.req_id, None)
        await self.engine.call(self.engine.engine.abort_request, t.req_id)
        await self._forget(t, release=False)
