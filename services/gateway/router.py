"""Where a request goes: the prefill and decode workers that already cache most of its prompt,
weighed against their load.

For each stage, over the live workers that are not draining:

        prefill: score(w) = matched_tokens(w) - load_weight * queued_tokens(w)
    decode:  the most matched blocks, among workers with room for the rest of the prompt
    local:   that decode worker prefills the request itself when at most local_prefill_max_tokens
             of the prompt are not cached there (no prefill worker, no KV handoff)

`matched` is the longest prefix of the prompt the worker caches (the KV index, fed by the
workers' events): a prefill worker skips computing it, a decode worker need not receive it.
`queued_tokens` is the prompt tokens waiting on a prefill worker (its heartbeat, plus what this
gateway routed to it since), which its prefill computes before this one. A worker loaded beyond
the least loaded one by more than max_imbalance_tokens (prefill) or max_decode_imbalance_requests
running requests (decode) is no candidate: one hot worker must not get everything. The best
candidate is chosen only when it caches at least min_advantage_blocks more than the worst one;
otherwise caching does not tell them apart and load alone decides, as without routing: the
shared requests stream, whose first free reader takes the request, and no decode hint.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.gateway.kv_index import KVIndex
from shared.engine.block_pool import extend_block_hashes
from shared.protocol import WorkerStatus
from shared.settings import RoutingSettings
from shared.streams import Bus

logger = logging.getLogger(__name__)

STATUS_MAX_AGE_S = 0.25  # heartbeats come every 0.5 s by default: fresher reads buy nothing
RECENT_ROUTES_S = 30.0


@dataclass(slots=True, frozen=True)
class Choice:
    """One stage's pick: `worker_id` None means by load (the shared stream, or no decode hint)."""

    stage: str  # "prefill" | "decode"
    worker_id: str | None
    num_matched_blocks: int
    local: bool = False  # prefill only: `worker_id` is the decode worker, which prefills it itself

    @property
    def by(self) -> str:
        return "local" if self.local else "load" if self.worker_id is None else "overlap"


@dataclass(slots=True, frozen=True)
class Route:
    prefill: Choice
    decode: Choice


class Router:
    def __init__(self, bus: Bus, index: KVIndex, settings: RoutingSettings,
                 on_route: Callable[[Route], None] = lambda route: None) -> None:
        self.bus, self.index, self.settings = bus, index, settings
        self._on_route = on_route
        self._statuses: dict[str, list[WorkerStatus]] = {}
        self._read_at = -STATUS_MAX_AGE_S  # monotonic
        self._refreshing = asyncio.Lock()
        self._routed: dict[str, list[tuple[float, int]]] = {}  # worker -> (unix time, prompt tokens) sent to it

    async def route(self, token_ids: Sequence[int]) -> Route:
        """Where to send a request whose prompt (plus any tokens already generated) is `token_ids`."""
        if self.settings.enabled and self.index.workers:
            await self._refresh()
        # read after the refresh, whose wait may have seen the index forget every worker that went away
        indexed = list(self.index.workers.values())
        if not self.settings.enabled or not indexed:
            route = Route(Choice("prefill", None, 0), Choice("decode", None, 0))
        else:
            block_size = indexed[0].block_size  # one model: one block size
            hashes = extend_block_hashes([], token_ids, block_size)
            decode, best_decode = self._choose_decode(hashes)
            local = self._local_route(best_decode, len(token_ids), block_size)
            route = local or Route(self._choose_prefill(hashes, block_size), decode)
            if route.prefill.worker_id is not None and not route.prefill.local:
                self._routed.setdefault(route.prefill.worker_id, []).append((time.time(), len(token_ids)))
        logger.debug("route of %d tokens: prefill %s by %s (%d blocks matched), decode %s (%d blocks matched)",
                     len(token_ids), route.prefill.worker_id or "any", route.prefill.by, route.prefill.num_matched_blocks,
                     route.decode.worker_id or "by load", route.decode.num_matched_blocks)
        self._on_route(route)
        return route

    def _choose_prefill(self, hashes: list[bytes], block_size: int) -> Choice:
        cfg = self.settings
        statuses = self._usable("prefill")
        loads = {s.worker_id: s.num_queued_tokens + self._routed_since(s) for s in statuses}
        if not loads:
            return Choice("prefill", None, 0)
        least = min(loads.values())
        candidates = [s.worker_id for s in statuses if loads[s.worker_id] - least <= cfg.max_imbalance_tokens]
        matched = {w: self.index.num_matched_blocks(w, hashes) for w in candidates}
        best = max(candidates, key=lambda w: (matched[w] * block_size - cfg.load_weight * loads[w], -loads[w], w))
        return self._pick("prefill", best, matched)

    def _choose_decode(self, hashes: list[bytes]) -> tuple[Choice, Choice | None]:
        """The decode choice, and the candidate caching the most even where that does not set it apart."""
        cfg = self.settings
        statuses = self._usable("decode")
        if not statuses:
            return Choice("decode", None, 0), None
        least = min(s.num_running for s in statuses)
        matched = {s.worker_id: self.index.num_matched_blocks(s.worker_id, hashes) for s in statuses}
        candidates = [
            s for s in statuses
            if s.num_running - least <= cfg.max_decode_imbalance_requests
            and s.free_blocks >= len(hashes) - matched[s.worker_id]  # room for the blocks it would receive
        ]
        if not candidates:
            return Choice("decode", None, max(matched.values())), None
        best = max(candidates, key=lambda s: (matched[s.worker_id], s.free_blocks, -s.num_running, s.worker_id))
        choice = self._pick("decode", best.worker_id, {s.worker_id: matched[s.worker_id] for s in candidates})
        return choice, Choice("decode", best.worker_id, matched[best.worker_id])

    def _local_route(self, best_decode: Choice | None, num_tokens: int, block_size: int) -> Route | None:
        """Prefill and decode on the decode worker that caches all but a few tokens of the prompt, or None."""
        limit = self.settings.local_prefill_max_tokens
        if best_decode is None or not best_decode.num_matched_blocks or limit <= 0:
            return None
        if num_tokens - best_decode.num_matched_blocks * block_size > limit:
            return None
        return Route(Choice("prefill", best_decode.worker_id, best_decode.num_matched_blocks, local=True), best_decode)

    def _pick(self, stage: str, best: str, matched: dict[str, int]) -> Choice:
        if matched[best] - min(matched.values()) < self.settings.min_advantage_blocks:
            return Choice(stage, None, max(matched.values()))
        return Choice(stage, best, matched[best])

    def _usable(self, stage: str) -> list[WorkerStatus]:
        return [s for s in self._statuses.get(stage, []) if not s.draining]

    def _routed_since(self, status: WorkerStatus) -> int:
        """Prompt tokens this gateway routed to the worker after its last heartbeat (which misses them)."""
        return sum(n for at, n in self._routed.get(status.worker_id, []) if at >= status.timestamp)

    async def _refresh(self) -> None:
        if time.monotonic() - self._read_at < STATUS_MAX_AGE_S:
            return
        # one read for the routes that find the statuses old while it is on its way: a burst of
        # requests would otherwise each read every worker's status (a sixth of the gateway's time)
        async with self._refreshing:
            if time.monotonic() - self._read_at >= STATUS_MAX_AGE_S:
                await self._read_statuses()

    async def _read_statuses(self) -> None:
        self._statuses = {stage: await self.bus.live_workers(stage) for stage in ("prefill", "decode")}
        self._read_at = time.monotonic()
        now = time.time()
        live = {s.worker_id for statuses in self._statuses.values() for s in statuses}
        self._routed = {w: [r for r in recent if now - r[0] < RECENT_ROUTES_S]
                        for w, recent in self._routed.items() if w in live}
