"""The gateway against workers played by the test: failures, validation, limits, auth, models,
tokenize, probes and metrics (gateway_harness.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from aiohttp.test_utils import TestClient

from shared.streams import Bus
from shared.text.tokenizer import Tokenizer
from tests.services.gateway_harness import (  # noqa: F401 (bus, client, namespace, start, tokenizer, worker: fixtures)
    BANG,
    GATEWAY_ID,
    HELLO,
    IM_END,
    MODEL,
    WORLD,
    FakeWorker,
    Start,
    bus,
    client,
    eventually,
    namespace,
    openai_client,
    post,
    sse_events,
    start,
    tokenizer,
    worker,
)

pytestmark = pytest.mark.timeout(60)


# ---- failures ------------------------------------------------------------------------------------


async def test_deadline_cancels_and_answers_504(start: Start, worker: FakeWorker, bus: Bus) -> None:
    client = await start(request_timeout_s="0.2")
    call = asyncio.create_task(post(client, "/v1/completions", {"prompt": "Hello"}))
    req = await worker.next_request()
    status, body, _ = await call
    assert status == 504
    assert body["error"]["message"] == "The request did not finish within 0.2 s (gateway.request_timeout_s)."
    assert await eventually(lambda: bus.redis.exists(bus.keys.cancelled(req.req_id)))


async def test_deadline_mid_stream_ends_with_an_error_event(start: Start, worker: FakeWorker) -> None:
    client = await start(request_timeout_s="0.5")
    call = asyncio.create_task(client.post("/v1/completions", json={"prompt": "Hello", "stream": True}))
    req = await worker.next_request()
    await worker.reply(req, [WORLD])
    events = sse_events(await (await call).read())
    assert events[0]["choices"][0]["text"] == " world"
    assert events[1]["error"]["code"] == "timeout"


async def test_worker_failure_is_a_clear_error(client: TestClient, worker: FakeWorker) -> None:
    call = asyncio.create_task(post(client, "/v1/completions", {"prompt": "Hello"}))
    req = await worker.next_request()
    await worker.reply(req, [], finish_reason="abort", error="KV transfer failed: gone")
    status, body, _ = await call
    assert status == 502
    assert body["error"] == {
        "message": "The request failed on worker decode-7: KV transfer failed: gone",
        "type": "server_error", "param": None, "code": "worker_error",
    }  # fmt: skip


async def test_redis_down_is_503_and_not_ready(start: Start, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMD_REDIS__URL", "redis://127.0.0.1:1/0")
    client = await start()
    status, body, _ = await post(client, "/v1/completions", {"prompt": "Hello"})
    assert (status, body["error"]["type"]) == (503, "server_error")
    async with client.get("/ready") as resp:
        assert (resp.status, (await resp.json())["reason"]) == (503, "Redis at redis://127.0.0.1:1/0 is unreachable")


# ---- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "message"),
    [
        ("/v1/completions", "{not json", 400, None,
         "Request body is not valid JSON: key must be a string at line 1 column 2"),
        ("/v1/completions", {"prompt": "Hello", "temperature": 3}, 400, "temperature",
         "temperature must be between 0 and 2, got 3.0"),
        ("/v1/completions", '{"prompt": "Hello", "top_p": NaN}', 400, "top_p", "top_p must be in (0, 1], got nan"),
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 9000}, 400, "prompt",
         "This model's maximum context length is 8192 tokens. However, you requested 9001 tokens (1 in the prompt, "
         "9000 in the completion). Please reduce the length of the prompt or completion."),
        ("/v1/completions", {"prompt": [[1, 49152]]}, 400, "prompt",
         "token id 49152 in 'prompt' is outside the vocabulary (size 49152)"),
        ("/v1/completions", {"prompt": "Hello", "n": 17}, 400, "n",
         "Invalid value for 'n': Input should be less than or equal to 16, got 17"),
        ("/v1/completions", {"prompt": "Hello", "min_tokens": 20}, 400, "min_tokens",
         "min_tokens must be between 0 and max_tokens (16), got 20"),
        ("/v1/completions", {"prompt": "Hello", "model": "gpt-4"}, 404, "model",
         f"The model `gpt-4` does not exist; this server serves `{MODEL}` (see /v1/models)."),
        ("/v1/chat/completions", {"messages": []}, 400, "messages",
         "messages must contain at least one message, got []"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 0}, 400,
         "max_completion_tokens", "max_completion_tokens must be at least 1, got 0"),
        ("/detokenize", {"tokens": [50000]}, 400, "tokens",
         "token id 50000 in 'tokens' is outside the vocabulary (size 49152)"),
    ],
)  # fmt: skip
async def test_bad_input_is_a_4xx_openai_error(
    client: TestClient, path: str, body: Any, status: int, param: str | None, message: str
) -> None:
    got_status, got_body, _ = await post(client, path, body)
    assert (got_status, got_body["error"]["param"], got_body["error"]["message"]) == (status, param, message)
    assert set(got_body["error"]) == {"message", "type", "param", "code"}


async def test_chat_longer_than_the_context_is_rejected(client: TestClient, tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "x " * 9000}]
    num_tokens = len(tokenizer.apply_chat_template(messages))
    status, body, _ = await post(client, "/v1/chat/completions", {"messages": messages})
    assert (status, body["error"]["code"]) == (400, "context_length_exceeded")
    assert body["error"]["message"] == (
        f"This model's maximum context length is 8192 tokens. However, you requested {num_tokens + 1} tokens "
        f"({num_tokens} in the messages, 1 in the completion). Please reduce the length of the messages or completion."
    )


async def test_unknown_route_is_404_in_the_openai_envelope(client: TestClient) -> None:
    async with client.get("/v1/nothing") as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("chunked", [False, True])
async def test_oversized_body_is_413(start: Start, chunked: bool) -> None:
    client = await start(max_body_bytes="2048")
    payload = json.dumps({"prompt": "x" * 4096}).encode()

    async def chunks() -> AsyncIterator[bytes]:
        for start_at in range(0, len(payload), 1024):
            yield payload[start_at : start_at + 1024]

    status, body, _ = await post(client, "/v1/completions", chunks() if chunked else payload)
    assert status == 413
    size = "more" if chunked else f"{len(payload)} bytes"
    assert body["error"]["message"] == (
        f"The request body ({size}) is larger than the 2048 bytes allowed (gateway.max_body_bytes)."
    )


async def test_full_gateway_answers_429_with_retry_after(start: Start, worker: FakeWorker) -> None:
    client = await start(max_queued_requests="2")
    first = asyncio.create_task(post(client, "/v1/completions", {"prompt": "Hello", "n": 2}))
    req = await worker.next_request()
    status, body, headers = await post(client, "/v1/completions", {"prompt": "Hello"})
    assert (status, headers["Retry-After"], body["error"]["code"]) == (429, "1", "rate_limit_exceeded")
    assert body["error"]["message"] == (
        "The gateway is at capacity: 2 requests in flight, this request adds 1, the limit is 2 "
        "(gateway.max_queued_requests). Retry after 1 s."
    )
    too_big = await post(client, "/v1/completions", {"prompt": "Hello", "n": 3})
    assert (too_big[0], too_big[1]["error"]["code"]) == (400, "request_too_large")
    for r in [req, await worker.next_request()]:
        await worker.reply(r, [WORLD], finish_reason="stop")
    assert (await first)[0] == 200
    again = asyncio.create_task(post(client, "/v1/completions", {"prompt": "Hello"}))  # room again
    await worker.reply(await worker.next_request(), [WORLD], finish_reason="stop")
    assert (await again)[0] == 200
    async with client.get("/metrics") as resp:
        assert f'llmd_requests_rejected_total{{model_name="{MODEL}"}} 1.0' in (await resp.text()).splitlines()


async def test_a_burst_beyond_the_redis_pool_waits_for_connections(
    start: Start, worker: FakeWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More requests at once than the gateway has Redis connections: each waits for a free one
    (redis-py's plain pool would refuse the command, a 503), and every one is answered."""
    monkeypatch.setenv("LLMD_REDIS__MAX_CONNECTIONS", "4")
    client = await start()
    calls = [asyncio.create_task(post(client, "/v1/completions", {"prompt": "Hello", "max_tokens": 1}))
             for _ in range(40)]
    for _ in calls:
        await worker.reply(await worker.next_request(), [WORLD], finish_reason="stop")
    assert [status for status, _, _ in await asyncio.gather(*calls)] == [200] * len(calls)


# ---- auth, models, tokenize, probes, metrics -----------------------------------------------------


async def test_api_keys_guard_the_api_but_not_the_probes(start: Start) -> None:
    client = await start(api_keys="key-one, key-two")
    async with client.get("/v1/models") as resp:
        assert (resp.status, resp.headers["WWW-Authenticate"]) == (401, "Bearer")
        assert (await resp.json())["error"]["code"] == "invalid_api_key"
    async with client.get("/v1/models", headers={"Authorization": "Bearer key-three"}) as resp:
        assert resp.status == 401
    async with client.get("/health") as resp:
        assert resp.status == 200
    async with openai_client(client, api_key="key-two") as oai:
        assert [m.id for m in (await oai.models.list()).data] == [MODEL]
    async with openai_client(client, api_key="wrong") as oai:
        with pytest.raises(openai.AuthenticationError):
            await oai.models.list()


async def test_models_lists_the_served_model(client: TestClient) -> None:
    async with openai_client(client) as oai:
        models = (await oai.models.list()).data
    assert [(m.id, m.object, m.owned_by) for m in models] == [(MODEL, "model", "llmd")]


async def test_tokenize_and_detokenize_round_trip(client: TestClient, tokenizer: Tokenizer) -> None:
    status, body, _ = await post(client, "/tokenize", {"prompt": "Hello world!"})
    assert (status, body) == (200, {"count": 3, "max_model_len": 8192, "tokens": [HELLO, WORLD, BANG]})
    messages = [{"role": "user", "content": "Hi"}]
    status, body, _ = await post(client, "/tokenize", {"messages": messages})
    assert body["tokens"] == tokenizer.apply_chat_template(messages)
    status, body, _ = await post(client, "/detokenize", {"tokens": [HELLO, WORLD, BANG]})
    assert (status, body) == (200, {"prompt": "Hello world!"})
    status, body, _ = await post(client, "/tokenize", {"prompt": "a", "messages": messages})
    assert (status, body["error"]["message"]) == (400, "give exactly one of 'prompt' and 'messages'")


async def test_ready_needs_a_live_prefill_and_decode_worker(client: TestClient, worker: FakeWorker) -> None:
    async def ready() -> tuple[int, dict[str, Any]]:
        async with client.get("/ready") as resp:
            return resp.status, await resp.json()

    def not_ready(role: str) -> tuple[int, dict[str, str]]:
        return 503, {"status": "not ready", "reason": f"no live {role} worker (namespace '{worker.bus.keys.namespace}')"}

    assert await ready() == not_ready("prefill")
    await worker.heartbeat("prefill", "prefill-0")
    await worker.heartbeat("decode", "decode-0", draining=True)  # a draining worker takes no new work
    assert await ready() == not_ready("decode")
    await worker.heartbeat("decode", "decode-1")
    assert await ready() == (200, {"status": "ready"})
    async with client.get("/health") as resp:
        assert (resp.status, await resp.json()) == (200, {"status": "ok", "gateway_id": GATEWAY_ID})


async def test_metrics_count_tokens_by_worker(client: TestClient, worker: FakeWorker) -> None:
    call = asyncio.create_task(post(client, "/v1/completions", {"prompt": "Hello", "max_tokens": 3}))
    req = await worker.next_request()
    await worker.reply(req, [WORLD], worker_id="prefill-0")
    await worker.reply(req, [WORLD, BANG], index=1, finish_reason="length")
    assert (await call)[0] == 200
    async with client.get("/metrics") as resp:
        text = await resp.text()
    label = f'model_name="{MODEL}"'
    for line in (
        f"vllm:prompt_tokens_total{{{label}}} 1.0",
        f"vllm:generation_tokens_total{{{label}}} 3.0",
        f"vllm:e2e_request_latency_seconds_count{{{label}}} 1.0",
        f"vllm:time_to_first_token_seconds_count{{{label}}} 1.0",
        f"vllm:inter_token_latency_seconds_count{{{label}}} 2.0",
        f"vllm:request_queue_time_seconds_count{{{label}}} 1.0",
        f"llmd_queue_depth{{{label}}} 0.0",
        f'llmd_worker_tokens_total{{{label},worker_id="prefill-0"}} 1.0',
        f'llmd_worker_tokens_total{{{label},worker_id="decode-7"}} 2.0',
    ):
        assert line in text.splitlines()
