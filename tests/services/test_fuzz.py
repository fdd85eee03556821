"""Bad input against the gateway's real app: every malformed request is a 4xx in OpenAI's error
envelope, never a 5xx, and never reaches a worker. The fuzz run sends >= 1,000 hypothesis-made
bodies around the schema; a fake worker answers the ones that are accepted at once."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from shared.protocol import GenerateRequest, TokenBatch, TokenUpdate
from shared.streams import REDIS_ERRORS, Bus, with_backoff
from tests.services.gateway_harness import MODEL, WORLD, Start, bus, namespace, post, start, tokenizer  # noqa: F401

pytestmark = pytest.mark.timeout(180)

NUM_FUZZ_REQUESTS = 1200
CONCURRENCY = 8


async def answer_everything(bus: Bus, seen: list[GenerateRequest], stop: asyncio.Event) -> None:
    """A worker pool that finishes every request with one token. Stopped by `stop`, not by a cancel:
    on Python 3.11 a cancel that lands inside a redis-py command can be swallowed."""
    last_id = b"0-0"
    while not stop.is_set():
        try:
            entries = await bus.read(bus.keys.requests, last_id, count=64, block_ms=100)
        except REDIS_ERRORS:  # the shared Redis is slow under load at times; a real worker rides it out too
            continue
        for entry_id, msg in entries:
            last_id = entry_id
            assert isinstance(msg, GenerateRequest)
            seen.append(msg)
            update = TokenUpdate(
                req_id=msg.req_id, attempt=msg.attempt, index=len(msg.output_token_ids), token_ids=[WORLD],
                finish_reason="length", num_prompt_tokens=len(msg.prompt_token_ids), worker_id="decode-fuzz",
            )  # fmt: skip
            await with_backoff(lambda: bus.send(bus.keys.replies(msg.gateway_id), TokenBatch([update])), "replying")


@pytest.fixture
async def worker_pool(bus: Bus) -> AsyncIterator[list[GenerateRequest]]:
    seen: list[GenerateRequest] = []
    stop = asyncio.Event()
    task = asyncio.create_task(answer_everything(bus, seen, stop))
    yield seen
    stop.set()
    await asyncio.gather(task, return_exceptions=True)


def assert_openai_error(status: int, body: Any) -> None:
    assert 400 <= status < 500, (status, body)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]


# ---- explicit cases -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "message"),
    [
        ("/v1/completions", {"prompt": ""}, 400, "prompt", 'prompt must not be empty, got ""'),
        ("/v1/completions", {"prompt": []}, 400, "prompt", "prompt must not be empty, got []"),
        ("/v1/completions", {"prompt": "Hi " * 9000}, 400, "prompt", None),
        ("/v1/completions", {"prompt": "Hello", "max_tokens": "10"}, 400, "max_tokens",
         "Invalid value for 'max_tokens': Input should be a valid integer, got \"10\""),
        ("/v1/completions", {"prompt": 5}, 400, "prompt",
         "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids, got 5"),
        ("/v1/completions", {"prompt": "Hello", "top_p": 0}, 400, "top_p", "top_p must be in (0, 1], got 0.0"),
        ("/v1/completions", {"prompt": "Hello", "stop": [f"s{i}" for i in range(17)]}, 400, "stop",
         "at most 16 stop sequences are allowed, got 17"),
        ("/v1/completions", {"prompt": "Hello", "logprobs": 21}, 400, "logprobs",
         "logprobs must be between 0 and 20, got 21"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
                                  "top_logprobs": 21}, 400, "top_logprobs",
         "Invalid value for 'top_logprobs': Input should be less than or equal to 20, got 21"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "model": "nope"}, 404, "model",
         f"The model `nope` does not exist; this server serves `{MODEL}` (see /v1/models)."),
        ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None, None),
        ("/v1/completions", b"[1, 2]", 400, None, "Request body must be a JSON object"),
        ("/v1/completions", b"", 400, None, None),
    ],
)  # fmt: skip
async def test_bad_input_is_refused_before_any_worker(
    start: Start, worker_pool: list[GenerateRequest], path: str, body: Any, status: int, param: str | None,
    message: str | None,
) -> None:
    client = await start()
    got_status, got_body, _ = await post(client, path, body)
    assert_openai_error(got_status, got_body)
    assert (got_status, got_body["error"]["param"]) == (status, param)
    if message is not None:
        assert got_body["error"]["message"] == message
    assert worker_pool == []


async def test_oversized_body_is_refused_before_it_is_all_read(start: Start) -> None:
    client = await start(max_body_bytes="4096")
    sent = 0

    async def endless() -> AsyncIterator[bytes]:
        nonlocal sent
        yield b'{"prompt": "'
        while sent < 64 * 2**20:  # the gateway must answer long before this
            sent += 65536
            yield b"x" * 65536

    status, body, _ = await post(client, "/v1/completions", endless())
    assert status == 413
    assert body["error"]["code"] == "request_too_large"
    assert sent < 64 * 2**20


# ---- fuzz -----------------------------------------------------------------------------------------

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)  # fmt: skip
_json = st.recursive(_scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4), max_leaves=10)  # noqa: E501


def _around(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly plausible values, sometimes anything at all."""
    return st.one_of(valid, valid, valid, _json)


_token_ids = st.lists(st.integers(-2, 50_000), min_size=0, max_size=6)
_common = {
    "model": _around(st.sampled_from([MODEL, None, "gpt-4"])),
    "max_tokens": _around(st.integers(-2, 9000)),
    "temperature": _around(st.floats(-1, 3)),
    "top_p": _around(st.floats(-0.5, 1.5)),
    "top_k": _around(st.integers(-3, 100)),
    "min_p": _around(st.floats(-0.5, 1.5)),
    "n": _around(st.integers(-1, 20)),
    "seed": _around(st.integers(-(2**64), 2**64)),
    "stop": _around(st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=20))),
    "stop_token_ids": _around(_token_ids),
    "presence_penalty": _around(st.floats(-3, 3)),
    "frequency_penalty": _around(st.floats(-3, 3)),
    "repetition_penalty": _around(st.floats(-1, 3)),
    "min_tokens": _around(st.integers(-1, 40)),
    "stream": _around(st.booleans()),
    "stream_options": _around(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "ignore_eos": _around(st.booleans()),
    "logit_bias": _around(st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)),
}
_prompt = st.one_of(
    st.text(max_size=30), st.lists(st.text(max_size=10), max_size=3), _token_ids, st.lists(_token_ids, max_size=3)
)
_message = st.fixed_dictionaries(
    {"role": _around(st.sampled_from(["system", "user", "assistant", "developer", "tool", "bot"]))},
    optional={"content": _around(st.one_of(st.text(max_size=20), st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=8)}),
        max_size=2)))},
)  # fmt: skip
_completion = st.fixed_dictionaries(
    {}, optional={**_common, "prompt": _around(_prompt), "logprobs": _around(st.integers(-1, 25)),
                  "echo": _around(st.booleans()), "best_of": _around(st.integers(0, 3))},
)  # fmt: skip
_chat = st.fixed_dictionaries(
    {}, optional={**_common, "messages": _around(st.lists(_message, max_size=3)),
                  "logprobs": _around(st.booleans()), "top_logprobs": _around(st.integers(-1, 25)),
                  "max_completion_tokens": _around(st.integers(-1, 9000))},
)  # fmt: skip
_raw = st.one_of(st.binary(max_size=40), st.text(max_size=40).map(str.encode))
_request = st.one_of(
    st.tuples(st.just("/v1/completions"), _completion), st.tuples(st.just("/v1/completions"), _completion),
    st.tuples(st.just("/v1/chat/completions"), _chat), st.tuples(st.just("/v1/chat/completions"), _chat),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]), _raw),
    st.tuples(st.just("/tokenize"), st.fixed_dictionaries({}, optional={"prompt": _around(_prompt),
                                                                        "messages": _around(st.lists(_message))})),
    st.tuples(st.just("/detokenize"), st.fixed_dictionaries({}, optional={"tokens": _around(_token_ids)})),
)  # fmt: skip


def generate_requests(num: int) -> list[tuple[str, bytes]]:
    made: list[tuple[str, bytes]] = []

    @settings(max_examples=num, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(_request)
    def collect(request: tuple[str, Any]) -> None:
        path, body = request
        made.append((path, body if isinstance(body, bytes) else json.dumps(body).encode()))

    collect()
    return made


@pytest.fixture(scope="module")
def fuzz_requests() -> list[tuple[str, bytes]]:
    # generated before any event loop runs: hypothesis takes seconds, which would freeze the
    # gateway under test for that long
    return generate_requests(NUM_FUZZ_REQUESTS)


async def test_fuzzed_requests_never_get_a_5xx(
    fuzz_requests: list[tuple[str, bytes]], start: Start, worker_pool: list[GenerateRequest]
) -> None:
    client: TestClient = await start(request_timeout_s="60")
    requests = fuzz_requests
    assert len(requests) >= 1000
    statuses: dict[int, int] = {}
    limit = asyncio.Semaphore(CONCURRENCY)

    async def send(path: str, body: bytes) -> None:
        async with limit, client.post(path, data=body, headers={"Content-Type": "application/json"}) as resp:
            raw = await resp.read()
        statuses[resp.status] = statuses.get(resp.status, 0) + 1
        if resp.status >= 400:
            assert resp.status < 500, (path, body, resp.status, raw[:300])
            assert_openai_error(resp.status, json.loads(raw))
        else:
            assert resp.status == 200, (path, body, resp.status, raw[:300])
            assert b'"error"' not in raw, (path, body, raw[:300])

    await asyncio.gather(*(send(path, body) for path, body in requests))
    assert not [s for s in statuses if s >= 500], statuses
    assert statuses.get(200, 0) > 0 and sum(n for s, n in statuses.items() if s >= 400) > 0, statuses
