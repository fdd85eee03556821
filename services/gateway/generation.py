"""One API request on the workers, read back as one stream of per-choice deltas.

    plan_choices -> Generation.__aenter__ (XADD every request) -> deltas() -> __aexit__

Each choice turns its token updates into text with an IncrementalDetokenizer, so a stop
string never reaches the client; a choice that hits one is cancelled on the workers at once.
Leaving the `async with` block cancels whatever has not finished: the client went away,
the deadline passed, or a worker failed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

from services.gateway.inflight import InflightRequest
from services.gateway.metrics import DETOKENIZE
from services.gateway.openai_responses import PositionLogprobs, TokenLogprob, Usage
from services.gateway.openai_schema import ApiError, FinishReason
from services.gateway.planner import PlannedChoice
from shared.protocol import TokenUpdate
from shared.text.detokenizer import IncrementalDetokenizer
from shared.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from services.gateway.context import Gateway

logger = logging.getLogger(__name__)

# What a Generation's deadline timer queues among its replies: one timer per request, where a
# timeout around each wait for a reply cost a tenth of a busy gateway's time.
_DEADLINE_PASSED = TokenUpdate(req_id="", attempt=0, index=0, token_ids=[])


@dataclass(slots=True, frozen=True)
class ChoiceDelta:
    """What one update added to one choice; the last one of a choice carries `finish_reason`."""

    index: int
    text: str
    logprobs: list[PositionLogprobs] | None  # None unless the request asked for logprobs
    finish_reason: FinishReason | None
    text_offset: int  # characters of the choice's text before `text`
    is_first: bool  # the choice's first delta: it comes with the choice's first token (or its end), never before


class ChoiceState:
    def __init__(self, planned: PlannedChoice, tokenizer: Tokenizer) -> None:
        self.planned = planned
        self._tokenizer = tokenizer
        self._detok = IncrementalDetokenizer(tokenizer, planned.req.prompt_token_ids, stop=planned.req.params.stop)
        self._wants_logprobs = planned.req.params.logprobs is not None
        self.num_text_chars = 0
        self.num_deltas = 0
        self.num_cached_tokens = 0
        self.finish_reason: FinishReason | None = None
        self.last_token_at: float | None = None

    @property
    def req(self) -> InflightRequest:
        return self.planned.req

    @property
    def num_tokens(self) -> int:
        """Output tokens that count: up to and including the one that completed a stop string."""
        return self._detok.num_output_tokens

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stopped_early(self) -> bool:
        """A stop string ended the choice while the workers still generate it."""
        return self._detok.stopped and not self.req.is_finished

    def consume(self, update: TokenUpdate) -> ChoiceDelta | None:
        if update.error is not None or update.finish_reason == "abort":
            raise _worker_error(self.req, update)
        self.num_cached_tokens = update.num_cached_tokens
        num_before = self._detok.num_output_tokens
        text = self._detok.add(update.token_ids)
        num_new = self._detok.num_output_tokens - num_before
        if self._detok.stopped:
            self.finish_reason = "stop"
        elif update.finish_reason is not None:
            text += self._detok.flush()
            self.finish_reason = "length" if update.finish_reason == "length" else "stop"
        logprobs = self._positions(update, num_new) if self._wants_logprobs else None
        if not text and not logprobs and self.finish_reason is None:
            return None
        delta = ChoiceDelta(
            self.planned.index, text, logprobs, self.finish_reason, self.num_text_chars, is_first=self.num_deltas == 0
        )
        self.num_text_chars += len(text)
        self.num_deltas += 1
        return delta

    def _positions(self, update: TokenUpdate, num_tokens: int) -> list[PositionLogprobs]:
        token_bytes = self._tokenizer.token_bytes
        tops = update.top_logprobs or [[] for _ in range(num_tokens)]
        return [
            PositionLogprobs(
                TokenLogprob(token_bytes(token_id), logprob),
                [TokenLogprob(token_bytes(int(top_id)), float(top_logprob)) for top_id, top_logprob in top],
            )
            for token_id, logprob, top in zip(update.token_ids[:num_tokens], update.logprobs or [], tops)
        ]


def _worker_error(req: InflightRequest, update: TokenUpdate) -> ApiError:
    where = f"worker {update.worker_id}" if update.worker_id else "a worker"
    message = f"The request failed on {where}: {update.error or 'aborted'}"
    logger.error("%s (attempt %d): %s", req.req_id, req.attempt, message)
    return ApiError(502, message, type="server_error", code="worker_error")


class Generation:
    """The choices of one API request, from submission to the last delta."""

    def __init__(self, gw: Gateway, response_id: str, choices: list[PlannedChoice], arrived_at: float) -> None:
        self._gw = gw
        self.response_id = response_id
        self._arrived_at = arrived_at  # monotonic
        self._choices = {c.req.req_id: ChoiceState(c, gw.tokenizer) for c in choices}
        self._replies = choices[0].req.replies
        self._deadline = choices[0].req.deadline
        self._first_token_at: float | None = None
        self._is_abandoned = False
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._deadline_passed = False

    @property
    def choices(self) -> list[ChoiceState]:
        return list(self._choices.values())

    @property
    def usage(self) -> Usage:
        """Prompt and cached tokens count once per prompt (the first sample's), output tokens per choice."""
        firsts = [c for c in self._choices.values() if c.planned.sample_index == 0]
        return Usage(
            prompt_tokens=sum(len(c.req.prompt_token_ids) for c in firsts),
            completion_tokens=sum(c.num_tokens for c in self._choices.values()),
            cached_tokens=sum(c.num_cached_tokens for c in firsts),
        )

    async def __aenter__(self) -> Generation:
        try:
            await self._gw.dispatcher.submit([c.req for c in self._choices.values()])
        except asyncio.CancelledError:
            # the client left mid-submit, perhaps after the XADD reached Redis; no __aexit__ follows
            self.abandon("client_disconnected")
            raise
        self._gw.metrics.request_queue_time.observe(time.monotonic() - self._arrived_at)
        self._gw.metrics.prompt_tokens.inc(self.usage.prompt_tokens)
        loop = asyncio.get_running_loop()
        self._deadline_timer = loop.call_at(
            loop.time() + self._deadline - time.time(), self._replies.put_nowait, _DEADLINE_PASSED
        )
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        if exc_type is None or issubclass(exc_type, (asyncio.CancelledError, ConnectionError)):
            self.abandon("client_disconnected")  # a no-op when every choice finished
        else:
            self.abandon("failed")
        if not self._is_abandoned and all(c.is_finished for c in self._choices.values()):
            self._log_done()

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Deltas in arrival order until every choice finished; raises ApiError on timeout or a worker's failure."""
        async for batch in self.delta_batches():
            for delta in batch:
                yield delta

    async def delta_batches(self) -> AsyncIterator[list[ChoiceDelta]]:
        """`deltas`, each time as all that the updates arrived so far give: a stream writes them in
        one go, and a busy gateway, whose replies pile up between two turns of a request's task, pays
        one wake-up and one write for the pile instead of one per token."""
        phase_seconds = self._gw.metrics.phase_seconds
        while not self._is_abandoned and any(not c.is_finished for c in self._choices.values()):
            batch: list[ChoiceDelta] = []
            updates = await self._next_updates()
            started = time.perf_counter()
            for update in updates:
                choice = self._choices[update.req_id]
                if choice.is_finished:  # queued before a stop string ended it
                    continue
                self._observe(choice, update)
                try:
                    delta = choice.consume(update)
                except ApiError:
                    self.abandon("failed")
                    raise
                if choice.is_finished:
                    self._finish(choice)
                if delta is not None:
                    batch.append(delta)
            phase_seconds[DETOKENIZE] += time.perf_counter() - started
            if batch:
                yield batch

    def abandon(self, reason: str) -> None:
        """End the response early: cancel every unfinished choice on the workers (their later replies are dropped)."""
        unfinished = [c for c in self._choices.values() if not c.is_finished and not c.req.is_finished]
        if self._is_abandoned or not unfinished:
            return
        self._is_abandoned = True
        logger.info("%s: %s; cancelling %d request(s)", self.response_id, reason.replace("_", " "), len(unfinished))
        for choice in unfinished:
            self._cancel(choice.req, reason)

    async def _next_updates(self) -> list[TokenUpdate]:
        """Every update queued now, waiting (up to the deadline) only when there is none."""
        replies = self._replies
        while True:
            if replies.empty():
                if self._deadline_passed:
                    raise self._timed_out()
                pending = [await replies.get()]
            else:
                pending = []
            while not replies.empty():
                pending.append(replies.get_nowait())
            updates = [update for update in pending if update is not _DEADLINE_PASSED]
            self._deadline_passed |= len(updates) < len(pending)
            if updates:
                return updates

    def _timed_out(self) -> ApiError:
        self.abandon("deadline")
        timeout_s = self._gw.settings.request_timeout_s
        logger.warning("%s: no answer within %g s; cancelled", self.response_id, timeout_s)
        return ApiError(
            504, f"The request did not finish within {timeout_s:g} s (gateway.request_timeout_s).",
            type="server_error", code="timeout",
        )

    def _finish(self, choice: ChoiceState) -> None:
        if choice.stopped_early:
            self._cancel(choice.req, "stop_string")
        else:
            self._gw.dispatcher.release(choice.req)

    def _cancel(self, req: InflightRequest, reason: str) -> None:
        self._gw.dispatcher.release(req)  # now, so no late reply is routed while the cancel is on its way
        self._gw.metrics.cancelled(reason)
        self._gw.spawn(self._gw.dispatcher.cancel(req, reason.replace("_", " ")))

    def _observe(self, choice: ChoiceState, update: TokenUpdate) -> None:
        num_tokens = len(update.token_ids)
        if not num_tokens:
            return
        now = time.monotonic()
        metrics = self._gw.metrics
        metrics.generation_tokens.inc(num_tokens)
        metrics.tokens_from(update.worker_id or "unknown", num_tokens)
        if choice.last_token_at is None:  # the prefill worker's update: how much of the prompt it had cached
            metrics.prefilled_by(update.worker_id or "unknown", update.num_prompt_tokens, update.num_cached_tokens)
        if self._first_token_at is None:
            self._first_token_at = now
            metrics.time_to_first_token.observe(now - self._arrived_at)
        if choice.last_token_at is not None:
            gap = (now - choice.last_token_at) / num_tokens
            for _ in range(num_tokens):
                metrics.inter_token_latency.observe(gap)
        choice.last_token_at = now

    def _log_done(self) -> None:
        latency_s = time.monotonic() - self._arrived_at
        self._gw.metrics.e2e_request_latency.observe(latency_s)
        usage = self.usage
        reasons = sorted({str(c.finish_reason) for c in self._choices.values()})
        logger.info(
            "%s: %d choice(s), %d prompt tokens (%d cached), %d completion tokens, finish %s, %.2f s",
            self.response_id, len(self._choices), usage.prompt_tokens, usage.cached_tokens,
            usage.completion_tokens, "/".join(reasons), latency_s,
        )
