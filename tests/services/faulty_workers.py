"""Real workers that SIGKILL their own process at one exact point of a KV handoff, for
tests/services/test_fault_handoff.py. Configured from LLMD_* variables like any worker:

    python -m tests.services.faulty_workers prefill-dies-after-accept
    python -m tests.services.faulty_workers decode-dies-on-kv-ready   (and the others in FAULTS)

prefill-dies-after-accept: a decode worker accepted its offer and holds a reservation; the KV
never comes. decode-dies-on-kv-ready: it accepted an offer and the KV is ready, but it dies before
importing it (the prefill worker has named it as the holder). Its KV pool is twice the configured
LLMD_KV_CACHE__MEMORY_BYTES, so a prefill worker, which offers to the most free blocks first,
picks it over a normal decode worker; so is the pool of every faulty decode worker.

Over the data port (services/kv_transfer/tcp.py), with half of a transfer's bytes sent (for a
layer-by-layer stream, tcp_layers.py: half of the layers sent, or the first layer's blocks
received): prefill-dies-mid-transfer and decode-dies-mid-transfer SIGKILL themselves;
prefill-stalls-mid-transfer sends nothing more until the decode worker gives up and closes the
connection, once (its later transfers are normal).

Through NIXL (services/kv_transfer/nixl.py), with a decode worker's read in flight:
prefill-dies-mid-read and decode-dies-mid-read SIGKILL themselves.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from typing import NoReturn

from services.decode.worker import DecodeWorker
from services.kv_transfer import KVTransferError
from services.kv_transfer.tcp import TcpSender, TransferHeader, recv_frame, recv_into_views, send_views
from services.kv_transfer.tcp_layers import LayerStream
from services.prefill.tracked import Tracked
from services.prefill.worker import PrefillWorker
from services.runtime.worker import Worker, main
from shared.protocol import KVReady
from shared.settings import WorkerServiceSettings


def die() -> NoReturn:
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: SIGKILL cannot be caught")


class PrefillDiesAfterAccept(PrefillWorker):
    async def _transfer(self, t: Tracked, decode_id: str, needed: list[int]) -> None:
        die()


class PreferredDecode(DecodeWorker):
    """A decode worker with twice the configured KV pool, so that prefill workers offer to it first."""

    def __init__(self, settings: WorkerServiceSettings) -> None:
        kv = settings.kv_cache
        if kv.memory_bytes is None:
            raise SystemExit("a faulty decode worker needs LLMD_KV_CACHE__MEMORY_BYTES (it takes twice that)")
        kv.memory_bytes *= 2
        super().__init__(settings)


class DecodeDiesOnKVReady(PreferredDecode):
    async def _on_kv_ready(self, msg: KVReady) -> None:
        die()


def half(views: list[memoryview]) -> list[memoryview]:
    return views[: max(1, len(views) // 2)]


class DiesMidSend(TcpSender):
    def _send_payload(self, sock: socket.socket, views: list[memoryview], deadline: float) -> None:
        send_views(sock, half(views), deadline)
        die()


class StallsMidSendOnce(TcpSender):
    def __init__(self) -> None:
        self.stalled = False

    def _send_payload(self, sock: socket.socket, views: list[memoryview], deadline: float) -> None:
        if self.stalled:
            return super()._send_payload(sock, views, deadline)
        self.stalled = True
        send_views(sock, half(views), deadline)
        sock.settimeout(None)
        sock.recv(1)  # until the decode worker gives up on the transfer and closes the connection
        raise KVTransferError("stalled on purpose (tests/services/faulty_workers.py)")


class DiesMidStream(LayerStream):
    def _send_layer(self, sock: socket.socket, layer: int, first: int, block_ids: list[int], deadline: float) -> None:
        if layer >= self.header.num_layers // 2:
            die()
        super()._send_layer(sock, layer, first, block_ids, deadline)


class PrefillDiesMidTransfer(PrefillWorker):
    def __init__(self, settings: WorkerServiceSettings) -> None:
        super().__init__(settings)
        self.kv.sender = DiesMidSend()
        self.kv.layer_stream = DiesMidStream


class PrefillStallsMidTransfer(PrefillWorker):
    def __init__(self, settings: WorkerServiceSettings) -> None:
        super().__init__(settings)
        self.kv.sender = StallsMidSendOnce()


class DecodeDiesMidTransfer(PreferredDecode):
    def __init__(self, settings: WorkerServiceSettings) -> None:
        super().__init__(settings)
        assert self.kv.receiver is not None, "decode-dies-mid-transfer needs the data port (kv_transport auto or tcp)"
        self.kv.receiver._recv_payload = self._recv_half_and_die  # type: ignore[method-assign]

    @staticmethod
    def _recv_half_and_die(sock: socket.socket, header: TransferHeader, views: list[memoryview],
                           deadline: float) -> None:
        if not header.num_layers:
            recv_into_views(sock, half(views), deadline)
            die()
        while recv_frame(sock, deadline).get("wait"):  # a layered stream: die once its first blocks come
            pass
        recv_into_views(sock, views[:1], deadline)
        die()


def die_at_first(agent: object, method: str, before_s: float = 0.0) -> None:
    """SIGKILL the process at its first call of `agent.method` (NIXL's progress), `before_s`
    after it, the call itself made: by then a decode worker's read is in flight."""
    call = getattr(agent, method)

    def call_then_die(*args: object) -> NoReturn:
        time.sleep(before_s)
        call(*args)
        die()

    setattr(agent, method, call_then_die)


class PrefillDiesMidRead(PrefillWorker):
    """NIXL: dies while the decode worker reads its blocks (it has had the KVReady for 0.2 s)."""

    async def _transfer(self, t: Tracked, decode_id: str, needed: list[int]) -> None:
        assert self.kv.nixl is not None, "prefill-dies-mid-read needs NIXL (kv_transport auto or nixl)"
        die_at_first(self.kv.nixl.agent, "get_new_notifs", before_s=0.2)
        await super()._transfer(t, decode_id, needed)


class DecodeDiesMidRead(PreferredDecode):
    """NIXL: dies right after starting to read a prefill worker's blocks into its reserved ones."""

    async def _on_kv_ready(self, msg: KVReady) -> None:
        assert self.kv.nixl is not None, "decode-dies-mid-read needs NIXL (kv_transport auto or nixl)"
        die_at_first(self.kv.nixl.agent, "check_xfer_state")
        await super()._on_kv_ready(msg)


FAULTS: dict[str, type[Worker]] = {
    "prefill-dies-after-accept": PrefillDiesAfterAccept, "decode-dies-on-kv-ready": DecodeDiesOnKVReady,
    "prefill-dies-mid-transfer": PrefillDiesMidTransfer, "decode-dies-mid-transfer": DecodeDiesMidTransfer,
    "prefill-stalls-mid-transfer": PrefillStallsMidTransfer, "prefill-dies-mid-read": PrefillDiesMidRead,
    "decode-dies-mid-read": DecodeDiesMidRead,
}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in FAULTS:
        raise SystemExit(f"usage: python -m tests.services.faulty_workers {{{','.join(FAULTS)}}}")
    main(FAULTS[sys.argv[1]])
