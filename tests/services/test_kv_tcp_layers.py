"""KV over the data port layer by layer while the prefill runs (services/kv_transfer/tcp_layers.py),
with the real model on loopback: the blocks of a chunked prefill's first chunk reach the other
pool before its last chunk is computed, every byte lands exactly, and a stream whose request
was preempted, or whose frames lie, fails instead of landing."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass, field

import pytest
import torch

from services.runtime.engine_thread import EngineThread
from services.kv_transfer import KVTransferError, TransferHeader
from services.kv_transfer.base import num_bytes
from services.kv_transfer.tcp import TcpReceiver, recv_frame, send_frame, send_views
from services.kv_transfer.tcp_layers import LayerStream, LayerStreams
from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from shared.model.loader import LoadedModel
from shared.settings import EngineSettings, KVCacheSettings, ModelSettings, SchedulerSettings

pytestmark = pytest.mark.timeout(120)

TOKEN = "b" * 32
CHUNK = 64  # tokens per prefill step: a 150-token prompt takes three
PROMPT = [(i * 7919) % 40000 + 100 for i in range(150)]  # 10 blocks of 16, the last one partial
NEEDED = list(range(2, 10))  # the decode side caches the first two


def make_engine(loaded: LoadedModel) -> Engine:
    return Engine(EngineSettings(
        model=ModelSettings(dtype="float32", device="cpu"), kv_cache=KVCacheSettings(memory_bytes=24 * 2**20),
        scheduler=SchedulerSettings(max_num_batched_tokens=CHUNK),
    ), loaded)


@pytest.fixture(scope="module")
def engines(loaded_model: LoadedModel) -> tuple[Engine, Engine]:
    return make_engine(loaded_model), make_engine(loaded_model)


@dataclass
class Receiving:
    """The decode side: blocks of the target engine, claimed for one transfer."""

    views: list[memoryview]
    settled: list[str | None] = field(default_factory=list)
    claimed: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    async def is_peer(self, host: str) -> bool:
        return True

    async def claim(self, header: TransferHeader, host: str) -> list[memoryview]:
        if header.token != TOKEN:
            raise KVTransferError("wrong token")
        self.claimed.set()
        return self.views

    async def settle(self, header: TransferHeader, error: str | None) -> None:
        self.settled.append(error)
        self.done.set()


@pytest.fixture
async def receiving(engines: tuple[Engine, Engine]) -> AsyncIterator[tuple[TcpReceiver, Receiving, list[int]]]:
    target = engines[1]
    into = list(range(20, 20 + len(NEEDED)))
    target.runner.kv_cache.zero_()
    views = target.kv_block_views(into)
    assert views is not None
    recv = Receiving(views)
    receiver = TcpReceiver("127.0.0.1", 0, 2.0, recv.is_peer, recv.claim, recv.settle)
    await receiver.start()
    yield receiver, recv, into
    await receiver.close()


@pytest.fixture
def thread(engines: tuple[Engine, Engine]) -> Iterator[tuple[EngineThread, LayerStreams]]:
    source = engines[0]
    thread, streams = EngineThread(), LayerStreams()
    thread._engine = source
    source.runner.model.between_layers = thread.between_layers
    thread.after_layer = streams.after_layer
    yield thread, streams
    source.runner.model.between_layers = None
    thread.shutdown()


def layered_header(engine: Engine, req_id: str) -> TransferHeader:
    shape = engine.kv_blocks_shape(len(NEEDED))
    return TransferHeader(TOKEN, req_id, 0, "prefill-0", len(NEEDED), num_bytes(shape, engine.kv_dtype),
                          num_layers=shape[1])


def stream_to(receiver: TcpReceiver, engine: Engine, req_id: str, timeout_s: float = 2.0) -> LayerStream:
    header = layered_header(engine, req_id)
    return LayerStream("127.0.0.1", receiver.port, header, NEEDED, engine.block_size, engine.kv_layer_views, timeout_s)


async def until(check: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_a_chunked_prefill_streams_each_chunk_before_the_next_and_every_byte_lands(
    engines: tuple[Engine, Engine], receiving: tuple[TcpReceiver, Receiving, list[int]],
    thread: tuple[EngineThread, LayerStreams],
) -> None:
    source, target = engines
    receiver, recv, into = receiving
    engine_thread, streams = thread
    await engine_thread.call(source.add_request, "long", PROMPT, SamplingParams(max_tokens=8), True)
    stream = stream_to(receiver, source, "long")
    streams.add("long", stream)
    sending = asyncio.ensure_future(stream.run())

    await engine_thread.step()  # tokens 0-63: blocks 0-3 of every layer are final, of them 2 and 3 needed

    def landed(positions: list[int]) -> bool:
        table = source.kv_cache.block_ids("long")
        sent = source.read_blocks([table[p] for p in positions])
        return torch.equal(target.read_blocks([into[NEEDED.index(p)] for p in positions]), sent)

    await until(lambda: landed([2, 3]))  # before the second chunk is computed
    assert not target.read_blocks([into[NEEDED.index(4)]]).any()  # not computed yet, so not sent

    outputs = []
    while not outputs:
        outputs = await engine_thread.step()
    assert outputs[0].is_prefilled
    stream.finish(source.kv_block_ids("long"))  # nothing is left: the last step's layers sent all
    await asyncio.wait_for(sending, 10)
    streams.remove("long")

    assert landed(NEEDED)
    assert recv.settled == [None]
    await engine_thread.call(source.release, "long")


async def test_a_request_preempted_mid_stream_fails_its_stream(
    engines: tuple[Engine, Engine], receiving: tuple[TcpReceiver, Receiving, list[int]],
) -> None:
    source = engines[0]
    receiver, recv, _ = receiving
    stream = stream_to(receiver, source, "preempted")
    sending = asyncio.ensure_future(stream.run())
    table = list(range(10))
    stream.layer_done(0, 64, 150, num_preemptions=0, table=table)
    await asyncio.wait_for(recv.claimed.wait(), 10)
    stream.layer_done(1, 64, 150, num_preemptions=1, table=table)  # its blocks were freed meanwhile

    with pytest.raises(KVTransferError, match="preempted"):
        await asyncio.wait_for(sending, 10)
    await asyncio.wait_for(recv.done.wait(), 10)
    assert recv.settled[0] is not None


def connect_and_claim(port: int, engine: Engine) -> socket.socket:
    head = layered_header(engine, "liar")
    sock = socket.create_connection(("127.0.0.1", port))
    deadline = time.monotonic() + 5
    send_frame(sock, asdict(head), deadline)
    assert recv_frame(sock, deadline) == {"ok": True}
    return sock


@pytest.mark.parametrize("frame", [
    {"layer": 0, "first": 7, "count": 2},  # past the reserved blocks
    {"layer": 99, "first": 0, "count": 1},  # past the model's layers
    {"layer": 0, "first": 0, "count": 1},  # sent twice
])
async def test_a_frame_outside_the_reservation_or_sent_twice_fails_the_transfer(
    engines: tuple[Engine, Engine], receiving: tuple[TcpReceiver, Receiving, list[int]], frame: dict[str, int],
) -> None:
    source = engines[0]
    receiver, recv, _ = receiving
    segment = bytes(len(source.kv_layer_views([0], 0)[0]))  # type: ignore[index]

    def lie() -> None:
        with connect_and_claim(receiver.port, source) as sock:
            deadline = time.monotonic() + 5
            if frame["layer"] == 0 and frame["first"] == 0:  # the first time, honestly
                send_frame(sock, frame, deadline)
                send_views(sock, [memoryview(segment)] * 2, deadline)
            send_frame(sock, frame, deadline)
            send_views(sock, [memoryview(segment)] * 2 * frame["count"], deadline)
            with pytest.raises((OSError, KVTransferError)):
                recv_frame(sock, deadline)  # closed without {ok}

    await asyncio.to_thread(lie)
    await asyncio.wait_for(recv.done.wait(), 10)
    assert recv.settled[0] is not None


async def test_a_sender_silent_past_the_bound_fails_while_one_that_says_wait_does_not(
    engines: tuple[Engine, Engine], receiving: tuple[TcpReceiver, Receiving, list[int]],
) -> None:
    source = engines[0]
    receiver, recv, _ = receiving  # a 2 s bound on each silence

    def keep_waiting_then_go_silent() -> None:
        with connect_and_claim(receiver.port, source) as sock:
            for _ in range(3):  # 3 s in all, each gap under the bound
                time.sleep(1.0)
                send_frame(sock, {"wait": True}, time.monotonic() + 5)
            assert not recv.done.is_set()
            with pytest.raises((OSError, KVTransferError)):
                recv_frame(sock, time.monotonic() + 10)

    await asyncio.to_thread(keep_waiting_then_go_silent)
    assert recv.settled and recv.settled[0] is not None and "deadline" in recv.settled[0]
