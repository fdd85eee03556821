"""Where the tokens of the requests a worker runs go: one TokenBatch per gateway per engine step,
sent in step order while the engine runs the next step. Decode and colocated workers stream
through it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.runtime.worker import Ack
from shared.engine.engine import RequestOutput
from shared.protocol import Message, TokenBatch, TokenUpdate

if TYPE_CHECKING:
    from services.runtime.worker import Worker


def token_update(out: RequestOutput, attempt: int, index: int, worker_id: str) -> TokenUpdate:
    top = out.new_top_logprobs
    return TokenUpdate(
        req_id=out.req_id,
        attempt=attempt,
        index=index,
        token_ids=list(out.new_token_ids),
        logprobs=out.new_logprobs,
        top_logprobs=[[[token_id, logprob] for token_id, logprob in row] for row in top] if top is not None else None,
        finish_reason=out.finish_reason,
        num_prompt_tokens=out.num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens,
        worker_id=worker_id,
    )


@dataclass(slots=True)
class Active:
    """A request in the engine, and where its tokens go."""

    gateway_id: str
    attempt: int
    next_index: int  # output position of the next token


class TokenStream:
    def __init__(self, worker: Worker) -> None:
        self._worker = worker
        self.active: dict[str, Active] = {}
        self._outbox: asyncio.Queue[tuple[list[tuple[str, Message]], list[Ack]]] = asyncio.Queue()
        self.num_unsent = 0  # steps whose batches are not sent yet

    def push(self, outputs: list[RequestOutput], acks: Sequence[Ack] = ()) -> list[RequestOutput]:
        """Queue one step's updates of the active requests, and `acks` to follow them in the same
        round trip; returns the outputs that were for active requests (finished ones leave)."""
        worker = self._worker
        batches: dict[str, list[TokenUpdate]] = {}
        delivered: list[RequestOutput] = []
        num_tokens = 0
        for out in outputs:
            active = self.active.get(out.req_id)
            if active is None:  # aborted while its last step ran
                continue
            batches.setdefault(active.gateway_id, []).append(
                token_update(out, active.attempt, active.next_index, worker.worker_id)
            )
            active.next_index += len(out.new_token_ids)
            num_tokens += len(out.new_token_ids)
            if out.is_finished:
                del self.active[out.req_id]
            delivered.append(out)
        worker.metrics.generation_tokens.inc(num_tokens)  # once a step: each inc takes a lock
        if batches or acks:
            self.num_unsent += 1
            items: list[tuple[str, Message]] = [(worker.keys.replies(g), TokenBatch(u)) for g, u in batches.items()]
            self._outbox.put_nowait((items, list(acks)))
        return delivered

    async def send_loop(self) -> None:
        """Sends each step's batches in order while the engine runs the next step."""
        while not self._worker.stopped.is_set():
            items, acks = await self._outbox.get()
            num_steps = 1
            while not self._outbox.empty():
                more_items, more_acks = self._outbox.get_nowait()
                items += more_items
                acks += more_acks
                num_steps += 1
            await self._worker.send_many(items, acks)
            self.num_unsent -= num_steps
