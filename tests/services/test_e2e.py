"""The whole stack (real Redis, gateway, 2 prefill and 2 decode worker processes, the real model)
through the official `openai` client, checked against the offline engine (`LLM`) on the same
prompts: one stack for the module, requests sent one at a time unless concurrency is the point."""

from __future__ import annotations

import asyncio
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from openai import AsyncOpenAI, OpenAI

from services.gateway.openai_responses import token_text
from services.launcher import Stack
from shared.engine.llm import LLM, CompletionOutput
from shared.engine.sampling_params import SamplingParams
from shared.protocol import WorkerStatus
from shared.settings import (
    EngineSettings,
    KVCacheSettings,
    ModelSettings,
    RedisSettings,
)
from shared.streams import Bus
from tests.deploy.dashboard import missing_series
from tests.services.stacks import metric_value, running_stack, scrape, worker_tokens

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
KV_BYTES = 64 * 2**20  # per worker; ~90 blocks of 16 tokens, plenty for these prompts
# Every comparison with the offline engine uses a prompt neither side has cached: a prefix-cache hit
# takes another numeric path (logprobs move by up to ~0.2), and which prefill worker holds the cache
# is up to the stack. Prompts under one KV block (16 tokens) are never cached; chats get their own
# system message, so their first block differs from every other chat's.
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def chat(system: str, user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]
WORKERS = ("prefill-0", "prefill-1", "decode-0", "decode-1")


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with running_stack("e2e", {"LLMD_KV_CACHE__MEMORY_BYTES": str(KV_BYTES)}, num_prefill=2, num_decode=2) as stack:
        yield stack


@pytest.fixture(scope="module")
def llm() -> LLM:
    # float32 and one torch thread, as each worker of the stack runs with on two cores: same kernels,
    # same numbers (bfloat16 rounding would make near-ties flip between batch compositions)
    return LLM(settings=EngineSettings(model=ModelSettings(dtype="float32"),
                                       kv_cache=KVCacheSettings(memory_bytes=KV_BYTES), torch_threads=1))


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
        yield client


def offline(llm: LLM, prompt: str | list[int], **params: object) -> CompletionOutput:
    return llm.generate([prompt], SamplingParams(**params))[0]  # type: ignore[arg-type]


def token_texts(llm: LLM, token_ids: list[int]) -> list[str]:
    return [token_text(llm.tokenizer.token_bytes(token_id)) for token_id in token_ids]


# ---- greedy parity with the offline engine -------------------------------------------------------


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completion_is_token_for_token_the_offline_engines(
    client: OpenAI, model: str, llm: LLM, prompt: str
) -> None:
    expected = offline(llm, prompt, temperature=0, max_tokens=12, logprobs=0)
    completion = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, logprobs=0)
    choice = completion.choices[0]
    assert choice.logprobs is not None
    assert choice.logprobs.tokens == token_texts(llm, expected.token_ids)
    assert (choice.text, choice.finish_reason) == (expected.text, expected.finish_reason)
    assert choice.logprobs.token_logprobs == pytest.approx(expected.logprobs, abs=1e-4)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_streamed_completion_with_usage_equals_the_offline_engine(
    client: OpenAI, model: str, llm: LLM, prompt: str
) -> None:
    expected = offline(llm, prompt, temperature=0, max_tokens=12)
    chunks = list(client.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True},
    ))  # fmt: skip
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == expected.text
    finish_reasons = [c.choices[0].finish_reason for c in text_chunks]
    assert finish_reasons == [None] * (len(text_chunks) - 1) + [expected.finish_reason]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens) == (
        len(expected.prompt_token_ids), len(expected.token_ids)
    )


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_chat_equals_the_offline_engine_on_the_templated_prompt(
    client: OpenAI, model: str, llm: LLM, stream: bool
) -> None:
    messages = chat("Answer briefly." if stream else "You are a terse tutor.", "What is 2+2?")
    expected = offline(llm, llm.tokenizer.apply_chat_template(messages), temperature=0, max_tokens=24)
    kwargs = {"model": model, "messages": messages, "max_tokens": 24, "temperature": 0}
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))  # type: ignore[call-overload]
        first = chunks[0].choices[0].delta  # it waits for the first token, so it carries that token's text
        assert first.role == "assistant" and first.content and expected.text.startswith(first.content)
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish_reason = chunks[-1].choices[0].finish_reason
    else:
        completion = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
        text, finish_reason = completion.choices[0].message.content, completion.choices[0].finish_reason
        assert completion.usage is not None and completion.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert (text, finish_reason) == (expected.text, expected.finish_reason)


# ---- sampling parameters -------------------------------------------------------------------------


def test_seeded_sampling_repeats_and_equals_the_offline_engine_per_sample(client: OpenAI, model: str, llm: LLM) -> None:
    prompt = "Once upon a time"
    first = client.completions.create(model=model, prompt=prompt, seed=1234, temperature=0.8, top_p=0.95, max_tokens=12)
    again = client.completions.create(
        model=model, prompt=prompt, seed=1234, n=2, temperature=0.8, top_p=0.95, max_tokens=12
    )
    expected = [
        offline(llm, prompt, seed=seed, temperature=0.8, top_p=0.95, max_tokens=12).text for seed in (1234, 1235)
    ]
    assert first.choices[0].text == expected[0]
    assert [c.text for c in again.choices] == expected  # sample i runs with seed + i
    assert expected[0] != expected[1]


def test_stop_string_ends_the_text_before_it(client: OpenAI, model: str, llm: LLM) -> None:
    unstopped = offline(llm, PROMPTS[0], temperature=0, max_tokens=12).text
    stop = unstopped.split()[2]  # a word from the middle of the greedy answer
    expected = offline(llm, PROMPTS[0], temperature=0, max_tokens=12, stop=[stop])
    assert expected.finish_reason == "stop" and stop not in expected.text
    completion = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop])
    streamed = client.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop], stream=True
    )
    assert (completion.choices[0].text, completion.choices[0].finish_reason) == (expected.text, "stop")
    assert "".join(c.choices[0].text for c in streamed) == expected.text


def test_max_tokens_ends_with_length(client: OpenAI, model: str) -> None:
    completion = client.completions.create(
        model=model, prompt="Count: 1, 2, 3,", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 5


def test_chat_logprobs_name_each_token_with_its_top_alternatives(client: OpenAI, model: str, llm: LLM) -> None:
    messages = chat("Reply with one word.", "Name a primary color.")
    expected = offline(llm, llm.tokenizer.apply_chat_template(messages), temperature=0, max_tokens=6, logprobs=2)
    completion = client.chat.completions.create(
        model=model, messages=messages, max_tokens=6, temperature=0,  # type: ignore[arg-type]
        logprobs=True, top_logprobs=2,
    )
    content = completion.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    assert [t.token for t in content] == token_texts(llm, expected.token_ids)
    assert [t.logprob for t in content] == pytest.approx(expected.logprobs, abs=1e-3)
    # greedy: the best alternative is the sampled token; the runner-up may be a near tie, so compare values
    assert [t.top_logprobs[0].token for t in content] == [t.token for t in content]
    assert [[a.logprob for a in t.top_logprobs] for t in content] == [
        pytest.approx([logprob for _, logprob in top], abs=1e-3) for top in expected.top_logprobs
    ]


# ---- the stack at work ---------------------------------------------------------------------------


async def test_32_concurrent_requests_complete_on_every_worker(stack: Stack, model: str) -> None:
    async with AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=300) as aclient:
        completions = await asyncio.gather(*(
            aclient.completions.create(
                model=model, prompt=f"Request number {i}:", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
            )
            for i in range(32)
        ))  # fmt: skip
    endings = [(c.choices[0].finish_reason, c.usage.completion_tokens if c.usage else None) for c in completions]
    assert endings == [("length", 8)] * 32
    served = worker_tokens(stack)
    assert all(served.get(worker_id, 0) > 0 for worker_id in WORKERS), served


def test_the_gateway_exports_each_pools_load_and_recommended_workers(stack: Stack) -> None:
    """For an autoscaler (services/pool_planner): a pool's load shows once half a window (5 s by
    default) of its heartbeats is in; the recommendation is there from the first look."""
    series = r'^llmd_planner_(load|recommended_workers)\{[^}]*role="(\w+)"[^}]*\} (\S+)$'
    deadline = time.monotonic() + 60
    while True:
        found = {(name, role): float(v) for name, role, v in re.findall(series, scrape(stack.base_url), re.MULTILINE)}
        if len(found) == 4 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert set(found) == {(name, role) for name in ("load", "recommended_workers") for role in ("prefill", "decode")}
    assert all(found[("load", role)] >= 0 for role in ("prefill", "decode"))
    assert all(found[("recommended_workers", role)] >= 1 for role in ("prefill", "decode"))


def test_a_shared_prefix_is_reported_as_cached_prompt_tokens(client: OpenAI, model: str) -> None:
    # 4 blocks of 16 tokens shared, then a different tail; unique to this run so nothing else cached it.
    # Two prefill workers: of three requests in a row at least two meet on one worker.
    start = 1000 + uuid.uuid4().int % 40000
    prefix = list(range(start, start + 64))
    cached = []
    for tail in range(3):
        completion = client.completions.create(model=model, prompt=prefix + [500 + tail] * 8, max_tokens=1)
        assert completion.usage is not None and completion.usage.prompt_tokens_details is not None
        cached.append(completion.usage.prompt_tokens_details.cached_tokens)
    assert cached[0] == 0
    assert set(cached[1:]) <= {0, 64} and 64 in cached[1:]


def test_a_client_that_disconnects_frees_its_sequence_on_the_decode_worker(
    client: OpenAI, model: str, stack: Stack
) -> None:
    # 1200 tokens take minutes on a CPU: the request can only leave the decode worker early if cancelled
    stream = client.completions.create(
        model=model, prompt="Tell me a long story.", max_tokens=1200, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    until_decode_load(stack, lambda running: running == 1, "the request to run on a decode worker")
    stream.close()
    until_decode_load(stack, lambda running: running == 0, "the decode workers to drop the request")
    assert metric_value(stack, "llmd_cancellations_total", 'reason="client_disconnected"') == 1


def until_decode_load(stack: Stack, condition: Callable[[int], bool], what: str, timeout_s: float = 30.0) -> None:
    """Waits until the decode workers' heartbeats report a total of running sequences that meets `condition`."""
    deadline = time.monotonic() + timeout_s
    while not condition(sum(s.num_running for s in worker_statuses(stack, "decode"))):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def worker_statuses(stack: Stack, role: str) -> list[WorkerStatus]:
    async def read() -> list[WorkerStatus]:
        bus = Bus(RedisSettings(url=REDIS_URL, namespace=stack.namespace))
        try:
            return await bus.live_workers(role)
        finally:
            await bus.close()

    return asyncio.run(read())


# ---- what operators see --------------------------------------------------------------------------


def test_every_series_the_grafana_dashboard_queries_is_exported(client: OpenAI, model: str, stack: Stack) -> None:
    # A streamed request times tokens at the gateway and a handoff on a prefill worker; the stop
    # strings end the second at its first token while decode still runs it, so the gateway cancels
    # it there (llmd_cancellations_total has no series before a first cancellation).
    list(client.completions.create(model=model, prompt="Hello there", max_tokens=4, stream=True))
    stopped = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=16, stop=[" ", "\n", "e", "a"],
        extra_body={"ignore_eos": True},
    )
    assert stopped.choices[0].finish_reason == "stop"
    workers = {role: worker_statuses(stack, role) for role in ("prefill", "decode")}
    assert {role: len(statuses) for role, statuses in workers.items()} == {"prefill": 2, "decode": 2}
    expositions = {
        "gateway": [scrape(stack.base_url)],
        **{role: [scrape(f"http://127.0.0.1:{s.health_port}") for s in statuses] for role, statuses in workers.items()},
    }
    assert missing_series(expositions) == []
