"""The one thread that touches a worker's engine, and how a worker builds its engine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from services.runtime.core_lease import CoreLease
from services.runtime.step_threads import StepThreads
from shared.engine.engine import Engine, EngineStats, RequestOutput, resolve_device
from shared.engine.policy import StepPolicy
from shared.model.loader import load_model
from shared.settings import WorkerServiceSettings

T = TypeVar("T")
logger = logging.getLogger(__name__)

LEND_POLL_S = 0.002  # while lending, how often to look whether the neighbour still has work
# The engine thread lets go of the GIL in every torch call and, to take it back while the event loop
# runs Python, waits out the loop's switch interval: 5 ms by default, per call. On an H200 the decode
# worker's engine thread spent 553 of its 800 busy samples (py-spy) building one step's inputs, a
# dozen small torch calls, while the loop streamed 3,400 tokens/s. On this CPU, 15 small torch calls
# beside a busy Python thread took 207 ms, not 0.12; with 0.5 ms, 9.5 ms.
ENGINE_GIL_SWITCH_INTERVAL_S = 0.0005


class EngineThread:
    """The only door to the engine. One dedicated thread runs every call in submission order, so
    the engine is never touched concurrently and the event loop never waits on the model; only
    `call_between_layers` may run sooner, inside a step, still on that thread.

    After each call the thread snapshots `stats`, so heartbeats and /metrics read the load
    without queueing behind a long step. It also tells a hung engine (a call that never returns,
    or work held while nobody steps) from a busy one (`stalled_s`); a step that finds nothing it
    can schedule, e.g. while blocks wait for a handoff, still counts as a step.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._engine: Engine | None = None
        self._lease: CoreLease | None = None
        self.step_threads: StepThreads | None = None  # with a lease: how many of its cores a step takes
        # (fn, args, future) of call_between_layers
        self._layer_calls: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], asyncio.Future[Any]]] = (
            queue.SimpleQueue()
        )
        self._fixed_threads: int | None = None
        self.stats: EngineStats | None = None
        self.num_steps = 0  # steps that computed something
        self.busy_s = 0.0  # seconds those steps took: what the pool planner reads as this worker's load
        self._clock = clock
        self._busy_since: float | None = None
        self._stepped_at = clock()
        self.after_call: Callable[[], None] | None = None  # runs on the engine thread after every call
        # runs on the engine thread after each decoder layer of a step, with that layer's index (CPU only)
        self.after_layer: Callable[[Engine, int], None] | None = None
        self._layer = 0  # the next decoder layer of the step in progress
        self._held: dict[str, int] = {}  # the engine's requests after the last call, with their sure output tokens
        self.lent_s = 0.0  # seconds the engine lent its cores to a neighbour while it had work (pacing)

    @property
    def engine(self) -> Engine:
        assert self._engine is not None, "the engine is not loaded yet"
        return self._engine

    @property
    def is_loaded(self) -> bool:
        return self._engine is not None

    @property
    def has_work(self) -> bool:
        return self.stats is not None and self.stats.num_running + self.stats.num_waiting > 0

    async def load(self, settings: WorkerServiceSettings) -> Engine:
        sys.setswitchinterval(ENGINE_GIL_SWITCH_INTERVAL_S)  # for the whole process: see the constant
        # a CUDA graph's replay calls no Python between layers, so only a CPU engine leases cores
        on_cpu = resolve_device(settings.model.device).type == "cpu"
        if on_cpu and settings.worker.elastic_threads:
            max_threads = settings.torch_threads or await self.call(torch.get_num_threads)
            await self.call(self._lease_cores, settings.worker.core_lease_dir, max_threads)
        self._engine = await self.call(load_engine, settings, self._lease)
        self._fixed_threads = await self.call(torch.get_num_threads)
        if on_cpu:
            self._engine.runner.model.between_layers = self.between_layers
            if self._lease is not None:
                self._engine.runner.model.within_layer = self._lease.rebalance
        await self.call(lambda: None)  # first stats snapshot
        return self._engine

    @property
    def threads_now(self) -> int | None:
        """The torch threads the engine steps on now (None before it loads)."""
        if self._lease is not None:
            return self._lease.threads
        return self._fixed_threads

    def _lease_cores(self, directory: str, max_threads: int) -> None:
        try:
            self._lease = CoreLease(directory, max_threads)
            self.step_threads = StepThreads(self._lease.max_threads)
        except OSError as e:
            logger.warning(
                "elastic threads off: no core lease in %s (%s); running a fixed %d torch threads. Point "
                "LLMD_WORKER__CORE_LEASE_DIR at a tmpfs the host's workers share, or set "
                "LLMD_WORKER__ELASTIC_THREADS=false and LLMD_TORCH_THREADS", directory, e, max_threads,
            )

    @property
    def policy(self) -> StepPolicy:
        return self.engine.policy

    def pace(self, max_pause_s: float) -> bool:
        """Space steps as far apart as the inter-token target allows while a neighbour on the lease has
        work, lending it the cores between them, and pause the streams for up to `max_pause_s` where
        the policy allows (shared/engine/policy); False where there is no lease."""
        if self._lease is None:
            return False
        self.policy.pace(max_pause_s)
        return True

    def stall_for_prompts(self, first_token_seen: bool) -> bool:
        """Let a prompt the step budget holds back take a whole step where the streams afford it
        (`StepPolicy.stall_for_prompts`), and say so once in the log."""
        if not self.policy.stall_for_prompts(first_token_seen):
            return False
        targets = self.policy.targets
        assert targets is not None
        logger.info("a prompt that the inter-token target would cut into chunks beside the streams takes a whole "
                    "step, at once or after %g ms, where %d%% of each one's gaps still meet the target "
                    "(LLMD_TARGETS__ITL_PERCENTILE)", 1000 * self.policy.pause_after_s, targets.itl_percentile)
        return True

    @property
    def num_pauses(self) -> int:
        """Pauses the late-gap allowance bought a neighbour, or whole steps a held-back prompt."""
        return self.policy.num_pauses if self._engine is not None else 0

    @property
    def paced_steps(self) -> tuple[int, int]:
        """(steps the pacer planned, those of them whose tokens came later than the target)."""
        return self.policy.paced_steps if self._engine is not None else (0, 0)

    @property
    def torch_threads(self) -> int | None:
        """The most torch threads the engine runs, where it leases them from its neighbours (else None)."""
        return None if self._lease is None else self._lease.max_threads

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._run, fn, args)

    async def call_between_layers(self, fn: Callable[..., T], *args: Any) -> T:
        """Like `call`, but where a step is in progress on the CPU, `fn` runs at its next layer
        boundary instead of after it: a decode step is tens of milliseconds, and an incoming request
        that waits for one to reserve its blocks and another to join the batch starts a step later.
        Only for calls that touch nothing the step in progress uses (reserving blocks for an import,
        committing an imported request); never for one that frees blocks the step may use."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._layer_calls.put((fn, args, future))
        # after the step in progress should no layer boundary come first, or now if none is running
        loop.run_in_executor(self._executor, self._run_layer_calls_now)
        return await future

    def between_layers(self) -> None:
        """The model's hook after each decoder layer, on the engine thread."""
        if self._lease is not None:
            self._lease.rebalance()
        layer, self._layer = self._layer, self._layer + 1
        if self.after_layer is not None:
            self.after_layer(self.engine, layer)
        if not self._layer_calls.empty():
            _hand_back(self._take_layer_calls())  # at once: a reservation's answer need not wait for the step

    def _run_layer_calls_now(self) -> None:
        # results go back after `_run` took its stats snapshot, as a `call`'s do: a caller that then
        # wakes the step loop must find the work it just committed
        _hand_back(self._run(self._take_layer_calls, ()))

    def _take_layer_calls(self) -> list[tuple[asyncio.Future[Any], Any, Exception | None]]:
        """Runs the queued calls; returns each one's future with its result or error."""
        done: list[tuple[asyncio.Future[Any], Any, Exception | None]] = []
        while True:
            try:
                fn, args, future = self._layer_calls.get_nowait()
            except queue.Empty:
                return done
            if future.cancelled():  # as a queued executor job is dropped when its caller leaves
                continue
            try:
                done.append((future, fn(*args), None))
            except Exception as e:
                done.append((future, None, e))

    async def step(self, then: Callable[[list[RequestOutput]], None] | None = None) -> list[RequestOutput]:
        """One engine step; `then(outputs)` runs right after it on the engine thread, before any call
        queued meanwhile (which would otherwise wait for the next step)."""
        if self._lease is not None and self.policy.is_paced:
            await self._lend_until_due(self._lease)
            self.policy.woke(self._clock())
        return await self.call(self._step, then)

    async def _lend_until_due(self, lease: CoreLease) -> None:
        # on the event loop, not the engine thread: calls (a commit, an abort) still run meanwhile
        now = self._clock()
        lend = self.policy.before_step(now, lease.neighbour_has_work(), self._held)
        if lend is None:
            return
        await self.call(lease.lend)
        lent_at = self._clock()
        # a pause lasts its length; a paced step is due at a time, which the lend's own latency (ms on
        # cores the neighbour's threads fill) must not push later
        deadline = lent_at + lend.seconds if lend.is_pause else lend.deadline_s
        while (left := deadline - self._clock()) > 0 and lease.neighbour_has_work():
            if lend.is_pause and not self.policy.pause_goes_on(self._held, lend.paused):
                break  # a request committed meanwhile cannot spare its first gap
            await asyncio.sleep(min(left, LEND_POLL_S))
        self.lent_s += self._clock() - lent_at

    def _step(self, then: Callable[[list[RequestOutput]], None] | None) -> list[RequestOutput]:
        threads = None
        if self._lease is not None:
            assert self.step_threads is not None
            threads = self._lease.before_step(self.step_threads.choose())
        started, num_steps = self._clock(), self.engine.num_steps
        self._layer = 0
        outputs = self.engine.step()
        self._stepped_at = self._clock()
        if self.engine.num_steps != num_steps:
            self.busy_s += self._stepped_at - started
            self.policy.stepped(self._stepped_at, outputs)
            if self.step_threads is not None and threads == self.threads_now:  # none given back mid-step
                self.step_threads.observe(threads, self.engine.last_step_tokens, self._stepped_at - started)
        if then is not None and outputs:
            then(outputs)
        return outputs

    def _run(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        start = self._clock()
        self._busy_since = start
        if not self.has_work:
            self._stepped_at = start  # idle time is not a stall
        try:
            return fn(*args)
        finally:
            if self._engine is not None:
                self.stats = self._engine.stats()
                if self._engine.policy.pauses_streams:
                    self._held = self._engine.unfinished_sure_tokens()
                self.num_steps = self._engine.num_steps
                if self.after_call is not None:
                    self.after_call()
                if self._lease is not None:  # after any call: an abort or a release can leave it idle too
                    self._lease.after_call(self._engine.has_unfinished)
            self._busy_since = None

    def stalled_s(self) -> float:
        """How long one call has been running, or the engine has held work that nobody stepped."""
        now = self._clock()
        busy_since = self._busy_since
        stalled = now - busy_since if busy_since is not None else 0.0
        return max(stalled, now - self._stepped_at) if self.has_work else stalled

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._lease is not None:
            self._lease.leave()


def _hand_back(done: list[tuple[asyncio.Future[Any], Any, Exception | None]]) -> None:
    for future, result, error in done:
        future.get_loop().call_soon_threadsafe(_settle, future, result, error)


def _settle(future: asyncio.Future[Any], result: Any, error: Exception | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def load_engine(settings: WorkerServiceSettings, lease: CoreLease | None = None) -> Engine:
    """The worker's engine; where it leases cores, loaded on the lease's share, which then sets the threads."""
    engine_settings = settings.engine
    if lease is not None:
        engine_settings = engine_settings.model_copy(update={"torch_threads": None})
    with contextlib.nullcontext() if lease is None else lease.loading():
        return Engine(engine_settings, load_model(settings.model.path, settings.model.disk_cache))
