"""KV over the data port between workers that cannot see each other's tmpfs (each role has a
directory of its own: two hosts, simulated), with real processes, the real model and Redis:

- greedy tokens equal the single engine's, and Redis carried no KV bytes; a long prompt's KV goes
  layer by layer while it prefills;
- a prefill worker SIGKILLed mid-transfer: the decode worker frees the reservation at once and
  another prefill worker re-runs the request;
- a decode worker SIGKILLed mid-transfer: the prefill worker offers the request to another one;
- a transfer that stalls: the decode worker gives up within handoff_timeout_s, the prefill
  worker offers the request elsewhere;
- either worker SIGKILLed mid-way through a layer-by-layer stream: the same;
- a peer with a wrong token, sender or sizes, or from an address no heartbeat names, writes nothing.

Every request ends with the fault-free text, and nothing is left held or pending.
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import pytest
import redis
from openai import OpenAI

from services.kv_transfer import TransferHeader
from services.kv_transfer.tcp import recv_frame, send_frame
from services.launcher import Stack
from shared.engine.sampling_params import SamplingParams
from shared.model.loader import LoadedModel
from shared.protocol import HandoffAccept, HandoffOffer
from tests.services.stack_client import FakeGateway, offline_greedy, prompt
from tests.services.stacks import BOUND_S, FAST_HEARTBEAT, kv_bytes_by_transport, prefill_metric, running_stack
from tests.services.test_fault_handoff import PROMPT, decode_pool_empty, until_killed
from tests.services.test_fault_handoff import expected  # noqa: F401  (a module fixture)
from tests.services.test_fault_real import greedy
from tests.services.test_faults import assert_clean, live_decode, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

FAULTY = "tests.services.faulty_workers"
HANDOFF_TIMEOUT_S = 3  # above the heartbeat TTL, as in test_fault_handoff.py
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
FAILURES = "llmd_handoff_failures_total"
STREAMED = "llmd_handoffs_streamed_total"
STREAM_MIN_TOKENS = 200  # of the prompts below, those of 300 tokens stream; PROMPT does not


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {
        "LLMD_KV_CACHE__MEMORY_BYTES": str(32 * 2**20), **FAST_HEARTBEAT,
        "LLMD_WORKER__HANDOFF_TIMEOUT_S": str(HANDOFF_TIMEOUT_S), "LLMD_WORKER__KV_TRANSPORT": "tcp",  # not NIXL
        "LLMD_WORKER__KV_STREAM_MIN_TOKENS": str(STREAM_MIN_TOKENS),
    }  # fmt: skip
    apart = {role: {"LLMD_WORKER__KV_SHM_DIR": str(tmp_path_factory.mktemp(f"shm-{role}"))} for role in ("prefill", "decode")}
    with running_stack("kv-tcp", env, num_prefill=1, num_decode=2, role_env=apart) as stack:
        yield stack


def by_transport(rds: redis.Redis, stack: Stack) -> dict[str, float]:
    return kv_bytes_by_transport(rds, stack.keys)


async def assert_greedy_tokens_only_through(
    transport: str, stack: Stack, gateway: FakeGateway, loaded_model: LoadedModel, rds: redis.Redis,
) -> None:
    """Prompts of 1-19 blocks end with the single engine's greedy tokens, every KV byte through `transport`."""
    prompts = [prompt(7, 0), prompt(40, 1), prompt(300, 2)]
    for i, p in enumerate(prompts):
        await gateway.submit(f"{transport}-{i}", p, GREEDY)

    replies = await gateway.finish(*(f"{transport}-{i}" for i in range(len(prompts))))

    assert [r.token_ids for r in replies.values()] == offline_greedy(loaded_model, prompts, GREEDY)
    moved = by_transport(rds, stack)
    assert moved.pop(transport) > 0 and set(moved.values()) == {0}
    await gateway.until_all_blocks_free()


async def test_greedy_tokens_over_the_data_port_equal_the_single_engine(
    stack: Stack, gateway: FakeGateway, loaded_model: LoadedModel, rds: redis.Redis,
) -> None:
    statuses = await gateway.workers("decode")
    assert all(s.kv_port and s.kv_host == "127.0.0.1" and s.kv_transports == ["tcp", "redis"] for s in statuses)
    streamed = sum(prefill_metric(rds, stack.keys, STREAMED).values())
    await assert_greedy_tokens_only_through("tcp", stack, gateway, loaded_model, rds)
    assert sum(prefill_metric(rds, stack.keys, STREAMED).values()) == streamed + 1  # the 300-token prompt


def normal_prefill_workers(stack: Stack) -> list[str]:
    return [n for n, c in stack.children.items() if c.role == "prefill"]


def only(stack: Stack, faulty: str) -> None:
    """Drain every other prefill worker, so that the faulty one reads the next request."""
    for name in [n for n in normal_prefill_workers(stack) if n != faulty]:
        stack.drain_worker(name)
        until(lambda: stack.exited() == {} and name not in stack.children, f"{name} to drain and exit")


def test_a_prefill_worker_killed_mid_transfer_leaves_nothing_held_and_is_replaced(
    stack: Stack, client: OpenAI, model: str, expected: str, rds: redis.Redis,
) -> None:
    assert_replaced_after_dying_mid_transfer("prefill-dies-mid-transfer", stack, client, model, expected, rds)


def assert_replaced_after_dying_mid_transfer(
    fault: str, stack: Stack, client: OpenAI, model: str, expected: str, rds: redis.Redis,
) -> None:
    """A prefill worker with `fault` (tests/services/faulty_workers.py) takes a request and dies
    mid-transfer: the decode worker frees its blocks, another prefill worker re-runs the request."""
    faulty = stack.add_worker("prefill", module=[FAULTY, fault])
    only(stack, faulty)

    with ThreadPoolExecutor(1) as pool:
        text = pool.submit(greedy, client, model, PROMPT)
        until_killed(stack, faulty)
        until(lambda: decode_pool_empty(rds, stack), "the decode worker to free the half-written blocks")
        stack.add_worker("prefill")  # claims the dead worker's pending request and runs it again
        assert text.result(BOUND_S) == expected

    assert_clean(rds, stack.keys)
    assert stack.exited() == {}


def test_a_decode_worker_killed_mid_transfer_has_the_request_offered_to_another(
    stack: Stack, client: OpenAI, model: str, expected: str, rds: redis.Redis,
) -> None:
    faulty = stack.add_worker("decode", module=[FAULTY, "decode-dies-mid-transfer"])
    failures = prefill_metric(rds, stack.keys, FAILURES)

    assert greedy(client, model, PROMPT) == expected

    assert sum(prefill_metric(rds, stack.keys, FAILURES).values()) == sum(failures.values()) + 1

    until_killed(stack, faulty)
    until(lambda: faulty not in [s.worker_id for s in live_decode(rds, stack.keys)],
          f"{faulty}'s heartbeat to lapse")
    assert_clean(rds, stack.keys)
    assert stack.exited() == {}


def test_a_stalled_transfer_is_given_up_within_the_handoff_timeout_and_offered_elsewhere(
    stack: Stack, client: OpenAI, model: str, expected: str, rds: redis.Redis,
) -> None:
    faulty = stack.add_worker("prefill", module=[FAULTY, "prefill-stalls-mid-transfer"])
    only(stack, faulty)

    assert greedy(client, model, PROMPT) == expected

    assert prefill_metric(rds, stack.keys, FAILURES) == {faulty: 1}  # the stalled transfer, offered elsewhere

    assert_clean(rds, stack.keys)
    assert stack.exited() == {}
    stack.add_worker("prefill")
    only(stack, normal_prefill_workers(stack)[-1])


async def test_a_prefill_worker_killed_mid_stream_leaves_nothing_held_and_is_replaced(
    stack: Stack, gateway: FakeGateway, loaded_model: LoadedModel, rds: redis.Redis,
) -> None:
    faulty = stack.add_worker("prefill", module=[FAULTY, "prefill-dies-mid-transfer"])
    await asyncio.to_thread(only, stack, faulty)
    streamed_prompt = prompt(300, 11)
    await gateway.submit("stream-prefill-dies", streamed_prompt, GREEDY)

    await asyncio.to_thread(until_killed, stack, faulty)  # half of the layers sent
    await asyncio.to_thread(until, lambda: decode_pool_empty(rds, stack), "the decode worker to free the blocks")
    stack.add_worker("prefill")  # claims the dead worker's pending request and runs it again

    reply = (await gateway.finish("stream-prefill-dies"))["stream-prefill-dies"]
    assert reply.token_ids == offline_greedy(loaded_model, [streamed_prompt], GREEDY)[0]
    assert sum(prefill_metric(rds, stack.keys, STREAMED).values()) >= 1  # the new worker streamed it
    await gateway.until_all_blocks_free()
    assert_clean(rds, stack.keys)
    assert stack.exited() == {}


async def test_a_decode_worker_killed_mid_stream_has_the_request_offered_to_another(
    stack: Stack, gateway: FakeGateway, loaded_model: LoadedModel, rds: redis.Redis,
) -> None:
    faulty = stack.add_worker("decode", module=[FAULTY, "decode-dies-mid-transfer"])
    failures = sum(prefill_metric(rds, stack.keys, FAILURES).values())
    streamed_prompt = prompt(300, 12)

    await gateway.submit("stream-decode-dies", streamed_prompt, GREEDY)
    reply = (await gateway.finish("stream-decode-dies"))["stream-decode-dies"]

    assert reply.token_ids == offline_greedy(loaded_model, [streamed_prompt], GREEDY)[0]
    assert sum(prefill_metric(rds, stack.keys, FAILURES).values()) == failures + 1
    await asyncio.to_thread(until_killed, stack, faulty)
    await asyncio.to_thread(until, lambda: faulty not in [s.worker_id for s in live_decode(rds, stack.keys)],
                            f"{faulty}'s heartbeat to lapse")
    assert_clean(rds, stack.keys)
    assert stack.exited() == {}


def transfer(port: int, header: TransferHeader, source: str = "127.0.0.1") -> dict[str, object]:
    """Connect to a data port from `source` and announce a transfer; the receiver's answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0)) as sock:
        deadline = time.monotonic() + 10
        send_frame(sock, asdict(header), deadline)
        try:
            return recv_frame(sock, deadline)
        except Exception as e:  # noqa: BLE001  (closed without an answer)
            return {"closed": str(e)}


async def test_only_the_reservations_token_sender_and_sizes_from_a_known_address_get_in(
    stack: Stack, gateway: FakeGateway, rds: redis.Redis,
) -> None:
    decode = (await gateway.workers("decode"))[0]
    assert decode.kv_port is not None
    prefill_id = f"ghost-prefill-{uuid.uuid4().hex[:6]}"  # the test plays a prefill worker on 127.0.0.1
    offer = HandoffOffer(
        req_id="intruded", attempt=0, gateway_id=gateway.gateway_id, prefill_id=prefill_id,
        prompt_token_ids=list(range(100, 140)), output_token_ids=[42], output_logprobs=[], output_top_logprobs=[],
        params=GREEDY.to_dict(), seed=1, num_cached_tokens=0, num_blocks=3,
    )  # fmt: skip
    await gateway.bus.send(decode.inbox, offer)
    accept = await _accept_for(gateway, gateway.keys.inbox(prefill_id), "intruded")
    assert accept.needed_blocks == [0, 1, 2] and len(accept.kv_token) == 32
    size = 3 * 30 * 2 * 16 * 3 * 64 * 4  # [blocks, layers, K/V, block_size, kv_heads, head_dim] in float32
    right = TransferHeader(accept.kv_token, "intruded", 0, prefill_id, num_blocks=3, num_bytes=size)

    answers = await asyncio.gather(*(asyncio.to_thread(transfer, decode.kv_port, h) for h in (
        TransferHeader("0" * 32, "intruded", 0, prefill_id, 3, size),
        TransferHeader(accept.kv_token, "intruded", 0, "prefill-impostor", 3, size),
        TransferHeader(accept.kv_token, "intruded", 0, prefill_id, 3, size + 4),
        TransferHeader(accept.kv_token, "intruded", 1, prefill_id, 3, size),
    )))
    stranger = await asyncio.to_thread(transfer, decode.kv_port, right, source="127.0.0.2")

    assert [a.get("error", "") for a in answers] == [
        "wrong transfer token for 'intruded' from 127.0.0.1",
        f"the KV of 'intruded' is {prefill_id}'s to send, once",
        f"3 blocks of {size + 4} bytes announced for 'intruded'; its reservation holds 3 blocks of {size} bytes",
        "no reservation for 'intruded' attempt 1",
    ]
    assert "closed" in stranger  # not a live worker's address: refused before its header is read
    # nobody sent the KV: the reservation lapses as it would have, and the gateway hears why
    reply = (await gateway.finish("intruded"))["intruded"]
    assert reply.finish_reason == "abort" and "did not arrive" in (reply.error or "")
    await gateway.until_all_blocks_free()
    assert by_transport(rds, stack)["redis"] == 0


async def _accept_for(gateway: FakeGateway, stream: str, req_id: str) -> HandoffAccept:
    deadline = time.monotonic() + BOUND_S
    last = b"0"
    while time.monotonic() < deadline:
        for entry_id, msg in await gateway.bus.read(stream, last, 100, 200):
            last = entry_id
            if isinstance(msg, HandoffAccept) and msg.req_id == req_id:
                return msg
    raise AssertionError(f"no accept for {req_id} in {stream}")
