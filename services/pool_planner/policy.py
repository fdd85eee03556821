"""When a pool gets a worker and when it gives one back.

A pool's load is the share of its latency targets it uses now (signals.py): 1.0 means its
requests just meet them. A pool above `target_load` for `scale_up_after_s` gets one more
worker; a pool that would stay below `low_load` without one of its workers, for
`scale_down_after_s`, drains one. One worker at a time, and never a second change of a pool
within `hold_s` of its last: a new worker needs a few heartbeats before its load counts, and a
drained one needs time to finish what it holds. Until a change shows in the heartbeats (or the
hold time passes), the pool counts as changed against `max_workers`. The gap between the two
thresholds keeps a pool that sits near its target from flapping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shared.settings import PlannerSettings


@dataclass(slots=True, frozen=True)
class PoolLoad:
    """One pool as measured now. `load` is None until a window of heartbeats has been seen."""

    role: str
    num_workers: int  # live and not draining
    load: float | None
    detail: str = ""  # the measurements behind `load`, for the log

    def recommended(self, target_load: float) -> int:
        """Workers that would bring the load to `target_load` (at least one)."""
        if self.load is None:
            return max(1, self.num_workers)
        return max(1, math.ceil(self.num_workers * self.load / target_load - 1e-9))


@dataclass(slots=True, frozen=True)
class Decision:
    role: str
    delta: int  # +1: start a worker; -1: drain one
    pool: PoolLoad
    held_s: float  # how long the load stayed past the threshold

    @property
    def command(self) -> str:
        """The launcher's scaling command for it ('+prefill', '-decode')."""
        return f"{'+' if self.delta > 0 else '-'}{self.role}"

    def line(self, settings: PlannerSettings) -> str:
        n = self.pool.num_workers
        if self.delta > 0:
            why = f"load {self.pool.load:.2f} above {settings.target_load:.2f} for {self.held_s:.0f} s"
            what = "adding a"
        else:
            assert self.pool.load is not None
            without = self.pool.load * n / (n - 1)
            why = f"load {self.pool.load:.2f}, {without:.2f} without one worker, below {settings.low_load:.2f} " \
                  f"for {self.held_s:.0f} s"
            what = "draining a"
        return f"{what} {self.role} worker ({n} -> {n + self.delta}): {why}; {self.pool.detail}"


@dataclass(slots=True)
class _PoolState:
    above_since: float | None = None
    below_since: float | None = None
    changed_at: float = -math.inf
    expected: int | None = None  # workers the last change aims at, until the heartbeats show it


@dataclass(slots=True)
class PoolPlanner:
    settings: PlannerSettings
    max_workers: int  # prefill and decode together
    _pools: dict[str, _PoolState] = field(default_factory=dict)

    def decide(self, now: float, pools: list[PoolLoad]) -> list[Decision]:
        """At most one change per pool; `now` is a monotonic clock in seconds."""
        total = sum(self._counted(now, p) for p in pools)
        decisions = []
        for pool in pools:
            decision = self._decide_pool(now, pool, total)
            if decision is not None:
                total += decision.delta
                decisions.append(decision)
        return decisions

    def _counted(self, now: float, pool: PoolLoad) -> int:
        """The pool's workers, with a change not yet seen in the heartbeats counted as done."""
        state = self._pools.setdefault(pool.role, _PoolState())
        if state.expected is not None and (pool.num_workers == state.expected or not self._within_hold(state, now)):
            state.expected = None
        return pool.num_workers if state.expected is None else state.expected

    def _decide_pool(self, now: float, pool: PoolLoad, total: int) -> Decision | None:
        cfg = self.settings
        state = self._pools.setdefault(pool.role, _PoolState())
        if pool.load is None or pool.num_workers < 1:
            state.above_since = state.below_since = None
            return None
        n, load = pool.num_workers, pool.load
        if load > cfg.target_load:
            state.below_since = None
            state.above_since = _since(state.above_since, now)
            held_s = now - state.above_since
            if held_s >= cfg.scale_up_after_s and total < self.max_workers and self._may_change(state, now):
                return self._changed(state, now, Decision(pool.role, +1, pool, held_s))
        elif n > 1 and load * n / (n - 1) < cfg.low_load:
            state.above_since = None
            state.below_since = _since(state.below_since, now)
            held_s = now - state.below_since
            if held_s >= cfg.scale_down_after_s and self._may_change(state, now):
                return self._changed(state, now, Decision(pool.role, -1, pool, held_s))
        else:
            state.above_since = state.below_since = None
        return None

    def _may_change(self, state: _PoolState, now: float) -> bool:
        return not self._within_hold(state, now) and state.expected is None

    def _within_hold(self, state: _PoolState, now: float) -> bool:
        return now - state.changed_at < self.settings.hold_s

    @staticmethod
    def _changed(state: _PoolState, now: float, decision: Decision) -> Decision:
        state.changed_at = now
        state.expected = decision.pool.num_workers + decision.delta
        state.above_since = state.below_since = None
        return decision


def _since(since: float | None, now: float) -> float:
    return now if since is None else since
