"""Linear layers over weights kept in their GGUF block format (Q4_1, Q8_0), float32 in and out.

`dequantize` is the PyTorch reference: it widens the blocks to the same float32 values as
gguf's dequantiser, and `quantized_linear_ref` is F.linear over them. `quantized_linear` runs
csrc/quantized_linear.c, which widens each block in registers as it goes, so a small batch
reads 0.6-1.1 bytes a weight instead of 4 (see the C file for why the weights it uses are
bitwise those of the reference). Built on first use for this CPU (see `kernels.cpu_build`);
where it cannot be built, `load()` logs why once and returns None.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.cpu_build import CSRC, load_functions, profiled

SOURCE = CSRC / "quantized_linear.c"
COMPILE_FLAGS = ()
BLOCK = 32
# bytes a block of 32 weights takes, and the C kernel's code for the format
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}
FORMAT_CODES = {"q4_1": 0, "q8_0": 1}
BF16_FORMAT_OFFSET = 2  # the C kernel's code for a format with its weights rounded to bfloat16

_INT64, _INT32, _PTR = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
# out, its row stride, x, its row stride, blocks, bias (or NULL), M, N, K, format code
_SIGNATURES = {"quantized_linear": [_PTR, _INT64, _PTR, _INT64, _PTR, _PTR, _INT32, _INT32, _INT32, _INT32]}


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A [out_features, in_features] weight as rows of GGUF blocks: uint8 [out_features, in_features / 32 * block bytes]."""

    format: str
    blocks: torch.Tensor
    in_features: int

    def __post_init__(self) -> None:
        if self.format not in BLOCK_BYTES:
            raise ValueError(f"block format {self.format!r} is not one of {sorted(BLOCK_BYTES)}")
        if self.in_features % BLOCK:
            raise ValueError(f"in_features must be a multiple of {BLOCK}, got {self.in_features}")
        row_bytes = self.in_features // BLOCK * BLOCK_BYTES[self.format]
        shape_ok = self.blocks.dim() == 2 and self.blocks.shape[1] == row_bytes
        if self.blocks.dtype != torch.uint8 or not shape_ok or not self.blocks.is_contiguous():
            raise ValueError(
                f"{self.format} blocks for {self.in_features} inputs must be contiguous uint8 [rows, {row_bytes}], "
                f"got {self.blocks.dtype} {list(self.blocks.shape)} with strides {self.blocks.stride()}"
            )

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    def num_bytes(self) -> int:
        return self.blocks.numel()

    @staticmethod
    def stack(weights: list[QuantizedWeight]) -> QuantizedWeight:
        """The weights' rows one after another: one product for several projections."""
        formats = {w.format for w in weights}
        inputs = {w.in_features for w in weights}
        if len(formats) != 1 or len(inputs) != 1:
            raise ValueError(f"cannot stack weights of formats {sorted(formats)} and in_features {sorted(inputs)}")
        return QuantizedWeight(formats.pop(), torch.cat([w.blocks for w in weights]).contiguous(), inputs.pop())


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """float32 [out_features, in_features], bitwise what gguf's dequantiser gives."""
    rows = weight.out_features
    blocks = weight.blocks.view(rows, -1, BLOCK_BYTES[weight.format])

    def half(start: int) -> torch.Tensor:
        return blocks[..., start:start + 2].contiguous().view(torch.float16).float()

    if weight.format == "q4_1":
        nibbles = blocks[..., 4:]
        q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).float()
        return (half(0) * q + half(2)).view(rows, weight.in_features)
    q = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (half(0) * q).view(rows, weight.in_features)


def quantized_linear_ref(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, bf16_weights: bool = False
) -> torch.Tensor:
    w = dequantize(weight)
    return F.linear(x, w.bfloat16().float() if bf16_weights else w, bias)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel, building it on first use; None (logged once) where it cannot be built."""
    return load_functions(SOURCE, COMPILE_FLAGS, "the small-batch linear layers over GGUF blocks", _SIGNATURES)


def quantized_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, bf16_weights: bool = False
) -> torch.Tensor:
    """x [rows, in_features] float32 on the CPU, last dim contiguous -> [rows, out_features] float32.
    `bf16_weights`: each weight rounded to bfloat16 first, as a bfloat16 model holds it.

    Called once per layer per decode step, so it checks only what would make the C code
    read out of bounds: the rest (a float32 bias of out_features) is the caller's promise.
    """
    lib = load()
    if lib is None:
        raise RuntimeError(f"the quantized linear kernel is not built (see the warning logged for {SOURCE})")
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != weight.in_features or x.stride(1) != 1:
        raise ValueError(
            f"the quantized linear kernel takes float32 [rows, {weight.in_features}] with a contiguous last dim, "
            f"got {x.dtype} {list(x.shape)} with strides {x.stride()}"
        )
    rows, out_features = x.shape[0], weight.blocks.shape[0]
    out = torch.empty(rows, out_features, dtype=torch.float32)
    with profiled("llmd::quantized_linear"):
        failed = lib.quantized_linear(
            out.data_ptr(), out_features, x.data_ptr(), x.stride(0), weight.blocks.data_ptr(),
            None if bias is None else bias.data_ptr(), rows, out_features, weight.in_features,
            FORMAT_CODES[weight.format] + (BF16_FORMAT_OFFSET if bf16_weights else 0),
        )
    if failed:  # 2 (arguments it does not take) is ruled out by QuantizedWeight's checks
        raise MemoryError(f"the quantized linear kernel could not allocate scratch for 2 x {weight.in_features} floats")
    return out
