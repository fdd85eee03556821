"""Moves a request's KV blocks from the prefill worker that computed them to a decode worker.

One module per transport behind one seam: the prefill side `put`s a transfer and sends the
returned location in KVReady; the decode side takes it from there and commits the blocks.

    base.py    the connector seam (`KVConnector`), `KVSource`, the blob header
    shm.py     a tmpfs both workers see (one host)
    nixl.py    NIXL (UCX): the decode worker reads pool blocks into its reserved pool blocks
    tcp.py     a socket of our own, straight from pool blocks into reserved pool blocks
    tcp_layers.py  the same socket, a long prompt's blocks layer by layer while it prefills
    redis.py   Redis hashes: the last resort
    select.py  `KVTransports`: which one each pair of workers uses
"""

from services.kv_transfer.base import KVConnector, KVSource, KVTransferError
from services.kv_transfer.nixl import NIXL_SCHEME
from services.kv_transfer.redis import RedisKVConnector
from services.kv_transfer.select import KVPeer, KVTransports, kv_transports
from services.kv_transfer.shm import SHM_SCHEME, SharedMemoryKVConnector
from services.kv_transfer.tcp import TCP_SCHEME, TransferHeader

__all__ = [
    "NIXL_SCHEME", "SHM_SCHEME", "TCP_SCHEME", "KVConnector", "KVPeer", "KVSource", "KVTransferError", "KVTransports",
    "RedisKVConnector", "SharedMemoryKVConnector", "TransferHeader", "kv_transports",
]
