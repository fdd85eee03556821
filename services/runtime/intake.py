"""What every worker that reads requests streams does before a request enters its engine: skip
the ones that expired or were cancelled while queued, and answer those that will not run."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from shared.engine.engine import InvalidRequestError
from shared.engine.sampling_params import SamplingParamsError
from shared.protocol import GenerateRequest, TokenBatch, TokenUpdate
from shared.streams import PREFILL_GROUP, with_backoff

if TYPE_CHECKING:
    from services.runtime.worker import Worker

logger = logging.getLogger(__name__)


async def refusal(worker: Worker, msg: GenerateRequest) -> tuple[str, str | None] | None:
    """(finish reason, error) for a request that must not run, or None."""
    if msg.deadline is not None and msg.deadline < time.time():
        return "abort", "the request's deadline passed before a worker picked it up"
    is_cancelled = await with_backoff(
        lambda: worker.bus.redis.exists(worker.keys.cancelled(msg.req_id)), "checking cancel marks", worker.stopped
    )
    return ("abort", None) if is_cancelled else None


async def finish_early(worker: Worker, msg: GenerateRequest, stream: str, entry_id: bytes, finish_reason: str,
                       error: str | None) -> None:
    """Answer a request that will not run (cancelled, expired, invalid) and acknowledge its entry."""
    update = TokenUpdate(
        req_id=msg.req_id, attempt=msg.attempt, index=len(msg.output_token_ids), token_ids=[],
        finish_reason=finish_reason, worker_id=worker.worker_id, error=error,
    )
    await worker.send(worker.keys.replies(msg.gateway_id), TokenBatch([update]))
    await worker.ack(stream, PREFILL_GROUP, entry_id)


async def add_to_engine(worker: Worker, msg: GenerateRequest, stop_after_prefill: bool) -> str | None:
    """Queue `msg` in the worker's engine; the error a request the engine rejects gets, else None."""
    engine = worker.engine.engine
    try:
        # at the step's next layer: a burst read in one batch is queued at once, not one request per step
        await worker.engine.call_between_layers(
            engine.add_request, msg.req_id, msg.prompt_token_ids, msg.sampling_params, stop_after_prefill,
            msg.output_token_ids, msg.seed,
        )
    except (InvalidRequestError, SamplingParamsError, TypeError, ValueError) as e:
        logger.info("rejected %s: %s", msg.req_id, e)
        return f"invalid request: {e}"
    return None
