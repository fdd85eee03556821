from __future__ import annotations

import asyncio
import io

import pytest

from bench.serving.client import RequestResult, Target
from bench.serving.progress import ProgressTracker
from bench.serving.runner import LoadSpec, WarmupError, run_benchmark
from bench.serving.workload import BenchRequest
from tests.bench.conftest import StartStub
from tests.bench.stub_server import StubScript

# generous bound so a broken concurrency cap fails the test instead of hanging it
DEADLOCK_GUARD_S = 30


def requests(num: int) -> list[BenchRequest]:
    return [BenchRequest(prompt=[i, i + 1], num_prompt_tokens=2, max_tokens=3 + i) for i in range(num)]


def target(base_url: str) -> Target:
    return Target(url=f"{base_url}/v1/completions", model="stub-model", timeout_s=10.0)


async def test_burst_sends_every_request_concurrently(start_stub: StartStub) -> None:
    stub, base_url = await start_stub(StubScript(num_peers=6))
    load = LoadSpec(progress_interval_s=0)
    outcome = await asyncio.wait_for(run_benchmark(target(base_url), requests(6), load), DEADLOCK_GUARD_S)
    assert stub.max_in_flight == 6
    assert [r.num_output_tokens for r in outcome.results] == [3, 4, 5, 6, 7, 8]
    assert [len(r.itl_s) for r in outcome.results] == [2, 3, 4, 5, 6, 7]
    assert all(r.success for r in outcome.results)
    assert outcome.duration_s >= max(r.start_s + r.latency_s for r in outcome.results if r.latency_s is not None)


async def test_max_concurrency_caps_requests_in_flight(start_stub: StartStub) -> None:
    stub, base_url = await start_stub(StubScript(num_peers=2))
    load = LoadSpec(max_concurrency=2, progress_interval_s=0)
    outcome = await asyncio.wait_for(run_benchmark(target(base_url), requests(7), load), DEADLOCK_GUARD_S)
    assert stub.max_in_flight == 2
    assert sum(r.success for r in outcome.results) == 7


async def test_poisson_arrivals_follow_the_seeded_schedule(start_stub: StartStub) -> None:
    stub, base_url = await start_stub(StubScript())
    load = LoadSpec(request_rate=200.0, seed=5, progress_interval_s=0)
    outcome = await run_benchmark(target(base_url), requests(5), load)
    starts = [r.start_s for r in outcome.results]
    assert starts == sorted(starts)
    assert [p["prompt"] for p in stub.payloads] == [r.prompt for r in requests(5)]


async def test_warmups_go_first_and_are_not_reported(start_stub: StartStub) -> None:
    stub, base_url = await start_stub(StubScript())
    warmup = BenchRequest(prompt=[99], num_prompt_tokens=1, max_tokens=2)
    outcome = await run_benchmark(target(base_url), requests(3), LoadSpec(progress_interval_s=0), [warmup])
    assert stub.payloads[0]["prompt"] == [99]
    assert len(stub.payloads) == 4
    assert len(outcome.results) == 3


async def test_failed_warmup_stops_the_run(start_stub: StartStub) -> None:
    stub, base_url = await start_stub(StubScript(status=400))
    warmup = BenchRequest(prompt=[99], num_prompt_tokens=1, max_tokens=2)
    with pytest.raises(WarmupError, match="HTTP 400: prompt is too long"):
        await run_benchmark(target(base_url), requests(3), LoadSpec(), [warmup])
    assert len(stub.payloads) == 1


async def test_progress_ends_with_a_final_line(start_stub: StartStub) -> None:
    _, base_url = await start_stub(StubScript())
    stream = io.StringIO()
    await run_benchmark(target(base_url), requests(4), LoadSpec(progress_interval_s=60), progress_stream=stream)
    last_line = stream.getvalue().splitlines()[-1]
    assert "done 4/4 failed 0 running 0" in last_line


def test_progress_line_counts_finished_failed_and_running() -> None:
    tracker = ProgressTracker(num_total=5)
    for _ in range(4):
        tracker.on_sent()
    tracker.on_done(RequestResult(start_s=0.0, num_prompt_tokens=1, num_output_tokens=30, chunk_times_s=[0.1]))
    tracker.on_done(RequestResult(start_s=0.0, num_prompt_tokens=1, num_output_tokens=9, error="HTTP 500: boom"))
    line = "[    2.0s] done 2/5 failed 1 running 2 output tok/s (finished requests) 15.0"
    assert tracker.line(2.0) == line
