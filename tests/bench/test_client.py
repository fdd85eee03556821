from __future__ import annotations

import time

import aiohttp

from bench.serving.client import RequestResult, Target, fetch_model_name, send_request
from bench.serving.workload import BenchRequest
from tests.bench.conftest import StartStub
from tests.bench.stub_server import ScriptedClock, StubScript

REQ = BenchRequest(prompt=[5, 6, 7], num_prompt_tokens=3, max_tokens=4)


async def send(
    base_url: str, req: BenchRequest = REQ, clock: object = time.perf_counter, **target: object
) -> RequestResult:
    fields: dict[str, object] = {"url": f"{base_url}/v1/completions", "model": "stub-model", "timeout_s": 10.0} | target
    async with aiohttp.ClientSession() as session:
        return await send_request(session, Target(**fields), req, clock)  # type: ignore[arg-type]


async def test_measures_scripted_chunk_times_exactly(start_stub: StartStub) -> None:
    clock = ScriptedClock(now=10.0)
    _, base_url = await start_stub(StubScript(clock=clock, chunk_times=[10.5, 10.75, 11.0, 11.5]))
    result = await send(base_url, clock=clock)
    assert result.error is None
    assert result.start_s == 10.0
    assert result.chunk_times_s == [0.5, 0.75, 1.0, 1.5]
    assert (result.ttft_s, result.itl_s, result.latency_s) == (0.5, [0.25, 0.25, 0.5], 1.5)
    assert result.tpot_s == 1.0 / 3


async def test_sends_the_benchmark_payload(start_stub: StartStub) -> None:
    stub, base_url = await start_stub(StubScript())
    await send(base_url, extra_body={"top_k": 1})
    assert stub.payloads == [
        {
            "model": "stub-model",
            "prompt": [5, 6, 7],
            "max_tokens": 4,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "top_k": 1,
        }
    ]


async def test_token_counts_come_from_usage(start_stub: StartStub) -> None:
    _, base_url = await start_stub(StubScript(tokens_per_chunk=2))
    result = await send(base_url, BenchRequest(prompt="a b c d e", num_prompt_tokens=4, max_tokens=8))
    assert len(result.chunk_times_s) == 4
    assert len(result.itl_s) == 3
    assert (result.num_prompt_tokens, result.num_output_tokens) == (5, 8)


async def test_token_counts_fall_back_to_chunks_without_usage(start_stub: StartStub) -> None:
    _, base_url = await start_stub(StubScript(send_usage=False))
    result = await send(base_url, BenchRequest(prompt=[1, 2], num_prompt_tokens=2, max_tokens=6))
    assert result.error is None
    assert (result.num_prompt_tokens, result.num_output_tokens, len(result.itl_s)) == (2, 6, 5)


async def test_http_error_keeps_the_openai_message(start_stub: StartStub) -> None:
    _, base_url = await start_stub(StubScript(status=400))
    result = await send(base_url)
    assert result.error == "HTTP 400: prompt is too long"
    assert not result.success


async def test_error_event_mid_stream_fails_the_request(start_stub: StartStub) -> None:
    _, base_url = await start_stub(StubScript(error_after_chunks=2))
    result = await send(base_url)
    assert result.error == "stream error: worker lost"
    assert len(result.chunk_times_s) == 2


async def test_stream_without_chunks_is_a_failure(start_stub: StartStub) -> None:
    _, base_url = await start_stub(StubScript())
    result = await send(base_url, BenchRequest(prompt=[1], num_prompt_tokens=1, max_tokens=0))
    assert result.error == "stream ended before the first chunk"


async def test_request_past_its_timeout_fails(start_stub: StartStub) -> None:
    _, base_url = await start_stub(StubScript(hang_after_chunks=1))
    result = await send(base_url, timeout_s=0.2)
    assert result.error == "timed out after 0.2 s"
    assert len(result.chunk_times_s) == 1


async def test_unreachable_server_is_a_failure_not_an_exception(start_stub: StartStub) -> None:
    _, base_url = await start_stub(StubScript())
    result = await send(base_url.rsplit(":", 1)[0] + ":1")
    assert result.error is not None and result.error.startswith("ClientConnectorError")


async def test_fetch_model_name_takes_the_first_listed(start_stub: StartStub) -> None:
    _, base_url = await start_stub(StubScript())
    async with aiohttp.ClientSession() as session:
        assert await fetch_model_name(session, base_url, timeout_s=5.0) == "stub-model"
