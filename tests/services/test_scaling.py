"""Scaling a running stack: workers added while requests stream take work, a decode worker removed
with SIGTERM drains, and every request completes; the launcher's stdin commands do the same."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import redis
from openai import OpenAI

from services.launcher import Stack
from services.launcher.cli import apply_command
from shared.streams import PREFILL_GROUP
from tests.services.stacks import BOUND_S, FAST_HEARTBEAT, openai_client, running_stack, worker_tokens
from tests.services.test_faults import assert_clean, live_decode, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NUM_REQUESTS = 24


@pytest.fixture
def stack() -> Iterator[Stack]:
    with running_stack("scaling", {"LLMD_KV_CACHE__MEMORY_BYTES": str(32 * 2**20), **FAST_HEARTBEAT}) as stack:
        yield stack


def test_workers_added_and_removed_under_load_serve_and_lose_nothing(stack: Stack) -> None:
    rds = redis.Redis.from_url(stack.redis_url or "")
    results: dict[int, tuple[int, str | None] | BaseException] = {}

    def run(client: OpenAI, model: str, i: int) -> None:
        try:
            completion = client.completions.create(
                model=model, prompt=f"Request {i}: write a short poem about the number {i}.", max_tokens=12,
                temperature=0.0, extra_body={"ignore_eos": True},
            )
            results[i] = (completion.usage.completion_tokens if completion.usage else -1,
                          completion.choices[0].finish_reason)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            results[i] = e

    with openai_client(stack) as client:
        model = client.models.list().data[0].id
        sema = threading.Semaphore(4)  # a steady stream, not one burst

        def paced(i: int) -> None:
            with sema:
                run(client, model, i)

        threads = [threading.Thread(target=paced, args=(i,)) for i in range(NUM_REQUESTS)]
        for t in threads[: NUM_REQUESTS // 2]:
            t.start()
        # scale up while the first half runs (workers must start on this thread: they die with it)
        assert apply_command(stack, "+prefill") == "started prefill-1"
        assert apply_command(stack, "+decode") == "started decode-1"
        stack.wait_registered("prefill-1")
        stack.wait_registered("decode-1")
        for t in threads[NUM_REQUESTS // 2:]:
            t.start()
        until(lambda: {"prefill-1", "decode-1"} <= {w for w, n in worker_tokens(stack).items() if n > 0}
              or all(not t.is_alive() for t in threads), "the added workers to take work")
        # scale down: the newest decode worker drains while requests still run
        assert apply_command(stack, "-decode") == "draining decode-1 (SIGTERM)"
        for t in threads:
            t.join(BOUND_S)

    served = worker_tokens(stack)
    assert served.get("prefill-1", 0) > 0 and served.get("decode-1", 0) > 0, served
    assert results == {i: (12, "length") for i in range(NUM_REQUESTS)}
    until(lambda: "decode-1" not in stack.exited() and "decode-1" not in stack.children, "decode-1 to exit")
    assert rds.hget(stack.keys.workers("decode"), "decode-1") is None  # deregistered, not dead
    assert apply_command(stack, "-decode") == "not removing the last decode worker"
    assert [s.worker_id for s in live_decode(rds, stack.keys)] == ["decode-0"]
    assert_clean(rds, stack.keys)
    assert rds.xpending(stack.keys.requests, PREFILL_GROUP)["pending"] == 0
    assert apply_command(stack, "*decode").startswith("unknown command")
    rds.close()
