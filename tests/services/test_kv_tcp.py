"""The socket KV transport on loopback: bytes land exactly in the memory the receiver's claim
names and nowhere else, and only for a peer it knows and a header it accepts; a sender that
dies, stalls or lies ends the transfer within its deadline with the receiver told, and `stop`
returns only once nothing writes the blocks any more."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest
import torch

from services.kv_transfer import KVPeer, KVSource, KVTransferError, TransferHeader, kv_transports
from services.kv_transfer.base import tensor_bytes
from services.kv_transfer.tcp import TcpReceiver, TcpSender, recv_frame, send_frame, send_views
from shared.settings import WorkerSettings
from shared.streams import Bus
from tests.services.test_kv_connector import bus  # noqa: F401  (the fixture)
from tests.services.test_kv_shm import raises_enospc

pytestmark = pytest.mark.timeout(60)

TOKEN = "a" * 32
SEGMENT = 3000  # bytes per view: the receiver sees several, like one block's layers
GAP = 50


@dataclass
class Reservations:
    """Plays the decode worker's side of the receiver: one reservation, scattered over views."""

    into: torch.Tensor = field(default_factory=lambda: torch.zeros(4 * (SEGMENT + GAP), dtype=torch.uint8))
    known_peer: bool | None = True  # None: the check fails (Redis unreachable)
    settled: list[tuple[str, str | None]] = field(default_factory=list)
    settled_event: asyncio.Event = field(default_factory=asyncio.Event)

    def views(self) -> list[memoryview]:
        # segments of `into` with gaps between, so a write outside them shows
        whole = tensor_bytes(self.into)
        return [whole[i * (SEGMENT + GAP) : i * (SEGMENT + GAP) + SEGMENT] for i in range(4)]

    async def is_peer(self, host: str) -> bool:
        if self.known_peer is None:
            raise ConnectionError("Redis is unreachable")
        return self.known_peer

    async def claim(self, header: TransferHeader, host: str) -> list[memoryview]:
        if header.token != TOKEN:
            raise KVTransferError(f"wrong transfer token for {header.req_id!r}")
        return self.views()

    async def settle(self, header: TransferHeader, error: str | None) -> None:
        self.settled.append((header.req_id, error))
        self.settled_event.set()


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[TcpReceiver, Reservations]]:
    reservations = Reservations()
    receiver = TcpReceiver("127.0.0.1", 0, 2.0, reservations.is_peer, reservations.claim, reservations.settle)
    await receiver.start()
    yield receiver, reservations
    await receiver.close()


def payload() -> torch.Tensor:
    return torch.randint(0, 256, (4 * SEGMENT,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


def header(token: str = TOKEN, num_bytes: int = 4 * SEGMENT) -> TransferHeader:
    return TransferHeader(token, "req-1", 0, "prefill-0", num_blocks=2, num_bytes=num_bytes)


async def send(receiver: TcpReceiver, head: TransferHeader, data: torch.Tensor, timeout_s: float = 2.0) -> None:
    views = [tensor_bytes(data)[i : i + 1000] for i in range(0, len(data), 1000)]
    await asyncio.to_thread(TcpSender().send, "127.0.0.1", receiver.port, head, views, timeout_s)


async def test_bytes_land_exactly_in_the_claimed_views(receiver: tuple[TcpReceiver, Reservations]) -> None:
    rx, reservations = receiver
    data = payload()
    before = reservations.into.clone()

    await send(rx, header(), data)

    assert b"".join(reservations.views()) == data.numpy().tobytes()
    outside = torch.ones_like(before, dtype=torch.bool)
    for i in range(4):
        outside[i * (SEGMENT + GAP) : i * (SEGMENT + GAP) + SEGMENT] = False
    assert torch.equal(reservations.into[outside], before[outside])
    assert reservations.settled == [("req-1", None)]


async def test_a_wrong_token_is_refused_before_any_byte_lands(receiver: tuple[TcpReceiver, Reservations]) -> None:
    rx, reservations = receiver
    with pytest.raises(KVTransferError, match="refused the KV of req-1: wrong transfer token"):
        await send(rx, header(token="b" * 32), payload())
    assert not reservations.into.any() and reservations.settled == []


async def test_an_announced_size_other_than_the_reservations_is_refused(
    receiver: tuple[TcpReceiver, Reservations],
) -> None:
    rx, reservations = receiver
    with pytest.raises(KVTransferError, match="the reservation holds 12000 bytes, the sender announced 12001"):
        await send(rx, header(num_bytes=4 * SEGMENT + 1), torch.zeros(4 * SEGMENT + 1, dtype=torch.uint8))
    assert not reservations.into.any() and reservations.settled == []


@pytest.mark.parametrize("known_peer", [False, None])
async def test_an_address_no_heartbeat_names_is_not_even_read(receiver: tuple[TcpReceiver, Reservations],
                                                              known_peer: bool | None) -> None:
    rx, reservations = receiver
    reservations.known_peer = known_peer
    with pytest.raises(KVTransferError, match="failed"):
        await send(rx, header(), payload())
    assert not reservations.into.any() and reservations.settled == []


def half_then(port: int, then: str) -> socket.socket:
    """A sender that gets the go-ahead, sends half the bytes, then closes or stalls."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    deadline = time.monotonic() + 5
    send_frame(sock, asdict(header()), deadline)
    assert recv_frame(sock, deadline) == {"ok": True}
    send_views(sock, [tensor_bytes(payload())[: 2 * SEGMENT]], deadline)
    if then == "close":
        sock.close()
    return sock


@pytest.mark.parametrize(("then", "error"), [
    ("close", "the peer closed the connection after 6000 of 12000 bytes"),
    ("stall", "ran past its deadline"),
])
async def test_a_sender_that_dies_or_stalls_midway_is_settled_as_failed(
    receiver: tuple[TcpReceiver, Reservations], then: str, error: str,
) -> None:
    rx, reservations = receiver
    sock = await asyncio.to_thread(half_then, rx.port, then)
    async with asyncio.timeout(10):  # the receiver's deadline is 2 s
        await reservations.settled_event.wait()
    assert len(reservations.settled) == 1 and error in (reservations.settled[0][1] or "")
    sock.close()


async def test_stop_ends_a_transfer_in_progress_and_returns_once_it_wrote_its_last(
    receiver: tuple[TcpReceiver, Reservations],
) -> None:
    rx, reservations = receiver
    sock = await asyncio.to_thread(half_then, rx.port, "stall")
    async with asyncio.timeout(5):
        while ("req-1", 0) not in rx._receiving:
            await asyncio.sleep(0.01)

    await rx.stop("req-1", 0)

    assert len(reservations.settled) == 1 and reservations.settled[0][1] is not None
    assert rx._receiving == {}
    sock.close()


async def test_a_receiver_that_never_answers_ends_the_send_within_its_timeout() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:
        head = header()
        with pytest.raises(KVTransferError, match="ran past its deadline|timed out"):
            await asyncio.to_thread(TcpSender().send, "127.0.0.1", silent.getsockname()[1], head, [], 0.5)


async def test_transports_send_to_a_decode_workers_data_port_over_tcp(bus: Bus) -> None:  # noqa: F811
    reservations = Reservations()
    settings = WorkerSettings(kv_shm_dir="", handoff_timeout_s=5)
    decode = kv_transports(bus.redis, bus.keys, "ns", settings, "decode-0")
    decode.listen(reservations.is_peer, reservations.claim, reservations.settle)
    prefill = kv_transports(bus.redis, bus.keys, "ns", settings, "prefill-0")
    await decode.start()
    try:
        data = payload()
        source = KVSource((4 * SEGMENT,), torch.uint8, read=lambda out: data, views=lambda: [tensor_bytes(data)])
        peer = KVPeer("decode-0", tcp_host=decode.host, tcp_port=decode.port, tcp_token=TOKEN)

        location = await prefill.put("req-1", 0, source, peer)

        assert prefill.transport_of(location) == "tcp" and decode.names == ["tcp", "redis"]
        assert b"".join(reservations.views()) == data.numpy().tobytes()
        await decode.discard(location)  # nothing to discard: the bytes are in the blocks
    finally:
        await decode.close()


async def test_a_failed_shared_memory_write_goes_to_the_data_port_where_there_is_one(  # noqa: F811
    bus: Bus, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reservations = Reservations()
    settings = WorkerSettings(kv_shm_dir=str(tmp_path), handoff_timeout_s=5)
    decode = kv_transports(bus.redis, bus.keys, "ns", settings, "decode-0")
    decode.listen(reservations.is_peer, reservations.claim, reservations.settle)
    prefill = kv_transports(bus.redis, bus.keys, "ns", settings, "prefill-0")
    await decode.start()
    try:
        assert prefill.shm is not None
        prefill.shm.put_filled = raises_enospc  # type: ignore[method-assign]  # the tmpfs is full
        data = payload()
        source = KVSource((4 * SEGMENT,), torch.uint8, read=lambda out: data, views=lambda: [tensor_bytes(data)])
        peer = KVPeer("decode-0", shm_token=decode.shm_token, tcp_host=decode.host, tcp_port=decode.port,
                      tcp_token=TOKEN)
        assert prefill.choose(peer) == "shm"

        location = await prefill.put("req-1", 0, source, peer)

        assert prefill.transport_of(location) == "tcp"
        assert b"".join(reservations.views()) == data.numpy().tobytes()
        assert "goes through the data port" in caplog.text and "No space left" in caplog.text
    finally:
        await decode.close()
