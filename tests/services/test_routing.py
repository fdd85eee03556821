"""Cache-aware routing on a real 2 prefill + 2 decode stack (private Redis): a conversation's next
turn goes to the workers that hold its history, a short one is prefilled on the decode worker
that holds it, and it stays correct when those workers are SIGKILLed or Redis restarts empty (the
index is rebuilt from the workers' snapshots)."""

from __future__ import annotations

import random
import re
import signal
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from openai import APIStatusError, OpenAI

from bench.stack_harness import scrape_metrics
from services.gateway.kv_feed import SNAPSHOT_POLL_S
from services.launcher import Stack, StackConfig
from services.launcher.redis_server import RedisServer
from shared.engine.sampling_params import SamplingParams
from shared.model.loader import LoadedModel
from shared.model.paths import default_model_path
from shared.streams import PREFILL_GROUP
from shared.text.tokenizer import Tokenizer
from tests.services.stack_client import offline_greedy
from tests.services.stacks import (
    BOUND_S,
    FAST_HEARTBEAT,
    kv_bytes_by_transport,
    live_workers,
    remove_kv_files,
    request_holders,
    scrape,
)
from tests.services.test_faults import until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

VOCAB = 49152
DOC_TOKENS = 320  # 20 blocks of 16 tokens
LOCAL_PREFILL_MAX_TOKENS = 64
LONG_TURN = 80  # new tokens of a follow-up that a prefill worker computes
ENV = {
    **FAST_HEARTBEAT,
    "LLMD_KV_CACHE__MEMORY_BYTES": str(128 * 2**20),
    "LLMD_LOG_LEVEL": "WARNING",
    "LLMD_WORKER__KV_EVENTS__SNAPSHOT_INTERVAL_S": "0.3",
    # the holder of a history gets every follow-up, however many are queued on it
    "LLMD_ROUTING__LOAD_WEIGHT": "0",
    "LLMD_ROUTING__MAX_IMBALANCE_TOKENS": "100000",
    "LLMD_ROUTING__LOCAL_PREFILL_MAX_TOKENS": str(LOCAL_PREFILL_MAX_TOKENS),
}
# small prefill steps: a long prompt takes many steps, and one queued prompt fills the intake
PREFILL_ENV = {"LLMD_SCHEDULER__MAX_NUM_BATCHED_TOKENS": "64"}


@pytest.fixture(scope="module")
def private_redis() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def stack(private_redis: RedisServer) -> Iterator[Stack]:
    config = StackConfig(
        port=0, num_prefill=2, num_decode=2, redis_url=private_redis.url, dtype="float32",
        namespace=f"test-routing-{uuid.uuid4().hex[:8]}", env=ENV, role_env={"prefill": PREFILL_ENV},
    )  # fmt: skip
    try:
        with Stack(config) as stack:
            yield stack
    finally:
        remove_kv_files(config.namespace)


@pytest.fixture
def rds(private_redis: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(private_redis.url)
    yield client
    client.close()


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, VOCAB) for _ in range(n)]


def complete(client: OpenAI, model: str, prompt: list[int], max_tokens: int) -> tuple[str, int]:
    """Greedy text of exactly `max_tokens` tokens, and how many prompt tokens were cached."""
    out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    assert out.usage is not None and out.usage.completion_tokens == max_tokens
    details = out.usage.prompt_tokens_details
    return out.choices[0].text, (details.cached_tokens or 0) if details is not None else 0


def complete_or_retry(client: OpenAI, model: str, prompt: list[int]) -> str | None:
    """`complete`'s text, or None for a 503 (with Retry-After) while the gateway reconnects to Redis."""
    try:
        return complete(client, model, prompt, 4)[0]
    except APIStatusError as e:
        assert e.status_code == 503
        return None


def routed(stack: Stack) -> dict[tuple[str, str, str], float]:
    """The gateway's llmd_routed_requests_total: (stage, by, worker_id) -> count."""
    pattern = r'^llmd_routed_requests_total\{[^}]*by="(\w+)",[^}]*stage="(\w+)",worker_id="([^"]*)"\} (\S+)$'
    found = re.findall(pattern, scrape(stack.base_url), re.MULTILINE)
    return {(stage, by, worker): float(value) for by, stage, worker, value in found}


def routed_since(stack: Stack, before: dict[tuple[str, str, str], float]) -> dict[tuple[str, str, str], float]:
    return {k: v - before.get(k, 0.0) for k, v in routed(stack).items() if v - before.get(k, 0.0)}


def by_overlap(counts: dict[tuple[str, str, str], float], stage: str) -> dict[str, float]:
    return {worker: n for (s, by, worker), n in counts.items() if s == stage and by == "overlap"}


@pytest.fixture(scope="module")
def model(client: OpenAI) -> str:
    return client.models.list().data[0].id


def test_a_follow_up_goes_to_the_workers_that_hold_its_history(stack: Stack, client: OpenAI, model: str) -> None:
    history = tokens(1, DOC_TOKENS)
    complete(client, model, history, 4)  # the first turn: nobody caches it, routed by load
    before = routed(stack)
    _, num_cached = complete(client, model, history + tokens(2, LONG_TURN), 4)
    counts = routed_since(stack, before)
    assert len(by_overlap(counts, "prefill")) == 1 and len(by_overlap(counts, "decode")) == 1, counts
    assert num_cached >= DOC_TOKENS - 16  # the whole history but its partial last block
    metrics = scrape(stack.base_url)
    assert re.search(r'^llmd_routed_matched_blocks_total\{[^}]*stage="prefill"[^}]*\} [1-9]', metrics, re.MULTILINE)
    assert re.search(r"^llmd_worker_cached_tokens_total\{[^}]*\} [1-9]", metrics, re.MULTILINE)


def test_a_short_follow_up_is_prefilled_on_the_decode_worker_that_holds_its_history(
    stack: Stack, client: OpenAI, model: str, rds: redis.Redis, loaded_model: LoadedModel
) -> None:
    history = tokens(12, DOC_TOKENS)
    complete(client, model, history, 4)
    follow_up = history + tokens(13, LOCAL_PREFILL_MAX_TOKENS - 8)
    handed_off, before = kv_bytes_by_transport(rds, stack.keys), routed(stack)
    text, num_cached = complete(client, model, follow_up, 8)
    counts = routed_since(stack, before)
    local = {worker: n for (stage, by, worker), n in counts.items() if (stage, by) == ("prefill", "local")}
    assert list(local.values()) == [1] and by_overlap(counts, "decode") == local, counts
    assert num_cached == DOC_TOKENS  # the decode worker holds the history the first turn's handoff brought
    assert kv_bytes_by_transport(rds, stack.keys) == handed_off  # no KV moved
    (holder,) = [s for s in live_workers(rds, stack.keys, "decode") if s.worker_id in local]
    holder_metrics = scrape_metrics(f"http://127.0.0.1:{holder.health_port}/metrics")
    assert sum(v for k, v in holder_metrics.items() if k.startswith("llmd_local_prefills_total")) == 1
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (expected,) = offline_greedy(loaded_model, [follow_up], greedy)
    assert text == Tokenizer.from_path(str(default_model_path())).decode(expected)


def test_requests_routed_to_a_prefill_worker_that_is_killed_are_taken_over(
    stack: Stack, client: OpenAI, model: str, rds: redis.Redis
) -> None:
    history = tokens(3, DOC_TOKENS)
    complete(client, model, history, 4)
    prompts = [history + tokens(10 + i, 400) for i in range(3)]
    before = routed(stack)
    texts: dict[int, str] = {}
    errors: dict[int, BaseException] = {}

    def one(i: int) -> None:
        try:
            texts[i] = complete(client, model, prompts[i], 8)[0]
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors[i] = e

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    holder: list[str] = []

    def routed_entries_pending() -> bool:
        holder[:] = list(by_overlap(routed_since(stack, before), "prefill"))
        return len(holder) == 1 and rds.xpending(stack.keys.routed_requests(holder[0]), PREFILL_GROUP)["pending"] > 0

    until(routed_entries_pending, "follow-ups routed to one prefill worker, one of them in its hands")
    assert stack.stop_worker(holder[0], signal.SIGKILL) == -signal.SIGKILL
    for t in threads:
        t.join(BOUND_S)
        assert not t.is_alive()
    assert errors == {}
    stream = stack.keys.routed_requests(holder[0])
    assert rds.xpending(stream, PREFILL_GROUP)["pending"] == 0
    # with one prompt filling its intake, the victim usually dies with entries it never read
    group = next(g for g in rds.xinfo_groups(stream) if g["name"] == PREFILL_GROUP.encode())
    assert group["lag"] == 0  # none of them left unread
    # the same answers again, now from the survivors: each was produced once, whole
    assert {i: complete(client, model, p, 8)[0] for i, p in enumerate(prompts)} == texts
    stack.add_worker("prefill")


def test_a_routed_request_survives_its_decode_workers_kill(stack: Stack, client: OpenAI, model: str,
                                                           rds: redis.Redis) -> None:
    history = tokens(4, DOC_TOKENS)
    complete(client, model, history, 4)
    follow_up = history + tokens(5, 24)
    expected, _ = complete(client, model, follow_up, 48)
    before = routed(stack)
    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["text"] = complete(client, model, follow_up, 48)[0]
        except BaseException as e:  # noqa: BLE001 - reported by the test
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    until(lambda: bool(by_overlap(routed_since(stack, before), "decode")), "the follow-up to get a decode hint")
    (hinted,) = by_overlap(routed_since(stack, before), "decode")
    assert request_holders(rds, stack.keys, "decode", timeout_s=BOUND_S) == [hinted]
    assert stack.stop_worker(hinted, signal.SIGKILL) == -signal.SIGKILL
    thread.join(BOUND_S)
    assert result == {"text": expected}
    stack.add_worker("decode")


def test_routing_recovers_after_redis_restarts_empty(stack: Stack, client: OpenAI, model: str,
                                                     private_redis: RedisServer, rds: redis.Redis) -> None:
    history, probe = tokens(6, DOC_TOKENS), tokens(8, 40)
    complete(client, model, history, 4)
    expected = complete(client, model, probe, 4)[0]
    private_redis.stop()
    private_redis.start()
    # a prompt unrelated to the history, so that only one prefill worker keeps holding it
    until(lambda: complete_or_retry(client, model, probe) == expected, "the stack to serve again")
    # every event and snapshot is gone; the workers, their caches unchanged, publish their snapshots again
    prefill_ids = [s.decode() for s in rds.hkeys(stack.keys.workers("prefill"))]
    until(lambda: all(rds.exists(stack.keys.kv_snapshot(w)) for w in prefill_ids), "the workers' snapshots")
    time.sleep(2 * SNAPSHOT_POLL_S)  # the gateway reads them
    before = routed(stack)
    complete(client, model, history + tokens(7, LONG_TURN), 4)
    assert len(by_overlap(routed_since(stack, before), "prefill")) == 1
    assert stack.exited() == {}
