"""Each pool's load, from the workers' heartbeats and the requests stream.

    prefill   max(busy share, estimated queue wait / TTFT target)
                busy share: the pool's mean share of the window spent in engine steps
                queue wait: (requests not yet read + waiting in the engines) x seconds of prefill
                            per request over the window / workers
    decode    max(mean step time / inter-token target, KV usage / KV_HIGH)

A worker's counters (WorkerStatus.busy_s, num_steps, num_prefilled) count up from its start, so
load is their change over the last `window_s` of heartbeats; a worker seen for less than half a
window does not count yet, and a pool none of whose workers does has no load (None).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from redis.exceptions import ResponseError

from services.pool_planner.policy import PoolLoad
from shared.protocol import WorkerStatus
from shared.settings import LatencyTargetSettings, PlannerSettings
from shared.streams import PREFILL_GROUP, Bus

KV_HIGH = 0.9  # KV usage at which a decode pool counts as full: past it, requests wait or get preempted
ROLES = ("prefill", "decode")


@dataclass(slots=True, frozen=True)
class _Sample:
    at: float  # the heartbeat's unix time
    busy_s: float
    num_steps: int
    num_prefilled: int

    @classmethod
    def of(cls, status: WorkerStatus) -> _Sample:
        return cls(status.timestamp, status.busy_s, status.num_steps, status.num_prefilled)


@dataclass(slots=True, frozen=True)
class _Window:
    """What one worker did between the oldest and the newest sample of the window."""

    seconds: float
    busy_s: float
    num_steps: int
    num_prefilled: int


class LoadSignals:
    def __init__(self, bus: Bus, settings: PlannerSettings, targets: LatencyTargetSettings) -> None:
        self.bus = bus
        self.settings = settings
        self.targets = targets
        self._history: dict[str, deque[_Sample]] = {}

    async def observe(self) -> list[PoolLoad]:
        statuses = {role: await self.bus.live_workers(role) for role in ROLES}
        self._record([s for ss in statuses.values() for s in ss])
        queued = await self._unread_requests()
        return [self.prefill_load(statuses["prefill"], queued), self.decode_load(statuses["decode"])]

    def _record(self, statuses: list[WorkerStatus]) -> None:
        for gone in self._history.keys() - {s.worker_id for s in statuses}:
            del self._history[gone]
        for status in statuses:
            samples = self._history.setdefault(status.worker_id, deque())
            if not samples or samples[-1].at < status.timestamp:
                samples.append(_Sample.of(status))
            while len(samples) > 2 and samples[-1].at - samples[1].at >= self.settings.window_s:
                samples.popleft()

    def _window(self, worker_id: str) -> _Window | None:
        samples = self._history.get(worker_id)
        if not samples or samples[-1].at - samples[0].at < self.settings.window_s / 2:
            return None
        first, last = samples[0], samples[-1]
        return _Window(last.at - first.at, last.busy_s - first.busy_s, last.num_steps - first.num_steps,
                       last.num_prefilled - first.num_prefilled)

    async def _unread_requests(self) -> int:
        """Entries of the requests stream no prefill worker has read yet (the group's lag)."""
        try:
            groups = await self.bus.redis.xinfo_groups(self.bus.keys.requests)
        except ResponseError:  # no stream yet: no prefill worker has started
            return 0
        group = next((g for g in groups if _text(g["name"]) == PREFILL_GROUP), None)
        return int(group.get("lag") or 0) if group is not None else 0

    def prefill_load(self, statuses: list[WorkerStatus], num_unread: int) -> PoolLoad:
        serving = [s for s in statuses if not s.draining]
        windows = [w for s in serving if (w := self._window(s.worker_id)) is not None]
        if not windows:
            return PoolLoad("prefill", len(serving), None, "not measured yet")
        busy = sum(w.busy_s / w.seconds for w in windows) / len(windows)
        num_prefilled = sum(w.num_prefilled for w in windows)
        queued = num_unread + sum(s.num_waiting for s in serving)
        per_request_s = sum(w.busy_s for w in windows) / num_prefilled if num_prefilled else 0.0
        wait_s = queued * per_request_s / len(serving)
        target_s = self.targets.ttft_ms / 1000
        load = max(busy, wait_s / target_s)
        detail = (f"prefill busy {busy:.0%}, {queued} requests queued x {per_request_s:.2f} s each = "
                  f"{wait_s:.1f} s of waiting for a TTFT target of {target_s:g} s")
        return PoolLoad("prefill", len(serving), load, detail)

    def decode_load(self, statuses: list[WorkerStatus]) -> PoolLoad:
        serving = [s for s in statuses if not s.draining]
        windows = [w for s in serving if (w := self._window(s.worker_id)) is not None]
        if not windows:
            return PoolLoad("decode", len(serving), None, "not measured yet")
        num_steps = sum(w.num_steps for w in windows)
        step_s = sum(w.busy_s for w in windows) / num_steps if num_steps else 0.0
        kv_usage = sum(1 - s.free_blocks / s.total_blocks for s in serving if s.total_blocks) / len(serving)
        target_s = self.targets.itl_ms / 1000
        load = max(step_s / target_s, kv_usage / KV_HIGH)
        detail = (f"decode step {1000 * step_s:.0f} ms for an inter-token target of {1000 * target_s:.0f} ms, "
                  f"KV {kv_usage:.0%} used")
        return PoolLoad("decode", len(serving), load, detail)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
