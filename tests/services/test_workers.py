"""Prefill and decode workers as real subprocesses on a real Redis with the real model; the test
plays the gateway (and, for the handoff-timeout test, a prefill worker) through the protocol."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import torch

from services.kv_transfer import RedisKVConnector
from services.launcher import Stack, StackConfig
from shared.engine.sampling_params import SamplingParams
from shared.model.loader import LoadedModel
from shared.protocol import Cancel, HandoffAccept, HandoffOffer, KVReady, WorkerStatus
from tests.services.stack_client import REDIS_URL, FakeGateway, block_bytes, eventually, offline_greedy, prompt

pytestmark = pytest.mark.timeout(600)

NUM_BLOCKS = 96
HANDOFF_TIMEOUT_S = 3.0
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)

@pytest.fixture(scope="module")
def stack(loaded_model: LoadedModel) -> Iterator[Stack]:
    config = StackConfig(
        num_prefill=2, num_decode=2, gateway=False, redis_url=REDIS_URL, namespace=f"test-workers-{uuid.uuid4().hex[:8]}",
        dtype="float32",
        env={
            "LLMD_KV_CACHE__MEMORY_BYTES": str(NUM_BLOCKS * block_bytes(loaded_model)),
            "LLMD_WORKER__HEARTBEAT_INTERVAL_S": "0.2",
            "LLMD_WORKER__HEARTBEAT_TTL_S": "2",
            "LLMD_WORKER__HANDOFF_TIMEOUT_S": str(HANDOFF_TIMEOUT_S),
        },
    )
    with Stack(config) as stack:
        yield stack
        assert stack.exited() == {}, "a worker died during the tests"


async def test_tokens_equal_the_offline_engine_and_the_first_comes_from_prefill(
    gateway: FakeGateway, loaded_model: LoadedModel
) -> None:
    prompts = [prompt(5), prompt(16, 1), prompt(37, 2)]
    for i, p in enumerate(prompts):
        await gateway.submit(f"greedy-{i}", p, GREEDY)
    replies = await gateway.finish(*(f"greedy-{i}" for i in range(len(prompts))))

    expected = offline_greedy(loaded_model, prompts, GREEDY)
    for i, reply in enumerate(replies.values()):
        assert reply.token_ids == expected[i]
        assert reply.error is None
        first, *rest = reply.updates
        assert (first.index, first.worker_id.split("-")[0]) == (0, "prefill")
        assert {u.worker_id.split("-")[0] for u in rest} == ({"decode"} if rest else set())
        assert reply.finish_reason == ("length" if len(expected[i]) == GREEDY.max_tokens else "stop")
    await gateway.until_all_blocks_free()


async def test_sixteen_concurrent_requests_complete_and_every_worker_serves_some(
    gateway: FakeGateway, loaded_model: LoadedModel
) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [prompt(8 + 3 * i, 100 + i) for i in range(16)]
    await gateway.submit_many({f"many-{i}": p for i, p in enumerate(prompts)}, params)
    replies = await gateway.finish(*(f"many-{i}" for i in range(16)))

    expected = offline_greedy(loaded_model, prompts, params)
    assert [r.token_ids for r in replies.values()] == expected
    assert all(r.finish_reason == "length" for r in replies.values())
    served = {w for r in replies.values() for w in r.worker_ids}
    assert served == {"prefill-0", "prefill-1", "decode-0", "decode-1"}
    await gateway.until_all_blocks_free()


async def test_a_seeded_rerun_after_streamed_tokens_continues_with_the_same_tokens(gateway: FakeGateway) -> None:
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    await gateway.submit("first-run", prompt(20, 5), params, seed=99)
    first = (await gateway.finish("first-run"))["first-run"].token_ids

    await gateway.submit("re-run", prompt(20, 5), params, seed=99, attempt=1, output_token_ids=first[:3])
    rerun = (await gateway.finish("re-run"))["re-run"]

    assert [(u.index, u.attempt) for u in rerun.updates[:2]] == [(3, 1), (4, 1)]
    assert [rerun.tokens[i] for i in range(3, 8)] == first[3:]
    assert rerun.finish_reason == "length"


async def test_a_cancel_of_an_older_attempt_is_ignored_and_one_of_the_held_attempt_frees_the_blocks(
    gateway: FakeGateway,
) -> None:
    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
    await gateway.submit("doomed", prompt(40, 3), params, attempt=1)  # a re-run: attempt 0 was lost
    reply = gateway.replies["doomed"]
    await gateway.until(lambda: len(reply.tokens) >= 3, "decode tokens of the doomed request")
    prefill_id, decode_id = reply.worker_ids[0], reply.worker_ids[-1]
    assert (prefill_id.split("-")[0], decode_id.split("-")[0]) == ("prefill", "decode")

    # the cancel of attempt 0 reaches the decode worker directly and through the prefill worker
    # (which forwards cancels of requests it handed over): both times attempt 1 runs on
    for worker_id in (decode_id, prefill_id):
        await gateway.bus.send(gateway.keys.inbox(worker_id), Cancel("doomed", "attempt 0 is lost", attempt=0))
        await _until_inbox_read(gateway, worker_id)
    await _until_inbox_read(gateway, decode_id)
    num_tokens = len(reply.tokens)
    await gateway.until(lambda: len(reply.tokens) >= num_tokens + 3, "more tokens after the stale cancels")

    await gateway.bus.send(gateway.keys.inbox(decode_id), Cancel("doomed", "client disconnected", attempt=1))

    await gateway.until_all_blocks_free()
    await gateway.poll()
    assert reply.finish_reason is None and len(reply.tokens) < 500


async def test_cancel_mark_and_expired_deadline_answer_without_running(gateway: FakeGateway) -> None:
    await gateway.bus.redis.set(gateway.keys.cancelled("marked"), b"1", ex=60)
    await gateway.submit("marked", prompt(12), GREEDY)
    await gateway.submit("late", prompt(12), GREEDY, deadline=time.time() - 1)
    await gateway.submit("bad", [1, 2, 10**7], GREEDY)

    replies = await gateway.finish("marked", "late", "bad")

    assert [(r.token_ids, r.finish_reason) for r in replies.values()] == [([], "abort")] * 3
    assert replies["marked"].error is None
    assert "deadline" in (replies["late"].error or "")
    assert "outside the vocabulary" in (replies["bad"].error or "")


async def test_a_reservation_whose_kv_never_comes_is_freed_and_the_gateway_told(gateway: FakeGateway) -> None:
    """The test plays a prefill worker that dies after its offer was accepted."""
    await gateway.until_all_blocks_free()
    decode = (await gateway.workers("decode"))[0]
    ghost = f"ghost-prefill-{uuid.uuid4().hex[:6]}"
    offer = HandoffOffer(
        req_id="orphan", attempt=0, gateway_id=gateway.gateway_id, prefill_id=ghost,
        prompt_token_ids=prompt(40, 4), output_token_ids=[42], output_logprobs=[], output_top_logprobs=[],
        params=GREEDY.to_dict(), seed=1, num_cached_tokens=0, num_blocks=3,
    )
    await gateway.bus.send(decode.inbox, offer)
    accept = await _read_one(gateway, gateway.keys.inbox(ghost))
    assert accept == HandoffAccept("orphan", 0, decode.worker_id, needed_blocks=[0, 1, 2], kv_shm=accept.kv_shm,
                                   kv_token=accept.kv_token)
    assert len(accept.kv_token) == 32  # a transfer over its data port must show this token
    await gateway.until_status(
        lambda ss: _status(ss, decode.worker_id).free_blocks == decode.total_blocks - 3, "decode", "the reservation"
    )

    await gateway.until_status(
        lambda ss: _status(ss, decode.worker_id).free_blocks == decode.total_blocks, "decode", "the reservation to lapse"
    )

    # KV that turns up after the reservation lapsed is dropped, bytes included
    connector = RedisKVConnector(gateway.bus.redis, gateway.keys, ttl_s=60)
    location = await connector.put("orphan", 0, torch.zeros(3, 1))
    await gateway.bus.send(decode.inbox, KVReady("orphan", 0, [0, 1, 2], location, 12))
    await eventually(lambda: _missing(gateway, location), "the late KV bytes to be discarded")
    reply = (await gateway.finish("orphan"))["orphan"]
    assert (reply.token_ids, reply.finish_reason, reply.worker_ids) == ([], "abort", [decode.worker_id])
    assert f"did not arrive from {ghost}" in (reply.error or "")


async def _read_one(gateway: FakeGateway, stream: str) -> object:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        entries = await gateway.bus.read(stream, b"0", 1, 200)
        if entries:
            return entries[0][1]
    raise AssertionError(f"nothing arrived on {stream}")


async def _until_inbox_read(gateway: FakeGateway, worker_id: str) -> None:
    """Until the worker has handled every message in its inbox (it acknowledges each once handled)."""
    inbox = gateway.keys.inbox(worker_id)

    async def all_handled() -> bool:
        last_id = (await gateway.bus.redis.xinfo_stream(inbox))["last-generated-id"]
        [group] = await gateway.bus.redis.xinfo_groups(inbox)
        return bool(group["last-delivered-id"] == last_id and group["pending"] == 0)

    await eventually(all_handled, f"{worker_id} to handle its inbox")


async def _missing(gateway: FakeGateway, key: str) -> bool:
    return not await gateway.bus.redis.exists(key)


def _status(statuses: list[WorkerStatus], worker_id: str) -> WorkerStatus:
    return next(s for s in statuses if s.worker_id == worker_id)
