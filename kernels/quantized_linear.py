"""Linear layers over weights kept in their GGUF block format (Q4_1, Q8_0).

`dequantize` is the PyTorch reference: it widens the blocks to the same float32 values as
gguf's dequantiser, and `quantized_linear_ref` is F.linear over them. `quantized_linear` runs
csrc/quantized_linear.c, float32 in and out, which widens each block in registers as it goes,
so a small batch reads 0.6-1.1 bytes a weight instead of 4 (see the C file for why the weights
it uses are bitwise those of the reference). `quantized_linear_bf16` runs
csrc/quantized_linear_bf16.c, bfloat16 in and out with the weights rounded to bfloat16 as a
bfloat16 model holds them, on CPUs with AVX512-BF16 (`load_bf16`). Both are built on first use
for this CPU (see `kernels.cpu_build`); where one cannot be built, its loader logs why once and
returns None.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.cpu_build import CSRC, load_functions, profiled

SOURCE = CSRC / "quantized_linear.c"
BF16_SOURCE = CSRC / "quantized_linear_bf16.c"
COMPILE_FLAGS = ()
BLOCK = 32
# bytes a block of 32 weights takes, and the C kernel's code for the format
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}
FORMAT_CODES = {"q4_1": 0, "q8_0": 1}
BF16_FORMAT_OFFSET = 2  # the C kernel's code for a format with its weights rounded to bfloat16

_INT64, _INT32, _PTR = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
# out, its row stride, x, its row stride, blocks, bias (or NULL), M, N, K, format code
_PRODUCT_ARGS = [_PTR, _INT64, _PTR, _INT64, _PTR, _PTR, _INT32, _INT32, _INT32, _INT32]
_SIGNATURES = {"quantized_linear": _PRODUCT_ARGS}
_BF16_SIGNATURES = {"quantized_linear_bf16": _PRODUCT_ARGS, "quantized_linear_bf16_available": []}


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


@functools.cache
def load_bf16() -> ctypes.CDLL | None:
    """The bfloat16 kernel, building it on first use; None where this CPU lacks AVX512-BF16 (silently:
    the float32 kernel and oneDNN serve there) or where it cannot be built (logged once)."""
    lib = load_functions(BF16_SOURCE, COMPILE_FLAGS, "the bfloat16 small-batch linear layers over GGUF blocks",
                         _BF16_SIGNATURES)
    return lib if lib is not None and lib.quantized_linear_bf16_available() else None


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
    code = FORMAT_CODES[weight.format] + (BF16_FORMAT_OFFSET if bf16_weights else 0)
    return _product(lib.quantized_linear, "quantized linear kernel", x, torch.float32, weight, bias, code, "2 x")


def quantized_linear_bf16(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in_features] bfloat16 on the CPU, last dim contiguous -> [rows, out_features] bfloat16,
    each weight rounded to bfloat16 as a bfloat16 model holds it; `bias` float32 [out_features] or None.
    The sums are float32, and each output is rounded once (`quantized_linear_ref(x.float(), weight,
    bias, bf16_weights=True).bfloat16()` but for the order of the sums). Checks only what
    `quantized_linear` checks."""
    lib = load_bf16()
    if lib is None:
        raise RuntimeError(f"the bfloat16 quantized linear kernel is not available here (see {BF16_SOURCE})")
    return _product(lib.quantized_linear_bf16, "bfloat16 quantized linear kernel", x, torch.bfloat16, weight, bias,
                    FORMAT_CODES[weight.format], "16 x")


def _product(
    kernel: Callable[..., int], what: str, x: torch.Tensor, dtype: torch.dtype, weight: QuantizedWeight,
    bias: torch.Tensor | None, code: int, scratch_rows: str,
) -> torch.Tensor:
    if x.dtype != dtype or x.dim() != 2 or x.shape[1] != weight.in_features or x.stride(1) != 1:
        raise ValueError(
            f"the {what} takes {str(dtype).removeprefix('torch.')} [rows, {weight.in_features}] with a contiguous "
            f"last dim, got {x.dtype} {list(x.shape)} with strides {x.stride()}"
        )
    rows, out_features = x.shape[0], weight.blocks.shape[0]
    out = torch.empty(rows, out_features, dtype=dtype)
    with profiled(f"llmd::{kernel.__name__}"):
        failed = kernel(
            out.data_ptr(), out_features, x.data_ptr(), x.stride(0), weight.blocks.data_ptr(),
            None if bias is None else bias.data_ptr(), rows, out_features, weight.in_features, code,
        )
    if failed:  # 2 (arguments it does not take) is ruled out by QuantizedWeight's checks
        raise MemoryError(f"the {what} could not allocate scratch for {scratch_rows} {weight.in_features} values")
    return out
