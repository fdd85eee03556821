"""What a decode worker holds for an offered request until its KV has arrived, and what a
transfer over the data port may write into it."""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass

import torch

from services.kv_transfer import KVTransferError, TransferHeader
from services.kv_transfer.base import num_bytes, tensor_bytes
from shared.engine.engine import Engine
from shared.protocol import HandoffOffer


@dataclass(slots=True, eq=False)
class Reservation:
    """Blocks held for an offered request until its KV arrives."""

    offer: HandoffOffer
    needed_blocks: list[int]  # block-table positions the KV must be sent for
    block_ids: list[int]  # the pool blocks at those positions
    expiry: asyncio.TimerHandle
    token: str  # what a transfer over the data port must show; empty: this worker has no data port
    receiving: bool = False  # a transfer over the data port is writing the blocks
    landed: bool = False  # ... and wrote every byte: KVReady commits them
    staging: torch.Tensor | None = None  # where the bytes landed instead, for a pool not in host memory

    def claim(self, header: TransferHeader, host: str, engine: Engine) -> list[memoryview]:
        """The memory a transfer over the data port writes: these blocks, and only for this
        reservation's token, sender and sizes, once. Raises KVTransferError otherwise."""
        if not self.token or not secrets.compare_digest(self.token.encode(), header.token.encode()):
            raise KVTransferError(f"wrong transfer token for {header.req_id!r} from {host}")
        if header.prefill_id != self.offer.prefill_id or self.receiving or self.landed:
            raise KVTransferError(f"the KV of {header.req_id!r} is {self.offer.prefill_id}'s to send, once")
        shape = engine.kv_blocks_shape(len(self.block_ids))
        expected = num_bytes(shape, engine.kv_dtype)
        if header.num_blocks != len(self.block_ids) or header.num_bytes != expected:
            raise KVTransferError(
                f"{header.num_blocks} blocks of {header.num_bytes} bytes announced for {header.req_id!r}; "
                f"its reservation holds {len(self.block_ids)} blocks of {expected} bytes"
            )
        if header.num_layers not in (0, shape[1]):
            raise KVTransferError(f"{header.num_layers} layers announced for {header.req_id!r}; this model has {shape[1]}")
        views = engine.kv_block_views(self.block_ids)
        if views is None:  # a pool in device memory: the bytes land on the host, KVReady writes them
            self.staging = torch.empty(shape, dtype=engine.kv_dtype)
            # in the pool's order (per block, per layer, K then V), so a layered transfer finds its pieces
            whole, num_pieces = tensor_bytes(self.staging), len(self.block_ids) * shape[1] * 2
            piece = len(whole) // num_pieces
            views = [whole[i * piece : (i + 1) * piece] for i in range(num_pieces)]
        self.receiving = True
        return views
