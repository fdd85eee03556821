"""What every KV transport shares: the connector seam, its error, and the header that says what
tensor a transfer's bytes are.

A transfer's bytes are the blocks as `Engine.read_blocks` lays them out: shape
`Engine.kv_blocks_shape(n)`, dtype `Engine.kv_dtype`, C order. Transports treat them as opaque
bytes of that shape and dtype (a quantised cache may carry scales among them).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgpack
import torch

_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int32)
}


class KVTransferError(RuntimeError):
    """The bytes of a transfer are gone (expired, discarded, the peer died) or do not describe a tensor."""


class KVConnector(ABC):
    @abstractmethod
    async def put(self, req_id: str, attempt: int, tensor: torch.Tensor) -> str:
        """Store a tensor for one transfer; returns the location a reader passes to `get`."""

    @abstractmethod
    async def get(self, location: str) -> torch.Tensor:
        """The tensor stored at `location`, on the CPU; raises KVTransferError if it is gone."""

    @abstractmethod
    async def discard(self, location: str) -> None:
        """Free the bytes of a finished or abandoned transfer; a missing location is not an error."""


@dataclass(slots=True)
class KVSource:
    """One transfer's blocks on the sending side. `read(out)` copies them into `out` (a tensor of
    `shape` and `dtype`) or, given None, returns a tensor of its own; `views()` gives the pool's
    own bytes in the same order, as writable memoryviews, or None where the pool is not in host
    memory. Both may run on a helper thread (see `Engine.read_blocks`). `block_ids`: the pool
    blocks themselves, for a peer that reads them (NIXL)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[torch.Tensor | None], torch.Tensor]
    views: Callable[[], list[memoryview] | None]
    block_ids: list[int] = field(default_factory=list)

    @property
    def num_bytes(self) -> int:
        return num_bytes(self.shape, self.dtype)


def num_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise TypeError(f"KV tensors of dtype {dtype} cannot be transferred")
    return name


def dtype_named(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise KVTransferError(f"unknown KV dtype {name!r}; known: {sorted(_DTYPES)}")
    return _DTYPES[name]


def pack_header(dtype: torch.dtype, shape: Sequence[int], num_chunks: int) -> bytes:
    return msgpack.packb({"dtype": dtype_name(dtype), "shape": list(shape), "chunks": num_chunks})


def unpack_header(header: bytes) -> tuple[torch.dtype, tuple[int, ...], int]:
    """(dtype, shape, number of data chunks) of a blob's header."""
    try:
        meta = msgpack.unpackb(header)
        return _DTYPES[meta["dtype"]], tuple(int(d) for d in meta["shape"]), int(meta["chunks"])
    except (ValueError, KeyError, TypeError) as e:
        raise KVTransferError(f"malformed KV header: {e!r}") from e


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor, without a copy when it is already contiguous."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)  # [numel]
    return memoryview(flat.view(torch.uint8).numpy())
