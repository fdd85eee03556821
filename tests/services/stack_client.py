"""Plays the gateway against real workers through `Bus` and protocol messages: puts
GenerateRequests on the requests stream, reads TokenBatches off its replies stream, sends
Cancels, and reads the workers' heartbeats."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from shared.model.loader import LoadedModel
from shared.model.runner import kv_block_bytes
from shared.protocol import Cancel, GenerateRequest, TokenBatch, TokenUpdate, WorkerStatus, encode
from shared.settings import EngineSettings, KVCacheSettings, ModelSettings, RedisSettings
from shared.streams import Bus

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
WAIT_S = 240.0  # bounds every wait so nothing hangs; generous because CI machines are shared


@dataclass(slots=True)
class Reply:
    """Everything the workers sent for one request, keyed by output position."""

    tokens: dict[int, int] = field(default_factory=dict)
    worker_ids: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    updates: list[TokenUpdate] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        assert sorted(self.tokens) == list(range(len(self.tokens))), f"gaps in {sorted(self.tokens)}"
        return [self.tokens[i] for i in range(len(self.tokens))]

    def add(self, update: TokenUpdate) -> None:
        self.updates.append(update)
        self.worker_ids.append(update.worker_id)
        for i, token_id in enumerate(update.token_ids):
            assert self.tokens.setdefault(update.index + i, token_id) == token_id, "a re-sent position changed"
        if update.finish_reason is not None:
            self.finish_reason, self.error = update.finish_reason, update.error


class FakeGateway:
    def __init__(self, namespace: str, gateway_id: str = "gw-test") -> None:
        self.bus = Bus(RedisSettings(url=REDIS_URL, namespace=namespace))
        self.keys = self.bus.keys
        self.gateway_id = gateway_id
        self.replies: dict[str, Reply] = {}
        self._last_id = b"0"

    async def close(self) -> None:
        await self.bus.close()

    async def submit(self, req_id: str, prompt: list[int], params: SamplingParams, **fields: Any) -> GenerateRequest:
        msg = GenerateRequest(
            req_id=req_id, gateway_id=self.gateway_id, prompt_token_ids=prompt, params=params.to_dict(),
            seed=fields.pop("seed", 1234), **fields,
        )
        self.replies[req_id] = Reply()
        await self.bus.send(self.keys.requests, msg)
        return msg

    async def submit_many(self, prompts: dict[str, list[int]], params: SamplingParams) -> None:
        """All in one round trip, as a busy gateway's burst arrives."""
        pipe = self.bus.redis.pipeline(transaction=False)
        for req_id, prompt in prompts.items():
            msg = GenerateRequest(req_id, self.gateway_id, prompt, params.to_dict(), seed=1234)
            self.replies[req_id] = Reply()
            pipe.xadd(self.keys.requests, {"m": encode(msg)})
        await pipe.execute()

    async def cancel(self, worker_id: str, req_id: str) -> None:
        await self.bus.send(self.keys.inbox(worker_id), Cancel(req_id))

    async def poll(self) -> None:
        for entry_id, msg in await self.bus.read(self.keys.replies(self.gateway_id), self._last_id, 1000, 200):
            self._last_id = entry_id
            assert isinstance(msg, TokenBatch)
            for update in msg.updates:
                self.replies.setdefault(update.req_id, Reply()).add(update)

    async def until(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not condition():
            assert time.monotonic() < deadline, f"gave up waiting for {what}"
            await self.poll()

    async def finish(self, *req_ids: str) -> dict[str, Reply]:
        await self.until(lambda: all(r in self.replies and self.replies[r].finish_reason for r in req_ids),
                         f"{req_ids} to finish")
        return {r: self.replies[r] for r in req_ids}

    async def workers(self, role: str) -> list[WorkerStatus]:
        return sorted(await self.bus.live_workers(role), key=lambda s: s.worker_id)

    async def until_status(self, predicate: Callable[[list[WorkerStatus]], bool], role: str, what: str) -> list[WorkerStatus]:
        deadline = time.monotonic() + WAIT_S
        while not predicate(statuses := await self.workers(role)):
            assert time.monotonic() < deadline, f"gave up waiting for {what}; last heartbeats {statuses}"
            await asyncio.sleep(0.1)
        return statuses

    async def until_all_blocks_free(self) -> None:
        """Every worker's heartbeat shows an empty engine and no block in use."""
        for role in ("prefill", "decode"):
            await self.until_status(
                lambda ss: bool(ss) and all(_is_empty(s) for s in ss), role, f"every {role} worker to free its blocks"
            )


def _is_empty(s: WorkerStatus) -> bool:
    return s.free_blocks == s.total_blocks and s.num_running == 0 and s.num_waiting == 0


async def eventually(check: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not await check():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        await asyncio.sleep(0.1)


def as_async(check: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    """A plain check in the form `eventually` awaits."""

    async def run() -> bool:
        return check()

    return run


def prompt(n: int, offset: int = 0) -> list[int]:
    """n token ids spread over the vocabulary; another offset gives a prompt that shares no prefix."""
    return [(offset * 7919 + i * 104729) % 49000 + 50 for i in range(n)]


def block_bytes(loaded: LoadedModel, block_size: int = 16) -> int:
    return kv_block_bytes(loaded.config, block_size, torch.float32)


def offline_greedy(loaded: LoadedModel, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """The offline engine's tokens for the same prompts, all in one batch, on the device the
    workers pick (their dtype is pinned to float32 too)."""
    engine = Engine(EngineSettings(
        model=ModelSettings(dtype="float32", device="auto"),
        kv_cache=KVCacheSettings(memory_bytes=512 * block_bytes(loaded)),
    ), loaded)
    outputs: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
        outputs[str(i)] = []
    while engine.has_unfinished:
        for out in engine.step():
            outputs[out.req_id].extend(out.new_token_ids)
    return [outputs[str(i)] for i in range(len(prompts))]
