"""The router's choices against real Redis heartbeats and a KV index fed by events: the worker
caching most of a prompt gets it, unless load or a draining state says otherwise."""

from __future__ import annotations

import asyncio
import time
import uuid

from services.gateway.kv_index import KVIndex
from services.gateway.router import Choice, Router
from shared.engine.block_pool import extend_block_hashes
from shared.protocol import KVEvents, WorkerStatus
from shared.settings import RoutingSettings
from shared.streams import Bus
from tests.services.test_kv_connector import bus  # noqa: F401 - the fixture: a Bus on its own namespace

BLOCK_SIZE = 16
PROMPT = list(range(1000, 1200))  # 12 full blocks
PREFILL_ROUTING = RoutingSettings(local_prefill_max_tokens=0)  # what goes to a prefill worker


async def beat(bus: Bus, worker_id: str, role: str, queued: int = 0, draining: bool = False) -> None:
    status = WorkerStatus(
        worker_id=worker_id, role=role, inbox=bus.keys.inbox(worker_id), free_blocks=100, total_blocks=100,
        num_running=0, num_waiting=0, timestamp=time.time(), draining=draining, num_queued_tokens=queued,
    )  # fmt: skip
    await bus.publish_status(status, ttl_s=60)


def caches(index: KVIndex, worker_id: str, role: str, num_blocks: int) -> None:
    """The worker, started anew (a new epoch), caches the first `num_blocks` blocks of PROMPT."""
    hashes = extend_block_hashes([], PROMPT, BLOCK_SIZE)[:num_blocks]
    index.on_events(KVEvents(worker_id, role, uuid.uuid4().hex, 1, BLOCK_SIZE, list(hashes), []))


async def two_by_two(bus: Bus, p0_queued: int = 0, p0_draining: bool = False) -> KVIndex:
    """p0 and d1 cache 10 blocks of PROMPT, p1 and d0 one."""
    index = KVIndex()
    await beat(bus, "p0", "prefill", queued=p0_queued, draining=p0_draining)
    await beat(bus, "p1", "prefill")
    await beat(bus, "d0", "decode")
    await beat(bus, "d1", "decode")
    for worker_id, role, num_blocks in (("p0", "prefill", 10), ("p1", "prefill", 1), ("d0", "decode", 1),
                                        ("d1", "decode", 10)):
        caches(index, worker_id, role, num_blocks)
    return index


async def test_the_workers_caching_most_of_the_prompt_get_it(bus: Bus) -> None:
    index = await two_by_two(bus)
    route = await Router(bus, index, PREFILL_ROUTING).route(PROMPT)
    assert (route.prefill, route.decode) == (Choice("prefill", "p0", 10), Choice("decode", "d1", 10))


async def test_a_prefill_worker_queued_far_beyond_the_others_gets_nothing_routed(bus: Bus) -> None:
    index = await two_by_two(bus, p0_queued=RoutingSettings().max_imbalance_tokens + 1)
    route = await Router(bus, index, PREFILL_ROUTING).route(PROMPT)
    assert route.prefill == Choice("prefill", None, 1)  # p1 alone is a candidate: by load, the shared stream
    assert route.decode.worker_id == "d1"


async def test_prompts_routed_since_the_last_heartbeat_count_as_queued(bus: Bus) -> None:
    index = await two_by_two(bus)
    router = Router(bus, index, RoutingSettings(load_weight=1.0, local_prefill_max_tokens=0))
    # p0 saves 9 blocks (144 tokens) over p1; one 200-token prompt queued on it outweighs that
    assert (await router.route(PROMPT)).prefill.worker_id == "p0"
    assert (await router.route(PROMPT)).prefill == Choice("prefill", None, 10)


async def test_a_draining_worker_gets_nothing_and_equal_caches_leave_it_to_load(bus: Bus) -> None:
    index = await two_by_two(bus, p0_draining=True)
    caches(index, "d0", "decode", 10)
    route = await Router(bus, index, PREFILL_ROUTING).route(PROMPT)
    assert (route.prefill, route.decode) == (Choice("prefill", None, 1), Choice("decode", None, 10))


async def test_a_prompt_a_decode_worker_caches_all_but_a_few_tokens_of_is_prefilled_there(bus: Bus) -> None:
    index = await two_by_two(bus)  # d1 caches 160 of the 200 tokens
    route = await Router(bus, index, RoutingSettings(local_prefill_max_tokens=40)).route(PROMPT)
    assert (route.prefill, route.decode) == (Choice("prefill", "d1", 10, local=True), Choice("decode", "d1", 10))
    assert route.prefill.by == "local"
    route = await Router(bus, index, RoutingSettings(local_prefill_max_tokens=39)).route(PROMPT)
    assert (route.prefill, route.decode) == (Choice("prefill", "p0", 10), Choice("decode", "d1", 10))


async def test_of_decode_workers_caching_the_prompt_alike_one_prefills_it(bus: Bus) -> None:
    index = await two_by_two(bus)
    caches(index, "d0", "decode", 10)  # both decode workers: no advantage either way, so no decode hint
    assert (await Router(bus, index, PREFILL_ROUTING).route(PROMPT)).decode == Choice("decode", None, 10)
    route = await Router(bus, index, RoutingSettings()).route(PROMPT)
    assert route.prefill.local and route.decode.worker_id == route.prefill.worker_id in ("d0", "d1")


async def test_without_an_index_or_with_routing_off_everything_goes_by_load(bus: Bus) -> None:
    index = await two_by_two(bus)
    assert (await Router(bus, KVIndex(), RoutingSettings()).route(PROMPT)).prefill.worker_id is None
    route = await Router(bus, index, RoutingSettings(enabled=False)).route(PROMPT)
    assert (route.prefill.worker_id, route.decode.worker_id) == (None, None)


async def test_an_index_that_forgets_every_worker_while_heartbeats_are_read_routes_by_load(bus: Bus) -> None:
    index = await two_by_two(bus)
    router = Router(bus, index, PREFILL_ROUTING)
    live_workers = bus.live_workers

    async def workers_gone_meanwhile(stage: str) -> list[WorkerStatus]:
        index.clear()  # the KV feed dropped them all (a stack restarted on the same Redis)
        return await live_workers(stage)

    bus.live_workers = workers_gone_meanwhile  # type: ignore[method-assign]
    route = await router.route(PROMPT)
    assert (route.prefill, route.decode) == (Choice("prefill", None, 0), Choice("decode", None, 0))


async def test_routes_that_find_the_statuses_old_together_share_one_read(bus: Bus) -> None:
    index = await two_by_two(bus)
    router = Router(bus, index, PREFILL_ROUTING)
    live_workers = bus.live_workers
    reads: list[str] = []

    async def counted(stage: str) -> list[WorkerStatus]:
        reads.append(stage)
        return await live_workers(stage)

    bus.live_workers = counted  # type: ignore[method-assign]
    routes = await asyncio.gather(*(router.route(PROMPT) for _ in range(20)))
    assert reads == ["prefill", "decode"]  # one read of each stage for the burst
    assert {(r.prefill.worker_id, r.decode.worker_id) for r in routes} == {("p0", "d1")}
