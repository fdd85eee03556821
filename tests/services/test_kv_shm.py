"""The shared-memory KV transport on a real tmpfs directory, and how `KVTransports` picks between
it and Redis: exact round trips, files only a deployment's own names can reach, a sweep for
transfers nobody will read, and Redis whenever shared memory cannot carry a transfer."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.kv_transfer import (
    SHM_SCHEME,
    KVPeer,
    KVSource,
    KVTransferError,
    KVTransports,
    SharedMemoryKVConnector,
    kv_transports,
)
from services.kv_transfer.base import tensor_bytes
from shared.settings import WorkerSettings
from shared.streams import Bus
from tests.services.test_kv_connector import KV_SHAPE, bus  # noqa: F401  (bus: the fixture, a namespace of its own)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def shm_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory in /dev/shm where there is one (the real tmpfs), else a temporary one."""
    base = Path("/dev/shm")
    directory = base / f"llmd-test-{uuid.uuid4().hex[:8]}" if base.is_dir() and os.access(base, os.W_OK) else tmp_path
    directory.mkdir(exist_ok=True)
    yield directory
    for path in directory.iterdir():
        path.unlink()
    if directory != tmp_path:
        directory.rmdir()


@pytest.fixture
def shm(shm_dir: Path) -> SharedMemoryKVConnector:
    return SharedMemoryKVConnector(shm_dir, "ns", ttl_s=30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
async def test_round_trip_is_bit_exact_and_discard_removes_the_file(shm: SharedMemoryKVConnector,
                                                                    dtype: torch.dtype) -> None:
    kv = torch.randn(KV_SHAPE, generator=torch.Generator().manual_seed(0)).to(dtype)

    location = await shm.put("req-1", 2, kv)
    back = await shm.get(location)

    assert location.startswith(SHM_SCHEME + str(shm.directory))
    assert (back.dtype, back.shape) == (dtype, kv.shape)
    assert torch.equal(back.view(torch.uint8), kv.view(torch.uint8))
    back.add_(1)  # the tensor owns writable memory, as the pool write expects
    await shm.discard(location)
    await shm.discard(location)
    assert list(shm.directory.iterdir()) == []
    with pytest.raises(KVTransferError, match="expired or already discarded"):
        await shm.get(location)


async def test_non_contiguous_and_empty_tensors_round_trip(shm: SharedMemoryKVConnector) -> None:
    transposed = torch.arange(12, dtype=torch.float32).view(3, 4).t()
    empty = torch.empty(0, *KV_SHAPE[1:])
    assert torch.equal(await shm.get(await shm.put("t", 0, transposed)), transposed)
    assert (await shm.get(await shm.put("e", 0, empty))).shape == empty.shape


async def test_a_truncated_file_is_an_error_not_a_wrong_tensor(shm: SharedMemoryKVConnector) -> None:
    location = await shm.put("req-1", 0, torch.zeros(4))
    path = Path(location.removeprefix(SHM_SCHEME))
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(KVTransferError, match="holds 15 bytes; float32\\[4\\] needs 16"):
        await shm.get(location)
    path.write_bytes(b"")
    with pytest.raises(KVTransferError, match="holds 0 bytes, not even a header"):
        await shm.get(location)


@pytest.mark.parametrize("location", [
    "shm:/etc/passwd", "shm:{dir}/../etc/passwd", "shm:{dir}/llmd-other-kv-1-0", "shm:{dir}/llmd-ns-worker-abc",
    "{dir}/llmd-ns-kv-1-0",
])
async def test_locations_outside_the_deployments_transfers_are_refused(shm: SharedMemoryKVConnector,
                                                                      location: str) -> None:
    # a location arrives in a message, and discard deletes what it names
    location = location.format(dir=shm.directory)
    with pytest.raises(KVTransferError, match="is not a KV transfer in"):
        await shm.discard(location)
    with pytest.raises(KVTransferError, match="is not a KV transfer in"):
        await shm.get(location)


async def test_sweep_removes_only_this_deployments_files_past_their_ttl(shm: SharedMemoryKVConnector) -> None:
    old_path = Path((await shm.put("old", 0, torch.zeros(2))).removeprefix(SHM_SCHEME))
    fresh_path = Path((await shm.put("fresh", 0, torch.zeros(2))).removeprefix(SHM_SCHEME))
    killed = SharedMemoryKVConnector(shm.directory, "ns", ttl_s=30)  # a worker killed without withdrawing
    alive = SharedMemoryKVConnector(shm.directory, "ns", ttl_s=30)
    stranger = shm.directory / "llmd-other-kv-1-0"
    for connector in (killed, alive):
        assert connector.advertise()
    stranger.touch()
    an_hour_ago = time.time() - 3600
    for path in (old_path, stranger, killed._marker, alive._marker):
        os.utime(path, (an_hour_ago, an_hour_ago))
    alive.refresh()  # each heartbeat

    assert shm.sweep() == 2
    assert not old_path.exists() and not killed._marker.exists()
    assert fresh_path.exists() and alive._marker.exists() and stranger.exists()


def test_workers_that_share_the_directory_find_each_others_marker(shm_dir: Path, tmp_path: Path) -> None:
    decode = SharedMemoryKVConnector(shm_dir, "ns", ttl_s=30)
    same_host = SharedMemoryKVConnector(shm_dir, "ns", ttl_s=30)
    other_shm = SharedMemoryKVConnector(tmp_path / "elsewhere", "ns", ttl_s=30)
    other_namespace = SharedMemoryKVConnector(shm_dir, "other", ttl_s=30)

    assert decode.advertise()
    assert same_host.shares_with(decode.token)
    assert not other_shm.shares_with(decode.token)  # e.g. another container's /dev/shm
    assert not other_namespace.shares_with(decode.token)
    assert not same_host.shares_with("") and not same_host.shares_with("../x")
    decode.withdraw()
    assert not same_host.shares_with(decode.token)


def transports(bus: Bus, shm_dir: Path | str, worker_id: str = "w") -> KVTransports:
    return kv_transports(bus.redis, bus.keys, "ns", WorkerSettings(kv_shm_dir=str(shm_dir)), worker_id)


async def test_an_unusable_directory_leaves_no_shared_memory(bus: Bus, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    missing = transports(bus, tmp_path / "missing")
    await missing.start()
    assert missing.shm is None and missing.shm_token == "" and missing.names == ["tcp", "redis"]
    assert "no KV handoffs through shared memory" in caplog.text and "missing" in caplog.text
    assert transports(bus, "").shm is None


async def test_transports_use_shared_memory_only_with_a_worker_that_shares_it(bus: Bus, shm_dir: Path) -> None:
    decode, prefill = transports(bus, shm_dir, "decode"), transports(bus, shm_dir, "prefill")
    await decode.start()
    kv = torch.randn(2, 5)

    shared = await prefill.put("r", 0, source_of(kv), KVPeer("decode", shm_token=decode.shm_token))
    apart = await prefill.put("r", 1, source_of(kv), KVPeer("decode"))

    assert shared.startswith(SHM_SCHEME) and apart == bus.keys.kv_blob("r", 1)
    assert (prefill.transport_of(shared), prefill.transport_of(apart)) == ("shm", "redis")
    for location in (shared, apart):
        assert torch.equal(await decode.get(location), kv)
        await decode.discard(location)
    assert not await bus.redis.exists(apart)
    await decode.close()
    assert list(shm_dir.iterdir()) == []


async def test_a_failed_shared_memory_write_goes_through_redis(bus: Bus, shm_dir: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    decode = transports(bus, shm_dir, "decode")
    await decode.start()
    prefill = transports(bus, shm_dir, "prefill")
    assert prefill.shm is not None
    prefill.shm.put_filled = raises_enospc  # type: ignore[method-assign]  # the tmpfs is full
    kv = torch.ones(3)

    location = await prefill.put("r", 0, source_of(kv), KVPeer("decode", shm_token=decode.shm_token))

    assert location == bus.keys.kv_blob("r", 0)
    assert torch.equal(await decode.get(location), torch.ones(3))
    assert "goes through Redis" in caplog.text and "No space left" in caplog.text
    await decode.close()


async def raises_enospc(*args: object) -> str:
    raise OSError(28, "No space left on device")


def source_of(kv: torch.Tensor) -> KVSource:
    """What the prefill worker passes for its pool's blocks: `read` fills `out` or returns a tensor."""
    return KVSource(tuple(kv.shape), kv.dtype, read=lambda out: kv.clone() if out is None else out.copy_(kv),
                    views=lambda: [tensor_bytes(kv)])


async def test_a_filled_transfer_is_written_in_place_and_a_failed_fill_leaves_nothing(
    shm: SharedMemoryKVConnector,
) -> None:
    kv = torch.randn(KV_SHAPE, generator=torch.Generator().manual_seed(1)).bfloat16()
    seen: list[tuple[torch.Size, torch.dtype, bool]] = []

    def fill(out: torch.Tensor) -> None:
        seen.append((out.shape, out.dtype, out.is_contiguous()))
        out.copy_(kv)

    location = await shm.put_filled("r", 0, kv.shape, kv.dtype, fill)
    assert seen == [(kv.shape, torch.bfloat16, True)]
    assert torch.equal((await shm.get(location)).view(torch.int16), kv.view(torch.int16))

    def fail(out: torch.Tensor) -> None:
        raise RuntimeError("the pool read failed")

    with pytest.raises(RuntimeError, match="the pool read failed"):
        await shm.put_filled("r", 1, kv.shape, kv.dtype, fail)
    assert [p.name for p in shm.directory.iterdir()] == [Path(location.removeprefix(SHM_SCHEME)).name]


async def test_a_worker_without_shared_memory_refuses_a_shared_memory_location(bus: Bus) -> None:
    with pytest.raises(KVTransferError, match="in shared memory, which this worker does not use"):
        await transports(bus, "").get(SHM_SCHEME + "/dev/shm/llmd-ns-kv-1-0")


def test_a_marker_that_disappeared_is_recreated_and_said_once(shm: SharedMemoryKVConnector,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    assert shm.advertise()
    shm._marker.unlink()  # a neighbour swept it, or someone cleared the tmpfs

    shm.refresh()
    shm.refresh()

    assert shm._marker.exists()
    assert caplog.text.count("had disappeared; recreated it") == 1
    shm.withdraw()


def test_a_marker_that_cannot_be_refreshed_is_warned_about_once(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    directory = tmp_path / "shm"
    directory.mkdir()
    shm = SharedMemoryKVConnector(directory, "ns", ttl_s=30)
    assert shm.advertise()
    shm._marker.unlink()
    directory.rmdir()  # the tmpfs went away

    for _ in range(3):
        shm.refresh()

    assert caplog.text.count("could not recreate the KV marker") == 1
    directory.mkdir()
    shm.refresh()
    assert shm._marker.exists() and caplog.text.count("recreated it") == 1
