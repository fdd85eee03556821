"""Faults among workers on a real stack (gateway, 1 prefill, 2 decode workers, real model): a decode
worker SIGKILLed mid-generation has its requests migrated by the gateway, and the client's stream
goes on with no token lost or doubled; a client that leaves frees its blocks everywhere."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import redis
from openai import OpenAI

from services.launcher import Stack
from shared.protocol import WorkerStatus
from shared.streams import INBOX_GROUP, PREFILL_GROUP, Keys
from tests.services.stacks import (
    BOUND_S,
    FAST_HEARTBEAT,
    HolderKiller,
    live_workers,
    metric_value,
    running_stack,
    streamed_text,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

KV_BYTES = 32 * 2**20
PROMPT = "Once upon a time, in a village by the sea,"
NUM_TOKENS = 60


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    env = {"LLMD_KV_CACHE__MEMORY_BYTES": str(KV_BYTES), **FAST_HEARTBEAT}
    with running_stack("faults", env, num_prefill=1, num_decode=2) as stack:
        yield stack


def live_decode(rds: redis.Redis, keys: Keys) -> list[WorkerStatus]:
    return live_workers(rds, keys, "decode")


def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not condition():
        assert time.monotonic() < deadline, f"gave up after {BOUND_S:.0f}s waiting for {what}"
        time.sleep(0.05)


def requests_streams(rds: redis.Redis, keys: Keys) -> list[str]:
    """The shared requests stream and those of the prefill workers a gateway may route to."""
    return [keys.requests, *(keys.routed_requests(w.decode()) for w in sorted(rds.smembers(keys.routed_workers)))]


def unacknowledged(rds: redis.Redis, stream: str) -> int:
    try:
        return rds.xpending(stream, PREFILL_GROUP)["pending"]
    except redis.ResponseError as error:
        # a reclaimer deletes a gone worker's drained stream, group and all, at any moment
        if "NOGROUP" in str(error):
            return 0
        raise


def assert_clean(rds: redis.Redis, keys: Keys) -> None:
    """Every live decode pool empty, and no stream entry left unacknowledged."""
    until(lambda: all(s.free_blocks == s.total_blocks and s.num_running == 0 for s in live_decode(rds, keys)),
          "every decode worker to free its blocks")
    for stream in requests_streams(rds, keys):
        # a worker answers a failed request before it acknowledges it (an answer must not be lost
        # to a crash between the two), so the client may hear of it a moment before the ack
        until(lambda: unacknowledged(rds, stream) == 0, f"every entry of {stream} to be acknowledged")
    for status in live_decode(rds, keys):
        until(lambda: rds.xpending(status.inbox, INBOX_GROUP)["pending"] == 0, f"{status.worker_id}'s inbox")


def seeded(client: OpenAI, model: str, on_token: Callable[[int], None] = lambda n: None) -> str:
    return streamed_text(client, model, PROMPT, NUM_TOKENS, on_token, temperature=1.0, seed=11)


def test_a_decode_worker_killed_mid_generation_has_its_request_migrated_seamlessly(
    client: OpenAI, model: str, stack: Stack, rds: redis.Redis
) -> None:
    keys = stack.keys
    expected = seeded(client, model)
    assert_clean(rds, keys)  # heartbeats lag up to an interval: the first run's holder must read idle first
    kill_holder = HolderKiller(stack, rds, "decode")

    text = seeded(client, model, kill_holder)

    assert len(kill_holder.victims) == 1
    assert text == expected  # no token lost, none doubled, and the seed holds across the take-over
    assert [s.worker_id for s in live_decode(rds, keys)] != kill_holder.victims
    assert metric_value(stack, "llmd_migrations_total", "model_name") == 1
    assert_clean(rds, keys)
    stack.add_worker("decode")  # back to two for the next test


def test_a_client_that_leaves_mid_stream_frees_its_blocks(
    client: OpenAI, model: str, stack: Stack, rds: redis.Redis
) -> None:
    stream = client.completions.create(
        model=model, prompt="Tell me a long story.", max_tokens=1200, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    until(lambda: sum(s.num_running for s in live_decode(rds, stack.keys)) == 1, "the request to reach decode")
    stream.close()
    assert_clean(rds, stack.keys)
