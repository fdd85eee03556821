"""The planner's loop: observe the pools every `interval_s` and hand what it sees on. The
launcher (`--planner`) turns that into decisions, each logged with the numbers behind it and
carried out as a scaling command; the gateway exports it as metrics for an autoscaler."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from services.pool_planner.policy import PoolLoad, PoolPlanner
from services.pool_planner.signals import LoadSignals
from shared.settings import LatencyTargetSettings, PlannerSettings, RedisSettings
from shared.streams import Bus

logger = logging.getLogger(__name__)

PoolsHandler = Callable[[list[PoolLoad]], None]


async def watch_pools(bus: Bus, settings: PlannerSettings, targets: LatencyTargetSettings, stop: asyncio.Event,
                      on_pools: PoolsHandler) -> None:
    """Until `stop` is set; rides out Redis outages (nothing is handed on while the pools cannot be seen)."""
    signals = LoadSignals(bus, settings, targets)
    while not stop.is_set():
        try:
            pools = await signals.observe()
        except (RedisError, OSError) as e:
            logger.warning("planner: cannot read the pools' load (%s)", e)
        else:
            on_pools(pools)
        try:
            async with asyncio.timeout(settings.interval_s):
                await stop.wait()
        except TimeoutError:
            pass


def planning(settings: PlannerSettings, max_workers: int, on_command: Callable[[str], None]) -> PoolsHandler:
    """What the launcher does with each observation: decide, log why, and issue the command."""
    planner = PoolPlanner(settings, max_workers)

    def on_pools(pools: list[PoolLoad]) -> None:
        for decision in planner.decide(time.monotonic(), pools):
            logger.info("planner: %s", decision.line(settings))
            on_command(decision.command)

    return on_pools


class PlannerThread:
    """`watch_pools` with `planning` on a thread of its own, for the launcher: decisions become
    scaling commands ('+decode'), which `on_command` queues for the thread that owns the workers."""

    def __init__(self, redis_url: str, namespace: str, settings: PlannerSettings, targets: LatencyTargetSettings,
                 max_workers: int, on_command: Callable[[str], None]) -> None:
        self._redis = RedisSettings(url=redis_url, namespace=namespace)
        self._settings = settings
        self._targets = targets
        self._on_pools = planning(settings, max_workers, on_command)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="planner", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        cfg = self._settings
        logger.info("planner: TTFT target %g ms, inter-token target %g ms; a pool gets a worker above load %.2f "
                    "for %g s and drains one below %.2f for %g s, at most one change each %g s", self._targets.ttft_ms,
                    self._targets.itl_ms, cfg.target_load, cfg.scale_up_after_s, cfg.low_load, cfg.scale_down_after_s,
                    cfg.hold_s)  # fmt: skip

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self._ready.set()
        bus = Bus(self._redis)
        try:
            await watch_pools(bus, self._settings, self._targets, self._stop, self._on_pools)
        finally:
            await bus.close()
