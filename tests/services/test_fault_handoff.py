"""A KV handoff whose peer dies, with real processes (gateway, workers, real model, real Redis): the
faulty workers of tests/services/faulty_workers.py SIGKILL themselves at the exact point.

- A prefill worker dies once a decode worker accepted its offer: the decode worker frees the
  reservation within handoff_timeout_s, and another prefill worker re-runs the request it left
  pending.
- A decode worker dies on KVReady, after accepting and before importing: the prefill worker named
  it as the holder, so the gateway migrates the request to the other decode worker.

Either way the client gets the fault-free greedy text, and nothing is left held or pending.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from openai import OpenAI

from services.launcher import Stack
from tests.services.stacks import BOUND_S, FAST_HEARTBEAT, running_stack
from tests.services.test_fault_real import greedy
from tests.services.test_faults import assert_clean, live_decode, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

FAULTY = "tests.services.faulty_workers"
PROMPT = "Once upon a time, in a village by the sea,"
# above the heartbeat TTL, so a reservation lapses only once its dead prefill worker's heartbeat has
HANDOFF_TIMEOUT_S = 3


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    env = {
        "LLMD_KV_CACHE__MEMORY_BYTES": str(32 * 2**20), **FAST_HEARTBEAT,
        "LLMD_WORKER__HANDOFF_TIMEOUT_S": str(HANDOFF_TIMEOUT_S),
    }  # fmt: skip
    with running_stack("handoff", env) as stack:
        yield stack


@pytest.fixture(scope="module")
def expected(client: OpenAI, model: str) -> str:
    """The fault-free run's text."""
    return greedy(client, model, PROMPT)


def until_killed(stack: Stack, name: str) -> None:
    """Wait for the faulty worker to kill itself, then forget it."""
    until(lambda: name in stack.exited(), f"{name} to reach its fault")
    assert stack.stop_worker(name) == -signal.SIGKILL


def decode_pool_empty(rds: redis.Redis, stack: Stack) -> bool:
    return all(s.free_blocks == s.total_blocks for s in live_decode(rds, stack.keys))


def test_a_prefill_worker_dying_after_its_offer_was_accepted_frees_the_reservation_and_is_replaced(
    stack: Stack, client: OpenAI, model: str, expected: str, rds: redis.Redis
) -> None:
    faulty = stack.add_worker("prefill", module=[FAULTY, "prefill-dies-after-accept"])
    for name in [n for n, c in stack.children.items() if c.role == "prefill" and n != faulty]:
        stack.drain_worker(name)  # the faulty worker must be the one to read the request
        until(lambda: stack.exited() == {} and name not in stack.children, f"{name} to drain and exit")

    with ThreadPoolExecutor(1) as pool:
        text = pool.submit(greedy, client, model, PROMPT)
        until_killed(stack, faulty)
        until(lambda: not decode_pool_empty(rds, stack), "the reservation to show in the decode heartbeat")
        # nobody will send the KV: the decode worker drops its reservation after handoff_timeout_s
        until(lambda: decode_pool_empty(rds, stack), "the decode worker to free the reservation")
        stack.add_worker("prefill")  # claims the dead worker's pending request and runs it again
        assert text.result(BOUND_S) == expected

    assert_clean(rds, stack.keys)
    assert stack.exited() == {}


def test_a_decode_worker_dying_before_it_takes_the_kv_has_the_request_migrated(
    stack: Stack, client: OpenAI, model: str, expected: str, rds: redis.Redis
) -> None:
    faulty = stack.add_worker("decode", module=[FAULTY, "decode-dies-on-kv-ready"])

    assert greedy(client, model, PROMPT) == expected

    until_killed(stack, faulty)
    assert faulty not in [s.worker_id for s in live_decode(rds, stack.keys)]
    assert_clean(rds, stack.keys)
    assert stack.exited() == {}
