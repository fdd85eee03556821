"""Continuous batching: which requests compute how many tokens this step.

Each step has a token budget and a cap on running requests. Running requests go first (a
decode needs one token, an unfinished chunked prefill the next chunk), then waiting requests
fill what is left, long prompts in chunks. A step may also be given a cap on its prompt tokens
(the step policy, shared/engine/policy, keeps a step beside decodes within the inter-token target);
the decodes are not counted in it, so a chunk ahead of them in the running list never crowds them
out of the step. Prompts go the fewest tokens left first (`ShortestFirst`). When blocks run out, the most recently started
request is preempted: its blocks are freed and it is recomputed later, reusing whatever of
its prefix is still cached. Under the max_length reservation policy (kept to measure what
paging buys) a request is admitted only with blocks for its whole length, so it never grows.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import get_args

from shared.engine.kv_cache_manager import KVCacheManager
from shared.engine.policy.prompt_order import ShortestFirst
from shared.engine.request import ReqId, Request, RequestStatus
from shared.settings import KVReservation


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True
    kv_reservation: KVReservation = "paged"
    # with chunked prefill, the most prompt tokens one request takes in a step; 0: no cap
    long_prefill_token_threshold: int = 0
    # which prompt first, and how many share a step (by default: as many as the budget holds)
    prompt_order: ShortestFirst | None = None

    @property
    def order(self) -> ShortestFirst:
        return self.prompt_order or ShortestFirst(self.max_num_batched_tokens)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be 0 (off) or more, got {self.long_prefill_token_threshold}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.kv_reservation not in get_args(KVReservation):
            raise ValueError(f"kv_reservation must be one of {get_args(KVReservation)}, got {self.kv_reservation!r}")


@dataclass(slots=True)
class ScheduledBatch:
    """One step's plan: `num_new_tokens[i]` tokens of `reqs[i]`, read through `block_tables[i]`."""

    reqs: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.reqs

    def samples(self, i: int) -> bool:
        """Whether reqs[i] reaches its last token this step, so a new token is sampled for it."""
        req = self.reqs[i]
        return req.num_computed_tokens + self.num_new_tokens[i] == req.num_tokens


@dataclass(slots=True)
class StepResult:
    """What the runner produced for the requests of a batch that sample (aligned with them)."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass(slots=True)
class Budget:
    """What is left of one step's tokens, and of its prompt tokens where they are capped."""

    tokens: int
    prompt_tokens: int | None = None
    per_prompt: int | None = None  # the most one prompt takes

    def grant(self, wanted: int) -> int:
        """How many of the `wanted` tokens a request gets; wanting more than one, it is a prompt."""
        granted = min(wanted, self.tokens)
        if wanted == 1:
            return granted
        if self.per_prompt is not None:
            granted = min(granted, self.per_prompt)
        return granted if self.prompt_tokens is None else min(granted, self.prompt_tokens)

    def limit_prompts(self, most: int) -> None:
        """Let the rest of the step take at most `most` more prompt tokens."""
        self.prompt_tokens = most if self.prompt_tokens is None else min(self.prompt_tokens, most)

    def spend(self, wanted: int, granted: int) -> None:
        self.tokens -= granted
        if wanted > 1 and self.prompt_tokens is not None:
            self.prompt_tokens -= granted


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.order = config.order
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def num_decoding(self) -> int:
        """Running requests whose next step computes one token: the streams a long step stalls."""
        return sum(1 for req in self.running if req.num_tokens - req.num_computed_tokens == 1)

    def next_prompt(self) -> Request | None:
        """The prompt the next step serves first."""
        return next(iter(self._prompts_in_order(self.order)), None)

    def schedule(self, max_prompt_tokens: int | None = None) -> ScheduledBatch:
        """This step's plan; with `max_prompt_tokens`, prompts (chunks of more than one token) take at
        most that many of its tokens in all."""
        batch = ScheduledBatch()
        cap = self.config.long_prefill_token_threshold
        # a long prompt taking part of each step, not all of it, lets a short one that came after it
        # finish in the next step instead of after the long one's last
        per_prompt = cap if cap and self.config.enable_chunked_prefill else None
        budget = Budget(self.config.max_num_batched_tokens, max_prompt_tokens, per_prompt)
        self._schedule_running(batch, budget)
        if not batch.preempted:
            self._schedule_prompts_in_order(batch, budget, self.order)
        batch.block_tables = [self.kv_cache.block_ids(req.req_id) for req in batch.reqs]
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: Budget) -> None:
        """The decodes, each one token; running prompts' chunks go in the prompts' order."""
        i = 0
        while i < len(self.running) and budget.tokens > 0:
            req = self.running[i]
            wanted = req.num_tokens - req.num_computed_tokens
            if wanted > 1:
                i += 1
                continue
            num_new = budget.grant(wanted)
            if num_new == 0:  # a chunk, with no prompt tokens left this step
                i += 1
                continue
            while not self.kv_cache.allocate_slots(req, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    break
            else:
                batch.reqs.append(req)
                batch.num_new_tokens.append(num_new)
                budget.spend(wanted, num_new)
                i += 1

    def _admit(self, batch: ScheduledBatch, budget: Budget, req: Request) -> int | None:
        """Start a waiting request with the tokens the step grants it (returned); None where the step
        cannot take it: no tokens left, a whole prompt that does not fit unchunked, or no blocks."""
        holds_blocks = bool(self.kv_cache.blocks(req.req_id))
        cached = [] if holds_blocks else self.kv_cache.find_cached_prefix(req)
        num_computed = req.num_computed_tokens if holds_blocks else len(cached) * self.kv_cache.block_size
        wanted = req.num_tokens - num_computed
        num_new = budget.grant(wanted)
        if num_new < wanted and (num_new == 0 or not self.config.enable_chunked_prefill):
            return None
        if not self.kv_cache.allocate_slots(req, num_new, cached, self._tokens_to_reserve(req)):
            return None
        self.waiting.remove(req)
        if not holds_blocks:
            req.num_computed_tokens = num_computed
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_computed
                self.kv_cache.record_prefix_lookup(req.num_prompt_tokens, num_computed)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        batch.reqs.append(req)
        batch.num_new_tokens.append(num_new)
        budget.spend(wanted, num_new)
        return num_new

    def _prompts_in_order(self, order: ShortestFirst) -> list[Request]:
        """Running chunked prompts and waiting requests, in the order `order` serves them."""
        chunked = [req for req in self.running if req.num_tokens - req.num_computed_tokens > 1]
        return order.order([*chunked, *self.waiting], self._tokens_left, time.monotonic())

    def _tokens_left(self, req: Request) -> int:
        """Tokens a prompt has still to compute: a new one's cached prefix is not among them."""
        if self.kv_cache.blocks(req.req_id):
            return req.num_tokens - req.num_computed_tokens
        return req.num_tokens - len(self.kv_cache.find_cached_prefix(req)) * self.kv_cache.block_size

    def _schedule_prompts_in_order(self, batch: ScheduledBatch, budget: Budget, order: ShortestFirst) -> None:
        """Prompts after the decodes, running chunks and waiting ones alike in `order`; the first one's
        share sets how many more prompt tokens the step takes. A preemption ends the step's prompts,
        so the request preempted is not started again in the same step."""
        first_share: int | None = None
        for req in self._prompts_in_order(order):
            if budget.tokens <= 0 or batch.preempted:
                break
            if req.status is RequestStatus.RUNNING:
                wanted = req.num_tokens - req.num_computed_tokens
                num_new = budget.grant(wanted)
                if num_new == 0 or not self._allocate_chunk(batch, req, num_new):
                    break
                batch.reqs.append(req)
                batch.num_new_tokens.append(num_new)
                budget.spend(wanted, num_new)
            elif len(self.running) >= self.config.max_num_seqs:
                break
            else:
                admitted = self._admit(batch, budget, req)
                if admitted is None:
                    break
                num_new = admitted
            if first_share is None:
                first_share = num_new
                budget.limit_prompts(order.step_prompt_tokens(num_new) - num_new)

    def _allocate_chunk(self, batch: ScheduledBatch, req: Request, num_new: int) -> bool:
        """Blocks for a running prompt's next chunk, preempting the running prompt with the most tokens
        left that this step does not include, which may be `req` itself (then False)."""
        while not self.kv_cache.allocate_slots(req, num_new):
            scheduled = {id(r) for r in batch.reqs}
            others = [r for r in self.running if id(r) not in scheduled and r.num_tokens - r.num_computed_tokens > 1]
            victim = max(others, key=lambda r: r.num_tokens - r.num_computed_tokens)
            self.running.remove(victim)
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _tokens_to_reserve(self, req: Request) -> int:
        """Tokens whose blocks a request takes at admission: none ahead of need when paged; under
        max_length its prompt + max_tokens (a prefill-only request ends after its prompt)."""
        if self.config.kv_reservation == "paged":
            return 0
        if req.stop_after_prefill:
            most = req.num_tokens
        else:
            most = min(req.num_prompt_tokens + req.params.max_tokens, req.max_model_len)
        # a reservation beyond the whole pool could never be met and would block the queue for
        # good; such a request grows (and is preempted) as under paging instead
        return min(most, self.kv_cache.pool.num_blocks * self.kv_cache.block_size)

    def _preempt(self, req: Request) -> None:
        self.kv_cache.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, batch: ScheduledBatch, result: StepResult) -> list[Request]:
        """Advance progress counters, append sampled tokens, retire what finished; returns the sampling requests."""
        sampled: list[Request] = []
        for i, (req, num_new) in enumerate(zip(batch.reqs, batch.num_new_tokens)):
            samples = batch.samples(i)
            req.num_computed_tokens += num_new
            self.kv_cache.cache_full_blocks(req)
            if not samples:
                continue
            row = len(sampled)
            sampled.append(req)
            wants_logprobs = req.params.logprobs is not None and result.logprobs is not None
            req.append_output(
                result.token_ids[row],
                result.logprobs[row] if wants_logprobs else None,
                result.top_logprobs[row] if wants_logprobs and result.top_logprobs is not None else None,
            )
            stop = req.stop_status()
            if stop is not None:
                self._retire(req, stop)
            elif req.stop_after_prefill:
                self._retire(req, RequestStatus.PREFILLED)
        return sampled

    def _retire(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.running.remove(req)
        if status is not RequestStatus.PREFILLED:
            self.kv_cache.free(req)

    def abort(self, req_id: ReqId) -> Request | None:
        """Drop a request wherever it is and free its blocks at once."""
        for queue in (self.running, self.waiting):
            for req in queue:
                if req.req_id == req_id:
                    queue.remove(req)
                    self.kv_cache.free(req)
                    req.status = RequestStatus.FINISHED_ABORTED
                    return req
        return None
