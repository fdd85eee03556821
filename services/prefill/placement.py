"""Where a prefilled request goes: decode workers ordered by load, and the offer/accept rendezvous."""

from __future__ import annotations

import asyncio
import time

from shared.protocol import HandoffAccept, WorkerStatus
from shared.streams import Bus

RECENT_PLACEMENTS_S = 30.0


class DecodePicker:
    """Orders live decode workers by load: most free KV blocks, then fewest running requests.

    Heartbeats are up to one interval old, so the blocks this worker placed on a decode worker
    since its last heartbeat count against it; without that every handoff of an interval would
    land on the same worker.
    """

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._placed: dict[str, list[tuple[float, int]]] = {}

    async def candidates(self, num_blocks: int, hint: str | None = None) -> list[WorkerStatus]:
        """Decode workers that could ever hold `num_blocks` blocks, least loaded first; skips draining
        ones. The gateway's `hint` (a worker that caches most of the prompt) goes first where usable."""
        statuses = await self.bus.live_workers("decode")
        usable = sorted((s for s in statuses if not s.draining and s.total_blocks >= num_blocks), key=self._load)
        return sorted(usable, key=lambda s: s.worker_id != hint)  # stable: the rest stay in load order

    def record(self, decode_id: str, num_blocks: int) -> None:
        now = time.time()
        recent = [p for p in self._placed.get(decode_id, []) if now - p[0] < RECENT_PLACEMENTS_S]
        self._placed[decode_id] = [*recent, (now, num_blocks)]

    def _load(self, status: WorkerStatus) -> tuple[int, int, str]:
        unseen = [n for at, n in self._placed.get(status.worker_id, []) if at >= status.timestamp]
        return -(status.free_blocks - sum(unseen)), status.num_running + len(unseen), status.worker_id


class AcceptBoard:
    """Routes each HandoffAccept read from the inbox to the handoff waiting for it."""

    def __init__(self) -> None:
        self._waiting: dict[tuple[str, int], tuple[str, asyncio.Future[HandoffAccept]]] = {}

    def expect(self, req_id: str, attempt: int, decode_id: str) -> asyncio.Future[HandoffAccept]:
        future: asyncio.Future[HandoffAccept] = asyncio.get_running_loop().create_future()
        self._waiting[(req_id, attempt)] = (decode_id, future)
        return future

    def forget(self, req_id: str, attempt: int) -> None:
        self._waiting.pop((req_id, attempt), None)

    def resolve(self, accept: HandoffAccept) -> bool:
        """False when nobody waits for this answer (it came late, or from a worker no longer asked)."""
        waiting = self._waiting.get((accept.req_id, accept.attempt))
        if waiting is None or waiting[0] != accept.decode_id or waiting[1].done():
            return False
        waiting[1].set_result(accept)
        return True
