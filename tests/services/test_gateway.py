"""The gateway's real app against the real Redis; the test plays the workers through `Bus` and
protocol messages: it reads each GenerateRequest off the requests stream and answers with
TokenBatches on the gateway's replies stream."""

from __future__ import annotations

import os

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, TypeVar

import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer
from openai import AsyncOpenAI
from openai.types import Completion
from openai.types.chat import ChatCompletion

from shared.engine.sampling_params import SamplingParams
from shared.model.paths import default_model_path
from shared.protocol import Cancel, GenerateRequest, Message, TokenBatch, TokenUpdate, WorkerStatus, decode
from shared.settings import GatewayServiceSettings, RedisSettings
from shared.streams import Bus
from shared.text.tokenizer import Tokenizer

from services.gateway.app import create_app
from services.gateway.dispatcher import Dispatcher
from services.gateway.inflight import InflightRequest
from services.gateway.planner import sample_seed

pytestmark = pytest.mark.timeout(60)

REDIS_URL = os.environ["REDIS_URL"]
GATEWAY_ID = "gw-test"
MODEL = default_model_path().stem
HELLO, WORLD, BANG, IM_END = 19556, 905, 17, 2  # "Hello", " world", "!", "<|im_end|>"
T = TypeVar("T")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_path(str(default_model_path()))


@pytest.fixture
def namespace(monkeypatch: pytest.MonkeyPatch) -> str:
    namespace = f"test-gateway-{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("LLMD_REDIS__URL", REDIS_URL)
    monkeypatch.setenv("LLMD_REDIS__NAMESPACE", namespace)
    monkeypatch.setenv("LLMD_GATEWAY__GATEWAY_ID", GATEWAY_ID)
    return namespace


@pytest.fixture
async def bus(namespace: str) -> AsyncIterator[Bus]:
    bus = Bus(RedisSettings(url=REDIS_URL, namespace=namespace))
    yield bus
    keys = [key async for key in bus.redis.scan_iter(f"{namespace}:*")]
    if keys:
        await bus.redis.delete(*keys)
    await bus.close()


Start = Callable[..., Awaitable[TestClient]]


@pytest.fixture
async def start(bus: Bus, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Start]:
    """Starts a gateway whose settings come from the environment; keyword arguments set LLMD_GATEWAY__<NAME>."""
    async with AsyncExitStack() as stack:

        async def start_gateway(**gateway_env: str) -> TestClient:
            for name, value in gateway_env.items():
                monkeypatch.setenv(f"LLMD_GATEWAY__{name.upper()}", value)
            app = create_app(GatewayServiceSettings(), tokenizer)
            return await stack.enter_async_context(TestClient(TestServer(app)))

        yield start_gateway


@pytest.fixture
async def client(start: Start) -> TestClient:
    return await start()


@asynccontextmanager
async def openai_client(client: TestClient, api_key: str = "unused") -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=api_key, max_retries=0) as oai:
        yield oai


class FakeWorker:
    """Plays the worker pools: takes GenerateRequests off the requests stream, answers with TokenBatches."""

    def __init__(self, bus: Bus, worker_id: str = "decode-7") -> None:
        self.bus = bus
        self.worker_id = worker_id
        self._last_id = b"0-0"

    async def next_request(self) -> GenerateRequest:
        while True:
            entries = await self.bus.read(self.bus.keys.requests, self._last_id, count=1, block_ms=100)
            if entries:
                self._last_id, msg = entries[0]
                assert isinstance(msg, GenerateRequest)
                return msg

    async def reply(
        self, req: GenerateRequest, token_ids: list[int], index: int = 0, finish_reason: str | None = None,
        **fields: Any,
    ) -> None:
        update = TokenUpdate(
            req_id=req.req_id, attempt=fields.pop("attempt", req.attempt), index=index, token_ids=token_ids,
            finish_reason=finish_reason, num_prompt_tokens=len(req.prompt_token_ids),
            worker_id=fields.pop("worker_id", self.worker_id), **fields,
        )  # fmt: skip
        await self.bus.send(self.bus.keys.replies(req.gateway_id), TokenBatch([update]))

    async def inbox(self, worker_id: str | None = None) -> list[Message]:
        entries = await self.bus.redis.xrange(self.bus.keys.inbox(worker_id or self.worker_id))
        return [decode(fields[b"m"]) for _, fields in entries]

    async def heartbeat(self, role: str, worker_id: str, draining: bool = False) -> None:
        status = WorkerStatus(worker_id, role, self.bus.keys.inbox(worker_id), 100, 100, 0, 0, time.time(), draining)
        await self.bus.publish_status(status, ttl_s=30)


@pytest.fixture
def worker(bus: Bus) -> FakeWorker:
    return FakeWorker(bus)


async def eventually(probe: Callable[[], Awaitable[T]], timeout_s: float = 10.0) -> T:
    """The first truthy value of `probe`; fails the test if none comes (the bound only stops a hang)."""
    async with asyncio.timeout(timeout_s):
        while not (value := await probe()):
            await asyncio.sleep(0.01)
    return value


async def post(client: TestClient, path: str, body: Any, **kwargs: Any) -> tuple[int, dict[str, Any], dict[str, str]]:
    data = json.dumps(body) if isinstance(body, (dict, list)) else body
    async with client.post(path, data=data, headers={"Content-Type": "application/json"}, **kwargs) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


def sse_events(raw: bytes) -> list[Any]:
    events = [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


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
