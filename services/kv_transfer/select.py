"""Which transport each transfer takes, chosen per pair of workers from what both speak:

    1. shm    the decode worker's marker is in this worker's tmpfs directory (one host)
    2. nixl   both workers have NIXL (an optional dependency) and a pool in host memory, and the
              decode worker's heartbeat carries its agent metadata (kv_nixl)
    3. tcp    the decode worker listens on a data port (its heartbeat's kv_host:kv_port) and its
              accept carried a transfer token
    4. redis  nothing else: works anywhere, slowly, and stalls every token stream while it
              carries the bytes, so it is logged

LLMD_WORKER__KV_TRANSPORT forces one (shm, nixl or tcp, else Redis; or redis). Reads and discards
go by the location a KVReady names, so a reader takes whatever the writer chose.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
import torch

from services.kv_transfer.base import KVConnector, KVSource, KVTransferError, num_bytes, tensor_bytes
from services.kv_transfer.nixl import NIXL_SCHEME, NixlTransport, location_of, nixl_api
from services.kv_transfer.redis import RedisKVConnector
from services.kv_transfer.shm import SHM_SCHEME, SharedMemoryKVConnector
from services.kv_transfer.tcp import TCP_SCHEME, Claim, IsPeer, Settle, TcpReceiver, TcpSender, TransferHeader
from services.kv_transfer.tcp_layers import LayerStream
from shared.engine.engine import Engine
from shared.protocol import WorkerStatus
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
    nixl: bool = False  # its heartbeat carries NIXL agent metadata


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
        self.layer_stream = LayerStream
        self.receiver: TcpReceiver | None = None
        redis_host = str(redis.redis.connection_pool.connection_kwargs.get("host", ""))
        address = advertised_host(settings, redis_host) if settings.kv_transport in ("auto", "tcp", "nixl") else ""
        self.nixl = nixl_transport(settings, worker_id, address)
        self.host = address if self.speaks_tcp else ""
        self.port: int | None = None  # the data port where this worker receives KV, once open
        self.streams_layers = False  # sends long prompts' KV layer by layer (tcp_layers.py); see use_pool
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

    def use_pool(self, pool: memoryview | None, block_views: Callable[[list[int]], list[memoryview] | None]) -> None:
        """Register the engine's KV pool with NIXL (`Engine.kv_pool_view`, `Engine.kv_block_views`);
        a pool not in host memory goes by the other transports, and is not streamed layer by layer."""
        self.streams_layers = pool is not None and self.speaks_tcp and self.settings.kv_stream_min_tokens > 0
        if self.nixl is None:
            return
        if pool is None:
            logger.info("no KV handoffs through NIXL: the KV pool is not in host memory")
            self.nixl = None
            return
        try:
            self.nixl.register(pool, block_views)
        except Exception as e:  # NIXL's and UCX's own errors: no backend, memory that cannot be registered
            if self.settings.kv_transport == "nixl":
                raise
            logger.warning("no KV handoffs through NIXL: setting it up failed (%s)", e)
            self.nixl = None
            return
        logger.info("KV handoffs through NIXL (UCX on %s): %.0f MiB of pool registered",
                    self.nixl.devices or "every network device", len(pool) / 2**20)

    async def close(self) -> None:
        if self.nixl is not None:
            await self.nixl.close()
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
        return [*(["shm"] if self.shm is not None else []), *(["nixl"] if self.nixl_advertisement else []),
                *(["tcp"] if self.speaks_tcp else []), "redis"]

    @property
    def nixl_advertisement(self) -> bytes:
        """This worker's NIXL agent metadata and pool layout (WorkerStatus.kv_nixl); empty: no NIXL."""
        return b"" if self.nixl is None else self.nixl.advertisement

    @property
    def shm_token(self) -> str:
        """This worker's shared-memory marker (HandoffAccept.kv_shm); empty: no shared memory."""
        return "" if self.shm is None else self.shm.token

    # -- one transfer --------------------------------------------------------------------------

    def choose(self, peer: KVPeer) -> str:
        transport = self._best(peer)
        if transport == "redis" and self.settings.kv_transport != "redis" and peer.worker_id not in self._warned:
            self._warned.add(peer.worker_id)
            logger.warning(
                "KV to %s goes through Redis, which stalls every token stream while it carries the bytes: the two "
                "workers share no tmpfs and %s (see docs/deploy.md)", peer.worker_id,
                "it has no data port nor NIXL" if self.speaks_tcp else f"this worker's kv_transport is {self.settings.kv_transport}",
            )
        return transport

    def _best(self, peer: KVPeer) -> str:
        if self.shm is not None and self.shm.shares_with(peer.shm_token):
            return "shm"
        if peer.nixl and self.nixl_advertisement:
            return "nixl"
        if self._reaches_by_tcp(peer):
            return "tcp"
        return "redis"

    def streams_to(self, status: WorkerStatus) -> bool:
        """Whether KV for this decode worker goes over its data port, so a long prompt's can be
        streamed layer by layer: no shared tmpfs, no NIXL in common (its heartbeat says)."""
        neither_shm_nor_nixl = self._best(KVPeer(status.worker_id, status.kv_shm, nixl=bool(status.kv_nixl))) == "redis"
        return self.streams_layers and neither_shm_nor_nixl and status.kv_port is not None and bool(status.kv_host)

    def stream(self, req_id: str, attempt: int, peer: KVPeer, needed: list[int], engine: Engine) -> LayerStream:
        """A layer-by-layer transfer of the blocks at table positions `needed` to `peer`'s data port
        (`streams_to` it); `LayerStream.run` sends it."""
        assert peer.tcp_port is not None
        shape = engine.kv_blocks_shape(len(needed))
        header = TransferHeader(peer.tcp_token, req_id, attempt, self.worker_id, len(needed), num_bytes(shape, engine.kv_dtype),
                                num_layers=shape[1])
        return self.layer_stream(peer.tcp_host, peer.tcp_port, header, needed, engine.block_size, engine.kv_layer_views,
                           self.settings.handoff_timeout_s)

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
        if transport == "nixl":  # the decode worker reads the blocks: `until_read` waits for that
            return location_of(self.worker_id, source.block_ids)
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

    async def until_read(self, location: str, decode_id: str, req_id: str, attempt: int) -> None:
        """Once KVReady is sent: hold the blocks until the decode worker has read them (NIXL);
        other transports moved them already."""
        if location.startswith(NIXL_SCHEME):
            assert self.nixl is not None
            await self.nixl.until_read(decode_id, req_id, attempt)

    async def read_into(self, location: str, peer: str, advertisement: bytes, block_ids: list[int], req_id: str,
                        attempt: int) -> None:
        """The decode side of NIXL: read the blocks of `peer` that `location` names into these
        reserved ones, with the agent metadata of its heartbeat."""
        if self.nixl is None:
            raise KVTransferError(f"KV transfer {location!r} is a NIXL read, which this worker cannot make")
        await self.nixl.read(location, peer, advertisement, block_ids, req_id, attempt)

    async def stop_receiving(self, req_id: str, attempt: int) -> None:
        """End a transfer into this worker's blocks (TCP, NIXL), if one runs; returns once nothing writes them."""
        if self.receiver is not None:
            await self.receiver.stop(req_id, attempt)
        if self.nixl is not None:
            await self.nixl.stop(req_id, attempt)

    @staticmethod
    def transport_of(location: str) -> str:
        """The transport a location's bytes went through, as the metrics label it."""
        for scheme, transport in ((SHM_SCHEME, "shm"), (NIXL_SCHEME, "nixl"), (TCP_SCHEME, "tcp")):
            if location.startswith(scheme):
                return transport
        return "redis"

    def _at(self, location: str) -> KVConnector:
        if location.startswith(SHM_SCHEME):
            if self.shm is None:
                raise KVTransferError(f"KV transfer {location!r} is in shared memory, which this worker does not use")
            return self.shm
        if location.startswith((TCP_SCHEME, NIXL_SCHEME)):
            raise KVTransferError(f"KV transfer {location!r} goes into the reserved blocks; there is nothing to get")
        return self.redis

    async def get(self, location: str) -> torch.Tensor:
        return await self._at(location).get(location)

    async def discard(self, location: str) -> None:
        if location and not location.startswith((TCP_SCHEME, NIXL_SCHEME)):
            await self._at(location).discard(location)


def advertised_host(settings: WorkerSettings, redis_host: str = "") -> str:
    """The address other workers reach this one at, and see its connections come from, as an IP.
    Listening on every address (0.0.0.0) with none advertised: this host's own (`host_address`)."""
    host = settings.kv_tcp_advertise or settings.kv_tcp_host
    if host in ("", "0.0.0.0", "::"):
        return host_address(redis_host)
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise ValueError(f"the KV address {host!r} does not resolve ({e}); set LLMD_WORKER__KV_TCP_ADVERTISE") from e


def host_address(redis_host: str) -> str:
    """What the host's name resolves to, unless that is a loopback address, as /etc/hosts makes it on
    many machines (127.0.1.1 on Debian, 127.0.0.1 on some VMs): then the address this host reaches
    Redis from, which every worker reaches, so other hosts reach this one at it too."""
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError:
        address = ""
    if address and not ipaddress.ip_address(address).is_loopback:
        return address
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(redis_host or "127.0.0.1"), 9))  # picks the route; sends nothing
            return str(probe.getsockname()[0])
    except OSError as e:
        raise ValueError(f"this host's name {name!r} resolves to {address or 'nothing'} and no route to Redis at "
                         f"{redis_host!r} shows its address ({e}); set LLMD_WORKER__KV_TCP_ADVERTISE") from e


def nixl_transport(settings: WorkerSettings, worker_id: str, address: str) -> NixlTransport | None:
    """NIXL where it is installed and not ruled out by a forced transport; forced without it: an error.
    `address`: this worker's advertised one (`advertised_host`)."""
    if settings.kv_transport not in ("auto", "nixl"):
        return None
    if nixl_api() is None:
        if settings.kv_transport == "nixl":
            raise ValueError("LLMD_WORKER__KV_TRANSPORT is nixl, but NIXL is not installed (pip install nixl-cu12, "
                             "or pip install -e '.[nixl]')")
        return None
    # like the data port: on loopback unless the deployment opens its KV address to the network
    # (UCX would otherwise listen on every interface)
    loopback = ipaddress.ip_address(address).is_loopback
    return NixlTransport(worker_id, settings.handoff_timeout_s, devices="lo" if loopback else "")


def kv_transports(redis: aioredis.Redis, keys: Keys, namespace: str, settings: WorkerSettings,
                  worker_id: str) -> KVTransports:
    """A worker's transports: Redis always; shared memory in kv_shm_dir unless it is empty or
    another transport is forced; TCP unless shm or redis is forced. The blobs of a transfer
    outlive a handoff's timeout so that a slow reader still finds them."""
    ttl_s = settings.handoff_timeout_s * 3
    use_shm = settings.kv_shm_dir and settings.kv_transport in ("auto", "shm")
    shm = SharedMemoryKVConnector(settings.kv_shm_dir, namespace, ttl_s) if use_shm else None
    return KVTransports(settings, worker_id, RedisKVConnector(redis, keys, ttl_s), shm)
