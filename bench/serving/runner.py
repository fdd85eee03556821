"""Drive a workload against a server: warm-up, arrivals, concurrency cap, progress."""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

import aiohttp

from bench.serving.arrivals import arrival_offsets
from bench.serving.client import Clock, RequestResult, Target, send_request
from bench.serving.progress import ProgressTracker, report_every
from bench.serving.workload import BenchRequest


class WarmupError(RuntimeError):
    """A warm-up request failed, so the timed run would only measure errors."""


@dataclass(slots=True, frozen=True)
class LoadSpec:
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    progress_interval_s: float = 1.0


@dataclass(slots=True)
class RunOutcome:
    results: list[RequestResult]
    duration_s: float


async def run_benchmark(
    target: Target,
    requests: list[BenchRequest],
    load: LoadSpec,
    warmups: Sequence[BenchRequest] = (),
    progress_stream: TextIO = sys.stderr,
) -> RunOutcome:
    """Send `warmups` one by one, untimed, then every request once, and wait for all.

    Results come back in workload order; `duration_s` runs from the first send to the
    last completion.
    """
    # limit=0: the semaphore, not aiohttp's default pool of 100, bounds concurrency.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await _warm_up(session, target, warmups)
        return await _timed_run(session, target, requests, load, progress_stream)


async def _warm_up(session: aiohttp.ClientSession, target: Target, warmups: Sequence[BenchRequest]) -> None:
    for req in warmups:
        result = await send_request(session, target, req, time.perf_counter)
        if not result.success:
            raise WarmupError(f"warm-up request failed: {result.error}")


async def _timed_run(
    session: aiohttp.ClientSession, target: Target, requests: list[BenchRequest], load: LoadSpec, stream: TextIO
) -> RunOutcome:
    t0 = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - t0

    tracker = ProgressTracker(num_total=len(requests))
    reporter = None
    if load.progress_interval_s > 0:
        reporter = asyncio.create_task(report_every(tracker, load.progress_interval_s, now, stream))
    tasks = await _dispatch(session, target, requests, load, _Probe(now, tracker))
    results = await asyncio.gather(*tasks)
    duration_s = now()
    if reporter is not None:
        reporter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reporter
        print(tracker.line(duration_s), file=stream, flush=True)
    return RunOutcome(results=list(results), duration_s=duration_s)


@dataclass(slots=True, frozen=True)
class _Probe:
    clock: Clock
    tracker: ProgressTracker


async def _dispatch(
    session: aiohttp.ClientSession, target: Target, requests: list[BenchRequest], load: LoadSpec, probe: _Probe
) -> list[asyncio.Task[RequestResult]]:
    """Start each request at its arrival time; the cap, if any, delays sends past it."""
    offsets = arrival_offsets(len(requests), load.request_rate, load.seed, load.burstiness)
    limit = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else contextlib.nullcontext()
    tasks = []
    for req, offset in zip(requests, offsets, strict=True):
        delay = offset - probe.clock()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_send(session, target, req, limit, probe)))
    return tasks


async def _send(
    session: aiohttp.ClientSession,
    target: Target,
    req: BenchRequest,
    limit: asyncio.Semaphore | contextlib.nullcontext[None],
    probe: _Probe,
) -> RequestResult:
    async with limit:
        probe.tracker.on_sent()
        result = await send_request(session, target, req, probe.clock)
    probe.tracker.on_done(result)
    return result
