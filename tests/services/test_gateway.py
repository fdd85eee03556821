"""The gateway against workers played by the test: completions, chat, stop strings and cancellation
(gateway_harness.py)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable

import pytest
from aiohttp.test_utils import TestClient
from openai.types import Completion
from openai.types.chat import ChatCompletion

from services.gateway.dispatcher import Dispatcher
from services.gateway.inflight import InflightRequest
from services.gateway.planner import sample_seed
from shared.engine.sampling_params import SamplingParams
from shared.protocol import Cancel, TokenUpdate
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


# ---- completions ---------------------------------------------------------------------------------


async def test_completion_reaches_workers_and_answers_in_openai_shape(
    client: TestClient, worker: FakeWorker, tokenizer: Tokenizer
) -> None:
    async with openai_client(client) as oai:
        call = asyncio.create_task(oai.completions.create(model=MODEL, prompt="Hello", max_tokens=3, seed=7, user="u1"))
        req = await worker.next_request()
        assert (req.gateway_id, req.prompt_token_ids, req.seed, req.attempt, req.output_token_ids) == (
            GATEWAY_ID, [HELLO], 7, 0, []
        )
        assert req.sampling_params.max_tokens == 3 and req.sampling_params.seed == 7
        assert req.deadline is not None and req.deadline > time.time()
        await worker.reply(req, [WORLD], num_cached_tokens=0)
        await worker.reply(req, [BANG, WORLD], index=1, finish_reason="length")
        completion = await call
    assert isinstance(completion, Completion)
    assert completion.model == MODEL and completion.id.startswith("cmpl-")
    assert [(c.index, c.text, c.finish_reason, c.logprobs) for c in completion.choices] == [
        (0, " world! world", "length", None)
    ]
    assert completion.usage is not None
    usage = completion.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (1, 3, 4)


async def test_default_max_tokens_is_the_setting_for_completions(start: Start, worker: FakeWorker) -> None:
    client = await start(default_max_tokens="5")
    call = asyncio.create_task(post(client, "/v1/completions", {"prompt": "Hello"}))
    req = await worker.next_request()
    assert req.sampling_params.max_tokens == 5
    await worker.reply(req, [WORLD], finish_reason="stop")
    status, body, _ = await call
    assert status == 200 and body["choices"][0]["text"] == " world"


async def test_streamed_completion_chunks_and_usage(client: TestClient, worker: FakeWorker) -> None:
    async with openai_client(client) as oai:
        stream = await oai.completions.create(
            model=MODEL, prompt=[HELLO], max_tokens=4, stream=True, stream_options={"include_usage": True}
        )
        req = await worker.next_request()
        await worker.reply(req, [WORLD], num_cached_tokens=16)
        await worker.reply(req, [BANG], index=1, num_cached_tokens=16)
        await worker.reply(req, [IM_END], index=2, finish_reason="stop", num_cached_tokens=16)
        chunks = [chunk async for chunk in stream]
    assert [[(c.index, c.text, c.finish_reason) for c in chunk.choices] for chunk in chunks] == [
        [(0, " world", None)], [(0, "!", None)], [(0, "", "stop")], []
    ]
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens) == (1, 3, 16)
    assert all(chunk.id == chunks[0].id for chunk in chunks)


async def test_n_samples_of_several_prompts_are_indexed_prompt_major(client: TestClient, worker: FakeWorker) -> None:
    call = asyncio.create_task(post(client, "/v1/completions", {"prompt": ["Hello", "world"], "n": 2, "seed": 10}))
    reqs = [await worker.next_request() for _ in range(4)]
    by_prompt_and_seed = {(tuple(r.prompt_token_ids), r.seed): r for r in reqs}
    assert set(by_prompt_and_seed) == {((HELLO,), 10), ((HELLO,), 11), ((6693,), 10), ((6693,), 11)}
    for (prompt, seed), req in by_prompt_and_seed.items():
        token = BANG if prompt == (HELLO,) else WORLD
        await worker.reply(req, [token] * (seed - 9), finish_reason="length")
    status, body, _ = await call
    assert status == 200
    texts = [(c["index"], c["text"]) for c in body["choices"]]
    assert texts == [(0, "!"), (1, "!!"), (2, " world"), (3, " world world")]
    assert body["usage"]["prompt_tokens"] == 2 and body["usage"]["completion_tokens"] == 6


def test_sample_seeds_are_the_given_seed_plus_index_wrapped_into_range() -> None:
    assert [sample_seed(5, i) for i in range(3)] == [5, 6, 7]
    assert sample_seed(2**64 - 1, 1) == 0
    assert sample_seed(None, 0) != sample_seed(None, 0)  # drawn: 63 random bits


async def test_completion_logprobs(client: TestClient, worker: FakeWorker) -> None:
    call = asyncio.create_task(post(client, "/v1/completions", {"prompt": "Hello", "logprobs": 2}))
    req = await worker.next_request()
    assert req.sampling_params.logprobs == 2
    await worker.reply(
        req, [WORLD, BANG], finish_reason="length", logprobs=[-0.5, -1.5],
        top_logprobs=[[[WORLD, -0.5], [BANG, -2.0]], [[BANG, -1.5], [WORLD, -3.0]]],
    )  # fmt: skip
    status, body, _ = await call
    assert status == 200
    logprobs = Completion.model_validate(body).choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens == [" world", "!"] and logprobs.token_logprobs == [-0.5, -1.5]
    assert logprobs.top_logprobs == [{" world": -0.5, "!": -2.0}, {"!": -1.5, " world": -3.0}]
    assert logprobs.text_offset == [0, 6]


# ---- chat ----------------------------------------------------------------------------------------


async def test_chat_renders_the_template_and_streams_deltas(
    client: TestClient, worker: FakeWorker, tokenizer: Tokenizer
) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    async with openai_client(client) as oai:
        stream = await oai.chat.completions.create(
            model=MODEL, messages=messages, stream=True  # type: ignore[arg-type]
        )
        req = await worker.next_request()
        assert req.prompt_token_ids == tokenizer.apply_chat_template(messages)
        assert req.sampling_params.max_tokens == 8192 - len(req.prompt_token_ids)  # the rest of the context
        await worker.reply(req, [HELLO, BANG])
        await worker.reply(req, [IM_END], index=2, finish_reason="stop")
        chunks = [chunk async for chunk in stream]
    deltas = [(c.choices[0].delta.role, c.choices[0].delta.content, c.choices[0].finish_reason) for c in chunks]
    assert deltas == [("assistant", "Hello!", None), (None, None, "stop")]
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].id.startswith("chatcmpl-")


async def test_chat_stream_sends_nothing_before_the_first_token(client: TestClient, worker: FakeWorker) -> None:
    # Clients time to first token by the first chunk, so each choice's role chunk waits for its first token.
    body = {"messages": [{"role": "user", "content": "Hi"}], "n": 2, "stream": True}
    async with client.post("/v1/chat/completions", json=body) as resp:
        first, second = await worker.next_request(), await worker.next_request()
        await worker.reply(second, [WORLD])
        line = await resp.content.readline()  # the first event: nothing was written before this token
        await worker.reply(first, [HELLO], finish_reason="length")
        await worker.reply(second, [BANG], index=1, finish_reason="length")
        events = [json.loads(line.removeprefix(b"data: ")), *sse_events((await resp.read()).lstrip(b"\n"))]
    choices = [(e["choices"][0]["index"], e["choices"][0]["delta"], e["choices"][0]["finish_reason"]) for e in events]
    assert choices == [
        (1, {"role": "assistant", "content": " world"}, None),
        (0, {"role": "assistant", "content": "Hello"}, "length"),
        (1, {"content": "!"}, "length"),
    ]


async def test_chat_stream_that_fails_before_any_token_has_no_role_chunk(start: Start, worker: FakeWorker) -> None:
    client = await start(request_timeout_s="0.2")
    body = {"messages": [{"role": "user", "content": "Hi"}], "stream": True}
    call = asyncio.create_task(client.post("/v1/chat/completions", json=body))
    await worker.next_request()
    events = sse_events(await (await call).read())
    assert [e["error"]["code"] for e in events] == ["timeout"]


async def test_chat_completion_with_logprobs(client: TestClient, worker: FakeWorker) -> None:
    async with openai_client(client) as oai:
        call = asyncio.create_task(oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=1,
            max_completion_tokens=2,
        ))  # fmt: skip
        req = await worker.next_request()
        assert (req.sampling_params.logprobs, req.sampling_params.max_tokens) == (1, 2)
        await worker.reply(req, [HELLO, BANG], finish_reason="length", logprobs=[-0.25, -0.75],
                           top_logprobs=[[[HELLO, -0.25]], [[BANG, -0.75]]])
        chat = await call
    assert isinstance(chat, ChatCompletion)
    choice = chat.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", "Hello!", "length")
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [(t.token, t.logprob, t.bytes, [(a.token, a.logprob) for a in t.top_logprobs])
            for t in choice.logprobs.content] == [("Hello", -0.25, list(b"Hello"), [("Hello", -0.25)]),
                                                  ("!", -0.75, [33], [("!", -0.75)])]  # fmt: skip


# ---- stop strings and cancellation ---------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_string_never_leaks_and_cancels_the_request(
    client: TestClient, worker: FakeWorker, bus: Bus, stream: bool
) -> None:
    body = {"prompt": "Hello", "max_tokens": 10, "stop": ["END"], "stream": stream}
    call = asyncio.create_task(client.post("/v1/completions", json=body))
    req = await worker.next_request()
    await worker.reply(req, [33662, 11286])  # " hello", " EN": "EN" may begin the stop string, so it waits
    await worker.reply(req, [52, 540], index=2)  # "D", " more"
    resp = await call
    if stream:
        events = sse_events(await resp.read())
        assert [(e["choices"][0]["text"], e["choices"][0]["finish_reason"]) for e in events] == [
            (" hello ", None), ("", "stop")
        ]
    else:
        choice = (await resp.json())["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (" hello ", "stop")
    cancels = await eventually(worker.inbox)
    assert cancels == [Cancel(req.req_id, reason="stop string")]
    assert await bus.redis.ttl(bus.keys.cancelled(req.req_id)) > 0


async def test_stop_string_usage_counts_tokens_up_to_the_stop(client: TestClient, worker: FakeWorker) -> None:
    call = asyncio.create_task(post(client, "/v1/completions", {"prompt": "Hello", "stop": "!"}))
    req = await worker.next_request()
    await worker.reply(req, [WORLD, BANG, WORLD])
    status, body, _ = await call
    assert (status, body["choices"][0]["text"], body["usage"]["completion_tokens"]) == (200, " world", 2)


async def test_client_disconnect_mid_stream_cancels_on_the_worker_last_heard_from(
    client: TestClient, worker: FakeWorker, bus: Bus
) -> None:
    resp = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 50, "stream": True})
    req = await worker.next_request()
    await worker.reply(req, [WORLD], worker_id="prefill-1")
    assert (await resp.content.readline()).startswith(b"data: ")
    resp.close()
    assert await eventually(lambda: worker.inbox("prefill-1")) == [Cancel(req.req_id, "client disconnected")]
    assert await bus.redis.exists(bus.keys.cancelled(req.req_id))


async def test_client_disconnect_before_any_token_cancels_on_every_prefill_worker(
    client: TestClient, worker: FakeWorker, bus: Bus
) -> None:
    await worker.heartbeat("prefill", "prefill-a")
    await worker.heartbeat("prefill", "prefill-b")
    call = asyncio.create_task(client.post("/v1/completions", json={"prompt": "Hello"}))
    req = await worker.next_request()
    call.cancel()
    for prefill_id in ("prefill-a", "prefill-b"):
        assert await eventually(lambda: worker.inbox(prefill_id)) == [Cancel(req.req_id, "client disconnected")]
    assert await bus.redis.exists(bus.keys.cancelled(req.req_id))


async def test_a_client_that_leaves_while_its_request_is_being_queued_still_cancels_it(
    client: TestClient, worker: FakeWorker, bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = Dispatcher.submit

    async def queued_then_slow_to_return(self: Dispatcher, reqs: list[InflightRequest]) -> None:
        await queue(self, reqs)
        await asyncio.Event().wait()  # the XADD went out; the client leaves before the gateway resumes

    monkeypatch.setattr(Dispatcher, "submit", queued_then_slow_to_return)
    await worker.heartbeat("prefill", "prefill-a")
    call = asyncio.create_task(client.post("/v1/completions", json={"prompt": "Hello"}))
    req = await worker.next_request()
    call.cancel()
    assert await eventually(lambda: worker.inbox("prefill-a")) == [Cancel(req.req_id, "client disconnected")]
    assert await bus.redis.exists(bus.keys.cancelled(req.req_id))


async def test_duplicate_and_stale_updates_are_dropped(client: TestClient, worker: FakeWorker) -> None:
    call = asyncio.create_task(post(client, "/v1/completions", {"prompt": "Hello", "max_tokens": 4}))
    req = await worker.next_request()
    await worker.reply(req, [WORLD, BANG])
    await worker.reply(req, [HELLO], index=0, attempt=3)  # another attempt's run
    await worker.reply(req, [WORLD, BANG, HELLO], index=0, worker_id="decode-9")  # a take-over re-sends all
    await worker.reply(req, [BANG], index=1)  # already seen
    await worker.reply(req, [BANG], index=3, finish_reason="length")
    await worker.reply(req, [WORLD], index=4)  # after the end
    status, body, _ = await call
    assert (status, body["choices"][0]["text"], body["usage"]["completion_tokens"]) == (200, " world!Hello!", 4)


def test_inflight_request_accepts_only_its_current_attempt() -> None:
    req = InflightRequest("r", [HELLO], SamplingParams(), seed=1, deadline=0.0, replies=asyncio.Queue(), attempt=1,
                          output_token_ids=[WORLD])  # fmt: skip
    assert req.accept(TokenUpdate("r", attempt=0, index=1, token_ids=[BANG])) is None
    fresh = req.accept(TokenUpdate("r", attempt=1, index=0, token_ids=[WORLD, BANG], logprobs=[-1.0, -2.0]))
    assert fresh is not None and (fresh.index, fresh.token_ids, fresh.logprobs) == (1, [BANG], [-2.0])
    assert req.output_token_ids == [WORLD, BANG]


async def test_replies_are_trimmed_once_routed(client: TestClient, worker: FakeWorker, bus: Bus) -> None:
    call = asyncio.create_task(post(client, "/v1/completions", {"prompt": "Hello"}))
    req = await worker.next_request()
    for index in range(5):
        await worker.reply(req, [WORLD], index=index, finish_reason="length" if index == 4 else None)
    assert (await call)[0] == 200
    assert await eventually(lambda: _is_zero(bus.redis.xlen(bus.keys.replies(GATEWAY_ID))))


async def _is_zero(value: Awaitable[int]) -> bool:
    return await value == 0


async def test_a_streamed_request_shows_in_the_gateways_phase_counters(client: TestClient, worker: FakeWorker) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "stream": True}
    async with client.post("/v1/chat/completions", json=body) as resp:
        request = await worker.next_request()
        await worker.reply(request, [HELLO])
        await worker.reply(request, [WORLD], index=1, finish_reason="length")
        await resp.read()
    async with client.get("/metrics") as resp:
        lines = (await resp.text()).splitlines()
    seconds = {line.split('phase="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
               for line in lines if line.startswith("llmd_gateway_phase_seconds_total{")}
    assert set(seconds) == {"route", "detokenize", "sse"} and all(s > 0 for s in seconds.values()), seconds
