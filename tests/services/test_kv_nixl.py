"""The NIXL transport on its own: two agents in one process over UCX on loopback TCP, each with a
pool laid out as the engine's (segment s of block b at (s * num_blocks + b) * segment)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np
import pytest

from services.kv_transfer import KVPeer, KVTransferError
from services.kv_transfer.nixl import NixlTransport, PoolLayout, address, location_of, nixl_api
from shared.streams import Bus
from tests.services.test_kv_connector import bus  # noqa: F401  (the fixture)
from tests.services.test_kv_shm import transports

pytestmark = pytest.mark.skipif(nixl_api() is None, reason="NIXL is not installed (pip install -e '.[nixl]')")

NUM_BLOCKS, NUM_SEGMENTS, SEGMENT = 6, 4, 4096


def pool(seed: int) -> tuple[np.ndarray, Callable[[list[int]], list[memoryview]]]:
    data = np.random.default_rng(seed).integers(0, 256, NUM_SEGMENTS * NUM_BLOCKS * SEGMENT, dtype=np.uint8)
    view = memoryview(data)

    def block_views(block_ids: list[int]) -> list[memoryview]:
        starts = [(s * NUM_BLOCKS + b) * SEGMENT for b in block_ids for s in range(NUM_SEGMENTS)]
        return [view[start : start + SEGMENT] for start in starts]

    return data, block_views


def test_the_layout_finds_every_segment_of_every_block_and_nothing_outside() -> None:
    data, block_views = pool(0)
    layout = PoolLayout.of(memoryview(data), block_views)

    assert (layout.num_blocks, layout.num_segments, layout.segment) == (NUM_BLOCKS, NUM_SEGMENTS, SEGMENT)
    descriptors = layout.descriptors([5, 0, 2])
    assert descriptors[:, 0].tolist() == [address(v) for v in block_views([5, 0, 2])]
    assert set(descriptors[:, 1].tolist()) == {SEGMENT}
    with pytest.raises(KVTransferError, match=r"KV blocks \[6\] outside a pool of 6"):
        layout.descriptors([1, 6])


@pytest.fixture
def on_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp")  # on one host UCX would otherwise pick shared memory
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")


async def test_nixl_comes_after_a_shared_tmpfs_and_before_the_data_port(
    bus: Bus, tmp_path: Path, on_loopback: None,  # noqa: F811
) -> None:
    decode, prefill = transports(bus, tmp_path, "decode"), transports(bus, tmp_path, "prefill")
    pools = [pool(0), pool(1)]
    for kv, (data, block_views) in zip((decode, prefill), pools):
        kv.use_pool(memoryview(data), block_views)
    await decode.start()
    data_port = {"tcp_host": "127.0.0.1", "tcp_port": 9200, "tcp_token": "t"}

    assert decode.names == ["shm", "nixl", "tcp", "redis"]
    assert prefill.choose(KVPeer("decode", shm_token=decode.shm_token, nixl=True, **data_port)) == "shm"
    assert prefill.choose(KVPeer("decode", nixl=True, **data_port)) == "nixl"
    assert prefill.choose(KVPeer("decode", **data_port)) == "tcp"
    for kv in (decode, prefill):
        await kv.close()


@pytest.fixture
async def agents(on_loopback: None) -> AsyncIterator[tuple[NixlTransport, NixlTransport, list[np.ndarray]]]:
    pools, agents = [], []
    for i, name in enumerate(("prefill-a", "decode-a")):
        data, block_views = pool(i)
        agent = NixlTransport(name, timeout_s=10.0)
        agent.register(memoryview(data), block_views)
        pools.append(data)
        agents.append(agent)
    yield agents[0], agents[1], pools
    for agent in agents:
        await agent.close()


def blocks(data: np.ndarray, block_ids: list[int]) -> np.ndarray:
    return data.reshape(NUM_SEGMENTS, NUM_BLOCKS, SEGMENT)[:, block_ids]


async def test_a_read_moves_exactly_the_named_blocks_and_tells_the_sender(
    agents: tuple[NixlTransport, NixlTransport, list[np.ndarray]],
) -> None:
    prefill, decode, (source, dest) = agents
    untouched = dest.copy()

    await asyncio.gather(
        decode.read(location_of("prefill-a", [4, 1]), "prefill-a", prefill.advertisement, [0, 5], "r", 0),
        prefill.until_read("decode-a", "r", 0),
    )

    assert np.array_equal(blocks(dest, [0, 5]), blocks(source, [4, 1]))
    assert np.array_equal(blocks(dest, [1, 2, 3, 4]), blocks(untouched, [1, 2, 3, 4]))


async def test_a_read_that_does_not_match_the_reservation_moves_nothing(
    agents: tuple[NixlTransport, NixlTransport, list[np.ndarray]],
) -> None:
    prefill, decode, (_, dest) = agents
    untouched = dest.copy()
    cases = {
        "2 KV blocks offered for 'r'; its reservation holds 1": (location_of("prefill-a", [1, 2]), [0]),
        r"KV blocks \[9\] outside a pool of 6": (location_of("prefill-a", [9]), [0]),
        "the KV of 'r' is prefill-a's to send; its location names 'intruder'": (location_of("intruder", [1]), [0]),
    }
    for error, (location, into) in cases.items():
        with pytest.raises(KVTransferError, match=error):
            await decode.read(location, "prefill-a", prefill.advertisement, into, "r", 0)
    with pytest.raises(KVTransferError, match="could not load prefill-a's NIXL metadata"):
        await decode.read(location_of("prefill-a", [1]), "prefill-a", b"not metadata", [0], "r", 0)
    assert np.array_equal(dest, untouched)


async def test_a_read_that_stalls_ends_at_its_deadline(
    agents: tuple[NixlTransport, NixlTransport, list[np.ndarray]],
) -> None:
    prefill, decode, _ = agents  # the prefill side never progresses: over TCP, the read cannot finish
    decode.timeout_s = 0.5
    everything = list(range(NUM_BLOCKS))

    with pytest.raises(KVTransferError, match="ran past its deadline of 0.5s"):
        await decode.read(location_of("prefill-a", everything), "prefill-a", prefill.advertisement, everything, "r", 0)


async def test_a_read_whose_sender_never_serves_it_ends_when_stopped(
    agents: tuple[NixlTransport, NixlTransport, list[np.ndarray]],
) -> None:
    prefill, decode, _ = agents  # the prefill side never progresses: over TCP, the read cannot finish
    read = asyncio.ensure_future(
        decode.read(location_of("prefill-a", list(range(NUM_BLOCKS))), "prefill-a", prefill.advertisement,
                    list(range(NUM_BLOCKS)), "r", 0)
    )
    while ("r", 0) not in decode._reads:
        await asyncio.sleep(0.01)

    await decode.stop("r", 0)

    with pytest.raises(KVTransferError, match="stopped"):
        await read
