"""KV through NIXL (UCX over TCP on loopback) between workers that cannot see each other's tmpfs
(each role has a directory of its own: two hosts, simulated), with real processes, the real
model and Redis:

- greedy tokens equal the single engine's, and Redis (and the data port) carried no KV bytes;
- a prefill worker SIGKILLed while the decode worker reads its blocks: the read fails or runs
  out its deadline, the reservation is freed, and another prefill worker re-runs the request;
- a decode worker SIGKILLed mid-read: the gateway re-runs the request, and the prefill worker
  releases the blocks once the read's deadline passed.

Every request ends with the fault-free text, and nothing is left held or pending.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from openai import OpenAI

from services.kv_transfer.nixl import nixl_api
from services.launcher import Stack
from shared.model.loader import LoadedModel
from tests.services.stack_client import FakeGateway
from tests.services.stacks import FAST_HEARTBEAT, prefill_metric, running_stack
from tests.services.test_fault_handoff import PROMPT, until_killed
from tests.services.test_fault_handoff import expected  # noqa: F401  (a module fixture)
from tests.services.test_fault_real import greedy
from tests.services.test_faults import assert_clean, live_decode, until
from tests.services.test_kv_tcp_stack import (
    FAILURES,
    HANDOFF_TIMEOUT_S,
    assert_greedy_tokens_only_through,
    assert_replaced_after_dying_mid_transfer,
)

pytestmark = [
    pytest.mark.slow, pytest.mark.timeout(900),
    pytest.mark.skipif(nixl_api() is None, reason="NIXL is not installed (pip install -e '.[nixl]')"),
]

FAULTY = "tests.services.faulty_workers"
# over TCP on loopback: on one host UCX would otherwise pick shared memory, which two hosts do not share
UCX_ON_LOOPBACK = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {
        "LLMD_KV_CACHE__MEMORY_BYTES": str(32 * 2**20), **FAST_HEARTBEAT, **UCX_ON_LOOPBACK,
        "LLMD_WORKER__HANDOFF_TIMEOUT_S": str(HANDOFF_TIMEOUT_S), "LLMD_WORKER__KV_TRANSPORT": "nixl",
    }  # fmt: skip
    apart = {role: {"LLMD_WORKER__KV_SHM_DIR": str(tmp_path_factory.mktemp(f"shm-{role}"))} for role in ("prefill", "decode")}
    with running_stack("kv-nixl", env, num_prefill=1, num_decode=1, role_env=apart) as stack:
        yield stack


async def test_greedy_tokens_through_nixl_equal_the_single_engine(
    stack: Stack, gateway: FakeGateway, loaded_model: LoadedModel, rds: redis.Redis,
) -> None:
    workers = [*await gateway.workers("prefill"), *await gateway.workers("decode")]
    assert all(s.kv_nixl and s.kv_transports == ["nixl", "redis"] for s in workers)
    await assert_greedy_tokens_only_through("nixl", stack, gateway, loaded_model, rds)


def test_a_prefill_worker_killed_mid_read_leaves_nothing_held_and_is_replaced(
    stack: Stack, client: OpenAI, model: str, expected: str, rds: redis.Redis,
) -> None:
    assert_replaced_after_dying_mid_transfer("prefill-dies-mid-read", stack, client, model, expected, rds)


def test_a_decode_worker_killed_mid_read_has_the_request_run_again(
    stack: Stack, client: OpenAI, model: str, expected: str, rds: redis.Redis,
) -> None:
    faulty = stack.add_worker("decode", module=[FAULTY, "decode-dies-mid-read"])
    failures = sum(prefill_metric(rds, stack.keys, FAILURES).values())

    assert greedy(client, model, PROMPT) == expected

    until_killed(stack, faulty)
    # the prefill worker held its blocks until the read's deadline, then let them go
    until(lambda: sum(prefill_metric(rds, stack.keys, FAILURES).values()) == failures + 1,
          "the prefill worker to give up on the dead reader")
    until(lambda: faulty not in [s.worker_id for s in live_decode(rds, stack.keys)], f"{faulty}'s heartbeat to lapse")
    assert_clean(rds, stack.keys)
    assert stack.exited() == {}
