"""Which transport each transfer takes, chosen per pair of workers from what both speak:

    1. shm    the decode worker's marker is in this worker's tmpfs directory (one host)
    2. tcp    the decode worker listens on a data port (its heartbeat's kv_host:kv_port) and its
              accept carried a transfer token
    3. redis  nothing else: works anywhere, slowly, and stalls every token stream while it
              carries the bytes, so it is logged

LLMD_WORKER__KV_TRANSPORT forces one (shm or tcp, else Redis; or redis). Reads and discards go
by the location a KVReady names, so a reader takes whatever the writer chose.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass

import redis.asyncio as aioredis
import torch

from services.kv_transfer.base import KVConnector, KVSource, KVTransferError, tensor_bytes
from services.kv_transfer.redis import RedisKVConnector
from services.kv_transfer.shm import SHM_SCHEME, SharedMemoryKVConnector
from services.kv_transfer.tcp import TCP_SCHEME, Claim, IsPeer, Settle, TcpReceiver, TcpSender, TransferHeader
from shared.settings import WorkerSettings
from shared.streams import Keys

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class KVPeer:
    """What a prefill worker knows of the decode worker it hands a request to: from that worker's
    heartbeat (where its data port is) and its accept (shared-memory marker, transfer token)."""

    worker_id: str
    shm_token: str = ""
    tcp_host: str = ""
    tcp_port: int | None = None
    tcp_token: str = ""


class KVTransports:
    """One worker's transports. Every worker can send over each it speaks; a decode worker also
    receives over TCP once `listen` gave it the callbacks that check transfers against its
    reservations."""

    def __init__(
        self, settings: WorkerSettings, worker_id: str, redis: RedisKVConnector, shm: SharedMemoryKVConnector | None,
    ) -> None:
        self.settings = settings
        self.worker_id = worker_id
        self.redis = redis
        self.shm = shm
        self.speaks_tcp = settings.kv_transport in ("auto", "tcp")
        self.sender = TcpSender()
        self.receiver: TcpReceiver | None = None
        self.host = advertised_host(settings) if self.speaks_tcp else ""
        self.port: int | None = None  # the data port where this worker receives KV, once open
        self._warned: set[str] = set()

    def listen(self, is_peer: IsPeer, claim: Claim, settle: Settle) -> None:
        """Receive over TCP (decode workers), on the data port `start` opens."""
        if self.speaks_tcp:
            cfg = self.settings
            self.receiver = TcpReceiver(cfg.kv_tcp_host, cfg.kv_tcp_port, cfg.handoff_timeout_s, is_peer, claim, settle)

    async def start(self) -> None:
        """Advertise the shared-memory marker (without a usable directory: no shm) and open the data port."""
        if self.shm is not None and not self.shm.advertise():
            self.shm = None
        if self.receiver is not None:
            self.port = await self.receiver.start()
            logger.info("KV data port %s:%d (advertised as %s)", self.settings.kv_tcp_host, self.port, self.host)

    async def close(self) -> None:
        if self.receiver is not None:
            await self.receiver.close()
        if self.shm is not None:
            self.shm.withdraw()

    def refresh(self) -> None:
        if self.shm is not None:
            self.shm.refresh()

    def sweep(self) -> None:
        """Remove shared-memory transfers and markers that outlived their TTL (their worker died)."""
        if self.shm is not None and (removed := self.shm.sweep()):
            logger.warning("removed %d abandoned KV transfers or markers from %s", removed, self.shm.directory)

    # -- what the heartbeat and the accept advertise ------------------------------------------

    @property
    def names(self) -> list[str]:
        """The transports this worker speaks, best first (WorkerStatus.kv_transports)."""
        return [*(["shm"] if self.shm is not None else []), *(["tcp"] if self.speaks_tcp else []), "redis"]

    @property
    def shm_token(self) -> str:
        """This worker's shared-memory marker (HandoffAccept.kv_shm); empty: no shared memory."""
        return "" if self.shm is None else self.shm.token

    # -- one transfer --------------------------------------------------------------------------

    def choose(self, peer: KVPeer) -> str:
        if self.shm is not None and self.shm.shares_with(peer.shm_token):
            return "shm"
        if self._reaches_by_tcp(peer):
            return "tcp"
        if self.settings.kv_transport != "redis" and peer.worker_id not in self._warned:
            self._warned.add(peer.worker_id)
            logger.warning(
                "KV to %s goes through Redis, which stalls every token stream while it carries the bytes: the two "
                "workers share no tmpfs and %s (see docs/deploy.md)", peer.worker_id,
                "it has no data port" if self.speaks_tcp else f"this worker's kv_transport is {self.settings.kv_transport}",
            )
        return "redis"

    def _reaches_by_tcp(self, peer: KVPeer) -> bool:
        return self.speaks_tcp and peer.tcp_port is not None and bool(peer.tcp_host) and bool(peer.tcp_token)

    async def put(self, req_id: str, attempt: int, source: KVSource, peer: KVPeer) -> str:
        """Send one transfer to `peer`; returns the location its KVReady names. A TCP transfer
        that fails raises KVTransferError: its bytes may be half in the peer's blocks, which the
        peer has freed, so the request must be offered again rather than sent another way."""
        transport = self.choose(peer)
        if transport == "shm":
            assert self.shm is not None
            try:
                return await self.shm.put_filled(req_id, attempt, source.shape, source.dtype, source.read)
            except OSError as e:
                transport = "tcp" if self._reaches_by_tcp(peer) else "redis"
                logger.warning("KV of %s goes through %s: writing it to %s failed (%s)", req_id,
                               "the data port" if transport == "tcp" else "Redis", self.shm.directory, e)
        if transport == "tcp":
            assert peer.tcp_port is not None
            header = TransferHeader(peer.tcp_token, req_id, attempt, self.worker_id, source.shape[0], source.num_bytes)
            await asyncio.to_thread(self._send_tcp, peer.tcp_host, peer.tcp_port, header, source)
            return f"{TCP_SCHEME}{peer.tcp_host}:{peer.tcp_port}"
        return await self.redis.put(req_id, attempt, await asyncio.to_thread(source.read, None))

    def _send_tcp(self, host: str, port: int, header: TransferHeader, source: KVSource) -> None:
        views = source.views()
        if views is None:  # a pool in device memory: one copy to the host first
            views = [tensor_bytes(source.read(None))]
        self.sender.send(host, port, header, views, self.settings.handoff_timeout_s)

    async def stop_receiving(self, req_id: str, attempt: int) -> None:
        """End a TCP transfer into this worker's blocks, if one runs; returns once nothing writes them."""
        if self.receiver is not None:
            await self.receiver.stop(req_id, attempt)

    @staticmethod
    def transport_of(location: str) -> str:
        """The transport a location's bytes went through, as the metrics label it."""
        if location.startswith(SHM_SCHEME):
            return "shm"
        return "tcp" if location.startswith(TCP_SCHEME) else "redis"

    def _at(self, location: str) -> KVConnector:
        if location.startswith(SHM_SCHEME):
            if self.shm is None:
                raise KVTransferError(f"KV transfer {location!r} is in shared memory, which this worker does not use")
            return self.shm
        if location.startswith(TCP_SCHEME):
            raise KVTransferError(f"KV transfer {location!r} went into the reserved blocks; there is nothing to get")
        return self.redis

    async def get(self, location: str) -> torch.Tensor:
        return await self._at(location).get(location)

    async def discard(self, location: str) -> None:
        if location and not location.startswith(TCP_SCHEME):
            await self._at(location).discard(location)


def advertised_host(settings: WorkerSettings) -> str:
    """The address other workers reach this one at, and see its connections come from, as an IP."""
    host = settings.kv_tcp_advertise or settings.kv_tcp_host
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise ValueError(f"the KV address {host!r} does not resolve ({e}); set LLMD_WORKER__KV_TCP_ADVERTISE") from e


def kv_transports(redis: aioredis.Redis, keys: Keys, namespace: str, settings: WorkerSettings,
                  worker_id: str) -> KVTransports:
    """A worker's transports: Redis always; shared memory in kv_shm_dir unless it is empty or
    another transport is forced; TCP unless shm or redis is forced. The blobs of a transfer
    outlive a handoff's timeout so that a slow reader still finds them."""
    ttl_s = settings.handoff_timeout_s * 3
    use_shm = settings.kv_shm_dir and settings.kv_transport in ("auto", "shm")
    shm = SharedMemoryKVConnector(settings.kv_shm_dir, namespace, ttl_s) if use_shm else None
    return KVTransports(settings, worker_id, RedisKVConnector(redis, keys, ttl_s), shm)
