"""What the prefill and decode workers share: the heartbeat, stream consumption that survives
Redis restarts, signals, the /health and /metrics server and the lifecycle

    start (health server, model, consumer groups) -> serve -> drain (SIGTERM) -> deregister -> exit 0

A subclass names its `role`, supplies its loops (`serve_tasks`), says when it holds no work
(`is_idle`) and what to do with a step's outputs (`on_outputs`). Every engine call goes through
`EngineThread.call`; every Redis call goes through `Bus` or the helpers here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import socket
import sys
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, ClassVar

from aiohttp import web
from redis.exceptions import ResponseError

from services.kv_transfer import kv_transports
from services.runtime.cpu_pin import CpuPinError, pin_to_cpus
from services.runtime.engine_thread import EngineThread
from services.runtime.health import create_health_app
from services.runtime.heartbeat import Heartbeats, wait_for
from services.runtime.kv_events import KVEventPublisher, KVEventSource
from services.runtime.malloc_tuning import keep_freed_memory
from shared import event_loop
from shared.engine.engine import Engine, RequestOutput
from shared.gc_tuning import freeze_startup_heap
from shared.metrics import WorkerMetrics
from shared.model.paths import ModelNotFoundError, resolve_model_path
from shared.outage_log import OutageLog
from shared.protocol import Message, encode
from shared.settings import WorkerServiceSettings, warn_unknown_settings
from shared.streams import INBOX_GROUP, READ_BLOCK_MS, REDIS_ERRORS, Bus, with_backoff

logger = logging.getLogger(__name__)

Handler = Callable[[bytes, Message | None], Awaitable[None]]
Ack = tuple[str, str, bytes]  # stream, consumer group, entry id


def default_worker_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"


def model_name(settings: WorkerServiceSettings) -> str:
    if settings.model.name:
        return settings.model.name
    try:
        return resolve_model_path(settings.model.path).stem
    except ModelNotFoundError:
        return Path(settings.model.path).stem


async def send_many(bus: Bus, items: list[tuple[str, Message]], acks: Sequence[Ack] = ()) -> None:
    """XADD several messages in one round trip, in order, then XACK `acks`: Redis runs a pipeline in
    order, so an entry is never acknowledged without the messages before it. Entries are laid out
    as `Bus.send` does."""
    pipe = bus.redis.pipeline(transaction=False)
    for stream, msg in items:
        pipe.xadd(stream, {"m": encode(msg)})
    for stream, group, entry_id in acks:
        pipe.xack(stream, group, entry_id)
    await pipe.execute()


class Worker(Heartbeats):
    role: ClassVar[str]

    def __init__(self, settings: WorkerServiceSettings) -> None:
        self.settings = settings
        self.worker_id = settings.worker.worker_id or default_worker_id(self.role)
        self.bus = Bus(settings.redis)
        self.keys = self.bus.keys
        self.inbox = self.keys.inbox(self.worker_id)
        self.kv = kv_transports(self.bus.redis, self.keys, settings.redis.namespace, settings.worker, self.worker_id)
        self.engine = EngineThread()
        self.metrics = WorkerMetrics(model_name(settings), self.worker_id)
        self.draining = False
        self.num_prefilled = 0  # requests whose first token this worker computed, for the pool planner
        self.failed = False  # a loop crashed: the process exits 1 so that a supervisor restarts it
        self.health_port: int | None = None
        self.stopping = asyncio.Event()  # first SIGTERM/SIGINT: drain
        self.stopped = asyncio.Event()  # second signal, or drained: stop now
        self.serving = False  # started: reads its streams, so a stop signal drains what it took
        self.capacity_changed = asyncio.Event()
        # entries read from each stream and not yet through their handler: a batch is handled one
        # entry at a time, so the last may wait behind long engine calls; no reclaimer takes them
        self.unhandled: dict[str, set[bytes]] = defaultdict(set)
        self._work = asyncio.Event()
        self._beat_now = asyncio.Event()
        self._beat_outage = OutageLog(logger, "heartbeat")
        self._status_published_at = time.monotonic()
        self._is_stuck = False
        self._tasks: list[asyncio.Task[None]] = []
        self._helpers: set[asyncio.Task[Any]] = set()
        self._health_runner: web.AppRunner | None = None
        kv_events = settings.worker.kv_events
        self.kv_events = KVEventSource(self.worker_id, self.role, settings.kv_cache.block_size)
        self.kv_publisher = KVEventPublisher(self.bus, self.kv_events, kv_events) if kv_events.enabled else None

    # -- what a subclass provides ------------------------------------------------------------

    async def setup(self) -> None:
        """Create the consumer groups this worker reads (called again after Redis lost them)."""
        await self.bus.ensure_group(self.inbox, INBOX_GROUP)

    def serve_tasks(self) -> list[Coroutine[Any, Any, None]]:
        raise NotImplementedError

    def is_idle(self) -> bool:
        raise NotImplementedError

    async def on_outputs(self, outputs: list[RequestOutput]) -> None:
        raise NotImplementedError

    def engine_loaded(self) -> None:
        """Called once the engine is loaded, before any work arrives."""

    def after_step_on_engine_thread(self, outputs: list[RequestOutput]) -> None:
        """Engine work for a step's outputs that must not wait for the next step; runs on the
        engine thread, before `on_outputs`."""

    def report(self, interval_s: float) -> str | None:
        """A line for the log summing up the last `interval_s` seconds; None when there was nothing."""
        return None

    # -- lifecycle -----------------------------------------------------------------------------

    async def run(self, owns_process: bool = True) -> None:
        """Serve until told to stop. A first SIGTERM/SIGINT drains (no new work, finish what is
        held), a second one stops at once. `owns_process`: this is the process's one worker, which
        handles its signals and, once serving, freezes its start-up heap (shared/gc_tuning.py)."""
        try:
            await self.start(owns_process)
            await self._drain_when_asked()
        finally:
            await self.close()

    async def start(self, owns_process: bool = True) -> None:
        if owns_process:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop)
        await self._start_health_server()
        await self.kv.start()
        # from now on, not from the first heartbeat: a model's first load (converting it into the
        # disk cache) can outlast the marker's TTL, and a neighbour would sweep the marker meanwhile
        self._tasks = [self._spawn_forever(self._kv_marker_loop())]
        logger.info("%s worker %s: loading %s", self.role, self.worker_id, self.settings.model.path)
        engine = await self.engine.load(self.settings)
        self.kv.use_pool(engine.kv_pool_view(), engine.kv_block_views)
        self.metrics.track_engine_steps(lambda: engine.phases.seconds, lambda: engine.num_steps)
        self.engine_loaded()
        stats = self.engine.stats
        assert stats is not None
        threads = self.engine.torch_threads
        logger.info(
            "engine ready on %s (%s): %d KV blocks of %d tokens, torch threads %s",
            engine.device, engine.dtype, stats.kv.num_blocks, engine.block_size,
            self.settings.torch_threads or "default" if threads is None else f"1-{threads}, leased from the neighbours",
        )
        await with_backoff(self.setup, "creating consumer groups", self.stopped)
        if self.stopped.is_set():  # told to stop before it took any work: nothing to drain
            return
        if self.kv_publisher is not None:
            await self._start_kv_events(engine)
        await self._publish_status()
        self._tasks += [self._spawn_forever(self._heartbeat_loop()), self._spawn_forever(self._step_loop())]
        if self.kv_publisher is not None:
            self._tasks.append(self._spawn_forever(self._kv_events_loop(self.kv_publisher)))
        self._tasks += [self._spawn_forever(coro) for coro in self.serve_tasks()]
        if owns_process:
            freeze_startup_heap()
        self.serving = True
        logger.info("serving: inbox %s, redis %s namespace %s", self.inbox, self.settings.redis.url,
                    self.settings.redis.namespace)

    def request_stop(self) -> None:
        if self.stopping.is_set():
            logger.warning("second stop signal: stopping now without finishing held work")
            self.stopped.set()
            return
        if not self.serving:
            # it holds no work yet, and a start that waits for Redis would otherwise wait forever
            logger.info("stop signal while starting: stopping")
            self.stopping.set()
            self.stopped.set()
            return
        logger.info("stop signal: draining (no new work; finishing what is held)")
        self.stopping.set()

    async def _drain_when_asked(self) -> None:
        await self.stopping.wait()
        self.draining = True
        self.beat_now()
        while not self.stopped.is_set() and not (self.is_idle() and not self.engine.has_work):
            if self.heartbeat_lapsed():
                # its work is re-queued elsewhere by now, and what it computes cannot be delivered
                logger.error(
                    "no heartbeat reached Redis for over %.0fs while draining: the held work is taken over "
                    "by other workers, stopping", self.settings.worker.heartbeat_ttl_s,
                )  # fmt: skip
                self.stopped.set()
                break
            await wait_for(self.stopped, 0.05)
        logger.info("drained" if not self.stopped.is_set() else "stopping with work still held")

    async def close(self) -> None:
        # stopping as well: the loops that read only until a drain begins must end too, and cancelling
        # them is not enough (on Python 3.11 a cancel that lands while redis-py sends a command can be
        # swallowed, and the loop would read on forever while this waits for it)
        self.stopping.set()
        self.stopped.set()
        for task in [*self._tasks, *self._helpers]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._helpers, return_exceptions=True)
        try:
            async with asyncio.timeout(self.settings.redis.socket_timeout_s):
                await self.bus.deregister(self.role, self.worker_id)
            logger.info("deregistered %s", self.worker_id)
        except (*REDIS_ERRORS, TimeoutError) as e:
            logger.warning("could not deregister (%s); the heartbeat will lapse on its own", e)
        if self._health_runner is not None:
            await self._health_runner.cleanup()
        await self.kv.close()
        await self.bus.close()
        self.engine.shutdown()

    def _spawn_forever(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=getattr(coro, "__qualname__", None))
        task.add_done_callback(self._on_loop_done)
        return task

    def _on_loop_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        # a worker missing one of its loops would look alive while doing nothing: stop instead
        logger.critical("loop %s crashed; stopping the worker", task.get_name(), exc_info=task.exception())
        self.failed = True
        self.stopping.set()
        self.stopped.set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """A short-lived task the worker waits for before it counts as idle."""
        task = asyncio.create_task(coro)
        self._helpers.add(task)
        task.add_done_callback(self._helpers.discard)
        task.add_done_callback(_log_crash)
        return task

    @property
    def has_helpers(self) -> bool:
        return bool(self._helpers)

    # -- engine ----------------------------------------------------------------------------------

    def wake_engine(self) -> None:
        self._work.set()

    async def _step_loop(self) -> None:
        while not self.stopped.is_set():
            if not self.engine.has_work:
                await self._work.wait()
                self._work.clear()
                continue
            num_steps = self.engine.num_steps
            # an engine error ends the loop, and with it the worker
            outputs = await self.engine.step(self.after_step_on_engine_thread)
            if outputs:
                try:
                    await self.on_outputs(outputs)
                except Exception:
                    logger.exception("delivering the outputs of a step failed")
            elif self.engine.num_steps == num_steps:
                await asyncio.sleep(0.01)  # work the engine cannot schedule yet (no free blocks): don't spin

    # -- Redis -----------------------------------------------------------------------------------

    async def consume(
        self, stream: str, group: str, handle: Handler, capacity: Callable[[], int], until: asyncio.Event
    ) -> None:
        """Read new entries of `stream` as `group` while `capacity()` allows, until `until` is set.

        Survives Redis going away (retries with backoff) and losing the group (recreates it).
        """
        delay = 0.05
        outage = OutageLog(logger, f"reading {stream}")
        while not until.is_set():
            count = capacity()
            if count <= 0:
                await wait_for(self.capacity_changed, READ_BLOCK_MS / 1000)
                self.capacity_changed.clear()
                continue
            try:
                entries = await self.bus.read_group(stream, group, self.worker_id, count, READ_BLOCK_MS)
                outage.recovered()
                delay = 0.05
            except (*REDIS_ERRORS, ResponseError) as e:
                if isinstance(e, ResponseError) and "NOGROUP" in str(e):
                    logger.warning("consumer group %s of %s is gone (Redis restarted?); recreating it", group, stream)
                    await with_backoff(self.setup, "recreating consumer groups", self.stopped)
                    continue
                outage.failed(e)  # unreachable, or refusing the read (out of memory, an ACL)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            unhandled = self.unhandled[stream]
            unhandled.update(entry_id for entry_id, _ in entries)
            for entry_id, msg in entries:
                try:
                    await handle(entry_id, msg)
                except Exception:
                    logger.exception("handling %s from %s failed", type(msg).__name__, stream)
                finally:
                    unhandled.discard(entry_id)

    async def send(self, stream: str, msg: Message) -> None:
        await with_backoff(lambda: self.bus.send(stream, msg), f"sending {msg.TYPE}", self.stopped)

    async def send_many(self, items: list[tuple[str, Message]], acks: Sequence[Ack] = ()) -> None:
        if items or acks:
            await with_backoff(lambda: send_many(self.bus, items, acks), "sending token batches", self.stopped)

    async def ack(self, stream: str, group: str, entry_id: bytes) -> None:
        await with_backoff(lambda: self.bus.ack(stream, group, entry_id), f"acknowledging {stream}", self.stopped)

    async def trim(self) -> None:
        """Drop acknowledged entries of the streams this worker consumes, so they do not grow forever,
        and KV transfers that nobody will read."""
        await self.bus.trim_acknowledged(self.inbox, INBOX_GROUP)
        self.kv.sweep()

    # -- KV events -------------------------------------------------------------------------------

    async def _start_kv_events(self, engine: Engine) -> None:
        assert self.kv_publisher is not None
        loop, wake = asyncio.get_running_loop(), self.kv_publisher.wake

        def collect() -> None:  # engine thread, after every call
            if self.kv_events.collect():
                loop.call_soon_threadsafe(wake.set)

        await self.engine.call(self.kv_events.attach, engine.kv_cache.pool)
        self.engine.after_call = collect

    async def _kv_events_loop(self, publisher: KVEventPublisher) -> None:
        """Events out as they come; a snapshot every snapshot_interval_s while the cache changes."""
        pool = self.engine.engine.kv_cache.pool
        snapshot_outage = OutageLog(logger, "KV snapshot")
        while not self.stopped.is_set():
            await wait_for(publisher.wake, publisher.settings.snapshot_interval_s)
            publisher.wake.clear()
            await publisher.publish_events()
            try:
                if await publisher.snapshot_due():
                    snap = await self.engine.call(self.kv_events.snapshot, pool)
                    await publisher.publish_events()  # what the snapshot collected goes out before it
                    await publisher.publish_snapshot(snap)
                snapshot_outage.recovered()
            except REDIS_ERRORS as e:
                snapshot_outage.failed(e)

    # -- /health and /metrics --------------------------------------------------------------------

    async def _start_health_server(self) -> None:
        cfg = self.settings.worker
        self._health_runner = web.AppRunner(create_health_app(self), access_log=None)
        await self._health_runner.setup()
        await web.TCPSite(self._health_runner, cfg.health_host, cfg.health_port).start()
        self.health_port = self._health_runner.addresses[0][1]
        logger.info("health and metrics on http://%s:%d/health, /metrics", cfg.health_host, self.health_port)

    def health(self) -> tuple[int, dict[str, Any]]:
        body: dict[str, Any] = {"worker_id": self.worker_id, "role": self.role, "draining": self.draining}
        if not self.engine.is_loaded:
            return 503, {**body, "status": "loading"}
        stalled_s = self.engine.stalled_s()
        if stalled_s > self.settings.worker.stuck_after_s:
            return 503, {**body, "status": "stuck", "stalled_s": round(stalled_s, 1)}
        return 200, {**body, "status": "draining" if self.draining else "ok"}

    def render_metrics(self) -> tuple[bytes, str]:
        if self.engine.stats is not None:
            self.metrics.observe_engine(self.engine.stats)
        if (threads := self.engine.threads_now) is not None:
            self.metrics.torch_threads.set(threads)
        self.metrics.observe_pacing(self.engine.lent_s, self.engine.num_pauses, *self.engine.paced_steps)
        return self.metrics.render(), self.metrics.content_type


def _log_crash(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("task %s crashed", task.get_name(), exc_info=task.exception())


def main(worker_cls: type[Worker]) -> None:
    """Entry point of `python -m services.<role>` (prefill, decode, colocated): settings from the environment."""
    settings = WorkerServiceSettings()
    worker = worker_cls(settings)
    logging.basicConfig(
        level=settings.log_level, stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s [{worker.worker_id}] %(name)s: %(message)s",
    )
    warn_unknown_settings()
    keep_freed_memory()
    try:
        pin_to_cpus(settings.worker.cpus)
        event_loop.run(worker.run())
    except (ModelNotFoundError, CpuPinError) as e:
        logger.error("%s", e)
        sys.exit(1)
    sys.exit(1 if worker.failed else 0)
