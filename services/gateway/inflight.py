"""The gateway's record of each request it has on the workers, and the rule that keeps the
request's token stream exact: every output position accepted once, from the current attempt."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace

from shared.engine.sampling_params import SamplingParams
from shared.protocol import GenerateRequest, TokenUpdate

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class InflightRequest:
    """One prompt sample on the workers (one GenerateRequest), with all it takes to re-queue it:
    a re-run sends `attempt + 1` and continues after `output_token_ids`.

    `replies` receives the accepted updates (it may be shared by the samples of one API request);
    `worker_id` is the worker holding it, where a Cancel goes and whose death triggers a re-run:
    the last one heard from, or the decode worker a prefill worker named as it handed it over.
    """

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    deadline: float  # unix time
    replies: asyncio.Queue[TokenUpdate]
    attempt: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    worker_id: str | None = None
    queued_on: str | None = None  # the worker whose own requests stream it was put on, if any
    is_finished: bool = False

    def to_message(self, gateway_id: str) -> GenerateRequest:
        return GenerateRequest(
            req_id=self.req_id,
            gateway_id=gateway_id,
            prompt_token_ids=self.prompt_token_ids,
            params=self.params.to_dict(),
            seed=self.seed,
            attempt=self.attempt,
            output_token_ids=list(self.output_token_ids),
            deadline=self.deadline,
        )

    def accept(self, update: TokenUpdate) -> TokenUpdate | None:
        """`update` cut to the tokens not seen yet, and recorded; None when it is from another
        attempt, arrives after the end, or repeats only what was seen (a take-over re-sends)."""
        if update.attempt != self.attempt or self.is_finished:
            return None
        if update.worker_id:
            self.worker_id = update.worker_id
        num_seen = len(self.output_token_ids)
        if update.index > num_seen and update.token_ids:
            logger.error("%s: update starts at output position %d, expected %d; tokens in between are lost",
                         self.req_id, update.index, num_seen)
        fresh = _without_first(update, num_seen - update.index)
        if not fresh.token_ids and fresh.finish_reason is None and fresh.error is None:
            return None
        self.output_token_ids.extend(fresh.token_ids)
        self.is_finished = fresh.finish_reason is not None
        return fresh


def _without_first(update: TokenUpdate, num_tokens: int) -> TokenUpdate:
    if num_tokens <= 0:
        return update
    return replace(
        update,
        index=update.index + num_tokens,
        token_ids=update.token_ids[num_tokens:],
        logprobs=None if update.logprobs is None else update.logprobs[num_tokens:],
        top_logprobs=None if update.top_logprobs is None else update.top_logprobs[num_tokens:],
    )
