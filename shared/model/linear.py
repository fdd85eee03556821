"""y = x W^T + b, with W packed once for oneDNN where that is faster than plain F.linear.

On the CPU in float32, F.linear calls MKL, which on a 2-core AMD EPYC (Zen 3, AVX2)
runs the LM head (49152 x 576) 2.3x slower at batch 64, and the MLP's
gate/up projection 2x slower at batch 16, than oneDNN with the weight reordered once into
its blocked layout; no shape measured was slower by more than a few microseconds. So the
weights are packed at load and every call goes through oneDNN's linear. In bfloat16 on a CPU
with native bf16 (AMX) the packed weight is also faster: 1.4-2x at decode batches 1-64
on a 2-core Xeon with AMX (the LM head 1.9x at batch 64), even at prefill sizes of
512-2048 rows. Elsewhere (CUDA, bf16 emulated, a torch without those ops) the plain
weight and F.linear are used.

oneDNN sums in another order than MKL, so logits differ from transformers' (which uses
F.linear) by float rounding (about 1e-5); greedy output stays token-identical.

Where the weight came as Q4_1 or Q8_0 blocks (a GGUF), on the CPU, products of up to
QUANTIZED_MAX_ROWS rows (decode steps) run `kernels.quantized_linear` over the blocks
instead: the same float32 weights, read at 0.6-1.1 bytes each instead of 4, which is what a
small batch waits for. Above that the packed float32 weight is faster (the product is bound
by arithmetic, and oneDNN's is better than widening blocks on the fly). A bfloat16 model does
the same up to QUANTIZED_MAX_ROWS_BF16 rows, the kernel rounding each weight to bfloat16 as the
model's copy is rounded: on a 2-core Xeon with AMX the model's products took 13.4-13.8 /
14.7 / 15.5-16.0 ms a pass at 1 / 2 / 3 rows against oneDNN's 16.1-16.6 on the 2 bytes a weight,
and 17.3-20.1 against 16.4-17.0 at 4 rows. On a CPU with AVX512-BF16 but no AMX (AMD's Zen 4
and 5), a bfloat16 model's products go instead to `kernels.quantized_linear.quantized_linear_bf16`,
which multiplies the rounded weights on the CPU's bfloat16 dot products, up to
BF16_KERNEL_MAX_ROWS rows on two threads or more and BF16_KERNEL_MAX_ROWS_ONE_THREAD on one
(see its C file for the measurements; on one thread it widens the blocks no faster than oneDNN
streams the 2 bytes, on two it does). With AMX, oneDNN multiplies on the tile unit and the
float32 kernel's crossover above stands.

At prefill sizes on an AVX2 CPU, float32, the layers' products of at least PLAIN_MIN_ROWS rows
go back to F.linear (MKL) on a plain copy of the weight: on a 2-core EPYC (Zen 3, AVX2)
MKL took 9-13% less time than oneDNN for the model's 210 layer products at
96-2,048 rows on one core, and 7-11% less at 512-1,024 rows on two, which made the guide's burst
about 10% faster end to end (the prefill worker's core sets its pace). Below 256 rows on two
threads oneDNN was as fast or faster (26% at 64 rows), so decode batches stay with it. The plain
copy costs the layers' float32 weights once more (425 MB for the default model); the LM head,
whose products are one row per request, keeps none. Elsewhere (AVX-512, bf16) this was not
measured, and every product of more than QUANTIZED_MAX_ROWS rows stays with oneDNN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import quantized_linear as block_kernel
from kernels.cpu_build import cpu_has_amx
from kernels.quantized_linear import QuantizedWeight

# the most rows a product sends to the block kernel: about where both products are bound by
# arithmetic and oneDNN's becomes as fast. Measured on 2-core AVX2 EPYCs (docs/kernels.md), where
# oneDNN's float32 product is 8 lanes wide like the kernel's; with AVX-512 oneDNN's lanes are twice
# as wide, and the bound stays at the 24 rows chosen before the kernel's tiles kept their loads in
# registers (the crossover there is not measured)
QUANTIZED_MAX_ROWS = 32 if torch.backends.cpu.get_cpu_capability() == "AVX2" else 24
# against oneDNN's bfloat16 products, which read half the bytes of float32 and run on AMX or
# AVX512-BF16, and with each weight rounded to bfloat16 as it is widened (about 3 ms of a pass
# over the model's products): the crossover measured on a 2-core Xeon with AMX lies between 3
# and 4 rows (`python -m bench.linear_products --dtype bfloat16`)
QUANTIZED_MAX_ROWS_BF16 = 3
# the most rows a bfloat16 product sends to the bfloat16 block kernel (`bf16_kernel_applies`), on two
# threads or more and on one: up to where whole decode steps on a 2-core Zen 4 still got faster with
# it (alone, the products gain further, to 12 rows on two threads: see the kernel's C file)
BF16_KERNEL_MAX_ROWS = 8
BF16_KERNEL_MAX_ROWS_ONE_THREAD = 3
# the fewest rows a layer's product sends to MKL where `plain_products_faster` (prefill sizes)
PLAIN_MIN_ROWS = 256


def onednn_packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16:
        return ops._is_mkldnn_bf16_supported()
    return dtype == torch.float32


def plain_products_faster(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether MKL (F.linear on the plain weight) beats the oneDNN-packed one at PLAIN_MIN_ROWS rows
    and more here: float32 on an AVX2 CPU, where it was measured (see the module's docstring)."""
    return (
        dtype == torch.float32 and onednn_packing_available(dtype, device)
        and torch.backends.cpu.get_cpu_capability() == "AVX2"
    )


def quantized_kernel_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `Linear` can run block-format weights here: float32 or bfloat16 on the CPU, with the kernel built."""
    return dtype in (torch.float32, torch.bfloat16) and device.type == "cpu" and block_kernel.load() is not None


def bf16_kernel_applies(dtype: torch.dtype) -> bool:
    """Whether a `Linear` of this dtype with blocks sends its small products to the bfloat16 block kernel:
    bfloat16 on a CPU with AVX512-BF16 (the kernel loads) and no AMX."""
    return dtype == torch.bfloat16 and not cpu_has_amx() and block_kernel.load_bf16() is not None


def quantized_max_rows(dtype: torch.dtype) -> int:
    """The most rows a product of this dtype sends to a block kernel (on any number of threads)."""
    if bf16_kernel_applies(dtype):
        return BF16_KERNEL_MAX_ROWS
    return QUANTIZED_MAX_ROWS_BF16 if dtype == torch.bfloat16 else QUANTIZED_MAX_ROWS


def block_rows_text(dtype: torch.dtype) -> str:
    """For the log: the products of this dtype a block kernel takes."""
    if bf16_kernel_applies(dtype):
        return (f"{BF16_KERNEL_MAX_ROWS} rows ({BF16_KERNEL_MAX_ROWS_ONE_THREAD} on one thread) "
                "on the bfloat16 dot products")
    return f"{quantized_max_rows(dtype)} rows"


class Linear:
    __slots__ = ("weight", "bias", "packed", "quantized", "plain", "quantized_max_rows", "bf16_kernel")

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool, quantized: QuantizedWeight | None = None,
        keep_plain: bool = False,
    ) -> None:
        """`weight` [out_features, in_features]; `pack` reorders it for oneDNN (CPU float32, or bf16 where native);
        `quantized`: the same weight as blocks, for small products (see `quantized_kernel_available`);
        `keep_plain`: beside the packed weight, the plain one for products of PLAIN_MIN_ROWS rows and more
        (see `plain_products_faster`)."""
        if quantized is not None and (quantized.out_features, quantized.in_features) != tuple(weight.shape):
            raise ValueError(
                f"the block copy of a weight must have its shape {list(weight.shape)}, "
                f"got {[quantized.out_features, quantized.in_features]}"
            )
        self.bias = bias
        self.packed = pack
        self.quantized = quantized
        self.quantized_max_rows = quantized_max_rows(weight.dtype)
        self.bf16_kernel = quantized is not None and bf16_kernel_applies(weight.dtype)
        # the packed copy replaces the plain one: keeping both would double the weights' memory
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None) if pack else weight
        self.plain = weight if pack and keep_plain else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.quantized is not None and rows <= self.quantized_max_rows:
            if self.bf16_kernel:
                if rows <= BF16_KERNEL_MAX_ROWS_ONE_THREAD or torch.get_num_threads() > 1:
                    bias = None if self.bias is None else self.bias.float()
                    x = x if x.stride(-1) == 1 else x.contiguous()
                    return block_kernel.quantized_linear_bf16(x, self.quantized, bias)
            elif x.dtype == torch.bfloat16:  # widened exactly, the weights rounded as the model's are, y rounded back
                bias = None if self.bias is None else self.bias.float()
                return block_kernel.quantized_linear(x.float(), self.quantized, bias, bf16_weights=True).bfloat16()
            else:
                return block_kernel.quantized_linear(x if x.stride(-1) == 1 else x.contiguous(), self.quantized,
                                                     self.bias)
        if self.plain is not None and rows >= PLAIN_MIN_ROWS:
            return F.linear(x, self.plain, self.bias)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def num_bytes(self) -> int:
        tensors = [t for t in (self.weight, self.plain, self.bias) if t is not None]
        blocks = 0 if self.quantized is None else self.quantized.num_bytes()
        return sum(t.numel() * t.element_size() for t in tensors) + blocks
